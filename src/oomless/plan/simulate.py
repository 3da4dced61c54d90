"""Timeline simulator: replay one training step under a plan, saved tensor by saved tensor, and
return its peak bytes and its duration. It does what the runtime (`runtime/saved.py`) does.

Streams modelled (as in the CUDA runtime): one compute stream, a copy-out stream for swaps in forward
and a copy-in stream for prefetches in backward.
- Forward: a block's saved tensors (its profiled storages, in order) appear evenly over its forward.
  A kept one stays until backward uses it; a swapped one leaves when its copy out ends (copies queue
  on one stream, in order); a recompute block holds only its inputs. A swapped block keeps, as the
  runtime does, the storages it cannot move or that are under the plan's ``min_swap_bytes``
  (`BlockProfile.kept_when_swapped`, `with_swap_threshold`).
- Backward: blocks in reverse; a block's tensors are used evenly over its backward, last saved first,
  and each leaves right after its use. Swapped tensors are asked back in that order, ahead of their
  use as far as the activation budget's free bytes and the prefetch window allow, leaving room in
  each phase before their use for what a recompute there puts on the ledger; a tensor not back
  in time stalls compute until its copy lands. A swapped storage that a later block saved too (its
  input: `BlockProfile.saved_earlier`) is first used in that block's backward, by the op that saved
  it, and stays until its own block's. A recompute block re-runs its forward first and holds
  all its saved bytes until its backward ends.
- Selective recompute (decision "selective" here; in the plan a recompute block with ``selective``
  set, runtime/selective.py): the forward holds the block's inputs and the outputs of its costly ops
  from its start to its backward; the backward re-runs the rest of its forward (its share of the
  forward time) and holds its saved bytes with those outputs until it ends.
- With the disk tier (compute on CPU) transfers share the cores with compute: their time is added to
  the step (the conservative reading: fully serialised).
- Besides the ledger (saved activations), each phase holds "other" bytes: measured per block forward
  and backward and for the loss (`profile.recorder`), else estimated from held and tensor sizes.
  Whatever phase runs, at least the least of those is there: the ledger's peak plus that least is
  counted as a peak too, so the ledger never predicts more than the plan's activation budget.
"""

import heapq
from collections import deque
from dataclasses import dataclass, field, replace

from oomless.profile.profile import RESIDENT_INPUT, BlockProfile, Profile


@dataclass
class Timeline:
    activation_peak_bytes: int      # the ledger's peak: saved activations resident on the device
    step_seconds: float
    forward_end_bytes: int
    stall_seconds: float
    curve: list[tuple[float, int]]  # (seconds, bytes beyond static memory) after each event
    peak_seconds: float = 0.0       # when the ledger's peak is first reached
    block_stall_seconds: list[float] | None = None  # per block: backward waiting for its tensors
    forward_seconds: float = 0.0    # when the forward (and loss) ended
    total_peak_bytes: int = 0       # the peak of saved activations plus the phases' other bytes (see `simulate`)
    peak_phase: tuple[str, int] = ("forward", -1)  # (kind, block index) of the phase at that peak
    # The simulation's arguments, to replay it when asked which blocks hold bytes at that peak.
    _replay: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def peak_holders(self) -> dict[int, int]:
        """Block index -> its saved bytes on the device at the total peak. Replayed when asked (error
        messages ask): keeping every simulation's events for it would cost the solvers gigabytes."""
        if self._replay is None:
            return {}
        return simulate(*self._replay, holders=True)


def entry_sizes(block: BlockProfile) -> list[int]:
    """The block's saved storages in the order saved: as profiled, or (profiles made by hand) its
    saved bytes in pieces of its largest storage."""
    if block.saved_sizes:
        return block.saved_sizes
    if block.saved_bytes <= 0:
        return []
    piece = max(block.largest_saved_bytes, 1)
    whole, rest = divmod(block.saved_bytes, piece)
    return [piece] * whole + ([rest] if rest else [])


def with_swap_threshold(profile: Profile, min_swap_bytes: int) -> Profile:
    """``profile`` as a plan with ``min_swap_bytes`` runs it: in every block, the storages under it
    (and empty ones) are added to those a swap keeps on the device (`BlockProfile.kept_when_swapped`),
    as the runtime's pack does (runtime/saved.py). The profile given is not changed."""
    threshold = max(min_swap_bytes, 1)
    blocks = []
    for block in profile.blocks:
        small = {index for index, size in enumerate(entry_sizes(block)) if size < threshold}
        kept = sorted(small | set(block.kept_when_swapped))
        blocks.append(replace(block, kept_when_swapped=kept) if kept != block.kept_when_swapped else block)
    return replace(profile, blocks=blocks)


