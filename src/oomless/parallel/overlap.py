"""The overlapped update (seed 001): each gradient bucket's optimizer step runs as soon as that
bucket's all-reduce lands, while backward is still computing and reducing the other buckets.

Plain DDP hides the all-reduce behind backward, but the optimizer step waits for the last bucket.
Here a DDP communication hook starts the bucket's all-reduce (averaging exactly as DDP's default hook
does: divide, then sum) and chains on its future one optimizer step over that bucket's parameters;
the future DDP waits for is the update's. The chained step runs on the thread that completes the
all-reduce (gloo's worker thread; under NCCL the hook's thread, which only enqueues kernels after the
all-reduce's), so only the last bucket's update is left when backward's compute ends. This is the
shape of torch's ``ddp_comm_hooks.optimizer_overlap_hooks._hook_then_optimizer``, with the user's own
``torch.optim`` optimizer instead of a functional one.

Why DDP waits for the update, and the next forward does not wait per layer instead: a forward may read
a parameter without calling the module that owns it, DDP rebuilds its buckets (re-pointing every
``param.grad``) at the start of the second forward, and a scheduler may change the learning rate right
after backward; with every update finished when backward returns none of these can race an update.
Letting the updates run on into the next forward (DDP's future first, per-layer waits in forward)
measured no faster on 2 gloo ranks (step time 1.01x this design's, median of 40 paired rounds; the
last bucket holds the first layers, which the next forward needs first), so it is not worth the races.

The update is bitwise the plain one: per bucket one ``torch.optim`` optimizer of the user's class, one
param group per user group the bucket touches, with that group's settings re-read at every step,
sharing the user's optimizer's ``state`` dict (so checkpoints and ``optimizer.state_dict()`` are
unchanged). Adam, AdamW and SGD (single-tensor, foreach or fused) compute each parameter on its own, so
a step over a bucket's parameters is the step over all parameters restricted to them, in the
implementation the user's optimizer picks for those same tensors. One ``step()`` per bucket, not per
parameter: torch's per-call overhead (hooks, profiling, state init checks) is paid once per bucket.
Parameters DDP reduces that the optimizer does not hold are left alone, as the plain step does.

Why some cases fall back to the post-backward step (`needs_global_view`):
- clipping by global norm needs every bucket's norm before any bucket may be updated, and
- mixed precision with a loss scaler must skip the whole step if any bucket overflowed.
Both need all gradients first, so with ``max_grad_norm`` or a scaler the update is not overlapped: DDP
still hides the all-reduce behind backward, then clip / unscale / step run as in plain DDP.

    update = apply_overlapped_update(ddp_model, optimizer)
    loss.backward()          # each bucket's update runs as its all-reduce lands; all done on return
    update.step()            # nothing left to do: bookkeeping only
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STATE_ATTRIBUTE = "_oomless_overlap"


def needs_global_view(max_grad_norm: float | None, grad_scaler=None) -> bool:
    """True when the update must see every bucket's gradient first (see the module docstring)."""
    return max_grad_norm is not None or (grad_scaler is not None and grad_scaler.is_enabled())


