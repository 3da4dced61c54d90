"""The public functions: plan, apply, remove, fit, stats (DESIGN.md section 1)."""

import dataclasses
import weakref

import torch
import torch.nn as nn

from oomless.arguments import check_fp16_loss_parameters, check_model, check_plan_arguments
from oomless.errors import ApplyError, InputError, PlanError
from oomless.plan.model_digests import check_same_model, model_digests
from oomless.plan.plan import Plan
from oomless.plan.planner import make_plan, named_margin_bytes
from oomless.plan.segments import best_of_granularities, check_decisions, coarsened
from oomless.plan.splitting import (can_split_at, floor_is_a_workspace, plan_or_lowest_floor,
                                    plan_splitting_near_the_floor, plan_splitting_the_floor, unsplit_floor_estimate)
from oomless.plan.static import UNDER_DATA_PARALLEL, StaticRequest, in_a_process_group, plan_with_static_decisions
from oomless.profile.profile import Profile
from oomless.profile.configured import profile_configured
from oomless.profile.profiler import count_start_up, held_now, start_up_counted
from oomless.profile.rss import give_back_free_heap
from oomless.profile.tensors import model_device, parameters_held_by, tensors_in
from oomless.runtime.compile import (apply_compile, check_compile_available, check_compile_composes, compile_options,
                                     remove_compile)
from oomless.runtime.deepcopy import allow_deepcopy, forget_deepcopy
from oomless.runtime.install import install_plan, installed_state, uninstall_plan
from oomless.runtime.ledger import Stats
from oomless.runtime.precision import (apply_precision, autocast_dtype, check_can_apply, precision_state,
                                       remove_precision)
from oomless.runtime.split import (DEFAULT_SLABS, apply_split, inside, remove_split, split_candidates,
                                   stream_outer_modules)
from oomless.runtime.stream import STREAM
from oomless.runtime.update_in_backward import apply_update_in_backward, remove_update_in_backward
from oomless.sizes import parse_bytes


def sum_of_outputs(output) -> torch.Tensor:
    """A loss_fn for profiling: the sum of every floating-point tensor in the output."""
    floats = [tensor for tensor in tensors_in(output) if tensor.is_floating_point()]
    if not floats:
        raise InputError("the model's output holds no floating-point tensor to sum into a loss")
    return sum(tensor.float().sum() for tensor in floats)


# Per model: the profile behind the last PlanError `plan` raised for it, with what it was measured
# for and the smallest budget the error named. Given that budget back (or more) for the same step,
# `plan` plans from the same measurements, so the named budget is accepted: a profile measured again
# differs a little (a 6-layer GPT-2's named floor was refused once in 9 fresh processes, its second
# profile's floor over 2 % higher), and the PlanError's promise is about this step, not a new sample.
_REFUSED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _step_key(model: nn.Module, example_inputs, loss_fn, optimizer, blocks, target, dtype, precision, options,
              split, request) -> tuple:
    """What a profile measured: the model's parameters and mode, the inputs' shapes, the loss's code
    (a lambda written again at the same place is the same loss), the optimizer's class and the
    settings planning was asked for."""
    def shapes(value):
        return tuple((tuple(tensor.shape), tensor.dtype, str(tensor.device)) for tensor in tensors_in(value))

    parameters = tuple((name, tuple(param.shape), param.dtype, param.requires_grad)
                       for name, param in model.named_parameters())
    return (model.training, parameters, shapes(example_inputs), getattr(loss_fn, "__code__", loss_fn),
            type(optimizer), repr(blocks), repr(target), dtype, precision, repr(options), repr(split),
            dataclasses.astuple(request))


