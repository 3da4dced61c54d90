"""The device ledger: bytes of saved activations resident on the compute device, by storage.

A storage saved by several ops (a view, the same tensor saved twice) is counted once; parameters
and buffers are never on the ledger. `oomless.stats(model)` reads it after a backward.
"""

from dataclasses import dataclass


@dataclass
class Stats:
    """What the runtime did in the steps since `apply` (or since `reset_peak`)."""

    peak_activation_bytes: int = 0
    offloaded_bytes: int = 0
    recomputed_blocks: int = 0
    stall_seconds: float = 0.0
    resident_activation_bytes: int = 0
    steps: int = 0


@dataclass
class Ledger:
    resident_bytes: int = 0
    peak_bytes: int = 0
    offloaded_bytes: int = 0
    recomputed_blocks: int = 0
    stall_seconds: float = 0.0
    steps: int = 0

    def add(self, num_bytes: int) -> None:
        self.resident_bytes += num_bytes
        if self.resident_bytes > self.peak_bytes:
            self.peak_bytes = self.resident_bytes

    def remove(self, num_bytes: int) -> None:
        self.resident_bytes -= num_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.resident_bytes
        self.offloaded_bytes = 0
        self.recomputed_blocks = 0
        self.stall_seconds = 0.0
        self.steps = 0

    def snapshot(self) -> Stats:
        return Stats(
            peak_activation_bytes=self.peak_bytes,
            offloaded_bytes=self.offloaded_bytes,
            recomputed_blocks=self.recomputed_blocks,
            stall_seconds=self.stall_seconds,
            resident_activation_bytes=self.resident_bytes,
            steps=self.steps,
        )
