"""The overlapped update (seed 001): each gradient bucket's optimizer step runs as soon as that
bucket's all-reduce lands, and each module's next forward waits only for its own parameters' update.

Plain DDP hides the all-reduce behind backward, but the optimizer step waits for the last bucket, and
the next forward for the whole step. Here a DDP communication hook starts the bucket's all-reduce
(averaging exactly as DDP's default hook does: divide, then sum); the future DDP waits for completes
when the averaged bucket has landed, and one optimizer step over that bucket's parameters is chained
after it. On CPU the step runs on one update thread of this module's own, in bucket order, once the
all-reduce landed (not chained with ``Future.then``, which runs the callback inline on backward's thread
when the all-reduce is already done). Under NCCL the future is complete once the all-reduce is
enqueued, so the step is chained with ``then``: the hook's thread enqueues its kernels on a pool stream
made to wait for the all-reduce, with no host sync. So backward returns when the last all-reduce
lands, and the updates still running then (the last bucket's: the first layers' parameters) run on
behind the next forward. A forward pre-hook on every module that
registers parameters (``recurse=False``) waits for the updates of exactly those parameters' buckets
before the module runs; a parameter registered by two modules (tied weights) is waited for by both.
On CUDA that wait is a stream wait (``Future.wait`` makes the current stream wait on the update's
events), not a host sync. This is the shape of torch's
``ddp_comm_hooks.optimizer_overlap_hooks._hook_then_optimizer``, with the user's own ``torch.optim``
optimizer instead of a functional one, and with the wait moved from DDP's backward to the forward.
``wait_in="backward"`` keeps the earlier design: DDP's future is the update's, so every update is done
when backward returns and only the rest of backward hides them. Measured on 2 gloo CPU ranks
(bench/bench_dp.py, a shared 2-core machine) neither form is faster than plain DDP beyond the noise:
the update the forward can hide is ~1 ms of a ~240 ms step, and the update thread shares the cores
with the forward. On CUDA the update's kernels run on a pool stream beside the forward's (not measured
here: no GPU in that session).

The races of letting updates run into the next forward, and what prevents each:

1. A forward may read a parameter without calling a module that registers it (``F.linear(x,
   self.proj.weight)``; torch's own ``nn.MultiheadAttention`` reads ``out_proj.weight`` so). Module
   pre-hooks cannot see such a read. The first forward after the update is installed (nothing is
   pending then) runs under a ``TorchFunctionMode`` that records, for every parameter an op reads,
   whether the innermost running module registers it; every parameter read anywhere else is waited for
   at the start of the model's forward (a pre-hook on the DDP module) from then on. What this does not
   cover, and is the caller's contract: a forward whose control flow later reads a parameter outside
   its modules in a way the first forward did not, and any read outside a forward (call
   `OverlappedUpdate.synchronize` first: the training loop does, through the strategy, before
   checkpoints, ``--save``, layout switches and at the end of the run). Modules added to the model
   after `apply_overlapped_update` get no pre-hook.
2. DDP rebuilds its buckets at the start of the first grad-enabled forward after the first backward,
   copying every gradient into new buffers and re-pointing ``param.grad``; an update running then
   would race the copy. Until DDP reports the rebuild done (``DistributedDataParallel.
   _has_rebuilt_buckets``, set in ``_pre_forward`` right after ``reducer._rebuild_buckets()``; there
   is no public signal), the model-level pre-hook waits for every pending update, before DDP's forward
   runs. If the attribute is missing (another torch) every forward waits for everything: correct,
   not overlapped. DDP with ``find_unused_parameters`` never rebuilds, so it never overlaps here.
   DDP's ``Join`` context (uneven inputs) may rebuild outside a forward: not supported here.
3. A scheduler may change the learning rate between backward and the step. The step's settings are
   read in the comm hook, on the training thread, during backward (`BucketUpdate.read_settings`), so
   a change after backward applies to the next step, as with the plain ``optimizer.step()`` after
   backward and ``scheduler.step()`` after that.
Also: the user's ``optimizer.zero_grad()`` must not run while updates are pending (each update zeroes
its own bucket's gradients; `OverlappedUpdate.zero_grad` is the no-op the loop calls).

The update is bitwise the plain one: per bucket one slice of the user's optimizer
(`oomless.runtime.optimizer_slices`: the user's class, one param group per user group the bucket
touches, that group's settings re-read at every step, the user's ``state`` dict shared, so checkpoints
and ``optimizer.state_dict()`` are unchanged). Any ``torch.optim`` optimizer with per-parameter state
computes each parameter on its own, so a step over a bucket's parameters is the step over all
parameters restricted to them (tested: SGD with momentum/nesterov/weight decay, Adam, AdamW, RMSprop,
Adagrad, NAdam; LBFGS is refused at install). One ``step()`` per bucket, not per
parameter: torch's per-call overhead (hooks, profiling, state init checks) is paid once per bucket.
Parameters DDP reduces that the optimizer does not hold are left alone, as the plain step does.

Why some cases fall back to the post-backward step (`needs_global_view`):
- clipping by global norm needs every bucket's norm before any bucket may be updated, and
- mixed precision with a loss scaler must skip the whole step if any bucket overflowed.
Both need all gradients first, so with ``max_grad_norm`` or a scaler the update is not overlapped: DDP
still hides the all-reduce behind backward, then clip / unscale / step run as in plain DDP.

    update = apply_overlapped_update(ddp_model, optimizer)
    loss.backward()          # each bucket's update starts as its all-reduce lands
    update.step()            # nothing to do: bookkeeping only
    ddp_model(next_batch)    # each module waits for its own parameters' update
    update.synchronize()     # before reading the model or optimizer outside a forward
"""

