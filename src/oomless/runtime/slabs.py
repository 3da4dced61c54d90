"""A chain of convolutions, normalisations and pointwise ops computed in slabs along one spatial axis.

The floor a plan reaches is the working set of its largest piece (DESIGN.md section 2). For a 3D
U-Net at full resolution that piece is one stage, conv-norm-act-conv-norm-act, whose backward holds
every intermediate of the whole volume at once, however its saved tensors are swapped. Here the stage
runs as one autograd function that saves only its input and computes forward and backward slab by
slab along the first spatial axis (the depth D of N, C, D, H, W), so the whole-volume tensors alive
are its input, its output, and their gradients; the rest is one slab's worth.

    chain = SlabChain.of(leaves(stage))    # None when some op cannot be computed in slabs
    output = run_in_slabs(chain, x, slabs=8)

Exact, with the ideas of StreamingCNN (Pinckaers et al., TPAMI 2020) and of operator tiling with
normalisation statistics aggregated over the whole volume:
- A convolution of stride 1 and "same" zero padding along D needs, for output rows [a, b), input rows
  [a - p, b + p) where p is its padding along D (the halo); rows outside the volume are its zero
  padding, added explicitly at the volume's ends, so each output row sees exactly the inputs it sees
  unsplit. Halos add up through the chain.
- A normalisation in training mode (BatchNorm, GroupNorm, InstanceNorm) needs statistics of the whole
  volume: a first pass over the slabs sums x and x^2 (float64) per statistic; the slabs then use them.
  Its backward needs sums over the whole volume too. They come from autograd: each slab's backward is
  taken with the statistics as leaves, which gives the gradient through the normalised values and the
  gradients of the statistics; a second pass per normalisation, last first, carries the gradients of
  its mean and variance back to the rows they were computed from (d mean/dx = 1/n,
  d var/dx = 2 (x - mean)/n).
Not bit-equal to the unsplit ops: the statistics and the weight gradients are sums over the whole
volume taken in another order (the tests bound the difference, about 1e-6 relative in float32).
Forward costs one more pass up to each normalisation, backward one more per normalisation.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

AXIS = 2    # the first spatial dimension of (N, C, D, ...)

_CONVOLUTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_POINTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
              nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.PReLU, nn.Identity)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@dataclass
class _Op:
    kind: str           # "conv" | "norm" | "pointwise"
    module: nn.Module
    halo: int = 0       # rows needed on each side along AXIS (convolutions)


def why_not_sliceable(module: nn.Module) -> str | None:
    """Why ``module`` (a leaf of a chain) cannot run in slabs along AXIS; None when it can."""
    if type(module) in _CONVOLUTIONS:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return (f"{type(module).__name__} with padding {module.padding!r} ({module.padding_mode}): "
                    "needs int zero padding")
        kernel, dilation = module.kernel_size[0], module.dilation[0]
        if module.stride[0] != 1 or dilation * (kernel - 1) != 2 * module.padding[0]:
            return (f"{type(module).__name__} stride {module.stride[0]}, kernel {kernel}, padding {module.padding[0]} "
                    "along the first spatial axis: needs stride 1 and padding that keeps the size")
        return None
    if isinstance(module, _POINTWISE):
        return None
    if isinstance(module, nn.Dropout) or isinstance(module, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)):
        return None if module.p == 0 else "dropout with p > 0 (its random mask would differ per slab)"
    if isinstance(module, _INSTANCE_NORMS) and module.track_running_stats:
        return "InstanceNorm with track_running_stats"
    if isinstance(module, _BATCH_NORMS + _INSTANCE_NORMS + (nn.GroupNorm,)):
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


class SlabChain:
    """The ops of a chain, with what each needs to run on a slab."""

    def __init__(self, ops: list[_Op]):
        self.ops = ops
        self.norm_indices = [index for index, op in enumerate(ops) if op.kind == "norm"]

    @classmethod
    def of(cls, modules: list[nn.Module]) -> "SlabChain | None":
        if not any(type(leaf) in _CONVOLUTIONS for leaf in modules):
            return None         # nothing a slab would shrink
        if any(why_not_sliceable(leaf) is not None for leaf in modules):
            return None
        ops = []
        for leaf in modules:
            if type(leaf) in _CONVOLUTIONS:
                ops.append(_Op("conv", leaf, leaf.padding[0]))
            elif _uses_batch_statistics(leaf):
                ops.append(_Op("norm", leaf))
            else:
                ops.append(_Op("pointwise", leaf))    # includes BatchNorm on its running statistics
        return cls(ops)

    def parameters(self) -> list[nn.Parameter]:
        return [parameter for op in self.ops for parameter in op.module.parameters()]

    def rows_needed(self, stop: int, low: int, high: int, depth: int) -> list[tuple[int, int]]:
        """Rows [low, high) of op ``stop - 1``'s output need these rows of each op's input; index i is
        op i's input (index ``stop`` the output itself), each clipped to the volume."""
        ranges = [(low, high)]
        for op in reversed(self.ops[:stop]):
            low, high = max(0, low - op.halo), min(depth, high + op.halo)
            ranges.append((low, high))
        return ranges[::-1]

    def run(self, stop: int, x: torch.Tensor, low: int, high: int, depth: int, statistics: list,
            x_low: int = 0) -> torch.Tensor:
        """Rows [low, high) of op ``stop - 1``'s output from ``x``, the input's rows from ``x_low`` on
        (the rows needed are taken by narrowing); ``statistics`` holds (mean, variance) of each
        normalisation before ``stop``."""
        ranges = self.rows_needed(stop, low, high, depth)
        first_low, first_high = ranges[0]
        current = x.narrow(AXIS, first_low - x_low, first_high - first_low)
        if self.ops and self.ops[0].kind != "conv":
            current = current.clone()       # an in-place first op must not write into the input
        norm = 0
        for index, op in enumerate(self.ops[:stop]):
            (in_low, in_high), (out_low, out_high) = ranges[index], ranges[index + 1]
            if op.kind == "conv":
                current = _convolve(op.module, current, (in_low - (out_low - op.halo), out_high + op.halo - in_high))
            elif op.kind == "norm":
                mean, variance = statistics[norm]
                current = _normalise(op.module, current, mean, variance)
                norm += 1
            else:
                current = op.module(current)
        return current


