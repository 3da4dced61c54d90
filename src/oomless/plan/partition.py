"""The partitioner: cut a profiled model into S contiguous pipeline stages, minimising the slowest
stage's time under each stage's memory limit (DESIGN.md sections 5 and 6, issue 5).

    profile = oomless.profile(model, one_microbatch, loss_fn=..., optimizer=...)
    partition = partition_stages(profile, stages=4, memory=["20GiB"] * 4, microbatches=8)
    print(partition)                  # stage -> blocks, predicted seconds and bytes, the bottleneck
    partition.stage_blocks            # [["blocks.0", "blocks.1"], ["blocks.2"], ...]

The profile must be of **one micro-batch**: its times and saved bytes are per micro-batch.

Cost model of stage s, holding blocks [i, j) of the profile, in a pipeline of S stages and M
micro-batches:

- seconds per micro-batch: the blocks' forward + backward seconds (the loss's on the last stage),
  plus, when ``link_bytes_per_second`` is given, the time to receive the tensors crossing the cut in
  front of it and to send back their gradients (both directions of each cut counted once, on the
  receiving stage). The pipeline's step then lasts about (M + S - 1) x the slowest stage
  (GPipe and 1F1B alike, communication not overlapped); its bubble is (S - 1) / (M + S - 1).
- bytes: parameters + gradients + optimizer state (the profile's optimizer bytes per parameter
  byte, 0 when the profile had no optimizer: a note says so) + every buffer of the model (buffers are
  not attributed to blocks; each stage is charged all of them, which overstates by at most
  ``profile.buffer_bytes``) + in-flight micro-batches x (saved activations + bytes crossing the cut
  in front, held as the stage's received input) + the largest working (transient) bytes of one of
  its blocks, as the memory planner estimates them.
- bytes crossing the cut in front of block i: what the forward holds when block i starts (every
  earlier block output still referenced: the skips of a U-Net), at least block i's own input. For
  stage 0 it is the step's input.
- in-flight micro-batches, whose saved activations a stage holds at once: GPipe runs every forward
  before any backward, so M; 1F1B (PipeDream-flush, Narayanan et al. 2021) starts stage s's first
  backward after S - s forwards, so min(S - s, M).

The search is exact: dynamic programming over contiguous cuts, O(n^2 S) for n blocks, minimising the
maximum stage time among cuts whose every stage fits its limit. Tested against brute force over every
cut (tests/test_partition.py).
"""

import io
import json
from dataclasses import asdict, dataclass, field
from itertools import accumulate

from oomless.errors import InputError, PlanError
from oomless.plan.planner import _transient_bytes
from oomless.profile.profile import Profile
from oomless.sizes import format_bytes, parse_bytes

SCHEDULES = ("gpipe", "1f1b")


@dataclass
class Partition:
    """S contiguous stages of a profiled model and what the cost model predicts for each."""

    schedule: str
    microbatches: int
    stage_blocks: list[list[str]]
    stage_seconds: list[float]          # forward + backward per micro-batch (+ communication)
    stage_bytes: list[int]              # predicted peak bytes of each stage's device
    memory_limits: list[int]
    crossing_bytes: list[int]           # per micro-batch, into each stage (stage 0: the step's input)
    in_flight: list[int]                # micro-batches whose activations each stage holds at once
    notes: list[str] = field(default_factory=list)

    @property
    def stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def bottleneck(self) -> int:
        """Index of the slowest stage (the first one, on ties)."""
        return max(range(self.stages), key=lambda stage: (self.stage_seconds[stage], -stage))

    @property
    def bottleneck_seconds(self) -> float:
        return self.stage_seconds[self.bottleneck]

    @property
    def predicted_step_seconds(self) -> float:
        return (self.microbatches + self.stages - 1) * self.bottleneck_seconds

    @property
    def bubble_fraction(self) -> float:
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

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

        table = Table(title=f"oomless pipeline cut: {self.stages} stages, {self.schedule}, "
                            f"{self.microbatches} micro-batches")
        for column in ("stage", "blocks", "ms / micro-batch", "bytes", "limit", "crossing in", "in flight"):
            table.add_column(column, justify="left" if column == "blocks" else "right")
        for stage, names in enumerate(self.stage_blocks):
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
            marker = " *" if stage == self.bottleneck else ""
            table.add_row(f"{stage}{marker}", shown, f"{self.stage_seconds[stage] * 1e3:.2f}",
                          format_bytes(self.stage_bytes[stage]), format_bytes(self.memory_limits[stage]),
                          format_bytes(self.crossing_bytes[stage]), str(self.in_flight[stage]))
        buffer = io.StringIO()
        Console(file=buffer, width=120, force_terminal=False, color_system=None).print(table)
        lines = [f"bottleneck: stage {self.bottleneck} (*), {self.bottleneck_seconds * 1e3:.2f} ms per micro-batch; "
                 f"predicted step {self.predicted_step_seconds * 1e3:.1f} ms, bubble {self.bubble_fraction:.0%}"]
        return buffer.getvalue() + "\n".join(lines + [f"note: {note}" for note in self.notes])


