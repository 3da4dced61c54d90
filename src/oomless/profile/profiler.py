"""Profile one real training step, per block, within the memory budget.

The step runs under the most frugal plan (every block's saved tensors swapped out as they are
saved), so sizes are measured without holding every activation at once. Hooks record per block:
forward and backward seconds, saved-activation bytes by storage (first saver owns a storage;
parameters never count), output, input and parameter bytes. The model's parameters, buffers,
gradients and RNG are left exactly as they were.
"""

import gc
import weakref
from dataclasses import replace

import torch
import torch.nn as nn

from oomless.errors import ApplyError, InputError
from oomless.plan.planner import MIN_SWAP_BYTES, rehearsal_plan
from oomless.profile.blocks import batchnorm_channels, children_as_blocks, find_blocks, segment_modules
from oomless.profile.links import measure_link
from oomless.profile.profile import LinkProfile, Profile, SegmentProfile
from oomless.profile.recorder import Recorder
from oomless.profile.rss import (MemoryProbe, give_back_free_heap, huge_pages_note, memory_rule_on,
                                 return_freed_memory_to_the_system)
from oomless.profile.selective import SelectiveMeter
from oomless.runtime import selective as selective_recompute
from oomless.profile.tensors import (call_model, check_inputs_device, earlier_saves_by_place, has_storage,
                                     holders_by_place, modules_reached_by, static_overhead_bytes, storage_bytes,
                                     tensor_bytes, tensors_held_by, tensors_in, training_state_kept)
from oomless.runtime.tiers import SIZING_MAX_PENDING_BYTES, TIMING_MAX_PENDING_BYTES
from oomless.sizes import format_bytes

_OPTIMIZER_STATE_COPIES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                           "RMSprop": 1, "Adadelta": 2}


def optimizer_state_bytes(optimizer, model: nn.Module, notes: list[str]) -> int:
    if optimizer is None:
        notes.append("no optimizer given: its state is counted as 0 bytes (pass optimizer= to count it)")
        return 0
    existing = storage_bytes([value for state in optimizer.state.values() for value in state.values()
                              if isinstance(value, torch.Tensor) and value.dim() > 0])
    if existing:
        return existing
    name = type(optimizer).__name__
    trainable = storage_bytes([p for group in optimizer.param_groups for p in group["params"]])
    copies = _OPTIMIZER_STATE_COPIES.get(name)
    if name == "SGD":
        copies = 1 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0
    if copies is None:
        notes.append(f"optimizer {name} has no state yet and is not one oomless knows: its state is "
                     "estimated as one copy of the parameters; run one step first for an exact count")
        copies = 1
    return copies * trainable


def loss_of(output, loss_fn):
    if loss_fn is not None:
        loss = loss_fn(output)
    else:
        loss = output
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        source = "loss_fn returned" if loss_fn is not None else "the model returned"
        raise InputError(f"{source} {shape}, not a scalar loss; pass loss_fn=callable(output) -> scalar "
                         "(for instance loss_fn=oomless.sum_of_outputs)")
    if not loss.requires_grad:
        # Otherwise autograd's "element 0 of tensors does not require grad" from inside the profiler.
        if not torch.is_grad_enabled():
            raise InputError("planning ran with gradients off (under torch.no_grad() or torch.inference_mode()): "
                             "oomless plans a training step, loss_fn(model(x)).backward(); call oomless.plan/fit "
                             "outside that block")
        raise InputError("the loss does not require grad, so there is no training step to plan: no parameter of "
                         "the model has requires_grad=True (and no input does), or the loss was computed from a "
                         "detached output; unfreeze what you train, or compute the loss from the model's output")
    return loss