def kept_when_swapped_bytes(block: BlockProfile) -> int:
    """Bytes a swap of ``block`` leaves on the device (`BlockProfile.kept_when_swapped`)."""
    sizes = entry_sizes(block)
    return sum(sizes[index] for index in block.kept_when_swapped if index < len(sizes))


def least_other_bytes(profile: Profile) -> int:
    """The smallest working memory of any phase (a block's forward or backward, the loss): what
    whichever phase runs holds at least besides the ledger; the plan's activation budget is the
    rest of the budget beyond static bytes. Less the gradients not made yet where the step starts
    without them (`gradients_absent_bytes`): the phases of a plan keeping every block."""
    return _phases(profile, ["keep"] * len(profile.blocks))[3]


def _estimated_transient(block: BlockProfile) -> int:
    return 2 * block.output_bytes + 2 * block.largest_saved_bytes


def forward_other_bytes(profile: Profile, block: BlockProfile) -> int:
    """Bytes beyond static memory and the ledger while ``block``'s forward runs."""
    if block.forward_other_bytes is not None:
        return block.forward_other_bytes
    transient = block.forward_transient_bytes if block.forward_transient_bytes is not None \
        else _estimated_transient(block)
    return block.held_forward_bytes + transient + profile.unassigned_saved_bytes


def backward_other_bytes(profile: Profile, block: BlockProfile) -> int:
    """Bytes beyond static memory and the ledger while ``block``'s backward runs."""
    if block.backward_other_bytes is not None:
        return block.backward_other_bytes
    transient = block.backward_transient_bytes if block.backward_transient_bytes is not None \
        else _estimated_transient(block)
    return block.held_backward_bytes + max(transient, block.output_bytes) + profile.unassigned_saved_bytes


def forward_own_peak_bytes(profile: Profile, block: BlockProfile) -> int:
    """The most at one time of ``block``'s own saved bytes and its other bytes in its forward, as a
    plan keeping it holds them (`BlockProfile.forward_own_peak_bytes`): where not measured, all of
    its saves on top of its most other bytes."""
    return _own_peak(block.saved_bytes, forward_other_bytes(profile, block), block.forward_own_peak_bytes)


def backward_own_peak_bytes(profile: Profile, block: BlockProfile) -> int:
    """The same as `forward_own_peak_bytes` in ``block``'s backward."""
    return _own_peak(block.saved_bytes, backward_other_bytes(profile, block), block.backward_own_peak_bytes)


def _own_peak(saved: int, other: int, measured: int | None) -> int:
    summed = saved + other
    return summed if measured is None else min(measured, summed)


def loss_other_bytes(profile: Profile) -> int:
    """Bytes beyond static memory and the ledger from the end of the forward to the first backward:
    measured, or the model's output and as much again for the loss's own tensors."""
    if profile.loss_other_bytes is not None:
        return profile.loss_other_bytes
    final_output = profile.blocks[-1].output_bytes if profile.blocks else 0
    return 2 * final_output + profile.unassigned_saved_bytes


@dataclass
class Phase:
    """What a phase of the step holds beyond static memory: ``other`` bytes on top of the ledger;
    where measured, ``peak``: the most at one time of those and the ledger in the profiling step,
    which swapped every block's tensors (written out as saved, brought back only when used); and
    where the plan holds the block's own tensors through the phase (kept; recomputed, in backward),
    ``own_peak``: the most at one time of its other bytes and its own tensors held then (the
    ledger's bytes of other blocks come on top). None: ledger and other bytes are added."""

    block: int          # -1: the loss
    other: int
    peak: int | None
    kind: str = "forward"   # "forward", "backward" or "loss"
    own_peak: int | None = None


def gradients_absent_bytes(profile: Profile, present: int | None) -> int:
    """Of the gradient bytes static memory counts, those that do not exist yet in a phase where
    ``present`` have been accumulated (None: not measured), when the step starts with none
    (`Profile.gradients_from_backward`); 0 otherwise. The phases' memory is static memory plus their
    own, so this much of it is room the phase has."""
    if not profile.gradients_from_backward or present is None:
        return 0
    return max(profile.gradient_bytes - present, 0)