def plan(model: nn.Module, example_inputs, memory, loss_fn=None, optimizer=None, target=None,
         blocks=None, decisions: dict[str, str] | None = None, min_swap_bytes: int = 64 * 1024,
         profile: Profile | None = None, dtype: torch.dtype | None = None, solver: str = "auto",
         update_in_backward: bool | None = None, offload_optimizer_state: bool | None = None,
         offload_parameters: bool | None = None, max_grad_norm: float | None = None,
         accumulation_steps: int = 1, precision: str = "fp32", compile=False, split=None,
         shard_over: int = 1) -> Plan:
    """Profile one step of ``model`` on ``example_inputs`` and plan it for ``memory`` bytes.

    ``blocks`` overrides the block policy (module types or qualified names); ``decisions`` forces
    keep/swap/recompute for every block instead of searching; storages smaller than
    ``min_swap_bytes`` are never swapped (the copy would cost more than it frees). A ``profile``
    from `oomless.profile` is reused instead of measuring again (where no plan fits it and ``split``
    is None, the step is measured again with chains split, see below).

    With ``target`` (a device name such as "h100", or an `oomless.Device`), nothing runs for real:
    the step is profiled on meta tensors and timed by that device's roofline, so the model and the
    inputs may be on the meta device; ``dtype`` then casts floating-point parameters and inputs.
    ``solver`` is "greedy", "exact" or "auto" (exact up to a few hundred blocks, see `plan.solvers`).

    Static bytes (`oomless.plan.static`), each True/False to force, None to let the planner decide:
    ``update_in_backward`` steps ``optimizer`` per parameter during backward and frees each gradient
    at once (`oomless.runtime.update_in_backward`); ``offload_optimizer_state`` keeps the optimizer's
    state in pinned host memory (CUDA) or on disk (CPU) between updates (`oomless.runtime.offload_state`);
    ``offload_parameters`` keeps each block's parameters there between uses (with the update in
    backward; `oomless.runtime.offload_parameters`).
    The loop's ``max_grad_norm`` (clipping by global norm) and ``accumulation_steps`` (micro-batches
    per optimizer step) decide what is possible. ``shard_over=N``: the parameters, gradients and
    optimizer state are sharded over N ranks by FSDP2 (`oomless.parallel.sharded`, ``--parallel
    fsdp``), so the plan counts one rank's: its shard, plus the root's and two blocks' parameters and
    gradients unsharded (`oomless.plan.static.sharded_device_bytes`); the three above are then off.

    ``precision`` "bf16" or "fp16" profiles, plans and (once applied) trains the step under
    ``torch.autocast`` for that dtype, fp16 with loss scaling (`oomless.runtime.precision`).
    ``compile`` True (or a dict of torch.compile options) compiles each block in place, profiled
    compiled and composed with the plan (`oomless.runtime.compile`); chains split into slabs run
    eagerly, the other blocks compiled.

    ``split`` computes chains of convolutions, normalisations and pointwise ops (a U-Net stage, a
    decoder stage, a head) in slabs along the first spatial axis, so that one stage's backward holds
    a slab of its intermediates, not the whole volume's (`oomless.runtime.split`; results within
    ~1e-6 relative of the unsplit step, not bit-equal; under bf16/fp16 each op in the dtype autocast
    gives it, within a few bf16 roundings of the unsplit step, `oomless.runtime.slab_autocast`). None:
    the planner splits the chains where the smallest plan without splitting does not fit ``memory``,
    or where ``memory`` is within 10 % of that smallest budget and splitting lowers it (those in the
    block that sets the floor, again while that lowers it; `oomless.plan.splitting`), at fp32 only;
    True: every chain; a dict {chain name: slabs}; False: never.
    """
    memory_bytes = parse_bytes(memory)
    autocast_dtype(precision)
    options = compile_options(compile)
    if precision == "fp16":
        # Loss scaling skips a step whose gradients overflowed: it needs every gradient before any
        # update, as clipping by global norm does, and steps the optimizer itself.
        forced = [name for name, value in (("update_in_backward", update_in_backward),
                                           ("offload_optimizer_state", offload_optimizer_state),
                                           ("offload_parameters", offload_parameters)) if value]
        if forced:
            raise InputError(f"precision='fp16' cannot be combined with {', '.join(n + '=True' for n in forced)}: "
                             "its loss scaler must see every gradient before any update and steps the optimizer "
                             "itself; leave them None (or False), or use precision='bf16'")
        update_in_backward = offload_optimizer_state = offload_parameters = False
    blocks = check_plan_arguments(model, example_inputs, loss_fn, optimizer, blocks, decisions, min_swap_bytes,
                                  profile, dtype, target, solver)
    loss_parameters = tuple(parameters_held_by(loss_fn, model))
    check_fp16_loss_parameters(precision, loss_fn, model)
    request = StaticRequest(update_in_backward, offload_optimizer_state, offload_parameters, max_grad_norm,
                            accumulation_steps, shard_over, loss_parameters)
    request.check()
    if installed_state(model) is not None:
        raise ApplyError("oomless is already applied to this model; call oomless.remove(model) before planning again")
    if profile is not None and profile.precision != precision:
        raise InputError(f"the profile given was measured at precision {profile.precision!r}, not {precision!r}; "
                         f"profile again with precision={precision!r}")
    if profile is not None and profile.compiled != (options is not None):
        raise InputError(f"the profile given was measured {'with' if profile.compiled else 'without'} compiled "
                         f"blocks, but compile={compile!r}; profile again with the same compile setting")
    chosen_split = profile.split if profile is not None else _split_request(model, split)
    # Splitting measures the step again, split: with the caller's own profile and no loss_fn, the
    # step it measured (its loss) is not known here, and the refusal stands.
    can_measure_again = profile is None or loss_fn is not None
    def plan_profile(measured: Profile, budget: int = memory_bytes) -> Plan:
        def make(device_profile: Profile) -> Plan:
            # Decisions may name segments (as a plan that recomputes one names it): planned merged.
            named = [segment for segment in device_profile.segments if segment.name in (decisions or {})]
            unplanned = sorted(set(decisions or {}) - {block.name for block in device_profile.blocks}
                               - {segment.name for segment in named})
            if unplanned:
                # With parameters off the device the plan moves them per measured block, so it has
                # no segments to merge: a module around several blocks names none of its blocks.
                inner = [block.name for block in device_profile.blocks if block.name.startswith(f"{unplanned[0]}.")]
                raise PlanError(f"decisions name {unplanned[:3]}, modules around several measured blocks, which a plan "
                                f"with parameters off the device plans block by block; name their blocks "
                                f"({', '.join(inner[:4])}{', ...' if len(inner) > 4 else ''}) or give "
                                "offload_parameters=False")
            planned = coarsened(device_profile, named) if named else device_profile
            return make_plan(planned, budget, decisions, min_swap_bytes=min_swap_bytes, solver=solver)
        # Segments (modules around blocks, recomputed as one) where blocks are the profile's own:
        # not for given decisions, chains in slabs or compiled blocks (planned per block), nor FSDP
        # (it shards per block of the plan, and the static bytes count the measured blocks').
        whole_segments = decisions is None and not measured.split and not measured.compiled and shard_over == 1
        return plan_with_static_decisions(
            measured, model, optimizer, request,
            (lambda device_profile: best_of_granularities(device_profile, make)) if whole_segments else make)

    # Memory the first planning call in a process takes before it measures a step (the estimate
    # below: its code paths' start-up) is held while training: its first measurement counts it
    # (`profiler.count_start_up`).
    device = model_device(model) if target is None else None
    before_planning = ([held_now(device)] if device is not None and device.type != "meta" and not start_up_counted()
                       else [])

    def measure(chains: dict[str, int]) -> Profile:
        """The step measured with ``chains`` split (none: unsplit), on this device."""
        if before_planning:
            count_start_up(model, before_planning.pop(), device)
        return profile_configured(model, example_inputs, loss_fn, optimizer, blocks, target, dtype, memory_bytes,
                                  precision, options, chains)

    # Under bf16/fp16 only where asked for (split=True or a dict): at its smallest budget a bf16 split
    # step measured ~2 MiB (3 %) over the named budget on CPU (tests/test_floor.py says why).
    may_split = (split is None and decisions is None and target is None and precision == "fp32"
                 and can_measure_again)
    step_key = None
    given_back = None   # the budget a PlanError named, where ``memory`` gives it back
    estimate = None     # the smallest budget without splitting, estimated where over the budget
    if profile is None:
        step_key = _step_key(model, example_inputs, loss_fn, optimizer, blocks, target, dtype, precision, options,
                             split, request)
        refused = _REFUSED.pop(model, None)
        if refused is not None and refused[0] == step_key and memory_bytes >= refused[1]:
            profile = refused[2]            # the budget a PlanError named, given back: the same measurements
            chosen_split = profile.split    # with the chains split as they were measured, where they were
            given_back = refused[1]
        else:
            # Not with compile: the estimate runs the eager step, and compiled graphs may save less.
            if may_split and options is None and split_candidates(model):
                estimate = unsplit_floor_estimate(model, example_inputs, optimizer, blocks, dtype, memory_bytes,
                                                  plan_profile)
            if estimate is None:
                profile = measure(chosen_split)
    if decisions is not None:
        check_decisions(decisions, profile)

    def plan_measured(measured: Profile) -> Plan:
        try:
            return plan_profile(measured)
        except PlanError as error:
            if not may_split:
                raise
            if error.limiting_block is None and not can_split_at(model, error.floor_block):
                raise   # the loss sets the floor: no split lowers it
            # Below the static bytes (limiting_block None), no split makes the budget fit, but the
            # floor named is the split one: a request for the floor (plan at 1 byte) names what a
            # budget between the estimate and the unsplit floor reaches in a fresh process, measured
            # in the same order (unsplit, then the rounds).
            return plan_splitting_the_floor(model, error, plan_profile, measure)

    def plan_splitting_where_needed() -> Plan:
        nonlocal profile
        if estimate is not None:
            # Even the estimate is over the budget: the step is measured split from the start.
            try:
                return plan_splitting_the_floor(model, estimate, plan_profile, measure, estimated=True)
            except PlanError as split_refused:
                if (split_refused.minimum_bytes or 0) < (estimate.minimum_bytes or 0):
                    raise   # below even the estimate of the unsplit floor: the lowest there is
                # The estimate is a lower bound: measured unsplit, the step's own floor may be below the
                # split ones' (slabs cost halos and kept inputs: the 3D U-Net at 48^3 was 70 MiB
                # unsplit, 76 streamed). Measured as without the estimate, the split steps again after
                # it, so the last profile counts what the earlier ones left behind.
                try:
                    profile = measure(chosen_split)
                except torch.OutOfMemoryError:
                    raise split_refused from None   # the device could not even measure the step unsplit
                return plan_measured(profile)
        if given_back is not None:
            return _plan_given_back(profile, memory_bytes, given_back, plan_profile, plan_measured)
        made = plan_measured(profile)
        if not made.split and not profile.split and may_split and split_candidates(model):
            made = plan_splitting_near_the_floor(model, made, profile, plan_profile, measure)
        return made

    def with_every_chain_split(refusal: PlanError) -> Plan:
        """Where splitting the chains that set the floor, round by round, did not fit (or the budget is
        below the static bytes, a user's way to ask for the floor) and that floor is a kernel's
        workspace slabs shrink (`plan.splitting.floor_is_a_workspace`), the step with every chain
        split: a plan if it fits, else the lower of the two refusals, so that the budget named, given
        back in a fresh process, fits there too (MONAI SegResNet, 48^3, batch 1, CPU: 141 MiB unsplit,
        the rounds 70, every chain split 55)."""
        measured = refusal.profile or profile   # None: refused by the estimate on meta tensors, nothing measured
        # Not for a profile the caller gave (step_key None: its refusals are not remembered, and its
        # budget named from a step measured here would not be the caller's).
        if (not may_split or step_key is None or given_back is not None or measured is None
                or not floor_is_a_workspace(measured, refusal.floor_block) or not can_split_at(model, refusal.floor_block)):
            raise refusal
        everything = _split_request(model, True)
        if measured.split == everything:
            raise refusal
        return plan_or_lowest_floor(refusal, measured.split, everything, plan_profile, measure)

    try:
        try:
            made = plan_splitting_where_needed()
        except PlanError as refusal:
            made = with_every_chain_split(refusal)
    except PlanError as error:
        named_by = error.profile or profile
        if step_key is not None and error.minimum_bytes is not None and named_by is not None:
            _REFUSED[model] = (step_key, error.minimum_bytes, named_by)
        # One refusal, the one that names the budget: the unsplit step's, refused on the way to it,
        # printed before it ("During handling of the above exception...") read as a second error.
        raise error from None
    made.precision, made.compile = precision, options
    made.training = model.training
    made.model_digests = model_digests(model, made.decisions)
    made.split = made.split or dict(chosen_split)
    return made


