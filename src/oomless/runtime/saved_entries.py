"""What the plan's pack hook makes of a saved tensor: the entry of its storage (kept on the device, or
moved to a tier and brought back for backward), the handle autograd holds instead of the tensor, and
the registry of one forward's entries, which brings swapped ones back in backward's order
(`runtime.saved.SavedTensorEngine` packs and unpacks through them).
"""

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from oomless.runtime.saved_versions import SavedVersion

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"


class Entry:
    """One saved storage: kept on the device, or moved to a tier and brought back for backward."""

    __slots__ = ("registry", "block_index", "position", "num_bytes", "decision", "weak", "device_data",
                 "ticket", "handles", "on_ledger", "fetch_issued", "fetched", "version")

    def __init__(self, registry, block_index: int, storage, decision: str, position: int, version: int):
        self.registry = registry
        self.version = version        # the storage's version when saved (what a swap copies out)
        self.block_index = block_index
        # Where in the step it was first saved (`SavedTensorEngine.position_of`): its last use in
        # backward, so the first place of the phases it must fit once brought back.
        self.position = position
        self.num_bytes = storage.nbytes()
        self.decision = decision
        self.weak = StorageWeakRef(storage)
        self.device_data = None
        self.ticket = None
        self.handles = 0
        self.on_ledger = False
        self.fetch_issued = False   # its copy back to the device has been asked for
        self.fetched = False        # backward has taken it


class ParameterUse:
    """A saved parameter (or a view of one) that lives off the device between uses
    (`oomless.runtime.offload_parameters`): brought back in, if its memory was freed, when backward
    unpacks it, whatever node reads it (`OffloadedParameters.ensure_in`)."""

    __slots__ = ("tensor", "parameter")

    def __init__(self, tensor: torch.Tensor, parameter):
        self.tensor, self.parameter = tensor, parameter


class Handle:
    """What autograd holds instead of a saved tensor; dropping it releases its share. ``place``: where
    the call that saved it ran (`SavedTensorEngine.position_of`), so where backward is when it is
    unpacked: a storage saved by several blocks is unpacked once per save, each at its saver's place."""

    __slots__ = ("entry", "place", "tensor", "storage_offset", "size", "stride", "dtype", "saved_version",
                 "__weakref__")

    def __init__(self, entry: Entry | None, tensor: torch.Tensor, place: int, hold: bool = False,
                 saved: torch.Tensor | None = None):
        self.entry, self.place = entry, place
        if entry is None or entry.decision == KEEP or hold:
            self.tensor = tensor
        else:
            self.tensor = None
            self.storage_offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()
            self.dtype = tensor.dtype
        # ``saved``: the tensor autograd saved, whose version `unpack` checks (not a recompute
        # block's inputs held on the ledger, which nothing unpacks; never an inference tensor,
        # which autograd does not save). Where the handle holds only bytes (swapped), watched
        # through a weak reference to the tensor the model holds (the detached alias above dies).
        self.saved_version = None
        if saved is not None and entry is not None:
            self.saved_version = SavedVersion(saved, watch=self.tensor is None)
            if self.tensor is None:
                entry.registry.watched.append(weakref.ref(self))
        if entry is not None:
            entry.handles += 1

    def __del__(self):
        entry = self.entry
        if entry is not None:
            entry.handles -= 1
            if entry.handles == 0:
                entry.registry.release(entry)