def _less(value: int | None, absent: int) -> int | None:
    return None if value is None else value - absent


def phases(profile: Profile, decisions: list[str]) -> tuple[list[Phase], Phase, list[Phase]]:
    """(forward phase per block, the loss, backward phase per block). A recomputed block's backward
    re-runs its forward first, so it holds the larger of the two. Where the step starts without
    gradients, each phase's bytes are less those not made yet (`gradients_absent_bytes`; negative
    where that is more than the phase's own: room static memory counted for them), and where the
    plan moves static bytes during the step, less those not on the device in that phase
    (`BlockProfile.forward_static_absent_bytes`, set by `plan.static_phases`)."""
    return _phases(profile, decisions)[:3]


def _phases(profile: Profile, decisions: list[str]) -> tuple[list[Phase], Phase, list[Phase], int]:
    """`phases`, and `least_other_bytes` from the same pass: a phase's other bytes under keep are those
    of any decision but a recompute's backward, which holds the more of its forward's and backward's
    (the simulator asks both for every plan it replays)."""
    forward, backward = [], []
    before_backward = gradients_absent_bytes(profile, 0)
    loss_absent = before_backward + profile.loss_static_absent_bytes
    loss = Phase(-1, loss_other_bytes(profile) - loss_absent, _less(profile.loss_peak_bytes, loss_absent), "loss")
    least = loss.other
    for i, (block, decision) in enumerate(zip(profile.blocks, decisions)):
        # Where a block is kept or recomputed, its own tensors are on the ledger as what the plan
        # holds: the profiling step's peak, which had them swapped, does not describe it.
        swapped = decision == "swap"
        forward_absent = before_backward + block.forward_static_absent_bytes
        kept = decision == "keep"
        forward_other = forward_other_bytes(profile, block)
        forward_own = _own_peak(block.saved_bytes, forward_other, block.forward_own_peak_bytes)
        forward.append(Phase(i, forward_other - forward_absent,
                             _less(block.forward_peak_bytes, forward_absent) if swapped else None,
                             own_peak=forward_own - forward_absent if kept else None))
        gradients_absent = gradients_absent_bytes(profile, block.backward_gradient_bytes)
        absent = gradients_absent + block.backward_static_absent_bytes
        backward_other = backward_other_bytes(profile, block)
        other = backward_other - absent
        least = min(least, other, forward[-1].other)
        # The static bytes a placement takes off the device in this phase are those of the stretch
        # where its other bytes peak (`plan.static_phases`), not necessarily where its own peak is:
        # only static bytes it adds are counted there.
        own_peak = (_own_peak(block.saved_bytes, backward_other, block.backward_own_peak_bytes) - gradients_absent
                    - min(block.backward_static_absent_bytes, 0)) if kept or decision == "recompute" else None
        if decision in RECOMPUTING:
            # The recompute re-runs the forward in backward, where the gradients so far exist.
            recompute_absent = gradients_absent + block.recompute_static_absent_bytes
            other = max(other, forward_other - recompute_absent)
            if own_peak is not None:
                own_peak = max(own_peak, forward_own - recompute_absent)
        backward.append(Phase(i, other, _less(block.backward_peak_bytes, absent) if swapped else None, "backward",
                              own_peak))
    return forward, loss, backward, least


SWAPPED, HELD, AHEAD, INPUT = 0, 1, 2, 3     # INPUT: a recompute block's held inputs (not its own saves)
SELECTIVE = "selective"
RECOMPUTING = ("recompute", SELECTIVE)


def selective_offered(block: BlockProfile) -> bool:
    """Whether the profile measured what selective recompute of ``block`` holds and costs."""
    return block.selective_kept_bytes is not None and block.selective_time_share is not None


def selective_held_bytes(block: BlockProfile) -> int:
    """What a selective block holds from its forward to its backward: its inputs and kept outputs."""
    return block.input_bytes + (block.selective_kept_bytes or 0)


def selective_backward_bytes(block: BlockProfile) -> int:
    """What a selective block holds while its backward runs: its inputs, its saved bytes and the
    kept outputs no op saves."""
    return block.input_bytes + block.saved_bytes + (block.selective_unsaved_bytes or 0)


