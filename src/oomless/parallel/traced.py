"""A model as users have it, cut into a `BlockSequence` by tracing it with ``torch.export`` (issue 14):
Hugging Face's GPT-2, MONAI's UNet or the project's own models become pipeline stages unmodified.

    sequence = traced_sequence(gpt2, (tokens,), output="logits")   # HF returns a ModelOutput: name the tensor
    sequence.origin                              # "traced with torch.export"
    [block.name for block in sequence.blocks]    # transformer_wte, transformer_wpe, ..., transformer_h_0, ..., lm_head
    PipelineParallel(sequence, cuts, ...)        # cuts by hand, or from oomless.plan.partition

How. ``torch.export.export(strict=False)`` runs the forward once on fake tensors, with the batch
dimension symbolic (micro-batches of any size run), and records its ATen ops in call order, each
tagged with the module calls it ran inside (``nn_module_stack``). `candidate_blocks` picks the modules
whose calls become blocks; the ops of one call form a block, and code between blocks (a U-Net's
concatenation, GPT-2's embedding sum) joins the block after it (`oomless.parallel.traced_graph` cuts
the graph). Each block is a ``torch.fx.GraphModule``
of its ops that reads the model's own parameters and buffers (the same tensors: training the sequence
trains the model, BatchNorm's running statistics move in the model's buffers) and calls torch.nn's
leaf modules (Linear, Conv, BatchNorm, ...) as modules, so their hooks run and a BatchNorm swapped
later (`rebuilt`) is the one called. A pipeline sends tensors only: sizes and tensors computed from
sizes alone (positions, causal masks) are computed again in each block that reads them instead of
crossing a cut. The graph's ops are the ones eager PyTorch runs, so the sequence computes the model's
function bit for bit (tests/test_traced_pipeline.py).

Limits (each an `InputError` saying so): the forward must trace with torch.export, so no Python
branch on a tensor's values (``if x.sum() > 0``; ``torch.cond`` traces) and no output shape that
depends on values; positional tensor inputs only; the sequence is the model in the mode it was
traced in (dropout on or off, BatchNorm on batch or running statistics are recorded in the graph):
run in the other mode, it refuses.
"""

from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn
from torch.fx import Graph, GraphModule

from oomless.errors import InputError, one_line
from oomless.parallel.block_sequence import Block, BlockSequence
from oomless.parallel.traced_graph import TracedGraph, is_torch_leaf, submodule
from oomless.profile.blocks import children_as_blocks, find_blocks

TRACED = "traced with torch.export"
# A module holding more than this share of the model's parameters is split into its children when
# choosing blocks: small enough that the partitioner has cuts to choose from, large enough that a
# transformer layer stays one block.
SPLIT_SHARE = 1 / 8
_MODEL = "model"        # the user's model inside `_Selected`: every traced name starts with it


class _Selected(nn.Module):
    """The model with its output narrowed to the tensor the loss reads (``output``: a key or
    attribute of a dict / ModelOutput, an index, or a callable); owns nothing but the model."""

    def __init__(self, model: nn.Module, output):
        super().__init__()
        self.model, self.select = model, output

    def forward(self, *inputs):
        held = _tensors_held(self.model)
        result = self.model(*inputs)
        replaced = [name for name, tensor in _tensors_held(self.model).items() if held.get(name) is not tensor]
        if replaced:
            raise InputError(f"{type(self.model).__name__}'s forward assigns a new tensor to {replaced[0]} "
                             f"(self.{replaced[0].rpartition('.')[2]} = ...): a traced sequence replays the ops on the "
                             "model's own tensors and cannot replay an assignment; update it in place instead "
                             f"(with torch.no_grad(): self.{replaced[0].rpartition('.')[2]}.copy_(...)), or write the "
                             "model as a BlockSequence")
        if self.select is None:
            chosen = result
        elif callable(self.select):
            chosen = self.select(result)
        elif isinstance(result, Mapping):
            chosen = result.get(self.select)
        elif isinstance(self.select, str):
            chosen = getattr(result, self.select, None)
        else:
            chosen = result[self.select] if -len(result) <= self.select < len(result) else None
        if not isinstance(chosen, torch.Tensor):
            keys = list(result.keys()) if isinstance(result, Mapping) else type(result).__name__
            raise InputError(f"{type(self.model).__name__} returns {keys}, not one tensor; give output= the key, "
                             "attribute or index of the tensor the loss reads (e.g. output='logits'), or a callable")
        return chosen


def _tensors_held(model: nn.Module) -> dict[str, torch.Tensor]:
    """{qualified name: tensor} of every parameter and buffer, under each name a module has."""
    return {f"{path}.{name}".lstrip("."): tensor for path, module in model.named_modules(remove_duplicate=False)
            for table in (module._parameters, module._buffers) for name, tensor in table.items()}


