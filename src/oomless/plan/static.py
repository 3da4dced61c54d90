"""Static bytes (parameters, gradients, optimizer state, buffers, inputs): how many, where each
lives, and the decisions that move them. Today one decision: the optimizer step in backward, which
frees each gradient as soon as its parameter is updated (`oomless.runtime.update_in_backward`), so
the device holds the gradients of one module at a time instead of all of them.

The planner decides it for the budget, or the user forces it (``update_in_backward=True/False``):
- off when the loop needs every gradient first (clipping by global norm), when there is no
  optimizer to step, or with an optimizer that steps all parameters at once (LBFGS);
- off when the plain step (every block kept) fits without it: nothing to gain, and one optimizer
  call per parameter costs more than one over all of them;
- otherwise the activation plan is made both ways and the faster one that fits is chosen: the bytes
  the gradients free are room for activations (fewer swaps and recomputes), against the measured
  cost of the extra optimizer calls;
- with gradient accumulation over k > 1 micro-batches every gradient is alive during the last
  micro-batch anyway: the planner never chooses it (forced, it still works and is counted at full size).

The activation planner (`plan.planner.make_plan`) is given the profile as the device sees it under
these decisions (`device_view`): the same step with fewer static bytes on the device.
"""

import collections
import dataclasses
import time

import torch
from torch import nn

from oomless.errors import InputError, PlanError
from oomless.plan.plan import Plan, StaticPart
from oomless.profile.profile import Profile
from oomless.runtime.optimizer_slices import NOT_SLICEABLE, OptimizerSlice
from oomless.sizes import format_bytes

ON_DEVICE = "device"
IN_BACKWARD = "device, one module's at a time (update in backward)"


@dataclasses.dataclass
class StaticRequest:
    """What the user asked for and what the loop does, for the static decisions."""

    update_in_backward: bool | None = None     # True/False forces it; None lets the planner decide
    max_grad_norm: float | None = None         # the loop clips by global norm
    accumulation_steps: int = 1                # micro-batches per optimizer step

    def check(self) -> None:
        if self.update_in_backward not in (None, True, False):
            raise InputError(f"update_in_backward must be True, False or None (the planner decides), "
                             f"got {self.update_in_backward!r}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise InputError(f"accumulation_steps must be a positive int (micro-batches per optimizer step), "
                             f"got {self.accumulation_steps!r}")


def why_not_in_backward(optimizer, max_grad_norm: float | None) -> str | None:
    """The reason the step cannot run in backward, or None."""
    if optimizer is None:
        return "it steps the optimizer, and none was given (pass optimizer=)"
    if isinstance(optimizer, NOT_SLICEABLE):
        return f"{type(optimizer).__name__} steps every parameter at once"
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return ("under data parallel each gradient must be averaged across ranks before the update "
                "(oomless.parallel's overlapped update steps each bucket after its all-reduce)")
    if max_grad_norm is not None:
        return ("clipping by global norm (max_grad_norm) needs every gradient before the first update, and in "
                "backward each parameter is updated as soon as its own gradient is ready")
    return None


def gradient_bytes_in_backward(model: nn.Module, profile: Profile) -> int:
    """Gradient bytes alive at once when each is freed after its update: a module's own parameters'.

    Autograd runs a parameter's AccumulateGrad as soon as its gradient is complete (those nodes go
    first in its ready queue), so the gradients alive together are those one node produced: a
    module's own parameters (a Linear's weight and bias). Scaled to the profile's gradient bytes, so
    a target's dtype applies."""
    trainable = {id(param): param for param in model.parameters() if param.requires_grad}
    total_elements = sum(param.numel() for param in trainable.values())
    if not total_elements:
        return 0
    largest = max((sum(param.numel() for param in module.parameters(recurse=False) if param.requires_grad)
                   for module in model.modules()), default=0)
    return -(-profile.gradient_bytes * largest // total_elements)


def device_view(profile: Profile, gradient_device_bytes: int) -> Profile:
    """The profile with only the static bytes the device holds."""
    return dataclasses.replace(profile, gradient_bytes=gradient_device_bytes)


def static_parts(profile: Profile, gradient_device_bytes: int) -> list[StaticPart]:
    gradients_where = ON_DEVICE if gradient_device_bytes >= profile.gradient_bytes else IN_BACKWARD
    return [StaticPart("parameters", profile.parameter_bytes, profile.parameter_bytes, ON_DEVICE),
            StaticPart("gradients", profile.gradient_bytes, min(gradient_device_bytes, profile.gradient_bytes),
                       gradients_where),
            StaticPart("optimizer state", profile.optimizer_state_bytes, profile.optimizer_state_bytes, ON_DEVICE),
            StaticPart("buffers", profile.buffer_bytes, profile.buffer_bytes, ON_DEVICE),
            StaticPart("inputs", profile.input_bytes, profile.input_bytes, ON_DEVICE)]


def per_parameter_step_seconds(optimizer, repeats: int = 20) -> float | None:
    """The fixed cost of one optimizer call (the update in backward makes one per parameter where the
    plain step makes one), measured on a one-element parameter on the parameters' device; None where
    it cannot run (meta parameters of a target)."""
    device = next((param.device for group in optimizer.param_groups for param in group["params"]),
                  torch.device("cpu"))
    if device.type == "meta":
        return None
    probe = nn.Parameter(torch.zeros(1, device=device))
    probe.grad = torch.zeros(1, device=device)
    try:
        scratch = OptimizerSlice(optimizer, [probe], {probe: 0})
        scratch.optimizer.state = collections.defaultdict(dict)     # never the user's state
        scratch.step()                          # state initialisation is not the per-call cost
        if device.type == "cuda":
            torch.cuda.synchronize(device)      # time the calls, not kernels queued before them
        started = time.perf_counter()
        for _ in range(repeats):
            scratch.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)      # the kernels' time belongs to the calls
        return (time.perf_counter() - started) / repeats
    except (RuntimeError, InputError):
        return None