def _plan_given_back(profile: Profile, memory_bytes: int, named_bytes: int, plan_profile, plan_measured) -> Plan:
    """Plan from the profile that named ``named_bytes`` (a PlanError's smallest budget), ``memory_bytes``
    (at least that) given back. The named budget carries a margin over that profile's smallest plan
    (`plan.planner.named_margin_bytes`) for the step as it trains, which reads a little differently
    from the step measured: the plan is made within ``memory_bytes`` less it, so that the margin is
    still there (planned within the whole of it, the 3D U-Net's floor step predicted 73.9 MiB of the
    74.0 named and measured 74.4). Where that refuses (the margin rounds), within the whole budget."""
    try:
        made = plan_profile(profile, memory_bytes - named_margin_bytes(named_bytes))
    except PlanError:
        return plan_measured(profile)
    made.memory_bytes = memory_bytes
    return made


def _split_request(model: nn.Module, split) -> dict[str, int]:
    """{chain: slabs} for ``split`` as given to `plan` (None: none at first; the planner decides)."""
    if split is None or split is False:
        return {}
    if split is True:
        # The outer level streamed where it can be (it runs the chains there itself), and every other chain.
        outer = stream_outer_modules(model)
        chains = [name for name in split_candidates(model) if outer is None or not inside(name, outer)]
        if not chains and outer is None:
            raise InputError("split=True, but the model has no chain of convolutions, normalisations and pointwise "
                             "ops (an nn.Sequential such as a U-Net stage) to compute in slabs; use split=None")
        return {**({STREAM: DEFAULT_SLABS} if outer is not None else {}), **{name: DEFAULT_SLABS for name in chains}}
    if isinstance(split, dict):
        return dict(split)
    raise InputError(f"split must be None, True, False or a dict {{chain name: slabs}}, got {split!r}")