class TracedSequence(BlockSequence):
    """A `BlockSequence` whose blocks are slices of a traced graph (module docstring)."""

    origin = TRACED

    def __init__(self, blocks: list[Block], inputs: tuple[str, ...], graphs: list[Graph], root: _Selected,
                 modes: dict[str, bool]):
        super().__init__(blocks, inputs, "output")
        # Not registered as submodules: the root holds the whole model (its parameters are the
        # blocks'), and the graphs are the recipes `rebuilt` builds from.
        self.__dict__.update(_root=root, _graphs=graphs, _modes=modes)

    def rebuilt(self) -> "TracedSequence":
        """The same blocks built again on the model's current modules, without tracing again: after
        a BatchNorm was swapped for one whose statistics span several processes."""
        blocks = [Block(block.name, _graph_module(self._root, graph, block.name, self._modes), block.inputs,
                        block.outputs) for block, graph in zip(self.blocks, self._graphs)]
        return TracedSequence(blocks, self.inputs, self._graphs, self._root, self._modes)


def traced_sequence(model: nn.Module, example_inputs, output=None, blocks=None) -> TracedSequence:
    """``model`` as a `BlockSequence`, by tracing its forward on ``example_inputs`` (a tensor or a
    tuple of positional tensors; dimension 0 is the batch). ``output`` picks the tensor the loss
    reads where the forward returns several (``"logits"`` for Hugging Face models); ``blocks``
    (module types or qualified names, as `oomless.profile` takes them) overrides `candidate_blocks`."""
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not inputs or not all(isinstance(tensor, torch.Tensor) for tensor in inputs):
        raise InputError("traced_sequence takes the forward's positional inputs as a tensor or a tuple of tensors; "
                         "wrap a model taking keyword or non-tensor inputs in a module that supplies them")
    root = _Selected(model, output)
    root.training = model.training              # the flag alone: train() would reach into the model
    modes = {path: module.training for path, module in root.named_modules()}
    program, called_otherwise = _export(root, inputs)
    trace = TracedGraph(program, root, called_otherwise)
    names = candidate_blocks(model) if blocks is None else [name for name, _ in find_blocks(model, blocks)]
    segments = trace.segments({f"{_MODEL}.{name}" for name in names})
    built = trace.block_graphs(segments)
    sequence_blocks = [Block(name, _graph_module(root, graph, name, modes), reads, writes)
                       for name, (graph, reads, writes) in zip(_block_names(segments), built)]
    return TracedSequence(sequence_blocks, trace.input_names, [graph for graph, _, _ in built], root, modes)


class _Warm(nn.Module):
    """Two convolutions, a BatchNorm and a residual: not a `nn.Sequential`, so it is traced."""

    def __init__(self):
        super().__init__()
        self.first, self.norm, self.last = nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2), nn.Conv3d(2, 1, 1)

    def forward(self, x):
        return self.last(torch.relu(self.norm(self.first(x)))) + x


def warm_up_tracing() -> None:
    """Trace a tiny model once. torch.export's first trace in a process loads its machinery (its
    lazy imports, sympy's caches): on the CPU machine a tiny model's trace left 30.2 MiB resident, the
    MONAI UNet's after it 4.1 (32 MiB alone). A run counting its memory from after start-up (the
    trainer's) calls this first, so that its budget counts the model's trace, not the library's.
    Leaves the CPU random stream as it found it."""
    with torch.random.fork_rng(devices=[]):    # the caller's random stream as it was
        traced_sequence(_Warm(), (torch.randn(2, 1, 4, 4, 4),))


