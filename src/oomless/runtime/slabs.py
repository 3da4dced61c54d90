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
``torch.fx`` traces to these ops only: convolutions of stride 1 and "same" zero padding along D,
transposed convolutions that upsample along D without overlap (kernel = stride, no padding),
BatchNorm / GroupNorm / InstanceNorm, pointwise activations, concatenation along channels, addition.

Exact, with the ideas of StreamingCNN (Pinckaers et al., TPAMI 2020) and of operator tiling with
normalisation statistics aggregated over the whole volume:
- Rows [a, b) of a node's output need rows of each of its inputs: [a - p, b + p) for a convolution
  of padding p along D (the halo), [a / s, b / s) (rounded outwards) for an upsampling by s, [a, b)
  for the rest. Needs are propagated from the output back to the inputs (a node several ops read is
  computed once per slab, over the union of their needs). Rows outside the volume are a
  convolution's zero padding, added explicitly at the volume's ends, so each output row sees exactly
  the inputs it sees unsplit.
- A normalisation in training mode needs statistics of the whole volume: a first pass over the slabs
  sums x and x^2 (float64) per statistic; the slabs then use them. Its backward needs sums over the
  whole volume too. They come from autograd: each slab's backward is taken with the statistics as
  leaves, which gives the gradient through the normalised values and the gradients of the
  statistics; a second pass per normalisation, last first, carries the gradients of its mean and
  variance back to the rows they were computed from (d mean/dx = 1/n, d var/dx = 2 (x - mean)/n).
