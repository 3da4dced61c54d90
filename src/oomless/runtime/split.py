"""Split chains of a model: each computed in slabs along its first spatial axis (`runtime.slabs`).

    apply_split(model, {"encoders.0": 8, "decoders.2": 8})
    remove_split(model)

A chain is a module whose ops can all run in slabs (`SlabGraph.of`): an ``nn.Sequential`` (nested
ones are looked through) of convolutions that keep the size along that axis, normalisations and
pointwise ops, such as a U-Net stage; a module whose forward torch.fx traces to such ops plus
upsampling transposed convolutions, concatenation along channels and addition, such as a U-Net
decoder stage (upsample, concatenate the skip, a stage) or a residual unit; a single convolution,
such as a segmentation head. Splitting is a transform
of the module in place, the way ``torch.distributed.fsdp.fully_shard`` transforms one: the module's
class becomes a subclass of it whose ``forward`` runs the chain in slabs, parameter names and hooks
stay as they are, and `remove_split` gives the module its class back. (Hooks cannot replace what a
forward computes, only add to it, so this one transform swaps the class, as FSDP2 does.)
Its child modules are not called while it is split: a chain is a plan block or lies inside one.
Under the plan's precision (bf16, fp16) a split chain computes each op in the dtype autocast gives
it (`runtime.slab_autocast`). With compile, a split chain runs eagerly: its slab engine (custom
autograd functions, a Python loop over slabs, saved-tensor hooks, rows kept in files) is nothing for
dynamo to trace, so `SplitChain.forward` is kept out of it (``torch.compiler.disable``). A block that
is a split chain is not compiled (`runtime.compile`); in a compiled block that holds one, dynamo
compiles the ops before and after the chain and runs the chain eagerly between them (a graph
break). For a target device splitting is refused (`check_split_composes`).
"""

import torch
import torch.nn as nn

from oomless.errors import ApplyError, InputError
from oomless.runtime.precision import autocast_dtype
from oomless.runtime.slab_autocast import check_slabs_run_in
from oomless.runtime.slabs import AXIS, SlabGraph, run_in_slabs
from oomless.runtime.stream import STATE_ATTRIBUTE as STREAM_STATE
from oomless.runtime.stream import STREAM, apply_stream, is_streamed, outer_level, outer_modules, remove_stream

DEFAULT_SLABS = 16   # as many as oneDNN's minimum thickness allows up to this (runtime/slabs.py)
STATE_ATTRIBUTE = "_oomless_split"


class SplitChain:
    """Mixed into a chain's class by `apply_split`: its forward computes the chain in slabs."""

    # Never traced: inside a compiled block, dynamo would otherwise inline the slab engine (or fail on
    # its Python); disabled, it graph-breaks around the chain, which runs eagerly (module docstring).
    @torch.compiler.disable(reason="oomless computes this chain in slabs, eagerly")
    def forward(self, *inputs, **keywords) -> torch.Tensor:
        slabs, graph, training = getattr(self, STATE_ATTRIBUTE)
        if training != self.training:
            # Traced in the other mode: Python in its forward that reads self.training ran as it was
            # then (a head that applies a sigmoid in eval mode only), so it is traced again.
            graph = _graph_of(self)
            if graph is None:
                raise InputError(f"{type(self).__name__} cannot be computed in slabs in "
                                 f"{'training' if self.training else 'eval'} mode (its forward is not a chain of "
                                 "slab ops then); remove the split (oomless.remove) to run it so")
            object.__setattr__(self, STATE_ATTRIBUTE, (slabs, graph, self.training))
        if (keywords or len(inputs) != len(graph.inputs)
                or not all(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > AXIS for x in inputs)):
            raise InputError(f"{type(self).__name__} is split into slabs along dimension {AXIS} and needs "
                             f"{len(graph.inputs)} floating-point tensor(s) (N, C, D, ...) as positional inputs; "
                             "remove the split (oomless.remove) to call it otherwise")
        return run_in_slabs(graph, inputs, slabs)


_split_classes: dict[type, type] = {}


def _split_class(cls: type) -> type:
    if cls not in _split_classes:
        _split_classes[cls] = type(f"Split{cls.__name__}", (SplitChain, cls), {"__module__": cls.__module__})
    return _split_classes[cls]


def _graph_of(module: nn.Module) -> SlabGraph | None:
    """The graph of a split ``module``'s own forward (its class's, not the split one's), as traced now."""
    split_class = type(module)
    module.__class__ = next(base for base in split_class.__bases__ if base is not SplitChain)
    try:
        return SlabGraph.of(module)
    finally:
        module.__class__ = split_class


def is_split(module: nn.Module) -> bool:
    return isinstance(module, SplitChain)


