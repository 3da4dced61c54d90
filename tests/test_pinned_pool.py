"""The CUDA tier's pinned pool, on CPU with the allocation faked: size classes, reuse across
shapes, a bound on what it holds, and never a 0-byte buffer (``torch.empty(0, pin_memory=True)`` is
not pinned, so a swapped 0-byte storage would be copied non_blocking from pageable memory)."""

import random

import torch

from oomless.runtime.pinned_pool import MIN_CLASS_BYTES, PinnedPool, size_class


class _FakeAllocator:
    """Plain CPU buffers standing in for pinned ones; records every size asked for."""

    def __init__(self):
        self.requests: list[int] = []

    def __call__(self, num_bytes: int) -> torch.Tensor:
        self.requests.append(num_bytes)
        return torch.empty(num_bytes, dtype=torch.uint8)


def test_size_classes_are_powers_of_two_of_at_least_a_page():
    assert [size_class(n) for n in (0, 1, 4096, 4097, 5000, 2**20, 2**20 + 1)] == \
        [MIN_CLASS_BYTES, MIN_CLASS_BYTES, 4096, 8192, 8192, 2**20, 2**21]


def test_a_zero_byte_request_gets_a_real_buffer():
    allocate = _FakeAllocator()
    pool = PinnedPool(allocate)
    view, last_use = pool.acquire(0)
    assert view.numel() == 0 and last_use is None
    assert allocate.requests == [MIN_CLASS_BYTES]


def test_a_buffer_is_reused_by_other_shapes_of_its_class_and_the_class_below():
    allocate = _FakeAllocator()
    pool = PinnedPool(allocate)
    first, _ = pool.acquire(5000)
    pointer = first.data_ptr()
    pool.release(first, "event-1")
    second, last_use = pool.acquire(6000)               # same class (8 KiB), another shape
    assert (second.data_ptr(), second.numel(), last_use) == (pointer, 6000, "event-1")
    pool.release(second, "event-2")
    third, last_use = pool.acquire(3000)                 # class 4 KiB: none idle, the 8 KiB one serves
    assert (third.data_ptr(), last_use) == (pointer, "event-2")
    assert allocate.requests == [8192]


def test_held_bytes_never_pass_the_most_ever_in_use_whatever_the_shapes():
    """Steps whose swapped sizes vary (as with varying sequence lengths): an exact-size pool keeps
    a buffer per size ever seen; this one stays within the largest step's need."""
    allocate = _FakeAllocator()
    pool = PinnedPool(allocate)
    rng = random.Random(0)
    for step in range(50):
        scale = rng.choice((1, 2, 4, 8))
        views = [pool.acquire(rng.randint(1, 64 * 1024) * scale)[0] for _ in range(rng.randint(4, 12))]
        assert pool.held_bytes <= pool.peak_in_use_bytes
        for view in views:
            pool.release(view, None)
    assert pool.held_bytes <= pool.peak_in_use_bytes
    assert sum(buffer.numel() for buffer in pool.buffers()) == pool.held_bytes
    assert pool.held_bytes < sum(allocate.requests)     # something was freed: the bound did work


def test_a_repeated_step_allocates_only_in_its_first_step():
    allocate = _FakeAllocator()
    pool = PinnedPool(allocate)
    sizes = [300_000, 70_000, 70_000, 5, 0, 1 << 20]
    for _ in range(3):
        views = [pool.acquire(size)[0] for size in sizes]
        for view in reversed(views):
            pool.release(view, None)
    assert len(allocate.requests) == len(sizes)


def test_clear_frees_idle_buffers_only():
    pool = PinnedPool(_FakeAllocator())
    held, _ = pool.acquire(10_000)
    idle, _ = pool.acquire(100_000)
    pool.release(idle, None)
    pool.clear()
    assert pool.held_bytes == pool.in_use_bytes == size_class(10_000)
    assert [buffer.data_ptr() for buffer in pool.buffers()] == [held.data_ptr()]


class _CopyOut:
    """Stands for a copy's CUDA event: done once waited for, or when the test says so."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _bookkeeping_tier(max_pending_bytes: int):
    """The CUDA tier without a GPU: its bookkeeping of copies in flight, and a `put` whose copies
    finish when waited for."""
    from collections import deque

    from oomless.runtime.tiers import PinnedHostTier, _CudaTicket

    tier = object.__new__(PinnedHostTier)
    tier.max_pending_bytes, tier._pending, tier._pending_bytes, tier._waited_seconds = max_pending_bytes, deque(), 0, 0.0
    tier._stall_marks = []

    def put(size):
        tier._wait_for_room(size)
        ticket = _CudaTicket()
        ticket.source, ticket.out_done = torch.empty(size, dtype=torch.uint8).untyped_storage(), _CopyOut()
        tier._queued(ticket, size)
        return ticket

    return tier, put


def test_the_cuda_tier_bounds_copies_in_flight_by_waiting_for_the_oldest():
    """The profiler's steps have no budget: `PinnedHostTier.put` waits for the oldest copies
    out once the bytes in flight would pass ``max_pending_bytes``, so the swapped activations can
    leave the device; copies already done, or released, count no more. (The CUDA tier without a
    GPU: its bookkeeping, with events that finish when waited for.)"""
    tier, put = _bookkeeping_tier(100)
    first, second = put(40), put(40)
    assert not first.out_done.done and tier._pending_bytes == 80
    third = put(40)                       # 120 > 100: waits for the first only
    assert first.out_done.done and tier._pending[0][0] is second
    assert not second.out_done.done and tier._pending_bytes == 80
    # The storage stays with the ticket: the engine's next poll frees it and updates the ledger at once.
    assert first.source is not None
    assert tier.collect_stall_seconds() >= 0.0 and tier._waited_seconds == 0.0
    second.out_done.done = True           # finished on its own: leaves without a wait
    third.source = None                   # released
    put(90)
    assert tier._pending_bytes == 90 and len(tier._pending) == 1


def test_the_profilers_sizing_step_keeps_one_copy_out_in_flight():
    """At the sizing step's bound each save first waits for every copy out before it: the step holds
    one swapped storage in flight, not 256 MiB of them beyond what an all-swap plan's budget allows
    (the 3D U-Net's sizing step peaked at 774 MiB with 256 MiB in flight, its smallest all-swap
    budget 479 MiB, H200, 2026-11-29). The timing step keeps a bound that lets copies overlap."""
    from oomless.runtime.tiers import SIZING_MAX_PENDING_BYTES, TIMING_MAX_PENDING_BYTES

    tier, put = _bookkeeping_tier(SIZING_MAX_PENDING_BYTES)
    tickets = [put(1024) for _ in range(4)]
    assert all(ticket.out_done.done for ticket in tickets[:-1]) and not tickets[-1].out_done.done
    assert len(tier._pending) == 1 and tier._pending_bytes == 1024
    tier.max_pending_bytes = TIMING_MAX_PENDING_BYTES
    more = [put(1024) for _ in range(4)]
    assert not any(ticket.out_done.done for ticket in more) and len(tier._pending) == 5
