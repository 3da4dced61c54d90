"""Saved-tensor handling for keep and swap blocks, on `torch.autograd.graph.saved_tensors_hooks`.

Every tensor autograd saves inside the model's forward goes through `pack`. The unit of work is the
storage: a storage saved by several ops shares one `_Entry`, so it is counted and moved once.
Parameters, buffers, the forward's own inputs, small tensors and anything outside a block stay
where they are (kept, exactly as plain PyTorch would).
"""

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"


class _Entry:
    """One saved storage: kept on the device, or moved to a tier and brought back for backward."""

    __slots__ = ("registry", "block_index", "num_bytes", "decision", "weak", "device_data",
                 "ticket", "handles", "on_ledger", "fetched")

    def __init__(self, registry, block_index: int, storage, decision: str):
        self.registry = registry
        self.block_index = block_index
        self.num_bytes = storage.nbytes()
        self.decision = decision
        self.weak = StorageWeakRef(storage)
        self.device_data = None
        self.ticket = None
        self.handles = 0
        self.on_ledger = False
        self.fetched = False


class _Handle:
    """What autograd holds instead of a saved tensor; dropping it releases its share."""

    __slots__ = ("entry", "tensor", "storage_offset", "size", "stride", "dtype", "__weakref__")

    def __init__(self, entry: _Entry | None, tensor: torch.Tensor, hold: bool = False):
        self.entry = entry
        if entry is None or entry.decision == KEEP or hold:
            self.tensor = tensor
        else:
            self.tensor = None
            self.storage_offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()
            self.dtype = tensor.dtype
        if entry is not None:
            entry.handles += 1

    def __del__(self):
        entry = self.entry
        if entry is not None:
            entry.handles -= 1
            if entry.handles == 0:
                entry.registry.release(entry)


class ForwardRegistry:
    """The entries of one forward pass, indexed by storage while that storage may still be alive."""

    def __init__(self, engine):
        self.engine = engine
        self.by_storage: dict[tuple, _Entry] = {}
        self.swapped_by_block: dict[int, list[_Entry]] = {}
        self.backward_started = False

    def entry_for(self, tensor: torch.Tensor, block_index: int, decision: str) -> _Entry:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        entry = self.by_storage.get(key)
        # An entry whose handles all went (a graph freed during the forward, e.g. a metric computed
        # with grad and dropped) has been released: its ticket and ledger share are gone, so a
        # later save of the same live storage needs a fresh entry, not that one.
        if entry is not None and not entry.weak.expired() and entry.handles > 0:
            return entry
        entry = _Entry(self, block_index, storage, decision)
        self.by_storage[key] = entry
        # Kept bytes count as much as swapped ones: either waits for earlier copies if the ledger
        # would pass the budget.
        self.engine.make_room(entry.num_bytes)
        ledger = self.engine.ledger
        entry.on_ledger = True
        ledger.add(entry.num_bytes)
        if self.engine.recorder is not None:
            self.engine.recorder.saved(block_index, entry.num_bytes)
        if decision == SWAP:
            data = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            entry.ticket = self.engine.tier.put(data)
            ledger.offloaded_bytes += entry.num_bytes
            self.swapped_by_block.setdefault(block_index, []).append(entry)
            self.engine.pending_out.append(entry)
        else:
            entry.device_data = tensor
        return entry

    def fetch(self, entry: _Entry) -> torch.Tensor:
        engine = self.engine
        engine.poll()
        if not entry.fetched:
            self._prefetch_ahead(entry.block_index)
            entry.device_data = engine.tier.get(entry.ticket)
            entry.fetched = True
            if not entry.on_ledger:
                entry.on_ledger = True
                engine.ledger.add(entry.num_bytes)
                if engine.recorder is not None:
                    engine.recorder.fetched(entry.num_bytes)
        return entry.device_data

    def _prefetch_ahead(self, block_index: int) -> None:
        # Backward visits blocks in reverse: bring back this block and the next `distance` ones
        # below it while compute works on this one.
        distance = self.engine.prefetch_blocks
        for index in range(block_index, block_index - distance - 1, -1):
            for entry in self.swapped_by_block.get(index, ()):
                if not entry.fetched and entry.ticket is not None and not entry.on_ledger:
                    if not self.engine.has_room(entry.num_bytes) and index != block_index:
                        return  # the budget is full: the rest is fetched when backward needs it
                    self.engine.tier.prefetch(entry.ticket)
                    if not entry.on_ledger:
                        entry.on_ledger = True
                        self.engine.ledger.add(entry.num_bytes)
                        if self.engine.recorder is not None:
                            self.engine.recorder.fetched(entry.num_bytes)

    def release(self, entry: _Entry) -> None:
        if entry.on_ledger:
            self.engine.ledger.remove(entry.num_bytes)
            entry.on_ledger = False
        if entry.ticket is not None:
            self.engine.tier.release(entry.ticket)
            entry.ticket = None
        entry.device_data = None


