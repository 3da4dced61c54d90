"""What selective recompute (runtime/selective.py) would keep and save, per block, measured in the
profiling step's forward.

A dispatch mode sees every op the forward runs. For the op outputs a selective block keeps (matrix
products, convolutions, attention) it adds up their storages' bytes, the bytes among them that no
op saves for backward (the runtime's pack hook never sees them), and the op time they take against
the time of all the block's ops: a selective recompute re-runs the rest (the planner charges that
share of the block's forward time). Op times are wall-clock around each op (CPU), or CUDA events
read after the step; the profiling step's block times include the runtime's own work, these do not.
A block whose kept outputs some op writes into in place is not offered it (`_note_writes`).
"""

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from oomless.runtime import selective


class SelectiveMeter(TorchDispatchMode):
    """Entered for the whole forward; ``block()`` says which block is running (None: none)."""

    def __init__(self, block, device: torch.device):
        super().__init__()
        self.block = block
        self.cuda = device.type == "cuda"
        # Kept outputs alive: storage key -> [weak reference, bytes, block, saved by backward]. A key
        # whose storage has died is a freed address that a later storage may reuse: totalled first.
        self.live: dict[tuple, list] = {}
        self.kept_bytes: dict[int, int] = {}
        self.unsaved_bytes: dict[int, int] = {}
        self.written: set[int] = set()      # blocks whose kept outputs an op wrote into
        self.op_seconds: dict[int, list] = {}              # block: [kept ops' time, all ops' time]
        self._events: list[tuple[int, bool, torch.cuda.Event, torch.cuda.Event]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.live and func._schema.is_mutable:
            self._note_writes(func, args, kwargs or {})
        index = self.block()
        if index is None:
            return func(*args, **(kwargs or {}))
        saved_op = selective.is_saved_op(func)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **(kwargs or {}))
            end.record()
            self._events.append((index, saved_op, start, end))
        else:
            started = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self._add_time(index, saved_op, time.perf_counter() - started)
        if saved_op:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                    storage = leaf.untyped_storage()
                    key = (leaf.device, storage.data_ptr())
                    record = self.live.get(key)
                    if record is not None and not record[0].expired():
                        continue        # an output that is a view of one kept already
                    if record is not None:
                        self._total(record)
                    self.live[key] = [StorageWeakRef(storage), storage.nbytes(), index, False]
        return out

    def _note_writes(self, func, args, kwargs) -> None:
        """An op that writes into a kept output (an in-place activation after a convolution, an add
        into a matmul's result) changes what torch's cache would hand back: torch refuses that at
        the replay, so the block that kept it is not offered selective recompute."""
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name) if argument.kwarg_only or position >= len(args) else args[position]
            for leaf in tree_leaves(value):
                if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                    record = self.live.get((leaf.device, leaf.untyped_storage().data_ptr()))
                    if record is not None and not record[0].expired():
                        self.written.add(record[2])

    def saved(self, tensor: torch.Tensor) -> None:
        """The runtime's pack hook saved ``tensor`` for backward (first save of its storage)."""
        storage = tensor.untyped_storage()
        record = self.live.get((tensor.device, storage.data_ptr()))
        if record is not None and not record[0].expired():
            record[3] = True

    def _total(self, record: list) -> None:
        _, num_bytes, index, saved = record
        self.kept_bytes[index] = self.kept_bytes.get(index, 0) + num_bytes
        if not saved:
            self.unsaved_bytes[index] = self.unsaved_bytes.get(index, 0) + num_bytes

    def _add_time(self, index: int, saved_op: bool, seconds: float) -> None:
        times = self.op_seconds.setdefault(index, [0.0, 0.0])
        times[0] += seconds if saved_op else 0.0
        times[1] += seconds

    def fill(self, blocks: dict) -> None:
        """Write the measured fields into ``blocks`` (index: BlockProfile)."""
        if self._events:
            torch.cuda.synchronize()
            for index, saved_op, start, end in self._events:
                self._add_time(index, saved_op, start.elapsed_time(end) / 1e3)
            self._events.clear()
        for record in self.live.values():
            self._total(record)
        self.live.clear()
        for index, block in blocks.items():
            kept_seconds, all_seconds = self.op_seconds.get(index, (0.0, 0.0))
            block.selective_kept_bytes = self.kept_bytes.get(index, 0)
            block.selective_unsaved_bytes = self.unsaved_bytes.get(index, 0)
            block.selective_time_share = kept_seconds / all_seconds if all_seconds > 0 else 0.0
            if index in self.written:
                block.selective_kept_bytes = block.selective_unsaved_bytes = block.selective_time_share = None


def without_selective(profile):
    """``profile`` with selective recompute not offered (its measurements dropped), for steps where it
    does not compose: compiled blocks (a dispatch mode around compiled code), chains in slabs,
    parameters brought in by block hooks (FSDP's all-gather, the offload of parameters) and pipeline
    stages (a zero-bubble schedule recomputes a block twice; torch's cache of kept outputs serves
    one replay)."""
    for block in profile.blocks:
        block.selective_kept_bytes = block.selective_unsaved_bytes = block.selective_time_share = None
    return profile