def _measure_step(model, example_inputs, loss_fn, found, device, decisions: dict[str, str] | None = None,
                  base_bytes: int = 0, measure_selective: bool = False, rehearsed=None,
                  link_minimum_bytes: int = 8 * 2**20, changing: frozenset = frozenset()) -> tuple[Recorder, float]:
    """Run forward, loss and backward once, every block swapped (or under ``decisions``), recording per
    block. ``rehearsed``: the plan those decisions are (`planner.rehearsal_plan`), whose activation
    budget, per-phase limits and prefetch window the step keeps as training does. The swap tier's
    rates are recorded (`Recorder.link`) where it moved ``link_minimum_bytes`` each way. ``changing``:
    the blocks whose inputs the sizing step saw changed in place (`BlockProfile.changes_input`),
    recomputed from copies."""
    from oomless.plan.plan import BlockPlan, Plan
    from oomless.runtime.install import install_plan, installed_state, uninstall_plan

    names = [name for name, _ in found]
    # Prefetch distance 0: what backward brings back while a block runs is that block's own bytes,
    # so the memory rise measured there is the block's own transient.
    measuring = Plan(memory_bytes=0, device=str(device), static_bytes=0, reserve_bytes=0, activation_budget=0,
                     predicted_peak_bytes=0, predicted_activation_peak_bytes=0, predicted_step_seconds=0.0,
                     plain_peak_bytes=0, plain_step_seconds=0.0, prefetch_bytes=0, min_swap_bytes=0,
                     blocks=[BlockPlan(name, (decisions or {}).get(name, "swap"), "profiling", 0, 0.0, 0.0,
                                       changes_input=name in changing) for name in names])
    if rehearsed is not None:
        # Without the plan's limits the timing step's copies out could lag behind compute unchecked
        # (256 MiB in flight): on CPU a transformer's rehearsal at 35 MiB held 4.1 MiB over its
        # prediction in 1 process of 16, where the others held 0-1.5, and that excess, carried by
        # every plan from the profile as its margin, refused the budget itself (39 named); on CUDA
        # such a step could pass a tight budget that training keeps. Kept, the copies that fall
        # behind make the step wait (counted as stall), as in training.
        planned = {block.name: block for block in rehearsed.blocks}
        measuring.activation_budget = rehearsed.activation_budget
        measuring.prefetch_bytes = rehearsed.prefetch_bytes
        measuring.loss_limit_bytes = rehearsed.loss_limit_bytes
        measuring.blocks = [replace(block, saved_bytes=planned[block.name].saved_bytes,
                                    forward_limit_bytes=planned[block.name].forward_limit_bytes,
                                    backward_limit_bytes=planned[block.name].backward_limit_bytes,
                                    recomputed_bytes=planned[block.name].recomputed_bytes)
                            for block in measuring.blocks]
    # Memory is read at every ledger change in the sizing step (no ``decisions``); the timing step,
    # whose block times must not pay for readings, reads only at phase changes: its highest reading
    # checks the plan's prediction.
    recorder = Recorder(names, device, base_bytes, parameters=model.parameters(),
                        every_ledger_change=decisions is None,
                        parameter_names={id(parameter): name for name, parameter in model.named_parameters()})
    install_plan(model, measuring, device, recorder=recorder)
    state = installed_state(model)
    # The modules around blocks too (`SegmentProfile`): their inputs in the sizing step, their time in
    # the timing step.
    segment_hooks = []
    for name, module in segment_modules(model, found):
        started, finished = _segment_hooks(recorder, name)
        segment_hooks += [module.register_forward_pre_hook(started, with_kwargs=True),
                          module.register_forward_hook(finished, always_call=True)]
    tier = state.tier
    if decisions is None and measure_selective:
        recorder.selective_meter = SelectiveMeter(lambda: state.engine.block_index, device)
    if tier is not None:
        ledger = state.ledger

        def stall_seconds() -> float:
            # The tier's own waits, and the engine's for room under the plan's limits (`make_room`).
            waited, ledger.stall_seconds = ledger.stall_seconds, 0.0
            return tier.collect_stall_seconds() + waited
        recorder.tier_stall_source = stall_seconds
        if decisions is None:
            recorder.tier_is_out = tier.is_out   # the sizing step reads when the forward frees each saved storage
        # No budget in the profiling steps: the forward must not hold every swapped activation while
        # the copies catch up, or profiling needs plain's peak. The sizing step, whose times are not
        # used, waits for each copy before the next save, so that no phase's reading holds copies
        # that happened to lag; the timing step lets copies run behind compute as a plan's do.
        tier.max_pending_bytes = SIZING_MAX_PENDING_BYTES if decisions is None else TIMING_MAX_PENDING_BYTES
    try:
        forward_started = recorder.now() - recorder.tier_stall()
        output = call_model(model, example_inputs)
        loss_started = recorder.now()
        # Less the recorder's own readings at block boundaries, Python the device idles through on
        # CUDA after `now`'s waits: with them a 3D U-Net's loss read 17.6 ms of its 75 ms step on an
        # H200, and the step predicted from the profile was 1.6x plain's (2026-11-29).
        between_blocks = loss_started - recorder.tier_stall() - forward_started - recorder.hook_seconds - sum(
            block.forward_seconds for block in recorder.blocks.values())
        loss = loss_of(output, loss_fn)
        loss_seconds = recorder.now() - loss_started
        # The step as the API defines it, ``loss_fn(model(x)).backward()``: no reference to the output
        # but the loss's own, so what the loss does not save is freed before backward, as in that loop.
        del output
        recorder.in_backward = True  # recompute re-runs block forwards: not forward calls
        recorder.loss_done()
        backward_started = recorder.now() - recorder.tier_stall()
        loss.backward()
        backward_end = recorder.now() - recorder.tier_stall()
        recorder.backward_finished()
        # The step's time outside every block counts with the loss's (as the meta profiler counts
        # it): functional code between blocks (a U-Net's skip concatenations), the blocks' calls
        # themselves, and the loss's backward before the last block's output gradient is ready.
        # Left out, the blocks' sum was ~6 % short of the step (3D U-Net, 35 blocks, CPU).
        if recorder.backward_marks:
            between_blocks += min(mark for mark, _ in recorder.backward_marks) - backward_started
        loss_seconds += max(between_blocks, 0.0)
        recorder.assign_backward_seconds(backward_end)
        rates = tier.measured_rates(link_minimum_bytes) if hasattr(tier, "measured_rates") else None
        if rates is not None:
            recorder.link = LinkProfile("disk", *rates)
        for block in recorder.blocks.values():
            if (decisions or {}).get(block.name) == "recompute":  # its backward re-ran its forward
                block.backward_seconds = max(block.backward_seconds - block.forward_seconds, 0.0)
        if recorder.selective_meter is not None:
            recorder.selective_meter.fill(recorder.blocks)
        del loss
    finally:
        for hook in segment_hooks:
            hook.remove()
        recorder.close()
        uninstall_plan(model)
    return recorder, loss_seconds