import queue
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

from oomless.errors import InputError
from oomless.runtime.optimizer_slices import OptimizerSlice, check_sliceable, group_index_of

STATE_ATTRIBUTE = "_oomless_overlap"
WAIT_IN = ("forward", "backward")


def needs_global_view(max_grad_norm: float | None, grad_scaler=None) -> bool:
    """True when the update must see every bucket's gradient first (see the module docstring)."""
    return max_grad_norm is not None or (grad_scaler is not None and grad_scaler.is_enabled())


class BucketUpdate:
    """One optimizer step over one DDP bucket's parameters, with the user's optimizer's settings and state."""

    def __init__(self, user_optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter],
                 group_index_of: dict[nn.Parameter, int]):
        self.key = tuple(map(id, parameters))
        # Parameters the user's optimizer does not hold keep their gradients, as after a plain step.
        self.slice = OptimizerSlice(user_optimizer, parameters, group_index_of)
        self.optimizer = self.slice.optimizer   # the torch.optim optimizer stepping this bucket (None: nothing held)
        self.parameters = self.slice.parameters
        self.group_indices = self.slice.group_indices

    def read_settings(self) -> None:
        """Copy the user's hyper-parameters and state dict; called in the comm hook, on the training
        (autograd) thread, so what the update uses is what the user's groups held during backward."""
        self.slice.read_settings()

    def run(self, averaged: torch.futures.Future) -> torch.Tensor:
        """Chained on the averaged all-reduce: step, consume the gradients; returns the averaged buffer."""
        buffer = averaged.value()[0]            # re-raises a failed all-reduce into whoever waits
        if self.slice.optimizer is not None:
            # gradient_as_bucket_view=True makes each param.grad a view of this bucket's buffer, so
            # the grads already hold the average, and DDP's finalize leaves them alone (the hook's
            # result is that buffer: nothing to copy back). Backward does not write them again this
            # step (DDP marked the bucket ready); the next backward writes them only after the
            # parameter's module ran its forward, which waits for this update.
            self.slice.step()
            for param in self.parameters:
                if param.grad is not None:
                    param.grad.zero_()          # the loop's zero_grad, done here: the grad is consumed
        return buffer


class _ParameterReads(TorchFunctionMode):
    """Records the parameters an op reads while the innermost running module does not register them."""

    def __init__(self, registered_by: dict[int, set[int]]):
        super().__init__()
        self.registered_by = registered_by      # id(parameter) -> ids of the modules registering it
        self.running: list[int] = []            # ids of the modules whose forward is running, innermost last
        self.read_outside: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        innermost = self.running[-1] if self.running else None
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                owners = self.registered_by.get(id(tensor))
                if owners is not None and innermost not in owners:
                    self.read_outside.add(id(tensor))
        return func(*args, **kwargs)


