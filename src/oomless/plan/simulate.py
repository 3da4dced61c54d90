"""Timeline simulator: replay one training step under a plan and return its peak saved-activation
bytes and its duration.

Streams modelled (as in the CUDA runtime): one compute stream, a copy-out stream for swaps in
forward and a copy-in stream for prefetches in backward. A swapped block's bytes leave the ledger
when its copy-out ends and return when its prefetch starts (the destination is allocated then).
Prefetch of block i is issued when backward reaches block i + distance. A recompute block holds its
inputs from forward to backward and re-runs its forward before its backward. With the disk tier
(compute on CPU) transfers share the cores with compute, so their time is added to the step.
"""

from collections import deque
from dataclasses import dataclass

from oomless.profile.profile import Profile


@dataclass
class Timeline:
    activation_peak_bytes: int
    step_seconds: float
    forward_end_bytes: int
    stall_seconds: float
    curve: list[tuple[float, int]]  # (seconds, resident activation bytes) after each event
    peak_seconds: float = 0.0       # when the peak is first reached
    block_stall_seconds: list[float] | None = None  # per block: backward waiting for its prefetch
    forward_seconds: float = 0.0    # when the forward (and loss) ended


def simulate(profile: Profile, decisions: list[str], prefetch_blocks: int = 1,
             max_pending_out_bytes: int | None = None, keep_curve: bool = False) -> Timeline:
    blocks = profile.blocks
    out_rate, in_rate = profile.link.out_bytes_per_second, profile.link.in_bytes_per_second
    # The disk tier's workers copy on the same CPU cores compute runs on: its transfers do not hide
    # behind compute, they take their time from it (the conservative reading: fully serialised).
    contended = profile.link.kind == "disk"
    events: list[tuple[float, int]] = []  # (time, +/- bytes)
    now, copy_out_free, stall = 0.0, 0.0, 0.0
    out_end = [0.0] * len(blocks)
    pending_out: deque[tuple[float, int]] = deque()  # (copy end, bytes) not yet written, in copy order
    pending_bytes = 0
    for i, (block, decision) in enumerate(zip(blocks, decisions)):
        if max_pending_out_bytes is not None:
            # The disk tier makes the forward wait when too many bytes are still unwritten.
            while pending_out and pending_out[0][0] <= now:
                pending_bytes -= pending_out.popleft()[1]
            while pending_out and pending_bytes + block.saved_bytes > max_pending_out_bytes:
                waited_until, size = pending_out.popleft()
                pending_bytes -= size
                stall += max(waited_until - now, 0.0)
                now = max(now, waited_until)
        now += block.forward_seconds
        if decision == "recompute":
            events.append((now - block.forward_seconds, block.input_bytes))
            continue
        events.append((now, block.saved_bytes))
        if decision == "swap":
            start = max(copy_out_free, now - block.forward_seconds)
            copy_out_free = out_end[i] = max(start + block.saved_bytes / out_rate, now)
            if contended:
                now += block.saved_bytes / out_rate
            events.append((out_end[i], -block.saved_bytes))
            pending_out.append((out_end[i], block.saved_bytes))
            pending_bytes += block.saved_bytes
    now += profile.loss_seconds
    forward_end = now
    forward_end_bytes = sum(delta for time, delta in events if time <= forward_end)

    copy_in_free = 0.0
    ready = [0.0] * len(blocks)
    swapped = [i for i, decision in enumerate(decisions) if decision == "swap"]

    def issue_prefetch(index: int, at: float) -> None:
        nonlocal copy_in_free
        start = max(copy_in_free, at, out_end[index])
        copy_in_free = ready[index] = start + blocks[index].saved_bytes / in_rate
        events.append((start, blocks[index].saved_bytes))

    block_stall = [0.0] * len(blocks)
    # Swapped blocks in descending order; prefetches are issued in that order as backward reaches
    # block j + distance, so one pointer walks them (the simulator stays O(n log n)).
    next_prefetch = len(swapped) - 1
    for i in range(len(blocks) - 1, -1, -1):
        while next_prefetch >= 0 and swapped[next_prefetch] >= i - prefetch_blocks:
            issue_prefetch(swapped[next_prefetch], now)
            next_prefetch -= 1
        block, decision = blocks[i], decisions[i]
        if decision == "swap" and ready[i] > now:
            stall += ready[i] - now
            block_stall[i] = ready[i] - now
            now = ready[i]
        if decision == "swap" and contended:
            now += block.saved_bytes / in_rate
        if decision == "recompute":
            events.append((now, block.saved_bytes))
            now += block.forward_seconds
        now += block.backward_seconds
        events.append((now, -block.saved_bytes))
        if decision == "recompute":
            events.append((now, -block.input_bytes))

    # Additions before removals at equal times: the conservative reading of simultaneous events.
    # (Sorting (time, -delta) pairs natively: a key function would dominate the planner's time.)
    events = [(time, -delta) for time, delta in events]
    events.sort()
    resident, peak, curve = profile.unassigned_saved_bytes, profile.unassigned_saved_bytes, []
    peak_seconds = 0.0
    for time, negative_delta in events:
        resident -= negative_delta
        if resident > peak:
            peak, peak_seconds = resident, time
        if keep_curve:
            curve.append((time, resident))
    return Timeline(peak, now, forward_end_bytes + profile.unassigned_saved_bytes, stall, curve,
                    peak_seconds, block_stall, forward_end)
