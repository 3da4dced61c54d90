"""Batch statistics over the global batch, so N processes normalise exactly what one process would.

Data parallel with plain BatchNorm normalises each rank's shard by the shard's own mean and variance,
which is a different model from the one-process run on the global batch. On CUDA torch's
``nn.SyncBatchNorm`` fixes that; it refuses CPU tensors (its kernels are CUDA-only), so for gloo on
CPU `GlobalBatchNorm` computes the same statistics with one collective each way, as ``SyncBatchNorm``
does: forward all-gathers every rank's per-channel mean and variance and combines them exactly,
backward all-reduces the two per-channel sums the input's gradient needs (`_GlobalBatchNorm`). It
ran two all-reduces each way before (sums, then centred sums of squares): on two ranks of this
project's 3D U-Net over gloo, each blocking collective cost ~2 ms of ranks waiting on each other,
and the 14 layers' 56 a step about as long as the step's compute.

What torch's ``SyncBatchNorm`` costs on CUDA (``torch/nn/modules/_functions.py``, read in torch
2.13): each layer's training forward all-gathers (mean, invstd, count) from every rank
(one all-gather, ``async_op=False``: the current stream waits, the host does not), then
drops ranks whose count is 0 with a boolean mask (``count_all[mask]``). That indexing has a
data-dependent shape: **one host synchronisation per BatchNorm layer per forward** (skipped only while
a CUDA graph is being captured; pytorch/pytorch#78549, #78656). Its backward all-reduces (sum_dy,
sum_dy_xmu) without any host synchronisation. ``GlobalBatchNorm`` has no host synchronisation (equal
shards: the count is known) and saves what BatchNorm saves (its input), but runs its statistics and
input gradient as several CPU kernels where ``SyncBatchNorm`` has fused CUDA ones, so ``SyncBatchNorm``
stays the CUDA choice until a GPU measurement says otherwise.

`convert_batchnorm_for_data_parallel` swaps the layers in place, reusing the same parameter and buffer
tensors, so parameter names, the optimizer and hooks installed on parent modules are unaffected. It
runs before a model is planned (the training loop converts, then plans): the layers are other modules
saving other tensors, and a plan made before would name blocks that no longer run and count storages
the step no longer saves. `statistics_of_each_rank` lets that profile run without collectives.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover every rank's shard (CPU / gloo counterpart of
    ``nn.SyncBatchNorm``); equal shards are assumed, as `local_batch_size` enforces. ``group``: the
    ranks whose shards form the batch (default the world; a pipeline's replicas of one stage)."""

    group: dist.ProcessGroup | None = None
    # True while profiled (`statistics_of_each_rank`): the same ops and saved tensors, no collective.
    each_rank_alone: bool = False

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if not self.training or (world_size == 1 and not self.each_rank_alone):
            return super().forward(input)
        self._check_input_dim(input)
        group = None if self.each_rank_alone else self.group
        output, mean, variance = _global_batch_norm(input, self.weight, self.bias, self.eps, group,
                                                    self.each_rank_alone)
        count = input.numel() // input.size(1) * (1 if self.each_rank_alone else world_size)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
                unbiased = variance * (count / max(count - 1, 1))
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        return output


# Run eagerly inside a compiled block (a graph break), as `sum_across_ranks` is: torch 2.11's dynamo
# dropped the backward of an autograd Function whose forward runs a collective.
@torch.compiler.disable
def _global_batch_norm(input, weight, bias, eps, group, alone):
    return _GlobalBatchNorm.apply(input, weight, bias, eps, group, alone)


