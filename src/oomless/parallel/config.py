"""The typed configuration of data parallel training; `TrainConfig.parallel` holds one.

Modes (see `oomless.parallel` for the trade-offs):

- ``none``: one process, no torch.distributed.
- ``dp``: synchronous data parallel on torch DDP. ``overlap="forward"`` (default): each bucket's
  optimizer update runs as soon as its all-reduce lands and may run on behind the next forward, in
  which each module waits only for its own parameters' update; ``"backward"``: the updates run
  while backward computes the other buckets and are all done when it returns; ``"none"``: plain DDP.
- ``fsdp``: synchronous sharded data parallel on FSDP2 (``fully_shard`` per block, then the root):
  every rank holds 1/N of the parameters, gradients and optimizer state (`oomless.parallel.sharded`).
- ``local-sgd``: every rank steps on its own shard; parameters are averaged every ``average_every`` steps.
- ``async``: every rank steps on its own shard; the parameter average of step k runs while step k+1
  computes and is applied one step late (staleness bounded by one step).
- ``pipeline``: the model cut into ``stages`` pipeline stages, one rank each (world = stages).
- ``hybrid``: world / ``stages`` replicas of such a pipeline, data parallel across replicas.

``switch`` changes layout during the run: ``[(10, "dp"), (20, "hybrid:2")]`` trains steps 0-9 in
the configured layout, 10-19 under dp, 20 on as a 2-stage hybrid (see `layout_at`). ``switch_when``
changes it when a logged metric crosses a threshold: ``[("loss<0.5", "dp")]`` switches to dp after
the first logged step whose loss (the mean over ranks, the same on every rank) is below 0.5; each
condition fires once, and its layout holds until the next step switch. A resumed run evaluates the
conditions afresh from its first logged step.
"""

import dataclasses
import operator
import re
from dataclasses import dataclass, field

from oomless.errors import InputError
from oomless.plan.schedules import SINGLE_STAGE_SCHEDULES, check_schedule

PARALLEL_MODES = ("none", "dp", "fsdp", "local-sgd", "async", "pipeline", "hybrid")
SYNCHRONOUS_MODES = ("none", "dp", "fsdp", "pipeline", "hybrid")
PIPELINE_MODES = ("pipeline", "hybrid")
OVERLAP_MODES = ("forward", "backward", "none")


