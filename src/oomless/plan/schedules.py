"""What each of torch's pipeline schedules does: placement, in-flight micro-batches, predicted step
time (torch.distributed.pipelining as of torch 2.13; issue 5). Plain arithmetic on the schedule, P
pipeline ranks, V stages per rank and M micro-batches: the partitioner (`oomless.plan.partition`)
plans with it and `oomless.parallel.pipeline` checks and places stages with it.

    stage_ranks("zbv", 4, 2)                      # [0, 1, 2, 3, 3, 2, 1, 0]
    rank_in_flight("zero-bubble", 0, 2, 2, 4)     # ([4, 2], [(2, 2), (3, 1), (4, 0)])
    rank_actions("zbv", 0, 2, 2, 4)               # rank 0's (stage, kind, micro-batch) in torch's order
    predicted_step_seconds("zbv", 4, 2, 8, 1.0)   # 8.5: a rank's 8 x 1 s plus 3 stage forwards idle

Schedules (`SCHEDULES`; `stage_ranks` gives the placement): ``gpipe`` and ``1f1b`` run one stage per
rank; ``interleaved-1f1b`` (ScheduleInterleaved1F1B) and ``zero-bubble`` (ScheduleInterleavedZeroBubble)
V >= 2 stages per rank, stage s on rank s mod P; ``zbv`` (ScheduleZBVZeroBubble) exactly 2, rank r
holding stages r and 2P - 1 - r.

Torch's order of actions (`rank_actions`), rewritten from torch 2.13's public source
(torch/distributed/pipelining/schedules.py; tests/test_schedules.py compares every order with
torch's): kinds ``F`` forward, ``B`` full backward, ``I`` input-gradient and ``W`` weight-gradient
pass, torch's letters. gpipe and 1f1b as `ScheduleGPipe` and `Schedule1F1B` ``_step_microbatches``
run them (1F1B's ``pipeline_order`` in 2.13 misnumbers micro-batches and its runtime does not read
it); interleaved-1f1b and zero-bubble as ``_get_1f1b_rank_ops`` builds them; zbv as
``ScheduleZBVZeroBubble._calculate_single_rank_operations``, which plans max(2P - 1, M)
micro-batches and drops the actions of those past M.

In-flight micro-batches (M micro-batches, P ranks, V stages per rank, stage s on rank r):

- gpipe: every forward before any backward (Huang et al. 2019), so M.
- 1f1b (PipeDream-flush, Narayanan et al. 2021 section 2.2.1): stage s's first backward comes after
  P - s forwards, so min(P - s, M).
- interleaved-1f1b (Narayanan et al. 2021 section 2.2.2): a warm-up of (V - 1) m + 2 (P - 1 - r)
  forwards over the rank's stages in turns of m micro-batches (Megatron-LM's count; torch's
  ``_get_warmup_ops`` with m = M / max(1, M // P), which is why torch needs M to be a multiple of
  max(1, M // P)), then one forward and one backward alternate.
- zero-bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1 as torch builds it): the
  same with a warm-up of (V - 1) m + (P - 1 - r), and a micro-batch's activations freed only by its
  weight-gradient pass, r steps after its input-gradient pass. Approximation: all its saved bytes
  are held until then (the input-gradient pass frees part of them).
- zbv (Qi et al. 2023 section 6, ZB-V as torch builds it): rank r's first stage peaks at
  min(2P - r, M) micro-batches, its second at min(r + 1, M); each stage holds half a rank's layers,
  so about 1F1B's P micro-batches of a whole rank.

The multi-stage counts are taken by walking `rank_actions` (+1 at a forward, -1 at the pass that
frees the micro-batch: ``B``, or ``W`` under the zero-bubble schedules).

The predicted step, T the slowest rank's seconds per micro-batch and T_F / T_B / T_W its forward,
input-gradient and weight-gradient shares (the profile does not split the backward: we take
T_B = T_W = backward / 2, Qi et al.'s working assumption T_F = T_B = T_W being the case backward =
2 forward); every rank is taken to be as slow as the slowest and its stages equal:

- gpipe, 1f1b: (M + P - 1) T; bubble (P - 1) / (M + P - 1) (Huang et al. 2019; Narayanan et al.).
- interleaved-1f1b: M T + (P - 1) T / V for M >= P (Narayanan et al. 2021 section 2.2.2: the bubble
  shrinks V-fold; bubble fraction (P - 1) / (V M + P - 1)). For M < P the loop of P V stages of
  T / V each comes round before a rank has other work: (M + V P - 1) T / V.
  These three formulas equal the simulation below of torch's order, for any T_F (tests/test_schedules.py).
- zero-bubble, zbv: simulated (`simulated_step_seconds`), exact for this cost model: torch's order
  run with each action as soon as its inputs exist (a forward after the previous stage's forward of
  its micro-batch, an input-gradient pass after the next stage's, a weight pass after its own
  input-gradient pass), taking T_F / V, T_B / V, T_W / V, communication free. Stage 0's
  input-gradient pass does nothing and its weight pass the whole backward, as torch runs it
  (stage.py ``backward_one_chunk``: "Skip the backward for the first stage"). Past torch's warm-up
  (zero-bubble M >= P, zbv M >= 2P - 1) every further micro-batch adds exactly T (the tests check
  it up to M = 4P), so the order is simulated up to that M only. Closed forms where they hold
  (checked there too): zero-bubble M T + (P - 1) max(T_F, T_B) / V for M >= P; zbv
  M T + (P - 1) T_B / 2 for M >= 2P - 1 when T_F <= T_B. With T_F = T_B = T_W both leave P - 1
  stage forwards idle, (P - 1) T_F / V, the least any order can: rank P - 1 cannot start before
  micro-batch 0 has crossed P - 1 stages. Qi et al.'s ZB-H1 bubble, (P - 1) (T_F + T_B - T_W)
  (their section 2.1), is the T_F term for V = 1 and T_B = T_W; torch's order also idles on the
  input-gradient passes when they are the longer. Qi et al. call ZB-V zero-bubble when
  T_F = T_B = T_W (section 6); torch's order is not. Below the warm-up threshold torch fills part
  of the warm-up with weight passes, which the simulation follows.
  With a slow forward (T_F > T_B) ZB-V's bubble grows faster with P; no closed form is used.
  bench/bench_pipeline.py measures these orders with real processes (bench/README.md).
"""

