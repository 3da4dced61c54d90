"""A graph of convolutions, normalisations and pointwise ops computed in slabs along one spatial axis.

The floor a plan reaches is the working set of its largest piece (DESIGN.md section 2). For a 3D
U-Net at full resolution that piece is one stage, conv-norm-act-conv-norm-act, or a decoder stage
(upsample, concatenate the skip, conv-norm-act twice), whose backward holds every intermediate of the
whole volume at once, however its saved tensors are swapped. Here the stage runs as one autograd
function that saves only its inputs and computes forward and backward slab by slab along the first
spatial axis (the depth D of N, C, D, H, W), so the whole-volume tensors alive are its inputs, its
output, and their gradients; the rest is one slab's worth.

    graph = SlabGraph.of(stage)                  # None when some op cannot be computed in slabs
    output = run_in_slabs(graph, (x,), slabs=8)  # a decoder stage: (x, skip)

A graph is an ``nn.Sequential`` (nested ones are looked through) or a module whose forward
``torch.fx`` traces to these ops only: convolutions of stride 1 and "same" zero padding along D
(``padding="same"`` too where it is symmetric),
transposed convolutions that upsample along D without overlap (kernel = stride, no padding),
BatchNorm / GroupNorm / InstanceNorm, pointwise activations, concatenation along channels, addition
(an addend of one row along D broadcasts: every slab reads it whole).

Exact, with the ideas of StreamingCNN (Pinckaers et al., TPAMI 2020) and of operator tiling with
normalisation statistics aggregated over the whole volume:
- Rows [a, b) of a node's output need rows of each of its inputs: [a - p, b + p) for a convolution
  of padding p along D (the halo), [a / s, b / s) (rounded outwards) for an upsampling by s, [a, b)
  for the rest. Needs are propagated from the output back to the inputs (a node several ops read is
  computed once per slab, over the union of their needs). Rows outside the volume are a
  convolution's zero padding, added explicitly at the volume's ends, so each output row sees exactly
  the inputs it sees unsplit.
- A normalisation in training mode needs statistics of the whole volume: a first pass over the
  slabs takes each slab's mean and variance (one pass, `torch.var_mean`), combined in float64 over the
  slabs (Chan et al.); the slabs then use them. Its input is kept off the device as it is computed
  (`runtime.rows`: a file on the CPU, pinned host memory beside a GPU), so later passes start from it
  and each op runs once in forward.
- Backward goes from the output back, node by node: first the output's slabs, then each kept
  normalisation input, last first. A node's slab is computed again from the kept nodes and inputs
  just before it (one convolution's worth, not the whole graph's), with the statistics as leaves,
  and backpropagated with the gradient reaching the node: the ops after it gave theirs (kept beside
  the node, in the same kind of store), and each normalisation reading it gives d mean/dx = 1/n and
  d var/dx = 2 (x - mean)/n times its statistics' gradients, complete once every op after it is done.
  A kept convolution output is not computed again: `aten.convolution_backward` runs on its input's
  rows (an input concatenated along channels part by part, with the weight's slice), the call
  autograd would make. A ReLU of a normalisation of a kept node, the usual input of a U-Net's
  convolutions, is computed into buffers reused slab after slab and taken back in place (the ops
  autograd would run, without their slab-sized temporaries). So the convolutions run once forward
  and once backward, each other op once more forward and once backward, and what is alive is one
  op's slab. (`DIRECT_CONVOLUTION_BACKWARD = False` computes each kept node again first, as under
  checkpointing; `FUSED_NORMALISED_RELU = False` takes the ReLU and normalisation back through
  autograd; `STORE_NORMALISATION_INPUTS = False` computes every node again from the graph's inputs:
  a pass of every op before it per normalisation, forward and backward.)
Under torch.autocast (precision="bf16"/"fp16") each op runs in the dtype autocast gives it, forward
and backward (`runtime.slab_autocast`): convolutions in the autocast dtype with weights cast once per
pass, normalisations as torch's kernels run them (statistics and gradient sums in float32, results
rounded once), each stored node in its own dtype.
Not bit-equal to the unsplit ops: the statistics and the weight gradients are sums over the whole
volume taken in another order (the tests bound the difference, about 1e-6 relative in float32; under
bf16 a few bf16 roundings of partial sums, tests/test_split_precision.py).
"""

import contextlib
import math
import operator
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from oomless.errors import InputError
from oomless.runtime.rows import AXIS, row_store
from oomless.runtime.slab_autocast import (SlabAutocast, accumulation_dtype, normalised_dtype, rounded_statistics,
                                           statistics_rounded_to)

# Each normalisation's input is kept off the device (`runtime.rows`) once computed, and the gradient
# reaching it beside it: each op runs once in forward and once (forward and backward) in backward,
# where computed again from the inputs each normalisation would be a pass of every op before it.
STORE_NORMALISATION_INPUTS = True
# A stored convolution output is taken back in backward with aten.convolution_backward from its
# input's rows, not computed again first (`_Backward._convolution`); False: computed again, as
# checkpointing does (the forward of every such convolution once more in backward).
DIRECT_CONVOLUTION_BACKWARD = True
# There, a convolution reading ReLU(normalisation(a stored node)) takes those two ops back itself, in
# place and into buffers reused slab after slab (`_Backward._normalised_relu_back`); False: through autograd.
FUSED_NORMALISED_RELU = True

_CONVOLUTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_TRANSPOSED = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
               nn.ConvTranspose3d: F.conv_transpose3d}
_POINTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
              nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.PReLU, nn.Identity)
_POINTWISE_FUNCTIONS = {torch.relu, F.relu, torch.sigmoid, torch.tanh, F.gelu, F.silu, F.elu, F.leaky_relu}
_CONCATENATIONS = {torch.cat, torch.concat, torch.concatenate}
_ADDITIONS = {operator.add, torch.add}
_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
_NORMS = _BATCH_NORMS + _INSTANCE_NORMS + (nn.GroupNorm,)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


@dataclass
class _Node:
    kind: str                   # "input" | "conv" | "up" | "down" | "norm" | "pointwise" | "cat" | "add"
    inputs: tuple[int, ...] = ()
    module: object = None       # the nn.Module (conv, up, norm, pointwise) or function (pointwise)
    halo: int = 0               # conv: rows needed on each side along AXIS
    scale: int = 1              # up: output rows per input row along AXIS; down: input rows per output row
    inplace: bool = False       # pointwise: writes into its input
    function: object = None     # conv, up: the functional form (its class may be swapped once split)
    recomputed: bool = False    # norm: computed again for another graph; leaves running statistics alone
    key: object = None          # the same op in another graph (`SharedNodes`); None: this graph's own


def _first(value) -> int:
    return value[0] if isinstance(value, (tuple, list)) else value


def why_not_downsampling(module: nn.Module) -> str | None:
    """Why ``module`` cannot downsample slabs along AXIS (a pooling whose windows do not overlap); None when it can."""
    if not isinstance(module, _POOLS):
        return f"{type(module).__name__} is not a pooling"
    kernel, stride = _first(module.kernel_size), _first(module.stride if module.stride is not None else module.kernel_size)
    if (kernel != stride or _first(module.padding) != 0 or module.ceil_mode
            or _first(getattr(module, "dilation", 1)) != 1 or getattr(module, "return_indices", False)):
        return f"{type(module).__name__} kernel {kernel}, stride {stride}: needs kernel = stride, no padding or ceil mode"
    return None