@dataclass
class ParallelConfig:
    """How the processes started by ``torchrun`` share the work of one training run."""

    mode: str = "none"
    overlap: str = "forward"             # dp only: forward | backward | none (see above)
    average_every: int = 4               # local-sgd only: steps between parameter averages (H)
    bucket_cap_mb: float = 25.0          # DDP gradient bucket size; smaller buckets overlap earlier
    timeout_seconds: float = 600.0       # a collective slower than this fails, naming rank and collective
    backend: str = "auto"                # auto: nccl on CUDA, gloo on CPU
    stages: int = 2                      # pipeline / hybrid: pipeline ranks per replica
    schedule: str = "1f1b"               # pipeline / hybrid: one of PIPELINE_SCHEDULES
    microbatches: int | None = None      # pipeline / hybrid: per replica and step; None: the planner chooses
    stages_per_rank: int | None = None   # None: 2 for interleaved-1f1b, zero-bubble, zbv; 1 otherwise
    switch: list[tuple[int, str]] = field(default_factory=list)   # (step, layout) in step order
    switch_when: list[tuple[str, str]] = field(default_factory=list)  # (condition, layout), e.g. ("loss<0.5", "dp")

    @property
    def distributed(self) -> bool:
        return self.mode != "none"

    @property
    def synchronous(self) -> bool:
        return self.mode in SYNCHRONOUS_MODES

    @property
    def pipelined(self) -> bool:
        return self.mode in PIPELINE_MODES

    @property
    def ever_pipelined(self) -> bool:
        """Whether any layout of the run (this one, or one it switches to) is a pipeline."""
        layouts = [layout for _, layout in self.switch] + [layout for _, layout in self.switch_when]
        return self.pipelined or any(layout.partition(":")[0] in PIPELINE_MODES for layout in layouts)

    @property
    def sharded(self) -> bool:
        return self.mode == "fsdp"

    @property
    def resolved_stages_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2

    def with_layout(self, layout: str) -> "ParallelConfig":
        """This configuration under ``layout``: ``dp``, ``local-sgd``, ``async``, ``pipeline[:S]`` or
        ``hybrid[:S]`` (S stages; without it, this configuration's), with no switches of its own."""
        mode, _, stages = layout.partition(":")
        if mode not in PARALLEL_MODES[1:] or (stages and (not stages.isdigit() or mode not in PIPELINE_MODES)):
            raise InputError(f"layout {layout!r} is not one of dp, local-sgd, async, pipeline[:STAGES], "
                             "hybrid[:STAGES]")
        changed = dataclasses.replace(self, mode=mode, stages=int(stages) if stages else self.stages, switch=[],
                                      switch_when=[])
        changed._validate_pipeline()
        return changed

    def layout_at(self, step: int) -> "ParallelConfig":
        """The configuration in force at 0-based ``step`` by the step switches: this one with the
        last switch at or before ``step`` applied."""
        current = dataclasses.replace(self, switch=[], switch_when=[])
        for at, layout in self.switch:
            if at <= step:
                current = current.with_layout(layout)
        return current

    def next_switch(self, step: int, stop: int) -> int:
        """The first step switch after ``step``, or ``stop``."""
        return min([at for at, _ in self.switch if step < at < stop] + [stop])

    def validate(self) -> "ParallelConfig":
        if self.mode not in PARALLEL_MODES:
            raise InputError(f"unknown parallel mode {self.mode!r}; choose one of {', '.join(PARALLEL_MODES)}")
        if self.average_every < 1:
            raise InputError(f"average-every must be at least 1, got {self.average_every}")
        if not self.bucket_cap_mb > 0:
            raise InputError(f"bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        if not self.timeout_seconds > 0:
            raise InputError(f"timeout must be positive, got {self.timeout_seconds}")
        if self.overlap not in OVERLAP_MODES:
            raise InputError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise InputError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        self._validate_pipeline()
        steps = [at for at, _ in self.switch]
        if steps != sorted(set(steps)) or any(at < 1 for at in steps):
            raise InputError(f"switch steps must be distinct, at least 1 and in order, got {steps}")
        for _, layout in self.switch + self.switch_when:
            self.with_layout(layout)
        layouts = [self.mode] + [layout.partition(":")[0] for _, layout in self.switch + self.switch_when]
        if "fsdp" in layouts and len(layouts) > 1:
            # A switch rebuilds the model from the old one's state_dict and the optimizer from its
            # state_dict (train.loop._rebuilt): under fsdp those are each rank's shards, not the model.
            raise InputError("switching layout to or from fsdp is not supported yet (--switch-at / --switch-when "
                             "with fsdp); train under fsdp throughout, or switch between dp, local-sgd, async, "
                             "pipeline and hybrid, or resume an fsdp checkpoint under another --parallel")
        for condition, _ in self.switch_when:
            parse_condition(condition)
        return self

    def _validate_pipeline(self) -> None:
        if self.stages < 1:
            raise InputError(f"stages must be at least 1, got {self.stages}")
        if self.microbatches is not None and self.microbatches < 1:
            raise InputError(f"microbatches must be at least 1, got {self.microbatches}")
        check_schedule(self.schedule, self.stages, self.resolved_stages_per_rank)


_COMPARISONS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_CONDITION = re.compile(r"^\s*(loss|dice)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*$")


def parse_condition(condition: str) -> tuple[str, object, float]:
    """"loss<0.5" -> ("loss", operator.lt, 0.5): a logged metric (loss or dice), a comparison, a number."""
    match = _CONDITION.match(condition)
    try:
        value = float(match.group(3)) if match else None
    except ValueError:
        value = None
    if value is None:
        raise InputError(f"switch condition {condition!r} is not METRIC<VALUE (METRIC: loss or dice; "
                         "comparisons <, <=, >, >=), e.g. loss<0.5")
    return match.group(1), _COMPARISONS[match.group(2)], value


def condition_holds(condition: str, record: dict) -> bool:
    """Whether ``condition`` holds for a logged ``record`` (step, loss, dice)."""
    metric, compare, value = parse_condition(condition)
    return bool(compare(record[metric], value))
