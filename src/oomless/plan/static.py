"""Static bytes (parameters, gradients, optimizer state, buffers, inputs): how many, where each
lives, and the decisions that move them off the device:

- the optimizer step in backward (`oomless.runtime.update_in_backward`): each gradient is freed as
  soon as its parameter is updated, so the device holds one module's gradients, not all of them;
- the optimizer state off the device (`oomless.runtime.offload_state`): each parameter's state lives
  in pinned host memory (CUDA) or the disk tier (CPU) between its updates, so the device holds the
  states of the few parameters being updated; the step streams them in and out;
- the parameters off the device (`oomless.runtime.offload_parameters`, with the update in backward):
  each block's own parameters live in the same tier between uses, brought in before its forward and
  its backward (prefetched one block ahead) and written out after their update, so the device holds
  a few blocks' parameters and those shared across blocks.

Each is forced by the user (``update_in_backward=``, ``offload_optimizer_state=``,
``offload_parameters=``: True/False) or decided here for the budget (None), with the reason in the
plan's notes:
- neither is possible without an optimizer, with an optimizer that steps all parameters at once
  (LBFGS), or under data parallel (each gradient is averaged across ranks before any update);
- the step in backward is not possible when the loop clips by global norm (every gradient is needed
  before the first update), and saves nothing with gradient accumulation (every gradient is alive in
  the last micro-batch): never chosen then (forced with accumulation, it works and is counted full);
- when the step fits with every block kept and everything on the device, nothing moves;
- otherwise the activation plan is made for each possible placement, and the fastest that fits is
  chosen: its predicted step plus what the placement adds (the measured cost of one optimizer call
  per module; the bytes moved over the tier's measured link, not assumed hidden: the state out
  and in, the parameters in twice and out once; on a CPU-only run, where they are mapped files, at
  the rates measured mapping and writing one, `runtime.tiers.mapped_files_rates`).
  Freed static bytes are room for activations, so moving them can also buy fewer swaps and recomputes.

The activation planner (`plan.planner.make_plan`) is given the profile as the device sees it under a
placement (`device_view`): the same step with fewer static bytes on the device.

Sharded data parallel (``shard_over=N``, `oomless.parallel.sharded`: FSDP2 per block, then the root)
changes what the device holds before any placement: each rank keeps its shard of every parameter,
gradient and optimizer state (1/N of dim 0, rounded up, as FSDP pads it), plus, unsharded, the
root's own parameters and gradients (FSDP keeps the root unsharded through the step) and those of
two blocks (the one computing and the one gathered ahead); `sharded_device_bytes`. FSDP decides where
parameters and gradients live, so none of the placements above is possible then.
"""

import math

import dataclasses
import time

import torch
from torch import nn

from oomless.errors import InputError, PlanError
from oomless.plan.plan import Plan, StaticPart
from oomless.plan.optimizer_step import optimizer_step_other_bytes
from oomless.plan.static_phases import with_phase_static
from oomless.profile.profile import Profile
from oomless.runtime.optimizer_slices import NOT_SLICEABLE, OptimizerSlice
from oomless.runtime.tiers import mapped_files_rates
from oomless.runtime.update_in_backward import update_units
from oomless.sizes import format_bytes

ON_DEVICE = "device"
IN_BACKWARD = "device, one module's at a time (update in backward)"
# Parameters whose state is on the device at once when it is offloaded: the one being updated, the
# prefetched one (OffloadedState's prefetch_parameters=1) and one still being copied out.
STATE_PARAMETERS_IN_FLIGHT = 3
# Blocks whose parameters are on the device at once when they are offloaded: the running one, the
# prefetched one, and one whose updated parameters are still being copied out.
PARAMETER_BLOCKS_IN_FLIGHT = 3
# Blocks unsharded at once under FSDP: the one computing, and the next one all-gathered ahead
# (FSDP2's implicit prefetch: forward and backward each issue the next block's all-gather first).
SHARDED_BLOCKS_UNSHARDED = 2


