"""Predict every parallel layout of one training step on a cluster: data parallel (dp), sharded
data parallel (fsdp), pipelines under each schedule and hybrids (dp x pp), each with its memory
plan, and recommend the fastest that fits (issue 14, item 3; `oomless simulate`).

    estimates = estimate_layouts(profile, 1, make_cluster("h100", 64, 8), global_batch=512,
                                 profile_at=profiles_of_a_batch)
    best = recommend(estimates)             # the fastest that fits; `oomless.simulate` prints them

``profile`` is one step of ``profiled_batch`` samples on the target (meta tensors,
`profile.fake` / `profile.repeated`). Each layout's per-rank step (dp's and fsdp's batch, each
pipeline micro-batch) is the step traced at that batch, ``profile_at(samples)``, where the caller
can trace it (`oomless.simulate`), else that profile scaled linearly to its batch
(`plan.microbatches.scale_profile`, which misses what a small batch runs less efficiently and the
working memory that does not grow with the batch). Ranks are numbered node by node; data-parallel
groups are consecutive ranks (inside a node first), pipeline stages the outer dimension.

- **dp** (torch DDP): every rank holds the whole model and steps G / N samples; its memory plan is
  `make_plan` (keep / swap / recompute per block) for the device's memory. Gradients are
  all-reduced in buckets of 25 MiB (DDP's ``bucket_cap_mb``) as backward produces them, on a
  communication stream beside compute; the step ends when both have, then the optimizer runs.
- **fsdp** (FSDP2 ``fully_shard`` per block, ZeRO-3): parameters, gradients and optimizer state
  sharded over all N ranks; each block's parameters all-gathered before its forward and again
  before its backward (one block prefetched ahead, resharded after forward), its gradients
  reduce-scattered after its backward, each collective taking FSDP2's own work around it
  (`Cluster.fsdp_host_seconds`, at one rank too) besides the link's time. Static bytes per rank: the shards plus two
  blocks' unsharded parameters and gradients (the one running and the one in flight); `make_plan` plans
  the activations on top. All-gathers and reduce-scatters share one stream (the link). Parameters
  move in their stored dtype (FSDP2 without a MixedPrecisionPolicy; with param_dtype=bf16 the
  all-gathers would move half the bytes of fp32 weights). Every oomless block is one FSDP unit.
- **pipeline** (dp = 1) and **hybrid** (dp x pp): for every pipeline depth pp dividing N and each
  schedule, `choose_microbatches` cuts the profile of the replica's batch into stages (the
  partitioner's cost model, activations sent to the next stage over the link between them) and
  picks the number of micro-batches. The sends between stages are not overlapped with compute
  and, once the pipeline spans nodes, every hop is priced at the slower link between nodes
  (pessimistic: only the hops at node boundaries cross). Memory plans are uniform here: every block kept, or every
  block recomputed (its input held, its forward run again in backward), whichever is faster
  among those that fit. A hybrid all-reduces each pipeline rank's gradients over its dp group
  after the pipeline's step (not overlapped: the stage-0 rank's last backward ends the step).
- BatchNorm (dp, fsdp, and a hybrid's replicas): the trainer normalises over every replica's shard,
  so each BatchNorm layer's collectives (`collectives.batchnorm_sync_seconds`) lengthen its block's
  forward and backward: compute waits for them (`with_batchnorm_sync`); in a hybrid they are added
  per micro-batch, the model's whole spread evenly over the stages.
- Pipelines cut between the model's pipeline blocks (``estimate_layouts(pipeline_profile=...)``:
  `oomless.simulate` merges the profile's blocks into the model's `BlockSequence` blocks, where the
  trainer cuts), dp and fsdp plan and shard the profile's own blocks, as the trainer does.
- Optimizer step: bandwidth-bound, parameters and state read and written, gradients read, at the
  roofline's memory efficiency.
- Ranks sharing a CPU node's cores (`Cluster.contention`; GPUs never do): dp and fsdp ranks compute
  together throughout the step, so every block, the loss and the optimizer step run
  ``contention(ranks per node)`` times slower than the profile (one rank alone). A pipeline's ranks
  idle in its bubble and wait on receives, giving their cores to the others: its step is the longer
  of the schedule's at full speed and the average rank's compute for the step slowed by
  ``contention(ranks per node)`` (`shared_cores_seconds`: Graham's two bounds, work over processors
  and the critical path). Before 2026-11-28 the whole schedule was slowed by the contention of the
  ranks busy on average outside the bubble, which made the slowest stage as slow as the average and
  over-predicted 4 pipeline ranks on 2 cores by 1.2-1.5x. The sends, measured between ranks as they
  run, are not slowed. A hybrid's all-reduce and optimizer step after
  the pipeline run on every rank at once.

Assumptions: compute and communication overlap perfectly where streams allow (no slowdown of
kernels sharing SMs with NCCL); where the step is not traced at a layout's batch, linear scaling of
time and activations with the batch; the collectives' model in `plan.collectives` (two levels across nodes).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from oomless.errors import InputError, PlanError
from oomless.plan.cluster import Cluster
from oomless.plan.collectives import (all_gather_seconds, all_reduce_seconds, batchnorm_sync_seconds, consecutive_group,
                                      reduce_scatter_seconds)
from oomless.plan.devices import MEMORY_EFFICIENCY
from oomless.plan.microbatches import choose_microbatches, scale_profile
from oomless.plan.planner import _transient_bytes, make_plan, static_breakdown
from oomless.plan.schedules import SCHEDULES, SINGLE_STAGE_SCHEDULES, split_backward_terms
from oomless.profile.profile import Profile
from oomless.sizes import format_bytes

DDP_BUCKET_BYTES = 25 * 2**20      # torch DDP's default bucket_cap_mb
# Per micro-batch and stage, besides the send and receive latencies: the schedule's dispatch and
# kernel launches on a GPU (an assumption, not measured; the partitioner's own default is CPU's).
PIPELINE_ACTION_SECONDS = 20e-6


@dataclass
class Span:
    """One interval of the predicted step on a stream, for the timeline plot."""

    stream: str
    label: str
    start_seconds: float
    end_seconds: float


@dataclass
class LayoutEstimate:
    layout: str                      # "dp" | "fsdp" | "pipeline" | "hybrid"
    data_parallel: int
    pipeline_parallel: int
    schedule: str | None
    microbatches: int
    samples_per_replica: int         # per step, per data-parallel replica
    fits: bool
    step_seconds: float
    memory_per_rank_bytes: int       # predicted peak of the fullest rank; not fitting: the least that would fit
    static_bytes: int                # parameters, gradients, optimizer state, buffers, inputs on that rank
    memory_plan: str                 # the activation plan, in words
    communication_seconds: float     # on the links, per rank
    exposed_communication_seconds: float
    compute_seconds: float
    notes: list[str] = field(default_factory=list)
    decisions: dict[str, str] = field(default_factory=dict)   # dp, fsdp: the memory plan's, per block
    timeline: list[Span] = field(default_factory=list, repr=False)
    partition: object = field(default=None, repr=False)     # pipelines: the `Partition`, for the plot

    @property
    def name(self) -> str:
        if self.layout in ("dp", "fsdp"):
            return f"{self.layout} x{self.data_parallel}"
        shape = f"pp{self.pipeline_parallel}" if self.data_parallel == 1 else \
            f"dp{self.data_parallel} x pp{self.pipeline_parallel}"
        return f"{self.layout} {shape} {self.schedule}"


class _Stream:
    """A stream that runs its work in the order given, each piece once it is ready. ``shares``:
    another stream whose resources this one's work takes (collectives on the cores compute runs on,
    `Cluster.overlap` false): each piece waits for it and holds it up while it runs."""

    def __init__(self, name: str, spans: list[Span], shares: "_Stream | None" = None):
        self.name, self.spans, self.free, self.busy = name, spans, 0.0, 0.0
        self.shares = shares

    def run(self, ready: float, seconds: float, label: str) -> float:
        start = max(self.free, ready, self.shares.free if self.shares is not None else 0.0)
        self.free = start + seconds
        if self.shares is not None:
            self.shares.free = self.free
        self.busy += seconds
        if seconds > 0:
            self.spans.append(Span(self.name, label, start, self.free))
        return self.free


def with_batchnorm_sync(profile: Profile, cluster: Cluster, replicas: int) -> Profile:
    """``profile`` with each block's forward and backward lengthened by its BatchNorm layers'
    collectives over ``replicas`` data-parallel ranks (`collectives.batchnorm_sync_seconds`: compute
    waits for them), once per call of the block."""
    if replicas <= 1 or not any(block.batchnorm_channels for block in profile.blocks):
        return profile
    group = consecutive_group(cluster, replicas)
    blocks = []
    for block in profile.blocks:
        forward, backward = batchnorm_sync_seconds(cluster, group, block.batchnorm_channels)
        calls = max(block.calls, 1)
        blocks.append(replace(block, forward_seconds=block.forward_seconds + calls * forward,
                              backward_seconds=block.backward_seconds + calls * backward))
    return replace(profile, blocks=blocks)


def optimizer_seconds(cluster: Cluster, parameter_bytes: float, gradient_bytes: float, state_bytes: float) -> float:
    """An elementwise optimizer's step: parameters and state read and written, gradients read, while
    every rank of the node steps too."""
    moved = 2 * parameter_bytes + gradient_bytes + 2 * state_bytes
    return (moved / (cluster.device.memory_bytes_per_second * MEMORY_EFFICIENCY)
            * cluster.contention(cluster.gpus_per_node))


def slowed(profile: Profile, factor: float) -> Profile:
    """``profile`` with its blocks' and loss's seconds ``factor`` times longer (`Cluster.contention`)."""
    if factor == 1:
        return profile
    return replace(profile, loss_seconds=profile.loss_seconds * factor,
                   blocks=[replace(block, forward_seconds=block.forward_seconds * factor,
                                   backward_seconds=block.backward_seconds * factor) for block in profile.blocks])


def _memory_plan(profile: Profile, memory_bytes: int):
    """(plan, None) or (None, the least memory that would fit)."""
    try:
        return make_plan(profile, memory_bytes, solver="greedy"), None
    except PlanError as error:
        return None, error.minimum_bytes


def _describe_plan(plan) -> str:
    counts = {}
    for block in plan.blocks:
        counts[block.decision] = counts.get(block.decision, 0) + 1
    return ", ".join(f"{decision} {counts[decision]}" for decision in ("keep", "swap", "recompute")
                     if decision in counts)


def _block_seconds(profile: Profile, plan) -> tuple[list[float], list[float]]:
    """Each block's forward and backward seconds under ``plan`` (recompute runs the forward again
    in backward; the simulator's stalls for swapped tensors spread over the swapped blocks)."""
    forward = [block.forward_seconds for block in profile.blocks]
    backward = [block.backward_seconds for block in profile.blocks]
    if plan is None:
        return forward, backward
    decisions = [block.decision for block in plan.blocks]
    for i, decision in enumerate(decisions):
        if decision == "recompute":
            backward[i] += forward[i]
    stall = plan.predicted_step_seconds - sum(forward) - sum(backward) - profile.loss_seconds
    swapped = [i for i, decision in enumerate(decisions) if decision == "swap"]
    if stall > 0 and swapped:
        saved = sum(profile.blocks[i].saved_bytes for i in swapped) or len(swapped)
        for i in swapped:
            backward[i] += stall * (profile.blocks[i].saved_bytes or 1) / saved
    return forward, backward


