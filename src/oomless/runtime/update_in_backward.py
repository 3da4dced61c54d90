"""Update in backward (seed 001's buffer reuse): each module's optimizer step runs as soon as the
gradients of the parameters it registers itself are accumulated (a Linear's weight and bias, which
one autograd node makes together), and the gradients are freed right after, so the gradients alive
at once are those of the parameters whose step has not run yet, not all of them.

    oomless.fit(model, inputs, memory="2GiB", optimizer=optimizer, update_in_backward=True)
    for batch in data:                 # the loop is unchanged
        loss_fn(model(batch)).backward()   # every parameter is updated here
        optimizer.step()               # nothing left to do for those parameters
        optimizer.zero_grad()          # their gradients are already gone
        scheduler.step()               # applies from the next backward on, as in the plain loop

Hook points (PyTorch's own; the shape of PyTorch's tutorial "How to save memory by fusing the
optimizer step into the backward pass" and of ``torch.distributed.optim._apply_optimizer_in_backward``):
``Tensor.register_post_accumulate_grad_hook`` on every trainable parameter the optimizer holds, and
``Optimizer.register_step_pre_hook`` on the user's optimizer. Both are removed by `remove`
(``oomless.remove(model)``), which leaves the model and optimizer exactly as plain PyTorch uses them.

Why the result is bit for bit the plain step's:
- Each module's parameters are stepped alone by a slice of the user's optimizer
  (`oomless.runtime.optimizer_slices`, ``step_only``: each group's parameter list is its share of them
  for the call): the user's class, its groups' settings re-read at each step, the user's state dict.
  Per-parameter optimizers compute each parameter on its own. A module whose other parameters get no
  gradient in a step (unused in that forward) has its ready ones stepped at the user's ``optimizer.step()``.
- Autograd runs a parameter's AccumulateGrad node only after every node that contributes to its
  gradient, and those are the nodes that saved it; so no later part of backward reads the parameter
  the update has just written (a recomputed block recomputes before its own parameters' gradients
  exist). A read outside the gradient's path (a tensor saved as ``param.detach()``, a recompute block
  reading another module's weight without its gradient) could come after the update: such a
  parameter's module is updated at the end of backward instead (`oomless.runtime.parameter_reads`).
- The user's ``optimizer.step()`` and ``zero_grad()`` skip parameters whose ``grad`` is None (every
  ``torch.optim`` optimizer does): for the parameters updated here they are no-ops; parameters the
  hooks do not cover (frozen, not in this model) are stepped by the user's call as before.

The same per-parameter update carries the optimizer state off the device (`offload_state`: brought
in around each parameter's step, in backward or, with ``in_backward=False``, inside the user's
``optimizer.step()``) and the blocks' parameters (`offload_parameters`: written out after their update).
With ``in_backward=False`` the gradients stay after ``optimizer.step()`` until ``zero_grad``, as in the
plain loop (gradient norms can be logged after the step): the plan counts every gradient on the device
through that step anyway. They are hidden from the user's own step while it runs (a step pre-hook sets
``grad`` to None, its post-hook puts them back) so that it does not step them a second time; after a
step that raises they stay None (its post-hook does not run), and the next step's pre-hook drops them.
In backward they are freed at each update, which is the memory that mode saves.

The loop's other habits:
- LR schedulers and hand-changed settings work: the slices copy the user's param groups before each
  step, during backward; a scheduler stepped after ``optimizer.step()`` applies from the next backward,
  exactly as in the plain loop. The user's ``optimizer.step()`` still runs (its parameters have no
  gradients), so the scheduler sees it called.
- Gradient accumulation over micro-batches: pass ``accumulation_steps=k``; each parameter is stepped at
  its k-th gradient, the earlier ones accumulate as usual (so they are all alive in the last
  micro-batch: no memory is saved; the planner never chooses this with k > 1). A parameter that gets a
  gradient after its update with no ``optimizer.step()`` in between (accumulation without telling),
  or ``optimizer.step()`` after fewer than k micro-batches, raises `InputError`; but ``zero_grad()``
  after fewer than k (a step skipped after an error or a non-finite loss) starts the count again, as
  the plain loop starts accumulating again (a hook before each accumulation sees the gradient gone),
  and a step after a backward that raised applies every gradient there is, as the plain step does.
- Clipping by global norm needs every gradient before the first update: refused at ``plan``/``fit``
  when ``max_grad_norm`` is given. A ``clip_grad_norm_`` in the loop would see no gradients.
- fp16 loss scaling (``GradScaler``) must skip the whole step on overflow, which cannot be known before
  the last gradient: ``GradScaler.step`` finds no gradients and asserts.
- A backward that raises (a loop that recovers from out of memory: zero_grad, next batch, no
  ``optimizer.step()``): the modules it had updated stay updated (plain PyTorch would have stepped
  none); the next backward warns, naming them, and counts from zero. Units it had completed but not
  updated yet (deferred to its end, or waiting for a partner) are dropped, as the plain loop drops
  their gradients. A backward is recognised by autograd's graph task: a callback queued at its first
  gradient runs at its end; one that raised is dropped unrun (a weak reference finds it gone), while a
  backward nested in it (a reentrant checkpoint) finds it still alive. Not recognised: a failure after
  the first gradients came from a nested backward (the model's last modules inside a reentrant
  checkpoint), whose end is taken for the whole one's; the next backward raises `InputError` then.
"""

