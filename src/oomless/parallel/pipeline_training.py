"""The training loop's strategy for the pipeline and hybrid layouts (issue 5).

    torchrun --nproc-per-node 4 -m oomless train --parallel hybrid --stages 2 --global-batch 8

The world is a ("pp", "dp") mesh: ``stages`` pipeline ranks per replica, world / stages replicas.
Rank 0 profiles the model as its `BlockSequence` on one replica's batch and cuts it with the
partitioner (`oomless.plan.partition`), choosing the number of micro-batches too unless the config
fixes it; every rank takes that cut. Each replica runs its shard of the global batch through the
pipeline; gradients are averaged over replicas.

What equals the one-process run: across replicas, BatchNorm statistics and the soft Dice's sums are
taken over every replica's micro-batch (as under ``dp``); across micro-batches they are not: each
micro-batch is normalised by its own statistics (GPipe's choice). So with one micro-batch the
layout trains the same model as one process with the global batch; with M micro-batches, the same as
one process accumulating gradients over M chunks.

Every process holds the whole model (built from the same seed) and one optimizer over all of it;
parameters outside this rank's stages get no gradient, so the optimizer skips them. Before a
checkpoint, ``--save`` or a layout switch, `synchronize` broadcasts every parameter, buffer and
optimizer state from the rank that trains it, so every rank then holds the whole current state and
the ordinary checkpoint code applies.

Precision and compile: the loop applies ``--precision``'s hooks to the whole model
(`oomless.runtime.precision.apply_precision`), which here own the fp16 loss scaler (unscaling each
parameter's gradient, skipping overflowed steps, the scale in checkpoints and across layout
switches); the model's own forward never runs. The stages run under autocast with the crossing
tensors in their autocast dtype and the last stage's output in fp32 (`stage_precision`), so the
layout trains what one process trains under ``--precision`` with the same global batch. The cut's
profile and the stages' plans are measured at that precision (bf16 bytes, not fp32's). ``--compile``
compiles each stage's blocks in place (with its plan when ``--memory`` gives one, profiled compiled);
the cut's profile, on rank 0 only, runs eager: compiling every block there would be a second
compilation of the whole model for an estimate of time and bytes per block.
"""

import io
import json
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from oomless.errors import InputError, PlanError
from oomless.sizes import format_bytes
from oomless.parallel.batchnorm import convert_batchnorm_for_data_parallel
from oomless.parallel.block_sequence import BlockSequence, sequence_for
from oomless.parallel.config import ParallelConfig
from oomless.parallel.data_parallel import Collectives
from oomless.parallel.pipeline import PipelineParallel, cuts_from_stage_blocks, pipeline_mesh
from oomless.parallel.process_group import Ranks, first_rank_outcome, local_batch_size, refusal_or, sum_across_ranks
from oomless.parallel.stage_fit import UNLIMITED, compile_stages, fit_stages
from oomless.parallel.traced import TracedSequence
from oomless.plan.microbatches import choose_microbatches
from oomless.plan.partition import Partition, partition_stages
from oomless.runtime.precision import precision_state
from oomless.train.losses import hard_dice, segmentation_loss


def warm_up_rank_reports() -> None:
    """Gather an object from every rank and render a table, thrown away: the code of the per-rank
    reports (`PipelineTraining.describe_rank_plans`, ``all_gather_object``) and of the printed cut
    and plans (rich) starts up once in a process and stays. The trainer calls this before its memory
    mark: started after it, the reports between the plans and the first step left 0.6-0.7 MiB held
    on each rank of a 2-stage 16^3 U-Net on CPU that no plan counted (every rank renders what it
    prints, quiet or not), and the cut's broadcast ~1.3 MiB on rank 0 that its held bytes counted
    (library start-up in the budget). Every rank calls it together."""
    from rich.console import Console
    from rich.table import Table

    if dist.is_initialized():
        dist.all_gather_object([None] * dist.get_world_size(), (0, 0))
    table = Table(title="warm-up")
    table.add_column("rank")
    table.add_row("0")
    Console(file=io.StringIO(), width=120).print(table, soft_wrap=True)