class _UpdateThread:
    """One thread running the CPU buckets' updates in the order DDP launched their all-reduces."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="oomless-overlapped-update", daemon=True)
        self.thread.start()

    def submit(self, run, averaged: torch.futures.Future) -> torch.futures.Future:
        updated = torch.futures.Future()
        self.queue.put((run, averaged, updated))
        return updated

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            run, averaged, updated = item
            try:
                averaged.wait()                 # releases the GIL while the all-reduce runs
                updated.set_result(run(averaged))
            except BaseException as error:      # re-raised by whoever waits for this update
                updated.set_exception(error)

    def stop(self) -> None:
        self.queue.put(None)


class OverlappedUpdate:
    """Installed on a DDP model by `apply_overlapped_update`; kept as ``ddp_model._oomless_overlap``.
    ``wait_in``: ``"forward"`` (each module's next forward waits for its parameters' updates) or
    ``"backward"`` (DDP waits for every update before backward returns)."""

    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 wait_in: str = "forward"):
        if wait_in not in WAIT_IN:
            raise InputError(f"the overlapped update waits in one of {', '.join(WAIT_IN)}, got {wait_in!r}")
        check_sliceable(optimizer)
        self.ddp_model = ddp_model
        self.optimizer = optimizer
        self.wait_in = wait_in
        self.process_group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.enabled = True
        # DDP's bucket index -> its update; DDP rebuilds its buckets once after the first backward.
        self.bucket_updates: dict[int, BucketUpdate] = {}
        self._group_index_of: dict[nn.Parameter, int] = {}
        self._group_count = -1                  # len(optimizer.param_groups) when _group_index_of was built
        # Bucket index -> the future of its update not yet waited for; id(parameter) -> its bucket index,
        # set before the bucket's update is pending, so a parameter with a pending update always finds it.
        self.pending: dict[int, torch.futures.Future] = {}
        self.bucket_of: dict[int, int] = {}
        # Counted for tests and benchmarks: updates waited for by a module's pre-hook (and of those, the
        # ones still running then), and the model-level waits for every pending update.
        self.module_waits = 0
        self.waited_while_running = 0
        self.global_waits = 0
        self._hooks, self._recording_hooks = [], []
        self._recording = False
        self._reads: _ParameterReads | None = None
        self._read_outside: set[int] | None = None     # None until the first forward recorded the reads
        self._update_thread: _UpdateThread | None = None
        if wait_in == "forward":
            self._update_thread = _UpdateThread()
            self._install_forward_waits()

    # --- the communication hook (backward) ---

    def _bucket_update_for(self, bucket: dist.GradBucket) -> BucketUpdate:
        if len(self.optimizer.param_groups) != self._group_count:      # first call, or add_param_group
            self._group_count = len(self.optimizer.param_groups)
            self._group_index_of = group_index_of(self.optimizer)
            self.bucket_updates.clear()
        index, parameters = bucket.index(), bucket.parameters()
        update = self.bucket_updates.get(index)
        if update is None or update.key != tuple(map(id, parameters)):     # first use, or DDP rebuilt
            update = BucketUpdate(self.optimizer, parameters, self._group_index_of)
            self.bucket_updates[index] = update
            self.bucket_of.update(dict.fromkeys(update.key, index))
        return update

    def comm_hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: average the bucket, then update its parameters. DDP waits for the
        average (``wait_in="forward"``) or for the update (``"backward"``)."""
        buffer = bucket.buffer()
        buffer.div_(self.world_size)            # divide first, as DDP's default hook does (fp16 overflow)
        reduced = dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future()
        averaged = reduced.then(lambda future: future.value()[0])
        if not self.enabled:                    # after remove(): plain DDP averaging
            return averaged
        update = self._bucket_update_for(bucket)
        update.read_settings()
        previous = self.pending.pop(bucket.index(), None)
        if previous is not None:
            # Last step's update of this bucket was never waited for (its parameters were read by no
            # forward this step): two steps of one bucket must not run at once on gloo's threads.
            previous.wait()
        if self.wait_in == "backward":
            return averaged.then(update.run)
        if buffer.is_cuda:
            # Runs at once on this thread (NCCL's future is complete when the all-reduce is enqueued),
            # on a pool stream made to wait for the all-reduce: kernels enqueued, no host sync.
            updated = averaged.then(update.run)
        else:
            # Future.then runs its callback inline when the all-reduce already landed, which would put
            # the update back into backward; the update thread runs it after backward's thread moved on.
            updated = self._update_thread.submit(update.run, averaged)
        self.pending[bucket.index()] = updated
        return averaged

    # --- the waits (forward) ---

    def _install_forward_waits(self) -> None:
        model = self.ddp_model.module
        registered_by: dict[int, set[int]] = {}
        for module in model.modules():
            direct = [id(param) for param in module.parameters(recurse=False)]
            for parameter_id in direct:
                registered_by.setdefault(parameter_id, set()).add(id(module))
            if direct:
                self._hooks.append(module.register_forward_pre_hook(self._waiter(tuple(direct))))
        self._reads = _ParameterReads(registered_by)
        for module in model.modules():          # removed once the first forward recorded the reads
            self._recording_hooks.append(module.register_forward_pre_hook(self._entered, prepend=True))
            self._recording_hooks.append(module.register_forward_hook(self._left, always_call=True))
        self._hooks.append(self.ddp_model.register_forward_pre_hook(self._before_model_forward, prepend=True))
        self._hooks.append(self.ddp_model.register_forward_hook(self._after_model_forward, always_call=True))

    def _entered(self, module, args) -> None:
        self._reads.running.append(id(module))

    def _left(self, module, args, output) -> None:
        if self._reads.running:
            self._reads.running.pop()

    def _waiter(self, parameter_ids: tuple[int, ...]):
        def wait_for_own_parameters(module, args) -> None:
            self._wait_for(parameter_ids)
        return wait_for_own_parameters

    def _wait_for(self, parameter_ids) -> None:
        pending, bucket_of = self.pending, self.bucket_of
        if not pending:
            return
        for parameter_id in parameter_ids:
            future = pending.pop(bucket_of.get(parameter_id), None)
            if future is not None:
                self.module_waits += 1
                if not future.done():
                    self.waited_while_running += 1
                # The module reads (and its backward accumulates into the gradient of) parameters
                # this bucket's update writes and zeroes: wait for it (on CUDA, a stream wait).
                future.wait()

    def _before_model_forward(self, module, args) -> None:
        if not self.enabled:
            return
        if self._read_outside is None or not getattr(self.ddp_model, "_has_rebuilt_buckets", False):
            # DDP may rebuild its buckets in this forward (race 2), or the reads are not recorded yet.
            self.global_waits += bool(self.pending)
            self.synchronize()
        else:
            self._wait_for(self._read_outside)     # read outside their modules (race 1)
        if self._read_outside is None and not self._recording:
            self._recording = True
            self._reads.__enter__()

    def _after_model_forward(self, module, args, output) -> None:
        if self._recording:                     # the first forward ended (or raised): reads recorded
            self._reads.__exit__(None, None, None)
            self._recording = False
            self._read_outside = set(self._reads.read_outside)
            for handle in self._recording_hooks:
                handle.remove()
            self._recording_hooks.clear()

    # --- the loop's calls ---

    def synchronize(self) -> None:
        """Wait for every pending update: before reading the model or optimizer outside a forward."""
        while self.pending:
            _, future = self.pending.popitem()
            future.wait()                       # re-raises a failed update or all-reduce

    def step(self) -> None:
        """The loop's ``optimizer.step()``: the updates already run from the comm hook."""

    def zero_grad(self) -> None:
        """The loop's ``optimizer.zero_grad()``: each update zeroes its own bucket's gradients."""

    def remove(self) -> None:
        """Wait for pending updates; from the next backward on the hook only averages (DDP keeps a comm
        hook once registered) and forwards wait for nothing."""
        self.synchronize()
        self.enabled = False
        if self._update_thread is not None:
            self._update_thread.stop()
            self._update_thread = None
        if self._recording:
            self._reads.__exit__(None, None, None)
            self._recording = False
        for handle in self._hooks + self._recording_hooks:
            handle.remove()
        self._hooks.clear()
        self._recording_hooks.clear()


def apply_overlapped_update(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                            wait_in: str = "forward") -> OverlappedUpdate:
    """Register the overlapped update on ``ddp_model`` (built with ``gradient_as_bucket_view=True``)."""
    if not ddp_model.gradient_as_bucket_view:
        raise ValueError("the overlapped update needs DistributedDataParallel(..., gradient_as_bucket_view=True)")
    update = OverlappedUpdate(ddp_model, optimizer, wait_in)
    ddp_model.register_comm_hook(None, update.comm_hook)
    setattr(ddp_model, STATE_ATTRIBUTE, update)
    return update