def _segment_hooks(recorder: Recorder, name: str):
    def started(module, args, kwargs):
        if torch.is_grad_enabled():
            recorder.segment_started(name, (args, kwargs))

    def finished(module, args, output):
        recorder.segment_finished(name)
    return started, finished


# A first step that keeps more than a fiftieth of its own peak rise made caches for its shapes (or
# started a fresh process up) that the training steps hold throughout (`profile_model`'s `measure_sizes`).
HELD_SHARE = 50

# Where replicas profile together (their BatchNorm's statistics all-reduced across them, as in
# `parallel.stage_fit`), each must run as many profiling steps as the others, or their collectives
# pair up wrongly and wait for ever: such callers set this to a function that agrees on a choice
# across them (any replica's True makes it True for all). None: choices are this process's own.
agree_across_replicas = None


def _agreed(choice: bool) -> bool:
    return choice if agree_across_replicas is None else agree_across_replicas(choice)


def _merge_timing_step(sized: Profile, timer: Recorder) -> None:
    """Times (and the swap tier's rates, where it moved enough to tell: `_link_minimum_bytes`) come
    from the timing step. Memory comes from the sizing step only: the timing step runs another plan
    (kept and recomputed blocks hold differently), and a code path it takes for the first time
    (checkpointing) allocates its start-up there."""
    if timer.link is not None:
        # The tier's rates as training sees them: the sizing step waits for each copy out, so its
        # disk writes ran with compute waiting (about twice as fast as beside compute on 2 cores).
        sized.link = timer.link
    times = {block.name: block for block in timer.blocks.values()}
    for block in sized.blocks:
        block.forward_seconds = times[block.name].forward_seconds
        block.backward_seconds = times[block.name].backward_seconds
    for segment in sized.segments:
        segment.forward_seconds = timer.segment_seconds.get(segment.name, 0.0)