def _block_shares(profile: Profile, total_bytes: float) -> list[float]:
    """``total_bytes`` (the gradients, the parameters) split over the blocks by their parameter bytes
    (blocks sharing a tied weight split it by their sizes)."""
    total = sum(block.parameter_bytes for block in profile.blocks)
    scale = total_bytes / total if total else 0.0
    return [block.parameter_bytes * scale for block in profile.blocks]


def _finish_step(name: str, ranks: int, samples_per_rank: int, plan, minimum: int, static: int,
                 compute: "_Stream", link: "_Stream", step_compute: float, update_seconds: float,
                 spans: list[Span], held: int = 0) -> LayoutEstimate:
    """The optimizer step once compute and communication are both done, and the estimate of a
    data-parallel layout (dp, fsdp) from its streams (``held``: `Profile.process_held_bytes`)."""
    end = max(compute.free, link.free)
    compute.free = end
    compute.run(end, update_seconds, "optimizer step")
    return LayoutEstimate(
        name, ranks, 1, None, 1, samples_per_rank, plan is not None, compute.free,
        (plan.predicted_peak_bytes if plan else minimum) + held, static,
        _describe_plan(plan) if plan else "no plan fits", link.busy, end - step_compute,
        step_compute + update_seconds, timeline=spans, decisions=plan.decisions if plan else {},
        notes=[] if plan else [f"the most frugal activation plan needs {format_bytes(minimum)}"])