import warnings
import weakref

import torch
from torch import nn

from oomless.errors import ApplyError, InputError
from oomless.runtime.offload_parameters import OffloadedParameters
from oomless.runtime.offload_state import MIN_OFFLOAD_BYTES, OffloadedState
from oomless.runtime.optimizer_slices import OptimizerSlice, check_sliceable, group_index_of
from oomless.runtime.parameter_reads import ParameterReads

STATE_ATTRIBUTE = "_oomless_update_in_backward"


def update_units(model: nn.Module, parameters) -> dict[nn.Parameter, tuple[nn.Parameter, ...]]:
    """Each of ``parameters`` -> the parameters stepped with it in one optimizer call: those of
    ``parameters`` its module registers itself (a Linear's weight and bias, made by one autograd
    node, ready together; a parameter registered twice belongs to the first module). One call per
    module rather than per parameter (each call has its fixed cost: wrappers, hooks, group setup):
    on a 16-block transformer the update in backward went from 1.15x to 1.12x the all-on-device
    step. The planner counts one module's gradients alive and one call per unit (`plan.static`)."""
    updated = set(parameters)
    unit_of: dict[nn.Parameter, tuple[nn.Parameter, ...]] = {}
    for module in model.modules():
        own = tuple(param for param in module.parameters(recurse=False) if param in updated and param not in unit_of)
        unit_of.update(dict.fromkeys(own, own))
    return unit_of