def profile(model: nn.Module, example_inputs, loss_fn=None, optimizer=None, blocks=None, target=None,
            dtype: torch.dtype | None = None, memory=None, precision: str = "fp32", compile=False,
            split=None) -> Profile:
    """Measure one training step per block (see `oomless.profile.profiler`); plain data. Block
    times are measured under the plan for ``memory`` when given (else recomputing every block).
    With ``target``, profile on meta tensors for that device instead (`oomless.profile.fake`).
    ``precision``, ``compile``: as for `plan`; ``split`` (True or {chain: slabs}) measures the step
    with those chains in slabs (None/False: unsplit)."""
    blocks = check_plan_arguments(model, example_inputs, loss_fn, optimizer, blocks, None, 0, None, dtype, target,
                                  function="profile")
    autocast_dtype(precision)
    return profile_configured(model, example_inputs, loss_fn, optimizer, blocks, target, dtype,
                              None if memory is None else parse_bytes(memory), precision, compile_options(compile),
                              _split_request(model, split))


def apply(model: nn.Module, plan: Plan, optimizer=None) -> nn.Module:
    """Install ``plan`` on ``model`` in place and return it; the training loop is unchanged. A plan
    that updates in backward or offloads the optimizer state, or made with precision="fp16", needs the
    ``optimizer`` it steps."""
    check_model(model, "apply")
    if not isinstance(plan, Plan):
        raise InputError(f"apply expects an oomless.Plan, got {type(plan).__name__}; make one with oomless.plan(...)")
    per_parameter = plan.update_in_backward or plan.offload_optimizer_state or plan.offload_parameters
    if per_parameter and optimizer is None:
        raise ApplyError("this plan updates the parameters in backward or keeps optimizer state or parameters "
                         "off the device: pass the optimizer it steps, oomless.apply(model, plan, optimizer=optimizer)")
    device = model_device(model)
    _check_plan_device(plan, device)
    check_same_model(plan.model_digests, model)
    if installed_state(model) is not None:
        # Before splitting or compiling: undoing a failed apply would undo the installed plan's too.
        raise ApplyError("oomless is already applied to this model; call oomless.remove(model) "
                         "before applying another plan")
    check_can_apply(model, plan.precision, optimizer, device)
    _check_no_plan_recomputed(model, plan)
    if plan.update_in_backward and in_a_process_group():
        # What planning inside the process group refuses (`plan.static.why_not_per_parameter`), for a
        # plan made outside it: under DDP each rank stepped its own gradient (replicas 0.09 apart).
        raise ApplyError(f"this plan updates the parameters in backward, and this process is one of "
                         f"{torch.distributed.get_world_size()} ranks: {UNDER_DATA_PARALLEL}. Plan inside the "
                         "process group, or with update_in_backward=False")
    if plan.compile is not None:
        check_compile_available(plan.compile)
        check_compile_composes(model, plan.decisions, plan.compile, plan.decisions, device)
    try:
        if plan.split:
            apply_split(model, plan.split, blocks=list(plan.decisions))
        # After splitting (split chains stay eager), before the plan's hooks (they then know to run eagerly).
        if plan.compile is not None:
            apply_compile(model, plan.decisions, plan.compile)
        install_plan(model, plan, device)
    except Exception:
        remove_split(model)
        remove_compile(model)
        raise
    apply_precision(model, plan.precision, optimizer, device)
    if per_parameter:
        try:
            modules = dict(model.named_modules())
            update = apply_update_in_backward(
                model, optimizer, plan.accumulation_steps, in_backward=plan.update_in_backward,
                offload_state=plan.offload_optimizer_state,
                offload_blocks=[(name, modules[name]) for name in plan.decisions] if plan.offload_parameters else None)
            if update.reads is not None:
                installed_state(model).engine.parameter_reads = update.reads
            if update.parameters_off is not None:
                # Brought-in parameters are resident, never saved activations to count or swap (the
                # saved-tensor engine takes the parameters' storages at the model's forward, before them).
                engine = installed_state(model).engine
                update.parameters_off.on_brought_in = lambda keys: engine.resident_storages.update(keys)
                engine.offloaded_parameters = update.parameters_off     # brought in when backward unpacks one
        except Exception:
            remove(model)                   # all or nothing: the model is left as it was
            raise
    allow_deepcopy(model, remove, optimizer_bound=per_parameter or plan.precision == "fp16")
    if device.type == "cpu":
        give_back_free_heap()               # planning's freed objects: the budget is resident memory
    return model


