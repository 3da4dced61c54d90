"""A model written as a sequence of blocks that read and write named tensors, so that it can be cut
anywhere: whatever a later block still needs (a U-Net's skips, a pass-through input) crosses the cut
as one more stage output / input (issue 5). The whole sequence is an ``nn.Module`` that computes the
same function as the model it was made from, sharing its parameters (nothing is copied).

    sequence = transformer_sequence(TinyTransformer(depth=4))      # embed, block0..block3, head
    sequence.crossing(2)            # ("x",): the tensors alive between blocks 1 and 2
    stage = sequence.stage(2, 4)    # an nn.Module: forward(*crossing(2)) -> crossing(4) tensors

A name written again (``x`` after every transformer block) is a new value; what crosses a cut is the
value live there.
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn

from oomless.errors import InputError


@dataclass(frozen=True)
class Block:
    name: str                       # a plain identifier: the key of its module in the sequence
    module: nn.Module
    inputs: tuple[str, ...]         # names of the tensors it reads, in its forward's argument order
    outputs: tuple[str, ...]        # names of the tensors it returns, in order (one: a bare tensor)


def _run(blocks, values: dict, modules: nn.ModuleDict) -> dict:
    for block in blocks:
        produced = modules[block.name](*(values[name] for name in block.inputs))
        produced = produced if isinstance(produced, tuple) else (produced,)
        if len(produced) != len(block.outputs):
            raise InputError(f"block {block.name} returned {len(produced)} tensors for outputs {block.outputs}")
        values.update(zip(block.outputs, produced))
    return values


class BlockSequence(nn.Module):
    """``blocks`` run in order over named tensors; ``forward(*inputs)`` returns the tensor ``output``.
    ``origin`` says how the sequence was made (written by hand here; `oomless.parallel.traced`'s say traced)."""

    origin = "block sequence"

    def __init__(self, blocks: list[Block], inputs: tuple[str, ...] = ("input",), output: str = "output"):
        super().__init__()
        names = [block.name for block in blocks]
        if len(set(names)) != len(names) or any("." in name or not name for name in names):
            raise InputError(f"block names must be distinct identifiers without dots, got {names}")
        self.blocks, self.inputs, self.output = list(blocks), tuple(inputs), output
        self.steps = nn.ModuleDict({block.name: block.module for block in blocks})
        self.crossing(len(blocks))     # every read has a writer before it

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return _run(self.blocks, dict(zip(self.inputs, tensors)), self.steps)[self.output]

    def crossing(self, cut: int) -> tuple[str, ...]:
        """Names of the tensors that blocks[cut:] (and the final output) read before writing them,
        in the order they were first written: what must cross a cut in front of block ``cut``."""
        needed, written = [], set()
        for block in self.blocks[cut:]:
            needed += [name for name in block.inputs if name not in written and name not in needed]
            written.update(block.outputs)
        if self.output not in written and self.output not in needed:
            needed.append(self.output)
        order = list(self.inputs) + [name for block in self.blocks[:cut] for name in block.outputs]
        missing = [name for name in needed if name not in order]
        if missing:
            raise InputError(f"blocks from {cut} read {missing}, which no earlier block writes and no input gives")
        return tuple(sorted(needed, key=order.index))

    def stage(self, start: int, stop: int) -> "SequenceStage":
        """Blocks [start, stop) as one module: takes ``crossing(start)``, returns ``crossing(stop)``."""
        if not 0 <= start < stop <= len(self.blocks):
            raise InputError(f"stage [{start}, {stop}) is not a non-empty range of {len(self.blocks)} blocks")
        return SequenceStage(self.blocks[start:stop], self.crossing(start), self.crossing(stop))

    def index(self, name: str) -> int:
        return [block.name for block in self.blocks].index(name)


class SequenceStage(nn.Module):
    """A contiguous run of a `BlockSequence`'s blocks (the module a `PipelineStage` wraps); its
    parameters are the sequence's own, under ``steps.<block name>.``."""

    def __init__(self, blocks: list[Block], inputs: tuple[str, ...], outputs: tuple[str, ...]):
        super().__init__()
        self.blocks, self.inputs, self.outputs = list(blocks), inputs, outputs
        self.steps = nn.ModuleDict({block.name: block.module for block in blocks})

    def forward(self, *tensors: torch.Tensor):
        tensors = tuple(_ContiguousGradient.apply(tensor) if tensor.requires_grad else tensor for tensor in tensors)
        values = _run(self.blocks, dict(zip(self.inputs, tensors)), self.steps)
        produced = tuple(_sendable(values[name]) for name in self.outputs)
        return produced[0] if len(produced) == 1 else produced


def _sendable(tensor: torch.Tensor) -> torch.Tensor:
    """A stage output as a pipeline can send it: contiguous (point-to-point sends need contiguous
    buffers; the receiver allocates the gradient buffer with the sent tensor's strides), and not a
    view (a split backward detaches stage outputs in place, which views refuse). The copy is made
    only where needed: a linear layer's 3-D output is a view of its 2-D product; a skip passing
    through a stage is a view of its input."""
    tensor = tensor.contiguous()
    return tensor.clone() if tensor._base is not None else tensor


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of a stage input goes
    back to the previous stage by a point-to-point send, which needs a contiguous tensor, and the
    gradient of a skip that went through ``torch.cat`` is a strided slice."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        return gradient.contiguous()


class _TransformerEmbedding(nn.Module):
    """TinyTransformer's token + position embedding and dropout, on the model's own modules."""

    def __init__(self, model):
        super().__init__()
        self.token_embedding, self.position_embedding, self.dropout = (
            model.token_embedding, model.position_embedding, model.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))


