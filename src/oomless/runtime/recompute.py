"""Recompute blocks: non-reentrant activation checkpointing installed through module hooks.

Same mechanism as PyTorch's composable `checkpoint(module)`: a forward pre-hook starts
`torch.utils.checkpoint`'s non-reentrant generator and the forward hook finishes it. Its RNG
stashing replays dropout exactly. What plain checkpointing gets wrong is buffers a forward changes:
a recompute must start from them as its call found them (spectral norm's power iteration), and
must not leave what it writes (BatchNorm's running statistics would move twice a step); see
`runtime.recompute_buffers`. And it must run the block as the call did: without the pre-hooks that
ran outside the checkpoint, with the call's attributes and parameters (`runtime.recompute_call`).
"""

import inspect
import itertools
from contextlib import nullcontext

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from oomless.errors import ApplyError
from oomless.profile.tensors import tensors_in
from oomless.runtime.saved_versions import SavedVersion, changed_error
from oomless.runtime.recompute_buffers import BlockBuffers
from oomless.runtime.recompute_call import CallState
from oomless.runtime.selective import selective_contexts

_GENERATOR = torch_checkpoint._checkpoint_without_reentrant_generator
_HAS_EARLY_STOP = "early_stop" in inspect.signature(_GENERATOR).parameters
_OPENED = itertools.count()     # the order calls opened their checkpoints in (`RecomputeBlock.opened`)
# In-place modules that give their own result back when run on it again (f(f(x)) == f(x)): one
# alone in a block changes the block's input in place, and its recompute, reading that result,
# saves and leaves what the forward did.
_IDEMPOTENT_IN_PLACE = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardtanh)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a storage of their own, requiring grad as it does."""
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)


class RecomputeBlock:
    """Hook state of one recompute block."""

    def __init__(self, module: torch.nn.Module, block_index: int, engine, selective: bool = False, name: str = "",
                 changes_input: bool = False, compiled: bool = False):
        self.module = module
        self.block_index = block_index
        self.name = name
        # Its forward changes its inputs in place (`BlockPlan.changes_input`): its recompute starts
        # from copies taken before the forward. Not a ReLU alone, whose recompute from its result
        # gives that result again.
        self.changes_input = changes_input and not isinstance(module, _IDEMPOTENT_IN_PLACE)
        self.engine = engine
        self.selective = selective      # keeps its costly ops' outputs (runtime/selective.py)
        self.generator = None
        self.opened = 0                 # when `generator` was opened, in the order of all blocks' calls
        self.recomputing = False
        self.buffers = BlockBuffers(module, name)
        self.context = None             # the running call's `_RecomputeContext`, pre_hook to post_hook
        self.pre_hook_id = None         # the handle id of `pre_hook` on the module (set where installed)
        # With the update in backward: whether its forward's reads of other modules' parameters outside
        # their gradients' path were recorded (at its first call, `runtime.parameter_reads`). Not in
        # a compiled block: dynamo would trace the recording mode into its graph.
        self.reads_recorded = compiled

    def pre_hook(self, module, args, kwargs):
        if self.recomputing or not torch.is_grad_enabled():
            return
        # Every input tensor goes in positionally, once: the recompute then sees the inputs as they
        # were at this call, not as the caller left them. A model may update a dict (or list) it
        # passed to the block in place afterwards (``state.update(layer(state))``); torch's
        # generator keeps its positional tensors only (saved through the plan's hooks, so without
        # autograd's version check: `_RecomputeContext.check_inputs` raises where one was changed
        # in place since, instead of recomputing from its new values). It gives
        # each back as a new tensor object, so a tensor passed several times goes in once and is
        # put in each place at the recompute: nn.MultiheadAttention takes its fused self-attention
        # path where ``query is key is value``, and the recompute must take the same one.
        # Keyword arguments go in the same way: torch's generator also stashes the RNG state only of
        # the devices of its positional tensors (get_device_states(*args)), so a block called as
        # block(x=...) would replay dropout with CUDA's RNG already advanced.
        leaves, spec = tree_flatten((args, kwargs))
        tensors, places = [], {}
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) not in places:
                places[id(leaf)] = len(tensors)
                tensors.append(leaf)
        where = [places[id(leaf)] if isinstance(leaf, torch.Tensor) else None for leaf in leaves]

        changes_input = self.changes_input
        # One context per call: a block called twice in a forward is recomputed once per call, and
        # each call's inputs leave the ledger when its own recompute is done.
        context = _RecomputeContext(self, self.engine.position_of(self.block_index), self.engine.registry)
        if context.registry is not None:
            context.registry.recompute_calls.append((context.position, self.block_index))

        def call(*inputs):
            context.check_inputs(inputs)
            if changes_input:
                # The recompute's inputs are leaves, which autograd lets no op change in place; a
                # clone of each is not (the clone's backward saves nothing).
                inputs = [tensor.clone() for tensor in inputs]
            rebuilt = [leaf if place is None else inputs[place] for leaf, place in zip(leaves, where)]
            call_args, call_kwargs = tree_unflatten(rebuilt, spec)
            # A recompute changes its inputs in place only where the block is a ReLU alone (any
            # other such block recomputes from clones), giving them the values they had: the raise
            # of their versions is hidden, or autograd's check (a loss that saved the model's
            # output) and the plan's would refuse a later backward through the same graph.
            with torch.autograd._unsafe_preserve_version_counter(
                    tuple(tensor for tensor in inputs if not tensor.is_inference())), context.call_state.as_called():
                return module(*call_args, **call_kwargs)
        if self.selective:
            forward_context, recompute_context = selective_contexts(context.keep)
            contexts = (forward_context, _Both(context, recompute_context))
        else:
            contexts = (nullcontext(), context)
        reads = self.engine.parameter_reads
        if reads is not None and not self.reads_recorded:
            # Recorded once its call completes (`post_hook`): a first call that raised (out of memory,
            # skipped by the loop) recorded part of them; the next call records them all.
            context.recorder = reads.recorder(tensors)
            contexts = (_Both(context.recorder, contexts[0]), contexts[1])
        options = (True, lambda: contexts, "default", False) + ((True,) if _HAS_EARLY_STOP else ())
        if self.changes_input:
            # The forward runs on the tensors themselves, as the model expects; the recompute, from
            # the copies, sees the values the forward started from and saves what it saved.
            tensors = [_copy(tensor) for tensor in tensors]
        self.generator = _GENERATOR(call, *options, *tensors)
        self.opened = next(_OPENED)
        self.engine.saving_recompute_inputs = True
        try:
            next(self.generator)
        finally:
            self.engine.saving_recompute_inputs = False
        context.input_handles = self.engine.keep_handles(tensors, self.block_index)
        self.context = context
        context.call_started(tensors)
        context.buffers = self.buffers.call_started()
        context.call_state = CallState(module, self.pre_hook_id)

    def abandon(self) -> None:
        """Its call was interrupted (`runtime.open_calls`): close torch's checkpoint generator, which
        takes its saved-tensor hooks and its forward's contexts off their stacks."""
        generator, self.generator, self.context = self.generator, None, None
        generator.close()

    def post_hook(self, module, args, output):
        generator, self.generator = self.generator, None
        context, self.context = self.context, None
        if generator is None or self.recomputing:
            return
        if context.changed_in_call() and not isinstance(module, _IDEMPOTENT_IN_PLACE):
            # Its recompute would start from the changed values and save other tensors than the
            # forward did (wrong gradients, silently); torch's checkpoint refuses it through
            # autograd's version check, which tensors saved through the plan's hooks do not get.
            raise ApplyError(f"block {self.name} changed its own input in place (nn.LeakyReLU(inplace=True) as its "
                             "first op, x.mul_(...)), which its profile did not show, so recomputing it would start "
                             "from the changed values and give wrong gradients; plan again (oomless.plan(model, ...) "
                             "on this model), make that op out of place (inplace=False), or give the block keep or "
                             "swap (oomless.plan(..., decisions={...}))")
        context.call_ended()
        context.buffers.call_ended()
        try:
            next(generator)
        except StopIteration:
            pass
        if context.recorder is not None and output is not None:     # None: the forward raised
            recorder, context.recorder = context.recorder, None
            self.engine.parameter_reads.defer_unreached(recorder, tensors_in(output))
            self.reads_recorded = True


