"""Batch statistics over the global batch, so N processes normalise exactly what one process would.

Data parallel with plain BatchNorm normalises each rank's shard by the shard's own mean and variance,
which is a different model from the one-process run on the global batch. On CUDA torch's
``nn.SyncBatchNorm`` fixes that; it refuses CPU tensors (its kernels are CUDA-only), so for gloo on
CPU `GlobalBatchNorm` computes the same statistics with differentiable all-reduces
(`sum_across_ranks`): per-channel sums, then the mean, then the centred
sum of squares (two passes, so the variance does not suffer the E[x^2] - E[x]^2 cancellation).

What torch's ``SyncBatchNorm`` costs on CUDA (``torch/nn/modules/_functions.py``, read in torch
2.13): each layer's training forward all-gathers (mean, invstd, count) from every rank
(one all-gather, ``async_op=False``: the current stream waits, the host does not), then
drops ranks whose count is 0 with a boolean mask (``count_all[mask]``). That indexing has a
data-dependent shape: **one host synchronisation per BatchNorm layer per forward** (skipped only while
a CUDA graph is being captured; pytorch/pytorch#78549, #78656). Its backward all-reduces (sum_dy,
sum_dy_xmu) without any host synchronisation. ``GlobalBatchNorm`` has no host synchronisation (equal
shards: the count is known), but two all-reduces per layer forward and unfused elementwise kernels
(it saves one input-sized tensor for backward, as BatchNorm does), so ``SyncBatchNorm`` stays the CUDA
choice until a GPU measurement says otherwise.

`convert_batchnorm_for_data_parallel` swaps the layers in place, reusing the same parameter and buffer
tensors, so parameter names, the optimizer and hooks installed on parent modules are unaffected. It
runs before a model is planned (the training loop converts, then plans): the layers are other modules
saving other tensors, and a plan made before would name blocks that no longer run and count storages
the step no longer saves. `statistics_of_each_rank` lets that profile run without collectives.
"""

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from oomless.parallel.process_group import sum_across_ranks


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
        if self.each_rank_alone:
            world_size, total = 1, _this_rank_only
        else:
            total = partial(sum_across_ranks, group=self.group)
        # A bf16/fp16 input (a convolution's output under autocast) is normalised in fp32 and the
        # result given back in its dtype, as torch's BatchNorm kernels do (their accumulate type):
        # statistics summed in bf16 lose up to 2^-8 of each sum, and the running statistics with them.
        dtype, input = input.dtype, input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = [0, *range(2, input.dim())]
        count = input.numel() // input.size(1) * world_size
        mean = total(input.sum(dim=dims)) / count
        shape = [1, -1] + [1] * (input.dim() - 2)
        centred = input - mean.view(shape)
        variance = total((centred * centred).sum(dim=dims)) / count
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                unbiased = variance.detach() * (count / max(count - 1, 1))
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        # One input-sized tensor saved for backward, as torch's BatchNorm saves its input: the scale is
        # folded per channel first, so the product saves ``centred`` (saved by the variance already)
        # and the channels' scale, not the normalised tensor a separate affine product would save.
        scale = torch.rsqrt(variance + self.eps)
        if not self.affine:
            return (centred * scale.view(shape)).to(dtype)
        return (centred * (scale * self.weight).view(shape) + self.bias.view(shape)).to(dtype)


def _this_rank_only(tensor: torch.Tensor) -> torch.Tensor:
    # A fresh tensor, as the all-reduce returns: neither saves anything for backward.
    return tensor.clone()


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