class BucketUpdate:
    """One optimizer step over one DDP bucket's parameters, with the user's optimizer's settings and state."""

    def __init__(self, user_optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter],
                 group_index_of: dict[nn.Parameter, int]):
        self.user_optimizer = user_optimizer
        self.key = tuple(map(id, parameters))
        # Parameters the user's optimizer does not hold keep their gradients, as after a plain step.
        self.parameters = [param for param in parameters if param in group_index_of]
        by_group: dict[int, list[nn.Parameter]] = {}
        for param in self.parameters:
            by_group.setdefault(group_index_of[param], []).append(param)
        self.group_indices = sorted(by_group)
        self.optimizer: torch.optim.Optimizer | None = None
        if self.parameters:
            groups = [{**self._settings(index), "params": by_group[index]} for index in self.group_indices]
            self.optimizer = type(user_optimizer)(groups, **user_optimizer.defaults)

    def _settings(self, group_index: int) -> dict:
        # By index: optimizer.load_state_dict replaces the group dicts (keeping their parameters).
        group = self.user_optimizer.param_groups[group_index]
        return {key: value for key, value in group.items() if key != "params"}

    def read_settings(self) -> None:
        """Copy the user's hyper-parameters and state dict; called in the comm hook, on the training
        (autograd) thread, so what the update uses is what the user's groups held during backward."""
        if self.optimizer is None:
            return
        for group, index in zip(self.optimizer.param_groups, self.group_indices):
            group.update(self._settings(index))
        # optimizer.load_state_dict gives the user's optimizer a new state dict: share that one.
        self.optimizer.state = self.user_optimizer.state

    def run(self, reduced: torch.futures.Future) -> torch.Tensor:
        """Chained on the all-reduce: step, consume the gradients, hand DDP the averaged buffer."""
        buffer = reduced.value()[0]             # re-raises a failed all-reduce into DDP's wait
        if self.optimizer is not None:
            # gradient_as_bucket_view=True makes each param.grad a view of this bucket's buffer, so
            # the grads already hold the average. Backward does not write them again this step (DDP
            # marked the bucket ready), and DDP waits for this future before backward returns.
            self.optimizer.step()
            for param in self.parameters:
                if param.grad is not None:
                    param.grad.zero_()          # the loop's zero_grad, done here: the grad is consumed
        return buffer


class OverlappedUpdate:
    """Installed on a DDP model by `apply_overlapped_update`; kept as ``ddp_model._oomless_overlap``."""

    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.process_group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.enabled = True
        # DDP's bucket index -> its update; DDP rebuilds its buckets once after the first backward.
        self.bucket_updates: dict[int, BucketUpdate] = {}
        self._group_index_of: dict[nn.Parameter, int] = {}
        self._group_count = -1                  # len(optimizer.param_groups) when _group_index_of was built

    def _bucket_update_for(self, bucket: dist.GradBucket) -> BucketUpdate:
        if len(self.optimizer.param_groups) != self._group_count:      # first call, or add_param_group
            self._group_count = len(self.optimizer.param_groups)
            self._group_index_of = {param: index for index, group in enumerate(self.optimizer.param_groups)
                                    for param in group["params"]}
            self.bucket_updates.clear()
        index, parameters = bucket.index(), bucket.parameters()
        update = self.bucket_updates.get(index)
        if update is None or update.key != tuple(map(id, parameters)):     # first use, or DDP rebuilt
            update = BucketUpdate(self.optimizer, parameters, self._group_index_of)
            self.bucket_updates[index] = update
        return update

    def comm_hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: average the bucket, then update its parameters; DDP waits for both."""
        buffer = bucket.buffer()
        buffer.div_(self.world_size)            # divide first, as DDP's default hook does (fp16 overflow)
        reduced = dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future()
        if not self.enabled:                    # after remove(): plain DDP averaging
            return reduced.then(lambda future: future.value()[0])
        update = self._bucket_update_for(bucket)
        update.read_settings()
        return reduced.then(update.run)

    def synchronize(self) -> None:
        """Nothing is in flight once backward returned (DDP waited for every bucket's update)."""

    def step(self) -> None:
        """The loop's ``optimizer.step()``: the updates already ran in the comm hook."""

    def zero_grad(self) -> None:
        """The loop's ``optimizer.zero_grad()``: each update zeroes its own bucket's gradients."""

    def remove(self) -> None:
        """From the next backward on, the hook only averages (DDP keeps a comm hook once registered)."""
        self.enabled = False


def apply_overlapped_update(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> OverlappedUpdate:
    """Register the overlapped update on ``ddp_model`` (built with ``gradient_as_bucket_view=True``)."""
    if not ddp_model.gradient_as_bucket_view:
        raise ValueError("the overlapped update needs DistributedDataParallel(..., gradient_as_bucket_view=True)")
    update = OverlappedUpdate(ddp_model, optimizer)
    ddp_model.register_comm_hook(None, update.comm_hook)
    setattr(ddp_model, STATE_ATTRIBUTE, update)
    return update
