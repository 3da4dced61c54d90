"""Solvers: choose keep / swap / recompute per block so the simulated peak fits the activation
budget with the least simulated step time. The simulator (`plan.simulate`) is the judge of every
plan; the solvers differ in how they search.

- `greedy`: moves blocks in batches ranked by bytes freed per second added (estimated per block,
  then checked by one simulation per batch), then undoes moves the slack allows. About a dozen
  simulations of O(n log n) each: 1000 blocks plan in well under a second
  (`bench/bench_predict.py --solver-blocks 1000`).
- `exact`: dynamic programming over a separable model of the step (below), exact for that model,
  its answer then checked by the simulator and, if the simulator disagrees, solved again with the
  budget tightened by the overshoot. For up to a few hundred blocks.

The separable model (blocks in execution order). Bytes beyond static memory while block j's backward
runs: for every earlier block i < j, its saved bytes if kept, its input if recomputed, what a swap
leaves on the device if swapped (storages too small to move or not movable); plus block j's own phase: its saved bytes and working memory if kept; its saved bytes,
input and the larger of its forward and backward working memory if recomputed; if swapped, its
measured peak with its tensors brought back one by one (`runtime/saved.py`). While its forward
runs: what earlier blocks hold, what it holds itself, and its forward working memory; at the end of
the forward, everything held and the loss's working memory. Every such sum must fit the budget.
Added seconds: a recompute re-runs the block's forward; a swap costs its prefetch time beyond the
backward of the block after it. Bytes are counted in units of budget / bins, rounded up, so a model
solution never exceeds the budget. Tests check the DP against brute force over all 3^n plans of
this model (tests/test_solvers.py).
"""

import itertools
import math
from dataclasses import dataclass

import numpy as np

from oomless.plan.simulate import (SELECTIVE, Timeline, backward_other_bytes, backward_own_peak_bytes,
                                   forward_other_bytes, forward_own_peak_bytes,
                                   kept_when_swapped_bytes, loss_other_bytes, recompute_seconds,
                                   selective_backward_bytes, selective_held_bytes, selective_offered, simulate)
from oomless.profile.profile import Profile

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"
_CHOICES = (KEEP, SWAP, RECOMPUTE, SELECTIVE)
_TIE_SECONDS = 1e-9  # a free swap still loses to keep: the plan moves nothing it need not


@dataclass
class SeparableModel:
    held_units: dict[str, list[int]]       # per decision: what a block holds for later blocks' phases
    backward_units: dict[str, list[int]]   # per decision: its own backward phase, beyond earlier blocks'
    forward_units: dict[str, list[int]]    # per decision: its forward phase, beyond earlier blocks'
    final_units: int                       # the loss's working memory, on top of everything held
    added_seconds: dict[str, list[float]]
    budget_units: int


def swap_added_seconds(profile: Profile, index: int) -> float:
    """Prefetch time of block ``index`` not hidden behind the backward of the block after it."""
    block = profile.blocks[index]
    hiding = profile.blocks[index + 1].backward_seconds if index + 1 < len(profile.blocks) else profile.loss_seconds
    return max(block.saved_bytes / profile.link.in_bytes_per_second - hiding, 0.0)


