"""A language model's head and its cross-entropy in chunks of rows: the logits never whole.

    body, head = model.base_model, model.get_output_embeddings()          # Hugging Face causal LM
    loss_fn = lambda out: oomless.linear_cross_entropy(out.last_hidden_state[:, :-1], head.weight, tokens[:, 1:])
    plan = oomless.plan(body, tokens, memory="2GiB", loss_fn=loss_fn, optimizer=optimizer)
    ...
    loss = oomless.linear_cross_entropy(body(tokens).last_hidden_state[:, :-1], head.weight, tokens[:, 1:])

Over a large vocabulary the logits are the largest tensors of a training step: GPT-2's 50,257
classes at 8 x 1024 tokens are 1.6 GB in fp32, and ``F.cross_entropy(lm_head(hidden), labels)``
saves them, its log-probabilities (as many bytes again) and, in backward, makes their gradient and
the logits' (seed 004; torchtune's ``LinearCrossEntropyLoss`` and Liger's fused linear cross-entropy
answer the same). Here the head's matrix product and the loss run over chunks of rows: each chunk's
logits are made, reduced to its rows' losses and, when a gradient will be needed, turned into the
chunk's logit gradient at once (softmax minus the target), which is multiplied into the hidden
states' and the weight's gradients and freed. Backward only scales those gradients by the loss's
own gradient: no product is computed twice, and nothing logits-sized is saved or made whole.

Memory: one chunk's logits (about ``CHUNK_BYTES`` in fp32, `default_chunk_rows`) at a time, their
gradient made in place, plus the hidden states' gradient (their size) and the weight's, summed in
fp32 (the head's parameter size for fp32 weights, which the plain step also makes when backward
starts; twice it, plus a low-precision product per chunk and a copy back, for bf16/fp16 weights).
Made in the loss's forward instead, they are held until backward starts, which follows at once in a
training step; a loss computed with gradients enabled but never backpropagated (an evaluation loop
without ``torch.no_grad``) pays for them all the same.

Equal to ``F.cross_entropy(F.linear(hidden, weight, bias), target)`` to float rounding, not bit for
bit: the weight's gradient sums over rows chunk by chunk, in another order than one product does
(tests/test_linear_loss.py: within 2e-6 relative in fp32). Under autocast the products run in the
autocast dtype and the softmax in fp32, as autocast runs ``linear`` and ``cross_entropy``; each
chunk's weight gradient is added in fp32, where plain autocast rounds the whole sum to bf16 once.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from oomless.errors import InputError

# About this many bytes of fp32 logits per chunk, in a multiple of CHUNK_ROWS_MULTIPLE rows (whole
# tiles for the matrix kernels). Smaller chunks hold less but make thinner products, and each chunk
# reads and writes the whole weight gradient once: GPT-2's head over 4096 rows on the CPU machine
# took 1.55x plain's time at 64 rows, 1.08x at 128 (this default), 0.90x at 1024, holding 171, 184
# and 391 MiB against plain's 2388 (bench/results/linear-loss-cpu-2026-11-26.json).
CHUNK_BYTES = 32 * 2**20
CHUNK_ROWS_MULTIPLE = 64
# Under bf16/fp16 each chunk's weight gradient is a low-precision product of the weight's size added
# to the fp32 sum, which costs more per chunk: chunks this many times larger. On the CPU machine, bf16,
# GPT-2's head over 4096 rows: 128 rows 2.25x plain's time, 512 rows 0.92x, 1024 rows 0.78x, holding
# 470, 506 and 556 MiB against plain's 2439 (the fp32 sum and the weight's casts dominate).
LOW_PRECISION_CHUNK_FACTOR = 4


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, chunk_rows: int | None = None,
                         compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the logits whole
    (module docstring).

    ``hidden`` (..., D) the states the head reads; ``weight`` (V, D) and ``bias`` (V,) the head's;
    ``target`` (...) class indices of any integer dtype, ``ignore_index`` where no loss is taken.
    ``reduction`` "mean" (over the targets not ignored) or "sum"; ``label_smoothing`` as PyTorch's.
    ``chunk_rows``: rows per chunk (default: about ``CHUNK_BYTES`` of fp32 logits each).
    ``compute_dtype`` (e.g. torch.bfloat16): the products' dtype, as autocast of that dtype would run
    them, where the loss runs outside autocast (under `oomless.fit(..., precision="bf16")` the model's
    outputs come back in fp32 and the loss runs in fp32); default: autocast's, else the inputs'."""
    _check(hidden, weight, target, bias, reduction, label_smoothing, chunk_rows, compute_dtype)
    _check_classes(target, weight.shape[0], ignore_index)
    rows = hidden.shape[:-1].numel()
    dtype = compute_dtype or _compute_dtype(hidden, weight)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], low_precision=dtype != torch.float32)
    # The loss in the logits' dtype, as F.cross_entropy returns it; fp32 where autocast (or
    # compute_dtype) sets the products' dtype, as autocast runs cross_entropy in fp32.
    loss_dtype = torch.float32 if compute_dtype is not None or _autocast_on(hidden.device.type) else dtype
    tensors = (hidden, weight) + (() if bias is None else (bias,))
    with_gradients = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return _LinearCrossEntropy.apply(hidden, weight, bias, target.reshape(rows), ignore_index, reduction,
                                     label_smoothing, min(chunk_rows, max(rows, 1)), with_gradients, dtype,
                                     loss_dtype)