def candidate_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules whose calls become blocks, in registration order: from the
    model down, the module with the most parameters is replaced by its children (through
    containers) while it holds more than `SPLIT_SHARE` of them. A repeated submodule stays whole:
    a layer of a stack of identical layers (GPT-2's ``transformer.h.<i>``) or a module whose class
    occurs elsewhere in the model too (MONAI's ``ResidualUnit``), unless it nests one of its own
    class (MONAI's outer ``SkipConnection`` holds the inner ones)."""
    total = _parameter_count(model)
    layers = {id(layer) for stack in model.modules() if _is_layer_stack(stack) for layer in stack}
    classes = Counter(type(module) for module in model.modules())

    def splittable(module: nn.Module) -> bool:
        if next(module.children(), None) is None or id(module) in layers:
            return False
        nests_its_class = any(isinstance(inner, type(module)) for inner in list(module.modules())[1:])
        return classes[type(module)] == 1 or nests_its_class

    frontier = [("", model)]
    while True:
        candidates = [index for index, (_, module) in enumerate(frontier) if splittable(module)]
        if not candidates:
            break
        index = max(candidates, key=lambda index: _parameter_count(frontier[index][1]))
        name, module = frontier[index]
        if name and _parameter_count(module) <= SPLIT_SHARE * total:
            break
        frontier[index:index + 1] = children_as_blocks(name, module)
    return [name for name, _ in frontier if name]


def _parameter_count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _is_layer_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    return len({(type(layer), tuple((name, tuple(parameter.shape)) for name, parameter in layer.named_parameters()))
                for layer in module}) == 1


def _export(root: _Selected, inputs: tuple[torch.Tensor, ...]):
    """(the exported program, the ids of torch.nn leaf modules called other than on one tensor
    giving one): those are replayed as their ATen ops, not as module calls (`TracedGraph`)."""
    from torch.export import Dim, ShapesCollection

    # A batch of one would be specialised (torch.export's 0/1 rule) and the blocks would run no
    # other batch size: the trace runs on two copies of the example instead (fake tensors: no cost).
    inputs = tuple(torch.cat([tensor, tensor]) if tensor.dim() and tensor.shape[0] == 1 else tensor
                   for tensor in inputs)
    shapes = ShapesCollection()
    for tensor in inputs:
        if tensor.dim():
            shapes[tensor] = {0: Dim.AUTO}
    called_otherwise: set[int] = set()

    def check_arguments(module, args, kwargs):
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            called_otherwise.add(id(module))

    def check_output(module, args, output):
        if not isinstance(output, torch.Tensor):
            called_otherwise.add(id(module))

    handles = []
    for module in root.modules():
        if is_torch_leaf(module):
            handles += [module.register_forward_pre_hook(check_arguments, with_kwargs=True),
                        module.register_forward_hook(check_output)]
    try:
        program = torch.export.export(root, inputs, strict=False, dynamic_shapes=shapes)
    except InputError:
        raise
    except Exception as error:
        data_dependent = "data-dependent" in str(error) or "GuardOnDataDependent" in type(error).__name__
        why = ("its forward branches on a tensor's values (data-dependent control flow), which a trace cannot "
               "follow; torch.cond can express such a branch" if data_dependent else "see torch's error")
        raise InputError(f"torch.export cannot trace {type(root.model).__name__}: {why}: {one_line(error)}. "
                         "Write the model as a BlockSequence instead (oomless.parallel.block_sequence.Block: name, "
                         "module, tensors read, tensors written) or trace a module without that code") from error
    finally:
        for handle in handles:
            handle.remove()
    _check_batch_symbolic(program, root)
    return program, called_otherwise


def _check_batch_symbolic(program, root: _Selected) -> None:
    """A pipeline runs micro-batches of any size: refuse a trace whose batch dimension the forward fixed."""
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(value, torch.Tensor) or not value.dim():
            continue
        spec = next((spec for spec in program.graph_signature.input_specs if spec.arg.name == node.name), None)
        batch = value.shape[0]         # a SymInt even where specialised: then its expression is a number
        if spec is not None and spec.kind.name == "USER_INPUT" and (not isinstance(batch, torch.SymInt)
                                                                    or batch.node.expr.is_number):
            raise InputError(f"{type(root.model).__name__}'s forward fixes the batch size (dimension 0 of input "
                             f"{node.name}) at {batch}: torch.export found code that takes it as a constant "
                             "(x.view(8, -1), a tensor made with a fixed batch), so its blocks could not run "
                             "micro-batches of another size; read it off the input (x.view(x.shape[0], -1)) or "
                             "write the model as a BlockSequence")


def _block_names(segments: list) -> list[str]:
    """Identifiers from the blocks' module names (``transformer.h.0`` -> ``transformer_h_0``), numbered
    where one module's calls give several blocks."""
    bases = [path.removeprefix(_MODEL).lstrip(".").replace(".", "_") or "forward" for path, _ in segments]
    return [base if bases.count(base) == 1 else f"{base}_{bases[:index].count(base)}"
            for index, base in enumerate(bases)]


def _graph_module(root: _Selected, graph: Graph, name: str, modes: dict[str, bool]) -> GraphModule:
    """One block: ``graph`` over ``root``'s own parameters, buffers and leaf modules (GraphModule
    reaches them by qualified name and keeps the objects), refusing to run in another mode than
    the one traced (``modes``: every module's ``training`` then, by qualified name under ``root``)."""
    copied = Graph()
    copied.output(copied.graph_copy(graph, {}))
    module = GraphModule(root, copied, class_name=f"Traced_{name}")
    module.training = modes[""]         # its own flag only: its leaves are the model's modules

    # The model's own modules in the block (its leaves), with the mode each was traced in.
    leaves = [(path, leaf) for path, leaf in module.named_modules() if path and submodule(root, path) is leaf]

    def check_mode(block, args):
        changed = [path for path, leaf in leaves if leaf.training != modes.get(path, leaf.training)]
        if block.training != modes[""] or root.model.training != modes[_MODEL] or changed:
            traced = "training" if modes[_MODEL] else "eval"
            moved = f", but {changed[0].removeprefix(_MODEL + '.')} changed mode" if changed else ""
            raise InputError(f"block {name} was traced with the model in {traced} mode (dropout and BatchNorm run "
                             f"as in that mode are in its graph){moved}; trace the model again in the mode you "
                             "run it in")

    module.register_forward_pre_hook(check_mode)
    return module
