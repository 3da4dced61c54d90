"""Mixed precision as a transform on the model: autocast entered by hooks, loss scaling for fp16.

    model = oomless.fit(model, inputs, memory="8GiB", optimizer=optimizer, precision="bf16")
    # the training loop is unchanged: the model's forward now runs under torch.autocast(bfloat16)

accelerate's ``prepare_model`` does this by wrapping ``model.forward``; here it is hooks only:
- A forward pre-hook on the model enters ``torch.autocast(device_type, dtype)``; its forward hook
  (always called, even when forward raises) leaves it. Backward needs no autocast: autograd runs
  each backward op in the dtypes its forward op used (torch.amp documentation, "Autocasting").
  Recomputed blocks replay under the same autocast state: torch's checkpoint stashes it.
- Floating outputs in the autocast dtype come back as fp32 (as accelerate's
  ``convert_outputs_to_fp32``), so a loss computed outside the model runs in fp32. For the losses
  autocast itself runs in fp32 (cross-entropy, MSE, NLL) that is exactly what wrapping the loss in
  autocast would give; a loss autocast would run in bf16 (a plain ``square().mean()``) runs in fp32.
- Parameters stay fp32 (master weights): autocast casts them per op, once per forward (its cache).

fp16 adds loss scaling (gradients below fp16's smallest normal would flush to zero). The user's
loop calls ``loss.backward()`` and ``optimizer.step()`` itself, so nothing can scale its loss; the
same arithmetic is done at the model's boundary instead:
- The gradient arriving at each floating output is multiplied by the scale S (a power of two, as
  GradScaler's, so S * g is exact: bitwise what scaling the loss gives when the loss runs in fp32),
  and the gradient leaving through an input that requires grad is multiplied by 1/S.
- Each parameter's gradient is multiplied by 1/S as it is accumulated (a tensor hook), so ``.grad``
  always holds the true gradient: clipping, accumulation and logging in the loop see what they
  would see without scaling, and no ``unscale_`` call is needed.
- A step pre-hook on the optimizer checks that every gradient of the model is finite (one host
  synchronisation per step, as ``GradScaler.step`` makes); on inf/nan the step is skipped (the
  gradients are hidden from that one ``step()`` call and put back after it), S halves and the
  skipped step is counted (``oomless.stats(model).skipped_steps``); after 2000 clean steps S
  doubles. These are GradScaler's defaults and update rule.
A loop that keeps its own ``torch.amp.GradScaler`` would scale the loss twice and have its steps
skipped unseen: `oomless.runtime.grad_scaler_guard` refuses it at its first step.
The contract: a parameter's gradient reaches it through the model's forward. A parameter read
outside the forward (a tied output projection applied in the loss) would be unscaled without
having been scaled.

Under FSDP2 (``fully_shard``, ``--parallel fsdp``) no hook sees a parameter's final gradient (FSDP
reduce-scatters the unsharded parameters' gradients into the shards' ``.grad``), so FSDP's own
division unscales it: ranks x S instead of ranks (`LossScaler.unscale_in_reduce_scatter`). Each
rank holds a shard of every gradient, so whether to skip is voted over the ranks (``agreement_group``,
as pipeline stages vote too). bf16 needs nothing of FSDP: parameters stay fp32 and are all-gathered
so, and autocast casts them per op, as in one process (FSDP's ``MixedPrecisionPolicy`` would
all-gather bf16 copies, half the traffic, but computes norms and the update from other roundings).

The caller's own autocast: if the model is called while ``torch.autocast`` is already on for its
device, with the plan's dtype, the hooks step aside (no second autocast, no output cast: the
caller's autocast governs the loss too) and the plan holds, having been made for that dtype. Any
other dtype, or autocast around a model planned for fp32, raises `ApplyError` before the forward
runs: the plan was sized for other bytes.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from oomless.errors import ApplyError, InputError
from oomless.runtime.grad_scaler_guard import DROPPED_MESSAGE, GradScalerGuard
from oomless.runtime.open_calls import is_running, module_call_frame

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_ATTRIBUTE = "_oomless_precision"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None for fp32), or `InputError` naming the choices."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def _run_probe(device: torch.device, dtype: torch.dtype) -> None:
    """One tiny linear and convolution, forward and backward, under autocast: the kernels a step needs."""
    layer = nn.Linear(8, 8).to(device)
    conv = nn.Conv2d(2, 2, 3, padding=1).to(device)
    with torch.autocast(device.type, dtype=dtype):
        out = layer(torch.randn(4, 8, device=device)).sum() + conv(torch.randn(1, 2, 5, 5, device=device)).sum()
    out.float().backward()


def check_precision(precision: str, device: torch.device) -> None:
    """`InputError` if ``precision`` cannot run on ``device`` in this PyTorch build, naming what can."""
    dtype = autocast_dtype(precision)
    if dtype is None or device.type == "meta":
        return
    if not torch.amp.is_autocast_available(device.type):
        raise InputError(f"precision={precision!r}: torch.autocast is not available for {device.type} devices "
                         "in this PyTorch build; use precision='fp32'")
    if device.type == "cuda" and dtype == torch.bfloat16 and not _cuda_has_bf16(device):
        name = torch.cuda.get_device_name(device)
        raise InputError(f"precision='bf16': {name} has no bf16 support (it needs compute capability 8.0, "
                         "Ampere, or newer); use precision='fp16' (with loss scaling) or 'fp32'")
    try:
        _run_probe(device, dtype)
    except (RuntimeError, NotImplementedError) as error:
        other = "'bf16' or 'fp32'" if precision == "fp16" else "'fp32'"
        raise InputError(f"precision={precision!r}: this PyTorch build has no {precision} kernels on "
                         f"{device.type} ({str(error).splitlines()[0]}); use precision={other}") from error


def _cuda_has_bf16(device: torch.device) -> bool:
    # Emulated bf16 (compute capability < 8) runs, but without the tensor-core throughput the plan assumes.
    return torch.cuda.get_device_capability(device) >= (8, 0)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor()`` read when backward runs."""

    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor(), None


