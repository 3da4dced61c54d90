"""The overlapped update (seed 001): each gradient bucket's optimizer step runs as soon as its
all-reduce lands, and each layer's next forward waits only for its own parameters.

Plain DDP hides the all-reduce behind backward, but the optimizer step waits for the last bucket and
the next forward waits for the whole step. Here a DDP communication hook starts the bucket's
all-reduce (averaging exactly as DDP's default hook does: divide, then sum) and chains on its future an
update of just that bucket's parameters. DDP waits only for the all-reduce futures; the update futures
are kept per parameter, and a forward pre-hook on every module that owns parameters waits for those of
its own parameters, so layer 1 of step k+1 can run while the update of layer 20 of step k is in flight.

The update is bitwise the plain one: one ``torch.optim`` optimizer per parameter, of the user's class
and hyper-parameters, sharing the user's optimizer's ``state`` dict (so checkpoints and
``optimizer.state_dict()`` are unchanged). Single-tensor Adam/SGD are per-parameter computations.

Why some cases fall back to the post-backward step (`needs_global_view`):
- clipping by global norm needs every bucket's norm before any bucket may be updated, and
- mixed precision with a loss scaler must skip the whole step if any bucket overflowed.
Both need all gradients first, so with ``max_grad_norm`` or a scaler the update is not overlapped: DDP
still hides the all-reduce behind backward, then clip / unscale / step run as in plain DDP.

    update = apply_overlapped_update(ddp_model, optimizer)
    loss.backward()          # buckets' updates start as their all-reduces land
    update.step()            # nothing left to do but bookkeeping; the next forward waits per layer
"""

import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STATE_ATTRIBUTE = "_oomless_overlap"


def needs_global_view(max_grad_norm: float | None, grad_scaler=None) -> bool:
    """True when the update must see every bucket's gradient first (see the module docstring)."""
    return max_grad_norm is not None or (grad_scaler is not None and grad_scaler.is_enabled())


class OverlappedUpdate:
    """Installed on a DDP model by `apply_overlapped_update`; kept as ``ddp_model._oomless_overlap``."""

    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.process_group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self._group_of = {param: group for group in optimizer.param_groups for param in group["params"]}
        self._per_parameter: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self._pending: dict[nn.Parameter, torch.futures.Future] = {}
        self._lock = threading.Lock()
        self.wait_seconds_by_bucket: dict[int, float] = {}   # exposed communication, measured in forward
        self._bucket_of: dict[nn.Parameter, int] = {}
        self.handles = []
        for module in ddp_model.module.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self.handles.append(module.register_forward_pre_hook(self._wait_for_own_parameters))
        # A model whose forward skips a layer must still not let the next backward write into a bucket
        # an update is reading: after the whole forward, wait for anything still pending.
        self.handles.append(ddp_model.module.register_forward_hook(lambda *_: self.synchronize()))

    def _optimizer_for(self, param: nn.Parameter) -> torch.optim.Optimizer:
        group = self._group_of[param]
        single = self._per_parameter.get(param)
        if single is None:
            settings = {key: value for key, value in group.items() if key != "params"}
            # A one-parameter group carrying every setting of the user's group (scheduler keys too).
            single = type(self.optimizer)([{"params": [param], **settings}], **self.optimizer.defaults)
            self._per_parameter[param] = single
        else:
            # Hyper-parameters may change between steps (a learning-rate schedule): read them each time.
            single.param_groups[0].update({key: value for key, value in group.items() if key != "params"})
        # After optimizer.load_state_dict the user's optimizer holds a new state dict: share that one.
        single.state = self.optimizer.state
        return single

    def comm_hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: average the bucket, then chain this bucket's update on the result."""
        parameters = bucket.parameters()
        optimizers = [self._optimizer_for(param) for param in parameters]
        index = bucket.index()
        for param in parameters:
            self._bucket_of[param] = index
        buffer = bucket.buffer()
        buffer.div_(self.world_size)            # divide first, as DDP's default hook does (fp16 overflow)
        reduced = dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future()

        def update(future: torch.futures.Future) -> None:
            future.value()                      # re-raises a failed all-reduce here, where it is waited on
            # gradient_as_bucket_view=True makes each param.grad a view of this bucket's buffer, so the
            # grads already hold the average; nobody else writes them until the next backward, and that
            # backward cannot start before the forward pre-hooks waited for this future.
            for single in optimizers:
                single.step()
            for param in parameters:
                if param.grad is not None:
                    param.grad.zero_()          # the loop's zero_grad, done here: the grad is consumed
            return None

        updated = reduced.then(update)
        with self._lock:
            for param in parameters:
                self._pending[param] = updated
        return reduced.then(lambda future: future.value()[0])

    def _wait_for_own_parameters(self, module: nn.Module, args) -> None:
        waits = set()
        with self._lock:
            for param in module.parameters(recurse=False):
                future = self._pending.pop(param, None)
                if future is not None:
                    waits.add((self._bucket_of.get(param, -1), future))
        for bucket_index, future in waits:
            if future.done():
                future.wait()                   # re-raises an update's error
                continue
            started = time.perf_counter()
            future.wait()
            waited = time.perf_counter() - started
            self.wait_seconds_by_bucket[bucket_index] = self.wait_seconds_by_bucket.get(bucket_index, 0.0) + waited

    def synchronize(self) -> None:
        """Wait for every pending update: before a checkpoint, a save, or reading the weights."""
        with self._lock:
            pending = set(self._pending.values())
            self._pending.clear()
        for future in pending:
            future.wait()

    def step(self) -> None:
        """The loop's ``optimizer.step()``: the updates already ran in the comm hook."""

    def zero_grad(self) -> None:
        """The loop's ``optimizer.zero_grad()``: each update zeroes its own bucket's gradients."""

    def remove(self) -> None:
        self.synchronize()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def apply_overlapped_update(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> OverlappedUpdate:
    """Register the overlapped update on ``ddp_model`` (built with ``gradient_as_bucket_view=True``)."""
    if not ddp_model.gradient_as_bucket_view:
        raise ValueError("the overlapped update needs DistributedDataParallel(..., gradient_as_bucket_view=True)")
    update = OverlappedUpdate(ddp_model, optimizer)
    ddp_model.register_comm_hook(None, update.comm_hook)
    setattr(ddp_model, STATE_ATTRIBUTE, update)
    return update
