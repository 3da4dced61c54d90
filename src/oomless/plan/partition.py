"""The partitioner: cut a profiled model into contiguous pipeline stages, P ranks x V stages per
rank, minimising the slowest rank's time under each rank's memory limit, and choose the number of
micro-batches (DESIGN.md sections 5 and 6, issue 5).

    profile = oomless.profile(model, one_microbatch, loss_fn=..., optimizer=...)
    partition = partition_stages(profile, stages=4, memory="20GiB", microbatches=8)
    print(partition)                  # stage -> blocks, rank, predicted seconds and bytes, the bottleneck
    partition.stage_blocks            # [["blocks.0", "blocks.1"], ["blocks.2"], ...]
    # or let the planner pick M: oomless.plan.microbatches.choose_microbatches

`partition_stages` takes a profile of **one micro-batch**: its times and saved bytes are per
micro-batch. `oomless.plan.microbatches.choose_microbatches` scales a whole-batch profile down.

The schedules (`SCHEDULES`: gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv) are described in
`oomless.plan.schedules`, with formulas and sources: where each places the stages (`stage_ranks`),
how many micro-batches a stage holds at once (`rank_in_flight`) and how long a step takes
(`predicted_step_seconds`). This module plans with them and re-exports those names.

Cost model of stage s holding blocks [i, j):

- seconds per micro-batch: the blocks' forward + backward seconds (the loss's on the last stage),
  plus, when ``link_bytes_per_second`` is given and the stage in front lives on another rank, the
  time to receive the tensors crossing the cut and to send back their gradients. A rank's time per
  micro-batch is the sum over its stages (plus ``overhead_seconds`` per stage in `choose_microbatches`).
- bytes: parameters + gradients + optimizer state (the profile's optimizer bytes per parameter
  byte, 0 when the profile had no optimizer: a note says so) + in-flight micro-batches x saved
  activations + torch's receive buffers: ``PipelineStage`` allocates one per micro-batch for the
  tensors crossing the cut in front and one for the gradients of those crossing the cut behind
  (torch/distributed/pipelining/stage.py, ``_prepare_forward_infra`` and
  ``_setup_backward_recv_info``) and reuses them every step, so all M of them stay resident: M x
  (crossing in front + crossing behind); stage 0's "received" input is the step's whole batch,
  which the caller holds. A rank adds
  its stages' static bytes, their activations at the rank's busiest moment (its stages do not peak
  together: under zero-bubble with P = 2, M = 4 they peak at 4 and 2 micro-batches but hold 4 in
  all; `rank_in_flight`), every buffer of the model once (buffers are not attributed to blocks,
  which overstates by at most ``profile.buffer_bytes``) and the largest working (transient) bytes
  of one of its blocks, as the memory planner estimates them.
- bytes crossing the cut in front of block i: what the forward holds when block i starts (every
  earlier block output still referenced: the skips of a U-Net), at least block i's own input. For
  stage 0 it is the step's input.

Choosing M (`oomless.plan.microbatches`): each divisor M of the per-replica batch that torch's schedule
accepts is planned on the whole-batch profile scaled to 1 / M (`scale_profile`), every stage paying
``overhead_seconds`` per micro-batch; the fastest predicted step that fits wins, fewer micro-batches
on ties. More micro-batches shrink the bubble and cost overhead; they never cost bytes here (GPipe
holds M micro-batches of 1 / M the activations each, 1F1B fewer), so memory only rules out small M.

The search: with one stage per rank it is exact, dynamic programming over contiguous cuts,
O(n^2 P) for n blocks. With several stages per rank the rank sums couple stages that are not
neighbours; a depth-first branch and bound over cuts (pruned by the best rank time so far, the
rank's memory and the time left to place) starts from two dynamic-programming cuts improved by
local search, and is exact when it finishes within `SEARCH_STEPS` (it does on the small models of
the tests, where it equals brute force over every cut: tests/test_partition.py). Otherwise the best
cut found is returned with a note of its distance from the lower bound compute seconds / P (within
about 2 % on generated models of 48 to 96 blocks on 4 to 8 ranks).
"""

import io
import json
import math
from dataclasses import asdict, dataclass, field
from itertools import accumulate