def _convolve(conv: nn.Module, x: torch.Tensor, zero_rows: tuple[int, int]) -> torch.Tensor:
    """``conv`` with its zero padding along AXIS given explicitly (only where the slab meets the volume's end)."""
    if any(zero_rows):
        x = F.pad(x, (0, 0) * (x.dim() - AXIS - 1) + zero_rows)
    padding = (0,) + tuple(conv.padding[1:])
    return _CONVOLUTIONS[type(conv)](x, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)


def _grouped(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` shaped so that each statistic reduces over the returned dims (kept as size 1)."""
    if isinstance(norm, nn.GroupNorm):
        grouped = x.reshape(x.shape[0], norm.num_groups, x.shape[1] // norm.num_groups, *x.shape[2:])
        return grouped, tuple(range(2, grouped.dim()))
    if isinstance(norm, _INSTANCE_NORMS):
        return x, tuple(range(2, x.dim()))
    return x, (0,) + tuple(range(2, x.dim()))       # BatchNorm: per channel


def _normalise(norm: nn.Module, x: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    grouped, _ = _grouped(norm, x)
    normalised = ((grouped - mean) * torch.rsqrt(variance + norm.eps)).reshape(x.shape)
    if getattr(norm, "weight", None) is not None:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        normalised = normalised * norm.weight.reshape(shape) + norm.bias.reshape(shape)
    return normalised


# PyTorch on CPU runs a float32 convolution with oneDNN only when its input's N * C * D * H exceeds
# this (else, for batch 1 without groups, "slow_conv3d": an im2col buffer of kernel volume x C_in values
# per output voxel, 27 x 16 x 4 bytes for a 3x3x3 kernel on 16 channels, far more than the slab
# saves; aten/src/ATen/native/Convolution.cpp, ConvParams::use_mkldnn). A slab is kept thick enough
# for every convolution of four or more input channels to stay on oneDNN; one of fewer channels has a
# small im2col buffer anyway.
ONEDNN_MIN_INPUT_ELEMENTS = 20480
ONEDNN_MIN_CHANNELS = 4


def _min_rows(chain: SlabChain, x: torch.Tensor) -> int:
    if x.device.type != "cpu" or x.dim() < 4:
        return 1
    rows = [ONEDNN_MIN_INPUT_ELEMENTS // (x.shape[0] * op.module.in_channels * x.shape[AXIS + 1]) + 1
            for op in chain.ops if op.kind == "conv" and op.module.in_channels >= ONEDNN_MIN_CHANNELS
            and op.module.groups == 1]
    return max(rows, default=1)


def _slab_bounds(depth: int, slabs: int, min_rows: int = 1) -> list[tuple[int, int]]:
    """``slabs`` (fewer where a slab would be thinner than ``min_rows``) row ranges of near-equal size."""
    count = max(1, min(slabs, depth // max(min_rows, 1)))
    edges = [depth * index // count for index in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _statistics(chain: SlabChain, x: torch.Tensor, bounds: list[tuple[int, int]]) -> tuple[list, list[int]]:
    """(mean, biased variance) of each normalisation's input over the whole volume, in x's dtype, and
    how many values each statistic is taken over."""
    depth, statistics, counts = x.shape[AXIS], [], []
    for index in chain.norm_indices:
        norm = chain.ops[index].module
        total = total_squares = None
        count = 0
        for low, high in bounds:
            slab = chain.run(index, x, low, high, depth, statistics)
            grouped, dims = _grouped(norm, slab.double())
            sums, squares = grouped.sum(dims, keepdim=True), grouped.square().sum(dims, keepdim=True)
            total = sums if total is None else total + sums
            total_squares = squares if total_squares is None else total_squares + squares
            count += grouped.numel() // sums.numel()
        mean = total / count
        variance = (total_squares / count - mean.square()).clamp_min(0)
        _update_running_statistics(norm, mean, variance, count)
        statistics.append((mean.to(x.dtype), variance.to(x.dtype)))
        counts.append(count)
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


class _Accumulators:
    """Gradients of the input, the statistics and the parameters, summed over slabs and passes."""

    def __init__(self, x, x_needs_grad: bool, statistics, parameters, trained: list[int]):
        self.x = torch.zeros_like(x) if x_needs_grad else None
        self.statistics = [[torch.zeros_like(mean), torch.zeros_like(variance)] for mean, variance in statistics]
        self.parameters = [torch.zeros_like(parameter) if i in trained else None
                           for i, parameter in enumerate(parameters)]

    def add(self, x_rows: tuple[int, int], grads: list, statistics_used: int, trained: list[int]) -> None:
        grads = list(grads)
        if self.x is not None:
            grad = grads.pop(0)
            if grad is not None:
                self.x.narrow(AXIS, x_rows[0], x_rows[1] - x_rows[0]).add_(grad)
        for position in range(statistics_used):
            for which in (0, 1):
                grad = grads.pop(0)
                if grad is not None:
                    self.statistics[position][which].add_(grad)
        for i in trained:
            grad = grads.pop(0)
            if grad is not None:
                self.parameters[i].add_(grad)


class _SlabbedChain(torch.autograd.Function):
    """Saves the input (and the parameters, for autograd's version check) and nothing else of the volume."""

    @staticmethod
    def forward(ctx, chain: SlabChain, slabs: int, x: torch.Tensor, *parameters):
        depth, output = x.shape[AXIS], None
        bounds = _slab_bounds(depth, slabs, _min_rows(chain, x))
        statistics, counts = _statistics(chain, x, bounds)
        for low, high in bounds:
            slab = chain.run(len(chain.ops), x, low, high, depth, statistics)
            if output is None:
                output = slab.new_empty(slab.shape[:AXIS] + (depth,) + slab.shape[AXIS + 1:])
            output.narrow(AXIS, low, high - low).copy_(slab)
            del slab
        ctx.chain, ctx.bounds, ctx.statistics, ctx.counts = chain, bounds, statistics, counts
        ctx.save_for_backward(x, *parameters)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, *parameters = ctx.saved_tensors
        chain, depth = ctx.chain, x.shape[AXIS]
        x_needs_grad = ctx.needs_input_grad[2]
        trained = [i for i in range(len(parameters)) if ctx.needs_input_grad[3 + i]]
        sums = _Accumulators(x, x_needs_grad, ctx.statistics, parameters, trained)

        def backpropagate(stop: int, low: int, high: int, surrogate) -> None:
            """Ops [0, stop) for rows [low, high) of op stop - 1's output, with the statistics they use
            as leaves; the gradients of ``surrogate(output)`` go into ``sums``."""
            x_low, x_high = chain.rows_needed(stop, low, high, depth)[0]
            used = sum(1 for index in chain.norm_indices if index < stop)
            with torch.enable_grad():
                x_slab = x.narrow(AXIS, x_low, x_high - x_low).detach().requires_grad_(x_needs_grad)
                statistics = [tuple(s.detach().requires_grad_() for s in pair) for pair in ctx.statistics[:used]]
                scalar = surrogate(chain.run(stop, x_slab, low, high, depth, statistics, x_low), low, high)
                inputs = ([x_slab] if x_needs_grad else []) + [s for pair in statistics for s in pair]
                inputs += [parameters[i] for i in trained]
                grads = torch.autograd.grad(scalar, inputs, allow_unused=True)
            sums.add((x_low, x_high), grads, used, trained)

        def through_output(out, low, high):
            return (out * grad_output.narrow(AXIS, low, high - low)).sum()

        for low, high in ctx.bounds:
            backpropagate(len(chain.ops), low, high, through_output)
        # Last normalisation first: its statistics' gradients are complete once every later op's are in.
        for position in reversed(range(len(chain.norm_indices))):
            index = chain.norm_indices[position]
            norm, count = chain.ops[index].module, ctx.counts[position]
            mean = ctx.statistics[position][0]
            grad_mean, grad_variance = (grad / count for grad in sums.statistics[position])

            def through_statistics(out, low, high, norm=norm, mean=mean, grad_mean=grad_mean,
                                   grad_variance=grad_variance):
                grouped, _ = _grouped(norm, out)
                return (grouped * grad_mean).sum() + ((grouped - mean).square() * grad_variance).sum()

            for low, high in ctx.bounds:
                backpropagate(index, low, high, through_statistics)
        return (None, None, sums.x, *sums.parameters)


def run_in_slabs(chain: SlabChain, x: torch.Tensor, slabs: int) -> torch.Tensor:
    """``chain``'s output for ``x`` (N, C, D, ...), computed in ``slabs`` slabs along D."""
    return _SlabbedChain.apply(chain, slabs, x, *chain.parameters())
