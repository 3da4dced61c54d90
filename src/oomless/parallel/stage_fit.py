"""Each pipeline stage with its own memory plan from the fit engine (issue 5: "each stage may carry
its own memory plan").

    pipeline = PipelineParallel(sequence, cuts, loss_fn, microbatches=8, schedule="1f1b", example=(tokens[:1],))
    plans = fit_stages(pipeline, memory="20GiB", target=next_tokens[:1])   # this rank's stages, planned and applied

A stage holds several micro-batches' saved activations at once (``in_flight_microbatches`` of its
schedule), while the fit engine plans one forward and backward. So each stage is planned for one
micro-batch with the activation share of the rank's memory divided by its in-flight count:

    share = (memory - held outside the stages) / stages on this rank
    plan memory = static + reserve + (share - static - reserve) / in flight

where "held outside the stages" is what the rank holds that no stage's plan counts (`held_outside_stages`:
the rest of the model, what profiling the cut left on rank 0, the device mesh, what the stages'
profiles left, the start-up of a first step, warmed up on a tiny schedule first, and the schedule's
receive buffers), read once every stage of the rank is profiled and before any is planned; the plan
memory is then lowered until the stage's peak, one micro-batch at its peak and each other at its
activations' peak, fits the share (the reserve is the worst phase's working memory, and the
activations may peak in another phase). The plan returned is the stage's, for its share: its budget
the share, its runtime budget (what the ledger enforces) the one micro-batch's activation budget
times the in-flight count, at most what the share leaves beside the static bytes, each phase's limit
raised by what the share adds to the one micro-batch's budget, and its peaks those of every
micro-batch in flight (`_for_the_share`).

Each stage is profiled on the real inputs it receives for the example micro-batch (earlier stages
run once without gradients, their buffers and the RNG put back after, so no statistic moves). The last stage is profiled
with the real loss on ``target``, the others with the sum of their outputs (the gradient's shape is
what matters). Replicas of a stage take replica 0's plan: a recomputed block re-runs BatchNorm's
all-reduce over the replicas in backward, so their plans must agree. They take its refusal too; a
stage refused on any rank is refused on every rank, by one `PlanError` that names each refused stage
and the memory per rank that fits them all (a stage's smallest plan budget m needs
``held + stages x`` the larger of ``static + reserve + (m - static - reserve) x in flight`` and the
stage's peak under m's plan, per rank).

Under the pipeline's precision (bf16 / fp16) each stage is profiled and planned at that precision,
on inputs computed under autocast (they arrive in their autocast dtype), so the plan counts the bytes
the stage saves. The plan is installed without its own precision hooks: the stage's autocast, fp32
output and loss scale are the pipeline's (`oomless.parallel.stage_precision`), which a plan's would
contradict (fp32 outputs at every stage, a loss scale at every boundary). With ``compile`` each
stage's blocks are profiled compiled and compiled in place with the plan (`oomless.runtime.compile`);
`compile_stages` compiles the same blocks where no stage is planned.
"""

import dataclasses

import torch
import torch.distributed as dist

import oomless
from oomless.parallel.pipeline import warm_up_schedule
from oomless.parallel.process_group import first_rank_outcome, from_shared, refusal_or, shareable
from oomless.parallel.stage_precision import stage_autocast
from oomless.plan.partition import in_flight_microbatches
from oomless.plan.planner import smallest_memory_for, with_margin
from oomless.plan.static import Placement
from oomless.profile import profiler
from oomless.profile.profiler import held_now
from oomless.profile.tensors import storage_bytes
from oomless.profile.selective import without_selective
from oomless.runtime.compile import check_compile_available, compile_blocks
from oomless.runtime.install import installed_state
from oomless.sizes import format_bytes, parse_bytes

UNLIMITED = 1 << 62      # bytes: a limit where the device's memory is not known (CPU)