from collections import defaultdict
from functools import lru_cache
from typing import Callable, NamedTuple

from oomless.errors import InputError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")      # one stage per rank; the others run several
# Share of a step's compute in forward when the profile says nothing (T_F = T_B = T_W).
DEFAULT_FORWARD_FRACTION = 1 / 3
ZERO_BUBBLE_SCHEDULES = ("zero-bubble", "zbv")


class Action(NamedTuple):
    """One compute action of a rank: ``kind`` is torch's letter (F, B, I or W)."""

    stage: int
    kind: str
    microbatch: int


def check_schedule(schedule: str, ranks: int, stages_per_rank: int) -> None:
    """Raise `InputError` unless ``schedule`` runs ``stages_per_rank`` stages on each of ``ranks``."""
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if ranks < 1 or stages_per_rank < 1:
        raise InputError(f"stages (ranks) and stages_per_rank must be at least 1, got {ranks} and {stages_per_rank}")
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise InputError(f"schedule {schedule} runs one stage per rank, got stages_per_rank={stages_per_rank}; "
                         "use interleaved-1f1b, zero-bubble or zbv for several")
    if schedule in ("interleaved-1f1b", "zero-bubble") and stages_per_rank < 2:
        raise InputError(f"schedule {schedule} needs at least 2 stages per rank, got {stages_per_rank}")
    if schedule == "zbv" and stages_per_rank != 2:
        raise InputError(f"schedule zbv runs exactly 2 stages per rank (a V), got {stages_per_rank}")