def in_flight_microbatches(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose saved activations stage ``stage`` holds at once under ``schedule``."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(stages - stage, microbatches)
    raise InputError(f"schedule must be one of {', '.join(SCHEDULES)} for the partitioner, got {schedule!r}")


class StageCosts:
    """Seconds and bytes of any contiguous run of blocks as a stage, in O(1) from prefix sums."""

    def __init__(self, profile: Profile, stages: int, microbatches: int, schedule: str,
                 link_bytes_per_second: float | None = None):
        blocks = profile.blocks
        self.profile, self.stages, self.microbatches, self.schedule = profile, stages, microbatches, schedule
        self.link_bytes_per_second = link_bytes_per_second
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

    def seconds(self, start: int, stop: int) -> float:
        """Per micro-batch seconds of blocks [start, stop) as one stage."""
        total = self._seconds[stop] - self._seconds[start]
        if stop == len(self.profile.blocks):
            total += self.profile.loss_seconds
        if self.link_bytes_per_second and start > 0:
            total += 2 * self.crossing[start] / self.link_bytes_per_second   # activations in, gradients back
        return total

    def bytes(self, stage: int, start: int, stop: int) -> int:
        """Predicted peak bytes of blocks [start, stop) as stage ``stage``."""
        parameters = self._parameters[stop] - self._parameters[start]
        static = 2 * parameters + int(parameters * self.optimizer_per_parameter_byte) + self.profile.buffer_bytes
        activations = self._saved[stop] - self._saved[start] + self.crossing[start]
        if stop == len(self.profile.blocks):
            activations += self.profile.unassigned_saved_bytes    # the loss's saved tensors
        in_flight = in_flight_microbatches(self.schedule, stage, self.stages, self.microbatches)
        return static + in_flight * activations + max(self._working[start:stop], default=0)


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


def _limits(memory, stages: int) -> list[int]:
    if isinstance(memory, (list, tuple)):
        if len(memory) != stages:
            raise InputError(f"memory gives {len(memory)} limits for {stages} stages; give one per stage or one for all")
        return [parse_bytes(limit) for limit in memory]
    return [parse_bytes(memory)] * stages


def partition_stages(profile: Profile, stages: int, memory, microbatches: int = 1, schedule: str = "1f1b",
                     link_bytes_per_second: float | None = None) -> Partition:
    """Cut ``profile``'s blocks into ``stages`` contiguous stages with the slowest stage as fast as
    possible, each stage within its memory limit (``memory``: one size for all, or one per stage).
    Raises `PlanError` naming the smallest per-stage memory that would fit when no cut does."""
    n = len(profile.blocks)
    if stages < 1 or microbatches < 1:
        raise InputError(f"stages and microbatches must be at least 1, got {stages} and {microbatches}")
    if n < stages:
        raise InputError(f"cannot cut {n} blocks into {stages} stages; use fewer stages or finer blocks (blocks=...)")
    limits = _limits(memory, stages)
    costs = StageCosts(profile, stages, microbatches, schedule, link_bytes_per_second)
    costs.bytes(0, 0, 1)  # rejects an unknown schedule before the search

    found = _min_max_cut(n, stages, lambda stage, start, stop: costs.seconds(start, stop),
                         lambda stage, start, stop: costs.bytes(stage, start, stop) <= limits[stage])
    if found is None:
        _raise_no_cut_fits(profile, costs, stages, limits)
    _, cuts = found
    spans = list(zip(cuts, cuts[1:]))
    notes = []
    if profile.parameter_bytes and not profile.optimizer_state_bytes:
        notes.append("the profile counted no optimizer state (profile with optimizer=...): counted as 0")
    if link_bytes_per_second is None and stages > 1:
        notes.append("communication between stages not counted (give link_bytes_per_second)")
    return Partition(
        schedule=schedule, microbatches=microbatches,
        stage_blocks=[[block.name for block in profile.blocks[start:stop]] for start, stop in spans],
        stage_seconds=[costs.seconds(start, stop) for start, stop in spans],
        stage_bytes=[costs.bytes(stage, start, stop) for stage, (start, stop) in enumerate(spans)],
        memory_limits=limits, crossing_bytes=[costs.crossing[start] for start, _ in spans],
        in_flight=[in_flight_microbatches(schedule, stage, stages, microbatches) for stage in range(stages)],
        notes=notes)


def _raise_no_cut_fits(profile: Profile, costs: StageCosts, stages: int, limits: list[int]):
    """No cut fits: find the cut that needs the least memory (relative to each stage's limit) and say
    what one limit for every stage would fit, and which block dominates the stage that overflows."""
    n = len(profile.blocks)
    _, cuts = _min_max_cut(n, stages, lambda stage, start, stop: costs.bytes(stage, start, stop) / limits[stage],
                           lambda stage, start, stop: True)
    spans = list(zip(cuts, cuts[1:]))
    needed = [costs.bytes(stage, start, stop) for stage, (start, stop) in enumerate(spans)]
    worst = max(range(stages), key=lambda stage: needed[stage] / limits[stage])
    start, stop = spans[worst]
    heaviest = max(profile.blocks[start:stop], key=lambda block: 2 * block.parameter_bytes + block.saved_bytes)
    uniform = _min_max_cut(n, stages, lambda stage, start, stop: costs.bytes(stage, start, stop),
                           lambda stage, start, stop: True)[0]
    raise PlanError(
        f"no cut into {stages} stages fits the memory limits: the tightest cut still needs "
        f"{format_bytes(needed[worst])} on stage {worst} (limit {format_bytes(limits[worst])}), mostly for "
        f"block {heaviest.name}; {format_bytes(uniform)} ({int(uniform)} bytes) per stage would fit. Give more "
        "memory, more stages, fewer micro-batches in flight (schedule='1f1b'), or plan each stage's "
        "activations with the fit engine", minimum_bytes=int(uniform), limiting_block=heaviest.name)
