"""The graph ``torch.export`` recorded of a model's forward, cut into the graphs of blocks
(`oomless.parallel.traced` makes them into a `BlockSequence`).

    graph = TracedGraph(program, root)                      # root: the module exported (the model inside)
    segments = graph.segments({"model.transformer.h.0", ...})   # the ops of each block, in call order
    for block_graph, reads, writes in graph.block_graphs(segments): ...

The ops are the graph's ATen calls in call order, except that a call of one of torch.nn's own leaf
modules (Linear, Conv3d, BatchNorm3d, Dropout, ...) taking one tensor and giving one becomes a call
of that module, as torch.fx's symbolic tracing keeps them. Two kinds of values are never sent
between blocks: sizes (the batch dimension is symbolic; a size is read again off a tensor the block
has, or off the tensor it came from) and tensors computed from sizes and constants alone without
randomness or writes (position indices, causal masks): each block that reads one computes it again.
Everything else a block reads from an earlier one is a placeholder of its graph and a name it
reads in the sequence.

Writes: a block that writes in place a tensor an earlier block made (``x += y`` across blocks, an
in-place ReLU at the start of a block) is merged with that block. In one process both see the one
tensor either way; across a pipeline's stages the later one would write its received copy (or
autograd refuses to write a stage's input), and the writer's block could no longer start a stage.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import Graph, Node
from torch.fx.node import map_aggregate

from oomless.errors import InputError

# Runtime assertions of the trace (shapes, dtypes, devices as they were when traced): dropped, so
# that a block runs on meta tensors (stage shapes) and on the device its stage lives on.
_ASSERTS = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range")
_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


@dataclass
class LeafCall:
    """A torch.nn leaf module's call, standing in for the ATen ops it ran."""

    target: str         # qualified name under the root
    argument: Node      # the one tensor it was called with
    result: Node        # its output
    nodes: list[Node]   # the ATen ops it stands for


def is_torch_leaf(module: nn.Module) -> bool:
    """One of torch.nn's own modules without children (Linear, Conv3d, BatchNorm3d, Dropout, ...)."""
    return (type(module).__module__.startswith("torch.nn.") and type(module) is not nn.Module
            and next(module.children(), None) is None)


def submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


