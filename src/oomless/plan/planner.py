"""The memory planner: from a Profile and a budget in bytes, choose keep / swap / recompute per
block so the simulated peak fits with the least simulated added time.

Budget arithmetic (DESIGN.md section 3): memory = static (parameters, gradients, buffers, optimizer
state, the step's inputs) + reserve (transient memory of forward and backward, estimated from the
profile) + activation budget (saved activations, the ledger's domain).
"""

import functools
from dataclasses import replace

from oomless.errors import InputError, PlanError
from oomless.plan.plan import BlockPlan, Plan
from oomless.plan.simulate import (SELECTIVE, Timeline, backward_other_bytes, forward_other_bytes, least_other_bytes,
                                   loss_other_bytes, phases, recompute_seconds, recomputed_bytes,
                                   selective_offered, simulate, with_swap_threshold)
from oomless.plan.solvers import exact, greedy, relax, simulator_for, swap_added_seconds
from oomless.profile.profile import Profile
from oomless.runtime.tiers import DISK_MAX_PENDING_BYTES
from oomless.sizes import format_bytes

DECISIONS = ("keep", "swap", "recompute")
MIN_SWAP_BYTES = 64 * 1024  # `make_plan`'s default: a smaller storage costs more to copy than it frees
EXACT_MAX_BLOCKS = 300  # "auto" runs the exact solver too up to here; the DP is O(n * bins)


def static_breakdown(profile: Profile) -> dict[str, int]:
    return {"parameters": profile.parameter_bytes, "gradients": profile.gradient_bytes,
            "buffers": profile.buffer_bytes, "optimizer state": profile.optimizer_state_bytes,
            "inputs": profile.input_bytes, "targets": profile.target_bytes,
            "allocator and objects": profile.static_overhead_bytes}


def _transient_bytes(block) -> int:
    """Bytes a block needs beyond saved activations while it runs, as the profiling step measured
    them; where not measured, its output and the gradients through it, about two of its largest
    tensors each way (used by the pipeline partitioner's per-stage memory)."""
    if block.forward_transient_bytes is None or block.backward_transient_bytes is None:
        return 2 * block.output_bytes + 2 * block.largest_saved_bytes
    return max(block.forward_transient_bytes, block.backward_transient_bytes, block.output_bytes)


# The reserve is measured (`profile.recorder`), exactly, at each change of the ledger; what varies
# between two profiles of the same step on CPU (heap pages glibc keeps, page granularity) is carried
# by this share of it on top, or by what the profiler's rehearsal of a plan held over its prediction,
# whichever is more. Profiles with estimated or meta-traced bytes (no kernels' workspaces) carry 20 %.
MEASURED_MARGIN = 0.05
ESTIMATED_MARGIN = 0.2


def _worst_other_bytes(profile: Profile) -> int:
    """The largest "other" bytes of any block's forward or backward or of the loss: held tensors
    such as U-Net skips, gradients in flight, op workspaces, the loss's own tensors."""
    others = [forward_other_bytes(profile, block) for block in profile.blocks]
    others += [backward_other_bytes(profile, block) for block in profile.blocks]
    return max(others + [loss_other_bytes(profile)])


def _margin_bytes(profile: Profile) -> int:
    measured = (all(block.forward_other_bytes is not None and block.backward_other_bytes is not None
                    for block in profile.blocks) and profile.loss_other_bytes is not None
                and not profile.memory_traced)
    rate = profile.margin_share if profile.margin_share is not None else \
        MEASURED_MARGIN if measured else ESTIMATED_MARGIN
    share = int(_worst_other_bytes(profile) * rate)
    return max(share, profile.rehearsal_excess_bytes)


def reserve_bytes(profile: Profile) -> int:
    """Bytes on top of saved activations at the worst phase of the step, plus the measurement margin."""
    return _worst_other_bytes(profile) + _margin_bytes(profile)


