"""The recorder: the runtime's callbacks during the profiling step, turned into per-block numbers.

Times come from the clock at block boundaries (synchronising CUDA: profiling only); memory from a
`MemoryProbe` marked at each boundary; sizes from the storages the runtime reports as saved.
"""

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from oomless.profile.profile import BlockProfile
from oomless.profile.rss import MemoryProbe
from oomless.profile.tensors import storage_bytes, tensors_in


class Recorder:
    """Receives the runtime's callbacks during the profiling step and keeps per-block numbers."""

    def __init__(self, names: list[str], device: torch.device):
        self.names = names
        self.device = device
        self.tier_stall_source = lambda: 0.0
        self.stall_seconds = 0.0
        self.blocks = {index: BlockProfile(name) for index, name in enumerate(names)}
        self.order: list[int] = []
        self.started: dict[int, float] = {}
        self.unassigned_saved_bytes = 0
        self.backward_marks: list[tuple[float, int]] = []
        self.live_outputs: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self.live_gradients: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self.resident: set[tuple] = set()
        self.probe = MemoryProbe(device)
        self.backward_block: int | None = None
        self.in_backward = False
        self.link = None  # the swap tier's bandwidth as seen in this step, where it could tell
        self.interval_saved_bytes = 0
        self.interval_fetched_bytes = 0

    def tier_stall(self) -> float:
        """Seconds waited on the swap tier so far: taken out of measured backward times."""
        self.stall_seconds += self.tier_stall_source()
        return self.stall_seconds

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # profiling only: exact per-block times
        return time.perf_counter()

    def forward_started(self, resident_storages):
        self.resident = resident_storages

    def _track(self, live: dict, tensors) -> None:
        for tensor in tensors:
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr())
            if key not in self.resident:
                live[key] = (StorageWeakRef(storage), storage.nbytes())

    @staticmethod
    def _alive_bytes(live: dict) -> int:
        for key in [key for key, (weak, _) in live.items() if weak.expired()]:
            del live[key]
        return sum(num_bytes for _, num_bytes in live.values())

    def forward_finished(self, output):
        pass

    def unassigned(self, num_bytes):
        self.unassigned_saved_bytes += num_bytes

    def fetched(self, num_bytes):
        self.interval_fetched_bytes += num_bytes

    def saved(self, block_index, num_bytes):
        self.interval_saved_bytes += num_bytes
        block = self.blocks[block_index]
        block.saved_bytes += num_bytes
        block.largest_saved_bytes = max(block.largest_saved_bytes, num_bytes)

    def block_started(self, index, args):
        if self.in_backward:
            return
        if index not in self.order:
            self.order.append(index)
        block = self.blocks[index]
        block.calls += 1
        block.input_bytes += storage_bytes(tensors_in(args))
        block.held_forward_bytes = max(block.held_forward_bytes, self._alive_bytes(self.live_outputs))
        self.started[index] = self.now()
        self.interval_saved_bytes = 0
        self.probe.mark()

    def block_finished(self, index, output):
        if self.in_backward:
            return
        block = self.blocks[index]
        transient = max(self.probe.peak_since_mark() - self.interval_saved_bytes, 0)
        block.forward_transient_bytes = max(block.forward_transient_bytes or 0, transient)
        block.forward_seconds += self.now() - self.started.pop(index)
        outputs = tensors_in(output)
        block.output_bytes += storage_bytes(outputs)
        self._track(self.live_outputs, outputs)
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(self._backward_mark(index))
                break

    def _backward_mark(self, index):
        def hook(grad):
            self.backward_finished()
            self.backward_block = index
            self.interval_fetched_bytes = 0
            self.probe.mark()
            self.backward_marks.append((self.now() - self.tier_stall(), index))
            self._track(self.live_gradients, [grad])
            block = self.blocks[index]
            block.held_backward_bytes = max(block.held_backward_bytes, self._alive_bytes(self.live_gradients))
        return hook

    def backward_finished(self) -> None:
        """The block whose backward was running is done (the next one started, or backward ended)."""
        if self.backward_block is not None:
            block = self.blocks[self.backward_block]
            transient = max(self.probe.peak_since_mark() - self.interval_fetched_bytes, 0)
            block.backward_transient_bytes = max(block.backward_transient_bytes or 0, transient)
            self.backward_block = None

    def assign_backward_seconds(self, backward_end: float) -> None:
        # A block's backward runs from the moment the gradient of its output is ready until the
        # next block's output gradient is (or backward ends): time minus waits on the swap tier.
        marks = sorted(self.backward_marks) + [(backward_end, None)]
        for (start, index), (end, _) in zip(marks, marks[1:]):
            self.blocks[index].backward_seconds += max(end - start, 0.0)
