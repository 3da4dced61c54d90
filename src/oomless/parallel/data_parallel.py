"""How the training loop runs on one process or many: the `Replication` strategies.

The loop asks its strategy for the module to call, the loss reduction, and what to do after backward;
the strategy owns every collective. `SingleProcess` is plain PyTorch. `SynchronousDataParallel` is
torch DDP (bucketed all-reduce hidden behind backward) plus, by default, the overlapped update of
`oomless.parallel.overlap`. The relaxed strategies live in `oomless.parallel.relaxed`.

Equal to the one-process run: each rank takes its equal shard of the global batch (`shard_start`);
DDP averages gradients, which is the gradient of the global mean when shards are equal; BatchNorm is
converted to global-batch statistics (`convert_batchnorm_for_data_parallel`); and loss terms that are
not means over samples (the soft Dice's sums) are summed across ranks before the ratio is taken.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from oomless.errors import InputError
from oomless.parallel.batchnorm import convert_batchnorm_for_data_parallel
from oomless.parallel.config import ParallelConfig
from oomless.parallel.overlap import OverlappedUpdate, apply_overlapped_update, needs_global_view
from oomless.runtime.precision import precision_state
from oomless.parallel.process_group import Ranks, local_batch_size, named_collective, shard_start, sum_across_ranks


class SingleProcess:
    """One process, no collectives: the reference every other strategy is compared to."""

    relaxed = False
    shards_parameters = False       # True under fsdp: the model's parameters are each rank's shard

    def __init__(self, config: ParallelConfig, ranks: Ranks, device: torch.device):
        self.config, self.ranks, self.device = config, ranks, device
        self.max_grad_norm: float | None = None

    def convert_modules(self, model: nn.Module) -> None:
        """Replace in place the modules this layout runs in another form (BatchNorm with global-batch
        statistics under dp and fsdp), keeping parameter names. The loop calls it before it plans the
        model, so the plan is made for the modules that will run; `prepare` calls it too (a second
        call changes nothing)."""

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None,
                example=None, memory=None) -> nn.Module:
        """Return the module the loop calls; ``model`` keeps its parameter names (checkpoints use it).
        ``example``: this rank's first (volumes, labels), and ``memory``: the device budget per
        rank, for strategies that plan the model themselves (the pipeline's per-stage plans)."""
        self.max_grad_norm = max_grad_norm
        return model

    def shard(self, step: int, global_batch: int) -> tuple[int, int]:
        """(first item, count) of this rank's part of step ``step``'s global batch."""
        return shard_start(step, global_batch, self.ranks), local_batch_size(global_batch, self.ranks.world_size)

    def train_step(self, train_model: nn.Module, volumes: torch.Tensor, labels: torch.Tensor):
        """Forward, loss and backward of this rank's batch: (loss, hard Dice), both 0-d tensors."""
        from oomless.train.losses import hard_dice, segmentation_loss     # oomless.train imports this package

        logits = train_model(volumes)
        loss = segmentation_loss(logits, labels, sum_across=self.sum_across_ranks())
        # Taken before backward, and the logits dropped: the plan counts what the loss does not save
        # of them freed by then (`Plan.output_freed_bytes`).
        dice = hard_dice(logits.detach(), labels)
        del logits
        self.backward(loss)
        return loss, dice

    def sum_across_ranks(self):
        """A differentiable cross-rank sum for loss terms that are not per-sample means, or None."""
        return None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step_index: int) -> None:
        """Everything after backward for 0-based ``step_index``: clip, step, zero, average."""
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize(self, model: nn.Module) -> None:
        """Finish anything in flight so model and optimizer can be read (checkpoint, save)."""

    def finish(self, model: nn.Module, optimizer=None) -> None:
        """End of the run or of its layout: after this every rank holds the same final weights (and
        the same ``optimizer`` state)."""
        self.synchronize(model)

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
        """(model state, optimizer state) with full tensors, as one process holds them, for checkpoints,
        ``--save`` and validation; read on rank 0. Every rank calls it (a collective where sharded)."""
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
                        optimizer_state: dict | None) -> None:
        """Load a full state (`full_state`'s, or a checkpoint's) into this layout's model and optimizer."""
        model.load_state_dict(model_state)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)

    def collective(self, name: str):
        return named_collective(name, self.config.timeout_seconds)

    def barrier(self) -> None:
        pass