def recompute_held_bytes(block: BlockProfile, index: int, decisions: list[str]) -> int:
    """What recompute block ``index`` holds from its forward to its backward: its inputs, but those
    an earlier block holds already under ``decisions`` (`BlockProfile.input_held_earlier`): saved by
    a kept block, or the input of a recomputed one, whose backward comes after this one's; and
    parameters and the model's inputs, which are resident. The runtime's entries are per storage, so
    such an input costs nothing more. A block called more than once is placed at its first call,
    and a later call's input may be held by a block after it: there only resident inputs are left out."""
    def held_earlier(saver: int, users: list[int]) -> bool:
        if saver == RESIDENT_INPUT:
            return True
        if block.calls > 1:
            return False
        return ((0 <= saver < index and decisions[saver] == "keep")
                or any(0 <= user < index and decisions[user] in RECOMPUTING for user in users))
    shared = sum(size for size, saver, users in block.input_held_earlier if held_earlier(saver, users))
    return max(block.input_bytes - shared, 0)


def recomputed_bytes(block: BlockProfile) -> int:
    """What a recompute of the block's forward makes anew: its saves, but its own inputs (held)."""
    return max(block.saved_bytes - block.input_saved_bytes, 0)


def _recomputed_in_backward(block: BlockProfile, decision: str) -> int:
    """What a recompute (or selective recompute) of the block puts on the ledger in backward."""
    if decision == "recompute":
        return recomputed_bytes(block)
    return selective_backward_bytes(block) - selective_held_bytes(block)


def recompute_seconds(block: BlockProfile, decision: str) -> float:
    """Forward time its backward re-runs: all of it, or (selective) the share of the ops not kept."""
    if decision == SELECTIVE:
        return block.forward_seconds * (1.0 - (block.selective_time_share or 0.0))
    return block.forward_seconds


class _Entry:
    __slots__ = ("size", "block", "swapped", "out_end", "leave", "issued", "ready", "used")

    def __init__(self, size: int, block: int, swapped: bool):
        self.size, self.block, self.swapped = size, block, swapped
        self.out_end = 0.0      # its copy out has ended
        self.leave = 0.0        # it leaves the ledger: copied out and freed by the forward
        self.issued = False
        self.ready = 0.0
        self.used = False       # a later block's backward has used it (`BlockProfile.saved_earlier`)


def _measured_alive(block: BlockProfile, sizes: list[int]) -> list[float] | None:
    """The block's `BlockProfile.saved_alive_blocks`, one per storage of ``sizes``; None: not measured."""
    return block.saved_alive_blocks if len(block.saved_alive_blocks) == len(sizes) else None


def _freed_at(alive: list[float] | None, index: int, k: int) -> float | None:
    """Where the forward frees storage ``k`` of block ``index`` (``alive``: `_measured_alive`), as a
    place in blocks; negative: it outlives the forward; None: not measured."""
    if alive is None:
        return None
    return alive[k] if alive[k] < 0 else index + alive[k]


def _saved_earlier(block: BlockProfile, index: int, per_block: list) -> list[tuple[int, _Entry]]:
    """The swapped entries of earlier blocks that block ``index`` saved too, each with how many of
    the block's own storages it had saved before (`BlockProfile.saved_earlier`; all of them where not
    recorded): its backward uses each one once the storages it saved after that one are used."""
    found = []
    for record in block.saved_earlier:
        back, k = record[0], record[1]
        saver = index - back
        if 0 <= saver < index and k < len(per_block[saver]) and per_block[saver][k].swapped:
            found.append((record[2] if len(record) > 2 else len(per_block[index]), per_block[saver][k]))
    return found


def _saved_again(blocks: list[BlockProfile], decisions: list[str],
                 index: int) -> list[tuple[int, _Entry, float | None]]:
    """Storages of recomputed blocks that block ``index`` saves (`BlockProfile.saved_earlier`): a
    recomputed block's forward saves nothing, so this block's save makes the runtime's entry, as its
    own decision says; (place among its saves, that entry, where the forward frees it in blocks
    (`BlockProfile.saved_alive_blocks`, its saver's measure; None: not measured)) each. The entry is
    tagged with its saver (the block whose saved bytes the profile counted it in), so that this
    block's own measured peak is read with its own saves only."""
    block, decision = blocks[index], decisions[index]
    found = []
    for record in block.saved_earlier:
        saver = index - record[0]
        k = record[1]
        if not 0 <= saver < index or decisions[saver] not in RECOMPUTING:
            continue
        sizes = entry_sizes(blocks[saver])
        if k >= len(sizes):
            continue
        entry = _Entry(sizes[k], saver, decision == "swap" and k not in blocks[saver].kept_when_swapped)
        freed = _freed_at(_measured_alive(blocks[saver], sizes), saver, k)
        found.append((record[2] if len(record) > 2 else len(entry_sizes(block)), entry, freed))
    return found