class UpdateInBackward:
    """Per-parameter updates of ``optimizer`` over ``model``'s parameters; kept as
    ``model._oomless_update_in_backward``.

    ``in_backward=True``: each parameter's step runs in its post-accumulate-grad hook (the module
    docstring). ``in_backward=False`` (only with ``offload_state``: clipping needs all gradients first):
    the steps run one parameter at a time inside the user's ``optimizer.step()`` (its step pre-hook),
    each gradient consumed as ``zero_grad(set_to_none=True)`` would, so that the user's own step, which
    runs after the hook, finds nothing left to do. ``offload_state``: the optimizer state lives off
    the device between updates (`oomless.runtime.offload_state`). ``offload_blocks`` (name, module)
    pairs: those blocks' parameters live off the device between uses (`oomless.runtime.offload_parameters`;
    in backward only, each written out after its update)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, accumulation_steps: int = 1,
                 in_backward: bool = True, offload_state: bool = False, min_offload_bytes: int = MIN_OFFLOAD_BYTES,
                 offload_blocks: list[tuple[str, nn.Module]] | None = None):
        check_sliceable(optimizer)
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise InputError(f"accumulation_steps must be a positive int (micro-batches per optimizer step), "
                             f"got {accumulation_steps!r}")
        if not in_backward and not offload_state:
            raise InputError("a per-parameter update after backward is only for offloaded optimizer state; "
                             "without it the optimizer's own step is the same and faster")
        if offload_blocks and (not in_backward or accumulation_steps > 1):
            raise InputError("parameters off the device are updated as soon as their gradients are ready (each "
                             "is written out after its update): they need the update in backward, one backward "
                             "per step (no gradient accumulation)")
        if getattr(optimizer, STATE_ATTRIBUTE, None) is not None:
            raise ApplyError("this optimizer already updates per parameter for a model; oomless.remove that model first")
        self.model = model
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.in_backward = in_backward
        group_of = group_index_of(optimizer)
        self.names = {param: name for name, param in model.named_parameters()
                      if param.requires_grad and param in group_of}
        if not self.names:
            raise InputError("the optimizer holds none of the model's trainable parameters: nothing to update "
                             "per parameter (pass the optimizer that trains this model)")
        # One slice over every parameter updated here; each update steps one unit of them (`step_only`).
        self.slice = OptimizerSlice(optimizer, list(self.names), group_of)
        self.unit_of = update_units(model, self.names)
        self._ready: dict[tuple, list[nn.Parameter]] = {}          # units whose gradients are partly ready
        # Units whose parameters backward reads outside their gradients' path: updated at its end.
        self.reads = ParameterReads(self) if in_backward else None
        self._at_backward_end: list[list[nn.Parameter]] = []
        self.gradients_seen = dict.fromkeys(self.names, 0)      # since the user's last optimizer.step()
        self._backward_end: weakref.ref | None = None           # the running backward's end callback
        self._updated_this_backward: list[nn.Parameter] = []
        self._grad_versions: dict[nn.Parameter, int] = {}      # after each accumulation not yet applied
        self.steps_in_backward = 0                              # counted for tests and stats
        self.state = self.parameters_off = None
        device = next(iter(self.names)).device
        if offload_state:
            self.state = OffloadedState(optimizer, list(self.names), device, min_offload_bytes, self.unit_of)
        if offload_blocks:
            self.parameters_off = OffloadedParameters(model, offload_blocks, device)
        self.handles = []
        if in_backward:
            self.handles += [param.register_post_accumulate_grad_hook(self._gradient_accumulated)
                             for param in self.names]
        if in_backward and accumulation_steps > 1:
            # Before each gradient is accumulated: whether the loop dropped the micro-batches so far.
            self.handles += [param.register_hook(self._arriving(param)) for param in self.names]
        self._hidden_gradients: dict[nn.Parameter, torch.Tensor] = {}     # during the user's step
        self.handles.append(optimizer.register_step_pre_hook(self._before_user_step))
        if not in_backward:
            self.handles.append(optimizer.register_step_post_hook(self._after_user_step))
        setattr(optimizer, STATE_ATTRIBUTE, self)

    def _update(self, params: list[nn.Parameter]) -> None:
        self.slice.read_settings()
        if self.state is not None:
            for param in params:
                self.state.bring_in(param)
        self.slice.step_only(params)
        if self.in_backward:
            for param in params:
                param.grad = None       # this gradient's memory is free for the rest of backward
        if self.state is not None:
            for param in params:
                self.state.send_out(param)
            self.state.prefetch_after(params[-1])
        if self.parameters_off is not None:
            for param in params:
                self.parameters_off.updated(param)

    def _gradient_accumulated(self, param: nn.Parameter) -> None:
        self._note_backward()
        seen = self.gradients_seen[param] + 1
        if seen > self.accumulation_steps:
            raise InputError(
                f"parameter {self.names[param]} got a gradient after its update in backward with no "
                f"step() of the optimizer the plan was applied with ({type(self.optimizer).__name__}) in between; "
                f"its update ran after {self.accumulation_steps} backward pass(es). Call that optimizer's step() "
                "once per step (it is a no-op for the parameters updated in backward), also where the loop skips "
                "a step after its backward (an error or a check after backward: that backward's update has "
                "been applied already), and for gradient accumulation over k micro-batches pass "
                "accumulation_steps=k. The plan steps that optimizer in backward: to train with a new one, "
                "oomless.remove(model), then oomless.apply(model, plan, optimizer=new_optimizer). A backward "
                "through this model for another model's loss (a GAN's generator step through its discriminator) "
                "steps it too, as it steps the model in every backward: freeze it for that backward "
                "(model.requires_grad_(False)) or plan it with update_in_backward=False")
        self.gradients_seen[param] = seen
        if seen < self.accumulation_steps:
            self._grad_versions[param] = param.grad._version     # `_arriving` tells a zero_() by it
        if seen == self.accumulation_steps:
            unit = self.unit_of[param]
            ready = self._ready.setdefault(unit, [])
            ready.append(param)
            if len(ready) == len(unit):
                del self._ready[unit]
                if self.reads is not None and self.reads.defers(ready):
                    # One callback per unit (the first finds them all, the others none): a backward
                    # that raised before its end left its units here without running its callback.
                    self._at_backward_end.append(ready)
                    torch.autograd.Variable._execution_engine.queue_callback(self._update_at_backward_end)
                    return
                self._step_unit(ready)

    def _arriving(self, param: nn.Parameter):
        def hook(grad):
            if 0 < self.gradients_seen[param] < self.accumulation_steps and self._dropped(param):
                # zero_grad() after micro-batches not yet applied (a step skipped after an error or a
                # non-finite loss): the plain loop starts accumulating again, and so does the count.
                self.gradients_seen[param] = 0
        return hook

    def _dropped(self, param: nn.Parameter) -> bool:
        """Whether the gradient accumulated so far is gone: set to None, or zeroed in place
        (``zero_grad(set_to_none=False)``: its version moved, and it holds zeros; values are read
        only then, a wait for the device on CUDA)."""
        grad = param.grad
        if grad is None:
            return True
        return grad._version != self._grad_versions.get(param) and not bool(grad.any())

    def _last_backward_raised(self) -> bool:
        """Its end callback was queued and is gone unrun (`_BackwardEnd`)."""
        return self._backward_end is not None and self._backward_end() is None

    def _note_backward(self) -> None:
        if self._last_backward_raised():
            self._forget_failed_backward()
        elif self._backward_end is not None:
            return      # this backward, or one nested in it (a reentrant checkpoint's)
        end = _BackwardEnd(self._backward_ended)
        self._backward_end = weakref.ref(end)
        torch.autograd.Variable._execution_engine.queue_callback(end)

    def _backward_ended(self) -> None:
        self._backward_end = None
        self._updated_this_backward = []

    def _forget_failed_backward(self) -> None:
        """The last backward raised before its end and no ``optimizer.step()`` followed: its counts
        start again; what it had updated cannot be undone (the module docstring)."""
        updated = self._updated_this_backward
        self._at_backward_end = []
        self._start_counting()
        if updated:
            names = sorted((self.names[param] for param in updated), key=list(self.names.values()).index)
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            warnings.warn(
                f"a backward that raised had already updated {len(names)} parameters ({shown}) with that "
                "batch's gradients: the update in backward steps each module as soon as its gradients are "
                "complete, and cannot undo it (the plain loop, which steps after backward, would have "
                "stepped none). The other gradients of that backward are dropped and counting starts again "
                "with this one. To skip a failed batch without any update, plan with update_in_backward=False",
                stacklevel=2)

    def _start_counting(self) -> None:
        """A new optimizer step's counts: after the user's step, or a backward that raised."""
        self._ready.clear()
        self.gradients_seen = dict.fromkeys(self.gradients_seen, 0)
        self._grad_versions = {}
        self._backward_ended()

    def _update_at_backward_end(self) -> None:
        units, self._at_backward_end = self._at_backward_end, []
        for ready in units:
            self._step_unit(ready)

    def _step_unit(self, ready: list[nn.Parameter]) -> None:
        """Update one module's parameters, counted as stepped by the plan rather than by the user's step."""
        self._update(ready)
        self.steps_in_backward += len(ready)
        self._updated_this_backward += ready

    def _before_user_step(self, optimizer, args, kwargs) -> None:
        self._hidden_gradients = {}     # left by a step that raised: stale, not put back
        if not self.in_backward:
            # The order of the last step's updates (backward's order) is the one prefetching follows.
            order = list(self.state.order) or list(reversed(self.names))
            known = set(order)
            order += [param for param in self.names if param not in known]
            for param in order:
                if param.grad is not None:
                    self._update([param])
                    # Hidden from the user's step, which runs next and would step it again.
                    self._hidden_gradients[param], param.grad = param.grad, None
            self.state.step_finished()
            return
        partial = [param for param, seen in self.gradients_seen.items() if 0 < seen < self.accumulation_steps]
        if self._last_backward_raised():
            # A step after a backward that raised: the plain step applies every gradient there is,
            # micro-batches short or not.
            waiting: dict[tuple, list[nn.Parameter]] = {}
            for param in partial:
                if param.grad is not None:
                    waiting.setdefault(self.unit_of[param], []).append(param)
            for ready in waiting.values():
                self._step_unit(ready)
        elif partial:
            name, seen = self.names[partial[0]], self.gradients_seen[partial[0]]
            raise InputError(f"optimizer.step() after {seen} of accumulation_steps={self.accumulation_steps} "
                             f"micro-batches (parameter {name} and {len(partial) - 1} more have accumulated "
                             "gradients not yet applied); step after every k-th backward, or plan with the "
                             "accumulation_steps the loop uses")
        self._update_at_backward_end()     # left by a backward that raised before its end
        self.reads.refresh()
        # A module's parameters whose partners got no gradient this step (unused in the forward).
        for ready in self._ready.values():
            self._step_unit(ready)
        self._start_counting()
        if self.state is not None:
            self.state.step_finished()
        if self.parameters_off is not None:
            self.parameters_off.step_finished()

    def _after_user_step(self, optimizer, args, kwargs) -> None:
        for param, grad in self._hidden_gradients.items():
            param.grad = grad
        self._hidden_gradients = {}

    def remove(self) -> None:
        """Remove the hooks (and bring offloaded state back): from the next backward on, gradients
        stay for the user's step."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.state is not None:
            self.state.remove()
            self.state = None
        if self.parameters_off is not None:
            self.parameters_off.remove()
            self.parameters_off = None
        if getattr(self.optimizer, STATE_ATTRIBUTE, None) is self:
            delattr(self.optimizer, STATE_ATTRIBUTE)