def separable_model(profile: Profile, budget_bytes: int, bins: int | None = None) -> SeparableModel:
    """The separable model of ``profile`` for ``budget_bytes`` beyond static memory."""
    blocks = profile.blocks
    bins = bins or min(max(4096, 32 * len(blocks)), 65536)
    unit = max(budget_bytes / bins, 1.0)

    def units(num_bytes: int) -> int:
        return math.ceil(max(num_bytes, 0) / unit)

    forward_other = [forward_other_bytes(profile, block) for block in blocks]
    backward_other = [backward_other_bytes(profile, block) for block in blocks]
    largest = [min(block.largest_saved_bytes, block.saved_bytes) for block in blocks]
    # A kept (or, in backward, recomputed) block's own saves and its other bytes at their most together.
    own_forward = [forward_own_peak_bytes(profile, block) for block in blocks]
    own_backward = [backward_own_peak_bytes(profile, block) for block in blocks]
    swap_backward = [block.backward_peak_bytes if block.backward_peak_bytes is not None else b + big
                     for block, b, big in zip(blocks, backward_other, largest)]
    swap_forward = [block.forward_peak_bytes if block.forward_peak_bytes is not None else f + big
                    for block, f, big in zip(blocks, forward_other, largest)]
    # Selective where the profile measured it; elsewhere never chosen (infinite seconds).
    offered = [selective_offered(block) for block in blocks]
    return SeparableModel(
        held_units={KEEP: [units(block.saved_bytes) for block in blocks],
                    SWAP: [units(kept_when_swapped_bytes(block)) for block in blocks],
                    RECOMPUTE: [units(block.input_bytes) for block in blocks],
                    SELECTIVE: [units(selective_held_bytes(block)) for block in blocks]},
        backward_units={KEEP: [units(value) for value in own_backward],
                        SWAP: [units(value) for value in swap_backward],
                        RECOMPUTE: [units(block.input_bytes + max(f, b))
                                    for block, f, b in zip(blocks, own_forward, own_backward)],
                        SELECTIVE: [units(selective_backward_bytes(block) + max(f, b))
                                    for block, f, b in zip(blocks, forward_other, backward_other)]},
        forward_units={KEEP: [units(value) for value in own_forward],
                       SWAP: [units(value) for value in swap_forward],
                       RECOMPUTE: [units(block.input_bytes + f) for block, f in zip(blocks, forward_other)],
                       SELECTIVE: [units(selective_held_bytes(block) + f) for block, f in zip(blocks, forward_other)]},
        final_units=units(loss_other_bytes(profile)),
        added_seconds={KEEP: [0.0] * len(blocks),
                       SWAP: [swap_added_seconds(profile, i) + _TIE_SECONDS for i in range(len(blocks))],
                       RECOMPUTE: [block.forward_seconds + 2 * _TIE_SECONDS for block in blocks],
                       SELECTIVE: [recompute_seconds(block, SELECTIVE) + 3 * _TIE_SECONDS if ok else math.inf
                                   for block, ok in zip(blocks, offered)]},
        budget_units=math.floor(budget_bytes / unit) if budget_bytes >= 0 else -1,
    )


def _phase_units(model: SeparableModel, index: int, decision: str) -> int:
    """The most block ``index``'s own phases need on top of what earlier blocks hold."""
    return max(model.backward_units[decision][index], model.forward_units[decision][index])


def evaluate(model: SeparableModel, decisions) -> tuple[bool, float]:
    """(fits, added seconds) of ``decisions`` in the separable model."""
    held, fits = 0, True
    for j, decision in enumerate(decisions):
        fits &= held + _phase_units(model, j, decision) <= model.budget_units
        held += model.held_units[decision][j]
    fits &= held + model.final_units <= model.budget_units
    return fits, sum(model.added_seconds[d][j] for j, d in enumerate(decisions))


def brute_force(model: SeparableModel) -> tuple[list[str] | None, float]:
    """The cheapest fitting plan by enumerating all 4^n (tests only)."""
    best, best_seconds = None, math.inf
    for decisions in itertools.product(_CHOICES, repeat=len(model.added_seconds[KEEP])):
        fits, seconds = evaluate(model, decisions)
        if fits and seconds < best_seconds:
            best, best_seconds = list(decisions), seconds
    return best, best_seconds