def fit_stages(pipeline, memory, target: torch.Tensor | None = None, policy: str | None = None,
               optimizer_class=torch.optim.Adam, min_swap_bytes: int = 64 * 1024, compile: dict | None = None,
               counted_from: int | None = None) -> list:
    """Plan and apply the fit engine on every stage of ``pipeline`` on this rank, for ``memory``
    bytes per rank less what the rank holds above ``counted_from`` (a `MemoryProbe.current`
    reading, the trainer's memory mark; None: nothing held is counted) that no stage's plan counts
    (`held_outside_stages`, sets ``pipeline.held_bytes``), split evenly among its stages; ``policy`` ("keep", "swap" or "recompute")
    forces that decision on every block instead of searching. Returns the plans, in the order of
    ``pipeline.stage_indices``, at the pipeline's precision. ``optimizer_class`` sizes the optimizer
    state; ``min_swap_bytes`` is `oomless.plan`'s (a swap block keeps smaller saved storages);
    ``compile`` (torch.compile options, ``{}`` for the defaults) compiles each stage's blocks."""
    if compile is not None:
        check_compile_available(compile)
    per_rank = parse_bytes(memory)
    inputs_by_stage = _stage_inputs(pipeline)
    if counted_from is not None:
        # What the first training step starts up and keeps is held from then on: started here, so
        # that the reading below counts it (`warm_up_schedule`).
        warm_up_schedule(pipeline, optimizer_class)
    # Every stage of the rank is profiled before what the rank holds is read: what a profile leaves
    # resident beyond what its plan counts (its steps' code paths read in, kernels' caches: 1.5 MiB
    # on the first and 5.8 MiB on the last stage's rank of a 2-stage 16^3 U-Net on CPU) is held
    # by every training step, and read before the profiles it went uncounted.
    profiles = {}
    for module, stage in zip(pipeline.modules, pipeline.stage_indices):
        profiles[stage] = refusal_or(lambda: _replicas_agreeing(pipeline, lambda: _profile_stage(
            module, inputs_by_stage[stage], _stage_loss(pipeline, stage, target), optimizer_class,
            pipeline.precision, compile)))
    # The tensors alive now that a stage's plan counts (each stage's example inputs, the last stage's
    # target) are not held beside it; the schedule's buffers, made at the first step, are.
    counted = [*(tensor for inputs in inputs_by_stage.values() for tensor in inputs),
               *([target] if target is not None and pipeline.is_last else [])]
    held_bytes = pipeline.held_bytes = 0
    if counted_from is not None:
        # Replicas run replica 0's plans, which count what its profiles left in every phase
        # (`Profile.held_from_start_bytes`); a replica's own profiles may have left more (a fresh
        # process's first step: a hybrid 16^3 U-Net's second replica of stage 0 measured 3.2 MiB
        # over its predicted peak), held beside them.
        in_plans = _from_replica_zero(pipeline, sum(
            profile.held_from_start_bytes for profile in profiles.values()
            if not isinstance(profile, oomless.OomlessError)))
        pipeline.held_bytes = held_outside_stages(pipeline, counted_from, counted, in_plans) + \
            pipeline.kept_by_the_schedule_bytes()
        # And replica 0's plans must fit the replica that holds the most beside them.
        held_bytes = _most_on_any_replica(pipeline, pipeline.held_bytes)
    plans, refusals = [], []
    for module, stage in zip(pipeline.modules, pipeline.stage_indices):
        inputs, profile = inputs_by_stage[stage], profiles[stage]
        in_flight = in_flight_microbatches(pipeline.schedule_name, stage, pipeline.pipeline_ranks,
                                           pipeline.microbatches, pipeline.stages_per_rank)
        where = StageShare(stage, len(pipeline.modules), per_rank, held_bytes)
        # A refusal (or any oomless error) of one stage is kept, not raised: the other stages still
        # plan, so that their replicas' collectives pair up, and every rank raises it after.
        try:
            plan = _replica_zero_plan(pipeline, lambda: _plan_stage(
                module, inputs, _as_raised(profile), where, in_flight, policy, min_swap_bytes, pipeline.precision,
                compile))
            # Without the plan's precision hooks: the stage's are the pipeline's (module docstring).
            oomless.apply(module, dataclasses.replace(plan, precision="fp32"))
        except oomless.OomlessError as refusal:
            refusals.append(shareable(refusal))
            continue
        plans.append(plan)
    _refuse_on_every_rank(pipeline, refusals)
    return plans


