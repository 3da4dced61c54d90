"""Timeline simulator: replay one training step under a plan and return its peak saved-activation
bytes and its duration.

Streams modelled (as in the CUDA runtime): one compute stream, a copy-out stream for swaps in
forward and a copy-in stream for prefetches in backward. A swapped block's bytes leave the ledger
when its copy-out ends and return when its prefetch starts (the destination is allocated then).
Prefetch of block i is issued when backward reaches block i + distance. A recompute block holds its
inputs from forward to backward and re-runs its forward before its backward.
"""

from dataclasses import dataclass

from oomless.profile.profile import Profile


@dataclass
class Timeline:
    activation_peak_bytes: int
    step_seconds: float
    forward_end_bytes: int
    stall_seconds: float
    curve: list[tuple[float, int]]  # (seconds, resident activation bytes) after each event


def simulate(profile: Profile, decisions: list[str], prefetch_blocks: int = 1,
             max_pending_out_bytes: int | None = None, keep_curve: bool = False) -> Timeline:
    blocks = profile.blocks
    out_rate, in_rate = profile.link.out_bytes_per_second, profile.link.in_bytes_per_second
    events: list[tuple[float, int]] = []  # (time, +/- bytes)
    now, copy_out_free, stall = 0.0, 0.0, 0.0
    out_end = [0.0] * len(blocks)
    pending_out: list[tuple[float, int]] = []  # (copy end, bytes) not yet written
    for i, (block, decision) in enumerate(zip(blocks, decisions)):
        if max_pending_out_bytes is not None:
            # The disk tier makes the forward wait when too many bytes are still unwritten.
            pending_out = [(end, size) for end, size in pending_out if end > now]
            while pending_out and sum(size for _, size in pending_out) + block.saved_bytes > max_pending_out_bytes:
                waited_until = pending_out.pop(0)[0]
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
            events.append((out_end[i], -block.saved_bytes))
            pending_out.append((out_end[i], block.saved_bytes))
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

    issued = set()
    for i in range(len(blocks) - 1, -1, -1):
        for j in swapped:
            if j not in issued and i - prefetch_blocks <= j <= i:
                issue_prefetch(j, now)
                issued.add(j)
        block, decision = blocks[i], decisions[i]
        if decision == "swap" and ready[i] > now:
            stall += ready[i] - now
            now = ready[i]
        if decision == "recompute":
            events.append((now, block.saved_bytes))
            now += block.forward_seconds
        now += block.backward_seconds
        events.append((now, -block.saved_bytes))
        if decision == "recompute":
            events.append((now, -block.input_bytes))

    # Additions before removals at equal times: the conservative reading of simultaneous events.
    events.sort(key=lambda event: (event[0], -event[1]))
    resident, peak, curve = profile.unassigned_saved_bytes, profile.unassigned_saved_bytes, []
    for time, delta in events:
        resident += delta
        peak = max(peak, resident)
        if keep_curve:
            curve.append((time, resident))
    return Timeline(peak, now, forward_end_bytes + profile.unassigned_saved_bytes, stall, curve)