def estimate_data_parallel(profile: Profile, cluster: Cluster, samples_per_rank: int) -> LayoutEstimate:
    """dp over every GPU: ``profile`` is one rank's step of ``samples_per_rank`` samples."""
    n, device = cluster.gpus, cluster.device
    # Every rank of the node computes at once (module docstring); BatchNorm's collectives then wait on them.
    profile = with_batchnorm_sync(slowed(profile, cluster.contention(cluster.gpus_per_node)), cluster, n)
    plan, minimum = _memory_plan(profile, device.memory_bytes)
    forward, backward = _block_seconds(profile, plan)
    gradients = _block_shares(profile, profile.gradient_bytes)
    group = consecutive_group(cluster, n)
    spans: list[Span] = []
    compute = _Stream("compute", spans)
    link = _Stream("communication", spans, shares=None if cluster.overlap else compute)
    for i, block in enumerate(profile.blocks):
        compute.run(0.0, forward[i], f"F {block.name}")
    compute.run(0.0, profile.loss_seconds, "loss")
    bucket, first = 0.0, None
    for i in range(len(profile.blocks) - 1, -1, -1):
        done = compute.run(0.0, backward[i], f"B {profile.blocks[i].name}")
        bucket += gradients[i]
        first = profile.blocks[i].name if first is None else first
        if bucket >= DDP_BUCKET_BYTES or i == 0:
            link.run(done, all_reduce_seconds(cluster, group, bucket), f"all-reduce {format_bytes(int(bucket))}")
            bucket, first = 0.0, None
    update = optimizer_seconds(cluster, profile.parameter_bytes, profile.gradient_bytes, profile.optimizer_state_bytes)
    return _finish_step("dp", n, samples_per_rank, plan, minimum, sum(static_breakdown(profile).values()),
                        compute, link, compute.busy, update, spans, profile.process_held_bytes)