def _check_plan_device(plan: Plan, device: torch.device) -> None:
    """A plan's budget and times are those of the device it was made for: the process's resident
    memory on a CPU, the allocator's on a GPU, a datasheet's for a ``target``. Installed on another
    kind of device it would run, its promise meaningless there."""
    made_for = plan.device.split(":")[0]
    if made_for == device.type:
        return
    if made_for in ("cpu", "cuda", "mps", "xpu"):
        raise ApplyError(f"this plan was made on {plan.device} and the model is on {device}: its budget and "
                         f"times are that device's; make the plan with the model on {device} "
                         "(oomless.plan(model, example_inputs, memory))")
    if device.type == "cpu":
        raise ApplyError(f"this plan was made for a {plan.device} (target=) and the model is on the CPU: apply "
                         "it on that GPU, or plan for the CPU with oomless.plan(model, example_inputs, memory)")


def _check_no_plan_recomputed(model: nn.Module, plan: Plan) -> None:
    """A block recomputed in backward runs its forward again under torch's checkpoint; a model inside
    it that has a plan of its own saves through that plan's hooks, which the checkpoint's recompute
    does not see (torch's CheckpointError: "saved during forward: 27, during recomputation: 0")."""
    from oomless.plan.simulate import RECOMPUTING

    for name, decision in plan.decisions.items():
        block = model.get_submodule(name) if decision in RECOMPUTING else None
        inner = next((path for path, module in (block.named_modules() if block is not None else ())
                      if installed_state(module) is not None), None)
        if inner is not None:
            what = f"holds {name}.{inner}, a model" if inner else "is a model"
            raise ApplyError(f"block {name} is recomputed by this plan and {what} oomless is applied to with its own "
                             f"plan: give {name} 'keep' or 'swap' (decisions={{{name!r}: 'swap'}}), or "
                             "oomless.remove the inner model and plan the whole")