class _RecomputeContext:
    """Entered each time torch's checkpoint recomputes the block: once per backward pass through
    it, twice where a zero-bubble pipeline schedule splits backward into input and weight passes
    (a generator-based context manager could be entered only once)."""

    def __init__(self, block: RecomputeBlock, position: int, registry):
        self.block = block
        self.position = position         # where this call ran in the forward (`SavedTensorEngine.position_of`)
        self.registry = registry         # that forward's (`SavedTensorEngine.recompute_started`)
        self.input_handles: list = []    # its call's inputs, held on the ledger as kept
        self.kept_handles: list = []     # selective: the costly ops' outputs the forward kept
        # Its call's input tensors and their versions at the call's start (None: an inference tensor,
        # which has none), until the call ends; then a `SavedVersion` (or None) of each, as it left them.
        self.inputs: list[tuple[torch.Tensor, int | None]] = []
        self.input_versions: list = []
        self.recorder = None             # its call's `parameter_reads.RecordReads`, until the call ends
        self.buffers = None              # its call's buffers as it found them (`CallBuffers`)
        self.call_state = None           # its call's attributes and parameters (`recompute_call.CallState`)

    def call_started(self, tensors) -> None:
        self.inputs = [(tensor, None if tensor.is_inference() else tensor._version) for tensor in tensors]

    def changed_in_call(self) -> bool:
        """Whether the call changed an input in place."""
        return any(version is not None and tensor._version != version for tensor, version in self.inputs)

    def call_ended(self) -> None:
        """Its inputs' versions now are those its recomputes must find (its own change in place is in
        them: a ReLU's, which its recompute makes again to the same values)."""
        self.input_versions = [None if version is None else SavedVersion(tensor) for tensor, version in self.inputs]
        self.inputs = []

    def check_inputs(self, inputs) -> None:
        """At a recompute: raise as autograd does where an input was changed in place after the call:
        the recompute would start from the changed values."""
        for saved, tensor in zip(self.input_versions, inputs):
            found = saved.found(tensor) if saved is not None else None
            if found is not None:
                raise changed_error(found, saved.version, f"block {self.block.name}", recompute_input=True)

    def keep(self, tensors) -> None:
        """Selective: put outputs the forward keeps on the ledger as kept, for the block's phases until
        its recompute."""
        self.kept_handles += self.block.engine.keep_handles(tensors, self.block.block_index)

    def __enter__(self):
        block = self.block
        block.recomputing = True
        # From here the recomputed block's saved bytes (the kept outputs among them) are on the ledger
        # as one count (`recompute_started`) until its backward is done.
        self.kept_handles = []
        block.buffers.before_recompute(self.buffers)
        block.engine.ledger.recomputed_blocks += 1
        block.engine.recompute_started(block.block_index, self.position, self.registry)

    def __exit__(self, *exception):
        self.block.recomputing = False
        # The checkpoint frame holds the inputs until now; the ledger lets go of them here.
        self.input_handles = []
        return False


class _Both:
    """Two context managers entered as one, the first outermost: the block's own, then the recompute
    context of selective checkpointing (a dispatch mode that answers every op of the replay from its
    cache or by computing it: the block's own context, which copies buffers, must run outside it).
    Re-entered at each recompute, as torch's checkpoint enters its recompute context."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException:
            self.outer.__exit__(None, None, None)
            raise

    def __exit__(self, *exception):
        try:
            self.inner.__exit__(*exception)
        finally:
            self.outer.__exit__(*exception)
        return False