def _what_limits(profile: Profile, timeline: Timeline) -> tuple[str | None, str]:
    """(block, why) of the smallest plan's peak: the block whose saved tensors fill most of the
    device then (copies out that cannot keep up), else the phase that runs then."""
    kind, index = timeline.peak_phase
    if kind == "optimizer step":
        return None, (f"the optimizer's step after backward sets it: "
                      f"{format_bytes(profile.optimizer_step_other_bytes)} beyond the static bytes (its temporaries, "
                      "the state it brings in) with every gradient on the device; the update in backward "
                      "(update_in_backward=True) steps one module at a time, fused=True makes no temporaries")
    holders = timeline.peak_holders or {}
    holder = max(holders, key=holders.get, default=None)
    if index >= 0:
        block = profile.blocks[index]
        working = forward_other_bytes(profile, block) if kind == "forward" else backward_other_bytes(profile, block)
    else:
        working = loss_other_bytes(profile)
    if holder is not None and holders[holder] > working:
        name = profile.blocks[holder].name
        return name, (f"block {name}'s saved tensors ({format_bytes(holders[holder])}) are still on the device "
                      f"then: its copies out take longer than the blocks after it")
    if index < 0:
        return None, (f"the loss sets it: the model's output, the loss's own tensors and their gradients "
                      f"({format_bytes(working)}; a loss computed in slabs, oomless.loss_in_slabs, makes none "
                      f"of its per-element tensors whole; a language model's head and loss in chunks, "
                      f"oomless.linear_cross_entropy, never makes its logits whole)")
    return block.name, (f"block {block.name}'s {kind} sets it: {format_bytes(working)} of working memory beyond "
                        f"saved tensors ({_working_parts(profile, working)}), with saved tensors brought back one "
                        f"at a time as it needs them (its largest {format_bytes(block.largest_saved_bytes)})")