def remove(model: nn.Module) -> nn.Module:
    """Uninstall oomless; the model (and an optimizer stepped in backward) exactly as before `apply`."""
    check_model(model, "remove")
    forget_deepcopy(model)
    remove_update_in_backward(model)
    uninstall_plan(model)
    remove_split(model)
    remove_precision(model)
    remove_compile(model)
    return model


def fit(model: nn.Module, example_inputs, memory, **kwargs) -> nn.Module:
    """Plan ``model`` for ``memory`` bytes and apply the plan: one line before the training loop."""
    return apply(model, plan(model, example_inputs, memory, **kwargs), optimizer=kwargs.get("optimizer"))


def stats(model: nn.Module) -> Stats:
    """What the runtime did since `apply`: peak activation bytes on the ledger, bytes offloaded,
    blocks recomputed, seconds compute waited on transfers."""
    check_model(model, "stats")
    state = installed_state(model)
    if state is None:
        raise ApplyError("oomless is not applied to this model; call oomless.fit or oomless.apply first")
    if state.tier is not None:
        state.ledger.stall_seconds += state.tier.collect_stall_seconds()
    snapshot = state.ledger.snapshot()
    scaler = getattr(precision_state(model), "scaler", None)
    if scaler is not None:
        snapshot = dataclasses.replace(snapshot, skipped_steps=scaler.skipped_steps, loss_scale=scaler.scale)
    return snapshot


def installed_plan(model: nn.Module) -> Plan:
    state = installed_state(model)
    if state is None:
        raise ApplyError("oomless is not applied to this model")
    return state.plan