class Collectives(SingleProcess):
    """Shared by every multi-process strategy: logging means, barriers, named failures."""

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        if self.ranks.world_size == 1:
            return value
        total = value.detach().clone()
        with self.collective("metric all-reduce"):
            dist.all_reduce(total)
        return total / self.ranks.world_size

    def barrier(self) -> None:
        with self.collective("barrier"):
            dist.barrier()


def check_replicated_plan(plan, world_size: int) -> None:
    """Refuse a plan that cannot run on replicas: one that updates in backward (each rank would step
    its own gradient before the all-reduce: the replicas drifted 0.09 apart in 3 steps), or one
    made for sharded parameters (it counted 1/shard_over of them; dp holds them all)."""
    from oomless.plan.static import UNDER_DATA_PARALLEL

    if world_size > 1 and plan.update_in_backward:
        raise InputError(f"this plan updates the parameters in backward, which cannot run on replicas: "
                         f"{UNDER_DATA_PARALLEL}. Plan inside the process group (oomless.plan there refuses it) or "
                         "with update_in_backward=False")
    if plan.shard_over != 1:
        raise InputError(f"this plan was made for parameters sharded over {plan.shard_over} ranks (fsdp); data "
                         "parallel holds them whole on every rank: plan with shard_over=1, or run it under fsdp")


class SynchronousDataParallel(Collectives):
    """torch DDP with global-batch BatchNorm and loss sums; with ``config.overlap`` the per-bucket update
    (``"forward"``: updates run on behind the next forward, each module waiting for its own parameters;
    ``"backward"``: every update done when backward returns)."""

    def __init__(self, config: ParallelConfig, ranks: Ranks, device: torch.device):
        super().__init__(config, ranks, device)
        self.ddp: DistributedDataParallel | None = None
        self.update: OverlappedUpdate | None = None

    def convert_modules(self, model: nn.Module) -> None:
        if self.ranks.world_size > 1:
            convert_batchnorm_for_data_parallel(model, self.device)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None,
                example=None, memory=None) -> nn.Module:
        from oomless.runtime.install import installed_state

        installed = installed_state(model)
        if installed is not None:
            check_replicated_plan(installed.plan, self.ranks.world_size)
        self.max_grad_norm = max_grad_norm
        self.convert_modules(model)
        device_ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else None
        with self.collective("DDP parameter broadcast"):
            # gradient_as_bucket_view: grads are views of DDP's buckets (no copy), which the overlapped
            # update needs to read a bucket's averaged gradients without racing DDP's own copy.
            self.ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.config.bucket_cap_mb,
                                               gradient_as_bucket_view=True)
        wait_in = None if self.config.overlap == "none" else self.config.overlap
        # fp16's loss scaler skips the whole step when any gradient overflowed (runtime/precision.py).
        scaler = getattr(precision_state(model), "scaler", None)
        if wait_in is not None and not needs_global_view(max_grad_norm, scaler):
            self.update = apply_overlapped_update(self.ddp, optimizer, wait_in)
        return self.ddp

    def sum_across_ranks(self):
        if self.ranks.world_size == 1:
            return None
        return sum_across_ranks

    def backward(self, loss: torch.Tensor) -> None:
        with self.collective("gradient all-reduce during backward (DDP buckets)"):
            loss.backward()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step_index: int) -> None:
        if self.update is not None:
            self.update.step()
            self.update.zero_grad()
            return
        super().step(model, optimizer, step_index)

    def synchronize(self, model: nn.Module) -> None:
        if self.update is not None:
            # Updates may still run after backward (behind the next forward): the model and the
            # optimizer are read (checkpoint, --save, layout switch) only after every one is done.
            with self.collective("overlapped update (bucket all-reduce)"):
                self.update.synchronize()

    def finish(self, model: nn.Module, optimizer=None) -> None:
        self.synchronize(model)
        if self.update is not None:
            self.update.remove()                # from now on DDP's comm hook only averages, as plain DDP