class SavedTensorEngine:
    """pack/unpack for one installed model."""

    def __init__(self, ledger, tier, prefetch_blocks: int, min_swap_bytes: int, budget_bytes: int | None = None,
                 device: torch.device | None = None):
        self.ledger = ledger
        self.device = device
        self.budget_bytes = budget_bytes
        self.tier = tier
        self.prefetch_blocks = prefetch_blocks
        self.min_swap_bytes = min_swap_bytes
        self.pending_out: list[_Entry] = []
        self.resident_storages: set[tuple] = set()
        self.registry: ForwardRegistry | None = None
        self.block_index: int | None = None
        self.decision: str = KEEP
        self.recorder = None
        self.recompute_bytes: dict[int, int] = {}
        self._recomputed_on_ledger = 0

    def recompute_started(self, block_index: int) -> None:
        """Put a recomputed block's saved bytes (known from the profile) on the ledger: they live
        inside torch's checkpoint frame where no hook of ours sees them."""
        self.backward_moved()
        self._recomputed_on_ledger = self.recompute_bytes.get(block_index, 0)
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
            if (tensor.device, tensor.untyped_storage().data_ptr()) in self.resident_storages:
                continue
            handles.append(_Handle(registry.entry_for(tensor, block_index, KEEP), tensor))
        return handles

    def begin_forward(self, resident_storages: set[tuple]) -> None:
        self.resident_storages = resident_storages
        self.registry = ForwardRegistry(self)

    def has_room(self, num_bytes: int) -> bool:
        return self.budget_bytes is None or self.ledger.resident_activation_bytes + num_bytes <= self.budget_bytes

    def make_room(self, num_bytes: int) -> None:
        """Before a saved storage goes on the ledger: if that would pass the activation budget,
        wait for earlier swaps' copies to finish. The plan predicts this never happens; when copies
        fall behind the prediction, waiting keeps the budget a promise (on CUDA this is a host
        synchronisation, the only one the runtime makes, and only in that case)."""
        self.poll()
        while not self.has_room(num_bytes) and self.pending_out:
            entry = self.pending_out[0]
            started = time.perf_counter()
            self.tier.wait_out(entry.ticket)
            self.ledger.stall_seconds += time.perf_counter() - started
            self.poll()

    def poll(self) -> None:
        """Take swapped-out storages off the ledger once their copy has completed (no waiting)."""
        still_pending = []
        for entry in self.pending_out:
            if entry.ticket is None:
                continue
            if self.tier.is_out(entry.ticket):
                if entry.on_ledger and not entry.fetched:
                    entry.on_ledger = False
                    self.ledger.remove(entry.num_bytes)
            else:
                still_pending.append(entry)
        self.pending_out = still_pending

    def pack(self, tensor: torch.Tensor):
        registry, block_index = self.registry, self.block_index
        if registry is None or not isinstance(tensor, torch.Tensor):
            return tensor
        if block_index is None:
            if self.recorder is not None and tensor.device.type != "meta":
                self.recorder.unassigned(tensor.untyped_storage().nbytes())
            return tensor
        if tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested:
            return tensor
        storage = tensor.untyped_storage()
        if (tensor.device, storage.data_ptr()) in self.resident_storages:
            return tensor  # a parameter, buffer or forward input: resident anyway, never moved
        decision = self.decision
        movable = self._movable(tensor)
        if decision == SWAP and (storage.nbytes() < self.min_swap_bytes or not movable):
            decision = KEEP
        self.poll()
        # hold: the storage may already have a swap entry (saved earlier through a plain view);
        # this view still cannot be rebuilt from bytes, so its handle keeps the tensor itself.
        return _Handle(registry.entry_for(tensor, block_index, decision), tensor, hold=not movable)

    def _movable(self, tensor: torch.Tensor) -> bool:
        """Whether `unpack` can rebuild ``tensor`` from its storage bytes alone. Not a tensor on
        another device than the tier's (a CPU scalar in a CUDA op, a second GPU: the tier's streams
        and pinned copies are for its own device), nor a conjugate or negative view: its conj/neg
        bit is not in the bytes, and dropping it would change the values backward reads."""
        if self.device is not None and tensor.device != self.device:
            return False
        return not (tensor.is_conj() or tensor.is_neg())

    def unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        if self._recomputed_on_ledger:
            self.backward_moved()
        if packed.tensor is not None:
            return packed.tensor
        entry = packed.entry
        data = entry.registry.fetch(entry)
        return torch.empty(0, dtype=packed.dtype, device=data.device).set_(
            data.untyped_storage(), packed.storage_offset, packed.size, packed.stride)
