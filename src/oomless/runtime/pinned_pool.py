"""Page-locked host buffers for the CUDA swap tier, reused across steps and shapes, and bounded.

Pinned allocation is slow (the driver locks every page) and PyTorch's host caching allocator
(``CachingHostAllocator``, behind ``torch.empty(..., pin_memory=True)``) rounds every request up to a
power of two and keeps freed blocks for later requests. A pool that asked for exact sizes therefore
held up to twice what it counted, and with shapes that vary from step to step (a sequence length, a
crop) kept one buffer per size ever seen: it grew without bound. This pool:

- hands out buffers by size class: the power of two at or above the request, at least
  ``MIN_CLASS_BYTES`` (so a 0-byte request still gets real pinned memory:
  ``torch.empty(0, pin_memory=True)`` is not pinned), as a view of the request's length;
- reuses a buffer across shapes: any request of a class takes an idle buffer of that class, or of
  the next class up before allocating;
- is bounded: it never holds (in use plus idle) more than the most bytes it ever had in use at once.
  Before allocating past that mark it frees idle buffers, oldest first.
"""

from collections import deque
from collections.abc import Callable

import torch

MIN_CLASS_BYTES = 4096          # one page: pinning works in pages anyway


def size_class(num_bytes: int) -> int:
    """Bytes a buffer for ``num_bytes`` really holds: the power of two at or above it, at least one page."""
    return max(MIN_CLASS_BYTES, 1 << max(0, num_bytes - 1).bit_length())


def allocate_pinned(num_bytes: int) -> torch.Tensor:
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """``acquire(n)`` returns (a uint8 view of n bytes, the event of the buffer's last use or None);
    ``release(view, last_use)`` gives it back. ``allocate`` makes a buffer (a test passes a fake).

    The last-use event travels with the buffer: the next user's copy stream waits on it, so a
    buffer is never overwritten while a host->device copy still reads it. Freeing an idle buffer
    needs no such wait: PyTorch's host allocator records an event for every non_blocking copy
    that touches pinned memory and does not hand the block out again before that copy completes."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] = allocate_pinned):
        self._allocate = allocate
        self._idle: dict[int, deque] = {}               # class bytes -> (serial, buffer, last_use), oldest first
        self._in_use: dict[int, torch.Tensor] = {}      # data pointer -> whole buffer
        self._serial = 0
        self.held_bytes = 0             # in use + idle
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0

    def acquire(self, num_bytes: int) -> tuple[torch.Tensor, object]:
        wanted = size_class(num_bytes)
        for size in (wanted, 2 * wanted):
            idle = self._idle.get(size)
            if idle:
                _, buffer, last_use = idle.popleft()
                return self._hand_out(buffer, num_bytes), last_use
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes + wanted)
        self._free_idle_until(self.peak_in_use_bytes - wanted)
        buffer = self._allocate(wanted)
        self.allocations += 1
        self.held_bytes += wanted
        return self._hand_out(buffer, num_bytes), None

    def _hand_out(self, buffer: torch.Tensor, num_bytes: int) -> torch.Tensor:
        self._in_use[buffer.untyped_storage().data_ptr()] = buffer
        self.in_use_bytes += buffer.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer[:num_bytes]

    def release(self, view: torch.Tensor, last_use) -> None:
        buffer = self._in_use.pop(view.untyped_storage().data_ptr())   # a 0-byte view's data_ptr() is 0
        self.in_use_bytes -= buffer.numel()
        self._serial += 1
        self._idle.setdefault(buffer.numel(), deque()).append((self._serial, buffer, last_use))

    def _free_idle_until(self, held_limit_bytes: int) -> None:
        """Drop idle buffers, oldest first, until the pool holds at most ``held_limit_bytes``."""
        while self.held_bytes > held_limit_bytes:
            heads = [(idle[0][0], size) for size, idle in self._idle.items() if idle]
            if not heads:
                return
            _, size = min(heads)
            self._idle[size].popleft()
            self.held_bytes -= size

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, idle or in use."""
        return [buffer for idle in self._idle.values() for _, buffer, _ in idle] + list(self._in_use.values())

    def clear(self) -> None:
        """Free the idle buffers (the tier is closing; buffers in use go when released)."""
        self._free_idle_until(self.in_use_bytes)
