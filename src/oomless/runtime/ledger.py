"""The device ledger: bytes of saved activations resident on the compute device, by storage.

A storage saved by several ops (a view, the same tensor saved twice) is counted once; parameters
and buffers are never on the ledger. `oomless.stats(model)` reads a copy of it after a backward.
"""

from dataclasses import dataclass, fields


@dataclass
class Stats:
    """What the runtime did in the steps since `apply`."""

    peak_activation_bytes: int = 0
    offloaded_bytes: int = 0
    recomputed_blocks: int = 0
    stall_seconds: float = 0.0
    resident_activation_bytes: int = 0
    steps: int = 0
    skipped_steps: int = 0           # fp16: optimizer steps skipped for inf/nan gradients (runtime/precision.py)
    loss_scale: float | None = None  # fp16: the loss scale now


class Ledger(Stats):
    """The live counters the runtime updates; `snapshot` hands out a plain `Stats`. ``observer``
    (the profiler's recorder) is told, before each change, the resident bytes until then and the
    change: ``observer(resident, change)``."""

    observer = None

    def add(self, num_bytes: int) -> None:
        if self.observer is not None:
            self.observer(self.resident_activation_bytes, num_bytes)
        self.resident_activation_bytes += num_bytes
        if self.resident_activation_bytes > self.peak_activation_bytes:
            self.peak_activation_bytes = self.resident_activation_bytes

    def remove(self, num_bytes: int) -> None:
        if self.observer is not None:
            self.observer(self.resident_activation_bytes, -num_bytes)
        self.resident_activation_bytes -= num_bytes

    def snapshot(self) -> Stats:
        return Stats(**{field.name: getattr(self, field.name) for field in fields(Stats)})