Not bit-equal to the unsplit ops: the statistics and the weight gradients are sums over the whole
volume taken in another order (the tests bound the difference, about 1e-6 relative in float32).
Forward costs one more pass up to each normalisation, backward one more per normalisation.
"""

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from oomless.errors import InputError

AXIS = 2    # the first spatial dimension of (N, C, D, ...)

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


def why_not_sliceable(module: nn.Module) -> str | None:
    """Why ``module`` (an op of a graph) cannot run in slabs along AXIS; None when it can."""
    if type(module) in _CONVOLUTIONS:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return (f"{type(module).__name__} with padding {module.padding!r} ({module.padding_mode}): "
                    "needs int zero padding")
        kernel, dilation = module.kernel_size[0], module.dilation[0]
        if module.stride[0] != 1 or dilation * (kernel - 1) != 2 * module.padding[0]:
            return (f"{type(module).__name__} stride {module.stride[0]}, kernel {kernel}, padding {module.padding[0]} "
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
    if isinstance(module, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)):
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
        return _Node("conv", (source,), module, halo=module.padding[0], function=_CONVOLUTIONS[type(module)])
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


def writes_into_a_shared_value(nodes: list[_Node]) -> bool:
    """Whether an in-place op writes into a value another op reads (then the order of ops matters)."""
    readers = [sum(source in node.inputs for node in nodes) for source in range(len(nodes))]
    return any(node.inplace and readers[node.inputs[0]] > 1 for node in nodes)


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
    if output is None or not inputs or writes_into_a_shared_value(nodes):
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
                if len(sizes) != 1:
                    raise InputError(f"a graph computed in slabs {node.kind}s tensors of different spatial sizes "
                                     f"{sorted(sizes)}; remove the split (oomless.remove) for such inputs")
                shapes.append(shapes[node.inputs[0]])
        return shapes

    def rows_needed(self, target: int, low: int, high: int, depths: list[int]) -> dict[int, tuple[int, int]]:
        """{node: rows of its output} that rows [low, high) of node ``target``'s output need, each clipped to the volume."""
        need = {target: (low, high)}
        for index in reversed(range(target + 1)):
            if index not in need:
                continue
            node, (low, high) = self.nodes[index], need[index]
            for source in node.inputs:
                if node.kind == "conv":
                    rows = (max(0, low - node.halo), min(depths[source], high + node.halo))
                elif node.kind == "up":
                    rows = (low // node.scale, -(-high // node.scale))
                elif node.kind == "down":
                    rows = (low * node.scale, min(depths[source], high * node.scale))
                else:
                    rows = (low, high)
                if source in need:
                    rows = (min(rows[0], need[source][0]), max(rows[1], need[source][1]))
                need[source] = rows
        return need

    def run(self, target: int, low: int, high: int, depths: list[int], given: dict[int, tuple[torch.Tensor, int]],
            statistics: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Rows [low, high) of node ``target``'s output. ``given`` maps each input node to a tensor
        holding its rows from an offset on (the rows needed are taken by narrowing); ``statistics``
        holds (mean, variance) of each normalisation node the target depends on."""
        need = self.rows_needed(target, low, high, depths)
        left = {index: sum(1 for user in need if index in self.nodes[user].inputs) for index in need}
        values: dict[int, torch.Tensor] = {}

        def rows(source: int, low: int, high: int) -> torch.Tensor:
            return values[source].narrow(AXIS, low - need[source][0], high - low)

        for index in sorted(need):
            node, (low, high) = self.nodes[index], need[index]
            if node.kind == "input":
                tensor, offset = given[index]
                value = tensor.narrow(AXIS, low - offset, high - low)
            elif node.kind == "conv":
                source = node.inputs[0]
                first, last = max(0, low - node.halo), min(depths[source], high + node.halo)
                value = _convolve(node, rows(source, first, last),
                                  (first - (low - node.halo), high + node.halo - last))
            elif node.kind == "up":
                source = node.inputs[0]
                first, last = low // node.scale, -(-high // node.scale)
                value = _upsample(node, rows(source, first, last)).narrow(
                    AXIS, low - first * node.scale, high - low)
            elif node.kind == "down":      # forward, not the module's call: its hooks are for when it runs whole
                value = node.module.forward(rows(node.inputs[0], low * node.scale, high * node.scale))
            elif node.kind == "norm":
                value = _normalise(node.module, rows(node.inputs[0], low, high), *statistics[index])
            elif node.kind == "pointwise":
                source = node.inputs[0]
                value = rows(source, low, high)
                if node.inplace and (self.nodes[source].kind == "input" or _shares_storage(value, given)):
                    value = value.clone()       # an in-place op must not write into an input
                value = node.module.forward(value) if isinstance(node.module, nn.Module) else node.module(value)
            elif node.kind == "cat":
                value = torch.cat([rows(source, low, high) for source in node.inputs], dim=1)
            else:
                value = rows(node.inputs[0], low, high) + rows(node.inputs[1], low, high)
            values[index] = value
            for source in set(node.inputs):
                left[source] -= 1
                if left[source] == 0:
                    del values[source]
        return values[target]


def _shares_storage(value: torch.Tensor, given: dict) -> bool:
    """Whether ``value`` is a view of one of the inputs (e.g. through an Identity)."""
    pointer = value.untyped_storage().data_ptr()
    return any(tensor.untyped_storage().data_ptr() == pointer for tensor, _ in given.values())


def _convolve(node: _Node, x: torch.Tensor, zero_rows: tuple[int, int]) -> torch.Tensor:
    """A convolution with its zero padding along AXIS given explicitly (only where the slab meets the volume's end)."""
    if any(zero_rows):
        x = F.pad(x, (0, 0) * (x.dim() - AXIS - 1) + zero_rows)
    conv = node.module
    padding = (0,) + tuple(conv.padding[1:])
    return node.function(x, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)


def _upsample(node: _Node, x: torch.Tensor) -> torch.Tensor:
    up = node.module
    return node.function(x, up.weight, up.bias, up.stride, up.padding, up.output_padding, up.groups, up.dilation)


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


def _normalise(norm: nn.Module, x: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """``x`` normalised as ``x * scale + shift`` (scale = weight / sqrt(variance + eps), shift = bias -
    mean * scale, per channel and sample), the form PyTorch's own CPU batch norm computes: one op over
    the slab, which saves only ``x`` for backward."""
    scale = _per_channel(norm, torch.rsqrt(variance + norm.eps), x)
    shift = -_per_channel(norm, mean, x) * scale
    if getattr(norm, "weight", None) is not None:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        weight = norm.weight.reshape(shape)
        scale, shift = scale * weight, shift * weight + norm.bias.reshape(shape)
    return torch.addcmul(shift, x, scale)


# PyTorch on CPU runs a float32 convolution with oneDNN only when its input's N * C * D * H exceeds
# this (else, for batch 1 without groups, "slow_conv3d": an im2col buffer of kernel volume x C_in values
# per output voxel, 27 x 16 x 4 bytes for a 3x3x3 kernel on 16 channels, far more than the slab
# saves; aten/src/ATen/native/Convolution.cpp, ConvParams::use_mkldnn). A slab is kept thick enough
# for every convolution of four or more input channels to stay on oneDNN; one of fewer channels has a
# small im2col buffer anyway, and so has an upsampling (kernel = stride: its column buffer is the
# size of its output).
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
            most = min(most, max(1, depth // rows))
    return most


def slab_bounds(depth: int, count: int) -> list[tuple[int, int]]:
    """``count`` (at most ``depth``) row ranges of near-equal size."""
    count = max(1, min(count, depth))
    edges = [depth * index // count for index in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _given(graph: SlabGraph, xs) -> dict[int, tuple[torch.Tensor, int]]:
    return {node: (x, 0) for node, x in zip(graph.inputs, xs)}


def _statistics(graph: SlabGraph, xs, depths: list[int], count: int) -> tuple[dict, dict]:
    """(mean, biased variance) of each normalisation's input over the whole volume, in the input's
    dtype, and how many values each statistic is taken over, by normalisation node."""
    statistics, counts = {}, {}
    for index in graph.norms:
        norm, source = graph.nodes[index].module, graph.nodes[index].inputs[0]
        total = total_squares = None
        values = 0
        for low, high in slab_bounds(depths[source], count):
            slab = graph.run(source, low, high, depths, _given(graph, xs), statistics)
            grouped, dims = _grouped(norm, slab.double())
            sums, squares = grouped.sum(dims, keepdim=True), grouped.square().sum(dims, keepdim=True)
            total = sums if total is None else total + sums
            total_squares = squares if total_squares is None else total_squares + squares
            values += grouped.numel() // sums.numel()
        mean = total / values
        variance = (total_squares / values - mean.square()).clamp_min(0)
        if not graph.nodes[index].recomputed:
            _update_running_statistics(norm, mean, variance, values)
        statistics[index] = (mean.to(xs[0].dtype), variance.to(xs[0].dtype))
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


class _SlabbedGraph(torch.autograd.Function):
    """Saves the inputs (and the parameters, for autograd's version check) and nothing else of the volume."""

    @staticmethod
    def forward(ctx, graph: SlabGraph, slabs: int, inputs: int, *tensors):
        xs, parameters = tensors[:inputs], tensors[inputs:]
        shapes = graph.shapes(xs)
        depths = [depth for depth, _ in shapes]
        count = min(slabs, _most_slabs(graph, xs[0].shape[0], shapes, xs[0].device))
        statistics, counts = _statistics(graph, xs, depths, count)
        output = None
        for low, high in slab_bounds(depths[graph.output], count):
            slab = graph.run(graph.output, low, high, depths, _given(graph, xs), statistics)
            if output is None:
                output = slab.new_empty(slab.shape[:AXIS] + (depths[graph.output],) + slab.shape[AXIS + 1:])
            output.narrow(AXIS, low, high - low).copy_(slab)
            del slab
        ctx.graph, ctx.count, ctx.depths, ctx.inputs = graph, count, depths, inputs
        ctx.statistics, ctx.counts = statistics, counts
        ctx.save_for_backward(*xs, *parameters)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        xs, parameters = saved[:ctx.inputs], saved[ctx.inputs:]
        wanted = [ctx.needs_input_grad[3 + position] for position in range(ctx.inputs)]
        trained = [i for i in range(len(parameters)) if ctx.needs_input_grad[3 + ctx.inputs + i]]

        def through_output(out, low, high):
            return (out * grad_output.narrow(AXIS, low, high - low)).sum()

        grad_inputs, grad_parameters = backward_in_slabs(ctx, xs, parameters, wanted, trained, through_output)
        return (None, None, None, *grad_inputs, *grad_parameters)


def backward_in_slabs(forward, xs, parameters, wanted: list[bool], trained: list[int], through_output):
    """The gradients of a graph's inputs (those ``wanted``) and parameters (those ``trained``) for the
    scalar ``through_output(output rows, low, high)`` summed over the slabs: ``forward`` holds what the
    graph's forward in slabs measured (graph, count, depths, statistics, counts)."""
    graph, depths, count = forward.graph, forward.depths, forward.count
    grad_inputs = [torch.zeros_like(x) if want else None for x, want in zip(xs, wanted)]
    grad_statistics = {index: [torch.zeros_like(mean), torch.zeros_like(variance)]
                       for index, (mean, variance) in forward.statistics.items()}
    grad_parameters = [torch.zeros_like(parameter) if i in trained else None
                       for i, parameter in enumerate(parameters)]

    def backpropagate(target: int, low: int, high: int, surrogate) -> None:
        """The graph up to node ``target`` for rows [low, high) of its output, with the statistics
        as leaves; the gradients of ``surrogate(output)`` are added to the sums above."""
        need = graph.rows_needed(target, low, high, depths)
        with torch.enable_grad():
            given, slabs = {}, []
            for position, node in enumerate(graph.inputs):
                if node in need:
                    first, last = need[node]
                    slab = xs[position].narrow(AXIS, first, last - first).detach().requires_grad_(wanted[position])
                    given[node] = (slab, first)
                    if wanted[position]:
                        slabs.append((position, first, last, slab))
            statistics = {index: tuple(s.detach().requires_grad_() for s in pair)
                          for index, pair in forward.statistics.items()}
            scalar = surrogate(graph.run(target, low, high, depths, given, statistics), low, high)
            leaves = [slab for *_, slab in slabs] + [s for index in graph.norms for s in statistics[index]]
            leaves += [parameters[i] for i in trained]
            grads = list(torch.autograd.grad(scalar, leaves, allow_unused=True))
        for position, first, last, _ in slabs:
            grad = grads.pop(0)
            if grad is not None:
                grad_inputs[position].narrow(AXIS, first, last - first).add_(grad)
        for index in graph.norms:
            for which in (0, 1):
                grad = grads.pop(0)
                if grad is not None:
                    grad_statistics[index][which].add_(grad)
        for i in trained:
            grad = grads.pop(0)
            if grad is not None:
                grad_parameters[i].add_(grad)

    for low, high in slab_bounds(depths[graph.output], count):
        backpropagate(graph.output, low, high, through_output)
    # Last normalisation first: its statistics' gradients are complete once every later op's are in.
    for index in reversed(graph.norms):
        norm, source, values = graph.nodes[index].module, graph.nodes[index].inputs[0], forward.counts[index]
        mean = forward.statistics[index][0]
        grad_mean, grad_variance = (grad / values for grad in grad_statistics[index])

        def through_statistics(out, low, high, norm=norm, mean=mean, grad_mean=grad_mean,
                               grad_variance=grad_variance):
            grouped, _ = _grouped(norm, out)
            return (grouped * grad_mean).sum() + ((grouped - mean).square() * grad_variance).sum()

        for low, high in slab_bounds(depths[source], count):
            backpropagate(source, low, high, through_statistics)
    return grad_inputs, grad_parameters


def run_in_slabs(graph: SlabGraph, inputs, slabs: int) -> torch.Tensor:
    """``graph``'s output for ``inputs`` (a tensor or a tuple of tensors, each N, C, D, ...), computed
    in ``slabs`` slabs along D (fewer where a slab would be too thin, see `_most_slabs`)."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if len(inputs) != len(graph.inputs):
        raise InputError(f"a graph computed in slabs takes {len(graph.inputs)} tensor inputs, got {len(inputs)}")
    # Each call: the modules' train/eval modes decide which normalisations use batch statistics.
    output = _SlabbedGraph.apply(graph.in_mode(), slabs, len(inputs), *inputs, *graph.parameters())
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