def padding_of(conv: nn.Module) -> tuple[int, ...] | None:
    """A convolution's zero padding per spatial axis as ints: ``padding="same"`` is dilation x
    (kernel - 1) / 2 on each side where that is whole (PyTorch pads the odd one out on the right
    alone, which no int padding gives: None), ``"valid"`` none."""
    if not isinstance(conv.padding, str):
        return tuple(conv.padding)
    if conv.padding == "valid":
        return (0,) * len(conv.kernel_size)
    total = [dilation * (kernel - 1) for kernel, dilation in zip(conv.kernel_size, conv.dilation)]
    return None if any(size % 2 for size in total) else tuple(size // 2 for size in total)


def why_not_sliceable(module: nn.Module) -> str | None:
    """Why ``module`` (an op of a graph) cannot run in slabs along AXIS; None when it can."""
    if type(module) in _CONVOLUTIONS:
        padding = padding_of(module)
        if module.padding_mode != "zeros" or padding is None:
            return (f"{type(module).__name__} with padding {module.padding!r} ({module.padding_mode}): "
                    "needs zero padding the same on both sides")
        kernel, dilation = module.kernel_size[0], module.dilation[0]
        if module.stride[0] != 1 or dilation * (kernel - 1) != 2 * padding[0]:
            return (f"{type(module).__name__} stride {module.stride[0]}, kernel {kernel}, padding {padding[0]} "
                    "along the first spatial axis: needs stride 1 and padding that keeps the size")
        return None
    if type(module) in _TRANSPOSED:
        if (module.kernel_size[0] != module.stride[0] or module.padding[0] != 0 or module.output_padding[0] != 0
                or module.dilation[0] != 1 or module.padding_mode != "zeros"):
            return (f"{type(module).__name__} kernel {module.kernel_size[0]}, stride {module.stride[0]}, padding "
                    f"{module.padding[0]} along the first spatial axis: needs kernel = stride and no padding")
        return None
    if isinstance(module, _POINTWISE):
        return None
    if isinstance(module, _DROPOUTS):
        return None if module.p == 0 else "dropout with p > 0 (its random mask would differ per slab)"
    if isinstance(module, _INSTANCE_NORMS) and module.track_running_stats:
        return "InstanceNorm with track_running_stats"
    if isinstance(module, _NORMS):
        return None
    return f"{type(module).__name__} is not a convolution, normalisation or pointwise op"


def leaves(module: nn.Module) -> list[nn.Module]:
    """The ops of a (nested) nn.Sequential in call order; [module] for anything else."""
    if type(module).forward is nn.Sequential.forward:
        return [leaf for child in module for leaf in leaves(child)]
    return [module]


def _uses_batch_statistics(module: nn.Module) -> bool:
    if isinstance(module, _BATCH_NORMS):
        return module.training or module.running_mean is None
    return isinstance(module, _INSTANCE_NORMS + (nn.GroupNorm,))


def _module_node(module: nn.Module, source: int, downsampling: bool = False) -> _Node | None:
    if downsampling and why_not_downsampling(module) is None:
        return _Node("down", (source,), module, scale=_first(module.kernel_size))
    if why_not_sliceable(module) is not None:
        return None
    if type(module) in _CONVOLUTIONS:
        return _Node("conv", (source,), module, halo=padding_of(module)[0], function=_CONVOLUTIONS[type(module)])
    if type(module) in _TRANSPOSED:
        return _Node("up", (source,), module, scale=module.stride[0], function=_TRANSPOSED[type(module)])
    if isinstance(module, _NORMS):
        return _Node("norm", (source,), module)
    return _Node("pointwise", (source,), module, inplace=bool(getattr(module, "inplace", False)))


def fx_node(fx_node: torch.fx.Node, root: nn.Module, index: dict, downsampling: bool = False) -> _Node | None:
    """The slab op of one torch.fx node (its inputs mapped through ``index``); None where it is not
    one (poolings only with ``downsampling``: a graph of their own cannot downsample its output)."""
    args, kwargs = fx_node.args, fx_node.kwargs
    if fx_node.op == "call_module":
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.fx.Node):
            return None
        return _module_node(root.get_submodule(fx_node.target), index[args[0]], downsampling)
    if fx_node.op != "call_function":
        return None
    if fx_node.target in _CONCATENATIONS:
        tensors = args[0] if args else kwargs.get("tensors")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if (dim != 1 or set(kwargs) - {"dim", "tensors"} or not isinstance(tensors, (list, tuple))
                or not all(isinstance(item, torch.fx.Node) for item in tensors)):
            return None
        return _Node("cat", tuple(index[item] for item in tensors))
    if fx_node.target in _ADDITIONS:
        if len(args) != 2 or kwargs or not all(isinstance(item, torch.fx.Node) for item in args):
            return None
        return _Node("add", tuple(index[item] for item in args))
    if fx_node.target in _POINTWISE_FUNCTIONS:
        if len(args) != 1 or set(kwargs) - {"inplace"} or not isinstance(args[0], torch.fx.Node):
            return None
        # Run out of place; marked in place so that a write into a value read twice is refused.
        return _Node("pointwise", (index[args[0]],), fx_node.target, inplace=bool(kwargs.get("inplace", False)))
    return None


def _aliases_its_input(node: _Node) -> bool:
    """Whether the op's output is its input tensor itself: an in-place op, an Identity, a dropout of p = 0."""
    return node.kind == "pointwise" and (node.inplace or type(node.module) is nn.Identity
                                         or isinstance(node.module, _DROPOUTS))


def writes_into_a_shared_value(nodes: list[_Node], read_outside=()) -> bool:
    """Whether an in-place op writes into a value another op reads (then the order of ops matters),
    or into one the graph's caller reads after it: ``read_outside``, the nodes it hands out or is
    handed (its inputs, which PyTorch would change under the caller, and its output, which an op
    after it would change: ``F.relu(y, inplace=True); return y``). Computed in slabs, each op writes
    a new slab, so such a write would not be seen. Through aliases too (an Identity, a dropout of
    p = 0 and an in-place op return their input itself)."""
    readers = [sum(source in node.inputs for node in nodes) for source in range(len(nodes))]
    if any(node.inplace and readers[node.inputs[0]] > 1 for node in nodes):
        return True
    value = list(range(len(nodes)))             # the node whose tensor each node's output is
    for index, node in enumerate(nodes):
        if _aliases_its_input(node):
            value[index] = value[node.inputs[0]]
    # (reader, node read): a read of a value made before an in-place op into it, after that op, sees the write.
    reads = [(reader, source) for reader, node in enumerate(nodes) for source in node.inputs]
    reads += [(len(nodes), source) for source in read_outside]
    return any(node.inplace and value[source] == value[writer] and source < writer < reader
               for writer, node in enumerate(nodes) for reader, source in reads)


def _traced_nodes(module: nn.Module) -> tuple[list[_Node], list[int], int] | None:
    """(nodes, input node indices, output node index) of ``module``'s forward as torch.fx traces it;
    None where it does not trace or uses an op that cannot run in slabs."""
    try:
        graph = torch.fx.symbolic_trace(module).graph
    except Exception:       # any Python the tracer cannot follow: not a graph of slab ops
        return None
    nodes, index, inputs, output = [], {}, [], None
    for node_of_fx in graph.nodes:
        if node_of_fx.op == "placeholder":
            node = _Node("input")
            inputs.append(len(nodes))
        elif node_of_fx.op == "output":
            output = index.get(node_of_fx.args[0]) if isinstance(node_of_fx.args[0], torch.fx.Node) else None
            break
        else:
            node = fx_node(node_of_fx, module, index)
        if node is None:
            return None
        index[node_of_fx] = len(nodes)
        nodes.append(node)
    if output is None or not inputs or writes_into_a_shared_value(nodes, inputs + [output]):
        return None
    read = {source for node in nodes for source in node.inputs} | {output}
    if any(index not in read for index in inputs):
        # An input the trace never reads: Python the tracer took another way than a call does (MONAI's
        # BasicUNet's UpCat concatenates its skip only where torch.jit.isinstance(skip, torch.Tensor),
        # False for the tracer's proxy), so the graph is not what the forward computes.
        return None
    return nodes, inputs, output