class _BackwardEnd:
    """Queued with autograd at a backward's first gradient, run at its end; held only by autograd,
    so a backward that raised leaves it to be freed unrun."""

    def __init__(self, ended):
        self.ended = ended

    def __call__(self) -> None:
        self.ended()


def apply_update_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer, accumulation_steps: int = 1,
                             in_backward: bool = True, offload_state: bool = False,
                             min_offload_bytes: int = MIN_OFFLOAD_BYTES,
                             offload_blocks: list[tuple[str, nn.Module]] | None = None) -> UpdateInBackward:
    """Step ``optimizer`` per parameter during ``model``'s backward (see the module docstring)."""
    if getattr(model, STATE_ATTRIBUTE, None) is not None:
        raise ApplyError("this model already updates per parameter; oomless.remove(model) first")
    update = UpdateInBackward(model, optimizer, accumulation_steps, in_backward, offload_state, min_offload_bytes,
                              offload_blocks)
    object.__setattr__(model, STATE_ATTRIBUTE, update)
    return update


def installed_update(model: nn.Module) -> UpdateInBackward | None:
    return getattr(model, STATE_ATTRIBUTE, None)


def remove_update_in_backward(model: nn.Module) -> None:
    update = getattr(model, STATE_ATTRIBUTE, None)
    if update is not None:
        update.remove()
        object.__delattr__(model, STATE_ATTRIBUTE)