def microbatch_problem(schedule: str, ranks: int, microbatches: int) -> str | None:
    """Why torch's ``schedule`` on ``ranks`` would refuse ``microbatches``, or None."""
    if microbatches < 1:
        return f"microbatches must be at least 1, got {microbatches}"
    if schedule == "1f1b" and microbatches < ranks:
        return f"torch's Schedule1F1B needs at least as many micro-batches as stages ({ranks})"
    rounds = max(1, microbatches // ranks)
    if schedule in ("interleaved-1f1b", "zero-bubble") and microbatches % rounds:
        return (f"torch's interleaved schedules need a multiple of max(1, microbatches // ranks) = {rounds} "
                f"micro-batches, got {microbatches}")
    return None


def stage_ranks(schedule: str, pipeline_ranks: int, stages_per_rank: int) -> list[int]:
    """The rank of each of the pipeline_ranks x stages_per_rank stages under ``schedule``."""
    check_schedule(schedule, pipeline_ranks, stages_per_rank)
    stages = pipeline_ranks * stages_per_rank
    if schedule == "zbv":
        return [stage if stage < pipeline_ranks else stages - 1 - stage for stage in range(stages)]
    return [stage % pipeline_ranks for stage in range(stages)]


def rank_actions(schedule: str, rank: int, ranks: int, stages_per_rank: int, microbatches: int) -> list[Action]:
    """``rank``'s compute actions in the order torch runs them (the module docstring gives the
    sources). Torch's empty slots (None in its ``pipeline_order``) are left out: a rank waits for
    its inputs whatever the slots say."""
    check_schedule(schedule, ranks, stages_per_rank)
    done, actions = defaultdict(int), []

    def run(kind: str, stage: int):   # each stage takes its micro-batches in order, per kind
        actions.append(Action(stage, kind, done[kind, stage]))
        done[kind, stage] += 1

    if schedule == "gpipe":
        for kind in "FB":
            for _ in range(microbatches):
                run(kind, rank)
    elif schedule == "1f1b":
        warmup = min(microbatches, ranks - rank)
        for _ in range(warmup):
            run("F", rank)
        for backward in range(microbatches):
            run("B", rank)
            if warmup + backward < microbatches:
                run("F", rank)
    elif schedule == "zbv":
        _zbv_actions(run, done, rank, ranks, max(2 * ranks - 1, microbatches))
        actions = [action for action in actions if action.microbatch < microbatches]
    else:
        _looped_actions(run, rank, ranks, stages_per_rank, microbatches, zero_bubble=schedule == "zero-bubble")
    return actions


def _looped_actions(run, rank: int, ranks: int, local_stages: int, microbatches: int, zero_bubble: bool):
    """torch's ``_get_1f1b_rank_ops``: op k runs a forward of local stage (k // m) mod V (while
    forwards remain) and, past the warm-up, a backward of local stage V - 1 - ((k - warmup) // m)
    mod V; zero bubble: an input-gradient pass, and the weight pass of the one r ops earlier."""
    rounds = max(1, microbatches // ranks)
    per_round = microbatches // rounds
    warmup = min((local_stages - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - rank),
                 microbatches * local_stages)
    forward_stage = lambda op: (op // per_round) % local_stages * ranks + rank
    backward_stage = lambda op: (local_stages - 1 - ((op - warmup) // per_round) % local_stages) * ranks + rank
    passes, weights = microbatches * local_stages, 0
    for op in range(passes + warmup):
        if op < passes:
            run("F", forward_stage(op))
        if op >= warmup:
            run("I" if zero_bubble else "B", backward_stage(op))
            if zero_bubble and op - warmup >= rank:
                run("W", backward_stage(warmup + weights))
                weights += 1
    while zero_bubble and weights < passes:
        run("W", backward_stage(warmup + weights))
        weights += 1


def _zbv_actions(run, done, rank: int, ranks: int, planned: int):
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations`` for ``planned`` micro-batches."""
    first, second = rank, 2 * ranks - 1 - rank
    for _ in range(2 * (ranks - rank) - 1):
        run("F", first)
    for _ in range(rank):
        run("F", second)
        run("F", first)
    for _ in range(ranks - rank):
        for kind in "FIW":
            run(kind, second)
    while done["F", second] < done["F", first] or done["F", first] < planned:
        if done["F", first] < planned:
            run("F", first)
        for kind, stage in (("I", first), ("W", first), ("F", second), ("I", second), ("W", second)):
            run(kind, stage)
    for _ in range(rank):
        run("I", first)
        run("I", second)
    for _ in range(ranks - rank):
        run("I", first)
        run("W", first)
    for stage in (second, first):
        while done["W", stage] < done["I", stage]:
            run("W", stage)


def in_flight_microbatches(schedule: str, stage: int, ranks: int, microbatches: int, stages_per_rank: int = 1) -> int:
    """Micro-batches whose saved activations stage ``stage`` holds at once, at its peak, under
    ``schedule`` (the module docstring gives the sources)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(ranks - stage, microbatches)
    placement = stage_ranks(schedule, ranks, stages_per_rank)
    rank = placement[stage]
    return rank_in_flight(schedule, rank, ranks, stages_per_rank, microbatches)[0][placement[:stage].count(rank)]


def rank_in_flight(schedule: str, rank: int, ranks: int, stages_per_rank: int,
                   microbatches: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """For ``rank``'s stages (in stage order): each one's peak in-flight count, and the counts of all
    of them at once at each moment the rank's total may peak (after a forward; those another
    moment's counts dominate left out). A rank's activation bytes are the most, over those moments,
    of counts x each stage's bytes per micro-batch: its stages do not peak together."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        count = in_flight_microbatches(schedule, rank, ranks, microbatches)
        return [count], [(count,)]
    local = {stage: index for index, stage in
             enumerate(stage for stage, owner in enumerate(stage_ranks(schedule, ranks, stages_per_rank))
                       if owner == rank)}
    frees = "W" if schedule in ZERO_BUBBLE_SCHEDULES else "B"
    live, moments = [0] * stages_per_rank, set()
    for action in rank_actions(schedule, rank, ranks, stages_per_rank, microbatches):
        if action.kind == "F":
            live[local[action.stage]] += 1
            moments.add(tuple(live))
        elif action.kind == frees:
            live[local[action.stage]] -= 1
    peaks = [max(moment[index] for moment in moments) for index in range(stages_per_rank)]
    kept = [moment for moment in moments
            if not any(other != moment and all(map(int.__ge__, other, moment)) for other in moments)]
    return peaks, sorted(kept)


def simulate_actions(orders: list[list[Action]], action_seconds: Callable[[int, str], float],
                     on_action: Callable[[int, str, float, float], None] | None = None) -> float:
    """Makespan of every rank running its ``orders`` in turn, each action as soon as its inputs
    exist (a forward after the previous stage's forward of its micro-batch; a backward or input-
    gradient pass after the next stage's and its own forward; a weight pass after its own input-
    gradient pass), taking ``action_seconds(stage, kind)``, with free communication.
    ``on_action(rank, kind, start, end)`` is told each action's times (the timeline plot)."""
    stages = 1 + max((action.stage for order in orders for action in order), default=0)
    finished: dict[tuple[str, int, int], float] = {}   # ("F" or "grad" or "W", stage, micro-batch)
    position, free_at = [0] * len(orders), [0.0] * len(orders)
    left = sum(map(len, orders))
    while left:
        ran = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                stage, kind, microbatch = order[position[rank]]
                if kind == "F":
                    needs = [("F", stage - 1, microbatch)] if stage else []
                elif kind in "BI":
                    needs = [("F", stage, microbatch)] + ([("grad", stage + 1, microbatch)]
                                                          if stage < stages - 1 else [])
                else:
                    needs = [("grad", stage, microbatch)]
                if any(need not in finished for need in needs):
                    break
                start = max([free_at[rank], *map(finished.get, needs)])
                free_at[rank] = start + action_seconds(stage, kind)
                finished["grad" if kind in "BI" else kind, stage, microbatch] = free_at[rank]
                if on_action is not None:
                    on_action(rank, kind, start, free_at[rank])
                position[rank] += 1
                left -= 1
                ran = True
        if not ran:
            raise RuntimeError(f"the action orders deadlock: {orders}")
    return max(free_at)


def simulated_step_seconds(schedule: str, ranks: int, stages_per_rank: int, microbatches: int,
                           rank_seconds: float, forward_fraction: float = DEFAULT_FORWARD_FRACTION) -> float:
    """One step's seconds when torch's order for ``schedule`` runs on ranks of ``rank_seconds`` per
    micro-batch each, ``forward_fraction`` of it in forward, split evenly over their stages: forward
    T_F / V, full backward (T_B + T_W) / V, input-gradient and weight passes half of that each, but
    stage 0's input-gradient pass nothing and its weight pass the whole backward (torch skips the
    first stage's input gradients: stage.py ``backward_one_chunk``)."""
    return rank_seconds * _simulated_step_units(schedule, ranks, stages_per_rank, microbatches, forward_fraction)


@lru_cache(maxsize=1024)
def _simulated_step_units(schedule: str, ranks: int, stages_per_rank: int, microbatches: int,
                          forward_fraction: float) -> float:
    forward = forward_fraction / stages_per_rank
    backward = (1 - forward_fraction) / stages_per_rank

    def action_seconds(stage: int, kind: str) -> float:
        if kind in "FB":
            return forward if kind == "F" else backward
        if stage == 0:
            return 0.0 if kind == "I" else backward
        return backward / 2     # T_B = T_W: an assumption (module docstring)

    return simulate_actions([rank_actions(schedule, rank, ranks, stages_per_rank, microbatches)
                             for rank in range(ranks)], action_seconds)


def split_backward_terms(schedule: str, rank_seconds: float, forward_fraction: float,
                         split_backward_ratio: float) -> tuple[float, float]:
    """(rank seconds, forward fraction) of a micro-batch once the zero-bubble schedules' backward,
    split into input- and weight-gradient passes, costs ``split_backward_ratio`` times the backward
    in one pass (measured: `oomless.profile.split_backward`); unchanged for the other schedules.
    Every stage's backward is taken as split (torch runs stage 0's whole backward as its weight pass,
    unsplit: the few percent that over-counts for it)."""
    if schedule not in ZERO_BUBBLE_SCHEDULES or split_backward_ratio == 1.0:
        return rank_seconds, forward_fraction
    scale = forward_fraction + split_backward_ratio * (1 - forward_fraction)
    return rank_seconds * scale, forward_fraction / scale


def predicted_step_seconds(schedule: str, ranks: int, stages_per_rank: int, microbatches: int,
                           rank_seconds: float, forward_fraction: float = DEFAULT_FORWARD_FRACTION,
                           split_backward_ratio: float = 1.0) -> float:
    """One step's seconds under ``schedule`` when the slowest rank takes ``rank_seconds`` per
    micro-batch, ``forward_fraction`` of it in forward (formulas, method and sources: module docstring);
    ``split_backward_ratio``: what the zero-bubble schedules' split backward costs (`split_backward_terms`)."""
    rank_seconds, forward_fraction = split_backward_terms(schedule, rank_seconds, forward_fraction,
                                                          split_backward_ratio)
    P, V, M, T = ranks, stages_per_rank, microbatches, rank_seconds
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule in SINGLE_STAGE_SCHEDULES:
        return (M + P - 1) * T
    if schedule == "interleaved-1f1b":
        return max(M * T + (P - 1) * T / V, (M + V * P - 1) * T / V)
    # Past the warm-up each micro-batch adds T: simulate up to the threshold only.
    steady = min(M, P if schedule == "zero-bubble" else 2 * P - 1)
    return simulated_step_seconds(schedule, P, V, steady, T, forward_fraction) + (M - steady) * T