def plan_with_static_decisions(profile: Profile, model: nn.Module, optimizer, request: StaticRequest,
                               plan_activations) -> Plan:
    """Decide the static placements, make the activation plan for them with
    ``plan_activations(device_profile) -> Plan`` and record both in the returned plan."""
    request.check()
    blocker = why_not_in_backward(optimizer, request.max_grad_norm)
    if request.update_in_backward is True and blocker is not None:
        raise InputError(f"update_in_backward=True is not possible: {blocker}; use update_in_backward=None "
                         "(the planner then keeps the update after backward) or False")
    full_gradients = profile.gradient_bytes
    in_backward_gradients = full_gradients if request.accumulation_steps > 1 else \
        gradient_bytes_in_backward(model, profile)

    def attempt(in_backward: bool):
        gradient_bytes = in_backward_gradients if in_backward else full_gradients
        try:
            return plan_activations(device_view(profile, gradient_bytes)), gradient_bytes
        except PlanError as refused:
            return refused, gradient_bytes

    if request.update_in_backward is not None or blocker is not None:
        in_backward = bool(request.update_in_backward)
        reason = ("given by the user" if request.update_in_backward is not None else blocker)
        chosen, gradient_bytes = attempt(in_backward)
    else:
        in_backward, chosen, gradient_bytes, reason = _decide(profile, optimizer, request, attempt,
                                                              full_gradients, in_backward_gradients)
    if isinstance(chosen, PlanError):
        raise chosen
    chosen.update_in_backward, chosen.accumulation_steps = in_backward, request.accumulation_steps
    chosen.static_parts = static_parts(profile, gradient_bytes)
    # The activation planner saw the device's static bytes; plain PyTorch holds all of them.
    chosen.plain_peak_bytes += sum(part.total_bytes - part.device_bytes for part in chosen.static_parts)
    chosen.notes.append(f"update in backward: {'on' if in_backward else 'off'} ({reason})")
    return chosen


def _decide(profile, optimizer, request, attempt, full_gradients, in_backward_gradients):
    """(in backward?, plan or PlanError, device gradient bytes, reason) when the planner decides."""
    without, without_bytes = attempt(False)
    if isinstance(without, Plan) and set(without.decisions.values()) <= {"keep"}:
        return False, without, without_bytes, "the step fits with every block kept: nothing to gain"
    if request.accumulation_steps > 1:
        return False, without, without_bytes, (f"with {request.accumulation_steps} micro-batches per step every "
                                                "gradient is alive in the last one: nothing to gain")
    freed = f"{format_bytes(full_gradients - in_backward_gradients)} of {format_bytes(full_gradients)} gradients freed"
    with_it, with_bytes = attempt(True)
    if isinstance(with_it, PlanError):
        if isinstance(without, Plan):
            return False, without, without_bytes, "the plan fits only without it"
        # The smallest memory reported is the one with the step in backward: planning again with it
        # (and update_in_backward=None) chooses it and fits.
        refused = PlanError(f"{with_it} (counting the gradients the optimizer step in backward frees, {freed}; "
                            "with update_in_backward=False the minimum is higher)",
                            minimum_bytes=with_it.minimum_bytes, limiting_block=with_it.limiting_block)
        return False, refused, without_bytes, "no plan fits either way"
    if isinstance(without, PlanError):
        return True, with_it, with_bytes, f"{freed}: without it no plan fits"
    per_call = per_parameter_step_seconds(optimizer)
    calls_seconds = (per_call or 0.0) * sum(
        1 for group in optimizer.param_groups for param in group["params"] if param.requires_grad)
    with_seconds = with_it.predicted_step_seconds + calls_seconds
    calls = "not measured here" if per_call is None else f"{calls_seconds * 1e3:.1f} ms"
    comparison = (f"{freed}; predicted step {with_seconds * 1e3:.1f} ms with it (per-parameter optimizer "
                  f"calls {calls}) against {without.predicted_step_seconds * 1e3:.1f} ms without")
    if with_seconds < without.predicted_step_seconds:
        return True, with_it, with_bytes, comparison
    return False, without, without_bytes, comparison