def solve_separable(model: SeparableModel) -> tuple[list[str] | None, float]:
    """Exact DP over the bytes held so far (in units)."""
    n, capacity = len(model.added_seconds[KEEP]), model.budget_units
    if capacity < 0:
        return None, math.inf
    cost = np.full(capacity + 1, np.inf)
    cost[0] = 0.0
    choices = []  # per block: the decision index that reached each new state
    for j in range(n):
        new_cost = np.full(capacity + 1, np.inf)
        new_choice = np.full(capacity + 1, -1, dtype=np.int8)
        for d, decision in enumerate(_CHOICES):
            shift = model.held_units[decision][j]
            top = min(capacity - _phase_units(model, j, decision), capacity - shift)
            if top < 0:
                continue
            if math.isinf(model.added_seconds[decision][j]):
                continue
            candidate = cost[:top + 1] + model.added_seconds[decision][j]
            target = new_cost[shift:shift + top + 1]
            better = candidate < target
            target[better] = candidate[better]
            new_choice[shift:shift + top + 1][better] = d
        cost, choices = new_cost, choices + [new_choice]
    cost[max(capacity - model.final_units + 1, 0):] = np.inf
    held = int(np.argmin(cost))
    if not np.isfinite(cost[held]):
        return None, math.inf
    best_seconds = float(cost[held])
    decisions = []
    for j in range(n - 1, -1, -1):
        d = int(choices[j][held])
        decisions.append(_CHOICES[d])
        held -= model.held_units[_CHOICES[d]][j]
    return decisions[::-1], best_seconds


def exact(run, profile: Profile, budget_bytes: int, attempts: int = 4) -> list[str] | None:
    """The separable model's optimum, re-solved with a tighter budget while the simulator says it
    does not fit (the model ignores copy-stream contention and what prefetches hold)."""
    target = budget_bytes
    for _ in range(attempts):
        decisions, _ = solve_separable(separable_model(profile, target))
        if decisions is None:
            return None
        timeline = run(decisions)
        if timeline.total_peak_bytes <= budget_bytes:
            return decisions
        target -= timeline.total_peak_bytes - budget_bytes
    return None


def _resident_at_peak(profile: Profile, decisions: list[str], timeline: Timeline) -> list[int]:
    """Blocks whose saved bytes are (roughly) resident when the peak is reached: all kept and
    swapped blocks if the peak falls in backward at or after their backward start, estimated by the
    forward order."""
    return [i for i, decision in enumerate(decisions) if decision != RECOMPUTE]


def _added_seconds(profile: Profile, index: int, decision: str) -> float:
    """What ``decision`` adds to the step for block ``index``, estimated alone."""
    if decision == SWAP:
        return swap_added_seconds(profile, index)
    return recompute_seconds(profile.blocks[index], decision) if decision in (RECOMPUTE, SELECTIVE) else 0.0


def _held_bytes(block, decision: str) -> int:
    """What ``block`` holds from its forward to its backward under ``decision`` once its copies out
    are done."""
    return {KEEP: block.saved_bytes, SWAP: kept_when_swapped_bytes(block), RECOMPUTE: block.input_bytes,
            SELECTIVE: selective_held_bytes(block)}[decision]


# Moves towards fewer bytes held, and undoing them (`relax`), from each decision.
_FRUGAL_MOVES = {KEEP: (SWAP, SELECTIVE, RECOMPUTE), SWAP: (SELECTIVE, RECOMPUTE), SELECTIVE: (RECOMPUTE,), RECOMPUTE: ()}
_UNDO_MOVES = {RECOMPUTE: (KEEP, SWAP, SELECTIVE), SELECTIVE: (KEEP, SWAP), SWAP: (KEEP,), KEEP: ()}


def _move_estimates(profile: Profile, decisions: list[str], candidates: list[int]):
    """(score, bytes freed, seconds added, index, new decision) for each possible single move."""
    moves = []
    for i in candidates:
        block = profile.blocks[i]
        for option in _FRUGAL_MOVES[decisions[i]]:
            if option == SELECTIVE and not selective_offered(block):
                continue
            added = _added_seconds(profile, i, option) - _added_seconds(profile, i, decisions[i])
            if option == SWAP:
                freed = block.saved_bytes
            elif decisions[i] == SWAP:
                # A swap whose copy does not finish in time frees nothing.
                freed = block.saved_bytes // 2 - (_held_bytes(block, option) - block.input_bytes)
            else:
                freed = _held_bytes(block, decisions[i]) - _held_bytes(block, option)
            if freed > 0:
                moves.append((freed / (max(added, 0.0) + 1e-6), freed, added, i, option))
    moves.sort(key=lambda move: (-move[0], move[3]))
    return moves