def _working_parts(profile: Profile, working: int) -> str:
    """What a phase's ``working`` bytes are: its own tensors, and what the process held from the
    step's start (`Profile.held_from_start_bytes`), named where that is a share worth naming."""
    own = "held tensors, gradients in flight, op workspaces"
    held = min(profile.held_from_start_bytes, working)
    if held < max(working // 10, 2**20):
        return own
    what = "what earlier steps left the process holding: kernels' caches for its shapes, compiled code, start-up"
    if working - held < max(working // 20, 2**20):
        return f"nearly all of it {what}, which no plan frees"
    return f"{format_bytes(held)} of it {what}; {format_bytes(working - held)} its own: {own}"


def _reason(profile: Profile, index: int, decision: str, timeline, budget: int, solver: str) -> str:
    """Why block ``index`` got ``decision``, from the chosen plan's timeline and the per-block costs."""
    block = profile.blocks[index]
    if decision == "keep":
        return "fits: kept on the device"
    recompute_ms = block.forward_seconds * 1e3
    copy_ms = block.saved_bytes / profile.link.in_bytes_per_second * 1e3
    swap_ms = swap_added_seconds(profile, index) * 1e3
    if decision == "swap":
        stall_ms = (timeline.block_stall_seconds or [0.0] * len(profile.blocks))[index] * 1e3
        hidden = "transfer hidden behind compute" if stall_ms <= 0.1 else f"backward waits {stall_ms:.1f} ms for it"
        return f"swap ({solver}): {hidden} ({copy_ms:.1f} ms copy); recompute would add {recompute_ms:.1f} ms"
    if decision == SELECTIVE:
        return (f"selective recompute ({solver}): keeps its matmul/convolution outputs "
                f"({format_bytes(block.selective_kept_bytes)} of {format_bytes(block.saved_bytes)} saved), "
                f"adds {recompute_seconds(block, SELECTIVE) * 1e3:.1f} ms re-running the rest; "
                f"full recompute would add {recompute_ms:.1f} ms")
    return (f"recompute ({solver}): adds {recompute_ms:.1f} ms; swap would add ~{swap_ms:.1f} ms "
            f"({copy_ms:.1f} ms copy back)")


COORDINATE_SEARCH_MAX_BLOCKS = 40  # single-block moves are tried up to here: O(n) simulations a round


def _frugal_plan(profile: Profile, max_pending_out_bytes: int | None) -> tuple[list[str], Timeline]:
    """The plan with the smallest simulated peak beyond static memory: swapped tensors come back only when
    backward needs them (prefetch window 0). The best of the uniform plans (all swap, all
    recompute, all keep: on a slow link swaps free nothing before the peak, and recompute holds
    inputs) and of recomputing exactly the blocks whose input is smaller than what they save, then
    (up to COORDINATE_SEARCH_MAX_BLOCKS blocks) single-block moves while they lower the peak."""
    run = simulator_for(profile, 0, max_pending_out_bytes, None)
    return _frugal_search(run, profile, *_frugal_start(run, profile))


def _frugal_start(run, profile: Profile) -> tuple[list[str], Timeline]:
    """Where `_frugal_plan` starts its search, with its timeline: no plan it finds peaks higher."""
    count = len(profile.blocks)
    starts = [[option] * count for option in DECISIONS]
    starts.append(["recompute" if block.input_bytes < block.saved_bytes else "swap" for block in profile.blocks])
    decisions = min(starts, key=lambda start: run(start).total_peak_bytes)
    return decisions, run(decisions)


def _frugal_search(run, profile: Profile, decisions: list[str], timeline: Timeline) -> tuple[list[str], Timeline]:
    """`_frugal_plan`'s single-block moves from ``decisions`` while they lower the peak."""
    count = len(profile.blocks)
    improved, rounds = count <= COORDINATE_SEARCH_MAX_BLOCKS, 0
    while improved and rounds < 4:
        improved, rounds = False, rounds + 1
        for index in range(count):
            for option in DECISIONS:
                if option == decisions[index]:
                    continue
                trial = decisions[:index] + [option] + decisions[index + 1:]
                candidate = run(trial)
                if candidate.total_peak_bytes < timeline.total_peak_bytes:
                    decisions, timeline, improved = trial, candidate, True
    return decisions, timeline


def _pending_out_bound(profile: Profile, max_pending_out_bytes: int | None) -> int | None:
    """Bytes of copies out the forward may run ahead of: as given, else the disk tier's own bound
    (its writer makes the forward wait past it); None: no bound (copies to pinned host memory)."""
    if profile.link.kind == "disk" and max_pending_out_bytes is None:
        return DISK_MAX_PENDING_BYTES
    return max_pending_out_bytes


# The link's bandwidth varies between two profiles of the same step (disk writeback, page cache, a
# busy bus): the smallest budget named in a PlanError must also fit with a link this much slower,
# so that giving it back, profiled again, still plans.
LINK_NOISE = 0.75


def _with_slower_link(profile: Profile) -> Profile:
    link = profile.link
    return replace(profile, link=replace(link, out_bytes_per_second=link.out_bytes_per_second * LINK_NOISE,
                                         in_bytes_per_second=link.in_bytes_per_second * LINK_NOISE))


def _memory_for(profile: Profile, timeline: Timeline) -> int:
    """The budget a step simulated as ``timeline`` needs: static bytes, the margin and its peak."""
    return sum(static_breakdown(profile).values()) + _margin_bytes(profile) + timeline.total_peak_bytes


def smallest_memory(profile: Profile, max_pending_out_bytes: int | None = None,
                    min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """The smallest budget any plan with ``min_swap_bytes`` fits, for this profile (without the
    margin PlanError adds)."""
    profile = with_swap_threshold(profile, min_swap_bytes)
    _, timeline = _frugal_plan(profile, _pending_out_bound(profile, max_pending_out_bytes))
    return _memory_for(profile, timeline)


def smallest_memory_for(profile: Profile, decisions: dict[str, str], max_pending_out_bytes: int | None = None,
                        min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """The smallest budget the given decisions fit, for this profile (without the margin PlanError
    adds): swapped bytes come back only as backward reaches them (prefetch window 0). A plan of these
    decisions at this budget fits, bringing them back as early as the budget allows."""
    profile = with_swap_threshold(profile, min_swap_bytes)
    timeline = simulate(profile, [decisions[block.name] for block in profile.blocks], 0,
                        _pending_out_bound(profile, max_pending_out_bytes))
    return _memory_for(profile, timeline)


def rehearsal_plan(profile: Profile, memory_bytes: int | None) -> tuple[dict[str, str], int, Plan | None]:
    """(decisions, predicted bytes beyond static memory without the margin, the plan itself) of what
    the profiler's timing step rehearses: the plan for ``memory_bytes``; where none fits, the smallest
    plan at its smallest budget; the step keeps either's limits, as training would. Without a budget,
    every block recomputed (no plan: nothing swapped, no limits). Swaps of any size, as the profiling
    steps run them."""
    names = [block.name for block in profile.blocks]
    max_pending_out_bytes = _pending_out_bound(profile, None)
    if memory_bytes is None:
        decisions = ["recompute"] * len(names)
        return (dict(zip(names, decisions)),
                simulate(profile, decisions, None, max_pending_out_bytes).total_peak_bytes, None)
    try:
        made = make_plan(profile, memory_bytes, min_swap_bytes=0)
    except PlanError:
        # The smallest plan, at its own smallest budget: the floor a PlanError names counts static
        # placements (the update in backward, state and parameters off the device) that this
        # profile's plans do not, so the budget given is below what its plans need.
        decisions, timeline = _frugal_plan(profile, max_pending_out_bytes)
        try:
            made = make_plan(profile, _memory_for(profile, timeline), dict(zip(names, decisions)), min_swap_bytes=0)
        except PlanError:
            return dict(zip(names, decisions)), timeline.total_peak_bytes, None
    return made.decisions, made.predicted_peak_bytes - made.static_bytes - _margin_bytes(profile), made


def with_margin(num_bytes: int) -> int:
    """``num_bytes`` plus 2 % (at least 1 MiB), rounded up to whole MiB: the step as it trains (or
    measured again) reads a little differently from the step measured."""
    padded = num_bytes + max(num_bytes // 50, 2**20)
    return -(-padded // 2**20) * 2**20


def named_margin_bytes(named_bytes: int) -> int:
    """The margin `with_margin` put in a budget it named, ``named_bytes`` (at most: what is left
    without it is at least the smallest plan's bytes, to within a byte of integer division)."""
    return max(named_bytes // 51, 2**20)


def _prefetch_windows(profile: Profile, budget: int) -> list[int | None]:
    """Prefetch windows the planner tries: none ahead (the most frugal), a few tensors ahead, a
    quarter of the budget, and as far as the budget allows."""
    largest = max((block.largest_saved_bytes for block in profile.blocks), default=0)
    return [0, 4 * largest, max(budget // 4, 0), None]


def make_plan(profile: Profile, memory_bytes: int, decisions: dict[str, str] | None = None,
              max_pending_out_bytes: int | None = None, min_swap_bytes: int = MIN_SWAP_BYTES,
              solver: str = "auto") -> Plan:
    """Choose decisions for ``profile`` within ``memory_bytes`` (or check the ones given).

    Memory = static bytes + the measurement margin + what the step holds beyond static bytes at its
    worst moment: saved activations on the ledger plus the running phase's working memory, as the
    simulator replays the plan (`plan.simulate`). A swapped block keeps its storages under
    ``min_swap_bytes`` on the device, as the runtime does, and the simulator counts them there."""
    profile = with_swap_threshold(profile, min_swap_bytes)
    static = static_breakdown(profile)
    static_bytes = sum(static.values())
    margin = _margin_bytes(profile)
    worst_other = _worst_other_bytes(profile)
    budget = memory_bytes - static_bytes - margin     # beyond static bytes, for the whole step
    names = [block.name for block in profile.blocks]
    max_pending_out_bytes = _pending_out_bound(profile, max_pending_out_bytes)
    frugal_run = simulator_for(profile, 0, max_pending_out_bytes, None)
    frugal_started = functools.cache(lambda: _frugal_start(frugal_run, profile))
    frugal_searched = functools.cache(lambda: _frugal_search(frugal_run, profile, *frugal_started()))
    # Below static bytes and the margin, no plan fits whatever the search finds: it runs only if the
    # refusal's numbers are read (a floor request refuses every candidate placement, and reports one).
    static_alone = decisions is None and memory_bytes < static_bytes + margin
    if not static_alone:
        # Only a budget below the search's start can be below its end: above it, the search is not
        # needed to tell that some plan fits (its plan is asked for below, where none does).
        below_start = memory_bytes < static_bytes + margin + frugal_started()[1].total_peak_bytes
        frugal_timeline = (frugal_searched() if below_start else frugal_started())[1]
    if static_alone or (memory_bytes < static_bytes + margin + frugal_timeline.total_peak_bytes and decisions is None):
        static_exceeds = static_bytes + margin >= memory_bytes
        limiting_name = None if static_exceeds else _what_limits(profile, frugal_timeline)[0]

        def named() -> tuple[str, int, str | None]:
            timeline = frugal_searched()[1]
            floor_name, why = _what_limits(profile, timeline)
            if static_exceeds:
                why = (f"static bytes ({format_bytes(static_bytes)}) and the measurement margin "
                       f"({format_bytes(margin)}) alone exceed it")
            # A second profile of the same step measures a little differently: the smallest budget
            # reported carries a margin, and fits a slower link too, so that planning again with it succeeds.
            _, slower_timeline = _frugal_plan(_with_slower_link(profile), max_pending_out_bytes)
            minimum = with_margin(static_bytes + margin + max(timeline.total_peak_bytes,
                                                               slower_timeline.total_peak_bytes))
            return (f"no plan fits {format_bytes(memory_bytes)}: the smallest budget that fits is "
                    f"{format_bytes(minimum)} ({minimum} bytes); {why}. Give memory >= {minimum}, "
                    "or a smaller batch"), minimum, floor_name
        raise PlanError.deferred(named, limiting_block=limiting_name)

    plain = simulate(profile, ["keep"] * len(names), None, max_pending_out_bytes)
    not_offered = [block.name for block in profile.blocks
                   if (decisions or {}).get(block.name) == SELECTIVE and not selective_offered(block)]
    if not_offered:
        raise InputError(f"decisions ask for selective recompute of {not_offered[:5]}, which the profile did not "
                         "measure (compiled blocks, chains in slabs, parameters offloaded or sharded, pipeline "
                         "stages, meta-tensor profiles, or a torch without SelectiveCheckpointContext.op_output, "
                         "such as 2.11); use 'recompute' there")
    if solver not in ("auto", "greedy", "exact"):
        raise InputError(f"solver must be 'auto', 'greedy' or 'exact', got {solver!r}")
    use_exact = solver == "exact" or (solver == "auto" and len(names) <= EXACT_MAX_BLOCKS)
    best, widening = None, False
    for window in _prefetch_windows(profile, budget - worst_other):
        run = simulator_for(profile, window, max_pending_out_bytes, budget)
        candidates = []
        if decisions:
            candidates.append(("given", [decisions[name] for name in names]))
        elif widening:
            # The best plan so far fits and nothing waits for a transfer, but it recomputes: here,
            # with more bytes brought back ahead of use, a swap whose copy back stalled at the
            # narrower window hides behind several blocks' backward and can cost less than the
            # recompute. `relax` undoes recomputes into swaps where the simulator says so, a few
            # hundred simulations at most: the solvers run again from scratch at each window planned
            # generated 1000 blocks in 7.1 s instead of 1.7, and the README's 70B fsdp rank 0.08 s
            # a step slower than relaxing the plan window after window.
            candidates.append((best[4], relax(run, profile, budget, best[2])))
        else:
            if solver != "exact":
                candidates.append(("greedy", greedy(run, profile, budget, ["keep"] * len(names))))
            if use_exact:
                found = exact(run, profile, budget)
                if found is not None:
                    candidates.append(("exact", relax(run, profile, budget, found)))
            # When the greedy stalls (no move lowers the peak), relaxing the most frugal plans back
            # towards keep still finds a fitting plan.
            if not any(run(chosen).total_peak_bytes <= budget for _, chosen in candidates):
                candidates += [("relaxed", relax(run, profile, budget, start))
                               for start in (frugal_searched()[0], ["swap"] * len(names),
                                             ["recompute"] * len(names))]
        for solver_name, chosen in candidates:
            timeline = run(chosen)
            fits = timeline.total_peak_bytes <= budget
            key = (not fits, timeline.step_seconds if fits else timeline.total_peak_bytes)
            if best is None or key < best[0]:
                best = (key, window, chosen, timeline, solver_name)
        if not best[0][0] and best[3].stall_seconds <= 1e-9:
            if decisions or not any(decision in ("recompute", SELECTIVE) for decision in best[2]):
                break   # nothing waits for a transfer: a wider window has nothing to hide, only bytes to add
            # Stopping here too left the README's 70B transformer's fsdp rank recomputing 78 blocks,
            # 7.65 s a step, where swapping 25 of them fits in 7.07 s (docs/history.md).
            widening = True
    _, window, chosen, timeline, solver_name = best
    if timeline.total_peak_bytes > budget and decisions is None:
        raise PlanError(f"the planner found no plan within {format_bytes(memory_bytes)}; its best needs "
                        f"{format_bytes(static_bytes + margin + timeline.total_peak_bytes)}",
                        minimum_bytes=with_margin(static_bytes + margin + timeline.total_peak_bytes))
    forward_phases, loss_phase, backward_phases = phases(profile, chosen)
    blocks = [BlockPlan(block.name, "recompute" if chosen[i] == SELECTIVE else chosen[i],
                        _reason(profile, i, chosen[i], timeline, budget, solver_name),
                        block.saved_bytes, block.forward_seconds, block.backward_seconds,
                        forward_limit_bytes=budget - forward_phases[i].other,
                        backward_limit_bytes=budget - backward_phases[i].other,
                        selective=chosen[i] == SELECTIVE, recomputed_bytes=recomputed_bytes(block),
                        changes_input=block.changes_input)
              for i, block in enumerate(profile.blocks)]
    ahead = "as far as the budget allows" if window is None else format_bytes(window)
    notes = list(profile.notes) + [f"solver: {solver_name} ({len(names)} blocks, swapped tensors brought back "
                                   f"ahead of use: {ahead})"]
    if decisions is not None and timeline.total_peak_bytes > budget:
        notes.append(f"the given decisions are predicted to exceed the budget by "
                     f"{format_bytes(timeline.total_peak_bytes - budget)}")
    return Plan(
        memory_bytes=memory_bytes, device=profile.device, static_bytes=static_bytes,
        reserve_bytes=worst_other + margin, activation_budget=budget - least_other_bytes(profile),
        gradients_from_backward=profile.gradients_from_backward,
        output_freed_bytes=profile.output_freed_bytes, input_tensor_bytes=profile.input_tensor_bytes,
        predicted_peak_bytes=static_bytes + margin + timeline.total_peak_bytes,
        predicted_activation_peak_bytes=timeline.activation_peak_bytes,
        predicted_step_seconds=timeline.step_seconds,
        plain_peak_bytes=static_bytes + margin + plain.total_peak_bytes,
        plain_step_seconds=plain.step_seconds, blocks=blocks, prefetch_bytes=window,
        loss_limit_bytes=budget - loss_phase.other,
        min_swap_bytes=min_swap_bytes,
        static_breakdown=static, notes=notes)
