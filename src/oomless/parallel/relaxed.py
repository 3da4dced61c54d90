"""Relaxed synchronisation for slow links (seed 002): ranks step on their own shard and only average
parameters, either every H steps (local SGD) or every step one step late (asynchronous averaging).

    torchrun --nproc-per-node 4 -m oomless train --parallel local-sgd --average-every 4
    torchrun --nproc-per-node 4 -m oomless train --parallel async

Convergence caveat: neither mode is the one-process run. Between averages each rank follows the
gradient of its own shard (local SGD), or the average it receives is one step stale (async), so the
trajectory differs from synchronous SGD; with Adam each rank also keeps its own moment estimates.
Local SGD is known to converge for smooth problems at small H (Stich 2019, "Local SGD converges fast
and communicates little"; torch's post-local SGD follows Lin et al. 2020); bounded staleness keeps
asynchronous SGD convergent for small learning rates (Ho et al. 2013, SSP). Larger H, learning rates or
world sizes widen the gap: measure the loss against ``--parallel dp`` before relying on it. The tests
state the tolerance they accept on the embedded task.

Every rank computes the loss on its own shard only (no cross-rank sums, BatchNorm stays local), since
nothing else is synchronised within a step. Floating-point buffers (BatchNorm running statistics) are
averaged with the parameters.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from oomless.parallel.data_parallel import Collectives


def averaged_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What a relaxed mode averages: parameters and floating-point buffers (not step counters)."""
    return [*model.parameters(), *(buffer for buffer in model.buffers() if buffer.is_floating_point())]


class LocalSGD(Collectives):
    """Average parameters every ``average_every`` steps with torch's ``average_parameters`` (what
    ``PeriodicModelAverager`` / ``PostLocalSGDOptimizer`` call); in between, no communication at all.

    Not the averager object itself: it skips parameters whose ``.grad`` is None (ours are, after
    ``zero_grad(set_to_none=True)``), refuses buffers, and counts steps itself; here the period is
    read from the loop's step, so a resumed run averages at the same steps as an uninterrupted one."""

    relaxed = True

    def step(self, model, optimizer, step_index):
        super().step(model, optimizer, step_index)
        if (step_index + 1) % self.config.average_every == 0 and self.ranks.world_size > 1:
            with self.collective(f"local SGD parameter average (every {self.config.average_every} steps)"):
                average_parameters(iter(averaged_tensors(model)), None)

    def finish(self, model, optimizer=None):
        average_now(model, self, optimizer)


def average_now(model: nn.Module, strategy: Collectives, optimizer=None) -> None:
    """One synchronous average of parameters and float buffers, and of the floating-point state of
    ``optimizer`` where given: every rank then holds the same model and optimizer. A layout after
    this one that keeps ranks equal (dp, a pipeline) needs both: with each rank's own Adam moments,
    one all-reduced gradient stepped each replica its own way (apart by 3.6e-3 after 3 steps)."""
    if strategy.ranks.world_size == 1:
        return
    tensors = averaged_tensors(model)
    if optimizer is not None:
        tensors += [value for state in optimizer.state.values() for value in state.values()
                    if isinstance(value, torch.Tensor) and value.is_floating_point()]
    # On the parameters' device: Adam keeps its step counters on the host beside CUDA moments
    # (`_write_back` copies each part back to its own device).
    device = tensors[0].device
    flat = torch.cat([tensor.detach().reshape(-1).to(device) for tensor in tensors])
    with strategy.collective("final parameter average"):
        dist.all_reduce(flat)
    flat /= strategy.ranks.world_size
    _write_back(tensors, flat)


def _write_back(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


class AsynchronousAveraging(Collectives):
    """Every step, start averaging a snapshot of the parameters and keep computing; one step later
    apply it: ``params <- average(snapshot_k) + (params - snapshot_k)``, i.e. the average replaces the
    snapshot and this rank's own progress since the snapshot is kept. Staleness is bounded by one
    step; the all-reduce of step k is hidden behind the whole forward and backward of step k+1."""

    relaxed = True

    def prepare(self, model, optimizer, max_grad_norm, example=None, memory=None):
        self.max_grad_norm = max_grad_norm
        self._pending = None            # (work, snapshot, averaged buffer, tensors)
        return model

    def step(self, model, optimizer, step_index):
        super().step(model, optimizer, step_index)
        self._apply_pending()
        if self.ranks.world_size == 1:
            return
        tensors = averaged_tensors(model)
        snapshot = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
        averaged = snapshot / self.ranks.world_size     # divide first, then sum: the mean arrives
        with self.collective("asynchronous parameter average (start)"):
            work = dist.all_reduce(averaged, async_op=True)
        self._pending = (work, snapshot, averaged, tensors)

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        work, snapshot, averaged, tensors = self._pending
        self._pending = None
        with self.collective("asynchronous parameter average (wait, one step later)"):
            # The averaged buffer is only read after wait(): on NCCL the all-reduce writes it on a
            # communication stream, and wait() orders the current stream after that write.
            work.wait()
        current = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
        _write_back(tensors, averaged + (current - snapshot))

    def synchronize(self, model):
        # A checkpoint or save must not leave an average in flight (it could not be resumed): apply it
        # now instead of one step later. Runs checkpointing at the same steps follow the same trajectory.
        self._apply_pending()

    def finish(self, model, optimizer=None):
        self._apply_pending()
        average_now(model, self, optimizer)