def fsdp_static_profile(profile: Profile, ranks: int) -> Profile:
    """One fsdp rank's profile for the memory planner: parameters, gradients and optimizer state
    sharded over ``ranks``, plus two blocks' unsharded parameters and gradients (the largest)."""
    parameters = _block_shares(profile, profile.parameter_bytes)
    gradients = _block_shares(profile, profile.gradient_bytes)
    largest_parameters = 2 * math.ceil(max(parameters, default=0))
    largest_gradients = 2 * math.ceil(max(gradients, default=0))
    return replace(profile,
                   parameter_bytes=math.ceil(profile.parameter_bytes / ranks) + largest_parameters,
                   gradient_bytes=math.ceil(profile.gradient_bytes / ranks) + largest_gradients,
                   optimizer_state_bytes=math.ceil(profile.optimizer_state_bytes / ranks))


def estimate_fsdp(profile: Profile, cluster: Cluster, samples_per_rank: int) -> LayoutEstimate:
    """fsdp over every GPU: ``profile`` is one rank's step of ``samples_per_rank`` samples, unsharded."""
    n, device = cluster.gpus, cluster.device
    profile = with_batchnorm_sync(slowed(profile, cluster.contention(cluster.gpus_per_node)), cluster, n)
    sharded = fsdp_static_profile(profile, n)
    plan, minimum = _memory_plan(sharded, device.memory_bytes)
    forward, backward = _block_seconds(profile, plan)
    parameters = _block_shares(profile, profile.parameter_bytes)
    gradients = _block_shares(profile, profile.gradient_bytes)
    group = consecutive_group(cluster, n)
    spans: list[Span] = []
    compute = _Stream("compute", spans)
    link = _Stream("communication", spans, shares=None if cluster.overlap else compute)
    blocks = profile.blocks
    count = len(blocks)
    gathered = [0.0] * count

    # FSDP2's own work around each collective, at every world size: at one rank it skips the
    # collective but still copies in and out and runs its hooks (torch's `_fsdp_param_group`).
    host = cluster.fsdp_host_seconds

    def gather(i: int, ready: float, kind: str) -> None:
        if 0 <= i < count:
            gathered[i] = link.run(ready, all_gather_seconds(cluster, group, parameters[i]) + host,
                                   f"all-gather {kind} {blocks[i].name}") if parameters[i] else ready

    gather(0, 0.0, "F")
    for i in range(count):
        start = max(compute.free, gathered[i])
        gather(i + 1, start, "F")       # one block ahead
        compute.run(start, forward[i], f"F {blocks[i].name}")
    gather(count - 1, compute.free, "B")
    compute.run(0.0, profile.loss_seconds, "loss")
    for i in range(count - 1, -1, -1):
        start = max(compute.free, gathered[i])
        gather(i - 1, start, "B")
        done = compute.run(start, backward[i], f"B {blocks[i].name}")
        if gradients[i]:
            link.run(done, reduce_scatter_seconds(cluster, group, gradients[i]) + host,
                     f"reduce-scatter {blocks[i].name}")
    update = optimizer_seconds(cluster, profile.parameter_bytes / n, profile.gradient_bytes / n,
                               profile.optimizer_state_bytes / n)
    return _finish_step("fsdp", n, samples_per_rank, plan, minimum, sum(static_breakdown(sharded).values()),
                        compute, link, sum(forward) + sum(backward) + profile.loss_seconds, update, spans,
                        profile.process_held_bytes)