def default_chunk_rows(classes: int, low_precision: bool = False) -> int:
    """Rows per chunk for a head of ``classes`` outputs: about ``CHUNK_BYTES`` of fp32 logits (GPT-2's
    50,257 classes: 128 rows, 25 MiB; Llama 3's 128,256: 64 rows, 31 MiB), ``LOW_PRECISION_CHUNK_FACTOR``
    times that where the products run in bf16/fp16 (GPT-2's: 640 rows)."""
    rows = CHUNK_BYTES * (LOW_PRECISION_CHUNK_FACTOR if low_precision else 1) // (4 * classes)
    return max(rows - rows % CHUNK_ROWS_MULTIPLE, CHUNK_ROWS_MULTIPLE)


def _check(hidden, weight, target, bias, reduction, label_smoothing, chunk_rows, compute_dtype) -> None:
    if reduction not in ("mean", "sum"):
        raise InputError(f"linear_cross_entropy takes reduction 'mean' or 'sum', not {reduction!r}; for "
                         "per-token losses compute the logits yourself (they are what this avoids)")
    if not (isinstance(hidden, torch.Tensor) and hidden.is_floating_point() and hidden.dim() >= 1):
        raise InputError("linear_cross_entropy: hidden must be a floating-point tensor (..., D) of the states "
                         "the head reads, e.g. a Hugging Face model's last_hidden_state")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InputError(f"linear_cross_entropy: weight of shape {tuple(weight.shape)} does not map hidden states of "
                         f"size {hidden.shape[-1]}; give the head's weight (vocabulary, {hidden.shape[-1]}), "
                         "e.g. model.get_output_embeddings().weight")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise InputError(f"linear_cross_entropy: bias of shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise InputError(f"linear_cross_entropy: target must hold class indices (an integer dtype), not "
                         f"{target.dtype}; probabilities per class would be logits-sized")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise InputError(f"linear_cross_entropy: target of shape {tuple(target.shape)} does not match hidden "
                         f"states of shape {tuple(hidden.shape)}: one class index per row, shape "
                         f"{tuple(hidden.shape[:-1])} (shift them yourself for next-token prediction)")
    if not 0.0 <= label_smoothing <= 1.0:
        raise InputError(f"linear_cross_entropy: label_smoothing must be within [0, 1], got {label_smoothing}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise InputError(f"linear_cross_entropy: chunk_rows must be a positive int, got {chunk_rows!r}")
    if compute_dtype is not None and compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InputError(f"linear_cross_entropy: compute_dtype must be torch.float32, bfloat16 or float16, "
                         f"got {compute_dtype!r}")


def _check_classes(target: torch.Tensor, classes: int, ignore_index: int) -> None:
    """Class indices out of range are an error, as in F.cross_entropy (one host sync; a gather would
    otherwise read another class's logit silently). Not checkable on meta tensors (target planning)."""
    if target.device.type == "meta" or target.numel() == 0:
        return
    outside = (target != ignore_index) & ((target < 0) | (target >= classes))
    if bool(outside.any()):
        found = target[outside][0].item()
        raise InputError(f"linear_cross_entropy: target holds class index {found}, outside the head's {classes} "
                         f"classes (0..{classes - 1}); mark rows without a target with ignore_index={ignore_index}")


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``; never for devices it does not know (meta tensors of
    a target's profile, whose precision `profile.fake_autocast` applies around this function)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here: autocast's where it is on (linear is
    one of its low-precision ops on every device), else the wider of the two."""
    device_type = hidden.device.type
    if _autocast_on(device_type) and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_loss(rows, labels, kept, weight, bias, label_smoothing: float, with_gradient: bool):
    """The summed loss of ``rows`` and, where ``with_gradient``, the summed loss's gradient with
    respect to their logits (in the products' dtype): softmax - (1 - e) one-hot - e / V on the rows
    counted, 0 on the others, made in place in the logits' own buffer. Not divided by a mean's count
    here: entries up to 1 in fp16 keep their digits, where p / count (p ~ 1 / V) would fall below
    fp16's smallest subnormal before a loss scale could lift it; backward applies both factors."""
    classes = weight.shape[0]
    indices = labels.clamp(0, classes - 1).long().unsqueeze(1)     # ignored rows' are masked below
    logits = F.linear(rows, weight, bias).float()
    picked = logits.gather(1, indices).squeeze(1)
    average = logits.mean(dim=1) if label_smoothing else None
    # The softmax in place (logsumexp would make another chunk-sized tensor).
    maximum = logits.amax(dim=1, keepdim=True)
    exponentials = logits.sub_(maximum).exp_()
    sums = exponentials.sum(dim=1)
    normaliser = sums.log().add_(maximum.squeeze(1))
    losses = normaliser - picked
    if label_smoothing:
        losses = (1.0 - label_smoothing) * losses + label_smoothing * (normaliser - average)
    total = torch.where(kept, losses, 0.0).sum()
    if not with_gradient:
        return total, None
    gradient = exponentials.div_(sums.unsqueeze(1))
    gradient.scatter_add_(1, indices, torch.full_like(picked, label_smoothing - 1.0).unsqueeze(1))
    if label_smoothing:
        gradient.sub_(label_smoothing / classes)
    gradient.mul_(kept.unsqueeze(1))            # rows not counted: no gradient
    return total, gradient.to(rows.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_rows,
                with_gradients, dtype, loss_dtype):
        states = hidden.reshape(-1, hidden.shape[-1])
        # Cast once, as autocast's weight cache does, not once per chunk.
        weight_cast = weight.to(dtype)
        bias_cast = None if bias is None else bias.to(dtype)
        counted = target != ignore_index
        count = counted.sum()
        # A mean's divisor, applied to the loss here and to the gradients in backward.
        scale = 1.0 / count.to(torch.float32) if reduction == "mean" else torch.ones((), device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        needs = ctx.needs_input_grad
        grad_states = torch.empty_like(states) if with_gradients and needs[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_gradients and needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if with_gradients and bias is not None and needs[2] \
            else None
        # Autocast stays out of the chunks: their products are cast by hand above, and the softmax runs
        # in fp32 as autocast runs cross_entropy.
        with torch.autocast(hidden.device.type, enabled=False) if torch.amp.is_autocast_available(
                hidden.device.type) else contextlib.nullcontext():
            for start in range(0, states.shape[0], chunk_rows):
                rows = states[start:start + chunk_rows].to(dtype)
                chunk = slice(start, start + chunk_rows)
                chunk_total, gradient = _chunk_loss(rows, target[chunk], counted[chunk], weight_cast, bias_cast,
                                                    label_smoothing, with_gradients)
                total += chunk_total
                if gradient is None:
                    continue
                if grad_states is not None:
                    grad_states[chunk] = gradient @ weight_cast
                if grad_weight is not None and dtype == torch.float32:
                    grad_weight.addmm_(gradient.t(), rows)      # in place: no weight-sized temporary
                elif grad_weight is not None:
                    grad_weight += gradient.t() @ rows          # a product in the low dtype, summed in fp32
                if grad_bias is not None:
                    grad_bias += gradient.sum(dim=0)
                del gradient        # before the next chunk's logits are made: one chunk at a time
        ctx.gradients = (grad_states, grad_weight, grad_bias)
        ctx.shapes_dtypes = (hidden.shape, weight.dtype, None if bias is None else bias.dtype)
        # Backward's factor beyond its own gradient: a mean's 1 / count, 0 with every row ignored (the
        # loss nan, as PyTorch's, and the gradients zero, as PyTorch's; 0 x inf would give nan).
        ctx.factor = torch.where(count > 0, scale, 0.0) if reduction == "mean" else scale
        loss = total * scale if reduction == "mean" else total
        return loss.to(loss_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.gradients is None:
            raise RuntimeError("linear_cross_entropy's gradients were made in its forward and are used once; "
                               "call it again for another backward (retain_graph does not keep them)")
        grad_states, grad_weight, grad_bias = ctx.gradients
        ctx.gradients = None     # freed as backward hands them on
        hidden_shape, weight_dtype, bias_dtype = ctx.shapes_dtypes
        factor = grad_loss.to(torch.float32) * ctx.factor
        results = []
        for gradient, dtype in ((grad_states, None), (grad_weight, weight_dtype), (grad_bias, bias_dtype)):
            if gradient is not None:
                gradient = gradient.mul_(factor)
                if dtype is not None and gradient.dtype != dtype:
                    gradient = gradient.to(dtype)
            results.append(gradient)
        grad_hidden = None if results[0] is None else results[0].reshape(hidden_shape)
        return grad_hidden, results[1], results[2], None, None, None, None, None, None, None, None