def greedy(run, profile: Profile, budget_bytes: int, start: list[str], max_rounds: int = 200) -> list[str]:
    """Batches of the best-scoring moves until the simulated peak fits, then `relax`."""
    decisions = list(start)
    current = run(decisions)
    for _ in range(max_rounds):
        if current.total_peak_bytes <= budget_bytes:
            break
        deficit = current.total_peak_bytes - budget_bytes
        moves = _move_estimates(profile, decisions, _resident_at_peak(profile, decisions, current))
        trial, expected, moved = list(decisions), 0, set()
        for _, freed, _, index, option in moves:
            if index in moved:
                continue
            trial[index] = option
            moved.add(index)
            expected += freed
            if expected >= deficit:
                break
        timeline = run(trial)
        if timeline.total_peak_bytes < current.total_peak_bytes:
            decisions, current = trial, timeline
            continue
        # The estimates were wrong (copies not finishing in time, a peak elsewhere): try the
        # best few single moves by simulation instead.
        best = None
        for _, _, _, index, option in moves[:16]:
            single = decisions[:index] + [option] + decisions[index + 1:]
            timeline = run(single)
            gained = current.total_peak_bytes - timeline.total_peak_bytes \
                + 0.01 * (current.forward_end_bytes - timeline.forward_end_bytes)
            if gained > 0:
                score = gained / (max(timeline.step_seconds - current.step_seconds, 0.0) + 1e-6)
                if best is None or score > best[0]:
                    best = (score, single, timeline)
        if best is None:
            break
        _, decisions, current = best
    return relax(run, profile, budget_bytes, decisions)


def relax(run, profile: Profile, budget_bytes: int, decisions: list[str], max_trials: int | None = None) -> list[str]:
    """Undo moves while the plan still fits and gets faster: costliest moves first, and only those
    whose bytes fit in the slack left (the others cannot be undone), each checked by simulation.
    At most ``max_trials`` simulations (default: 400, fewer for long models so that 1000 blocks
    stay within a second)."""
    if max_trials is None:
        max_trials = min(400, max(16, 20000 // max(len(profile.blocks), 1)))
    decisions = list(decisions)
    base = run(decisions)
    limit = max(budget_bytes, base.total_peak_bytes)
    trials = 0
    improved = True
    while improved and trials < max_trials:
        improved = False
        slack = limit - base.total_peak_bytes
        undo = []
        for i, decision in enumerate(decisions):
            block = profile.blocks[i]
            cost = _added_seconds(profile, i, decision)
            for option in _UNDO_MOVES[decision]:
                if option == SELECTIVE and not selective_offered(block):
                    continue
                needs = _held_bytes(block, option) - _held_bytes(block, decision)
                if option == SWAP or needs <= slack or len(profile.blocks) <= 64:
                    undo.append((-cost, i, option))
        for _, i, option in sorted(undo):
            if trials >= max_trials:
                break
            trials += 1
            trial = decisions[:i] + [option] + decisions[i + 1:]
            timeline = run(trial)
            if timeline.total_peak_bytes <= limit and timeline.step_seconds < base.step_seconds - 1e-12:
                decisions, base, improved = trial, timeline, True
                break
    return decisions


def simulator_for(profile: Profile, prefetch_bytes: int | None, max_pending_out_bytes: int | None,
                  budget_bytes: int | None = None):
    """A memoised ``run(decisions) -> Timeline`` for one prefetch window and activation budget."""
    cache: dict[tuple, Timeline] = {}

    def run(decisions) -> Timeline:
        key = tuple(decisions)
        if key not in cache:
            cache[key] = simulate(profile, list(decisions), prefetch_bytes, max_pending_out_bytes,
                                  budget_bytes=budget_bytes)
        return cache[key]
    return run