class PipelineTraining(Collectives):
    """``--parallel pipeline|hybrid``: one replica's pipeline stages on this rank."""

    def __init__(self, config: ParallelConfig, ranks: Ranks, device: torch.device):
        super().__init__(config, ranks, device)
        with self.collective("device mesh (pipeline x data) creation"):
            self.mesh = pipeline_mesh(config.stages, device.type)
        self.replica, self.replicas = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        self.pipeline: PipelineParallel | None = None
        self.partition: Partition | None = None
        self.optimizer = None
        self.memory = None
        self.precision = "fp32"
        self.plans: list = []

    def shard(self, step: int, global_batch: int) -> tuple[int, int]:
        """(first item, count) of this rank's replica's part of step ``step``'s global batch."""
        count = local_batch_size(global_batch, self.replicas)
        return step * global_batch + self.replica * count, count

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None,
                example=None, memory=None, compile: dict | None = None,
                counted_from: int | None = None) -> nn.Module:
        """Cut the model, build this rank's stages at the precision applied to ``model`` (fp32 when
        none is); with ``memory`` (bytes per rank) each stage also gets its own plan from the fit
        engine (`oomless.parallel.stage_fit`), within what the rank does not hold already above
        ``counted_from`` (a `MemoryProbe.current` reading: the trainer's mark; None: nothing held
        is counted); ``compile`` (torch.compile options) compiles each stage's blocks."""
        self.max_grad_norm, self.optimizer, self.memory = max_grad_norm, optimizer, memory
        applied = precision_state(model)
        self.precision = "fp32" if applied is None else applied.precision
        scaler = None if applied is None else applied.scaler
        dp_group = self.mesh["dp"].get_group()
        # Written by hand for the project's models, else traced (every rank traces: same blocks).
        sequence = sequence_for(model, None if example is None else example[0])
        # Cut before BatchNorm turns collective: only rank 0 profiles, its replicas would not join.
        self.partition = self._cut(sequence, example)
        self.partition.notes.append(f"the model's blocks: {sequence.origin} "
                                    f"({len(sequence.blocks)} blocks to cut between)")
        if self.replicas > 1:
            convert_batchnorm_for_data_parallel(model, self.device, dp_group)
            # After the swap a block may be a BatchNorm itself (or, traced, call one): built again.
            sequence = sequence.rebuilt() if isinstance(sequence, TracedSequence) else sequence_for(model)
        sum_across = partial(sum_across_ranks, group=dp_group) if self.replicas > 1 else None
        cuts = cuts_from_stage_blocks(sequence, self.partition.stage_blocks)
        self.pipeline = PipelineParallel(
            sequence, cuts, lambda logits, labels: segmentation_loss(logits, labels, sum_across),
            self.partition.microbatches, self.partition.schedule, self.device,
            group=self.mesh["pp"].get_group(), dp_group=dp_group,
            example=(example[0].chunk(self.partition.microbatches)[0],), precision=self.precision, scaler=scaler)
        if memory is not None:
            labels = example[1].chunk(self.partition.microbatches)[0]
            with self.collective("per-stage plans (profiling with replica BatchNorm, plan broadcast)"):
                self.plans = fit_stages(self.pipeline, memory, target=labels, optimizer_class=type(optimizer),
                                        compile=compile, counted_from=counted_from)
        elif compile is not None:
            compile_stages(self.pipeline, compile)
        return model

    def planned_peak_bytes(self) -> int:
        """This rank's predicted peak: what it holds outside its stages' plans and each stage's
        predicted peak (every micro-batch in flight counted; stages of one rank as if at their peaks
        together)."""
        return self.pipeline.held_bytes + sum(plan.predicted_peak_bytes for plan in self.plans)

    def describe_rank_plans(self) -> str:
        """Every rank's planned peak within the memory per rank, for rank 0 to print (every rank calls it)."""
        planned = self._every_rank((self.planned_peak_bytes(), self.pipeline.held_bytes))
        return ("planned per rank (stage plans, and what the rank holds outside them: the rest of the model, "
                "start-up, the schedule's buffers, on rank 0 the cut's profiling): " + ", ".join(
                    f"{rank}: {format_bytes(peak)} (held {format_bytes(held)})" for rank, (peak, held) in enumerate(planned))
                + f" of {format_bytes(self.memory)}")

    def describe_predicted_vs_measured(self, measured_bytes: int) -> str:
        """Every rank's predicted and measured peak (``measured_bytes``: this rank's steps' peak
        above the trainer's mark), for rank 0 to print (every rank calls it)."""
        both = self._every_rank((self.planned_peak_bytes(), measured_bytes))
        return ("predicted vs measured: peak per rank " + ", ".join(
            f"{rank}: {format_bytes(predicted)} vs {format_bytes(measured)}" for rank, (predicted, measured)
            in enumerate(both)) + f" (budget {format_bytes(self.memory)} per rank)")

    def _every_rank(self, value) -> list:
        gathered = [None] * self.ranks.world_size
        with self.collective("per-rank memory report gather"):
            dist.all_gather_object(gathered, value)
        return gathered

    def _cut(self, sequence: BlockSequence, example) -> Partition:
        """Rank 0 profiles and partitions; every rank takes its answer (timings differ per rank)."""
        outcome = refusal_or(lambda: self._partition(sequence, example).to_json()) if self.ranks.is_first else None
        with self.collective("pipeline partition broadcast from rank 0"):
            return Partition.from_json(first_rank_outcome(outcome))

    def _partition(self, sequence: BlockSequence, example) -> Partition:
        import oomless

        if example is None:
            raise InputError("the pipeline layout needs an example batch to profile the model for its cut")
        volumes, labels = example
        batch, microbatches = volumes.shape[0], self.config.microbatches
        if microbatches is not None:
            if batch % microbatches:
                raise InputError(f"{batch} volumes per replica do not split into {microbatches} "
                                 "equal micro-batches; choose a divisor")
            # One micro-batch is what each stage runs: profiled at its size, no scaling, and this
            # process keeps no kernel workspaces for the whole batch's shapes (oneDNN holds ~20 MiB
            # for a 16^3 U-Net at 32 volumes on CPU) that no stage ever runs.
            volumes, labels = volumes[:batch // microbatches], labels[:batch // microbatches]
        profile = oomless.profile(sequence, volumes, blocks=[f"steps.{block.name}" for block in sequence.blocks],
                                  loss_fn=lambda logits: segmentation_loss(logits, labels),
                                  optimizer=self.optimizer, precision=self.precision)
        for block in profile.blocks:
            block.name = block.name.removeprefix("steps.")
        try:
            return self._partition_profile(profile, batch, self._memory_per_rank())
        except PlanError as error:
            if self.memory is None:
                raise
            # The partitioner counts every activation kept; the stages' own plans can swap and
            # recompute, so cut for speed alone and let each stage's plan meet the budget.
            partition = self._partition_profile(profile, batch, UNLIMITED)
            partition.notes.append(f"no cut fits {format_bytes(self.memory)} per rank with every activation kept "
                                   f"({error.minimum_bytes} bytes needed): cut for speed, each stage's fit plan "
                                   "swaps or recomputes to meet the budget")
            return partition

    def _partition_profile(self, profile, batch: int, memory: int) -> Partition:
        """The cut of ``profile``: of the whole replica batch of ``batch`` volumes when the number
        of micro-batches is left to choose, else of one micro-batch."""
        config = self.config
        if config.microbatches is None:
            return choose_microbatches(profile, config.stages, batch, memory, config.schedule,
                                       config.resolved_stages_per_rank)
        # With fewer micro-batches than stages 1F1B never reaches its steady state: it is GPipe,
        # which torch's Schedule1F1B refuses to run for it.
        schedule = "gpipe" if config.schedule == "1f1b" and config.microbatches < config.stages else config.schedule
        partition = partition_stages(profile, config.stages, memory,
                                     config.microbatches, schedule, stages_per_rank=config.resolved_stages_per_rank)
        if schedule != config.schedule:
            partition.notes.append(f"1f1b with {config.microbatches} micro-batch(es) on {config.stages} stages "
                                   "runs as gpipe (the same order of work)")
        return partition

    def _memory_per_rank(self) -> int:
        if self.memory is not None:
            return self.memory
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return UNLIMITED

    def train_step(self, train_model: nn.Module, volumes: torch.Tensor, labels: torch.Tensor):
        """(loss, dice) of this replica's batch on the last stage's rank; zeros elsewhere."""
        with self.collective("pipeline step (stage sends, receives, replica all-reduces)"):
            losses = self.pipeline.step(volumes, target=labels)
        if not self.pipeline.is_last:
            zero = torch.zeros((), device=self.device)
            return zero, zero
        return torch.stack(losses).mean().detach(), hard_dice(self.pipeline.output.detach(), labels)

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over replicas of a value that only last-stage ranks hold (zeros elsewhere)."""
        total = value.detach().clone()
        with self.collective("metric all-reduce"):
            dist.all_reduce(total)
        return total / self.replicas

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step_index: int) -> None:
        if self.max_grad_norm is not None:
            with self.collective("gradient norm all-reduce over the pipeline"):
                self.pipeline.clip_grad_norm_(self.max_grad_norm)
        optimizer.step()            # parameters of other ranks' stages have no gradient: skipped
        optimizer.zero_grad(set_to_none=True)

    def synchronize(self, model: nn.Module) -> None:
        """Every rank receives every parameter, buffer and optimizer state from the rank that trains it."""
        with self.collective("pipeline state broadcast from each stage's owner"):
            _broadcast_from_owners(model, self.optimizer, self._owner_ranks(), self.device)

    def _owner_ranks(self) -> dict[int, int]:
        """{id(tensor): global rank of replica 0 of the pipeline rank that owns it}."""
        by_stage_rank = self.mesh.mesh[:, 0].tolist()
        return {key: by_stage_rank[rank] for key, rank in self.pipeline.owners.items()}


@torch.no_grad()
def _broadcast_from_owners(model: nn.Module, optimizer, owners: dict[int, int], device: torch.device) -> None:
    tensors = [*model.parameters(), *model.buffers()]
    for tensor in tensors:
        _broadcast(tensor, owners.get(id(tensor), 0), device)
    if optimizer is None:
        return
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for owner in sorted(set(owners.values())):
        # The owner says which states it has (names, shapes, dtypes) before sending the tensors.
        described = [_describe_states(optimizer, parameters, owners, owner) if dist.get_rank() == owner else None]
        dist.broadcast_object_list(described, src=owner)
        for index, entries in json.loads(described[0]).items():
            parameter = parameters[int(index)]
            state = optimizer.state[parameter]
            for key, (shape, dtype, where) in entries.items():
                received = state[key] if dist.get_rank() == owner else torch.empty(
                    shape, dtype=getattr(torch, dtype), device=where)
                _broadcast(received, owner, device)
                state[key] = received


def _describe_states(optimizer, parameters: list, owners: dict[int, int], owner: int) -> str:
    described = {}
    for index, parameter in enumerate(parameters):
        if owners.get(id(parameter), 0) != owner or parameter not in optimizer.state:
            continue
        described[index] = {key: (list(value.shape), str(value.dtype).removeprefix("torch."), str(value.device))
                            for key, value in optimizer.state[parameter].items() if torch.is_tensor(value)}
    return json.dumps(described)


def _broadcast(tensor: torch.Tensor, source: int, device: torch.device) -> None:
    """Broadcast in place; a tensor off the communication device (Adam's CPU step count under NCCL)
    travels through a copy on it."""
    if tensor.device == device or device.type == "cpu":
        dist.broadcast(tensor, src=source)
        return
    carried = tensor.to(device)
    dist.broadcast(carried, src=source)
    tensor.copy_(carried)
