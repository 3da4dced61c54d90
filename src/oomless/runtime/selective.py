"""Selective recompute: a recomputed block that keeps the outputs of its costly ops.

Full recompute keeps a block's inputs only and re-runs its whole forward in backward. Most of that
forward's time is in a few ops (matrix products, convolutions, attention) whose outputs are a part
of what the block saves; the rest (normalisation, activations, dropout, adds, views) is cheap to
run again and, in a U-Net or a transformer layer, saves as many bytes again. Selective recompute
keeps the outputs of the costly ops from the forward and recomputes the rest, through PyTorch's own
selective activation checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`):
in backward, torch's checkpoint replays the block and hands back the kept outputs instead of
computing those ops again. A third point between keep and recompute: fewer bytes than keep, less
time than recompute. The planner offers it per block where the profiling step measured what it
holds and what it costs (`profile.selective.SelectiveMeter`); `plan.blocks[i].selective` says where
it was chosen (the block's decision stays "recompute").

Exactness: the kept outputs are the forward's own tensors, the recomputed ops run on the same
inputs with the RNG state torch's checkpoint restores (dropout draws the same mask), so the result is
bit for bit that of plain PyTorch, as with full recompute.
"""

import inspect

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts
from torch.utils.checkpoint import _CachedTorchDispatchMode

aten = torch.ops.aten

# Ops whose outputs a selective block keeps: the ones that cost time (and, on a GPU, tensor cores),
# as PyTorch's and torchtitan's selective checkpointing policies keep them. Matched by overload
# packet, so every overload counts.
SAVED_OPS = frozenset(
    getattr(aten, name) for name in (
        "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward", "_efficient_attention_forward",
    ) if hasattr(aten, name))


def is_saved_op(func) -> bool:
    return getattr(func, "overloadpacket", None) in SAVED_OPS


# The runtime counts the kept outputs on its ledger as they are made: torch hands them to the policy
# in ``SelectiveCheckpointContext.op_output`` (torch 2.13 does; 2.11 does not). Without it the
# planner does not offer selective recompute (`profile.selective`).
AVAILABLE = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


class _RecomputeContext(_CachedTorchDispatchMode):
    """Torch's recompute context of selective checkpointing, with the ops the block recomputes run
    as they come, not looked up by their count in the forward: only the kept ops' outputs are taken
    from the forward. The counts of the others may differ without anything being wrong: autocast
    keeps its bf16 copy of a weight for the whole forward, so a block called twice (weight sharing)
    casts its weights in its first call only, while the recompute of each call runs in an autocast
    of its own and casts them again; torch's context raised on the cast the forward had not made
    there ("aten._to_copy.default encountered during backward but not found in storage")."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_saved_op(func):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def selective_contexts(kept):
    """(forward context, recompute context) of one checkpointed call, fresh for each call (they
    share the storage of that call's kept outputs). ``kept(tensors)`` is told each kept output as
    the forward makes it."""
    def policy(ctx, func, *args, **kwargs):
        if not is_saved_op(func):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            kept([leaf for leaf in tree_leaves(ctx.op_output) if isinstance(leaf, torch.Tensor)])
        return CheckpointPolicy.MUST_SAVE
    forward_context, recompute_context = create_selective_checkpoint_contexts(policy)
    return forward_context, _RecomputeContext(None, recompute_context.storage,
                                              recompute_context.allow_cache_entry_mutation)