def _gathered(tensor: torch.Tensor, group: dist.ProcessGroup | None, alone: bool) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first axis (this rank's alone)."""
    if alone:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def _summed(tensor: torch.Tensor, group: dist.ProcessGroup | None, alone: bool) -> torch.Tensor:
    if not alone:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class _GlobalBatchNorm(torch.autograd.Function):
    """Training BatchNorm over every rank's equal shard, in one collective each way, as torch's
    ``SyncBatchNorm`` runs on CUDA (its kernels ``batch_norm_stats``, ``batch_norm_elemt`` and the
    backward's are CUDA-only), through torch's fused CPU BatchNorm kernels.

    Forward: each rank's per-channel mean and biased variance in one pass (``batch_norm_update_stats``,
    Welford's; ``torch.var_mean`` took 4x as long), all-gathered and combined exactly for equal shards
    (Chan et al.'s pairwise update: the variance is the ranks' mean variance plus the variance of
    their means, so no E[x^2] - E[x]^2 cancellation); then torch's BatchNorm kernel normalises with
    those statistics (its inference path: x * scale + (bias - mean * scale), the form torch's training
    kernel on CPU takes too). Saved for backward: the input, as torch's BatchNorm saves it, and
    per-channel tensors. Backward: torch's BatchNorm backward with the global mean and invstd, which
    also gives the local sums of dy and dy xhat (the bias and weight gradients, this rank's own, as
    DDP averages them); one all-reduce of both sums; then the input gradient's correction from the
    local means of those sums to the global ones, c0 + c1 (x - mean) per channel, by the same kernel.
    A bf16/fp16 input is normalised in fp32 and its result given back in its dtype, as torch's
    BatchNorm kernels do (their accumulate type). Alone (profiled), the same kernels run, without the
    collectives, and the correction is zero."""

    @staticmethod
    def forward(ctx, input, weight, bias, eps, group, alone):
        dtype = input.dtype
        work = (input.float() if dtype in (torch.float16, torch.bfloat16) else input).contiguous()
        mean, variance = torch.batch_norm_update_stats(work, None, None, 0.0)
        ranks = _gathered(torch.stack([mean, variance]), group, alone)
        mean = ranks[:, 0].mean(dim=0)
        variance = ranks[:, 1].mean(dim=0) + (ranks[:, 0] - mean).square().mean(dim=0)
        output = torch.batch_norm(work, weight, bias, mean, variance, False, 0.0, eps, False)
        ctx.save_for_backward(work, weight, mean, torch.rsqrt(variance + eps))
        ctx.group, ctx.alone, ctx.dtype = group, alone, dtype
        ctx.local_count = work.numel() // work.size(1)
        ctx.count = ctx.local_count * ranks.size(0)
        ctx.mark_non_differentiable(mean, variance)
        return output.to(dtype), mean, variance

    @staticmethod
    def backward(ctx, grad_output, _mean, _variance):
        work, weight, mean, invstd = ctx.saved_tensors
        grad_output = grad_output.to(work.dtype).contiguous()
        # dx = scale (dy - S / n - xhat Q / n), S = sum(dy), Q = sum(dy xhat), scale = weight x invstd:
        # torch's kernel takes this rank's sums and count; the global ones differ by c0 + c1 (x - mean).
        grad_input, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_output, work, weight, None, None, mean, invstd, True, 0.0, [True, True, True])
        local = torch.stack([sum_dy, sum_dy_xhat])
        difference = local / ctx.local_count - _summed(local.clone(), ctx.group, ctx.alone) / ctx.count
        scale = invstd if weight is None else invstd * weight
        c0, c1 = scale * difference[0], scale * invstd * difference[1]
        # (x - mean) * c1 + c0 by the inference kernel: variance 1 and eps 0 make its invstd 1.
        grad_input += torch.batch_norm(work, c1, c0, mean, torch.full_like(mean, 1.0), False, 0.0, 0.0, False)
        needs = ctx.needs_input_grad
        grad_weight = sum_dy_xhat if weight is not None and needs[1] else None
        grad_bias = sum_dy if needs[2] else None
        return grad_input.to(ctx.dtype), grad_weight, grad_bias, None, None, None


@contextmanager
def statistics_of_each_rank(model: nn.Module):
    """Within the block, every `GlobalBatchNorm` of ``model`` normalises by this rank's own shard and
    runs no collective, through the same ops (so it saves the same tensors for backward). For
    profiling: each rank profiles its own shard, and a profile's number of forwards and backwards is
    its own (a fresh process measures a second sizing step; a rehearsed plan recomputes blocks), so
    all-reduces there would pair up differently on different ranks, or wait forever."""
    layers = [module for module in model.modules() if isinstance(module, GlobalBatchNorm)]
    for layer in layers:
        layer.each_rank_alone = True
    try:
        yield
    finally:
        for layer in layers:
            layer.each_rank_alone = False


def _replacement(module: _BatchNorm, device: torch.device, group: dist.ProcessGroup | None) -> nn.Module:
    if device.type == "cuda":
        replacement = nn.SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                       module.track_running_stats, process_group=group)
    else:
        replacement = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                      module.track_running_stats)
        replacement.group = group
    if module.affine:
        replacement.weight, replacement.bias = module.weight, module.bias       # the same Parameters
    if module.track_running_stats:
        replacement.running_mean, replacement.running_var = module.running_mean, module.running_var
        replacement.num_batches_tracked = module.num_batches_tracked
    replacement.train(module.training)
    return replacement


def convert_batchnorm_for_data_parallel(model: nn.Module, device: torch.device,
                                        group: dist.ProcessGroup | None = None) -> int:
    """Replace every BatchNorm in ``model`` in place by one whose statistics cover the shards of every
    rank in ``group`` (default: the world); return how many."""
    converted = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, (GlobalBatchNorm, nn.SyncBatchNorm)):
                setattr(parent, name, _replacement(child, device, group))
                converted += 1
    return converted