# The timing step's rates stand for the swap tier's where it moved no fewer bytes each way than a
# quarter of what the step could swap, within these bounds; where it moved less, the sizing step's
# (every swappable storage, moved once each way) stay. Before, 8 MiB (`DiskTier.measured_rates`'s
# default) was enough: a rehearsal that swapped two 4 MiB storages of a chain of twelve set the rates
# from two files each way.
LINK_SHARE = 4
LINK_MIN_BYTES = 8 * 2**20
LINK_MAX_BYTES = 64 * 2**20


def _link_minimum_bytes(profile: Profile) -> int:
    """`LINK_SHARE` of the bytes a plan with the default threshold (`planner.MIN_SWAP_BYTES`) may
    swap, within `LINK_MIN_BYTES` and `LINK_MAX_BYTES`."""
    swappable = sum(size for block in profile.blocks for size in block.saved_sizes if size >= MIN_SWAP_BYTES)
    return min(max(swappable // LINK_SHARE, LINK_MIN_BYTES), LINK_MAX_BYTES)


def _refined(found, recorder) -> list | None:
    """Size-based policy: a block holding over a quarter of all saved bytes is split into its
    children (its backward must hold all its saved bytes at once, which sets the minimum memory)."""
    total = sum(block.saved_bytes for block in recorder.blocks.values())
    refined, changed = [], False
    for index, (name, module) in enumerate(found):
        children = children_as_blocks(name, module)
        if total and recorder.blocks[index].saved_bytes * 4 > total and len(children) > 1:
            refined.extend(children)
            changed = True
        else:
            refined.append((name, module))
    return refined if changed else None


# Per model: memory its earlier profiles' steps left held in the process (on CPU, oneDNN keeps a
# kernel's workspace for its shapes after the step's tensors are freed: a whole-volume feature map
# for a 3D U-Net). A later profile of the same model starts above it and its steps reuse it, so they
# would not see it; the training steps hold it all the same: every later reading counts it.
_LEFT_BEHIND: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


# Whether a planning call in this process has counted its start-up (`count_start_up`): once, as a
# first step's start-up is once. Counted again at every call, what later estimates keep alive while
# planning (their refusals' objects, ~3 MiB for a small U-Net) was added to the last: a budget a
# PlanError named was refused when given back.
_START_UP_COUNTED = [False]


def start_up_counted() -> bool:
    """Whether a planning call in this process has counted its start-up (`count_start_up`)."""
    return _START_UP_COUNTED[0]


def count_start_up(model: nn.Module, since_bytes: int, device: torch.device) -> None:
    """`count_as_held` for the first planning call in the process to measure a step; then no more."""
    if not _START_UP_COUNTED[0]:
        _START_UP_COUNTED[0] = True
        count_as_held(model, since_bytes, device)


def held_now(device: torch.device) -> int:
    """What the process holds on ``device`` (`MemoryProbe.current`), once recent garbage is collected
    and glibc's free heap pages are given back: freed objects are not memory training holds. (The
    young generations only: a full collection takes ~0.3 s with transformers imported.)"""
    gc.collect(1)
    give_back_free_heap()
    return MemoryProbe(device).current()


def count_as_held(model: nn.Module, since_bytes: int, device: torch.device) -> None:
    """What the process took on ``device`` since ``since_bytes`` (`held_now` before planning
    began), counted as held by later profiles of ``model``, as what earlier steps left behind is:
    the start-up of code paths planning ran before measuring a step, which training holds too (on
    CPU the meta-tensor estimate of the unsplit floor leaves ~7 MiB for a 3D U-Net the first time
    it runs in a process, 0.2 MiB the next; `make demo`'s step measured 263 MiB in its 256 with
    it uncounted)."""
    grown = held_now(device) - since_bytes
    if grown > 0:
        _LEFT_BEHIND[model] = _LEFT_BEHIND.get(model, 0) + grown


def profile_model(model: nn.Module, example_inputs, loss_fn=None, optimizer=None, blocks=None,
                  memory_bytes: int | None = None, selective: bool = True) -> Profile:
    """Measure one training step of ``model`` (no optimizer step), per block.

    Sizes come from a step under an all-swap plan (nothing held but what is in flight); with the
    default block policy, blocks too big to plan are split and that step measured once more. Times
    then come from a step under the plan those sizes give for ``memory_bytes``.
    """
    from oomless.runtime.install import installed_state

    device = check_inputs_device(model, example_inputs)
    if installed_state(model) is not None:
        raise ApplyError("oomless is already applied to this model; call oomless.remove(model) first")
    notes: list[str] = []
    if device.type == "cpu":
        rule_was_on = memory_rule_on()
        if return_freed_memory_to_the_system() and not rule_was_on:   # so resident memory measures what is in use
            notes.append("freed memory leaves the resident set from this profile on: what the process built and freed "
                         "before may stay in glibc's heap beyond the plan (make demo's step measured 254-265 MiB for a plan "
                         "predicted at 255.7 within 256; 253 with the rule from the start): call "
                         "return_freed_memory_to_the_system() before building the model (from oomless.profile.rss import it)")
        if (huge_pages := huge_pages_note()) is not None:
            notes.append(huge_pages)
    found = find_blocks(model, blocks)
    parameters = list(dict.fromkeys(model.parameters()))
    # Gradients, buffers and RNG as they were, after.
    with training_state_kept(model, also=modules_reached_by(loss_fn)) as (cpu_rng, cuda_rng):
        # Memory beyond static bytes is measured against what the process held before the first step:
        # what the steps leave behind (allocator caches, kernels' workspaces kept for their shapes) is
        # memory the training steps will hold too. Read as `held_now`, as what the steps kept is: read
        # raw, the garbage and free heap pages building the model and its inputs left (freed in the
        # step) lowered what the first step was read to keep by as much, 13.9-20.8 MiB in 4 fresh
        # processes profiling `make demo`'s step (their resident memory grew 30.8 MiB in each, the
        # same to 0.1 MiB), and the floors they named after differed by 6 %.
        probe = MemoryProbe(device)
        left_before = _LEFT_BEHIND.get(model, 0)
        start_bytes = held_now(device)
        baseline_bytes = start_bytes - left_before

        def measure(decisions: dict[str, str] | None = None, rehearsed=None, **link):
            for p in parameters:
                p.grad = None
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            return _measure_step(model, example_inputs, loss_fn, found, device, decisions, baseline_bytes,
                                 measure_selective=selective and decisions is None and selective_recompute.AVAILABLE,
                                 rehearsed=rehearsed, **link)

        held_from_start = left_before   # what the sizes' step holds from its start (`Profile.held_from_start_bytes`)

        def measure_sizes():
            nonlocal held_from_start
            recorder, loss_seconds = measure()
            for p in parameters:
                p.grad = None
            # What the first step kept, the process holds while it trains: kernels' caches and
            # workspaces for the step's shapes, and in a fresh process what it started up (the code of
            # every kernel it ran read in, thread pools' arenas: ~16 MiB of libtorch's code pages and
            # ~5-9 MiB anonymous for a 3D U-Net's first step on CPU). Counted, whatever its size or kind:
            # leaving out the code pages let `make demo`'s plan (its budget counted from before the
            # model is built) fill 16 MiB it did not have, and its step measured 272-277 MiB for 256.
            # Told apart by size before (more than a quarter of the rise: start-up, left out), a warm
            # bf16 step's 11-13 MiB of caches for its slabs' shapes were taken for start-up in 2 runs
            # of 3, and the floor it named was 14-20 MiB under the step's. (Benchmarks leave start-up
            # out as the plain runs' does: a warm-up step of the same code paths before their baseline.)
            # Read as `held_now`: what the step left as garbage and free heap pages is not held, and
            # read raw it varied between fresh processes and rode on every phase of the step measured
            # next (`make demo`'s floor request: 36.3-41.9 MiB kept, its floors named 116-122 MiB in 7
            # processes whose resident memory after planning agreed within 0.4 MiB; now 114-116 in 4).
            kept = held_now(device) - baseline_bytes
            if not _agreed(kept > max(recorder.highest_above_static_bytes // HELD_SHARE, 2**20)):
                return recorder, loss_seconds
            # Every training step holds it from its start, the first step's phases only from where
            # it was made: measured again on a step that starts with it, from the same baseline.
            notes.append(f"the first profiling step left {format_bytes(kept)} held (kernel caches for its shapes, "
                         "a fresh process's start-up): sizes measured again on a second step that holds it from "
                         "its start, as training does")
            held_from_start += kept
            return measure()

        recorder, loss_seconds = measure_sizes()
        refined = _refined(found, recorder) if blocks is None else None
        if refined is not None:
            found = refined
            recorder, loss_seconds = measure()
        sized = _as_profile(model, example_inputs, loss_fn, optimizer, found, recorder, loss_seconds, device, notes)
        sized.held_from_start_bytes = held_from_start
        # Times come from a second step under the plan those sizes give (`rehearsal_plan`): the
        # all-swap sizing step's times are inflated by its transfers (on CPU they share the cores).
        timing, predicted_bytes, rehearsed = rehearsal_plan(sized, memory_bytes)
        before_rehearsal = probe.current()
        link_minimum = _link_minimum_bytes(sized)
        changing = frozenset(block.name for block in sized.blocks if block.changes_input)
        timer, sized.loss_seconds = measure(timing, rehearsed, link_minimum_bytes=link_minimum, changing=changing)
        for p in parameters:
            p.grad = None
        sized.measured_peak_bytes = max(sized.measured_peak_bytes, timer.probe.highest_bytes)
        _merge_timing_step(sized, timer)
        # The timing step rehearses a plan: what it held beyond the simulator's prediction (phases
        # measured a little differently in two steps: heap pages glibc keeps, page granularity) is
        # carried by every plan made from this profile (`planner._margin_bytes`). What it still holds
        # after is the start-up of a code path it ran first (recompute's), not the step's.
        started_up = max(probe.current() - before_rehearsal, 0)
        # (A plan counting gradients from backward on predicts against static memory with all of them.)
        measured = timer.highest_above_all_gradients_bytes if sized.gradients_from_backward else \
            timer.highest_above_static_bytes
        sized.rehearsal_excess_bytes = max(measured - predicted_bytes - started_up, 0)
        # Left behind for later profiles of this model: what the sizing steps left (kernel caches for
        # the step's shapes), not the timing step's start-up of its plan's code path (recompute's
        # left ~6 MiB for a 3D U-Net at 32 x 16^3, which a keep plan's training never holds; this
        # profile does not count it either, so a later one must not).
        # Read as `held_now`, the steps' garbage collected: read without, what the last steps' objects
        # still held (~10 MiB for a 3D U-Net at 64^3) was added at every profile of the same model,
        # and each profile read every phase that much larger than the last (4 profiles in a row
        # named 184, 195, 203, 210 MiB, the process's resident memory the same after each; now 184,
        # 187, 188, 188).
        _LEFT_BEHIND[model] = max(left_before + min(held_now(device), before_rehearsal) - start_bytes, left_before)
    return sized


def target_bytes(loss_fn, model: nn.Module, example_inputs, device: torch.device) -> int:
    """Bytes of the tensors on ``device`` the loss function holds (its targets), beyond the model's
    parameters and buffers and the inputs: resident through the step as the inputs are."""
    if loss_fn is None:
        return 0
    counted = [*model.parameters(), *model.buffers(), *tensors_in(example_inputs)]
    held = [tensor for tensor in tensors_held_by(loss_fn)
            if tensor.device.type == device.type and (tensor.device.index or 0) == (device.index or 0)
            and has_storage(tensor)]
    return max(storage_bytes(counted + held) - storage_bytes(counted), 0)


def _as_profile(model, example_inputs, loss_fn, optimizer, found, recorder, loss_seconds, device, notes) -> Profile:
    modules = dict(found)
    parameters = list(dict.fromkeys(model.parameters()))
    block_profiles = []
    order = recorder.order + [i for i in range(len(found)) if i not in recorder.order]
    for index in order:
        block = recorder.blocks[index]
        block.parameter_bytes = storage_bytes(list(modules[block.name].parameters()))
        block.batchnorm_channels = batchnorm_channels(modules[block.name])
        if block.calls == 0:
            notes.append(f"block {block.name} did not run in the profiled step")
        block_profiles.append(block)
    holders_by_place(block_profiles, order)
    earlier_saves_by_place(block_profiles, order)
    segments = _segments(found, recorder, order)
    trainable = [p for p in parameters if p.requires_grad]
    return Profile(
        device=str(device),
        blocks=block_profiles,
        parameter_bytes=storage_bytes(parameters),
        gradient_bytes=storage_bytes(trainable),
        buffer_bytes=storage_bytes(list(model.buffers())),
        optimizer_state_bytes=optimizer_state_bytes(optimizer, model, notes),
        input_bytes=storage_bytes(tensors_in(example_inputs)),
        input_tensor_bytes=tensor_bytes(tensors_in(example_inputs)),
        target_bytes=target_bytes(loss_fn, model, example_inputs, device),
        gradients_from_backward=True,   # the profiling steps start with every gradient None
        static_overhead_bytes=static_overhead_bytes(
            device, len(trainable), len(parameters) - len(trainable) + len(list(model.buffers()))
            + len(tensors_in(example_inputs))),
        unassigned_saved_bytes=recorder.unassigned_saved_bytes,
        loss_seconds=loss_seconds,
        link=recorder.link or measure_link(str(device)),
        notes=notes,
        measured_peak_bytes=recorder.probe.highest_bytes,
        loss_other_bytes=recorder.loss_other_bytes,
        loss_peak_bytes=recorder.loss_peak_bytes,
        output_freed_bytes=recorder.output_freed_bytes,
        loss_gradient_names=recorder.loss_gradient_names,
        segments=segments,
    )


def _segments(found, recorder: Recorder, order: list[int]) -> list[SegmentProfile]:
    """The modules around blocks the sizing step saw called once, whose call ran each of the blocks
    inside them once and no other block (a block the parent calls after the module's own forward, a
    module shared with another place: no segment), at consecutive places in the profile (``order``,
    the recorder's block numbers in place order)."""
    place = {index: position for position, index in enumerate(order)}
    names = [name for name, _ in found]
    segments = []
    for name, seen in recorder.segments.items():
        inside = [index for index, block in enumerate(names) if block.startswith(name + ".")]
        inner = sorted(place[index] for index in inside)
        consecutive = bool(inner) and inner == list(range(inner[0], inner[-1] + 1))
        if seen.calls != 1 or not consecutive or sorted(seen.ran) != inside or seen.changes_input:
            continue        # (one that changes its inputs in place: recomputed whole, it would start from the changed values)
        if any(recorder.blocks[order[position]].calls != 1 for position in inner):
            continue
        segment = SegmentProfile(name, inner[0], inner[-1], seen.input_bytes, seen.input_held_earlier,
                                 seen.input_saved_bytes)
        holders_by_place([segment], order)
        segments.append(segment)
    return segments