def transformer_sequence(model) -> BlockSequence:
    """`oomless.models.TinyTransformer` as embed, block0 .. block{depth-1}, head (ln_f + tied head)."""
    blocks = [Block("embed", _TransformerEmbedding(model), ("input",), ("x",))]
    blocks += [Block(f"block{index}", block, ("x",), ("x",)) for index, block in enumerate(model.blocks)]
    blocks.append(Block("head", nn.Sequential(model.ln_f, model.head), ("x",), ("output",)))
    return BlockSequence(blocks)


def unet_sequence(model) -> BlockSequence:
    """`oomless.models.UNet3D` as encoder/pool pairs, the bottleneck, decoders and the head; each
    encoder's output is a named skip that the matching decoder reads, so a cut between them carries it.
    The model's one pooling module (no parameters, no state) is copied per level, so every block is
    its own module and a profile of the sequence sees each pool once per position."""
    blocks, previous = [], "input"
    for level, encoder in enumerate(model.encoders[:-1]):
        blocks.append(Block(f"encoder{level}", encoder, (previous,), (f"skip{level}",)))
        blocks.append(Block(f"pool{level}", copy.deepcopy(model.pool), (f"skip{level}",), ("x",)))
        previous = "x"
    blocks.append(Block("bottleneck", model.encoders[-1], ("x",), ("x",)))
    for index, decoder in enumerate(model.decoders):
        blocks.append(Block(f"decoder{index}", decoder, ("x", f"skip{model.depth - 1 - index}"), ("x",)))
    blocks.append(Block("head", model.head, ("x",), ("output",)))
    return BlockSequence(blocks)


def sequential_sequence(model: nn.Sequential) -> BlockSequence:
    """An ``nn.Sequential`` as one block per child, each reading and writing ``x``."""
    blocks = [Block(f"layer{name}", child, ("x",), ("x",)) for name, child in model.named_children()]
    first, last = blocks[0], blocks[-1]
    blocks[0] = Block(first.name, first.module, ("input",), first.outputs)
    blocks[-1] = Block(last.name, last.module, last.inputs, ("output",))
    return BlockSequence(blocks)


def has_hand_written_sequence(model: nn.Module) -> bool:
    """Whether `sequence_for` cuts ``model`` by hand (else it traces it)."""
    from oomless.models import TinyTransformer, UNet3D

    return isinstance(model, (BlockSequence, UNet3D, TinyTransformer)) or (
        isinstance(model, nn.Sequential) and len(model) >= 2)


def sequence_for(model: nn.Module, example=None, output=None) -> BlockSequence:
    """The `BlockSequence` of a model: written by hand for `UNet3D`, `TinyTransformer` and any
    ``nn.Sequential`` of two or more children (a `BlockSequence` is itself); any other model is
    traced with torch.export on ``example`` (its positional input tensors), ``output`` naming the
    tensor the loss reads where the forward returns several (`oomless.parallel.traced`).
    ``sequence.origin`` says which path made it."""
    from oomless.models import TinyTransformer, UNet3D

    if isinstance(model, BlockSequence):
        return model
    if isinstance(model, UNet3D):
        return unet_sequence(model)
    if isinstance(model, TinyTransformer):
        return transformer_sequence(model)
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return sequential_sequence(model)
    if example is None:
        raise InputError(f"oomless has no hand-written cut of a {type(model).__name__} and no example input to trace "
                         "it with torch.export; give one (sequence_for(model, example)), or write the model as a "
                         "BlockSequence (oomless.parallel.block_sequence.Block: name, module, tensors read, tensors "
                         "written)")
    from oomless.parallel.traced import traced_sequence

    return traced_sequence(model, example, output=output)


def pipeline_block_groups(model: nn.Module, names: list[str]) -> list[tuple[str, list[int]]] | None:
    """The model's blocks named ``names`` (a profile's, in the order they ran) grouped into the
    blocks of its hand-written `BlockSequence` (the only places a pipeline cuts it): [(sequence
    block name, indices into ``names``)], in order. A block that is none of the sequence's (the
    U-Net's one pooling module, copied per level in the sequence) joins the group before it. None
    for a model without a hand-written sequence (`sequence_for` would trace it)."""
    if not has_hand_written_sequence(model):
        return None
    owner = {}
    for block in sequence_for(model).blocks:
        for module in block.module.modules():
            owner.setdefault(id(module), block.name)
    groups: list[tuple[str, list[int]]] = []
    for index, name in enumerate(names):
        group = owner.get(id(model.get_submodule(name)))
        if groups and (group is None or group == groups[-1][0] or any(group == seen for seen, _ in groups)):
            groups[-1][1].append(index)     # stays contiguous: a block out of place joins the one before
        else:
            groups.append((group or name, [index]))
    return groups