def scaled_gradients(values, factor):
    """``values`` (a pytree) with the gradient reaching each floating tensor that requires one
    multiplied by ``factor()``, read when backward runs (the loss scale changes between steps)."""
    def scaled(value):
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
            return _ScaleGradient.apply(value, factor)
        return value
    return tree_map(scaled, values)


def fp32_outputs(output, dtype: torch.dtype | None):
    """``output`` (a pytree) as the loss reads it after autocast: tensors in ``dtype`` as fp32."""
    if dtype is None:
        return output
    return tree_map(lambda value: value.float() if isinstance(value, torch.Tensor) and value.dtype == dtype
                    else value, output)


class LossScaler:
    """The loss scale of one fp16 model, GradScaler's defaults and update rule (powers of two)."""

    def __init__(self, scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.sharded_modules: list = []     # FSDP2 units whose reduce-scatter unscales (`unscale_in_reduce_scatter`)
        self.data_parallel_size = 1
        self.scale = scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0
        self.parameters: list[nn.Parameter] = []
        # Ranks whose gradients differ (FSDP shards, pipeline stages) decide together whether a step
        # is skipped: the layout sets the group, and every rank of it takes the same decision.
        self.agreement_group = None
        self._hidden: list[tuple[nn.Parameter, torch.Tensor]] | None = None

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = value
        for module in self.sharded_modules:
            module.set_gradient_divide_factor(self.data_parallel_size * value)

    def unscale_in_reduce_scatter(self, modules: list, data_parallel_size: int) -> None:
        """Under FSDP2 autograd accumulates into unsharded parameters, which FSDP reduce-scatters into
        the sharded ones' ``.grad``: a hook on either never holds the final gradient. FSDP's own
        division unscales instead: it sums the ranks' scaled gradients and divides by ranks x S
        (``FSDPModule.set_gradient_divide_factor``, kept equal to it as S changes), exact because S
        is a power of two, so ``.grad`` holds the true averaged gradient when backward returns, as
        under dp. Summed, not PREMUL_SUM (which gloo lacks): forced for more than one rank; on one
        rank FSDP only copies and divides, and forcing the sum would divide twice (torch 2.13)."""
        if data_parallel_size > 1 and not all(hasattr(module, "set_force_sum_reduction_for_comms")
                                              for module in modules):
            raise InputError(f"precision='fp16' under FSDP needs FSDPModule.set_force_sum_reduction_for_comms, "
                             f"which torch {torch.__version__} lacks; use precision='bf16' (no loss scaling)")
        self.sharded_modules, self.data_parallel_size = list(modules), data_parallel_size
        for module in self.sharded_modules:
            if data_parallel_size > 1:
                module.set_force_sum_reduction_for_comms(True)
        self.scale = self._scale

    def restore_reduce_scatter(self) -> None:
        """FSDP's plain average again (`oomless.remove`)."""
        for module in self.sharded_modules:
            module.set_gradient_divide_factor(float(self.data_parallel_size))
            if self.data_parallel_size > 1:
                module.set_force_sum_reduction_for_comms(False)
        self.sharded_modules = []

    def is_enabled(self) -> bool:
        return True   # read by oomless.parallel.overlap.needs_global_view, as GradScaler's

    def unscale(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * (1.0 / self.scale)

    def all_finite(self) -> bool:
        """Whether every gradient of ``parameters`` is finite, on every rank of ``agreement_group``.
        One host synchronisation per step, as GradScaler.step's found_inf.item(): whether the step
        runs at all cannot be decided on the device."""
        grads = [_local(p.grad) for p in self.parameters if p.grad is not None]
        finite = torch.stack([torch.isfinite(grad).all() for grad in grads]).all() if grads else None
        if self.agreement_group is None:
            return finite is None or bool(finite)
        import torch.distributed as dist

        # A rank without gradients (a pipeline rank before its first stage ran) still votes: yes.
        device = grads[0].device if grads else _group_device(self.agreement_group)
        vote = (finite if finite is not None else torch.ones((), dtype=torch.bool, device=device)).to(torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.agreement_group)
        return bool(vote)

    def before_step(self, optimizer, args, kwargs):
        if self.all_finite():
            return None
        # Skip: the optimizer steps only parameters that have a gradient, so hiding them makes this
        # one step() a no-op (no update, no state change), as GradScaler.step not calling it.
        self._hidden = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]
                        if p.grad is not None]
        for parameter, _ in self._hidden:
            parameter.grad = None
        return None

    def after_step(self, optimizer, args, kwargs):
        if self._hidden is not None:
            for parameter, grad in self._hidden:
                parameter.grad = grad
            self._hidden = None
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def _fsdp_modules(model: nn.Module) -> list:
    """The modules of ``model`` that FSDP2's ``fully_shard`` made units, outermost first. Without a
    process group there are none (``fully_shard`` needs one): no walk over the modules then."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return []
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that take gradients, each once (tied ones too)."""
    return [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2's gradients), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _group_device(group) -> torch.device:
    """The device a collective over ``group`` runs on: CUDA under NCCL, else the CPU (gloo)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Precision:
    """The hooks of one model's precision: autocast around its forward, loss scaling for fp16."""

    def __init__(self, precision: str, device_type: str, scaler: LossScaler | None = None):
        self.precision = precision
        self.dtype = autocast_dtype(precision)
        self.device_type = device_type
        self.scaler = scaler
        self.handles: list = []
        self.unscale_handles: list = []     # one per parameter, until the model is sharded
        self.guard = GradScalerGuard() if scaler is not None else None
        # Per model call: the autocast context we entered (or None), and torch's call frame (`runtime.open_calls`).
        self._entered: list = []

    def install(self, model: nn.Module, optimizer=None) -> None:
        # First of the model's pre-hooks: a refused autocast stops the call before the plan's
        # hooks open a forward.
        self.handles.append(model.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True))
        self.post_handle = model.register_forward_hook(self._post_hook, always_call=True)
        self.handles.append(self.post_handle)
        if self.scaler is None:
            return
        self.scaler.parameters = _trainable(model)
        self.unscale_handles = [parameter.register_hook(self.scaler.unscale) for parameter in self.scaler.parameters]
        self._unscaled = set(self.scaler.parameters)
        self.guard.install(self.scaler.parameters, optimizer)
        # The guard first: a GradScaler's step is refused before the scaler checks (and votes on) gradients.
        self.handles.append(optimizer.register_step_pre_hook(self.guard.before_step))
        self.handles.append(optimizer.register_step_pre_hook(self.scaler.before_step))
        self.handles.append(optimizer.register_step_post_hook(self.scaler.after_step))
        self.follow_sharding(model)

    def follow_sharding(self, model: nn.Module) -> None:
        """fp16 on a model sharded with FSDP2 (``fully_shard``, before or after this was installed):
        unscale in FSDP's reduce-scatter instead of per-parameter hooks (`LossScaler.
        unscale_in_reduce_scatter`), count the sharded parameters, and decide a skip on every rank
        together (each holds a shard of every gradient). Called on install, by `oomless.parallel.
        sharded.apply_fsdp`, and by the first forward after a caller's own ``fully_shard``."""
        if self.scaler is None or self.scaler.sharded_modules:
            return
        modules = _fsdp_modules(model)
        if not modules:
            return
        import torch.distributed as dist

        for handle in self.unscale_handles:       # on the parameters FSDP replaced: they never see a gradient
            handle.remove()
        self.unscale_handles = []
        self.guard.end_watch()
        self.scaler.parameters = _trainable(model)
        # The ranks FSDP averages over: the mesh of its sharded parameters (DTensors).
        mesh = next((p.device_mesh for p in self.scaler.parameters if hasattr(p, "device_mesh")), None)
        size = 1 if mesh is None else mesh.size()
        if size > 1:
            self.scaler.agreement_group = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
        self.scaler.unscale_in_reduce_scatter(modules, size)
        # After FSDP's post-forward, which hooks its pre-backward onto the outputs and warns when an
        # output is a view, as the scaling identity's are: hooked on the outputs before the scaling.
        self.handles.remove(self.post_handle)
        self.post_handle.remove()
        self.post_handle = model.register_forward_hook(self._post_hook, always_call=True)
        self.handles.append(self.post_handle)

    def follow_unfrozen(self, model: nn.Module) -> None:
        """fp16: a parameter that takes gradients since install (a backbone unfrozen after
        ``oomless.fit``, ``requires_grad_(True)``) is unscaled and checked for inf/nan as the others
        are; before, its ``.grad`` held S times its gradient (65536x) with nothing said. Under FSDP2
        the reduce-scatter unscales every parameter (`follow_sharding`)."""
        if self.scaler.sharded_modules:
            return
        trainable = _trainable(model)
        unfrozen = [parameter for parameter in trainable if parameter not in self._unscaled]
        if not unfrozen:
            return
        self.unscale_handles += [parameter.register_hook(self.scaler.unscale) for parameter in unfrozen]
        self._unscaled.update(unfrozen)
        self.scaler.parameters = trainable

    def uninstall(self) -> None:
        for handle in self.handles + self.unscale_handles:
            handle.remove()
        self.handles.clear()
        self.unscale_handles.clear()
        if self.scaler is not None:
            self.guard.end_watch()
            self.scaler.restore_reduce_scatter()

    def _pre_hook(self, model, args, kwargs):
        # Calls interrupted where torch calls no forward hook (a KeyboardInterrupt): their autocast off.
        while self._entered and not is_running(self._entered[-1][1]):
            context, _ = self._entered.pop()
            if context is not None:
                context.__exit__(None, None, None)
        if self.guard is not None and torch.is_grad_enabled() and self.guard.skipped_by_grad_scaler():
            self._entered.append((None, None))      # popped by the forward hook, which runs even when this raises
            raise InputError(DROPPED_MESSAGE)
        if torch.is_grad_enabled():
            self.follow_sharding(model)     # a caller's fully_shard after installing: before its backward
        context = None
        if torch.is_autocast_enabled(self.device_type):
            outer = torch.get_autocast_dtype(self.device_type)
            if outer != self.dtype:
                self._entered.append((None, None))
                planned = "fp32 (no autocast)" if self.dtype is None else f"{self.precision} ({self.dtype})"
                raise ApplyError(
                    f"the model runs under torch.autocast({self.device_type!r}, dtype={outer}) but oomless planned "
                    f"it for {planned}: its saved tensors are not the planned bytes. Plan with the precision of "
                    f"your autocast (precision='bf16' for bfloat16, 'fp16' for float16) or drop the autocast")
        elif self.dtype is not None:
            context = torch.autocast(self.device_type, dtype=self.dtype)
            context.__enter__()
        self._entered.append((context, module_call_frame()))
        if self.scaler is not None and torch.is_grad_enabled():
            self.follow_unfrozen(model)
            # A gradient leaving the model through an input is the caller's: give it back unscaled.
            return scaled_gradients((args, kwargs), lambda: 1.0 / self.scaler.scale)
        return None

    def _post_hook(self, model, args, output):
        if not self._entered:
            return None
        context, _ = self._entered.pop()
        if context is not None:
            context.__exit__(None, None, None)
            if output is None:
                return None   # forward raised: nothing to convert
            output = fp32_outputs(output, self.dtype)
        elif self.scaler is None:
            return None
        return output if self.scaler is None else scaled_gradients(output, lambda: self.scaler.scale)


