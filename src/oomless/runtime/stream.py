"""The outer level of a U-shaped model streamed in slabs: none of its full-resolution tensors whole.

Splitting stages (`runtime.split`) leaves each stage's inputs, output and their gradients whole. At
the outer level of a 3D U-Net those are what sets the floor: the skip tensor and its gradient, the
last decoder stage's input, output and gradients, the head's. Streamed, the model's forward becomes

    downsampled = encode(x)                 # the outer encoder ops and the first downsampling, in slabs
    inner = inner_level(downsampled)        # everything below the outer level, as the model runs it
    output = decode(x, inner)               # the skip, the first upsampling and everything after
                                            # it at full resolution, in slabs

`encode` and `decode` are `SlabGraph`s run by `run_in_slabs`: each saves only its inputs (the
model's input and the inner level's output, a fraction of the volume) and computes its ops slab by
slab in forward and backward. `encode` keeps its normalisations' inputs and statistics off the
device (`runtime.rows`, `SharedNodes`); `decode` reads the skip's from them, computing per slab only
the ops after the last kept one, so neither the skip nor its gradient ever exists whole. In
backward, `decode` runs first: the gradients it gives the outer encoder's kept nodes (through the
skip) are kept beside them, and `encode`'s backward takes them back with its own (through the
downsampling), so each outer encoder op runs once forward and once backward per slab in backward,
as under checkpointing. (Where `encode`'s backward will not run, e.g. the inner level's output
detached, `decode` takes them back itself.) BatchNorm's running statistics move once, in `encode`.

The model's forward is traced with torch.fx down to its blocks (the units oomless plans; they run
as the model runs them, hooks and all, inside `inner_level`) and to torch's own modules outside
them. A model streams when its trace has one input, exactly one downsampling (a pooling whose
windows do not overlap) out of the input's resolution and one upsampling back into it, and nothing
but slab ops (`runtime.slabs`) at that resolution; functions called for their checks only (their
result unused, e.g. an input-shape check wrapped with ``torch.fx.wrap``) run first on the input.
Streaming is a transform of the model in place, like `runtime.split`: the model's class becomes a
subclass running the three parts, and `remove_stream` gives it back.
"""

from dataclasses import dataclass, replace

import torch
import torch.fx
import torch.nn as nn

from oomless.errors import InputError
from oomless.runtime.slabs import SharedNodes, SlabGraph, _Node, fx_node, run_in_slabs, writes_into_a_shared_value

STREAM = ""                         # split={"": slabs} streams the model's outer level
STATE_ATTRIBUTE = "_oomless_stream"


class _BlockTracer(torch.fx.Tracer):
    """Traces into everything but torch's own modules and the given modules (the model's blocks)."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.leaves or super().is_leaf_module(module, qualified_name)


@dataclass
class OuterLevel:
    """The three parts of a streamed model's forward (see the module docstring)."""

    encode: SlabGraph
    decode: SlabGraph
    inner: torch.fx.GraphModule
    checks: list                    # (function, args with None for the input, kwargs) run on the input first
    outer_modules: set[str]         # modules only the outer level runs: not called as modules while streamed
    slabs: int = 16
    training: bool = True           # the model's mode when traced (Python in its forward may read it)
    blocks: set[str] = None         # what the forward was traced down to


@dataclass
class _Op:
    """One traced node with what the analysis knows of it."""

    node: torch.fx.Node
    nodes: list[_Node] | None        # its slab ops (inputs numbered as local: -1 - i is its argument i); None: opaque
    arguments: list[torch.fx.Node]   # the traced nodes its tensor inputs come from, in order
    level: int = 0                   # 0: the input's resolution; k: after k downsamplings