class TracedGraph:
    """The exported graph as ops in call order, and its cut into blocks (module docstring)."""

    def __init__(self, program, root: nn.Module, called_otherwise=frozenset()):
        """``called_otherwise``: ids of leaf modules some call of which took more than one tensor or
        gave more than one (``ConvTranspose2d(x, output_size=...)``, ``Bilinear(x, y)``, a max pool
        giving its indices): their calls stay ATen ops."""
        self.graph, self.root, self.device = program.graph, root, None
        self.called_otherwise = called_otherwise
        for node in list(self.graph.nodes):
            if node.op == "call_function" and str(node.target).startswith(_ASSERTS) and not node.users:
                self.graph.erase_node(node)
        self.graph.eliminate_dead_code()
        specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
        self.attributes: dict[Node, str] = {}      # parameter, buffer, constant, subgraph -> name under root
        self.user_inputs: list[Node] = []
        for node in self.graph.nodes:
            kind = specs[node.name].kind.name if node.op == "placeholder" else None
            if kind in ("PARAMETER", "BUFFER"):
                self.attributes[node] = specs[node.name].target
            elif kind == "CONSTANT_TENSOR":
                self.attributes[node] = _attach(root, f"_traced_constant_{len(self.attributes)}",
                                                program.constants[specs[node.name].target])
            elif kind == "USER_INPUT":
                self.user_inputs.append(node)
                self.device = self.device or node.meta["val"].device
            elif kind is not None:
                raise InputError(f"torch.export lifted a {kind} input ({node.name}), which a traced sequence cannot "
                                 "carry; write the model as a BlockSequence")
            elif node.op == "get_attr":            # a higher-order op's subgraph (torch.cond's branches)
                self.attributes[node] = _attach(root, f"_traced_subgraph_{len(self.attributes)}",
                                                getattr(program.graph_module, node.target))
        written = [spec.kind.name for spec in program.graph_signature.output_specs if spec.kind.name != "USER_OUTPUT"]
        if written:
            raise InputError(f"the traced forward writes {written} through its outputs, which a traced sequence "
                             "cannot replay; write the model as a BlockSequence")
        self.output = next(node for node in self.graph.nodes if node.op == "output").args[0][0]
        self.input_names = tuple(node.name for node in self.user_inputs)
        self.position = {node: index for index, node in enumerate(self.graph.nodes)}
        # Tensors some op writes in place (through a view too: ``buf[:, :2] = y`` writes ``buf``):
        # never free, or the block reading one would make it again without the write.
        self._written_bases = {_base(argument) for node in self.graph.nodes for argument in _written(node)}
        self._free: dict[Node, bool] = {}
        self.calls = self._leaf_calls()
        self.ops = list(self._ops())

    def is_size(self, node: Node) -> bool:
        """A size (or another scalar): computed again where needed, never sent."""
        return isinstance(node.meta.get("val"), _SCALARS)

    def is_free(self, node: Node) -> bool:
        """Computed from sizes and constants alone, deterministically, writing nothing: computed
        again in every block that reads it."""
        if node not in self._free:
            self._free[node] = (node in self.attributes and self.attributes[node].startswith("_traced_")) or (
                node.op == "call_function" and node not in self.calls and not _written(node) and not _random(node)
                and _base(node) not in self._written_bases
                and all(self.is_size(arg) or self.is_free(arg) for arg in node.all_input_nodes))
        return self._free[node]

    def _leaf_calls(self) -> dict[Node, LeafCall]:
        """{each ATen node of a torch.nn leaf module's call: the call}, for the calls that take one
        tensor (besides the module's own parameters and buffers) and give one; the ops of other
        calls stay as they are."""
        groups: dict[str, tuple[str, list[Node]]] = {}
        for node in self.graph.nodes:
            for key, (path, _) in node.meta.get("nn_module_stack", {}).items():
                module = submodule(self.root, path)
                if module is not None and is_torch_leaf(module) and id(module) not in self.called_otherwise:
                    groups.setdefault(key, (path, []))[1].append(node)
                    break
        calls = {}
        for path, nodes in groups.values():
            members, module = set(nodes), submodule(self.root, path)
            own = {id(tensor) for tensor in [*module.parameters(), *module.buffers()]}
            outside = {arg for node in nodes for arg in node.all_input_nodes
                       if arg not in members and not (arg in self.attributes and id(self._tensor(arg)) in own)}
            results = [node for node in nodes if any(user not in members for user in node.users)]
            argument = next(iter(outside), None)
            if len(outside) == 1 and len(results) == 1 and isinstance(argument.meta.get("val"), torch.Tensor):
                call = LeafCall(path, argument, results[0], nodes)
                calls.update((node, call) for node in nodes)
        return calls

    def _tensor(self, node: Node):
        path, _, name = self.attributes[node].rpartition(".")
        return getattr(submodule(self.root, path), name)

    def _ops(self):
        """Nodes and leaf calls to place in blocks, in call order (a call where its first node was)."""
        seen = set()
        for node in self.graph.nodes:
            if node.op != "call_function" or self.is_size(node) or self.is_free(node):
                continue
            call = self.calls.get(node)
            if call is None:
                yield node
            elif id(call) not in seen:
                seen.add(id(call))
                yield call

    def segments(self, block_paths: set[str]) -> list[tuple[str, list]]:
        """(module path, ops) of each block: a run of ops inside one call of a module in
        ``block_paths`` (qualified names under the root); ops outside all of them join the run
        after them (the last run, at the end); then blocks are merged where one writes a tensor of
        an earlier one (module docstring)."""
        runs: list[tuple[tuple | None, list]] = []
        for op in self.ops:
            stack = (op.nodes[0] if isinstance(op, LeafCall) else op).meta.get("nn_module_stack", {})
            key = next(((key, path) for key, (path, _) in reversed(stack.items()) if path in block_paths), None)
            if runs and runs[-1][0] == key:
                runs[-1][1].append(op)
            else:
                runs.append((key, [op]))
        segments, pending = [], []
        for key, ops in runs:
            if key is None:
                pending += ops
            else:
                segments.append((key[1], pending + ops))
                pending = []
        if pending:
            path, ops = segments.pop() if segments else ("", [])
            segments.append((path, ops + pending))
        return self._merge_writers(segments)

    def _merge_writers(self, segments: list) -> list:
        while True:
            maker = {_result(op): index for index, (_, ops) in enumerate(segments) for op in ops}
            maker.update((node, 0) for node in self.user_inputs)
            found = next(((maker[written], index) for index, (_, ops) in enumerate(segments) for op in ops
                          for written in self._writes_outside(op) if maker.get(written, index) < index), None)
            if found is None:
                return segments
            first, last = found
            segments[first:last + 1] = [(segments[first][0], [op for _, ops in segments[first:last + 1] for op in ops])]

    def _writes_outside(self, op) -> list[Node]:
        """The tensors (followed back through views) that ``op`` writes in place and did not make."""
        nodes = op.nodes if isinstance(op, LeafCall) else [op]
        written = [_base(argument) for node in nodes for argument in _written(node)]
        return [node for node in written if node not in nodes and node not in self.attributes]

    def block_graphs(self, segments: list) -> list[tuple[Graph, tuple[str, ...], tuple[str, ...]]]:
        """Per block, (graph, names read, names written): what it reads from earlier blocks and the
        inputs are its placeholders; what later blocks read (and the model's output) it returns."""
        reads = [self._reads(ops) for _, ops in segments]
        built = []
        for index, (_, ops) in enumerate(segments):
            later = {node for block_reads in reads[index + 1:] for node in block_reads} | {self.output}
            writes = sorted((_result(op) for op in ops if _result(op) in later), key=self.position.get)
            built.append((self._emit(ops, reads[index], writes), tuple(map(self.name, reads[index])),
                          tuple(map(self.name, writes))))
        return built

    def name(self, node: Node) -> str:
        return "output" if node is self.output else node.name

    def _reads(self, ops: list) -> list[Node]:
        """The tensors the block of ``ops`` reads that earlier blocks or the inputs give, in call
        order. A size is read off one of them where one has it, else off the tensor it came from."""
        inside = {_result(op) for op in ops}
        tensors, sizes, seen = [], [], set()

        def visit(node: Node):
            if node in seen or node in inside or node in self.attributes:
                return
            seen.add(node)
            if self.is_size(node):
                sizes.append(node)
                for argument in node.all_input_nodes:
                    if not (_is_sym_size(node) and argument is node.args[0]):
                        visit(argument)
            elif self.is_free(node):
                for argument in node.all_input_nodes:
                    visit(argument)
            else:
                tensors.append(node)

        for op in ops:
            for argument in ([op.argument] if isinstance(op, LeafCall) else op.all_input_nodes):
                visit(argument)
        for size in sizes:
            source = size.args[0] if _is_sym_size(size) else None
            if (source is not None and source not in inside and source not in tensors and not self.is_free(source)
                    and _same_size(size, tensors) is None):
                tensors.append(source)
        return sorted(tensors, key=self.position.get)

    def _emit(self, ops: list, reads: list[Node], writes: list[Node]) -> Graph:
        graph, env = Graph(), {}
        for node in reads:
            env[node] = graph.placeholder(self.name(node))
            env[node].meta = dict(node.meta)
        # Factory calls (arange, masks) and .to() name the device the trace ran on: they get the
        # device of what the block reads instead, a stage's device or meta (stage shapes).
        tensors = [env[node] for node in reads if isinstance(node.meta.get("val"), torch.Tensor)]
        device = graph.call_function(getattr, (tensors[0], "device")) if tensors else None

        def moved(value):
            return device if device is not None and isinstance(value, torch.device) and value == self.device else value

        def lookup(node: Node) -> Node:
            if node not in env:
                if node in self.attributes:
                    env[node] = graph.get_attr(self.attributes[node])
                elif _is_sym_size(node) and node.args[0] not in env and not self.is_free(node.args[0]):
                    tensor, dimension = _same_size(node, reads) or node.args
                    env[node] = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], dimension))
                else:                               # a size or a free node: computed here
                    env[node] = copy(node)
            return env[node]

        def copy(node: Node) -> Node:
            copied = graph.node_copy(node, lookup)
            copied.args, copied.kwargs = map_aggregate(copied.args, moved), map_aggregate(copied.kwargs, moved)
            return copied

        for op in ops:
            if isinstance(op, LeafCall):
                env[op.result] = graph.call_module(op.target, (lookup(op.argument),))
            else:
                env[op] = copy(op)
        results = [lookup(node) for node in writes]
        graph.output(results[0] if len(results) == 1 else tuple(results))
        if device is not None and not device.users:
            graph.erase_node(device)
        return graph