def check_can_apply(model: nn.Module, precision: str, optimizer, device: torch.device) -> None:
    """Every reason `apply_precision` would refuse, checked before anything is installed."""
    if getattr(model, STATE_ATTRIBUTE, None) is not None:
        raise ApplyError("a precision is already applied to this model; oomless.remove(model) first")
    check_precision(precision, device)
    if precision == "fp16" and optimizer is None:
        raise InputError("precision='fp16' needs the optimizer (optimizer=...): loss scaling skips its step "
                         "when gradients overflow; or use precision='bf16', which needs no scaling")


def apply_precision(model: nn.Module, precision: str, optimizer=None, device: torch.device | None = None) -> Precision:
    """Install ``precision``'s hooks on ``model`` in place (see the module docstring); fp32 installs
    only the check against a caller's autocast. fp16 needs ``optimizer``: its steps are the ones
    skipped when gradients overflow."""
    from oomless.profile.tensors import model_device

    device = device or model_device(model)
    check_can_apply(model, precision, optimizer, device)
    state = Precision(precision, device.type, LossScaler() if precision == "fp16" else None)
    state.install(model, optimizer)
    object.__setattr__(model, STATE_ATTRIBUTE, state)
    return state


@contextmanager
def profiling_precision(model: nn.Module, precision: str, device: torch.device):
    """Autocast hooks for a profiling step: the step's dtypes and bytes, no loss scaling (scaling
    changes no size, and profiling takes no optimizer step)."""
    check_precision(precision, device)
    if device.type != "meta" and torch.is_autocast_enabled(device.type):
        outer = torch.get_autocast_dtype(device.type)
        if outer != autocast_dtype(precision):
            raise InputError(f"oomless.plan is called under torch.autocast({device.type!r}, dtype={outer}) with "
                             f"precision={precision!r}; pass the precision of your autocast (precision='bf16' for "
                             "bfloat16, 'fp16' for float16) so the plan is sized for the bytes your step saves")
    state = Precision(precision, device.type)
    state.install(model)
    try:
        yield
    finally:
        state.uninstall()


def remove_precision(model: nn.Module) -> None:
    state = getattr(model, STATE_ATTRIBUTE, None)
    if state is not None:
        state.uninstall()
        object.__delattr__(model, STATE_ATTRIBUTE)


def precision_state(model: nn.Module) -> Precision | None:
    return getattr(model, STATE_ATTRIBUTE, None)


def loss_scale_state(model: nn.Module) -> dict | None:
    """The fp16 loss scale's state (for checkpoints and rebuilt models), or None without fp16."""
    scaler = getattr(precision_state(model), "scaler", None)
    return None if scaler is None else scaler.state_dict()


def load_loss_scale_state(model: nn.Module, state: dict | None) -> None:
    scaler = getattr(precision_state(model), "scaler", None)
    if scaler is not None and state is not None:
        scaler.load_state_dict(state)


def skipped_steps(model: nn.Module) -> int | None:
    """fp16: optimizer steps skipped so far for inf/nan gradients; None without loss scaling."""
    scaler = getattr(precision_state(model), "scaler", None)
    return None if scaler is None else scaler.skipped_steps
