"""Recompute blocks: non-reentrant activation checkpointing installed through module hooks.

Same mechanism as PyTorch's composable `checkpoint(module)`: a forward pre-hook starts
`torch.utils.checkpoint`'s non-reentrant generator and the forward hook finishes it. Its RNG
stashing replays dropout exactly. What plain checkpointing gets wrong is buffers: the recomputed
forward would update BatchNorm running statistics a second time. We snapshot a block's buffers
before its recompute and put them back once the backward pass ends, so they change once per step.
"""

import inspect
from contextlib import nullcontext

import torch
from torch.utils import checkpoint as torch_checkpoint

_GENERATOR = torch_checkpoint._checkpoint_without_reentrant_generator
_HAS_EARLY_STOP = "early_stop" in inspect.signature(_GENERATOR).parameters


class RecomputeBlock:
    """Hook state of one recompute block."""

    def __init__(self, module: torch.nn.Module, block_index: int, engine):
        self.module = module
        self.block_index = block_index
        self.engine = engine
        self.generator = None
        self.input_handles: list = []
        self.recomputing = False

    def _context_fns(self):
        return nullcontext(), _RecomputeContext(self)

    def pre_hook(self, module, args, kwargs):
        if self.recomputing or not torch.is_grad_enabled():
            return
        options = (True, self._context_fns, "default", False) + ((True,) if _HAS_EARLY_STOP else ())
        # Keyword arguments go in positionally: torch's generator stashes the RNG state only of the
        # devices of its positional tensors (get_device_states(*args)), so a block called as
        # block(x=...) would replay dropout with CUDA's RNG already advanced: different masks,
        # wrong gradients, and a CUDA RNG no longer in step with plain PyTorch. Positional inputs
        # are also saved through the frame's version-checked input saver.
        names, count = tuple(kwargs), len(args)

        def call(*inputs):
            return module(*inputs[:count], **dict(zip(names, inputs[count:])))

        self.generator = _GENERATOR(call, *options, *args, *kwargs.values())
        next(self.generator)
        inputs = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        self.input_handles = self.engine.keep_handles(inputs, self.block_index)

    def post_hook(self, module, args, output):
        generator, self.generator = self.generator, None
        if generator is None or self.recomputing:
            return
        try:
            next(generator)
        except StopIteration:
            pass


class _RecomputeContext:
    """Entered each time torch's checkpoint recomputes the block: once per backward pass through
    it, twice where a zero-bubble pipeline schedule splits backward into input and weight passes
    (a generator-based context manager could be entered only once)."""

    def __init__(self, block: RecomputeBlock):
        self.block = block

    def __enter__(self):
        block = self.block
        block.recomputing = True
        snapshots = [(buffer, buffer.detach().clone()) for buffer in block.module.buffers()]
        if snapshots:
            # Restoring at the end of backward, not here: the recomputed graph of this block may
            # still read the buffers, and writing them now would trip autograd's version check.
            def restore():
                with torch.no_grad():
                    for buffer, saved in snapshots:
                        buffer.copy_(saved)
            torch.autograd.Variable._execution_engine.queue_callback(restore)
        block.engine.ledger.recomputed_blocks += 1
        block.engine.recompute_started(block.block_index)

    def __exit__(self, *exception):
        self.block.recomputing = False
        # The checkpoint frame holds the inputs until now; the ledger lets go of them here.
        self.block.input_handles = []
        return False