def recompute_profile(profile: Profile, share: float = 1.0) -> Profile:
    """The profile as if every block were recomputed, or ``share`` of them spread evenly (block i
    where floor((i + 1) x share) > floor(i x share): every other one at a half): a recomputed block
    holds its input between forward and backward, runs its forward again in backward, and holds
    its saved bytes during its backward."""
    blocks = []
    for index, block in enumerate(profile.blocks):
        if math.floor((index + 1) * share) == math.floor(index * share):
            blocks.append(block)
            continue
        working = 2 * block.output_bytes + 2 * block.largest_saved_bytes
        held_input = block.input_bytes // max(block.calls, 1)
        blocks.append(replace(block, saved_bytes=min(block.saved_bytes, held_input),
                              largest_saved_bytes=min(block.largest_saved_bytes, held_input), saved_sizes=[],
                              kept_when_swapped=[], saved_earlier=[],
                              backward_seconds=block.backward_seconds + block.forward_seconds,
                              forward_transient_bytes=working, backward_transient_bytes=working + block.saved_bytes,
                              # Measured for the block's whole saves, not the input it now holds.
                              forward_own_peak_bytes=None, backward_own_peak_bytes=None))
    return replace(profile, blocks=blocks)


def microbatch_candidates(samples: int, ranks: int) -> list[int]:
    """Micro-batch counts tried for a pipeline of ``ranks``: the smallest divisors of ``samples`` at
    or above ranks and 4 x ranks (two, so that deep models plan in seconds: more micro-batches
    shrink the bubble and, past the ranks, the bytes in flight, so the larger usually wins)."""
    divisors = [m for m in range(1, samples + 1) if samples % m == 0]
    picked = {next((m for m in divisors if m >= floor), None) for floor in (ranks, 4 * ranks)}
    picked.discard(None)
    return sorted(picked) or [samples]


def cut_may_fit(profile: Profile, pieces: int, limit_bytes: int) -> bool:
    """Whether ``profile``'s blocks cut into at most ``pieces`` contiguous pieces can each stay
    within ``limit_bytes`` counting, per piece, its parameters, gradients and optimizer state, one
    micro-batch of its saved activations and the largest working bytes of one of its blocks: less
    than the partitioner counts, so a cut it finds must pass this first. Filling pieces greedily
    answers exactly (the cost of a piece only grows with the blocks added)."""
    state_share = profile.optimizer_state_bytes / profile.gradient_bytes if profile.gradient_bytes else 0.0
    used, working, count = 0.0, 0, 1
    for block, parameters, gradients in zip(profile.blocks, _block_shares(profile, profile.parameter_bytes),
                                            _block_shares(profile, profile.gradient_bytes)):
        held = parameters + gradients * (1 + state_share) + block.saved_bytes
        block_working = _transient_bytes(block)
        if held + block_working > limit_bytes:
            return False
        if used + held + max(working, block_working) > limit_bytes:
            used, working, count = 0.0, 0, count + 1
        used, working = used + held, max(working, block_working)
    return count <= pieces


def at_batch(profile: Profile, profiled_batch: int,
             profile_at: Callable[[int], Profile] | None = None) -> Callable[[int], Profile]:
    """The step's profile at any batch of samples: ``profile`` at its own batch, else
    ``profile_at(samples)`` where given (`oomless.simulate` traces the step at that batch), else
    ``profile`` scaled linearly (`scale_profile`: what a smaller batch runs less efficiently, and
    working memory that does not grow with the batch, are missed)."""
    def at(samples: int) -> Profile:
        if samples == profiled_batch:
            return profile
        return profile_at(samples) if profile_at is not None else scale_profile(profile, samples / profiled_batch)
    return at


UNBOUNDED_BYTES = 1 << 62     # a memory limit no plan reaches: the cut that time alone would choose


