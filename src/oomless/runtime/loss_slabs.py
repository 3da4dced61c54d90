"""A loss computed in slabs: none of its per-element tensors whole.

    loss = oomless.loss_in_slabs(F.cross_entropy, model(volume), labels)      # in the training loop
    plan = oomless.plan(model, volume, "1GiB", loss_fn=lambda out: oomless.loss_in_slabs(F.cross_entropy, out, labels))

PyTorch's cross-entropy over a whole 3D volume saves its log-probabilities (one more tensor the size
of the logits) and its backward makes two more (the log-probabilities' gradient, then the logits'):
at the outer level of a streamed U-Net, where the model's own tensors never exist whole, the loss is
what sets the floor. Here the forward sums the loss slab by slab along the first spatial axis (rows
for a (N, C) output) and saves nothing but the output and target it was given; the backward computes
each slab's gradient again and writes it into the output's gradient, the one whole tensor it makes.
On the output of a graph computed in slabs (`runtime.slabs`: a streamed model's decoder and head) it
goes further: its backward runs that graph's slabs itself with the loss's slab in place of a slab of
the output's gradient, so the output is freed after the forward and its gradient is never made.

The general form, `reduce_in_slabs`, is a differentiable function of whole-output sums: each slab
gives its partial sums (``partial``), the loss is ``total(sums)``; backward takes the gradient of
``total`` at the sums once and carries it into each slab. Cross-entropy with a mean is ``sum / count``;
a soft Dice is a ratio of two (tests/test_loss_slabs.py).

Not bit-equal to the loss computed whole: the sum runs over slabs in another order (within 1e-6
relative; tests/test_loss_slabs.py), and the gradient of a mean is scaled by ``grad / count`` in
another order of operations than PyTorch's (within float rounding: ~1e-9 on unit logits).
"""

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from oomless.errors import InputError
from oomless.runtime.slabs import AXIS, SlabbedOutput, backward_in_slabs, slab_bounds

# About this many bytes of the output per slab: its per-element temporaries stay near this size,
# and the per-slab call overhead stays small next to the arithmetic.
SLAB_BYTES = 4 * 2**20

# Losses whose mean divides by the weight of the targets counted (class weights, ignore_index) rather
# than by the number of elements (torch.nn.functional's nll_loss, and cross_entropy on class indices).
_WEIGHTED_MEANS = (F.cross_entropy, F.nll_loss)
# Losses whose mean is over every element of the output (a loss not named here, e.g. multi_margin_loss,
# averages over other counts: it is taken with reduction="sum" only).
_ELEMENT_MEANS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
                  F.binary_cross_entropy_with_logits, F.soft_margin_loss, F.poisson_nll_loss)


def _axes(output: torch.Tensor, target: torch.Tensor | None) -> tuple[int, int]:
    """The axis slabs are taken along in the output (the first spatial one, or the rows of (N, C))
    and the matching one in the target (which may lack the class axis)."""
    axis = 2 if output.dim() > 2 else 0
    if target is None or target.dim() == output.dim():
        return axis, axis
    if target.dim() == output.dim() - 1:
        return axis, (1 if axis == 2 else 0)
    raise InputError(f"loss_in_slabs: a target of shape {tuple(target.shape)} does not match an output of shape "
                     f"{tuple(output.shape)}; give one of the output's shape, or of its shape without the class axis")


def slab_count(output: torch.Tensor, axis: int) -> int:
    return max(1, min(output.shape[axis], math.ceil(output.numel() * output.element_size() / SLAB_BYTES)))


def _sum_over_slabs(pieces) -> tuple[torch.Tensor, torch.dtype]:
    """The slabs' partial sums added in float64 (a whole volume's sum overflows float16), and the
    pieces' own dtype."""
    sums = dtype = None
    for piece in pieces:
        dtype = piece.dtype
        sums = piece.double() if sums is None else sums + piece.double()
    return sums, dtype


def _gradient_at_sums(total: Callable[[torch.Tensor], torch.Tensor], sums: torch.Tensor,
                      grad_value: torch.Tensor) -> torch.Tensor:
    """The gradient of ``total`` at the whole-output sums (float64): what every slab's partial sums
    are weighted by."""
    with torch.enable_grad():
        leaf = sums.detach().requires_grad_()
        (grad,) = torch.autograd.grad(total(leaf), leaf, grad_value.to(leaf.dtype))
    return grad


class _ReducedInSlabs(torch.autograd.Function):
    """Saves the output and targets it is given (no copies) and the whole-output sums."""

    @staticmethod
    def forward(ctx, partial, total, dtype, axes, bounds, output, *targets):
        device_type = output.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.sums, pieces_dtype = _sum_over_slabs(partial(*_rows(axes, low, high, output, *targets))
                                                 for low, high in bounds)
        ctx.partial, ctx.total, ctx.axes, ctx.bounds = partial, total, axes, bounds
        ctx.save_for_backward(output, *targets)
        return total(ctx.sums).to(dtype or pieces_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_value):
        output, *targets = ctx.saved_tensors
        device_type = output.device.type
        enabled, dtype = ctx.autocast
        # The backward runs outside the forward's autocast: the slabs' ops run again under it, as
        # they ran in the forward (the same dtypes, so the same gradients).
        grad_sums = _gradient_at_sums(ctx.total, ctx.sums, grad_value)
        with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            grad_output = torch.empty_like(output)
            for low, high in ctx.bounds:
                rows, *target_rows = _rows(ctx.axes, low, high, output, *targets)
                rows = rows.detach().requires_grad_()
                piece = ctx.partial(rows, *target_rows)
                (grad,) = torch.autograd.grad(piece, rows, grad_sums.to(piece.dtype))
                grad_output.narrow(ctx.axes[0], low, high - low).copy_(grad)
        return (None, None, None, None, None, grad_output, *(None for _ in targets))