def simulate(profile: Profile, decisions: list[str], prefetch_bytes: int | None = None,
             max_pending_out_bytes: int | None = None, keep_curve: bool = False,
             budget_bytes: int | None = None, holders: bool = False) -> Timeline:
    """Replay one step under ``decisions``. ``prefetch_bytes``: swapped bytes brought back ahead of
    use at most (None: no limit); ``budget_bytes``: the bytes beyond static memory the step may use
    (None: no limit): each backward phase leaves its own other bytes out of it, and prefetches fit
    in what is left until the phase that uses them. ``holders``: return instead the ledger bytes per
    block at the total peak (`Timeline.peak_holders`).

    The total peak: the most, at one time, of the ledger and the running phase's other bytes, and
    at least the ledger's own peak plus the least other bytes of any phase (`least_other_bytes`).
    Where a phase's peak was measured, the ledger may rise above what its measured other bytes leave
    (resident memory need not grow with a tensor brought back into freed pages); the second term
    keeps the predicted ledger within the activation budget all the same, which is what the plan
    promises the ledger (the runtime makes room against it)."""
    blocks = profile.blocks
    out_rate, in_rate = profile.link.out_bytes_per_second, profile.link.in_bytes_per_second
    contended = profile.link.kind == "disk"
    window = float("inf") if prefetch_bytes is None else prefetch_bytes
    forward_phases, loss_phase, backward_phases, least_other = _phases(profile, decisions)
    # A prefetched tensor stays until its use, through the backward phases between: the running one
    # (its bytes on the ledger already) and those to come, each with room for its own ledger bytes
    # beside it: a recompute puts its block's saves on the ledger when it starts, as the runtime
    # reserves them (`SavedTensorEngine.limit_until_use`).
    rooms = [float("inf") if budget_bytes is None else budget_bytes - phase.other for phase in backward_phases]
    room_running = rooms.__getitem__
    room_ahead = _RangeMin([room - (recomputed_bytes(block) if decision in RECOMPUTING else 0)
                            for room, block, decision in zip(rooms, blocks, decisions)])

    def room_between(first: int, current: int) -> float:
        """What the ledger may hold from now, in block ``current``'s backward, to block ``first``'s."""
        if first >= current:
            return room_running(current)
        return min(room_running(current), room_ahead(first, current - 1))
    # (time, delta, kind, phase entered): kind SWAPPED for a swapped block's tensors on the ledger,
    # HELD for any other ledger bytes, AHEAD for prefetched bytes not used yet (already SWAPPED too).
    events: list[tuple[float, int, int, Phase | None, int]] = []
    copy_outs: list[tuple[float, int, int]] = []   # heap of (copy end, bytes, block) still on the ledger
    ledger = 0                                      # the ledger as of `now`, copy-outs applied lazily

    def add(time: float, delta: int, kind: int, block: int) -> None:
        events.append((time, delta, kind, None, block))

    def enter(time: float, phase: Phase) -> None:
        events.append((time, 0, HELD, phase, phase.block))

    def settle(time: float) -> None:
        nonlocal ledger
        while copy_outs and copy_outs[0][0] <= time:
            ledger -= heapq.heappop(copy_outs)[1]

    now, copy_out_free, stall = 0.0, 0.0, 0.0
    pending_out: deque[tuple[float, int]] = deque()
    pending_bytes = 0
    per_block: list[list[_Entry]] = []
    held_by_recompute: dict[int, int] = {}   # a recompute block's inputs held from its forward to its backward
    resaved: dict[int, list[tuple[int, _Entry]]] = {}   # per block: entries of `_saved_again`, by place
    swapped: list[_Entry] = []
    # Swapped entries the forward still references, by the block in whose forward it frees them, with
    # how far into that forward (`BlockProfile.saved_alive_blocks`): they leave the ledger no earlier.
    freed_in: dict[int, list[tuple[_Entry, float]]] = {}

    def leave_at(entry: _Entry, freed: float) -> None:
        entry.leave = max(entry.out_end, freed)
        add(entry.leave, -entry.size, SWAPPED, entry.block)
        heapq.heappush(copy_outs, (entry.leave, entry.size, entry.block))

    def save(entry: _Entry, at: float, freed: float | None, i: int) -> None:
        """``entry`` saved at ``at`` in block ``i``'s forward; swapped, its copy out queued behind the
        others, and off the ledger once that is done and the forward has freed it (``freed``, a place
        in blocks: `_freed_at`)."""
        nonlocal ledger, copy_out_free, pending_bytes
        add(at, entry.size, SWAPPED if entry.swapped else HELD, entry.block)
        ledger += entry.size
        if not entry.swapped:
            return
        copy_out_free = entry.out_end = max(copy_out_free, at) + entry.size / out_rate
        if freed is None:
            leave_at(entry, entry.out_end)
        elif freed < 0:
            entry.leave = float("inf")   # the forward holds it into backward: it stays
        else:
            freed_block = max(int(freed), i)
            freed_in.setdefault(freed_block, []).append((entry, freed - freed_block))
        pending_out.append((entry.out_end, entry.size))
        pending_bytes += entry.size
        swapped.append(entry)

    for i, (block, decision) in enumerate(zip(blocks, decisions)):
        sizes = entry_sizes(block)
        alive = _measured_alive(block, sizes)
        kept = set(block.kept_when_swapped)
        per_block.append([_Entry(size, i, decision == "swap" and k not in kept) for k, size in enumerate(sizes)]
                         if decision not in RECOMPUTING else [])
        swapped_bytes = sum(entry.size for entry in per_block[i] if entry.swapped)
        if max_pending_out_bytes is not None and decision == "swap":
            # The disk tier makes the forward wait when too many bytes are still unwritten.
            while pending_out and pending_out[0][0] <= now:
                pending_bytes -= pending_out.popleft()[1]
            while pending_out and pending_bytes + swapped_bytes > max_pending_out_bytes:
                waited_until, size = pending_out.popleft()
                pending_bytes -= size
                stall += max(waited_until - now, 0.0)
                now = max(now, waited_until)
        start = now
        enter(start, forward_phases[i])
        if decision == "recompute":
            held_by_recompute[i] = recompute_held_bytes(block, i, decisions)
            add(start, held_by_recompute[i], INPUT, i)
            ledger += held_by_recompute[i]
        elif decision == SELECTIVE:
            # Counted from its start: the kept outputs appear over its forward.
            add(start, selective_held_bytes(block), HELD, i)
            ledger += selective_held_bytes(block)
        for k, entry in enumerate(per_block[i]):
            save(entry, start + block.forward_seconds * (k + 1) / len(sizes), _freed_at(alive, i, k), i)
        if decision not in RECOMPUTING:
            for place, entry, freed in _saved_again(blocks, decisions, i):
                # A recomputed block's storage saved again here: this block's entry, not its saver's.
                save(entry, start, freed, i)
                resaved.setdefault(i, []).append((place, entry))
        now = start + block.forward_seconds
        if decision == "swap" and contended:
            now += swapped_bytes / out_rate
        for entry, share in freed_in.pop(i, []):
            leave_at(entry, start + share * block.forward_seconds)
    enter(now, loss_phase)
    now += profile.loss_seconds
    forward_end = now
    for entries in freed_in.values():   # freed during the loss
        for entry, _ in entries:
            leave_at(entry, forward_end)
    settle(forward_end)
    forward_end_ledger = ledger

    copy_in_free = 0.0
    next_prefetch = len(swapped) - 1
    prefetched_unused = 0
    block_stall = [0.0] * len(blocks)

    def issue(entry: _Entry, at: float, ahead: bool) -> None:
        nonlocal copy_in_free, prefetched_unused, ledger
        entry.issued = True
        prefetched_unused += entry.size
        start = max(copy_in_free, at, entry.out_end)
        copy_in_free = entry.ready = start + entry.size / in_rate
        if ahead:
            add(at, entry.size, AHEAD, entry.block)
        if entry.leave == float("inf"):
            pass    # the forward still held it: its bytes never left the ledger
        elif at < entry.leave:
            # Asked back before it left the ledger: its bytes never did.
            copy_outs.remove((entry.leave, entry.size, entry.block))
            heapq.heapify(copy_outs)
            add(entry.leave, entry.size, SWAPPED, entry.block)
        else:
            add(at, entry.size, SWAPPED, entry.block)
            ledger += entry.size

    def prefetch(at: float, current: int) -> None:
        nonlocal next_prefetch
        settle(at)
        while next_prefetch >= 0:
            entry = swapped[next_prefetch]
            if entry.issued:
                next_prefetch -= 1
                continue
            if prefetched_unused + entry.size > window:
                return
            # It stays until its block's backward: it must fit every phase until then.
            room = room_between(entry.block, current)
            if at >= entry.leave and ledger + entry.size > room:
                return
            issue(entry, at, ahead=True)
            next_prefetch -= 1

    def use(entry: _Entry, i: int) -> None:
        """Block ``i``'s backward needs swapped ``entry`` now: asked back if it was not, waited for."""
        nonlocal now, stall, prefetched_unused
        entry.used = True
        if entry.issued:
            add(now, -entry.size, AHEAD, i)
        else:
            issue(entry, now, ahead=False)
        prefetched_unused -= entry.size
        prefetch(now, i)
        if contended:
            now += entry.size / in_rate
        elif entry.ready > now:
            # The wait is for its saver's tensor: that swap is not hidden (`planner._reason`).
            block_stall[entry.block] += entry.ready - now
            stall += entry.ready - now
            now = entry.ready

    def use_earlier(earlier: list[tuple[int, _Entry]], down_to: int, i: int) -> None:
        """Use those of ``earlier`` (sorted by place, highest first) saved at ``down_to`` or after."""
        while earlier and earlier[0][0] >= down_to:
            entry = earlier.pop(0)[1]
            if entry.swapped and not entry.used:
                use(entry, i)

    # A recomputed block called more than once is recomputed once per call (`runtime.recompute`), each
    # where backward reaches that call: a later call's before the backward of the blocks run between
    # its calls, whose tensors are still on the ledger. The profile places the block at its first
    # call and does not say where the others ran, so its recomputed saves are counted from the
    # backward's start to its own place (``c(a(b(a(x))))`` with ``a`` recomputed and ``b`` kept:
    # 2.5 MiB predicted, the ledger 4 MiB).
    recomputed_early = {i: _recomputed_in_backward(block, decision)
                        for i, (block, decision) in enumerate(zip(blocks, decisions))
                        if block.calls > 1 and decision in RECOMPUTING}
    for i, recomputed in recomputed_early.items():
        add(now, recomputed, HELD, i)
        ledger += recomputed
    for i in range(len(blocks) - 1, -1, -1):
        block, decision = blocks[i], decisions[i]
        enter(now, backward_phases[i])
        # An earlier block's swapped storages this block saved too come back for its backward, when the
        # op that saved them runs, and stay until their saver's backward has used them (the runtime's
        # one entry each). A recompute block holds them as its inputs instead (its forward saved
        # nothing; the storage is counted with `recompute_held_bytes`).
        earlier = [] if decision in RECOMPUTING else sorted(_saved_earlier(block, i, per_block) + resaved.get(i, []),
                                                            key=lambda found: -found[0])
        if decision in RECOMPUTING:
            if i not in recomputed_early:
                recomputed = _recomputed_in_backward(block, decision)
                add(now, recomputed, HELD, i)
                ledger += recomputed
            now += recompute_seconds(block, decision)
        entries = per_block[i][::-1]
        step = block.backward_seconds / len(entries) if entries else 0.0
        for place, entry in zip(range(len(entries) - 1, -1, -1), entries):
            use_earlier(earlier, place, i)
            if entry.swapped and not entry.used:
                use(entry, i)
            elif next_prefetch >= 0:
                prefetch(now, i)
            now += step
            add(now, -entry.size, SWAPPED if entry.swapped else HELD, i)
            settle(now)
            ledger -= entry.size
        if not entries:
            use_earlier(earlier, 0, i)
            if next_prefetch >= 0:
                prefetch(now, i)
            now += block.backward_seconds
        for _, entry in resaved.pop(i, []):
            add(now, -entry.size, SWAPPED if entry.swapped else HELD, entry.block)
            settle(now)
            ledger -= entry.size
        if decision == "recompute":
            add(now, -held_by_recompute[i], INPUT, i)
            add(now, -recomputed_bytes(block), HELD, i)
            ledger -= held_by_recompute[i] + recomputed_bytes(block)
        elif decision == SELECTIVE:
            add(now, -selective_backward_bytes(block), HELD, i)
            ledger -= selective_backward_bytes(block)
        if next_prefetch >= 0:
            prefetch(now, i)
    # After backward the optimizer's step (`plan.optimizer_step`), the ledger empty by then.
    enter(now, Phase(-1, profile.optimizer_step_other_bytes, None, "optimizer step"))
    peak, peak_seconds, total_peak, curve, peak_phase, up_to_peak = _sweep(events, keep_curve,
                                                                            least_other)
    if holders:
        return _holders(events, up_to_peak)
    return Timeline(peak, now, forward_end_ledger, stall, curve, peak_seconds, block_stall, forward_end,
                    total_peak, peak_phase,
                    (profile, decisions, prefetch_bytes, max_pending_out_bytes, False, budget_bytes))