def _stage_loss(pipeline, stage: int, target: torch.Tensor | None):
    """The loss a stage is profiled with: the pipeline's on ``target`` for the last, else the sum of
    its outputs (the gradient's shape is what matters)."""
    if stage < pipeline.num_stages - 1:
        return oomless.sum_of_outputs
    if target is None:
        raise oomless.InputError("the last stage's plan needs the example micro-batch's target")
    return _loss_on(pipeline.loss_fn, target.to(pipeline.device))


def _as_raised(outcome):
    """``outcome`` (`refusal_or`'s), its error raised."""
    if isinstance(outcome, oomless.OomlessError):
        raise outcome
    return outcome


@dataclasses.dataclass(frozen=True)
class StageShare:
    """Where a stage's plan budget comes from: ``stages`` stages on its rank share ``per_rank`` bytes
    less the ``held_bytes`` the rank holds outside their plans (`held_outside_stages`)."""

    stage: int
    stages: int
    per_rank: int
    held_bytes: int = 0

    @property
    def share_bytes(self) -> int:
        """The stage's bytes: at least 1, so that a rank whose held bytes fill its memory is refused
        by the planner, naming the smallest share (and so the memory per rank) that fits."""
        return max((self.per_rank - self.held_bytes) // self.stages, 1)


def held_outside_stages(pipeline, counted_from_bytes: int, counted=(), in_plans_bytes: int = 0) -> int:
    """What this rank holds above ``counted_from_bytes`` (a `MemoryProbe.current` reading: the
    trainer's memory mark) that its stages' plans do not count, read (`held_now`) after every stage
    of the rank is profiled and before any is planned. Every rank builds the whole
    model and keeps it (its stages' parameters and buffers are the plans' static bytes, taken off
    here); the device mesh's groups, the stages' shape inference (FakeTensorMode) and the warm-up of
    the schedule (`warm_up_schedule`) took memory after the mark; on rank 0, profiling the whole
    model for the cut left resident the code of every kernel it ran, read in, and their caches (~25
    MiB of file pages and 3 MiB anonymous for a 16^3 U-Net on CPU), which a stage's own profile then
    starts above and does not see; and each stage's profile leaves resident what its plan counts in
    part only (``in_plans_bytes``: the `Profile.held_from_start_bytes` its plans count in every phase,
    taken off).
    Every step holds it: a 2-stage pipeline of that U-Net planned within 64 MiB per rank measured
    39.4 MiB on rank 0 for a stage plan predicted at 5.8, and 10 MiB was accepted. ``counted``:
    tensors alive now that the plans count (each stage's example inputs, the last stage's target),
    taken off too; the rest of the example batch stays: a step holds its own."""
    own = storage_bytes([tensor for module in pipeline.modules for tensor in (*module.parameters(), *module.buffers())]
                        + list(counted))
    return max(held_now(pipeline.device) - counted_from_bytes - own - in_plans_bytes, 0)


def _refuse_on_every_rank(pipeline, refusals: list[dict]) -> None:
    """Raise on every rank of the pipeline what any stage's planning raised on any (`shareable`
    errors), after removing this rank's plans: an error other than a refusal as it was, else one
    `PlanError` with every refused stage's reason and the memory per rank that fits them all at this
    cut. Replicas of a stage agree already (`_replica_zero_plan`): the pipeline's own group sees each
    stage's once. Without this, the ranks whose stages fitted went on to their first step and failed
    there with "connection closed by peer"."""
    found = refusals
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(pipeline.group)
        dist.all_gather_object(gathered, refusals, group=pipeline.group)
        found = [refusal for rank_refusals in gathered for refusal in rank_refusals]
    if not found:
        return
    for module in pipeline.modules:
        if installed_state(module) is not None:
            oomless.remove(module)
    for other in (refusal for refusal in found if refusal["error"] != "PlanError"):
        from_shared(other)
    needed = [refusal["attributes"].get("minimum_bytes") for refusal in found]
    fits = None if None in needed else max(needed)
    advice = "" if fits is None else \
        f"; memory >= {format_bytes(fits)} per rank ({fits} bytes) fits every stage at this cut"
    raise oomless.PlanError("; ".join(refusal["message"] for refusal in found) + advice, minimum_bytes=fits)


def compile_stages(pipeline, options: dict) -> None:
    """Compile the blocks of every stage of ``pipeline`` on this rank in place, with torch.compile
    ``options``: the blocks a stage's plan compiles (`fit_stages` with ``compile``), for a pipeline
    whose stages run without plans. The stages' own hooks (their precision) stay eager around them."""
    for module in pipeline.modules:
        compile_blocks(module, options, pipeline.device)


def held_by_the_schedule(profile):
    """A stage's profile as torch's schedules run the stage: each micro-batch's stage output is kept
    from its forward until its backward is done (``_PipelineStageBase.fwd_cache``), where the
    profiling step, ``loss_fn(stage(x)).backward()``, let go before backward of what its loss does
    not save (`Profile.output_freed_bytes`; the sum of outputs saves nothing). Those bytes are then
    held in every backward phase too. Without this, a stage's plan counted them freed (its phases
    short by the stage's output) and the runtime warned that the training loop keeps the output."""
    freed = profile.output_freed_bytes
    if not freed:
        return profile

    def held(value):
        return None if value is None else value + freed

    blocks = [dataclasses.replace(block, backward_other_bytes=held(block.backward_other_bytes),
                                  backward_peak_bytes=held(block.backward_peak_bytes),
                                  backward_own_peak_bytes=held(block.backward_own_peak_bytes))
              for block in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks, output_freed_bytes=0)


def _loss_on(loss_fn, target: torch.Tensor):
    return lambda output: loss_fn(output, target)


def _profile_stage(module, inputs, loss_fn, optimizer_class, precision: str, compile: dict | None):
    """The stage's profile, as torch's schedules run it (`held_by_the_schedule`)."""
    # A stage may hold no parameters (the partitioner can cut a U-Net's pooling alone onto one):
    # then it has no optimizer state to count, and torch's optimizers refuse an empty list.
    trainable = [parameter for parameter in module.parameters() if parameter.requires_grad]
    optimizer = optimizer_class(trainable) if trainable else None
    # No selective recompute in a stage: a zero-bubble schedule replays a block twice (input, then
    # weight gradients), and torch's cache of kept outputs serves one replay.
    profile = without_selective(oomless.profile(module, inputs, loss_fn=loss_fn, optimizer=optimizer,
                                                **_configured(precision, compile)))
    # A stage's gradients accumulate over the micro-batches: they exist through every step but the first.
    return held_by_the_schedule(dataclasses.replace(profile, gradients_from_backward=False))


def _configured(precision: str, compile: dict | None) -> dict:
    return dict(precision=precision, compile=False if compile is None else compile)


def _plan_stage(module, inputs, profile, where: StageShare, in_flight: int, policy: str | None, min_swap_bytes: int,
                precision: str, compile: dict | None) -> oomless.Plan:
    """The stage's plan from its ``profile``; a refusal names the memory per rank (what the user gives) that fits."""
    configured = _configured(precision, compile)
    decisions = {block.name: policy for block in profile.blocks} if policy else None
    # The planner gets no optimizer: the profile counts its state, and stages step it after the
    # schedule, every micro-batch's gradient accumulated first (`PIPELINE_PLACEMENT`), when no
    # micro-batch's activations are held; planned with it, its step's temporaries would be a phase
    # of the one micro-batch's plan, and the in-flight count would multiply them in the share.
    roomy = oomless.plan(module, inputs, UNLIMITED, profile=profile, **configured)
    fixed = roomy.static_bytes + roomy.reserve_bytes
    share = where.share_bytes
    # A share short of the fixed bytes is refused as it is (planning for the fixed bytes would pass it).
    memory = fixed + (share - fixed) // in_flight if share > fixed else share

    def planned(budget: int) -> oomless.Plan:
        return oomless.plan(module, inputs, budget, profile=profile, decisions=decisions,
                            min_swap_bytes=min_swap_bytes, **configured)

    try:
        plan = planned(memory)
        if decisions is not None and plan.predicted_peak_bytes > memory:
            # `oomless.plan` keeps decisions it is given whatever they need (its notes say by how much):
            # here every rank would train on a share its stage's forced policy passes. Refused before any
            # step, in the terms the user sets, as a plan the planner chose would be.
            raise _forced_refusal(profile, decisions, policy, plan, min_swap_bytes)
        # The one micro-batch's budget leaves its static bytes and worst phase's working memory out
        # once, but its activations may peak in another phase, above what the others' share leaves
        # them: lower it until the stage's peak (`_for_the_share`) fits.
        attempts = 0
        while _stage_peak_bytes(plan, in_flight) > share:
            if decisions is not None:
                raise _forced_refusal(profile, decisions, policy, plan, min_swap_bytes)
            if attempts == STAGE_FIT_ATTEMPTS:
                # The smallest budget's plan holds the least; where even it does not fit, the refusal
                # names a share above this one (`_per_rank_refusal`), never one that was given.
                memory = _smallest_budget(planned)
                plan = planned(memory)
                if _stage_peak_bytes(plan, in_flight) > share:
                    raise oomless.PlanError(f"no plan for one micro-batch leaves room for {in_flight} in flight",
                                            minimum_bytes=memory)
                break
            # Each micro-batch in flight holds about as much less as its budget loses. From below the
            # plan's own peak: a budget above it gets the same plan back (a stage whose plan peaks
            # 9 MiB under its budget, 1.2 MiB over its share, was refused at 1 MiB a step).
            tried = memory
            memory = min(memory, plan.predicted_peak_bytes) - max(
                -(-(_stage_peak_bytes(plan, in_flight) - share) // in_flight), 2**20)
            try:
                plan = planned(memory)
            except oomless.PlanError as below_the_smallest:
                # Stepped past the one micro-batch's smallest budget: that budget is the last to try.
                if below_the_smallest.minimum_bytes is None or below_the_smallest.minimum_bytes >= tried:
                    raise
                memory = below_the_smallest.minimum_bytes
                plan = planned(memory)
            attempts += 1
    except oomless.PlanError as refusal:
        raise _per_rank_refusal(refusal, where, fixed, in_flight, memory, planned) from None
    return _for_the_share(plan, profile, share, in_flight)


PIPELINE_PLACEMENT = ("a pipeline stage steps its optimizer after the schedule's step, every micro-batch's "
                      "gradients accumulated first: update in backward, and optimizer state or parameters off "
                      "the device, are not offered")


def _for_the_share(plan: oomless.Plan, profile, share: int, in_flight: int) -> oomless.Plan:
    """The plan for one micro-batch, made the stage's: its budget the stage's ``share``; its runtime
    activation budget the one micro-batch's times ``in_flight``, at most what the share leaves
    beside the static bytes (times the in-flight count alone, the one micro-batch's slack over the
    working memory was counted that many times, and a plan for 64 MiB printed an activation budget
    of 64.46 MiB); its peaks with every in-flight micro-batch's activations held at once."""
    notes = [f"{Placement().describe()} ({PIPELINE_PLACEMENT})" if note.startswith(Placement().describe()) else note
             for note in plan.notes]
    if in_flight > 1:
        notes.append(f"planned for one micro-batch within {format_bytes(plan.memory_bytes)} of the stage's "
                     f"{format_bytes(share)}; {in_flight} micro-batches are in flight at once, so its budget, "
                     "activation budget and peaks here are the stage's, each in-flight micro-batch's "
                     "activations counted")
    more = in_flight - 1
    # Each phase's limit leaves the static bytes, the margin and the phase's working memory out of
    # the budget; the stage's ledger also holds the other in-flight micro-batches' activations, so
    # its limits leave the same out of the stage's share. Kept at the one micro-batch's, every save
    # of a second micro-batch found the first one's bytes over the limit and waited for every copy
    # still running (on CUDA a host synchronisation), and backward had no room to prefetch.
    extra = max(share - plan.memory_bytes, 0)

    def for_the_stage(limit: int | None) -> int | None:
        return None if limit is None else limit + extra
    blocks = [dataclasses.replace(block, forward_limit_bytes=for_the_stage(block.forward_limit_bytes),
                                  backward_limit_bytes=for_the_stage(block.backward_limit_bytes))
              for block in plan.blocks]
    return dataclasses.replace(
        plan, memory_bytes=share, notes=notes, blocks=blocks, loss_limit_bytes=for_the_stage(plan.loss_limit_bytes),
        activation_budget=min(plan.activation_budget * in_flight, max(share - plan.static_bytes, plan.activation_budget)),
        predicted_peak_bytes=plan.predicted_peak_bytes + more * plan.predicted_activation_peak_bytes,
        predicted_activation_peak_bytes=plan.predicted_activation_peak_bytes * in_flight,
        plain_peak_bytes=plan.plain_peak_bytes + more * profile.activation_bytes)


def _stage_peak_bytes(plan: oomless.Plan, in_flight: int) -> int:
    """The stage's predicted peak with ``in_flight`` micro-batches under ``plan`` (one micro-batch's),
    as `_for_the_share` counts it: one at its peak, each other at its activations' peak."""
    return plan.predicted_peak_bytes + (in_flight - 1) * plan.predicted_activation_peak_bytes


# Budgets for one micro-batch tried, each below the last plan's peak, before the smallest budget is.
STAGE_FIT_ATTEMPTS = 8


def _smallest_budget(planned) -> int:
    """The one micro-batch's smallest plan budget: what `oomless.plan`'s refusal of 1 byte names."""
    try:
        planned(1)
    except oomless.PlanError as refusal:
        if refusal.minimum_bytes is not None:
            return refusal.minimum_bytes
        raise
    raise oomless.PlanError("a stage plan fits 1 byte")   # no saved activations, no static bytes: not a stage


def _forced_refusal(profile, decisions: dict, policy: str, plan: oomless.Plan, min_swap_bytes: int):
    """A forced policy's refusal for one micro-batch: its smallest budget, with the margin the
    planner's own refusals carry (planning again profiles again, and a second profile of the same
    stage reads a little differently: 4.31 MiB against 4.28)."""
    needed = with_margin(smallest_memory_for(profile, decisions, min_swap_bytes=min_swap_bytes))
    return oomless.PlanError(f"every block {policy}: predicted at {format_bytes(plan.predicted_peak_bytes)}, its "
                             f"smallest budget {format_bytes(needed)}", minimum_bytes=needed)


def _per_rank_refusal(refusal, where: StageShare, fixed: int, in_flight: int, memory: int, planned):
    """A stage plan's refusal in the terms the user sets: memory per rank, rounded up to a whole MiB.
    The stage's plan budget is ``fixed + (share - fixed) / in_flight``, lowered until the stage's peak
    fits its share; so the one micro-batch's smallest budget m needs a share of at least ``fixed +
    (m - fixed) x in_flight`` and at least the stage's peak under m's plan (``planned(m)``), and the
    rank ``held + stages x`` that."""
    needed = None
    if refusal.minimum_bytes is not None:
        m = refusal.minimum_bytes
        try:
            at_smallest = _stage_peak_bytes(planned(m), in_flight)
        except oomless.OomlessError:
            at_smallest = 0
        exact = where.held_bytes + where.stages * max(fixed + max(m - fixed, 0) * in_flight, at_smallest)
        needed = -(-exact // 2**20) * 2**20
    in_terms = "" if needed is None else f"; it needs memory >= {format_bytes(needed)} ({needed} bytes) per rank"
    held = f", {format_bytes(where.held_bytes)} held by the rank outside its stages' plans" if where.held_bytes else ""
    return oomless.PlanError(
        f"stage {where.stage}: no plan fits its share of {format_bytes(where.per_rank)} per rank ({where.stages} "
        f"stage(s) on the rank{held}, {in_flight} micro-batch(es) in flight){in_terms}. Its plan for one micro-batch, "
        f"within {format_bytes(memory)} of the share, said: {refusal}",
        minimum_bytes=needed, limiting_block=refusal.limiting_block, floor_block=refusal.floor_block)


def _replicas_agreeing(pipeline, make_profile):
    """``make_profile()`` with the profiler's choices agreed across the stage's replicas: profiling
    runs BatchNorm's all-reduce over them, so every replica must run as many profiling steps."""
    group = pipeline.dp_group
    if group is None or dist.get_world_size(group) == 1:
        return make_profile()
    previous = profiler.agree_across_replicas
    profiler.agree_across_replicas = lambda choice: _any_replica(choice, group, pipeline.device)
    try:
        return make_profile()
    finally:
        profiler.agree_across_replicas = previous


def _replica_zero_plan(pipeline, make_plan):
    """Every replica plans, then all take replica 0's plan, or its refusal: a refusal on another
    replica alone is not theirs (its profile read a little more memory; replica 0's plan is the one
    every replica runs)."""
    group = pipeline.dp_group
    if group is None or dist.get_world_size(group) == 1:
        return make_plan()
    return oomless.Plan.from_json(first_rank_outcome(refusal_or(lambda: make_plan().to_json()), group))


def _from_replica_zero(pipeline, value: int) -> int:
    """Replica 0's ``value`` (an int) on every replica of this rank's stages."""
    group = pipeline.dp_group
    if group is None or dist.get_world_size(group) == 1:
        return value
    carried = torch.tensor([value], dtype=torch.int64, device=pipeline.device)
    dist.broadcast(carried, src=dist.get_global_rank(group, 0), group=group)
    return int(carried.item())


def _most_on_any_replica(pipeline, value: int) -> int:
    """The largest ``value`` (an int) of the replicas of this rank's stages, on every one of them."""
    group = pipeline.dp_group
    if group is None or dist.get_world_size(group) == 1:
        return value
    carried = torch.tensor([value], dtype=torch.int64, device=pipeline.device)
    dist.all_reduce(carried, op=dist.ReduceOp.MAX, group=group)
    return int(carried.item())


def _any_replica(choice: bool, group, device: torch.device) -> bool:
    flag = torch.tensor([int(choice)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


@torch.no_grad()
def _stage_inputs(pipeline) -> dict[int, tuple[torch.Tensor, ...]]:
    """{stage: the real inputs it receives for the example micro-batch}, for this rank's stages.
    Earlier stages run here, without gradients, in the mode they train in (a traced sequence runs
    in no other); every buffer is put back after and the RNG state too, so no BatchNorm statistic
    moves and dropout draws nothing. Under the pipeline's autocast, as they train: a stage receives
    its inputs in their autocast dtype. Replicas run the same stages: BatchNorm's all-reduces over
    them match."""
    sequence, cuts = pipeline.sequence, pipeline.cuts
    buffers = [(buffer, buffer.clone()) for buffer in sequence.buffers()]
    devices = [pipeline.device] if pipeline.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            values, found = pipeline.example, {}
            for stage, (start, stop) in enumerate(zip(cuts, cuts[1:])):
                if stage in pipeline.stage_indices:
                    found[stage] = tuple(_as_received(tensor, stage, pipeline.device) for tensor in values)
                if stage == max(pipeline.stage_indices):
                    break
                module = sequence.stage(start, stop)
                device = next((p.device for p in module.parameters()), values[0].device)
                with stage_autocast(device.type, pipeline.autocast_dtype):
                    produced = module(*(tensor.to(device) for tensor in values))
                values = produced if isinstance(produced, tuple) else (produced,)
    finally:
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return found


def _as_received(tensor: torch.Tensor, stage: int, device: torch.device) -> torch.Tensor:
    """What a stage gets: on its device, and, past the first stage, a floating-point activation
    that wants a gradient (the stage sends it back)."""
    tensor = tensor.detach().to(device)
    return tensor.requires_grad_(stage > 0 and tensor.is_floating_point())