from oomless.errors import InputError, PlanError
from oomless.plan.planner import _transient_bytes
from oomless.plan.schedules import (DEFAULT_FORWARD_FRACTION, check_schedule, microbatch_problem,
                                    predicted_step_seconds, rank_in_flight, split_backward_terms, stage_ranks)
# Not used here: re-exported for the callers that import them from this module (parallel/, cli/, tests).
from oomless.plan.schedules import SCHEDULES, in_flight_microbatches  # noqa: F401
from oomless.profile.profile import Profile
from oomless.sizes import format_bytes, parse_bytes

# Branch-and-bound steps (candidate stages tried) before the search settles for the best cut found.
SEARCH_STEPS = 100_000
# Assumed fixed cost per micro-batch and stage (kernel launches, a p2p send/recv pair, the schedule's
# Python dispatch): 1 ms, of the order of a gloo send/recv on loopback plus torch's per-action work
# on CPU; not measured here. Give `overhead_seconds` for your device (GPU/NCCL: likely less).
DEFAULT_OVERHEAD_SECONDS = 1e-3


@dataclass
class Partition:
    """Contiguous stages of a profiled model, placed on ranks, and what the cost model predicts."""

    schedule: str
    microbatches: int
    stage_blocks: list[list[str]]
    stage_seconds: list[float]          # forward + backward per micro-batch (+ communication)
    stage_bytes: list[int]              # predicted peak bytes of each stage, as if alone on its device
    memory_limits: list[int]            # per rank
    crossing_bytes: list[int]           # per micro-batch, into each stage (stage 0: the step's input)
    in_flight: list[int]                # micro-batches whose activations each stage holds at once
    notes: list[str] = field(default_factory=list)
    stages_per_rank: int = 1
    rank_bytes: list[int] = field(default_factory=list)   # predicted peak bytes of each rank
    overhead_seconds: float = 0.0       # added per micro-batch to every stage's seconds
    forward_fraction: float = DEFAULT_FORWARD_FRACTION
    split_backward_ratio: float = 1.0   # the profile's (zero-bubble schedules: split backward's cost)

    def __post_init__(self):
        if not self.rank_bytes and self.stages_per_rank == 1:   # a partition saved before ranks had several stages
            self.rank_bytes = list(self.stage_bytes)

    @property
    def stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def ranks(self) -> int:
        return self.stages // self.stages_per_rank

    @property
    def stage_ranks(self) -> list[int]:
        return stage_ranks(self.schedule, self.ranks, self.stages_per_rank)

    @property
    def rank_seconds(self) -> list[float]:
        """Each rank's seconds per micro-batch: its stages' seconds plus the overhead of each."""
        totals = [0.0] * self.ranks
        for stage, rank in enumerate(self.stage_ranks):
            totals[rank] += self.stage_seconds[stage] + self.overhead_seconds
        return totals

    @property
    def bottleneck(self) -> int:
        """Index of the slowest stage (the first one, on ties)."""
        return max(range(self.stages), key=lambda stage: (self.stage_seconds[stage], -stage))

    @property
    def bottleneck_rank(self) -> int:
        """Index of the slowest rank (the first one, on ties)."""
        seconds = self.rank_seconds
        return max(range(self.ranks), key=lambda rank: (seconds[rank], -rank))

    @property
    def bottleneck_seconds(self) -> float:
        """The slowest rank's seconds per micro-batch: what the cut minimises."""
        return self.rank_seconds[self.bottleneck_rank]

    @property
    def predicted_step_seconds(self) -> float:
        return predicted_step_seconds(self.schedule, self.ranks, self.stages_per_rank, self.microbatches,
                                      self.bottleneck_seconds, self.forward_fraction, self.split_backward_ratio)

    @property
    def predicted_bubble_fraction(self) -> float:
        """Share of the predicted step the slowest rank waits: 1 - M T / step (T with the split
        backward's cost, where the schedule splits it)."""
        step = self.predicted_step_seconds
        busy, _ = split_backward_terms(self.schedule, self.bottleneck_seconds, self.forward_fraction,
                                       self.split_backward_ratio)
        return 1 - self.microbatches * busy / step if step else 0.0

    @property
    def bubble_fraction(self) -> float:
        return self.predicted_bubble_fraction

    def stage_of(self) -> dict[str, int]:
        """{block name: stage index}."""
        return {name: stage for stage, names in enumerate(self.stage_blocks) for name in names}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Partition":
        return cls(**json.loads(text))

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"oomless pipeline cut: {self.stages} stages on {self.ranks} ranks, {self.schedule}, "
                            f"{self.microbatches} micro-batches")
        for column in ("stage", "rank", "blocks", "ms / micro-batch", "bytes", "crossing in", "in flight"):
            table.add_column(column, justify="left" if column == "blocks" else "right")
        for stage, (names, rank) in enumerate(zip(self.stage_blocks, self.stage_ranks)):
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
            marker = " *" if rank == self.bottleneck_rank else ""
            table.add_row(f"{stage}", f"{rank}{marker}", shown, f"{self.stage_seconds[stage] * 1e3:.2f}",
                          format_bytes(self.stage_bytes[stage]), format_bytes(self.crossing_bytes[stage]),
                          str(self.in_flight[stage]))
        buffer = io.StringIO()
        Console(file=buffer, width=120, force_terminal=False, color_system=None).print(table)
        # A limit this large stands for "no budget given" (oomless.parallel.stage_fit.UNLIMITED): not printed.
        ranks = ", ".join(f"{rank}: {format_bytes(used)}" + (f" of {format_bytes(limit)}" if limit < 1 << 60 else "")
                          for rank, (used, limit) in enumerate(zip(self.rank_bytes, self.memory_limits)))
        slowest = f"stage {self.bottleneck}" if self.stages_per_rank == 1 else f"rank {self.bottleneck_rank}"
        lines = [f"bottleneck: {slowest} (*), {self.bottleneck_seconds * 1e3:.2f} ms per micro-batch; "
                 f"predicted step {self.predicted_step_seconds * 1e3:.1f} ms, bubble {self.bubble_fraction:.0%}",
                 f"bytes per rank: {ranks} (its stages' own, as the cut weighs them; given a memory per "
                 "rank, the trainer prints each rank's 'planned per rank' after its stages are planned, with what "
                 "the rank holds beside them)"]
        return buffer.getvalue() + "\n".join(lines + [f"note: {note}" for note in self.notes])


