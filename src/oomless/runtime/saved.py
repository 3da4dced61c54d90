"""Saved-tensor handling for keep and swap blocks, on `torch.autograd.graph.saved_tensors_hooks`.

Every tensor autograd saves inside the model's forward goes through `pack`. The unit of work is the
storage: a storage saved by several ops shares one `Entry` (`runtime.saved_entries`), so it is counted and moved once.
Parameters, buffers, the forward's own inputs, small tensors and anything outside a block stay
where they are (kept, exactly as plain PyTorch would).
"""

import time
from collections import deque

import torch

from oomless.runtime.saved_entries import KEEP, SWAP, Entry, ForwardRegistry, Handle, ParameterUse
from oomless.runtime.saved_versions import UnmovedSave, changed_error


def _without_history(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the graph may hold it: the same storage and version counter, no ``grad_fn``.
    What a pack hook returns (or a handle holds) is owned by the graph's node that saved it; a
    tensor an op saves of its own outputs (layer norm's mean, log-softmax's result) points back at
    that node through its ``grad_fn``, a cycle through C++ that Python's collector cannot see. A
    forward dropped without backward (a validation loss computed with grad enabled) then never
    frees its graph: every activation, swapped copy and ledger entry of it stayed for good (60 such
    forwards of a small residual MLP: 597 MiB held under recompute, 120 MiB under swap, where plain
    PyTorch holds none). Autograd gives the unpacked tensor its history back (`SavedVariable::unpack`),
    as for torch's own checkpoint, whose recomputed tensors it stores detached."""
    return tensor.detach() if tensor.requires_grad else tensor


_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward in this thread (not an unpack in the
    forward, such as a loss reading a node's saved tensors); False where torch cannot tell."""
    return _graph_task is not None and _graph_task() >= 0


class SavedTensorEngine:
    """pack/unpack for one installed model."""

    def __init__(self, ledger, tier, prefetch_bytes: int | None, min_swap_bytes: int, budget_bytes: int | None = None,
                 device: torch.device | None = None, forward_limits: list | None = None,
                 backward_limits: list | None = None, loss_limit: int | None = None):
        self.ledger = ledger
        self.device = device
        # Saved-activation bytes allowed on the device: per block and phase where the plan says
        # (the budget less that phase's own working memory), else ``budget_bytes``; None: no limit.
        # The loss's too, once the forward has returned (`Plan.loss_limit_bytes`).
        self.budget_bytes = budget_bytes
        self.forward_limits = [budget_bytes if limit is None else limit for limit in forward_limits or []]
        self.backward_limits = [budget_bytes if limit is None else limit for limit in backward_limits or []]
        self.loss_limit = budget_bytes if loss_limit is None else loss_limit
        self.tier = tier
        # Bytes brought back ahead of their use at most (None: as many as the budget has room for).
        self.prefetch_bytes = float("inf") if prefetch_bytes is None else prefetch_bytes
        self.min_swap_bytes = min_swap_bytes
        # Swapped entries whose copy out may still run, in the order the copies were queued (one
        # copy-out stream, one disk writer: they finish in that order).
        self.pending_out: deque[Entry] = deque()
        # Swapped entries copied out whose storage the forward still references (a block's output
        # is the next block's input; a U-Net skip lives until its decoder): resident all the same,
        # so they stay on the ledger until that storage is freed.
        self.copied_alive: list[Entry] = []
        self.resident_storages: set[tuple] = set()
        self.registry: ForwardRegistry | None = None
        self.block_index: int | None = None
        # Where the forward is (`position_of`): the block last called for the first time in this
        # forward; the blocks called so far; the place of the call running.
        self.forward_position = -1
        self._called: set[int] = set()
        self._call_position: int | None = None
        self.decision: str = KEEP
        self.recorder = None
        self.recompute_bytes: dict[int, int] = {}
        self._recomputed_on_ledger = 0
        # Parameters off the device between uses (`OffloadedParameters`, set by `oomless.apply`).
        self.offloaded_parameters = None
        # Parameters updated in backward and read outside their gradients' path (`ParameterReads`,
        # set by `oomless.apply` with the update in backward): every save is shown to it.
        self.parameter_reads = None
        self.saving_recompute_inputs = False    # set by `RecomputeBlock.pre_hook` (`_unmoved`)
        # Called once at the first unpack in backward after a forward, then cleared.
        self.backward_check = None
        # Tensors packed inside a block since the forward began; where none were and backward
        # unpacks one all the same, ``blocks_unseen`` is called once (then cleared): the blocks ran
        # where the hooks did not see them (a model compiled as a whole, `InstalledPlan`).
        self.packed_in_blocks = 0
        self.blocks_unseen = None
        self.block_names: list[str] = []    # the plan's, for messages

    def block_name(self, block_index: int) -> str:
        if block_index < len(self.block_names):
            return f"block {self.block_names[block_index]}"
        return f"the plan's block {block_index}"

    def position_of(self, block_index: int) -> int:
        """Where in the step the call of block ``block_index`` running (or about to start) is: the
        block's own index at its first call in the forward; at a later call (a U-Net's one pooling
        module at every level), the place of the block last called for the first time. Backward's
        progress and the limits of the phases until an entry's use go by it. By the block's own
        index, its later calls' entries seemed used at its first call's place, and once one was,
        every later block's entries seemed to have no phase left before their use, so no limit
        (U-Net on CUDA: 350 MiB brought back at once, 2026-11-27). Blocks are indexed in the order
        their first calls ran when profiled; one that did not run then (listed last) is at its own
        index when it first runs."""
        if block_index == self.block_index and self._call_position is not None:
            return self._call_position
        return max(self.forward_position, block_index) if block_index in self._called else block_index

    def block_entered(self, block_index: int) -> None:
        """A block's call starts (its forward pre-hook; also where backward recomputes it)."""
        position = None
        if self.registry is not None and not self.registry.backward_started:
            if self.registry.watched:
                self.registry.note_swapped_changes()
            position = self.position_of(block_index)
            if block_index not in self._called:
                self._called.add(block_index)
                self.forward_position = block_index
        self.block_index, self._call_position = block_index, position

    def recompute_started(self, block_index: int, position: int, registry) -> None:
        """Put a recomputed block's saved bytes (known from the profile) on the ledger: they live
        inside torch's checkpoint frame where no hook of ours sees them. ``position``: where its
        forward call ran (`position_of`); ``registry``: that forward's (several forwards may run
        before their backwards: micro-batches, a pipeline stage's schedule)."""
        self.backward_moved()
        if registry is not None:
            registry.reached(position)
        self._recomputed_on_ledger = self.recompute_bytes.get(block_index, 0)
        # Copies out may still hold earlier blocks' bytes on the ledger (a slow disk, a short loss):
        # they finish before the recomputed tensors join them over the limit.
        self.make_room(self._recomputed_on_ledger, self.backward_limit(block_index, block_index))
        # The last recomputed block has no later unpack to take it off: the end of backward does.
        torch.autograd.Variable._execution_engine.queue_callback(self.backward_moved)
        self.ledger.add(self._recomputed_on_ledger)

    def backward_moved(self) -> None:
        """Backward left the last recomputed block: its recomputed tensors are gone."""
        if self._recomputed_on_ledger:
            self.ledger.remove(self._recomputed_on_ledger)
            self._recomputed_on_ledger = 0

    def keep_handles(self, tensors, block_index: int) -> list:
        """Handles that hold ``tensors`` on the ledger as kept (a recompute block's inputs)."""
        registry = self.registry
        if registry is None:
            return []
        handles = []
        for tensor in tensors:
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or (tensor.device, storage.data_ptr()) in self.resident_storages:
                continue
            place = self.position_of(block_index)
            # Held by torch's checkpoint frame, which the block's graph holds (`_without_history`).
            tensor = _without_history(tensor)
            handles.append(Handle(registry.entry_for(tensor, block_index, place, KEEP, saved=False), tensor, place))
        return handles

    def begin_forward(self, resident_storages: set[tuple]) -> None:
        self.resident_storages = resident_storages
        self.registry = ForwardRegistry(self)
        self.forward_position, self._called, self._call_position = -1, set(), None
        self.packed_in_blocks = 0

    def forward_limit(self, block_index: int) -> int | None:
        if block_index < len(self.forward_limits):
            return self.forward_limits[block_index]
        return self.budget_bytes

    def backward_limit(self, first: int, last: int) -> int | None:
        """The tightest limit of the backward phases of blocks ``first`` to ``last``; where ``first``
        is past ``last`` (backward has passed that place already), the limit of ``last``'s: never
        none where the plan set limits."""
        if not self.backward_limits:
            return self.budget_bytes
        if first > last:
            first = last
        limits = [limit for limit in self.backward_limits[first:last + 1] if limit is not None]
        return min(limits) if limits else None

    def limit_until_use(self, entry: Entry, backward_block: int, ahead: bool = False) -> int | None:
        """What ``entry`` brought back now must fit until it is used: the limit of every backward
        phase from backward's place to the entry's, and of its own block's backward (for a later
        call of a block, a phase other than its place's). ``ahead``: brought back before it is
        needed, it must also leave room in each of those phases not started yet for what the phase
        puts on the ledger itself: a recomputed block's saves (`recompute_started`). Without that
        room, bytes brought back as far ahead as the budget allowed took the room of the recomputes
        between: with no prefetch window the README's 70B transformer's fsdp rank was predicted at
        49.56 GiB beyond static bytes for a budget of 45.74 (the simulator, `plan.simulate`,
        reserves the same room). Not for an entry needed now, which is fetched whatever comes after."""
        limits = [self.backward_limit(entry.position, backward_block)]
        if entry.block_index < len(self.backward_limits):
            limits.append(self.backward_limits[entry.block_index])
        if ahead and self.recompute_bytes:
            # Each recompute still to come where its call ran: a later call of a block (weight
            # sharing) at that call's place, not at the block's own index (c(a(b(a(x)))) with ``a``
            # recomputed: b's saves, brought back during c's backward, took the room of a's second
            # recompute, which comes before b's backward; the ledger passed the budget by a's bytes).
            for place, block_index in entry.registry.recompute_calls:
                recomputed = self.recompute_bytes.get(block_index, 0)
                if entry.position <= place < backward_block and recomputed:
                    own = [self.backward_limits[index] for index in (place, block_index)
                           if index < len(self.backward_limits)]
                    limits += [limit - recomputed for limit in own if limit is not None]
        limits = [limit for limit in limits if limit is not None]
        return min(limits) if limits else None

    def has_room(self, num_bytes: int, limit: int | None) -> bool:
        return limit is None or self.ledger.resident_activation_bytes + num_bytes <= limit

    def make_room(self, num_bytes: int, limit: int | None) -> None:
        """Before bytes go on the ledger (a saved storage, a recomputed block's tensors, a storage
        fetched on demand): if that would pass ``limit``, the running phase's share of the
        activation budget, wait for earlier swaps' copies to finish. The plan predicts this never
        happens; when copies fall behind the prediction, waiting keeps the budget a promise (on CUDA
        this is a host synchronisation, the only one a planned step makes, and only in that case;
        the profiler's steps, which have no budget, bound the copies in flight instead)."""
        self.poll()
        while not self.has_room(num_bytes, limit) and self.pending_out:
            entry = self.pending_out[0]
            started = time.perf_counter()
            if entry.ticket is not None:
                self.tier.wait_out(entry.ticket)
            self.ledger.stall_seconds += time.perf_counter() - started
            self.poll()

    def poll(self) -> None:
        """Take swapped-out storages off the ledger once their copy has completed and nothing else
        references them (no waiting). Copies finish in the order they were queued, so this stops at
        the first one still running. The ledger so counts what is resident whatever the copies'
        timing: the profiler's "other" bytes (memory beyond the ledger) do not depend on it."""
        if self.copied_alive:
            self.copied_alive = [entry for entry in self.copied_alive if not self._left(entry)]
        pending = self.pending_out
        while pending:
            entry = pending[0]
            if entry.ticket is not None and not self.tier.is_out(entry.ticket):
                return
            pending.popleft()
            if not self._left(entry):
                self.copied_alive.append(entry)

    def _left(self, entry: Entry) -> bool:
        """Whether a copied-out entry is off the ledger now (taking it off if its storage is free)."""
        # An entry released, or already asked back for backward (its copy back is resident), is not
        # this method's to take off.
        if entry.ticket is None or not entry.on_ledger or entry.fetch_issued:
            return True
        if not entry.weak.expired():
            return False
        entry.on_ledger = False
        self.ledger.remove(entry.num_bytes)
        return True

    def pack(self, tensor: torch.Tensor):
        registry, block_index = self.registry, self.block_index
        if registry is None or not isinstance(tensor, torch.Tensor):
            return tensor
        saved = tensor
        if self.parameter_reads is not None:
            self.parameter_reads.saved(tensor)
        if self.offloaded_parameters is not None:
            owner = self.offloaded_parameters.owner_of(tensor)
            if owner is not None:
                return ParameterUse(tensor, owner)
        # (After the parameters' check: a view of a parameter is known by its ``_base``, which a
        # detached tensor has not; such a view is never the output of the node that saves it.)
        tensor = _without_history(tensor)
        if block_index is None:
            if self.recorder is not None and tensor.device.type != "meta":
                self.recorder.unassigned(tensor.untyped_storage().nbytes())
            return self._unmoved(tensor, None)
        self.packed_in_blocks += 1
        if tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested:
            return tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            # Nothing to count or move, and no address of its own: every empty storage has data
            # pointer 0, so one entry would stand for all of them (CUDA's batch norm saves an empty
            # reserve tensor in each call) and backward would seem to have reached the first
            # saver's place at the last one's (U-Net on CUDA: prefetch without limits, 2026-11-27).
            return tensor
        if (tensor.device, storage.data_ptr()) in self.resident_storages:
            # A parameter, buffer or forward input: resident anyway, never moved.
            return self._unmoved(tensor, block_index)
        decision = self.decision
        movable = self._movable(tensor)
        if decision == SWAP and (storage.nbytes() < self.min_swap_bytes or not movable):
            decision = KEEP
        self.poll()
        # hold: the storage may already have a swap entry (saved earlier through a plain view);
        # this view still cannot be rebuilt from bytes, so its handle keeps the tensor itself.
        place = self.position_of(block_index)
        return Handle(registry.entry_for(tensor, block_index, place, decision, movable), tensor, place,
                       hold=not movable, saved=saved)

    def _unmoved(self, tensor: torch.Tensor, block_index: int | None):
        """A save handed back as it is, checked at unpack as autograd would. Not a recompute block's
        inputs, which torch's checkpoint saves as the call starts: `_RecomputeContext.check_inputs`
        checks them against their versions at its end (a ReLU(inplace=True) block changes its own)."""
        return tensor if self.saving_recompute_inputs else UnmovedSave(tensor, block_index)

    def _updated_in_backward(self, tensor: torch.Tensor) -> bool:
        reads = self.parameter_reads
        return reads is not None and reads.parameter_read(tensor, on_gradient_path=False) is not None

    def _movable(self, tensor: torch.Tensor) -> bool:
        """Whether `unpack` can rebuild ``tensor`` from its storage bytes alone. Not a tensor on
        another device than the tier's (a CPU scalar in a CUDA op, a second GPU: the tier's streams
        and pinned copies are for its own device), nor a conjugate or negative view: its conj/neg
        bit is not in the bytes, and dropping it would change the values backward reads."""
        if self.device is not None and tensor.device != self.device:
            return False
        return not (tensor.is_conj() or tensor.is_neg())

    def unpack(self, packed):
        if self.backward_check is not None and _in_backward():
            check, self.backward_check = self.backward_check, None
            check()
        if self.blocks_unseen is not None and not self.packed_in_blocks and _in_backward():
            unseen, self.blocks_unseen = self.blocks_unseen, None
            unseen()
        if not isinstance(packed, Handle):
            if isinstance(packed, UnmovedSave):
                return packed.unpacked(self.block_name, self._updated_in_backward)
            if isinstance(packed, ParameterUse):
                self.offloaded_parameters.ensure_in(packed.parameter)
                return packed.tensor
            return packed
        entry = packed.entry
        if packed.saved_version is not None:
            found = packed.saved_version.found(packed.tensor)
            if found is not None:
                raise changed_error(found, packed.saved_version.version, self.block_name(entry.block_index))
        if self._recomputed_on_ledger:
            self.backward_moved()
        self.poll()     # storages freed since the last save or unpack leave the ledger before it is read
        if packed.tensor is not None:
            if entry is not None and entry.registry.next_prefetch >= 0:
                entry.registry.reached(packed.place)
                entry.registry.prefetch()   # backward is under way: bring swapped entries back
            return packed.tensor
        data = entry.registry.fetch(entry, packed.place)
        return torch.empty(0, dtype=packed.dtype, device=data.device).set_(
            data.untyped_storage(), packed.storage_offset, packed.size, packed.stride)