class _RangeMin:
    """min(values[first:last + 1]) in constant time (a sparse table): the prefetch asks it for the
    room of every phase between now and a tensor's use, thousands of times per simulation."""

    def __init__(self, values: list[float]):
        self.levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            below = self.levels[-1]
            self.levels.append([min(below[i], below[i + width]) for i in range(len(below) - width)])
            width *= 2

    def __call__(self, first: int, last: int) -> float:
        level = (last - first + 1).bit_length() - 1
        row = self.levels[level]
        return min(row[first], row[last - (1 << level) + 1])


def _sweep(events, keep_curve: bool, least_other: int) -> tuple[int, float, int, list, tuple[str, int], list]:
    """Walk the events in time order: the ledger's peak (and when), and the peak of all bytes beyond
    static memory. Where the running phase's peak was measured, the profiling step had on its
    ledger what this plan's swapped tensors are (written out as saved, back when used): those are
    inside the measured peak, and what this plan holds besides (kept tensors, recompute inputs and
    recomputed tensors, tensors prefetched ahead of use) comes on top, and the whole ledger with the
    least other bytes of any phase (``least_other``) is a floor under it. Elsewhere, the phase's other
    bytes come on top of the whole ledger."""
    # At equal times, events in the order the replay made them: the runtime's order (a tensor used
    # is freed before the prefetch that its room allows). Sorting plain tuples natively: a key
    # function would dominate.
    ordered = sorted((time, index) for index, (time, _, _, _, _) in enumerate(events))
    resident, held, ahead, peak, peak_seconds, total_peak, curve = 0, 0, 0, 0, 0.0, 0, []
    own: dict[int, int] = {}    # ledger bytes per block of its own saves (not a recompute's inputs)
    phase = Phase(-1, 0, None)
    peak_phase = (phase.kind, phase.block)
    peak_position = 0
    for position, (time, index) in enumerate(ordered):
        _, delta, kind, entered, block = events[index]
        if entered is not None:
            phase = entered
        elif kind == AHEAD:
            ahead += delta
        else:
            resident += delta
            if kind != SWAPPED:
                held += delta
            if kind != INPUT:
                own[block] = own.get(block, 0) + delta
            if resident > peak:
                peak, peak_seconds = resident, time
        if phase.peak is not None:
            # Never less than the ledger and the least working memory of any phase: resident memory
            # does not grow for every tensor (one brought back may reuse freed pages), so a measured
            # peak can miss some of them, and the runtime's ledger must fit the activation budget.
            total = max(phase.peak + held + ahead, resident + least_other)
        else:
            total = resident + phase.other
            if phase.own_peak is not None:
                # Its own tensors and its other bytes at their most together, the rest of the ledger
                # on top: never more than the two added, and (as above) never less than the ledger
                # with the least other bytes, which the activation budget promises the ledger.
                together = resident - own.get(phase.block, 0) + phase.own_peak
                total = max(min(total, together), resident + least_other)
        if total > total_peak:
            total_peak, peak_phase, peak_position = total, (phase.kind, phase.block), position
        if keep_curve:
            curve.append((time, total))
    return peak, peak_seconds, total_peak, curve, peak_phase, ordered[:peak_position + 1]


def _holders(events, ordered) -> dict[int, int]:
    """Ledger bytes per block after the events in ``ordered`` (those up to the peak)."""
    holders: dict[int, int] = {}
    for _, index in ordered:
        _, delta, kind, entered, block = events[index]
        if entered is None and kind != AHEAD:
            holders[block] = holders.get(block, 0) + delta
    return {block: held for block, held in holders.items() if held > 0}