class _LossThroughSlabbedGraph(torch.autograd.Function):
    """A loss of a graph's output computed in slabs (`runtime.slabs`), fused with the graph's
    backward: the loss's sums come from the output as the forward made it; the backward runs the
    graph's slabs once more, as its own backward would, with the loss's slab in place of the slab of
    the output's gradient. Neither the output nor its gradient is needed whole: the output is freed
    with the caller's reference, and the gradient never exists."""

    @staticmethod
    def forward(ctx, made, partial, total, dtype, axes, bounds, output, target, *tensors):
        forward = made.forward
        ctx.sums, pieces_dtype = _sum_over_slabs(partial(*_rows(axes, low, high, output, target))
                                                 for low, high in bounds)
        ctx.partial, ctx.total, ctx.target_axis, ctx.inputs = partial, total, axes[1], made.inputs
        ctx.made = forward.made
        ctx.save_for_backward(target, *tensors)
        return total(ctx.sums).to(dtype or pieces_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_value):
        target, *tensors = ctx.saved_tensors
        xs, parameters = tensors[:ctx.inputs], tensors[ctx.inputs:]
        offset = 8          # made, partial, total, dtype, axes, bounds, output, target
        wanted = [ctx.needs_input_grad[offset + position] for position in range(ctx.inputs)]
        trained = [i for i in range(len(parameters)) if ctx.needs_input_grad[offset + ctx.inputs + i]]
        grad_sums = _gradient_at_sums(ctx.total, ctx.sums, grad_value)

        def through_loss(out, low, high):
            piece = ctx.partial(out, target.narrow(ctx.target_axis, low, high - low))
            return (piece * grad_sums.to(piece.dtype)).sum()

        grad_inputs, grad_parameters = backward_in_slabs(ctx.made, xs, parameters, wanted, trained, through_loss)
        return (None,) * offset + (*grad_inputs, *grad_parameters)


def _made_in_slabs(output: torch.Tensor, axes: tuple[int, int]) -> SlabbedOutput | None:
    """The record of the graph in slabs that made ``output``, where the loss can run through it."""
    made = getattr(output, "_oomless_slabbed", None)
    if made is None or axes[0] != AXIS or output._version != made.version or torch.is_autocast_enabled(output.device.type):
        return None
    return made if output.grad_fn is made.forward else None


def _rows(axes: tuple[int, int], low: int, high: int, output: torch.Tensor, *targets: torch.Tensor) -> list[torch.Tensor]:
    return [output.narrow(axes[0], low, high - low)] + [target.narrow(axes[1], low, high - low) for target in targets]