def estimate_pipeline(profile: Profile, cluster: Cluster, global_batch: int, profiled_batch: int,
                      pipeline_ranks: int, schedule: str,
                      profile_at: Callable[[int], Profile] | None = None) -> LayoutEstimate | None:
    """A pipeline of ``pipeline_ranks`` stages (ranks) replicated over the rest of the GPUs; None
    when the model has too few blocks for the stages. ``profile_at(samples)``: the step's profile
    at another batch (each micro-batch's), default ``profile`` scaled linearly."""
    stages_per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
    if len(profile.blocks) < pipeline_ranks * stages_per_rank:
        return None
    at = at_batch(profile, profiled_batch, profile_at)
    replicas = cluster.gpus // pipeline_ranks
    samples = global_batch // replicas
    group = consecutive_group(cluster, replicas)
    across_nodes = replicas * pipeline_ranks > cluster.gpus_per_node
    bytes_per_second, latency = cluster.effective(cluster.inter_node if across_nodes else cluster.intra_node)
    overhead = 2 * latency + PIPELINE_ACTION_SECONDS
    if replicas > 1:
        # Each micro-batch's BatchNorm layers synchronise over the replicas of their stage: the
        # model's whole per micro-batch, spread evenly over the stages (the cut is not known yet).
        synced = sum(max(block.calls, 1) * sum(batchnorm_sync_seconds(cluster, group, block.batchnorm_channels))
                     for block in profile.blocks)
        overhead += synced / (pipeline_ranks * stages_per_rank)
    candidates = microbatch_candidates(samples, pipeline_ranks)
    if stages_per_rank > 1:
        # The partitioner's search for several stages per rank costs seconds on deep models: only
        # the most micro-batches, the fewest bytes in flight and the smallest bubble, is tried.
        candidates = candidates[-1:]
    layout = "pipeline" if replicas == 1 else "hybrid"
    static_share = math.ceil((profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_state_bytes)
                             / pipeline_ranks)
    # A rank holds whole stages; stages of a V-shaped or interleaved schedule are not neighbours,
    # so for those only each stage alone is checked.
    pieces = pipeline_ranks * (1 if schedule in SINGLE_STAGE_SCHEDULES else stages_per_rank)
    smallest = at(samples // max(candidates))

    def partitioned(make, memory_bytes: int = cluster.device.memory_bytes):
        """The fastest partition of ``make``'s micro-batch profiles that fits ``memory_bytes`` a rank,
        or the error why none does."""
        try:
            return choose_microbatches(None, pipeline_ranks, samples, memory_bytes, schedule,
                                       stages_per_rank, bytes_per_second, overhead, candidates,
                                       microbatch_profile=lambda m: make(at(samples // m)))
        except (PlanError, InputError) as error:    # InputError: no micro-batch count this schedule accepts
            return error

    parameters = _block_shares(profile, profile.parameter_bytes)
    gradients = _block_shares(profile, profile.gradient_bytes)
    index = {block.name: i for i, block in enumerate(profile.blocks)}
    state_share = profile.optimizer_state_bytes / profile.gradient_bytes if profile.gradient_bytes else 0.0

    def whole_step(plan_name: str, partition) -> LayoutEstimate:
        """The layout's estimate with ``partition``: its schedule's step, then the replicas'
        all-reduce of the fullest rank's gradients and the slowest rank's update."""
        rank_parameters, rank_gradients = [0.0] * pipeline_ranks, [0.0] * pipeline_ranks
        for names, rank in zip(partition.stage_blocks, partition.stage_ranks):
            rank_parameters[rank] += sum(parameters[index[name]] for name in names)
            rank_gradients[rank] += sum(gradients[index[name]] for name in names)
        reduce = all_reduce_seconds(cluster, group, max(rank_gradients))
        update = max(optimizer_seconds(cluster, p, g, g * state_share) for p, g in zip(rank_parameters, rank_gradients))
        pipeline_seconds = max(partition.predicted_step_seconds, shared_cores_seconds(partition, cluster))
        # Activations and their gradients crossing each cut, both ways, per micro-batch.
        sends = sum(2 * crossing / bytes_per_second for crossing in partition.crossing_bytes[1:]) * partition.microbatches
        return LayoutEstimate(
            layout, replicas, pipeline_ranks, schedule, partition.microbatches, samples, True,
            pipeline_seconds + reduce + update, max(partition.rank_bytes) + profile.process_held_bytes,
            max(2 * p + g * state_share for p, g in zip(rank_parameters, rank_gradients)), plan_name,
            sends / pipeline_ranks + reduce, reduce, pipeline_seconds * (1 - partition.bubble_fraction) + update,
            notes=[f"bubble {partition.bubble_fraction:.0%}"], partition=partition)

    def cut(adjust):
        """The estimate of the fastest plan some cut fits (or None), the least memory a cut would
        need, and what was tried; ``adjust``: applied to each micro-batch's profile. Every block kept
        where that fits with the cut and micro-batches it would have with no memory limit; else every
        block recomputed, and three quarters, half and a quarter of them (spread evenly over the
        model, `recompute_profile`), and every block kept where that fits at all: the one whose whole
        step (schedule, all-reduce and update) is fastest. Recomputing fewer blocks takes less time
        but holds more activations per micro-batch in flight; recomputing more may let the cut be even
        and the micro-batches many (a smaller bubble)."""
        best, least, tried = None, None, []

        def consider(plan_name, make) -> bool:
            """Partition ``make``'s profiles; keep the estimate if fastest. True if it fits."""
            nonlocal best, least
            partition = partitioned(make)
            if isinstance(partition, PlanError):
                least = partition.minimum_bytes if least is None else min(least, partition.minimum_bytes)
                tried.append(f"{plan_name}: no cut fits")
                return False
            if isinstance(partition, InputError):
                tried.append(f"{plan_name}: {partition}")
                return False
            estimate = whole_step(plan_name, partition)
            if best is None or estimate.step_seconds < best.step_seconds * (1 - 1e-9):
                best = estimate
            return True

        if not cut_may_fit(adjust(smallest), pieces, cluster.device.memory_bytes):
            tried.append(f"keep all: too big for {pipeline_ranks} ranks")
        elif consider("keep all", adjust):
            unbounded = partitioned(adjust, UNBOUNDED_BYTES)
            if isinstance(unbounded, Exception):
                return best, least, tried
            unbounded_seconds = whole_step("keep all", unbounded).step_seconds
            if best.step_seconds <= unbounded_seconds * (1 + 1e-9):
                return best, least, tried      # as fast as with no memory limit: recomputing only adds time
            # The memory bent the cuts (fewer blocks on the ranks holding the most micro-batches) or
            # kept the micro-batches few: a plan recomputing some blocks may cut evenly and run faster.
            tried.append(f"keep all: fits, {best.step_seconds * 1e3:.1f} ms a step ("
                         f"{unbounded_seconds * 1e3:.1f} ms with no memory limit)")
        make_all = lambda one: recompute_profile(adjust(one))
        if not cut_may_fit(make_all(smallest), pieces, cluster.device.memory_bytes):
            tried.append(f"recompute all: too big for {pipeline_ranks} ranks")
            return best, least, tried
        if not consider("recompute all", make_all):
            return best, least, tried      # fewer blocks recomputed hold more
        counts = set()
        for share in (0.75, 0.5, 0.25):
            recomputed = math.floor(len(profile.blocks) * share)
            make = lambda one, share=share: recompute_profile(adjust(one), share)
            if recomputed in counts or not 0 < recomputed < len(profile.blocks) \
                    or not cut_may_fit(make(smallest), pieces, cluster.device.memory_bytes):
                continue        # a few blocks: the same plan as a share tried, or none or all of them
            counts.add(recomputed)
            consider(f"keep {len(profile.blocks) - recomputed}, recompute {recomputed}", make)
        return best, least, tried

    best, least, tried = cut(lambda one: one)
    if best is None:
        compute = ((sum(b.forward_seconds + b.backward_seconds for b in smallest.blocks) + smallest.loss_seconds)
                   * max(candidates) * cluster.contention(cluster.gpus_per_node))
        return LayoutEstimate(layout, replicas, pipeline_ranks, schedule, 0, samples, False, compute / pipeline_ranks,
                              least or static_share, static_share, "no plan fits", 0.0, 0.0, compute / pipeline_ranks,
                              notes=[tried[-1] + (f" ({format_bytes(least)} per rank would fit)" if least else ""),
                                     *tried[:-1]])
    if tried:
        best.notes.append("; ".join(tried))
    return best


def shared_cores_seconds(partition, cluster: Cluster) -> float:
    """The least a pipeline's step can take when its node's ranks share cores: the average rank's
    compute for the step (its stages' seconds per micro-batch, the zero-bubble schedules' split
    backward counted, times the micro-batches) slowed by every rank of the node computing at once
    (`Cluster.contention`); 0 where ranks do not share (GPUs). The step is the longer of this and the
    schedule's own at full speed (Graham's bounds: the work over the processors, the critical path):
    a rank waiting in its bubble or on a receive gives its core to the others, so the slowest stage
    runs nearer full speed than the ranks' average contention would make it."""
    slowdown = cluster.contention(cluster.gpus_per_node)
    if slowdown <= 1:
        return 0.0
    work = [split_backward_terms(partition.schedule, seconds, partition.forward_fraction,
                                 partition.split_backward_ratio)[0] * partition.microbatches
            for seconds in partition.rank_seconds]
    return sum(work) / len(work) * slowdown


def check_global_batch(global_batch: int, gpus: int) -> None:
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise InputError(f"global batch must be a positive integer, got {global_batch!r}")
    if global_batch % gpus:
        below = global_batch - global_batch % gpus
        above = below + gpus
        nearest = " or ".join(str(b) for b in (below, above) if b > 0)
        raise InputError(f"a global batch of {global_batch} does not split evenly over {gpus} GPUs (each data-"
                         f"parallel rank steps an equal share); use a multiple of {gpus}: {nearest}")


def estimate_layouts(profile: Profile, profiled_batch: int, cluster: Cluster, global_batch: int,
                     pipeline_profile: Profile | None = None,
                     profile_at: Callable[[int], tuple[Profile, Profile | None]] | None = None) -> list[LayoutEstimate]:
    """Every layout's estimate (module docstring), dp and fsdp first, then pipelines by depth.
    ``pipeline_profile``: the same step with the blocks a pipeline cuts between
    (`plan.microbatches.merge_blocks`); default ``profile``'s own. ``profile_at(samples)``: both
    profiles of a step of another batch (each layout's per-rank batch, each micro-batch), traced
    at that batch; default: scaled linearly from ``profile``."""
    check_global_batch(global_batch, cluster.gpus)
    if profiled_batch < 1:
        raise InputError(f"the profiled batch must be at least 1 sample, got {profiled_batch}")
    samples_per_rank = global_batch // cluster.gpus

    def traced(pipeline: bool):
        def one(samples: int) -> Profile:
            blocks, pipeline_blocks = profile_at(samples)
            return pipeline_blocks if pipeline and pipeline_blocks is not None else blocks
        return None if profile_at is None else one

    per_rank = at_batch(profile, profiled_batch, traced(False))(samples_per_rank)
    estimates = [estimate_data_parallel(per_rank, cluster, samples_per_rank),
                 estimate_fsdp(per_rank, cluster, samples_per_rank)]
    pipelined, pipelined_at = pipeline_profile or profile, traced(True)
    for pipeline_ranks in (d for d in range(2, cluster.gpus + 1) if cluster.gpus % d == 0):
        for schedule in SCHEDULES:
            estimate = estimate_pipeline(pipelined, cluster, global_batch, profiled_batch, pipeline_ranks, schedule,
                                         pipelined_at)
            if estimate is not None:
                estimates.append(estimate)
    return estimates


# Predicted steps this close count as a tie: a prediction is not that exact.
RECOMMEND_TIE = 0.01


def all_ranks_bytes(estimate: LayoutEstimate) -> float:
    """The predicted peaks of every rank of a layout, summed: each pipeline rank's own (a 1F1B
    pipeline's later ranks hold fewer micro-batches than its first; GPipe's hold them all), times
    the replicas; a data-parallel layout's ranks are alike."""
    partition = estimate.partition
    if partition is None:
        return estimate.memory_per_rank_bytes * estimate.data_parallel
    held = estimate.memory_per_rank_bytes - max(partition.rank_bytes)      # `Profile.process_held_bytes`
    return (sum(partition.rank_bytes) + held * len(partition.rank_bytes)) * estimate.data_parallel


def recommend(estimates: list[LayoutEstimate]) -> LayoutEstimate | None:
    """The fastest predicted step among the layouts that fit; among those within `RECOMMEND_TIE` of
    it, the one with the least memory per rank (GPipe and 1F1B predict the same step, 1F1B holding
    fewer micro-batches), then the least over all ranks (`all_ranks_bytes`: with as many
    micro-batches as ranks, GPipe's and 1F1B's first ranks hold the same, 1F1B's later ranks less;
    ranks sharing a host share its memory); the first listed, on ties of all three."""
    fitting = [estimate for estimate in estimates if estimate.fits]
    if not fitting:
        return None
    fastest = min(estimate.step_seconds for estimate in fitting)
    close = [estimate for estimate in fitting if estimate.step_seconds <= fastest * (1 + RECOMMEND_TIE)]
    return min(close, key=lambda estimate: (estimate.memory_per_rank_bytes, all_ranks_bytes(estimate)))