class SlabGraph:
    """The ops of a graph in topological order, with what each needs to run on a slab."""

    def __init__(self, nodes: list[_Node], inputs: list[int], output: int):
        self.nodes, self.inputs, self.output = nodes, inputs, output
        self.norms = [index for index, node in enumerate(nodes) if node.kind == "norm"]

    @classmethod
    def chain(cls, modules: list[nn.Module]) -> "SlabGraph | None":
        """The graph of ops called one after the other; None when one cannot run in slabs or none is a convolution."""
        nodes = [_Node("input")]
        for module in modules:
            node = _module_node(module, len(nodes) - 1)
            if node is None:
                return None
            nodes.append(node)
        if writes_into_a_shared_value(nodes, [0]):
            return None         # its first op writes into its input (the caller's tensor)
        return cls._worth_it(nodes, [0], len(nodes) - 1)

    @classmethod
    def of(cls, module: nn.Module) -> "SlabGraph | None":
        """``module``'s graph: an nn.Sequential's leaves, a single convolution, or what torch.fx traces."""
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return None
        ops = leaves(module)
        if ops != [module] or not list(module.children()):
            return cls.chain(ops)
        if any(why_not_sliceable(leaf) is not None for leaf in module.modules() if not list(leaf.children())):
            return None         # cheap refusal before tracing
        traced = _traced_nodes(module)
        return None if traced is None else cls._worth_it(*traced)

    @classmethod
    def _worth_it(cls, nodes: list[_Node], inputs: list[int], output: int) -> "SlabGraph | None":
        if not any(node.kind in ("conv", "up") for node in nodes):
            return None         # nothing a slab would shrink
        return cls(nodes, inputs, output)

    def in_mode(self) -> "SlabGraph":
        """This graph as its modules' train/eval modes run it: a BatchNorm on its running statistics is pointwise."""
        nodes = [replace(node, kind="pointwise") if node.kind == "norm" and not _uses_batch_statistics(node.module)
                 else node for node in self.nodes]
        return SlabGraph(nodes, self.inputs, self.output)

    def parameters(self) -> list[nn.Parameter]:
        seen, parameters = set(), []
        for node in self.nodes:
            if isinstance(node.module, nn.Module):
                for parameter in node.module.parameters():
                    if id(parameter) not in seen:
                        seen.add(id(parameter))
                        parameters.append(parameter)
        return parameters

    def shapes(self, xs: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
        """(rows along AXIS, rows along the next axis) of each node's output for inputs ``xs``."""
        shapes = []
        for index, node in enumerate(self.nodes):
            if node.kind == "input":
                x = xs[self.inputs.index(index)]
                shapes.append((x.shape[AXIS], x.shape[AXIS + 1] if x.dim() > AXIS + 1 else 1))
            elif node.kind == "up":
                depth, height = shapes[node.inputs[0]]
                stride = node.module.stride
                shapes.append((depth * node.scale, height * (stride[1] if len(stride) > 1 else 1)))
            elif node.kind == "down":
                depth, height = shapes[node.inputs[0]]
                kernel = node.module.kernel_size
                shapes.append((depth // node.scale, height // (kernel[1] if isinstance(kernel, tuple) else kernel)))
            else:
                sizes = {shapes[source] for source in node.inputs}
                if node.kind == "add":
                    # A size of 1 broadcasts (an embedding of shape (N, C, 1, 1, 1) added to a volume).
                    sizes = {tuple(max(size[axis] for size in sizes) if size[axis] == 1 else size[axis]
                                   for axis in (0, 1)) for size in sizes}
                if len(sizes) != 1:
                    raise InputError(f"a graph computed in slabs {node.kind}s tensors of different spatial sizes "
                                     f"{sorted(sizes)}; remove the split (oomless.remove) for such inputs")
                shapes.append(sizes.pop())
        return shapes

    @staticmethod
    def broadcast(node: _Node, source: int, index: int, depths: list[int]) -> bool:
        """Whether node ``index`` reads its input ``source`` whole, as one row along AXIS broadcast over its rows."""
        return node.kind == "add" and depths[source] == 1 < depths[index]

    def rows_needed(self, target: int, low: int, high: int, depths: list[int],
                    given=frozenset()) -> dict[int, tuple[int, int]]:
        """{node: rows of its output} that rows [low, high) of node ``target``'s output need, each
        clipped to the volume; nodes ``given`` (other than the target) are read, not computed."""
        need = {target: (low, high)}
        for index in reversed(range(target + 1)):
            if index not in need or (index in given and index != target):
                continue
            node, (low, high) = self.nodes[index], need[index]
            for source in node.inputs:
                if node.kind == "conv":
                    rows = (max(0, low - node.halo), min(depths[source], high + node.halo))
                elif node.kind == "up":
                    rows = (low // node.scale, -(-high // node.scale))
                elif node.kind == "down":
                    rows = (low * node.scale, min(depths[source], high * node.scale))
                elif self.broadcast(node, source, index, depths):
                    rows = (0, 1)
                else:
                    rows = (low, high)
                if source in need:
                    rows = (min(rows[0], need[source][0]), max(rows[1], need[source][1]))
                need[source] = rows
        return need

    def run(self, target: int, low: int, high: int, depths: list[int], given: dict[int, tuple[torch.Tensor, int]],
            statistics: dict[int, tuple[torch.Tensor, torch.Tensor]], scratch: "_Scratch | None" = None,
            weights: dict | None = None) -> torch.Tensor:
        """Rows [low, high) of node ``target``'s output. ``given`` maps each input node, and any other
        node read rather than computed, to a tensor holding its rows from an offset on (the rows
        needed are taken by narrowing); ``statistics`` holds (mean, variance) of each normalisation
        node the target depends on. With ``scratch`` (and no gradient recorded), a convolution of
        ReLU(normalisation(x)) read by nothing else computes its input into a reused buffer, zero
        padding included (`_normalised_relu_into`). ``weights``: {id(parameter): the tensor to use
        instead} (the copies autocast would make, `SlabAutocast.cast_weights`)."""
        need = self.rows_needed(target, low, high, depths, given)
        computed = [index for index in need if index not in given or index == target]
        left = {index: sum(1 for user in computed if index in self.nodes[user].inputs) for index in need}
        values: dict[int, torch.Tensor] = {}
        fused = {}          # convolution: (its ReLU, that ReLU's normalisation), not computed on their own
        if scratch is not None and not torch.is_grad_enabled():
            for index in computed:
                pair = self.normalised_relu(index)
                if pair is not None and all(n in computed and n != target and left[n] == 1 for n in pair):
                    fused[index] = pair
        skipped = {n for pair in fused.values() for n in pair}

        def rows(source: int, low: int, high: int) -> torch.Tensor:
            return _rows_of(values[source], low - need[source][0], high - low)

        for index in sorted(need):
            node, (low, high) = self.nodes[index], need[index]
            inputs = set(node.inputs) if index not in given else set()
            if index in skipped:
                continue
            if index in given:
                tensor, offset = given[index]
                value = _rows_of(tensor, low - offset, high - low)
            elif index in fused:
                relu, norm = fused[index]
                source = self.nodes[norm].inputs[0]
                inputs = {source}
                first, last = max(0, low - node.halo), min(depths[source], high + node.halo)
                y = rows(source, first, last)
                scale, shift = _scale_and_shift(self.nodes[norm].module, y, *statistics[norm])
                padded, _ = _normalised_relu_into(scratch, f"fused {index}", y, scale, shift,
                                                  (first - (low - node.halo), high + node.halo - last),
                                                  normalised_dtype(self.nodes[norm].module, y))
                del y
                value = _convolve(node, padded, (0, 0), weights)
                del padded
            elif node.kind == "conv":
                source = node.inputs[0]
                first, last = max(0, low - node.halo), min(depths[source], high + node.halo)
                value = _convolve(node, rows(source, first, last),
                                  (first - (low - node.halo), high + node.halo - last), weights)
            elif node.kind == "up":
                source = node.inputs[0]
                first, last = low // node.scale, -(-high // node.scale)
                value = _upsample(node, rows(source, first, last), weights).narrow(
                    AXIS, low - first * node.scale, high - low)
            elif node.kind == "down":      # forward, not the module's call: its hooks are for when it runs whole
                value = node.module.forward(rows(node.inputs[0], low * node.scale, high * node.scale))
            elif node.kind == "norm":
                value = _normalise(node.module, rows(node.inputs[0], low, high), *statistics[index])
            elif node.kind == "pointwise":
                source = node.inputs[0]
                value = rows(source, low, high)
                if node.inplace and (source in given or _shares_storage(value, given)):
                    value = value.clone()       # an in-place op must not write into an input
                value = node.module.forward(value) if isinstance(node.module, nn.Module) else node.module(value)
            elif node.kind == "cat":
                value = torch.cat([rows(source, low, high) for source in node.inputs], dim=1)
            else:
                first, second = (values[source] if self.broadcast(node, source, index, depths) else rows(source, low, high)
                                 for source in node.inputs)
                value = first + second
            values[index] = value
            for source in inputs:
                left[source] -= 1
                if left[source] == 0:
                    del values[source]
        return values[target]

    def relu_of_normalisation(self, index: int) -> int | None:
        """The normalisation node where node ``index`` is ReLU(that normalisation); else None."""
        node = self.nodes[index]
        if node.kind != "pointwise" or not _is_relu(node.module):
            return None
        return node.inputs[0] if self.nodes[node.inputs[0]].kind == "norm" else None

    def normalised_relu(self, convolution: int) -> tuple[int, int] | None:
        """(its ReLU, that ReLU's normalisation) where node ``convolution`` is a convolution of
        ReLU(normalisation(a node)); else None."""
        if self.nodes[convolution].kind != "conv":
            return None
        relu = self.nodes[convolution].inputs[0]
        norm = self.relu_of_normalisation(relu)
        return None if norm is None else (relu, norm)

def _is_relu(function) -> bool:
    return type(function) is nn.ReLU or function in (torch.relu, F.relu)


def _rows_of(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """``tensor.narrow(AXIS, start, length)``, or the tensor itself where that is all of it: a
    narrowing that takes nothing away would still cost a whole slab of zeros and a copy in backward."""
    return tensor if start == 0 and length == tensor.shape[AXIS] else tensor.narrow(AXIS, start, length)


def _shares_storage(value: torch.Tensor, given: dict) -> bool:
    """Whether ``value`` is a view of one of the inputs (e.g. through an Identity)."""
    pointer = value.untyped_storage().data_ptr()
    return any(tensor.untyped_storage().data_ptr() == pointer for tensor, _ in given.values())


def _weight_and_bias(module: nn.Module, weights: dict | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``module``'s weight and bias, or their copies in ``weights`` ({id(parameter): copy})."""
    weight, bias = module.weight, module.bias
    if weights:
        weight, bias = weights.get(id(weight), weight), bias if bias is None else weights.get(id(bias), bias)
    return weight, bias


def _convolve(node: _Node, x: torch.Tensor, zero_rows: tuple[int, int], weights: dict | None = None) -> torch.Tensor:
    """A convolution with its zero padding along AXIS given explicitly (only where the slab meets the volume's end)."""
    if any(zero_rows):
        x = F.pad(x, (0, 0) * (x.dim() - AXIS - 1) + zero_rows)
    conv = node.module
    padding = (0,) + padding_of(conv)[1:]
    return node.function(x, *_weight_and_bias(conv, weights), conv.stride, padding, conv.dilation, conv.groups)


def _upsample(node: _Node, x: torch.Tensor, weights: dict | None = None) -> torch.Tensor:
    up = node.module
    return node.function(x, *_weight_and_bias(up, weights), up.stride, up.padding, up.output_padding, up.groups,
                         up.dilation)


def _grouped(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` shaped so that each statistic reduces over the returned dims (kept as size 1)."""
    if isinstance(norm, nn.GroupNorm):
        grouped = x.reshape(x.shape[0], norm.num_groups, x.shape[1] // norm.num_groups, *x.shape[2:])
        return grouped, tuple(range(2, grouped.dim()))
    if isinstance(norm, _INSTANCE_NORMS):
        return x, tuple(range(2, x.dim()))
    return x, (0,) + tuple(range(2, x.dim()))       # BatchNorm: per channel


def _per_channel(norm: nn.Module, statistic: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A statistic shaped as `_grouped` reduces, as (N or 1, C, 1, ...) to broadcast over ``x``."""
    if isinstance(norm, nn.GroupNorm):
        grouped = statistic.expand(-1, -1, x.shape[1] // norm.num_groups, *statistic.shape[3:])
        return grouped.reshape(statistic.shape[0], x.shape[1], *statistic.shape[3:])
    return statistic


def _scale_and_shift(norm: nn.Module, x: torch.Tensor, mean: torch.Tensor,
                     variance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) with ``norm(x) = x * scale + shift``: scale = weight / sqrt(variance + eps),
    shift = bias - mean * scale, each (N or 1, C, 1, ...). Where torch keeps the statistics in
    ``x``'s dtype (`statistics_rounded_to`), 1/sqrt(variance + eps) is rounded to it as well (its
    gradient taken as if it were not, as torch's backward formula takes it)."""
    inverse_deviation = torch.rsqrt(variance + norm.eps)
    rounded = statistics_rounded_to(norm, x)
    if rounded is not None:
        inverse_deviation = inverse_deviation + (inverse_deviation.to(rounded).to(variance.dtype)
                                                 - inverse_deviation).detach()
    scale = _per_channel(norm, inverse_deviation, x)
    shift = -_per_channel(norm, mean, x) * scale
    if getattr(norm, "weight", None) is not None:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        weight = norm.weight.reshape(shape)
        scale, shift = scale * weight, shift * weight + norm.bias.reshape(shape)
    return scale, shift


def _normalise(norm: nn.Module, x: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """``x`` normalised as ``x * scale + shift`` (`_scale_and_shift`), the form PyTorch's own CPU batch
    norm computes: one op over the slab, which saves only ``x`` for backward. In the dtype torch's
    normalisation runs in under the autocast now on (`normalised_dtype`: ``x`` cast to it first, as
    autocast casts it); a bf16/fp16 ``x`` is normalised in float32 (scale and shift are) and the
    result rounded to its dtype, as the kernels do."""
    x = x.to(normalised_dtype(norm, x))
    scale, shift = _scale_and_shift(norm, x, mean, variance)
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or shift.requires_grad):
        return _ScaleShift.apply(x, scale, shift)
    return _scaled_and_shifted(x, scale, shift)


def _scaled_and_shifted(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, out=None) -> torch.Tensor:
    """``x * scale + shift`` in ``x``'s dtype (into ``out``), computed in the wider of the dtypes."""
    if out is None and x.dtype != torch.promote_types(x.dtype, scale.dtype):
        out = torch.empty_like(x)
    return torch.addcmul(shift, x, scale) if out is None else torch.addcmul(shift, x, scale, out=out)


def _normalised_relu_into(scratch: "_Scratch", name: str, y: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                          zero_rows: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ReLU(y * scale + shift) in ``dtype`` (the normalisation's, `normalised_dtype`) with
    ``zero_rows`` rows of zeros before and after it along AXIS, its rows of ``y`` as a view of it),
    written into the buffer ``name`` of ``scratch``: a convolution's input with its padding, without
    the normalised, activated and padded copies of the slab."""
    rows = y.shape[AXIS] + sum(zero_rows)
    shape = y.shape[:AXIS] + (rows,) + y.shape[AXIS + 1:]
    padded = scratch.get(name, shape, rows, dtype).view(shape)
    x = padded.narrow(AXIS, zero_rows[0], y.shape[AXIS])
    for start, count in ((0, zero_rows[0]), (rows - zero_rows[1], zero_rows[1])):
        if count:
            padded.narrow(AXIS, start, count).zero_()
    torch.addcmul(shift, y, scale, out=x)
    x.relu_()
    return padded, x


class _ScaleShift(torch.autograd.Function):
    """``x * scale + shift``, scale and shift per (sample or 1, channel), whose backward takes the
    sums over the slab for scale's and shift's gradients without a product the size of the slab
    (autograd's own addcmul makes two, x * 1 and that times the gradient: two slab-sized
    allocations more for every normalisation of every slab in backward)."""

    @staticmethod
    def forward(ctx, x, scale, shift):
        ctx.save_for_backward(x, scale)
        ctx.shift_shape = shift.shape
        return _scaled_and_shifted(x, scale, shift)

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad * scale if grad.dtype == scale.dtype else torch.mul(grad, scale, out=torch.empty_like(x))
        grad_scale = _sum_to(_products_summed(grad, x), scale.shape) if ctx.needs_input_grad[1] else None
        grad_shift = _sum_to(_summed(grad), ctx.shift_shape) if ctx.needs_input_grad[2] else None
        return grad_x, grad_scale, grad_shift


def _summed(a: torch.Tensor) -> torch.Tensor:
    """``a`` summed over the spatial dims (N, C, 1, ...), in float32 at least (bf16/fp16 sums over a
    slab are not rounded to their dtype before the slabs are added)."""
    return a.sum(tuple(range(2, a.dim())), keepdim=True, dtype=accumulation_dtype(a.dtype))


def _products_summed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(a * b) summed over the spatial dims, per sample and channel (N, C, 1, ...), as one dot
    product per (sample, channel) where each one's values are contiguous (no product tensor is made;
    a slab narrowed along AXIS is such a view). In float32 at least: bf16/fp16 planes are widened
    one plane at a time (a dot of bf16 vectors would round each slab's sum to bf16)."""
    kept = a.shape[:2] + (1,) * (a.dim() - 2)
    planes_a, planes_b = _as_planes(a), _as_planes(b)
    dtype = accumulation_dtype(torch.promote_types(a.dtype, b.dtype))
    if planes_a is None or planes_b is None or a.dtype != b.dtype or a.device.type != "cpu":
        # Off the CPU one product and one reduction: a dot per plane is a kernel launch each, 2560
        # to 6656 a step for a 3D U-Net split in 16 slabs (base 16, batch 2).
        return _summed(a.to(dtype) * b.to(dtype))
    # One BLAS dot per plane: on this project's CPU 8x faster than (a * b).sum() and 17-34x faster
    # than torch.einsum or torch.bmm, which take the batched matrix product's path.
    return torch.stack([torch.dot(x.to(dtype), y.to(dtype)) for x, y in zip(planes_a, planes_b)]).reshape(kept)


def _as_planes(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` (N, C, ...) as a (N * C, values) view with contiguous rows; None where it is not one."""
    try:
        planes = tensor.view(tensor.shape[0] * tensor.shape[1], -1)
    except RuntimeError:
        return None
    return planes if planes.stride(1) == 1 else None


def _sum_to(value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``value`` (N, C, 1, ...) summed over the dims where ``shape`` has 1 (a statistic per channel)."""
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and value.shape[i] != 1)
    return value.sum(dims, keepdim=True) if dims else value


# PyTorch on CPU runs a float32 convolution with oneDNN only when its input's N * C * D * H exceeds
# this (else, for batch 1 without groups, "slow_conv3d": an im2col buffer of kernel volume x C_in values
# per output voxel, 27 x 16 x 4 bytes for a 3x3x3 kernel on 16 channels, far more than the slab
# saves; aten/src/ATen/native/Convolution.cpp, ConvParams::use_mkldnn). A slab is kept thick enough
# for every convolution of four or more input channels to stay on oneDNN; one of fewer channels has a
# small im2col buffer anyway, and so has an upsampling (kernel = stride: its column buffer is the
# size of its output). One whose whole input is too thin for oneDNN (batch 1, 8 channels, 48^3: 18432)
# runs im2col unsplit too, its buffer 27 x its input (117 MiB for MONAI SegResNet's 3.4 MiB feature
# map): it sets no limit, and each slab's buffer is the slab's share.
ONEDNN_MIN_INPUT_ELEMENTS = 20480
ONEDNN_MIN_CHANNELS = 4


def _most_slabs(graph: SlabGraph, batch: int, shapes: list[tuple[int, int]], device: torch.device) -> int:
    """How many slabs keep every convolution's slab thick enough for oneDNN (any number off the CPU)."""
    most = shapes[graph.output][0]
    if device.type != "cpu":
        return most
    for node in graph.nodes:
        if node.kind == "conv" and node.module.in_channels >= ONEDNN_MIN_CHANNELS and node.module.groups == 1:
            depth, height = shapes[node.inputs[0]]
            rows = ONEDNN_MIN_INPUT_ELEMENTS // (batch * node.module.in_channels * height) + 1
            if depth >= rows:   # else not on oneDNN even whole: im2col's buffer shrinks with the slab
                most = min(most, max(1, depth // rows))
    return most


def slab_bounds(depth: int, count: int) -> list[tuple[int, int]]:
    """``count`` (at most ``depth``) row ranges of near-equal size."""
    count = max(1, min(count, depth))
    edges = [depth * index // count for index in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _given(graph: SlabGraph, xs) -> dict[int, tuple[torch.Tensor, int]]:
    return {node: (x, 0) for node, x in zip(graph.inputs, xs)}


def _slab_of(graph: SlabGraph, target: int, low: int, high: int, depths: list[int], xs, stored: dict,
             statistics: dict, scratch: "_Scratch | None" = None, weights: dict | None = None) -> torch.Tensor:
    """Rows [low, high) of node ``target``'s output: read where it is stored, else computed from the
    graph's inputs and the stored nodes (each read as far as the rows need). With ``scratch`` the
    stored nodes are read into its buffers (`SlabGraph.run`): the slab returned may be a view of one,
    to be used before the next call with the same scratch."""
    if target in stored:
        return stored[target].read(low, high)
    given = _given(graph, xs)
    need = graph.rows_needed(target, low, high, depths, given.keys() | stored.keys())
    for node in need.keys() & stored.keys():
        first, last = need[node]
        store = stored[node]
        out = None if scratch is None else scratch.get(f"read {node}", store.shape, last - first, store.dtype)
        given[node] = (store.read(first, last, out=out), first)
    return graph.run(target, low, high, depths, given, statistics, scratch, weights)


def _statistics(graph: SlabGraph, xs, depths: list[int], count: int, stored: dict | None,
                known: dict, weights: dict | None = None) -> tuple[dict, dict]:
    """(mean, biased variance) of each normalisation's input over the whole volume, in
    `accumulation_dtype` of the input's dtype (float32 for bf16/fp16, as torch's kernels take them),
    and how many values each statistic is taken over, by normalisation node; those ``known``
    ({node: ((mean, variance), count)}, taken by another graph) are not taken again. With ``stored``
    (a dict), each normalisation's input is kept there once computed (`runtime.rows`), so that later
    ones start from it instead of computing it again."""
    statistics = {index: pair for index, (pair, _) in known.items()}
    counts = {index: values for index, (_, values) in known.items()}
    for index in graph.norms:
        if index in known:
            continue
        norm, source = graph.nodes[index].module, graph.nodes[index].inputs[0]
        keep = stored is not None and source not in stored and source not in graph.inputs and source != graph.output
        store, moments = None, []      # (values, mean, biased variance) of each slab
        scratch = _Scratch(xs[0].device)
        for low, high in slab_bounds(depths[source], count):
            slab = _slab_of(graph, source, low, high, depths, xs, stored or {}, statistics, scratch, weights)
            dtype, rounded = slab.dtype, statistics_rounded_to(norm, slab)
            if keep:
                if store is None:
                    shape = slab.shape[:AXIS] + (depths[source],) + slab.shape[AXIS + 1:]
                    store = row_store(shape, slab.dtype, slab.device)
                store.write(low, slab)
            grouped, dims = _grouped(norm, slab if slab.element_size() >= 4 else slab.float())
            variance, mean = torch.var_mean(grouped, dims, correction=0, keepdim=True)    # one pass, no copy
            moments.append((grouped.numel() // mean.numel(), mean.double(), variance.double()))
            del slab, grouped
        if store is not None:
            stored[source] = store
        values = sum(n for n, _, _ in moments)
        mean = sum(n * m for n, m, _ in moments) / values
        # Chan et al.'s combination: each slab's squared deviations about its own mean, plus its
        # count times its mean's squared deviation from the whole volume's.
        variance = sum(n * (v + (m - mean).square()) for n, m, v in moments) / values
        if rounded is not None:
            mean, variance = rounded_statistics(mean, variance, values, rounded)
        if not graph.nodes[index].recomputed:
            _update_running_statistics(norm, mean, variance, values)
        dtype = accumulation_dtype(dtype)
        statistics[index] = (mean.to(dtype), variance.to(dtype))
        counts[index] = values
    return statistics, counts


def _update_running_statistics(norm: nn.Module, mean: torch.Tensor, variance: torch.Tensor, count: int) -> None:
    """What BatchNorm's forward does to its buffers in training mode (momentum, or a cumulative average)."""
    if not (isinstance(norm, _BATCH_NORMS) and norm.training and norm.track_running_stats):
        return
    with torch.no_grad():
        norm.num_batches_tracked.add_(1)
        factor = norm.momentum if norm.momentum is not None else 1.0 / float(norm.num_batches_tracked)
        unbiased = variance * count / max(count - 1, 1)
        norm.running_mean.mul_(1 - factor).add_(mean.flatten().to(norm.running_mean.dtype), alpha=factor)
        norm.running_var.mul_(1 - factor).add_(unbiased.flatten().to(norm.running_var.dtype), alpha=factor)


@dataclass
class SharedNodes:
    """Nodes one graph in slabs kept (`runtime.rows`) that a later graph in slabs reads instead of
    computing them again, by key (`_Node.key`): the streamed outer level's encoder ops, which the
    decoder reads for the skip (runtime/stream.py). In backward the later graph runs first; where the
    earlier graph's backward will run as well, the later one adds the gradients it gives these nodes
    (and their normalisations' statistics) here and leaves taking them back to the earlier one, which
    takes its own with them: each shared op runs once backward, not once per graph. Else it takes
    them back itself."""

    stored: dict = field(default_factory=dict)              # key: store of the node's output
    statistics: dict = field(default_factory=dict)          # norm key: ((mean, variance), count)
    grad_stored: dict = field(default_factory=dict)         # key: store of the gradient given to the node
    grad_statistics: dict = field(default_factory=dict)     # norm key: [gradient of mean, of variance]
    node: object = None                                     # weakref to the earlier graph's backward node


@dataclass
class _Forward:
    """What a graph's forward in slabs measured and kept, for its backward."""

    graph: SlabGraph
    count: int
    depths: list[int]
    statistics: dict                # norm node: (mean, variance)
    counts: dict                    # norm node: how many values its statistics are taken over
    stored: dict                    # node: store of its output
    keeping: SharedNodes | None     # what this graph kept for a later one
    reading: SharedNodes | None     # what this graph read of an earlier one's
    shared: set                     # the nodes (stored, or normalisations) read from ``reading``
    autocast: SlabAutocast          # autocast as the forward ran under it: the backward runs the same


class _SlabbedGraph(torch.autograd.Function):
    """Saves the inputs (and the parameters, for autograd's version check) and nothing else of the volume."""

    @staticmethod
    def forward(ctx, graph: SlabGraph, slabs: int, inputs: int, keeping, reading, *tensors):
        xs, parameters = tensors[:inputs], tensors[inputs:]
        shapes = graph.shapes(xs)
        depths = [depth for depth, _ in shapes]
        count = min(slabs, _most_slabs(graph, xs[0].shape[0], shapes, xs[0].device))
        stored, known = {}, {}
        if reading is not None:
            stored = {index: reading.stored[node.key] for index, node in enumerate(graph.nodes)
                      if node.key is not None and node.key in reading.stored}
            known = {index: reading.statistics[graph.nodes[index].key] for index in graph.norms
                     if graph.nodes[index].key is not None and graph.nodes[index].key in reading.statistics}
        shared = set(stored) | set(known)
        autocast = SlabAutocast.current(xs[0].device)
        with autocast.ops():
            weights = autocast.cast_weights(graph)
            statistics, counts = _statistics(graph, xs, depths, count, stored if STORE_NORMALISATION_INPUTS else None,
                                             known, weights)
            output, scratch = None, _Scratch(xs[0].device)
            for low, high in slab_bounds(depths[graph.output], count):
                slab = _slab_of(graph, graph.output, low, high, depths, xs, stored, statistics, scratch, weights)
                if output is None:
                    output = slab.new_empty(slab.shape[:AXIS] + (depths[graph.output],) + slab.shape[AXIS + 1:])
                output.narrow(AXIS, low, high - low).copy_(slab)
                del slab
            del weights, scratch
        if keeping is not None:
            for index, store in stored.items():
                if graph.nodes[index].key is not None:
                    keeping.stored[graph.nodes[index].key] = store
            for index in graph.norms:
                if graph.nodes[index].key is not None:
                    keeping.statistics[graph.nodes[index].key] = (statistics[index], counts[index])
        elif not any(ctx.needs_input_grad):
            for index in set(stored) - shared:
                stored[index].close()
            stored = {index: stored[index] for index in shared if index in stored}
        ctx.made = _Forward(graph, count, depths, statistics, counts, stored, keeping, reading, shared, autocast)
        ctx.inputs = inputs
        ctx.save_for_backward(*xs, *parameters)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        xs, parameters = saved[:ctx.inputs], saved[ctx.inputs:]
        offset = 5          # graph, slabs, inputs, keeping, reading
        wanted = [ctx.needs_input_grad[offset + position] for position in range(ctx.inputs)]
        trained = [i for i in range(len(parameters)) if ctx.needs_input_grad[offset + ctx.inputs + i]]

        def through_output(out, low, high):
            return out, grad_output.narrow(AXIS, low, high - low)

        grad_inputs, grad_parameters = backward_in_slabs(ctx.made, xs, parameters, wanted, trained, through_output)
        return (None,) * offset + (*grad_inputs, *grad_parameters)


def backward_in_slabs(forward, xs, parameters, wanted: list[bool], trained: list[int], through_output):
    """The gradients of a graph's inputs (those ``wanted``) and parameters (those ``trained``) for the
    scalar ``through_output(output rows, low, high)`` summed over the slabs (or for the gradient of the
    output's rows, where it returns the pair (output rows, gradient)): ``forward`` holds what the
    graph's forward in slabs measured (graph, count, depths, statistics, counts, and the nodes it
    stored). Nodes are taken from the output back: each normalisation's input once every op after it
    has given it its gradient (through the normalised values, and through the statistics, d mean/dx =
    1/n, d var/dx = 2 (x - mean)/n); a stored one is recomputed only from the stored nodes and inputs
    before it, and its gradient is kept beside it."""
    with forward.autocast.ops(), _parameters_as_leaves(forward.graph, parameters) as leaves:
        # Each op in the dtype it had in forward; the gradients taken of ``leaves``, not of the parameters.
        backward = _Backward(forward, xs, leaves, wanted, trained)
        graph, stored = backward.graph, backward.stored
        for low, high in slab_bounds(backward.depths[graph.output], backward.count):
            backward.slab(graph.output, low, high, through_output)
        # Last first: a node's gradient is complete once every op after it has given its part.
        for source in sorted({graph.nodes[index].inputs[0] for index in graph.norms} | stored.keys(), reverse=True):
            if source not in backward.left_to_earlier:
                backward.node(source)
        grad_inputs, grad_parameters = backward.grad_inputs, backward.grad_parameters
        del backward
    # The graph's own stores go now, not with the autograd graph (which a caller may keep, with the
    # output, into the next step); a second backward (retain_graph) computes those nodes again.
    for index, store in forward.stored.items():
        if index not in forward.shared:
            store.close()
    return grad_inputs, grad_parameters


@contextlib.contextmanager
def _parameters_as_leaves(graph: SlabGraph, parameters):
    """``parameters`` (the graph's, as saved) replaced in their modules, while backward runs in
    slabs, by detached aliases (the same storage), which it takes its gradients of (yields them in
    the same order); the sums are returned through the graph's autograd function as usual. Taken of
    the parameters themselves, each ``torch.autograd.grad`` per slab would run their tensor hooks,
    which must run once per backward on the whole gradient: fp16's loss scaler divides by the scale
    there (`runtime.precision`), and would divide by it again for every slab. The swap is what
    ``torch.func.functional_call`` does; the modules get their parameters back however backward ends.
    (The graph's own, in the order it passed them to its function: those saved may come back from
    saved-tensor hooks as other tensor objects of the same parameters.)"""
    parameters = graph.parameters()
    aliases = {id(parameter): parameter.detach().requires_grad_(parameter.requires_grad) for parameter in parameters}
    owners = []
    for node in graph.nodes:
        if isinstance(node.module, nn.Module):
            for module in node.module.modules():
                owners += [(module, name, parameter) for name, parameter in module._parameters.items()
                           if parameter is not None and id(parameter) in aliases]
    try:
        for module, name, parameter in owners:
            module._parameters[name] = aliases[id(parameter)]
        yield [aliases[id(parameter)] for parameter in parameters]
    finally:
        for module, name, parameter in owners:
            module._parameters[name] = parameter


class _Scratch:
    """Flat buffers by name and dtype, reused for slabs of a few sizes (each grows to the largest asked for)."""

    def __init__(self, device: torch.device):
        self.device, self.buffers = device, {}

    def get(self, name: str, shape: tuple[int, ...], rows: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of ``rows`` rows along AXIS of a tensor of ``shape``, over the named buffer."""
        count = math.prod(shape) // shape[AXIS] * rows
        # By dtype too: under autocast one name serves values of two dtypes (a graph's fp32 input, its
        # bf16 nodes), which would otherwise take turns reallocating it.
        key = (name, dtype)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < count:
            self.buffers[key] = buffer = None       # the old one goes first
            self.buffers[key] = buffer = torch.empty(count, dtype=dtype, device=self.device)
        return buffer[:count]


class _Backward:
    """The sums one backward in slabs adds into (see `backward_in_slabs`)."""

    def __init__(self, forward: _Forward, xs, parameters, wanted: list[bool], trained: list[int]):
        self.forward, self.xs, self.parameters, self.wanted, self.trained = forward, xs, parameters, wanted, trained
        graph, self.depths, self.count = forward.graph, forward.depths, forward.count
        # Closed by an earlier backward of the same graph (retain_graph): computed again instead.
        self.stored = {index: store for index, store in forward.stored.items() if not store.closed}
        self.graph = graph
        self.read = set(graph.inputs) | self.stored.keys()
        self.grad_inputs = [torch.zeros_like(x) if want else None for x, want in zip(xs, wanted)]
        self.grad_parameters = [torch.zeros_like(parameter) if i in trained else None
                                for i, parameter in enumerate(parameters)]
        self.parameter_index = {id(parameter): i for i, parameter in enumerate(graph.parameters())}
        # Under autocast, the convolutions' weights in its dtype, cast once for the whole backward;
        # each records its cast, so that a weight's gradient reaches its fp32 parameter through it.
        with torch.enable_grad():
            self.weights = forward.autocast.cast_weights(graph)
        # Buffers reused slab after slab and node after node (new tensors would each be page-faulted
        # in under a low mmap threshold), each as large as the largest slab asked of it.
        self.scratch = _Scratch(xs[0].device)
        self.grad_statistics = {index: [torch.zeros_like(mean), torch.zeros_like(variance)]
                                for index, (mean, variance) in forward.statistics.items()}
        # The gradients an earlier graph's nodes got here: summed where that graph's backward takes
        # them (if it will run in this backward), each node taken back once, by that graph. A node
        # this graph also normalises itself is taken back here as well, with its own gradient and its
        # own normalisations' terms (the earlier graph takes back the rest).
        self.left_to_earlier, self.handed = set(), set()
        reading, keeping = forward.reading, forward.keeping
        earlier = reading.node() if reading is not None and reading.node is not None else None
        if earlier is not None and torch._C._will_engine_execute_node(earlier):
            for index in forward.shared & set(graph.norms):
                key = graph.nodes[index].key
                self.grad_statistics[index] = reading.grad_statistics.setdefault(key, self.grad_statistics[index])
                self.handed.add(index)
            own = {graph.nodes[index].inputs[0] for index in graph.norms if index not in self.handed}
            self.left_to_earlier = forward.shared & self.stored.keys() - own
            self.left_to_earlier |= {graph.nodes[index].inputs[0] for index in self.handed} - own - self.stored.keys()
        if keeping is not None:
            for index, node in enumerate(graph.nodes):
                if node.key in keeping.grad_statistics and index in self.grad_statistics:
                    self.grad_statistics[index] = keeping.grad_statistics.pop(node.key)
        # Each stored node's gradient store, made once (a whole volume of pinned memory beside a GPU):
        # the one a later graph left it, the earlier graph's it is handed to, or a new one. A sum (of
        # the ops reading the node, then its normalisations' terms), kept in `accumulation_dtype`:
        # for a bf16/fp16 node in float32, rounded to the node's dtype once, where it is used, as
        # torch's normalisation backward rounds its input's gradient once.
        self.grad_stored = {}
        for index, store in self.stored.items():
            key = graph.nodes[index].key
            if keeping is not None and key in keeping.grad_stored:
                self.grad_stored[index] = keeping.grad_stored.pop(key)
            elif index in self.left_to_earlier:
                if key not in reading.grad_stored:
                    reading.grad_stored[key] = row_store(store.shape, accumulation_dtype(store.dtype), xs[0].device)
                self.grad_stored[index] = reading.grad_stored[key]
            else:
                self.grad_stored[index] = row_store(store.shape, accumulation_dtype(store.dtype), xs[0].device)

    def _run(self, target: int, low: int, high: int, read_target: bool = False):
        """(rows [low, high) of node ``target``'s output computed with autograd recording, the slabs
        read as leaves [(node, first, last, slab)], the statistics as leaves {norm: (mean, variance)})
        from the inputs and stored nodes it needs; a stored target is computed from what it is computed
        from, or with ``read_target`` read (itself a leaf). Call under torch.enable_grad()."""
        graph, stored = self.graph, self.stored
        need = graph.rows_needed(target, low, high, self.depths, self.read)
        given, slabs = {}, []
        for node in sorted(need.keys() & self.read):
            if node == target and node in stored and not read_target:
                continue            # computed here from what it is computed from
            first, last = need[node]
            if node in stored:
                slab = stored[node].read(first, last).requires_grad_()
                slabs.append((node, first, last, slab))
            else:
                position = graph.inputs.index(node)
                wanted = self.wanted[position]
                slab = self.xs[position].narrow(AXIS, first, last - first).detach().requires_grad_(wanted)
                if wanted:
                    slabs.append((node, first, last, slab))
            given[node] = (slab, first)
        statistics = {index: tuple(s.detach().requires_grad_() for s in pair)
                      for index, pair in self.forward.statistics.items()}
        return graph.run(target, low, high, self.depths, given, statistics, weights=self.weights), slabs, statistics

    def _take_back(self, out: torch.Tensor, gradient, slabs: list, statistics: dict) -> None:
        """Backpropagate ``gradient`` (None: ``out`` is a scalar) from ``out`` to the leaves of `_run` and
        the trained parameters, and add what reaches them to the sums."""
        if not out.requires_grad:
            return      # nothing before this node needs a gradient (a frozen first layer, an input without one)
        leaves = [slab for *_, slab in slabs] + [s for index in self.graph.norms for s in statistics[index]]
        leaves += [self.parameters[i] for i in self.trained]
        grads = list(torch.autograd.grad(out, leaves, gradient, allow_unused=True))
        del out, gradient
        self._add(grads, slabs)

    def slab(self, target: int, low: int, high: int, surrogate) -> None:
        """Node ``target`` for rows [low, high) of its output, from the inputs and stored nodes it
        needs, with the statistics as leaves; the gradients of ``surrogate(output)`` are added to the
        sums. A target ReLU(normalisation(a node read)), or one op reading one, is computed from
        that ReLU written into reused buffers and taken back in place (`_after_normalised_relu`)."""
        node, relu = self.graph.nodes[target], target
        fused = self._relu_of_normalised(target) if FUSED_NORMALISED_RELU else None
        if fused is None and FUSED_NORMALISED_RELU and len(node.inputs) == 1 and node.kind in ("conv", "up", "down",
                                                                                              "pointwise"):
            fused, relu = self._relu_of_normalised(node.inputs[0]), node.inputs[0]
        if fused is not None:
            self._after_normalised_relu(target, relu, low, high, surrogate, *fused)
            return
        with torch.enable_grad():
            out, slabs, statistics = self._run(target, low, high)
            reached = surrogate(out, low, high)
            del out
            out, gradient = reached if isinstance(reached, tuple) else (reached, None)
            del reached
            self._take_back(out, gradient, slabs, statistics)

    def _convolved(self, source: int) -> bool:
        """Whether stored node ``source`` is a convolution's output that `_convolution` can take back
        without computing it again (a parameter as its weight, in the dtype the convolution ran in)."""
        node = self.graph.nodes[source]
        if node.kind != "conv" or source not in self.stored:
            return False
        weight = node.module.weight
        return (id(weight) in self.parameter_index
                and self.weights.get(id(weight), weight).dtype == self.stored[source].dtype)

    def _after_normalised_relu(self, target: int, relu: int, low: int, high: int, surrogate, norm: int,
                               read: int) -> None:
        """`slab` for a target that is ``relu``, ReLU(normalisation ``norm`` of node ``read``), or one op
        reading it: that ReLU is written into reused buffers and is a leaf (autograd runs the target's
        op, if any, and the surrogate), whose gradient is then taken back (`_normalised_relu_back`)."""
        first, last = (low, high) if relu == target else self.graph.rows_needed(target, low, high, self.depths,
                                                                                {relu})[relu]
        y = self._read(read, first, last, "y")
        _, x, scale, shift, mean, variance = self._normalised_relu_rows(norm, y, (0, 0))
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            out = leaf if relu == target else self.graph.run(target, low, high, self.depths, {relu: (leaf, first)}, {},
                                                             weights=self.weights)
            reached = surrogate(out, low, high)
            del out
            out, gradient = reached if isinstance(reached, tuple) else (reached, None)
            del reached
            if out is leaf and gradient is not None:
                grads = [gradient] + [None] * len(self.trained)
            else:
                leaves = [leaf] + [self.parameters[i] for i in self.trained]
                grads = list(torch.autograd.grad(out, leaves, gradient, allow_unused=True))
            del out, leaf
        for i, grad in zip(self.trained, grads[1:]):
            if grad is not None:
                self.grad_parameters[i].add_(grad)
        grad_x = grads[0]
        if grad_x is not None:
            # In place only into a tensor of its own: not the surrogate's gradient passed on by an op
            # (an Identity), nor a loss's expanded gradient (a sum's, one value for every element).
            owned = grad_x.is_contiguous() and (gradient is None or
                                               grad_x.untyped_storage().data_ptr() != gradient.untyped_storage().data_ptr())
            self._normalised_relu_back(norm, read, first, grad_x, x, y, scale, shift, mean, variance, owned=owned)

    def _relu_of_normalised(self, target: int) -> tuple[int, int] | None:
        """(normalisation node, its input) where node ``target`` is ReLU(that normalisation of a node
        read: stored, or an input); else None."""
        norm = self.graph.relu_of_normalisation(target)
        if norm is None or self.graph.nodes[norm].inputs[0] not in self.read:
            return None
        return norm, self.graph.nodes[norm].inputs[0]

    def _convolution(self, source: int, low: int, high: int, gradient: torch.Tensor) -> None:
        """Rows [low, high) of convolution node ``source``'s output taken back with ``gradient``, without
        computing them again: its input's rows (with the halo) are computed, or read, and
        `aten.convolution_backward` is called as autograd's own ConvolutionBackward calls it for
        `_convolve`'s convolution: the weight's and bias's gradients are added to the sums, the
        input's goes on back (`_normalised_relu_back` where the input is ReLU(normalisation(a node
        read)), else through autograd). An input concatenated along channels (a decoder's upsampled
        input and skip) is taken part by part, each with its slice of the weight (each input
        channel's gradients are sums over the output channels alone): the concatenation is never made.
        Under autocast the call gets what autocast gave the convolution: its input, weight (the copy
        cast once per backward) and output gradient in the autocast dtype; the input's gradient is
        then taken to its own dtype and the weight's added into the float32 sums, as autocast's cast
        passes each back."""
        node = self.graph.nodes[source]
        conv, before = node.module, node.inputs[0]
        first, last = max(0, low - node.halo), min(self.depths[before], high + node.halo)
        zero_rows = (first - (low - node.halo), high + node.halo - last)
        parts = [before]
        if self.graph.nodes[before].kind == "cat" and before not in self.read and conv.groups == 1:
            parts = list(self.graph.nodes[before].inputs)
        weight, bias = self.parameter_index[id(conv.weight)], self.parameter_index.get(id(conv.bias))
        cast = self.weights.get(id(conv.weight), conv.weight).detach()
        gradient = gradient.to(cast.dtype)
        channel = 0
        for position, part in enumerate(parts):
            fused = self._relu_of_normalised(part) if FUSED_NORMALISED_RELU else None
            if fused is not None:
                norm, read = fused
                y = self._read(read, first, last, "y")
                padded, x, scale, shift, mean, variance = self._normalised_relu_rows(norm, y, zero_rows)
            else:
                with torch.enable_grad():
                    x, slabs, statistics = self._run(part, first, last, read_target=True)
                padded = x.detach()
                if any(zero_rows):
                    padded = F.pad(padded, (0, 0) * (padded.dim() - AXIS - 1) + zero_rows)
            channels = padded.shape[1]
            padded, weights = padded.to(cast.dtype), cast
            if len(parts) > 1:
                weights = weights[:, channel:channel + channels]
            with_bias = conv.bias is not None and position == 0      # once, not once per part
            mask = [fused is not None or x.requires_grad, weight in self.trained, with_bias and bias in self.trained]
            if any(mask):
                # On CPU it may return gradients its mask did not ask for (the weight's with the bias's).
                grad_x, grad_weight, grad_bias = (grad if wanted else None for grad, wanted in zip(
                    torch.ops.aten.convolution_backward(
                        gradient, padded, weights, [conv.bias.shape[0]] if with_bias else None, conv.stride,
                        (0,) + padding_of(conv)[1:], conv.dilation, False, [0] * (padded.dim() - 2),
                        conv.groups, mask), mask))
                padded = None
                if grad_weight is not None:
                    into = self.grad_parameters[weight]
                    (into.narrow(1, channel, channels) if len(parts) > 1 else into).add_(grad_weight)
                if grad_bias is not None:
                    self.grad_parameters[bias].add_(grad_bias)
                if grad_x is not None:
                    grad_x = _rows_of(grad_x, zero_rows[0], last - first).to(x.dtype)
                    if fused is not None:
                        self._normalised_relu_back(norm, read, first, grad_x, x, y, scale, shift, mean, variance)
                    else:
                        with torch.enable_grad():
                            self._take_back(x, grad_x, slabs, statistics)
                del grad_x
            channel += channels
            x = padded = None

    def _read(self, node: int, first: int, last: int, name: str) -> torch.Tensor:
        """Rows [first, last) of a node read (stored: into a reused buffer; an input: a view of it)."""
        if node in self.stored:
            store = self.stored[node]
            return store.read(first, last, out=self.scratch.get(name, store.shape, last - first, store.dtype))
        return self.xs[self.graph.inputs.index(node)].narrow(AXIS, first, last - first).detach()

    def _normalised_relu_rows(self, norm: int, y: torch.Tensor, zero_rows: tuple[int, int]):
        """(ReLU(norm(y)) padded with ``zero_rows`` (`_normalised_relu_into`), its rows of ``y``, scale
        and shift recording their gradients, the statistics as leaves)."""
        mean, variance = (s.detach().requires_grad_() for s in self.forward.statistics[norm])
        with torch.enable_grad():
            scale, shift = _scale_and_shift(self.graph.nodes[norm].module, y, mean, variance)
        padded, x = _normalised_relu_into(self.scratch, "x", y, scale.detach(), shift.detach(), zero_rows,
                                          normalised_dtype(self.graph.nodes[norm].module, y))
        return padded, x, scale, shift, mean, variance

    def _normalised_relu_back(self, norm: int, read: int, first: int, grad_x: torch.Tensor, x: torch.Tensor,
                              y: torch.Tensor, scale, shift, mean, variance, owned: bool = True) -> None:
        """``grad_x`` (the gradient at x = ReLU(y * scale + shift)) taken back to ``y`` (node ``read``'s
        rows from ``first``), to scale and shift, and through them to the statistics and the
        normalisation's weight and bias: the same ops autograd would run (threshold_backward,
        `_ScaleShift.backward`), in place where ``grad_x`` is ``owned`` (else in one new tensor)."""
        if owned:
            torch.ops.aten.threshold_backward.grad_input(grad_x, x, 0, grad_input=grad_x)
        else:
            grad_x = torch.ops.aten.threshold_backward(grad_x, x, 0)
        grad_scale = _sum_to(_products_summed(grad_x, y), scale.shape)
        grad_shift = _sum_to(_summed(grad_x), shift.shape)
        module = self.graph.nodes[norm].module
        # Its parameters as trained (a parametrized weight's original, not the weight it makes).
        parameters = [self.parameter_index[id(p)] for p in module.parameters()
                      if id(p) in self.parameter_index and self.parameter_index[id(p)] in self.trained]
        leaves = [mean, variance] + [self.parameters[index] for index in parameters]
        grads = torch.autograd.grad([scale, shift], leaves, [grad_scale, grad_shift], allow_unused=True)
        for which, grad in enumerate(grads[:2]):
            if grad is not None:
                self.grad_statistics[norm][which].add_(grad)
        for index, grad in zip(parameters, grads[2:]):
            if grad is not None:
                self.grad_parameters[index].add_(grad)
        if read in self.stored and self.grad_stored[read].dtype != grad_x.dtype:
            grad_y = grad_x * scale.detach()        # into a float32 sum: not rounded to grad_x's dtype first
        else:
            grad_y = grad_x.mul_(scale.detach())
        if read in self.stored:
            self.grad_stored[read].add(first, grad_y)
        else:
            position = self.graph.inputs.index(read)
            if self.wanted[position]:
                self.grad_inputs[position].narrow(AXIS, first, grad_y.shape[AXIS]).add_(grad_y)

    def _add(self, grads: list, slabs: list) -> None:
        for node, first, last, _ in slabs:
            grad = grads.pop(0)
            if grad is None:
                continue
            if node in self.stored:
                self.grad_stored[node].add(first, grad)
            else:
                self.grad_inputs[self.graph.inputs.index(node)].narrow(AXIS, first, last - first).add_(grad)
        for index in self.graph.norms:
            for which in (0, 1):
                grad = grads.pop(0)
                if grad is not None:
                    self.grad_statistics[index][which].add_(grad)
        for i in self.trained:
            grad = grads.pop(0)
            if grad is not None:
                self.grad_parameters[i].add_(grad)

    def node(self, source: int) -> None:
        """Node ``source`` (a normalisation's input, or stored) taken back to what it is computed from,
        with the gradient reaching it: through the ops reading it (kept beside it, where stored) and
        through each normalisation's statistics, d mean/dx = 1/n and d var/dx = 2 (x - mean)/n. A
        stored convolution's output is not computed again (`_convolution`): the terms take its values
        as stored."""
        graph, statistics = self.graph, self.forward.statistics
        terms = [(graph.nodes[index].module, statistics[index][0],
                  *(grad / self.forward.counts[index] for grad in self.grad_statistics[index]))
                 for index in graph.norms if graph.nodes[index].inputs[0] == source and index not in self.handed]
        kept = self.grad_stored.get(source)

        def gradient_at(values: torch.Tensor, low: int, high: int, out: torch.Tensor | None = None) -> torch.Tensor:
            with torch.no_grad():
                gradient = (kept.read(low, high, out=out) if kept is not None
                            else torch.zeros_like(values, dtype=accumulation_dtype(values.dtype)))
                for norm, mean, grad_mean, grad_variance in terms:
                    grouped, _ = _grouped(norm, gradient)
                    values_grouped, _ = _grouped(norm, values)
                    grouped.addcmul_(values_grouped, 2 * grad_variance).add_(grad_mean - 2 * grad_variance * mean)
            return gradient

        if DIRECT_CONVOLUTION_BACKWARD and self._convolved(source):
            store = self.stored[source]
            for low, high in slab_bounds(self.depths[source], self.count):
                values = None
                if terms or kept is None:
                    # Into the buffer the convolution's input is read into next: these values are done with by then.
                    values = store.read(low, high, out=self.scratch.get("y", store.shape, high - low, store.dtype))
                out = None if kept is None else self.scratch.get("gradient", store.shape, high - low, kept.dtype)
                gradient = gradient_at(values, low, high, out)
                del values
                self._convolution(source, low, high, gradient)
                del gradient
        else:
            for low, high in slab_bounds(self.depths[source], self.count):
                self.slab(source, low, high,
                          lambda out, low, high: (out, gradient_at(out.detach(), low, high).to(out.dtype)))
        if kept is not None:
            self.grad_stored.pop(source).close()


def run_in_slabs(graph: SlabGraph, inputs, slabs: int, keeping: SharedNodes | None = None,
                 reading: SharedNodes | None = None) -> torch.Tensor:
    """``graph``'s output for ``inputs`` (a tensor or a tuple of tensors, each N, C, D, ...), computed
    in ``slabs`` slabs along D (fewer where a slab would be too thin, see `_most_slabs`). ``keeping``:
    the nodes with a key are kept there for a later graph; ``reading``: nodes with a key kept there
    by an earlier graph are read, not computed (see `SharedNodes`)."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if len(inputs) != len(graph.inputs):
        raise InputError(f"a graph computed in slabs takes {len(graph.inputs)} tensor inputs, got {len(inputs)}")
    # Each call: the modules' train/eval modes decide which normalisations use batch statistics.
    output = _SlabbedGraph.apply(graph.in_mode(), slabs, len(inputs), keeping, reading, *inputs, *graph.parameters())
    if keeping is not None and output.grad_fn is not None:
        keeping.node = weakref.ref(output.grad_fn)
    if output.requires_grad:
        # For a loss computed in slabs (runtime.loss_slabs): it runs this graph's backward itself,
        # slab by slab into the loss, and the output and its gradient are never needed whole.
        output._oomless_slabbed = SlabbedOutput(len(inputs), output._version, output.grad_fn)
    return output


@dataclass
class SlabbedOutput:
    """What made a graph's output in slabs: its backward node (what the forward measured, and its
    inputs as saved); no tensor of its own, so the output keeps nothing alive its node does not."""

    inputs: int             # how many of the node's saved tensors are the graph's inputs
    version: int            # the output's version then: written into since, it is no longer the graph's
    forward: object         # the graph's backward node