class StageCosts:
    """Seconds and bytes of any contiguous run of blocks as a stage, in O(1) from prefix sums (the
    largest working bytes in O(length)). ``stages`` is the number of pipeline ranks P; the model is
    cut into P x ``stages_per_rank`` stages placed by `stage_ranks`."""

    def __init__(self, profile: Profile, stages: int, microbatches: int, schedule: str,
                 link_bytes_per_second: float | None = None, stages_per_rank: int = 1):
        blocks = profile.blocks
        self.profile, self.ranks, self.microbatches, self.schedule = profile, stages, microbatches, schedule
        self.link_bytes_per_second = link_bytes_per_second
        self.stage_rank = stage_ranks(schedule, stages, stages_per_rank)
        self.local = [self.stage_rank[:stage].count(rank) for stage, rank in enumerate(self.stage_rank)]
        by_rank = [rank_in_flight(schedule, rank, stages, stages_per_rank, microbatches) for rank in range(stages)]
        self.in_flight = [by_rank[rank][0][local] for rank, local in zip(self.stage_rank, self.local)]
        self.moments = [moments for _, moments in by_rank]   # per rank: in-flight counts of its stages at once
        self._seconds = [0.0, *accumulate(block.forward_seconds + block.backward_seconds for block in blocks)]
        self._parameters = [0, *accumulate(block.parameter_bytes for block in blocks)]
        self._saved = [0, *accumulate(block.saved_bytes for block in blocks)]
        self._working = [_transient_bytes(block) for block in blocks]
        # What crosses the cut in front of block i; the first block receives the step's input.
        self.crossing = [max(block.held_forward_bytes, block.input_bytes // max(block.calls, 1)) for block in blocks]
        if blocks:
            self.crossing[0] = profile.input_bytes
        self.optimizer_per_parameter_byte = (profile.optimizer_state_bytes / profile.parameter_bytes
                                             if profile.parameter_bytes else 0.0)

    def compute_seconds(self, start: int, stop: int) -> float:
        """Forward + backward seconds of blocks [start, stop), the loss's if it ends the model."""
        last = stop == len(self.profile.blocks)
        return self._seconds[stop] - self._seconds[start] + (self.profile.loss_seconds if last else 0.0)

    def seconds(self, start: int, stop: int, stage: int | None = None) -> float:
        """Per micro-batch seconds of blocks [start, stop) as stage ``stage``: compute, plus the
        crossing in front both ways unless the stage before lives on the same rank (zbv's turn)."""
        total = self.compute_seconds(start, stop)
        remote = stage is None or stage == 0 or self.stage_rank[stage - 1] != self.stage_rank[stage]
        if self.link_bytes_per_second and start > 0 and remote:
            total += 2 * self.crossing[start] / self.link_bytes_per_second   # activations in, gradients back
        return total

    def static_bytes(self, start: int, stop: int) -> int:
        """Parameters, gradients and optimizer state of blocks [start, stop)."""
        parameters = self._parameters[stop] - self._parameters[start]
        return 2 * parameters + int(parameters * self.optimizer_per_parameter_byte)

    def activation_bytes(self, start: int, stop: int) -> int:
        """What one in-flight micro-batch holds on a stage of blocks [start, stop): saved activations
        (the loss's saved tensors on the last). Its received input is in `received_bytes`."""
        activations = self._saved[stop] - self._saved[start]
        return activations + (self.profile.unassigned_saved_bytes if stop == len(self.profile.blocks) else 0)

    def received_bytes(self, start: int, stop: int) -> int:
        """torch's receive buffers of blocks [start, stop) as a stage, resident whatever the moment:
        one per micro-batch for the tensors crossing in front, one for the gradients of those
        crossing behind (module docstring); stage 0's: the step's input, the whole batch."""
        behind = self.crossing[stop] if stop < len(self.profile.blocks) else 0
        return self.microbatches * (self.crossing[start] + behind)

    def working_bytes(self, start: int, stop: int) -> int:
        """The largest working bytes of one block in [start, stop): one block runs at a time."""
        return max(self._working[start:stop], default=0)

    def bytes(self, stage: int, start: int, stop: int) -> int:
        """Predicted peak bytes of blocks [start, stop) as stage ``stage``, alone on its device."""
        return (self.static_bytes(start, stop) + self.received_bytes(start, stop)
                + self.in_flight[stage] * self.activation_bytes(start, stop)
                + self.profile.buffer_bytes + self.working_bytes(start, stop))

    def rank_bytes(self, cuts: list[int]) -> list[int]:
        """Predicted peak bytes of each rank for stage boundaries ``cuts``: its stages' static bytes,
        their activations at the rank's worst moment, the largest working bytes, buffers once."""
        static, working = [0] * self.ranks, [0] * self.ranks
        activations = [[0] * len(moments) for moments in self.moments]
        for stage, (start, stop) in enumerate(zip(cuts, cuts[1:])):
            rank, local = self.stage_rank[stage], self.local[stage]
            static[rank] += self.static_bytes(start, stop) + self.received_bytes(start, stop)
            working[rank] = max(working[rank], self.working_bytes(start, stop))
            per_microbatch = self.activation_bytes(start, stop)
            activations[rank] = [total + moment[local] * per_microbatch
                                 for total, moment in zip(activations[rank], self.moments[rank])]
        return [static[rank] + max(activations[rank]) + working[rank] + self.profile.buffer_bytes
                for rank in range(self.ranks)]

    def rank_seconds(self, cuts: list[int]) -> list[float]:
        """Each rank's seconds per micro-batch for stage boundaries ``cuts``."""
        totals = [0.0] * self.ranks
        for stage, (start, stop) in enumerate(zip(cuts, cuts[1:])):
            totals[self.stage_rank[stage]] += self.seconds(start, stop, stage)
        return totals


def _min_max_cut(n: int, stages: int, cost, allowed) -> tuple[float, list[int]] | None:
    """Cut positions 0 = c0 < c1 < ... < cS = n minimising max_s cost(s, c_s, c_s+1) over cuts where
    every allowed(s, c_s, c_s+1); None if no cut is allowed. Exact; O(n^2 S) calls."""
    infinity = float("inf")
    # best[s][j]: the least maximum over stages 0..s-1 covering blocks [0, j); back[s][j]: where stage s-1 starts.
    best = [[infinity] * (n + 1) for _ in range(stages + 1)]
    back = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for stage in range(stages):
        # Every later stage needs at least one block: stage `stage` ends by n - (stages - 1 - stage).
        for stop in range(stage + 1, n - (stages - 1 - stage) + 1):
            for start in range(stage, stop):
                if best[stage][start] == infinity or not allowed(stage, start, stop):
                    continue
                value = max(best[stage][start], cost(stage, start, stop))
                if value < best[stage + 1][stop]:
                    best[stage + 1][stop], back[stage + 1][stop] = value, start
    if best[stages][n] == infinity:
        return None
    cuts = [n]
    for stage in range(stages, 0, -1):
        cuts.append(back[stage][cuts[-1]])
    return best[stages][n], cuts[::-1]


class _RankSearch:
    """Depth-first branch and bound over cuts into stages placed on ranks, for the least slowest-rank
    seconds among cuts whose every rank fits its limit. Exact when ``complete`` after `run`."""

    def __init__(self, costs: StageCosts, limits: list[int], steps: int):
        self.costs, self.limits, self.steps_left, self.complete = costs, limits, steps, True
        self.n, self.stages = len(costs.profile.blocks), len(costs.stage_rank)
        self.best_seconds, self.best_cuts = math.inf, None
        # Per rank, over the stages placed so far: seconds, static bytes, activation bytes at each of
        # its moments (`StageCosts.moments`), largest working bytes.
        self.seconds, self.static, self.working = [0.0] * costs.ranks, [0] * costs.ranks, [0] * costs.ranks
        self.activations = [[0] * len(moments) for moments in costs.moments]
        self.unplaced = [costs.stage_rank.count(rank) for rank in range(costs.ranks)]

    def offer(self, cuts: list[int] | None) -> None:
        """Start from ``cuts`` (a heuristic's) if it fits and beats the best so far."""
        if cuts and all(used <= limit for used, limit in zip(self.costs.rank_bytes(cuts), self.limits)):
            value = max(self.costs.rank_seconds(cuts))
            if value < self.best_seconds:
                self.best_seconds, self.best_cuts = value, list(cuts)

    def run(self) -> list[int] | None:
        self._visit(0, [0])
        return self.best_cuts

    def _room(self) -> float:
        """Seconds the ranks with stages still to place can take on and stay under the best."""
        return sum(self.best_seconds - seconds for seconds, left in zip(self.seconds, self.unplaced) if left)

    def _visit(self, stage: int, cuts: list[int]) -> None:
        costs, start = self.costs, cuts[-1]
        if stage == self.stages:
            if max(self.seconds) < self.best_seconds:
                self.best_seconds, self.best_cuts = max(self.seconds), list(cuts)
            return
        rank, local = costs.stage_rank[stage], costs.local[stage]
        before = self.seconds[rank], self.static[rank], self.activations[rank], self.working[rank]
        self.unplaced[rank] -= 1
        first = self.n if stage == self.stages - 1 else start + 1
        for stop in range(first, self.n - (self.stages - 1 - stage) + 1):
            if self.steps_left == 0:
                self.complete = False
                break
            self.steps_left -= 1
            # Seconds and bytes only grow with `stop`: past the best or the limit, so is every later stop.
            seconds = before[0] + costs.seconds(start, stop, stage)
            static = before[1] + costs.static_bytes(start, stop) + costs.received_bytes(start, stop)
            per_microbatch = costs.activation_bytes(start, stop)
            activations = [total + moment[local] * per_microbatch
                           for total, moment in zip(before[2], costs.moments[rank])]
            working = max(before[3], costs.working_bytes(start, stop))
            if (seconds >= self.best_seconds
                    or static + max(activations) + working + costs.profile.buffer_bytes > self.limits[rank]):
                break
            self.seconds[rank], self.static[rank], self.activations[rank], self.working[rank] = (
                seconds, static, activations, working)
            # The blocks after `stop` must fit in the room left under the best: if not, take more now.
            if stop < self.n and costs.compute_seconds(stop, self.n) >= self._room():
                continue
            cuts.append(stop)
            self._visit(stage + 1, cuts)
            cuts.pop()
        self.seconds[rank], self.static[rank], self.activations[rank], self.working[rank] = before
        self.unplaced[rank] += 1


def _improve(costs: StageCosts, limits: list[int], cuts: list[int]) -> list[int]:
    """Local search from ``cuts``: move one boundary by one block while that lowers the bytes over
    the limits, then the rank seconds sorted slowest first (compared in order, so moves that
    shorten the second-slowest rank count too: the plateaus of the maximum alone stall)."""
    def key(candidate):
        over = sum(max(0, used - limit) for used, limit in zip(costs.rank_bytes(candidate), limits))
        return over, sorted(costs.rank_seconds(candidate), reverse=True)

    best, best_key, moved = list(cuts), key(cuts), True
    while moved:
        moved = False
        for index in range(1, len(best) - 1):
            for step in (-1, 1):
                candidate = best[:index] + [best[index] + step] + best[index + 1:]
                if candidate[index - 1] < candidate[index] < candidate[index + 1] and key(candidate) < best_key:
                    best, best_key, moved = candidate, key(candidate), True
    return best


def _rank_cut(costs: StageCosts, limits: list[int]) -> tuple[list[int] | None, bool]:
    """The cut for several stages per rank, and whether it is proven the best: branch and bound
    from two dynamic-programming cuts (the most even stage seconds; the most even stage bytes
    against their rank's limit), each first improved by `_improve`."""
    n, stages = len(costs.profile.blocks), len(costs.stage_rank)
    search = _RankSearch(costs, limits, SEARCH_STEPS)
    for cost in (lambda stage, start, stop: costs.seconds(start, stop, stage),
                 lambda stage, start, stop: costs.bytes(stage, start, stop) / limits[costs.stage_rank[stage]]):
        search.offer(_improve(costs, limits, _min_max_cut(n, stages, cost, lambda stage, start, stop: True)[1]))
    return search.run(), search.complete


def _limits(memory, ranks: int, stages_per_rank: int) -> list[int]:
    if isinstance(memory, (list, tuple)):
        if len(memory) != ranks:
            holders = "stages" if stages_per_rank == 1 else "ranks (a rank holds all its stages)"
            raise InputError(f"memory gives {len(memory)} limits for {ranks} {holders}; give one each or one for all")
        return [parse_bytes(limit) for limit in memory]
    return [parse_bytes(memory)] * ranks


def _forward_fraction(profile: Profile) -> float:
    forward = sum(block.forward_seconds for block in profile.blocks) + profile.loss_seconds
    total = forward + sum(block.backward_seconds for block in profile.blocks)
    return forward / total if total > 0 else DEFAULT_FORWARD_FRACTION


def partition_stages(profile: Profile, stages: int, memory, microbatches: int = 1, schedule: str = "1f1b",
                     link_bytes_per_second: float | None = None, stages_per_rank: int = 1) -> Partition:
    """Cut ``profile``'s blocks (one micro-batch's) into ``stages`` x ``stages_per_rank`` contiguous
    stages, placed on ``stages`` pipeline ranks as ``schedule`` places them, with the slowest rank as
    fast as possible and each rank within its memory limit (``memory``: one size for all ranks, or
    one per rank). Raises `InputError` for what torch's schedule would refuse, and `PlanError`
    naming a per-rank memory that would fit when no cut does."""
    check_schedule(schedule, stages, stages_per_rank)
    n, count = len(profile.blocks), stages * stages_per_rank
    problem = microbatch_problem(schedule, stages, microbatches)
    if problem and schedule != "1f1b":   # 1f1b: planned anyway (earlier callers did), with a note
        raise InputError(problem)
    if n < count:
        raise InputError(f"cannot cut {n} blocks into {count} stages; use fewer stages or finer blocks (blocks=...)")
    limits = _limits(memory, stages, stages_per_rank)
    costs = StageCosts(profile, stages, microbatches, schedule, link_bytes_per_second, stages_per_rank)
    if stages_per_rank == 1:
        found = _min_max_cut(n, count, lambda stage, start, stop: costs.seconds(start, stop),
                             lambda stage, start, stop: costs.bytes(stage, start, stop) <= limits[stage])
        cuts, proven = (found[1] if found else None), True
    else:
        cuts, proven = _rank_cut(costs, limits)
    if cuts is None:
        _raise_no_cut_fits(profile, costs, limits, stopped=not proven)
    spans, notes = list(zip(cuts, cuts[1:])), []
    if not proven:
        gap = max(costs.rank_seconds(cuts)) / (costs.compute_seconds(0, n) / stages) - 1
        notes.append(f"cut search stopped after {SEARCH_STEPS} steps: the best cut found, not proven the best; "
                     f"its slowest rank is {gap:.1%} above the lower bound (compute seconds / ranks)")
    if problem:
        notes.append(f"{problem}: predicted as planned, but torch will refuse {microbatches} micro-batches")
    if profile.parameter_bytes and not profile.optimizer_state_bytes:
        notes.append("the profile counted no optimizer state (profile with optimizer=...): counted as 0")
    if link_bytes_per_second is None and stages > 1:
        notes.append("communication between stages not counted (give link_bytes_per_second)")
    return Partition(
        schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
        stage_blocks=[[block.name for block in profile.blocks[start:stop]] for start, stop in spans],
        stage_seconds=[costs.seconds(start, stop, stage) for stage, (start, stop) in enumerate(spans)],
        stage_bytes=[costs.bytes(stage, start, stop) for stage, (start, stop) in enumerate(spans)],
        rank_bytes=costs.rank_bytes(cuts), memory_limits=limits,
        crossing_bytes=[costs.crossing[start] for start, _ in spans], in_flight=list(costs.in_flight),
        forward_fraction=_forward_fraction(profile), split_backward_ratio=profile.split_backward_ratio, notes=notes)


def _raise_no_cut_fits(profile: Profile, costs: StageCosts, limits: list[int], stopped: bool = False):
    """No cut fits: find the cut that needs the least memory (relative to each limit) and say what
    one limit for every rank would fit, and which block dominates the rank that overflows. Exact
    with one stage per rank; with several, the bytes of a cut that fits, not proven the least."""
    n, stages, single = len(profile.blocks), len(costs.stage_rank), costs.ranks == len(costs.stage_rank)
    anything = lambda stage, start, stop: True
    cuts = _min_max_cut(n, stages, lambda stage, start, stop: costs.bytes(stage, start, stop)
                        / limits[costs.stage_rank[stage]], anything)[1]
    needed = costs.rank_bytes(cuts)
    worst = max(range(costs.ranks), key=lambda rank: needed[rank] / limits[rank])
    heaviest = max((block for stage, (start, stop) in enumerate(zip(cuts, cuts[1:])) if costs.stage_rank[stage] == worst
                    for block in profile.blocks[start:stop]),
                   key=lambda block: 2 * block.parameter_bytes + block.saved_bytes)
    fewest = _min_max_cut(n, stages, lambda stage, start, stop: costs.bytes(stage, start, stop), anything)
    uniform = int(fewest[0]) if single else max(costs.rank_bytes(fewest[1]))
    holder, fits = (("stage", "per stage would fit") if single
                    else ("rank", "per rank fits a cut (not proven the least)"))
    found = f" within {SEARCH_STEPS} search steps (the search stopped: one may exist)" if stopped else ""
    raise PlanError(
        f"no cut into {stages} stages fits the memory limits{found}: the tightest cut {'' if single else 'found '}"
        f"still needs {format_bytes(needed[worst])} on {holder} {worst} (limit {format_bytes(limits[worst])}), mostly "
        f"for block {heaviest.name}; {format_bytes(uniform)} ({uniform} bytes) {fits}. Give more memory, more "
        "stages, fewer micro-batches in flight (schedule='1f1b'), or plan each stage's activations with the fit "
        "engine", minimum_bytes=uniform, limiting_block=heaviest.name)