@dataclasses.dataclass
class StaticRequest:
    """What the user asked for and what the loop does, for the static decisions."""

    update_in_backward: bool | None = None       # True/False forces it; None lets the planner decide
    offload_optimizer_state: bool | None = None  # idem
    offload_parameters: bool | None = None       # idem
    max_grad_norm: float | None = None           # the loop clips by global norm
    accumulation_steps: int = 1                  # micro-batches per optimizer step
    shard_over: int = 1                          # ranks sharing the static bytes (FSDP2); 1: not sharded
    loss_parameters: tuple[str, ...] = ()        # the model's parameters the loss function reads itself

    def check(self) -> None:
        if not isinstance(self.shard_over, int) or isinstance(self.shard_over, bool) or self.shard_over < 1:
            raise InputError(f"shard_over is the number of ranks the parameters, gradients and optimizer state are "
                             f"sharded over (FSDP2; 1: none), a positive int, got {self.shard_over!r}")
        for name in ("update_in_backward", "offload_optimizer_state", "offload_parameters"):
            if getattr(self, name) not in (None, True, False):
                raise InputError(f"{name} must be True, False or None (the planner decides), got {getattr(self, name)!r}")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float))
                                                   and self.max_grad_norm > 0):
            raise InputError(f"max_grad_norm is the loop's clipping norm, a positive number (or None: no "
                             f"clipping), got {self.max_grad_norm!r}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise InputError(f"accumulation_steps must be a positive int (micro-batches per optimizer step), "
                             f"got {self.accumulation_steps!r}")


@dataclasses.dataclass(frozen=True)
class Placement:
    update_in_backward: bool = False
    offload_optimizer_state: bool = False
    offload_parameters: bool = False

    def describe(self) -> str:
        return (f"update in backward: {'on' if self.update_in_backward else 'off'}, optimizer state "
                f"{'off the device' if self.offload_optimizer_state else 'on the device'}, parameters "
                f"{'off the device' if self.offload_parameters else 'on the device'}")


# Why a plan cannot update each parameter by itself on a replica: planning in a process group says it,
# and so do `apply` and the dp strategy for a plan made outside one (each rank stepped its own gradient).
UNDER_DATA_PARALLEL = ("under data parallel each gradient must be averaged across ranks before the update "
                       "(oomless.parallel's overlapped update steps each bucket after its all-reduce)")


def in_a_process_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def why_not_per_parameter(optimizer) -> str | None:
    """Why no update can be split per parameter (in backward or with offloaded state), or None."""
    if optimizer is None:
        return "no optimizer was given (pass optimizer=)"
    if isinstance(optimizer, NOT_SLICEABLE):
        return f"{type(optimizer).__name__} steps every parameter at once"
    if in_a_process_group():
        return UNDER_DATA_PARALLEL
    return None


def why_not_in_backward(optimizer, max_grad_norm: float | None) -> str | None:
    """The reason the step cannot run in backward, or None."""
    blocker = why_not_per_parameter(optimizer)
    if blocker is None and max_grad_norm is not None:
        return ("clipping by global norm (max_grad_norm) needs every gradient before the first update, and in "
                "backward each parameter is updated as soon as its own gradient is ready")
    return blocker


def _largest_module_share(model: nn.Module) -> float:
    """The largest share of the trainable elements one module registers itself (a Linear's weight and
    bias): autograd runs a parameter's AccumulateGrad as soon as its gradient is complete (those nodes
    go first in its ready queue), so the gradients alive together are those one node produced."""
    trainable = {id(param): param for param in model.parameters() if param.requires_grad}
    total = sum(param.numel() for param in trainable.values())
    if not total:
        return 0.0
    largest = max((sum(param.numel() for param in module.parameters(recurse=False) if param.requires_grad)
                   for module in model.modules()), default=0)
    return largest / total