class ForwardRegistry:
    """The entries of one forward pass, indexed by storage while that storage may still be alive.

    Swapped entries come back in backward one by one, in the reverse of the order they were saved:
    backward runs the ops in reverse, and each op unpacks what it saved (in the models of the tests
    a tensor's first use is at most one place away from that order). Each unpack asks for the next
    entries in that order as far as the activation budget's free bytes and the plan's prefetch
    window allow, whatever the blocks between are doing (kept, recomputed or swapped), leaving room
    in each phase before an entry's use for a recompute's saves still to come; an entry
    asked for out of order is fetched on demand. Each entry leaves the ledger when autograd drops
    its last saved tensor, right after the op that used it.
    """

    def __init__(self, engine):
        self.engine = engine
        self.by_storage: dict[tuple, Entry] = {}
        self.swapped: list[Entry] = []
        self.next_prefetch = -1          # index in `swapped` of the next entry to bring back
        self.prefetched_unused_bytes = 0
        self.backward_started = False
        # The recompute blocks' calls of this forward: (place, block index) (`limit_until_use`).
        self.recompute_calls: list[tuple[int, int]] = []
        # Handles of swapped saves (weak: a save autograd dropped is no longer checked).
        self.watched: list[weakref.ref] = []
        # The lowest block backward has reached: none at first (the loss's backward runs before the
        # last block's, whose recompute is still to come then).
        self.backward_block = len(engine.backward_limits)

    def entry_for(self, tensor: torch.Tensor, block_index: int, place: int, decision: str,
                  movable: bool = True, saved: bool = True) -> Entry:
        """The entry of ``tensor``'s storage, made (and put on the ledger) at its first save in this
        forward, by block ``block_index``'s call at ``place`` (`SavedTensorEngine.position_of`).
        ``saved`` False: a recompute block's input held (`keep_handles`), not a save the profile records."""
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        entry = self.by_storage.get(key)
        # An entry whose handles all went (a graph freed during the forward, e.g. a metric computed
        # with grad and dropped) has been released: its ticket and ledger share are gone, so a
        # later save of the same live storage needs a fresh entry, not that one.
        # A swapped entry's bytes are the storage's at its first save: a storage changed in place
        # since (an earlier save no backward reads, as an output left out of the loss) is saved
        # again as a fresh entry, or this save would read the old values back.
        if entry is not None and not entry.weak.expired() and entry.handles > 0 and \
                (entry.decision != SWAP or entry.version == tensor._version):
            if saved and entry.block_index != block_index and self.engine.recorder is not None:
                self.engine.recorder.saved_again(block_index, entry)
            return entry
        entry = Entry(self, block_index, storage, decision, place, tensor._version)
        self.by_storage[key] = entry
        # Kept bytes count as much as swapped ones: either waits for earlier copies if the ledger
        # would pass the budget.
        self.engine.make_room(entry.num_bytes, self.engine.forward_limit(block_index))
        ledger = self.engine.ledger
        entry.on_ledger = True
        ledger.add(entry.num_bytes)
        if self.engine.recorder is not None:
            self.engine.recorder.saved(block_index, entry.num_bytes, movable, tensor, entry)
        if decision == SWAP:
            data = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            entry.ticket = self.engine.tier.put(data)
            ledger.offloaded_bytes += entry.num_bytes
            self.swapped.append(entry)
            self.next_prefetch = len(self.swapped) - 1
            self.engine.pending_out.append(entry)
        else:
            entry.device_data = tensor
        return entry

    def note_swapped_changes(self) -> None:
        """At each block's start in the forward: note a swapped tensor the model changed in place
        after its save (its copy out may have read the values from before or after the change),
        while the model still references it; `unpack` raises where backward reads it."""
        self.watched = [reference for reference in self.watched
                        if (handle := reference()) is not None and handle.saved_version.note_change()]

    def reached(self, position: int) -> None:
        """Backward is at ``position`` (`SavedTensorEngine.position_of`): it goes down the blocks."""
        if position < self.backward_block:
            self.backward_block = position

    def fetch(self, entry: Entry, place: int) -> torch.Tensor:
        """``entry``'s bytes on the device for a save made at ``place``, brought back if they are not."""
        engine = self.engine     # (its one caller, `unpack`, has just polled)
        self.reached(place)
        if not entry.fetched:
            if not entry.fetch_issued:
                # Needed now: asked for ahead of the prefetches below, once copies out still on the
                # ledger have made room for it (or none is left to wait for).
                if not entry.on_ledger:
                    engine.make_room(entry.num_bytes, engine.limit_until_use(entry, self.backward_block))
                self._issue(entry)
            self.prefetched_unused_bytes -= entry.num_bytes
            self.prefetch()
            entry.device_data = engine.tier.get(entry.ticket)
            entry.fetched = True
        return entry.device_data

    def _issue(self, entry: Entry) -> None:
        entry.fetch_issued = True
        self.prefetched_unused_bytes += entry.num_bytes
        # On the ledger before the tier allocates the bytes (the CUDA tier does at once): the
        # profiler reads memory at each change of the ledger, and bytes allocated while the ledger
        # did not count them yet would be read as the phase's working memory, on top of the ledger.
        if not entry.on_ledger:
            entry.on_ledger = True
            self.engine.ledger.add(entry.num_bytes)
            if self.engine.recorder is not None:
                self.engine.recorder.fetched(entry.num_bytes)
        self.engine.tier.prefetch(entry.ticket)

    def prefetch(self) -> None:
        """Ask for the next swapped entries in backward's order while they fit the budget's free
        bytes and the prefetch window. The budget is full: the rest waits for the next unpack or
        release (each frees room), or is fetched on demand."""
        self.backward_started = True
        engine = self.engine
        while self.next_prefetch >= 0:
            entry = self.swapped[self.next_prefetch]
            if entry.ticket is None or entry.fetch_issued:   # released, or already on its way back
                self.next_prefetch -= 1
                continue
            if self.prefetched_unused_bytes + entry.num_bytes > engine.prefetch_bytes:
                return
            # It stays until its block's backward: it must fit the limit of every phase until then.
            if not entry.on_ledger and not engine.has_room(
                    entry.num_bytes, engine.limit_until_use(entry, self.backward_block, ahead=True)):
                return
            self._issue(entry)
            self.next_prefetch -= 1

    def release(self, entry: Entry) -> None:
        if entry.fetch_issued and not entry.fetched:
            self.prefetched_unused_bytes -= entry.num_bytes
        # The bytes go before the ledger says so: the profiler reads memory at the change, and bytes
        # still there when its next interval starts would be read as working memory off the ledger.
        # (A kept tensor's handle still holds it until its __del__, which calls this, returns: the
        # sizing step, which reads every change, keeps only what cannot be swapped.)
        if entry.ticket is not None:
            self.engine.tier.release(entry.ticket)
            entry.ticket = None
        entry.device_data = None
        if entry.on_ledger:
            self.engine.ledger.remove(entry.num_bytes)
            entry.on_ledger = False
        if self.engine.recorder is not None:
            self.engine.recorder.released(entry.block_index, entry.num_bytes)
        if self.backward_started and self.next_prefetch >= 0:
            self.prefetch()   # room was freed: bring the next entries back while compute goes on