def _ops_of(node: torch.fx.Node, root: nn.Module) -> tuple[list[_Node] | None, list[torch.fx.Node]]:
    """The slab ops one traced node runs (a module of the model's own a graph of them), and its inputs."""
    arguments = list(node.all_input_nodes)
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if list(module.children()):
            graph = SlabGraph.of(module)
            if graph is None or node.kwargs or list(node.args) != arguments or len(arguments) != len(graph.inputs):
                return None, arguments
            local = {index: -1 - position for position, index in enumerate(graph.inputs)}
            ops = []
            for index, op in enumerate(graph.nodes):
                if op.kind == "input":
                    continue
                local[index] = len(ops)
                ops.append(replace(op, inputs=tuple(local[source] for source in op.inputs)))
            # The graph's output last: a graph whose output is not its last op is taken as opaque.
            return (ops if local[graph.output] == len(ops) - 1 else None), arguments
    index = {argument: -1 - position for position, argument in enumerate(arguments)}
    op = fx_node(node, root, index, downsampling=True)
    return (None if op is None else [op]), arguments


def _level(ops: list[_Node] | None, levels: list[int]) -> int | None:
    """The output level of slab ops given their arguments' levels; None where their levels disagree."""
    if ops is None:
        return min(levels) if levels and min(levels) >= 1 else None   # opaque: only below the outer level
    known: list[int] = []

    def level_of(source: int) -> int:
        return levels[-1 - source] if source < 0 else known[source]

    for op in ops:
        incoming = {level_of(source) for source in op.inputs}
        if len(incoming) != 1:
            return None
        (level,) = incoming
        known.append(level + 1 if op.kind == "down" else level - 1 if op.kind == "up" else level)
    return known[-1]


def _trace(model: nn.Module, blocks: set[str]) -> torch.fx.Graph | str:
    """The model's forward (its own class's, when streamed already) traced down to ``blocks``; the
    model's state left as it was (a forward that stores values on the model, e.g. features for a
    second loss, is refused: streamed, it would store nothing)."""
    before = [(module, dict(module.__dict__), {name: list(value) for name, value in module.__dict__.items()
                                               if isinstance(value, list)})
              for module in model.modules()]
    streamed_class = type(model) if is_streamed(model) else None
    if streamed_class is not None:
        model.__class__ = _unstreamed_class(model)
    try:
        traced = _BlockTracer(blocks).trace(model)
    except Exception as error:       # any Python the tracer cannot follow
        traced = f"torch.fx cannot trace its forward ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    finally:
        if streamed_class is not None:
            model.__class__ = streamed_class
    changed = False
    for module, attributes, lists in before:
        now = module.__dict__
        if (now.keys() != attributes.keys() or any(now[name] is not value for name, value in attributes.items())
                or any(len(now[name]) != len(items) or any(a is not b for a, b in zip(now[name], items))
                       for name, items in lists.items())):
            changed = True
            now.clear()
            now.update(attributes)
            for name, items in lists.items():
                attributes[name][:] = items
    return "its forward stores values on the model" if changed else traced


def _unstreamed_class(model: nn.Module) -> type:
    return next(base for base in type(model).__bases__ if base is not StreamedModel)


def _hooked(module: nn.Module) -> bool:
    return any(getattr(module, name) for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                  "_backward_pre_hooks"))


def outer_level(model: nn.Module, blocks: set[str], slabs: int = 16) -> OuterLevel | str:
    """The model's forward cut into the three parts, or why it cannot be streamed."""
    traced = _trace(model, blocks)
    if isinstance(traced, str):
        return traced
    try:
        return _cut(model, traced, blocks, slabs)
    except Exception as error:     # a shape of model the analysis does not know: not streamed, and why
        return f"its traced forward could not be cut into levels ({type(error).__name__}: {error})"


