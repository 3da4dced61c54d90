"""Segmentation loss and metric for the lesion class (label 1): cross-entropy + soft Dice, hard Dice."""

import torch
import torch.nn.functional as F

# Smoothing keeps the Dice defined on volumes with no lesion and damps its gradient on tiny lesions.
_DICE_SMOOTHING = 1.0


def soft_dice_loss(logits: torch.Tensor, labels: torch.Tensor, sum_across=None) -> torch.Tensor:
    """1 - soft Dice of the lesion class over the whole batch; logits (N, 2, D, H, W), labels (N, D, H, W).

    Dice is a ratio of sums over the batch, not a mean of per-sample terms, so under data parallel
    ``sum_across`` (a differentiable all-reduce) adds every rank's sums before the ratio is taken."""
    probability = F.softmax(logits, dim=1)[:, 1]
    target = (labels == 1).to(probability.dtype)
    sums = torch.stack([(probability * target).sum(), probability.sum() + target.sum()])
    if sum_across is not None:
        sums = sum_across(sums)
    overlap, total = sums[0], sums[1]
    return 1.0 - (2.0 * overlap + _DICE_SMOOTHING) / (total + _DICE_SMOOTHING)


def segmentation_loss(logits: torch.Tensor, labels: torch.Tensor, sum_across=None) -> torch.Tensor:
    """Cross-entropy for every voxel plus soft Dice: CE alone drowns the few lesion voxels in background.

    With ``sum_across`` (data parallel, equal shards) each rank's value is its shard's mean CE plus the
    global Dice term, and DDP's gradient average is exactly the gradient of the global-batch loss."""
    return F.cross_entropy(logits, labels) + soft_dice_loss(logits, labels, sum_across)


@torch.no_grad()
def hard_dice(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Dice of argmax predictions for the lesion class, as a 0-d tensor (no host sync); 1 when both are empty."""
    predicted = logits.argmax(dim=1) == 1
    target = labels == 1
    overlap = (predicted & target).sum()
    total = predicted.sum() + target.sum()
    return torch.where(total > 0, 2.0 * overlap / total.clamp(min=1), torch.ones((), device=logits.device))