def reduce_in_slabs(partial: Callable[..., torch.Tensor], total: Callable[[torch.Tensor], torch.Tensor],
                    output: torch.Tensor, *targets: torch.Tensor, slabs: int | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """``total(sums)``, where ``sums`` (float64) is the sum over slabs of ``partial(output rows,
    *target rows)`` (a 1-D tensor, differentiable in the output rows), in ``dtype`` (default: the
    partial sums' own); the gradient reaches ``output`` slab by slab. Targets get no gradient."""
    if any(target.requires_grad for target in targets):
        raise InputError("loss_in_slabs computes no gradient for the target, and this one requires one: detach "
                         "it, or call the loss itself")
    axes = _axes(output, targets[0] if targets else None)
    for target in targets:
        if target.shape[axes[1]] != output.shape[axes[0]]:
            raise InputError(f"loss_in_slabs: the target's {target.shape[axes[1]]} rows along axis {axes[1]} do not "
                             f"match the output's {output.shape[axes[0]]} along axis {axes[0]}")
    if slabs is not None and slabs < 1:
        raise InputError(f"loss_in_slabs: slabs={slabs}; give a positive number of slabs, or None to choose")
    bounds = slab_bounds(output.shape[axes[0]], slabs or slab_count(output, axes[0]))
    made = _made_in_slabs(output, axes) if len(targets) == 1 and slabs is None else None
    if made is not None:
        # The output goes in detached: its graph's own backward must not run (it would be given a
        # gradient of zeros, whole); this one reaches the graph's inputs and parameters directly.
        # Its inputs as the graph saved them (the record on the output holds none: it would keep
        # every level's inputs alive as long as the output, past its backward).
        inputs = made.forward.saved_tensors[:made.inputs]
        return _LossThroughSlabbedGraph.apply(made, partial, total, dtype, axes, bounds, output.detach(), targets[0],
                                              *inputs, *made.forward.made.graph.parameters())
    return _ReducedInSlabs.apply(partial, total, dtype, axes, bounds, output, *targets)


def _counted(target_rows: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """Slab rows' share of nll_loss's divisor for a mean: the summed class weights (1 each without
    ``weight``) of the targets not ignored."""
    kept = target_rows != ignore_index
    return kept.sum() if weight is None else weight[target_rows[kept]].sum()


def loss_in_slabs(loss: Callable[..., torch.Tensor], output: torch.Tensor, target: torch.Tensor, *,
                  reduction: str = "mean", slabs: int | None = None, **keywords) -> torch.Tensor:
    """``loss(output, target, reduction=reduction, **keywords)`` computed in slabs (module docstring).

    ``loss`` is a torch.nn.functional loss taking ``reduction`` (cross_entropy, nll_loss, mse_loss,
    l1_loss, smooth_l1_loss, huber_loss, binary_cross_entropy_with_logits, ...); ``output`` is
    (N, C, spatial...) or (N, C), the target has the output's shape or lacks its class axis (class
    indices of any integer dtype: each slab is made int64, as PyTorch's losses take them, so uint8
    labels need an eighth of int64's memory whole). ``slabs``: how many (default: about 4 MiB of the
    output each). On the output of a graph computed in slabs (a streamed model's, `runtime.slabs`)
    the loss runs through that graph's slabs in backward, and neither the output nor its gradient is
    needed whole."""
    if reduction not in ("mean", "sum"):
        raise InputError(f"loss_in_slabs takes reduction 'mean' or 'sum', not {reduction!r}: with 'none' the "
                         "per-element loss is whole anyway; call the loss itself")
    if not callable(loss):
        raise InputError(f"loss_in_slabs: {loss!r} is not a loss function; give e.g. torch.nn.functional.cross_entropy")
    loss, keywords = _unwrapped(loss, keywords)
    name = getattr(loss, "__name__", repr(loss))
    axis, target_axis = _axes(output, target)
    class_indices = not target.is_floating_point() and target.dim() == output.dim() - 1
    try:
        with torch.no_grad():
            probe = target.narrow(target_axis, 0, 1)
            dtype = loss(output.narrow(axis, 0, 1), probe.long() if class_indices else probe, reduction="sum",
                         **keywords).dtype
    except TypeError as error:
        raise InputError(f"loss_in_slabs: {name!r} does not take reduction='sum' ({error}); give a "
                         "torch.nn.functional loss, or use oomless.runtime.loss_slabs.reduce_in_slabs with partial "
                         "sums of your own") from error
    weighted_mean = reduction == "mean" and loss in _WEIGHTED_MEANS and class_indices
    if reduction == "mean" and not weighted_mean and loss not in _ELEMENT_MEANS + (F.cross_entropy,):
        raise InputError(f"loss_in_slabs does not know what {name}'s mean divides by; give reduction='sum' and "
                         "divide the result yourself, or use oomless.runtime.loss_slabs.reduce_in_slabs")
    weight, ignore_index = keywords.get("weight"), keywords.get("ignore_index", -100)
    half_precision = dtype in (torch.float16, torch.bfloat16)

    def partial(rows: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
        if class_indices:
            target_rows = target_rows.long()     # a no-op on int64; uint8 labels take an eighth of it whole
        if half_precision:
            # A 16-bit sum overflows (float16 past 65504) or rounds away (bfloat16): each element's
            # loss in the loss's dtype, their sum in float64, as PyTorch accumulates a reduction in float32.
            value = loss(rows, target_rows, reduction="none", **keywords).double().sum().reshape(1)
        else:
            value = loss(rows, target_rows, reduction="sum", **keywords).reshape(1)
        if not weighted_mean:
            return value
        # The mean's divisor counted in the same pass (no gradient: a function of the target alone),
        # in float64: float16 and bfloat16 count integers exactly only to 2048 and 256.
        return torch.cat([value.double(), _counted(target_rows, weight, ignore_index).reshape(1).double()])

    if reduction == "sum":
        divisor = None
    elif weighted_mean:
        divisor = "counted"
    elif loss is F.cross_entropy:        # class probabilities: the mean is over every position, not class
        divisor = output.numel() // output.shape[1] if output.dim() > 1 else 1
    else:
        divisor = output.numel()

    def total(sums: torch.Tensor) -> torch.Tensor:
        if divisor is None:
            return sums[0]
        return sums[0] / (sums[1].detach() if divisor == "counted" else divisor)

    return reduce_in_slabs(partial, total, output, target, slabs=slabs, dtype=dtype)


def _unwrapped(loss, keywords: dict) -> tuple[Callable, dict]:
    """The loss function under ``functools.partial`` wrappers, with their keywords (the call's win)."""
    while isinstance(loss, functools.partial):
        if loss.args:
            raise InputError("loss_in_slabs: a functools.partial with positional arguments is not a loss of "
                             "(output, target); bind keywords only")
        keywords = {**loss.keywords, **keywords}
        loss = loss.func
    return loss, keywords