def gradient_bytes_in_backward(model: nn.Module, profile: Profile) -> int:
    """Gradient bytes alive at once when each is freed after its update (scaled to the profile's bytes,
    so a target's dtype applies)."""
    return int(-(-profile.gradient_bytes * _largest_module_share(model) // 1))


def state_bytes_offloaded(model: nn.Module, profile: Profile) -> int:
    """Optimizer-state bytes on the device at once when it is offloaded."""
    share = min(1.0, _largest_module_share(model) * STATE_PARAMETERS_IN_FLIGHT)
    return int(-(-profile.optimizer_state_bytes * share // 1))


def parameter_bytes_offloaded(model: nn.Module, profile: Profile) -> int:
    """Parameter bytes on the device at once when the blocks' own parameters are offloaded: those
    no single block owns, and a few blocks' (scaled to the profile's bytes: a target's dtype applies)."""
    from oomless.runtime.offload_parameters import parameters_owned_by_blocks

    modules = dict(model.named_modules())
    blocks = [(block.name, modules[block.name]) for block in profile.blocks if block.name in modules]
    owned = [sum(param.numel() for param in params) for params in parameters_owned_by_blocks(model, blocks)]
    total = sum(param.numel() for param in dict.fromkeys(model.parameters()))
    if not total or not owned:
        return profile.parameter_bytes
    on_device = total - sum(owned) + PARAMETER_BLOCKS_IN_FLIGHT * max(owned)
    return min(profile.parameter_bytes, int(-(-profile.parameter_bytes * on_device // total)))


def sharded_device_bytes(model: nn.Module, profile: Profile, ranks: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes one of ``ranks`` FSDP ranks holds at once when
    each of ``profile``'s blocks is its own FSDP unit and the root the last (module docstring); each
    at most the unsharded total. Counted in elements on the model and scaled to the profile's bytes,
    so a target's dtype applies."""
    from oomless.runtime.offload_parameters import parameters_owned_by_blocks

    parameters = list(dict.fromkeys(model.parameters()))
    trainable = [param for param in parameters if param.requires_grad]

    def shard_elements(params) -> int:
        return sum(math.ceil(param.shape[0] / ranks) * (param.numel() // param.shape[0]) if param.dim() else
                   param.numel() for param in params if param.numel())

    modules = dict(model.named_modules())
    blocks = [(block.name, modules[block.name]) for block in profile.blocks if block.name in modules]
    owned = [sum(param.numel() for param in params) for params in parameters_owned_by_blocks(model, blocks)]
    total, total_trainable = sum(p.numel() for p in parameters), sum(p.numel() for p in trainable)
    root = total_trainable - sum(owned)             # trainable parameters no block holds: the root's unit
    unsharded = root + SHARDED_BLOCKS_UNSHARDED * max(owned, default=0)

    def scaled(full_bytes: int, elements: int, of: int) -> int:
        return min(full_bytes, -(-full_bytes * elements // of)) if of else full_bytes

    return (scaled(profile.parameter_bytes, shard_elements(parameters) + unsharded, total),
            scaled(profile.gradient_bytes, shard_elements(trainable) + unsharded, total_trainable),
            scaled(profile.optimizer_state_bytes, shard_elements(trainable), total_trainable))


def device_view(profile: Profile, gradient_device_bytes: int, state_device_bytes: int | None = None,
                parameter_device_bytes: int | None = None) -> Profile:
    """The profile with only the static bytes the device holds."""
    state = profile.optimizer_state_bytes if state_device_bytes is None else state_device_bytes
    parameters = profile.parameter_bytes if parameter_device_bytes is None else parameter_device_bytes
    return dataclasses.replace(profile, gradient_bytes=gradient_device_bytes, optimizer_state_bytes=state,
                               parameter_bytes=parameters)


def gradients_made_in_backward(request: StaticRequest) -> bool:
    """Whether each step starts without gradients, as a profile measures it (`Profile.gradients_from_backward`):
    not with gradient accumulation (the earlier micro-batches' are alive), FSDP (sharded gradients
    kept), or under torch.distributed (DDP's buckets hold every gradient through the step)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return request.accumulation_steps == 1 and request.shard_over == 1 and not distributed


def _state_tier(profile: Profile) -> str:
    return "pinned host memory" if profile.device.startswith("cuda") else "disk"


def static_parts(profile: Profile, gradient_device_bytes: int, state_device_bytes: int,
                 parameter_device_bytes: int, shard_over: int = 1) -> list[StaticPart]:
    gradients_where = ON_DEVICE if gradient_device_bytes >= profile.gradient_bytes else IN_BACKWARD
    state_where = ON_DEVICE if state_device_bytes >= profile.optimizer_state_bytes else \
        f"{_state_tier(profile)}; on the device around each parameter's update"
    parameters_where = ON_DEVICE if parameter_device_bytes >= profile.parameter_bytes else \
        f"{_state_tier(profile)}; each block's on the device around its forward, backward and update"
    if shard_over > 1:
        gradients_where = parameters_where = (f"device, sharded over {shard_over} ranks (FSDP2); unsharded: the "
                                              f"root's and {SHARDED_BLOCKS_UNSHARDED} blocks' at a time")
        state_where = f"device, sharded over {shard_over} ranks (FSDP2)"
    return [StaticPart("parameters", profile.parameter_bytes, parameter_device_bytes, parameters_where),
            StaticPart("gradients", profile.gradient_bytes, min(gradient_device_bytes, profile.gradient_bytes),
                       gradients_where),
            StaticPart("optimizer state", profile.optimizer_state_bytes,
                       min(state_device_bytes, profile.optimizer_state_bytes), state_where),
            StaticPart("buffers", profile.buffer_bytes, profile.buffer_bytes, ON_DEVICE),
            StaticPart("inputs", profile.input_bytes, profile.input_bytes, ON_DEVICE),
            StaticPart("targets", profile.target_bytes, profile.target_bytes,
                       f"{ON_DEVICE}: tensors the loss function holds"),
            StaticPart("allocator and objects", profile.static_overhead_bytes, profile.static_overhead_bytes,
                       f"{ON_DEVICE}: page rounding and each static tensor's objects on CPU, allocator rounding "
                       "on CUDA, profile.tensors.static_overhead_bytes")]


def per_parameter_step_seconds(optimizer, repeats: int = 20) -> float | None:
    """The fixed cost of one optimizer call (a per-parameter update makes one per parameter where the
    plain step makes one), measured on a one-element parameter on the parameters' device; None where
    it cannot run (meta parameters of a target)."""
    device = next((param.device for group in optimizer.param_groups for param in group["params"]),
                  torch.device("cpu"))
    if device.type == "meta":
        return None
    probe = nn.Parameter(torch.zeros(1, device=device))
    probe.grad = torch.zeros(1, device=device)
    try:
        scratch = OptimizerSlice(optimizer, [probe], {probe: 0}, share_state=False)    # never the user's state
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


class _Candidates:
    """The activation plan and the added seconds of each placement, made on demand."""

    def __init__(self, profile, model, optimizer, request, plan_activations):
        self.profile, self.model, self.optimizer, self.request = profile, model, optimizer, request
        self.plan_activations = plan_activations
        accumulating = request.accumulation_steps > 1
        # What the device holds with nothing moved: all of it, or this rank's shard under FSDP.
        self.parameters_held, self.gradients_held, self.state_held = (
            sharded_device_bytes(model, profile, request.shard_over) if request.shard_over > 1 else
            (profile.parameter_bytes, profile.gradient_bytes, profile.optimizer_state_bytes))
        self.gradients_in_backward = profile.gradient_bytes if accumulating else \
            gradient_bytes_in_backward(model, profile)
        self.state_offloaded = state_bytes_offloaded(model, profile)
        self.parameters_offloaded = parameter_bytes_offloaded(model, profile)
        self.results: dict[Placement, Plan | PlanError] = {}
        self._per_call_seconds = None
        # One optimizer call per module's trainable parameters the optimizer holds (`update_units`).
        held = [param for group in (optimizer.param_groups if optimizer is not None else [])
                for param in group["params"] if param.requires_grad]
        self.update_calls = len({id(unit) for unit in update_units(model, held).values()})

    def device_bytes(self, placement: Placement) -> tuple[int, int, int]:
        """(gradients, optimizer state, parameters) on the device at once."""
        gradients = self.gradients_in_backward if placement.update_in_backward else self.gradients_held
        state = self.state_offloaded if placement.offload_optimizer_state else self.state_held
        parameters = self.parameters_offloaded if placement.offload_parameters else self.parameters_held
        return gradients, state, parameters

    def plan(self, placement: Placement) -> Plan | PlanError:
        if placement not in self.results:
            seen = device_view(self.profile, *self.device_bytes(placement))
            if not gradients_made_in_backward(self.request):
                seen = dataclasses.replace(seen, gradients_from_backward=False)
            # What moves during the step is not on the device in every phase (`plan.static_phases`).
            seen = with_phase_static(seen, self.profile, self.model, placement.update_in_backward,
                                     placement.offload_optimizer_state, placement.offload_parameters)
            if placement.offload_parameters:
                # Parameters move per block of the plan, and were counted per measured block: no
                # segments (`plan.segments`) merge blocks here.
                seen = dataclasses.replace(seen, segments=[])
            if not placement.update_in_backward:
                # The user's optimizer.step() after backward, with every gradient on the device.
                seen = dataclasses.replace(seen, optimizer_step_other_bytes=optimizer_step_other_bytes(
                    self.optimizer, self.profile, placement.offload_optimizer_state, seen.optimizer_state_bytes,
                    self.request.shard_over))
            try:
                self.results[placement] = self.plan_activations(seen)
            except PlanError as refused:
                self.results[placement] = refused.kept()
        return self.results[placement]

    def added_seconds(self, placement: Placement) -> tuple[float, str]:
        """Seconds a placement adds to the activation plan's step, and how they were counted."""
        if placement == Placement():
            return 0.0, ""
        if self._per_call_seconds is None:
            self._per_call_seconds = per_parameter_step_seconds(self.optimizer) or 0.0
        calls = self.update_calls
        seconds = self._per_call_seconds * calls
        parts = [f"{calls} optimizer calls {seconds * 1e3:.1f} ms"]
        # Out and in over the tier's measured link; on a CPU-only run the static bytes are mapped
        # files instead (`runtime.tiers.MappedFiles`): state mapped in, updated in place, unmapped;
        # parameters copied from their mapping twice and written into their file once.
        mapped = self.profile.device == "cpu"
        rate_in, rate_out = mapped_files_rates() if mapped else (self.profile.link.in_bytes_per_second,
                                                                 self.profile.link.out_bytes_per_second)
        if placement.offload_optimizer_state:
            moved = self.profile.optimizer_state_bytes
            copies = moved / rate_in + (0.0 if mapped else moved / rate_out)
            seconds += copies
            parts.append(f"state {'mapped in' if mapped else 'out and in'} {format_bytes(moved)} "
                         f"{'' if mapped else 'each way '}{copies * 1e3:.1f} ms")
        if placement.offload_parameters:
            moved = self.profile.parameter_bytes
            copies = 2 * moved / rate_in + moved / rate_out
            seconds += copies
            parts.append(f"parameters in twice and out once, {format_bytes(moved)} each, {copies * 1e3:.1f} ms")
        return seconds, ", ".join(parts)


def plan_with_static_decisions(profile: Profile, model: nn.Module, optimizer, request: StaticRequest,
                               plan_activations) -> Plan:
    """Decide the static placements, make the activation plan for them with
    ``plan_activations(device_profile) -> Plan`` and record both in the returned plan."""
    request.check()
    sharded_blocker = (f"the parameters, gradients and optimizer state are sharded over {request.shard_over} ranks "
                       "(shard_over; FSDP2 decides where they live and steps each rank's shard after the "
                       "reduce-scatter)") if request.shard_over > 1 else None
    per_parameter_blocker = sharded_blocker or why_not_per_parameter(optimizer)
    in_backward_blocker = sharded_blocker or why_not_in_backward(optimizer, request.max_grad_norm)
    parameters_blocker = in_backward_blocker or (
        "they are written out after their update in backward, which gradient accumulation delays"
        if request.accumulation_steps > 1 else None) or (
        f"the loss function reads {', '.join(request.loss_parameters[:3])} itself (a tied head's weight?), "
        "outside the blocks that bring parameters back" if request.loss_parameters else None)
    if request.update_in_backward is False and request.offload_parameters is True:
        raise InputError("offload_parameters=True needs the update in backward (each parameter is written out "
                         "after its update); drop update_in_backward=False")
    for name, blocker in (("update_in_backward", in_backward_blocker),
                          ("offload_optimizer_state", per_parameter_blocker),
                          ("offload_parameters", parameters_blocker)):
        if getattr(request, name) is True and blocker is not None:
            raise InputError(f"{name}=True is not possible: {blocker}; use {name}=None (the planner then "
                             "keeps it off) or False")

    def options(requested, possible: bool) -> list[bool]:
        return [requested] if requested is not None else [False] + ([True] if possible else [])

    forced_in_backward = True if request.offload_parameters else request.update_in_backward
    placements = [Placement(in_backward, offload_state, offload_parameters)
                  for in_backward in options(forced_in_backward,
                                             in_backward_blocker is None and request.accumulation_steps == 1)
                  for offload_state in options(request.offload_optimizer_state,
                                               per_parameter_blocker is None and profile.optimizer_state_bytes > 0)
                  for offload_parameters in options(request.offload_parameters, parameters_blocker is None)
                  if in_backward or not offload_parameters]
    placements.sort(key=lambda placement: (placement.offload_parameters, placement.offload_optimizer_state,
                                           placement.update_in_backward))
    candidates = _Candidates(profile, model, optimizer, request, plan_activations)
    placement, reason = _choose(candidates, placements)
    unavailable = {"update in backward": in_backward_blocker if request.update_in_backward is None else None,
                   "optimizer state off the device": per_parameter_blocker
                   if request.offload_optimizer_state is None else None,
                   "parameters off the device": parameters_blocker if request.offload_parameters is None else None}
    if request.accumulation_steps > 1 and request.update_in_backward is None and in_backward_blocker is None:
        unavailable["update in backward"] = (f"with {request.accumulation_steps} micro-batches per step every "
                                             "gradient is alive in the last one: nothing to gain")
    reason += "".join(f"; {name} not possible: {why}" for name, why in unavailable.items() if why)
    chosen = candidates.plan(placement)
    chosen.update_in_backward = placement.update_in_backward
    chosen.offload_optimizer_state = placement.offload_optimizer_state
    chosen.offload_parameters = placement.offload_parameters
    chosen.accumulation_steps = request.accumulation_steps
    chosen.static_parts = static_parts(profile, *candidates.device_bytes(placement), shard_over=request.shard_over)
    chosen.shard_over = request.shard_over
    # The activation planner saw the device's static bytes; plain PyTorch holds all of them.
    chosen.plain_peak_bytes += sum(part.total_bytes - part.device_bytes for part in chosen.static_parts)
    # The activation simulator times the step without the placement's own work: add it.
    added_seconds, _ = candidates.added_seconds(placement)
    chosen.predicted_step_seconds += added_seconds
    chosen.notes.append(f"{placement.describe()} ({reason})")
    return chosen


def _named_minimum(refused: PlanError) -> float:
    return refused.minimum_bytes if refused.minimum_bytes is not None else float("inf")


# A placement that moves more (the update into backward, the optimizer's state or the parameters off
# the device) is chosen over a simpler one that fits only where its step is predicted faster by more.
SIMPLER_WITHIN = 0.02


def _choose(candidates: _Candidates, placements: list[Placement]) -> tuple[Placement, str]:
    """The placement to use and why; where none fits, raises the PlanError naming the smallest budget
    of any placement."""
    if len(placements) == 1:
        only = placements[0]
        if isinstance(candidates.plan(only), PlanError):
            raise candidates.plan(only).to_raise()
        return only, "the only placement given or possible"
    first = placements[0]
    first_plan = candidates.plan(first)
    if isinstance(first_plan, Plan) and set(first_plan.decisions.values()) <= {"keep"}:
        return first, "the step fits with every block kept: nothing to gain"
    scored = []
    for placement in placements:
        result = candidates.plan(placement)
        if isinstance(result, Plan):
            added, how = candidates.added_seconds(placement)
            scored.append((result.predicted_step_seconds + added, placement, how))
    if not scored:
        # The refusal naming the smallest budget of any placement: mostly that of the one holding least
        # on the device (the last; ties go to it), not necessarily: what it moves takes working memory
        # of its own (the copies back, the state of the module updating).
        frugal = placements[-1]
        least = min(reversed(placements), key=lambda placement: _named_minimum(candidates.plan(placement)))
        refused = candidates.plan(least)
        if least == frugal:
            why = (f"counting {frugal.describe()}, the least the device can hold; no placement that keeps more "
                   "on it fits a smaller budget")
        else:
            frugal_minimum = _named_minimum(candidates.plan(frugal))
            why = (f"counting {least.describe()}; with {frugal.describe()}, the least the device can hold, "
                   f"the smallest budget is {format_bytes(frugal_minimum) if frugal_minimum < float('inf') else 'not known'}")
        raise PlanError(f"{refused} ({why})", minimum_bytes=refused.minimum_bytes,
                        limiting_block=refused.limiting_block, floor_block=refused.floor_block)
    # The simplest placement (``placements`` is in that order: fewer things moved first) within
    # SIMPLER_WITHIN of the fastest: two predictions that close differ by the profile's timing noise
    # (`make demo`'s plan moved its parameters to disk in some processes, for a step predicted 1 %
    # faster, and kept them in others).
    fastest = min(total for total, _, _ in scored)
    seconds, best, how = next(item for item in scored if item[0] <= fastest * (1 + SIMPLER_WITHIN))
    others = "; ".join(f"{placement.describe()}: {total * 1e3:.1f} ms"
                       for total, placement, _ in sorted(scored, key=lambda item: item[0]) if placement != best)
    unfit = [placement.describe() for placement in placements if isinstance(candidates.plan(placement), PlanError)]
    reason = f"predicted step {seconds * 1e3:.1f} ms" + (f" with {how}" if how else "")
    if seconds > fastest:
        reason += f", the simplest within {SIMPLER_WITHIN:.0%} of the fastest"
    if others:
        reason += f"; against {others}"
    if unfit:
        reason += f"; no plan fits with {' / '.join(unfit)}"
    return best, reason