def _result(op) -> Node:
    return op.result if isinstance(op, LeafCall) else op


def _is_sym_size(node: Node) -> bool:
    return node.op == "call_function" and node.target == torch.ops.aten.sym_size.int


def _same_size(size: Node, tensors: list[Node]) -> tuple[Node, int] | None:
    """(tensor, dimension) among ``tensors`` whose extent there is ``size``'s symbol."""
    value = size.meta.get("val")
    if not isinstance(value, torch.SymInt):
        return None
    for tensor in tensors:
        shape = tensor.meta["val"].shape if isinstance(tensor.meta.get("val"), torch.Tensor) else ()
        for dimension, extent in enumerate(shape):
            if isinstance(extent, torch.SymInt) and extent.node.expr == value.node.expr:
                return tensor, dimension
    return None


def _written(node: Node) -> list[Node]:
    """The arguments an op writes in place (BatchNorm's counter, ``x += y``, an in-place ReLU)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            written += [value] if isinstance(value, Node) else []
    return written


# Dropouts return their input itself where they drop nothing (p = 0, or not training: ATen's
# ``dropout`` does ``return input``), which their schemas do not say: an in-place op after one (MONAI's
# BasicUNet: dropout 0.0, then an in-place LeakyReLU) writes the dropout's input.
_DROPOUTS = {torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
             torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default}


def _base(node: Node) -> Node:
    """The tensor ``node`` is a view of, through view ops (their output aliases argument 0) and
    dropouts that drop nothing."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args:
        arguments = node.target._schema.arguments
        if node.target in _DROPOUTS:
            probability = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
            training = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
            if probability != 0 and training is not False:
                break
        elif not arguments or arguments[0].alias_info is None:
            break
        if not isinstance(node.args[0], Node):
            break
        node = node.args[0]
    return node


def _random(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _attach(root: nn.Module, name: str, value) -> str:
    """Keep a traced constant or subgraph on the root (the wrapper, never the user's model)."""
    if isinstance(value, torch.Tensor):
        root.register_buffer(name, value, persistent=False)
    else:
        setattr(root, name, value)
    return name