def _cut(model: nn.Module, traced: torch.fx.Graph, blocks: set[str], slabs: int) -> OuterLevel | str:
    ops: dict[torch.fx.Node, _Op] = {}
    placeholders, checks, output = [], [], None
    for node in traced.nodes:
        if node.op == "placeholder":
            placeholders.append(node)
            ops[node] = _Op(node, [], [], 0)
        elif node.op == "output":
            output = node.args[0]
        elif node.op == "call_function" and not node.users:
            if any(argument not in placeholders for argument in node.all_input_nodes):
                return f"{node.target.__name__} is called for its effect on values other than the input"
            checks.append(node)
        elif node.op == "get_attr":
            return f"it reads {node.target} directly"
        else:
            slab_ops, arguments = _ops_of(node, model)
            level = _level(slab_ops, [ops[argument].level for argument in arguments])
            if level is None or level < 0:
                return f"{node.target if node.op != 'call_function' else node.target.__name__} mixes resolutions, " \
                       "goes above the input's, or is not a slab op at the input's resolution"
            ops[node] = _Op(node, slab_ops, arguments, level)
    if len(placeholders) != 1 or not isinstance(output, torch.fx.Node):
        return "its forward takes more than one input or returns more than one tensor"
    if any(op.nodes and op.nodes[0].inplace and len(op.arguments[0].users) > 1 for op in ops.values()):
        return "an in-place op writes into a tensor another op reads (the order of ops matters)"
    (source,) = placeholders
    downs = [op for op in ops.values() if op.level == 1 and op.arguments and all(ops[a].level == 0 for a in op.arguments)]
    rises = [op for op in ops.values() if op.level == 0 and any(ops[a].level >= 1 for a in op.arguments)]
    if len(downs) != 1 or len(rises) != 1:
        return (f"it leaves the input's resolution {len(downs)} times and comes back {len(rises)} times "
                "(streaming needs one of each)")
    (down,), (rise,) = downs, rises
    after_rise = _descendants(rise.node)
    outer = [op for node, op in ops.items() if op.level == 0 and node is not source]
    decoder = [op for op in outer if op.node in after_rise]
    encoder = [op for op in outer if op.node not in after_rise]
    inner = [op for node, op in ops.items() if op.level >= 1 and op is not down]
    if output not in after_rise:
        return "its output is not computed after the upsampling back to the input's resolution"
    inner_nodes = {op.node for op in inner} | {down.node}
    if any(argument not in inner_nodes for op in inner for argument in op.arguments):
        return "an op below the outer level reads a tensor of the outer level other than the downsampling's"
    from_below = [argument for argument in rise.arguments if ops[argument].level >= 1]
    if len(from_below) != 1:
        return "the upsampling back to the input's resolution takes more than one tensor from below"
    (inner_output,) = from_below
    outer_nodes = {op.node for op in outer} | {source}
    feeds_down = _ancestors(down.node, outer_nodes)
    needed = set().union(*(_ancestors(op.node, outer_nodes) for op in decoder)) | {op.node for op in decoder}
    unused = [op for op in encoder if op.node not in feeds_down and op.node not in needed]
    if unused:
        return f"{unused[0].node.target} runs at the input's resolution but neither the output nor the pooling uses it"
    modules = dict(model.named_modules())
    outer_modules = ({str(op.node.target) for op in outer + [down] if op.node.op == "call_module"}
                     - {str(op.node.target) for op in inner if op.node.op == "call_module"})
    # User hooks on a module only the outer level runs would never fire (its ops run in slabs, not
    # through the module). A module also called below (the pooling) keeps its hooks there.
    hooked = [name for name in sorted(outer_modules) if any(_hooked(module) for module in modules[name].modules())]
    if hooked or any(getattr(nn.modules.module, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")):
        return f"hooks are registered on {hooked[0] if hooked else 'every module'}, and the outer level runs its ops itself"

    encode = _graph([source], encoder + [down], feeds_down, down.node, ops)
    # The outer encoder's normalisations that also feed the pooling move their running statistics in
    # `encode`; computed again for the decoder, they leave them alone.
    decode = _graph([source, inner_output], encoder + decoder, needed, output, ops, recomputed=feeds_down)
    if encode is None or decode is None:
        return "an in-place op at the input's resolution writes into a tensor another op reads"
    graph = torch.fx.Graph()
    values = {down.node: graph.placeholder("downsampled")}
    for op in inner:
        values[op.node] = graph.node_copy(op.node, lambda argument: values[argument])
    graph.output(values[inner_output])
    inner_module = torch.fx.GraphModule(model, graph, class_name="InnerLevel")
    return OuterLevel(encode, decode, inner_module, checks, outer_modules, slabs, model.training, set(blocks))


def _ancestors(node: torch.fx.Node, within: set[torch.fx.Node] | None = None) -> set[torch.fx.Node]:
    """The nodes ``node`` is computed from (only through nodes ``within``, where given)."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen and (within is None or current in within):
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _descendants(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = {node}, list(node.users)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.users)
    return seen


def _graph(inputs: list[torch.fx.Node], members: list[_Op], wanted: set[torch.fx.Node], output: torch.fx.Node,
           ops: dict, recomputed: set[torch.fx.Node] = frozenset()) -> SlabGraph | None:
    """A SlabGraph of the ``members`` that ``output`` needs (``wanted``, in trace order), reading
    ``inputs``; normalisations of the ``recomputed`` ops leave running statistics alone."""
    nodes = [_Node("input") for _ in inputs]
    at = {node: index for index, node in enumerate(inputs)}
    for op in members:
        if op.node not in wanted and op.node is not output:
            continue
        first = len(nodes)
        for position, slab_op in enumerate(op.nodes):
            mapped = tuple(at[op.arguments[-1 - source]] if source < 0 else first + source for source in slab_op.inputs)
            # The key names the op in either graph: the decoder reads what the encoder kept of it.
            nodes.append(replace(slab_op, inputs=mapped, recomputed=op.node in recomputed and slab_op.kind == "norm",
                                 key=(op.node.name, position)))
        at[op.node] = len(nodes) - 1
    if writes_into_a_shared_value(nodes, [at[inputs[0]], at[output]]):     # the model's input, the graph's output
        return None
    return SlabGraph(nodes, list(range(len(inputs))), at[output])


class StreamedModel:
    """Mixed into the model's class by `apply_stream`: its forward runs the three parts."""

    def forward(self, *inputs, **keywords):
        state: OuterLevel = getattr(self, STATE_ATTRIBUTE)
        if keywords or len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor) or not inputs[0].is_floating_point():
            raise InputError(f"{type(self).__name__} streams its outer level in slabs and takes one floating-point "
                             "tensor as input; remove the split (oomless.remove) to call it otherwise")
        x = inputs[0]
        if state.training != self.training:
            # Traced in the other mode: Python in the forward that reads self.training ran as it was then.
            found = outer_level(self, state.blocks, state.slabs)
            if isinstance(found, str):
                raise InputError(f"{type(self).__name__}'s outer level cannot be streamed in "
                                 f"{'training' if self.training else 'eval'} mode: {found}; remove the split "
                                 "(oomless.remove) to run it so")
            object.__setattr__(self, STATE_ATTRIBUTE, found)
            state = found
        for check in state.checks:
            check.target(*torch.fx.node.map_arg(check.args, lambda _: x), **torch.fx.node.map_arg(check.kwargs, lambda _: x))
        encoder_ops = SharedNodes()
        downsampled = run_in_slabs(state.encode, x, state.slabs, keeping=encoder_ops)
        return run_in_slabs(state.decode, (x, state.inner(downsampled)), state.slabs, reading=encoder_ops)


_streamed_classes: dict[type, type] = {}


def is_streamed(model: nn.Module) -> bool:
    return isinstance(model, StreamedModel)


def apply_stream(model: nn.Module, found: OuterLevel, slabs: int) -> None:
    """Stream ``model``'s outer level, as `outer_level` found it, in ``slabs`` slabs."""
    if is_streamed(model):
        return
    found.slabs = slabs
    cls = type(model)
    if cls not in _streamed_classes:
        _streamed_classes[cls] = type(f"Streamed{cls.__name__}", (StreamedModel, cls), {"__module__": cls.__module__})
    object.__setattr__(model, STATE_ATTRIBUTE, found)
    model.__class__ = _streamed_classes[cls]


def remove_stream(model: nn.Module) -> None:
    if is_streamed(model):
        model.__class__ = _unstreamed_class(model)
        object.__delattr__(model, STATE_ATTRIBUTE)


def outer_modules(model: nn.Module) -> set[str]:
    """The modules a streamed model's outer level runs itself (empty when it is not streamed)."""
    return getattr(model, STATE_ATTRIBUTE).outer_modules if is_streamed(model) else set()