def inside(name: str, names) -> bool:
    return any(name == other or name.startswith(other + ".") or other.startswith(name + ".") for other in names)


def split_candidates(model: nn.Module) -> list[str]:
    """Qualified names of the largest chains in ``model`` that can run in slabs (never the model
    itself; none a streamed outer level runs)."""
    names, taken, outer = [], [], outer_modules(model)
    for name, module in model.named_modules():
        if module is model or any(name.startswith(other + ".") for other in taken) or inside(name, outer):
            continue
        if SlabGraph.of(module) is not None:
            names.append(name)
            taken.append(name)
    return names


def stream_candidate(model: nn.Module, blocks: list[str] | None = None):
    """The model's outer level as `runtime.stream` would stream it (`OuterLevel`), or why not (str).
    Its forward is traced down to the blocks and the chains (each called whole below the outer level,
    so that a chain can still be split and a block's hooks still fire)."""
    if blocks is None:
        from oomless.profile.blocks import find_blocks      # here: profile.blocks imports this module
        blocks = [name for name, _ in find_blocks(model)]
    return outer_level(model, set(blocks) | set(split_candidates(model)))


def stream_outer_modules(model: nn.Module, blocks: list[str] | None = None) -> set[str] | None:
    """The modules streaming would run itself, or None where the model's outer level cannot stream."""
    found = stream_candidate(model, blocks)
    return None if isinstance(found, str) else found.outer_modules


def apply_split(model: nn.Module, split: dict[str, int], blocks: list[str] | None = None) -> None:
    """Split each named chain into that many slabs, and with ``STREAM`` ("") stream the model's outer
    level (`runtime.stream`, its forward traced down to ``blocks``, default the block policy's); all
    or nothing (`ApplyError` names what is wrong)."""
    if STREAM in split:
        slabs = split[STREAM]
        if not isinstance(slabs, int) or slabs < 1:
            raise InputError(f"split= needs a whole number of slabs >= 1 per chain, got {{'': {slabs!r}}}")
        if not is_streamed(model):
            found = stream_candidate(model, blocks)
            if isinstance(found, str):
                raise ApplyError(f"split= names '' (the model's outer level streamed), but {found}")
            apply_stream(model, found, slabs)
        try:
            apply_split(model, {name: slabs for name, slabs in split.items() if name != STREAM})
        except Exception:
            remove_stream(model)
            raise
        return
    modules = dict(model.named_modules())
    candidates = set(split_candidates(model)) | {name for name, module in modules.items() if is_split(module)}
    wrong = [name for name in split if name not in candidates]
    if wrong:
        raise ApplyError(f"split= names {wrong[:5]} that are not chains this model can compute in slabs; "
                         f"the chains it has: {sorted(candidates)[:8]}")
    bad = {name: slabs for name, slabs in split.items() if not isinstance(slabs, int) or slabs < 1}
    if bad:
        raise InputError(f"split= needs a whole number of slabs >= 1 per chain, got {bad}")
    for name, slabs in split.items():
        module = modules[name]
        if is_split(module):
            continue
        # With the mode it was traced in: Python in a traced forward may read self.training.
        object.__setattr__(module, STATE_ATTRIBUTE, (slabs, SlabGraph.of(module), module.training))
        module.__class__ = _split_class(type(module))


def check_split_composes(target, precision: str, device: torch.device | None = None) -> None:
    """`InputError` for what splitting does not (yet) compose with, with what works instead. Under
    ``precision`` "bf16" or "fp16" the slabs run each op in the dtype autocast gives it
    (`runtime.slab_autocast`): refused only where this PyTorch build lacks a kernel for that on ``device``.
    Compile composes: split chains run eagerly, the other blocks compiled (module docstring)."""
    if target is not None:
        raise InputError("split= cannot be planned for a target device (its slabs' working memory is measured, "
                         "not estimated); plan for the target with split=False")
    dtype = autocast_dtype(precision)
    if dtype is not None and device is not None and device.type != "meta":
        check_slabs_run_in(device.type, precision, dtype)


def remove_split(model: nn.Module) -> None:
    """Every split chain of ``model`` back to its own class, and the outer level no longer streamed."""
    remove_stream(model)
    for module in model.modules():
        if is_split(module):
            module.__class__ = next(base for base in type(module).__bases__ if base is not SplitChain)
            object.__delattr__(module, STATE_ATTRIBUTE)


def split_names(model: nn.Module) -> dict[str, int]:
    """{name: slabs} of the chains split now."""
    names = {STREAM: outer_slabs(model)} if is_streamed(model) else {}
    names.update({name: getattr(module, STATE_ATTRIBUTE)[0] for name, module in model.named_modules() if is_split(module)})
    return names


def outer_slabs(model: nn.Module) -> int:
    return getattr(model, STREAM_STATE).slabs
