"""The memory planner: from a Profile and a budget in bytes, choose keep / swap / recompute per
block so the simulated peak fits with the least simulated added time.

Budget arithmetic (DESIGN.md section 3): memory = static (parameters, gradients, buffers, optimizer
state, the step's inputs) + reserve (transient memory of forward and backward, estimated from the
profile) + activation budget (saved activations, the ledger's domain).
"""

from oomless.errors import InputError, PlanError
from oomless.plan.plan import BlockPlan, Plan
from oomless.plan.simulate import simulate
from oomless.plan.solvers import exact, greedy, relax, simulator_for, swap_added_seconds
from oomless.profile.profile import Profile
from oomless.sizes import format_bytes

DECISIONS = ("keep", "swap", "recompute")
EXACT_MAX_BLOCKS = 300  # "auto" runs the exact solver too up to here; the DP is O(n * bins)


def static_breakdown(profile: Profile) -> dict[str, int]:
    return {"parameters": profile.parameter_bytes, "gradients": profile.gradient_bytes,
            "buffers": profile.buffer_bytes, "optimizer state": profile.optimizer_state_bytes,
            "inputs": profile.input_bytes}


def _transient_bytes(block) -> int:
    """Bytes a block needs beyond saved activations while it runs, as the profiling step measured
    them; where not measured, its output and the gradients through it, about two of its largest
    tensors each way. Measured backward transients are the rise less all the block's saved bytes,
    matching the simulator, which holds them all until the block's backward ends."""
    if block.forward_transient_bytes is None or block.backward_transient_bytes is None:
        return 2 * block.output_bytes + 2 * block.largest_saved_bytes
    return max(block.forward_transient_bytes, block.backward_transient_bytes, block.output_bytes)


# Resident memory on CPU is measured with page granularity and allocator reuse; a second profile
# of the same step reads up to ~15 % differently. The reserve carries that much on top.
MEASUREMENT_MARGIN = 0.2


def reserve_bytes(profile: Profile) -> int:
    """Bytes on top of saved activations, at the worst block: what the forward holds across blocks
    (U-Net skips) or the gradients alive in backward, plus that block's own transients, plus the
    model's output and the loss's own saved tensors, plus the measurement margin."""
    per_block = max((max(block.held_forward_bytes, block.held_backward_bytes) + _transient_bytes(block)
                     for block in profile.blocks), default=0)
    final_output = profile.blocks[-1].output_bytes if profile.blocks else 0
    return int((per_block + 2 * final_output) * (1 + MEASUREMENT_MARGIN))


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
    return (f"recompute ({solver}): adds {recompute_ms:.1f} ms; swap would add ~{swap_ms:.1f} ms "
            f"({copy_ms:.1f} ms copy back)")


def smallest_memory(profile: Profile, max_pending_out_bytes: int | None = None) -> int:
    """The smallest budget one of the uniform plans (all swap, all recompute, or all keep: on a slow
    link swaps free nothing before the peak, and recompute holds inputs) fits, for this profile."""
    if profile.link.kind == "disk" and max_pending_out_bytes is None:
        max_pending_out_bytes = 256 * 2**20
    frugal_peak = min(simulate(profile, [option] * len(profile.blocks), 1, max_pending_out_bytes).activation_peak_bytes
                      for option in ("swap", "recompute", "keep"))
    return sum(static_breakdown(profile).values()) + reserve_bytes(profile) + frugal_peak


def _with_margin(num_bytes: int) -> int:
    """``num_bytes`` plus 5 % (at least 1 MiB), rounded up to whole MiB."""
    padded = num_bytes + max(num_bytes // 20, 2**20)
    return -(-padded // 2**20) * 2**20


def make_plan(profile: Profile, memory_bytes: int, decisions: dict[str, str] | None = None,
              max_pending_out_bytes: int | None = None, min_swap_bytes: int = 64 * 1024,
              solver: str = "auto") -> Plan:
    """Choose decisions for ``profile`` within ``memory_bytes`` (or check the ones given)."""
    static = static_breakdown(profile)
    static_bytes = sum(static.values())
    reserve = reserve_bytes(profile)
    budget = memory_bytes - static_bytes - reserve
    names = [block.name for block in profile.blocks]
    if profile.link.kind == "disk" and max_pending_out_bytes is None:
        max_pending_out_bytes = 256 * 2**20
    plain = simulate(profile, ["keep"] * len(names), 1, max_pending_out_bytes)
    exact_minimum = smallest_memory(profile, max_pending_out_bytes)
    # Transient bytes are measured, and a second profile of the same step differs a little:
    # the smallest budget reported carries a margin so that planning again with it succeeds.
    minimum = _with_margin(exact_minimum)
    if memory_bytes < exact_minimum and decisions is None:
        limiting = max(profile.blocks, key=lambda b: b.saved_bytes + b.input_bytes, default=None)
        limiting_name = limiting.name if limiting is not None and static_bytes + reserve < memory_bytes else None
        why = (f"block {limiting_name} must hold its {format_bytes(limiting.saved_bytes)} of saved tensors "
               "during its own backward" if limiting_name else
               f"static bytes ({format_bytes(static_bytes)}) and the transient reserve "
               f"({format_bytes(reserve)}) alone exceed it")
        raise PlanError(f"no plan fits {format_bytes(memory_bytes)}: the smallest budget that fits is "
                        f"{format_bytes(minimum)} ({minimum} bytes); {why}. Give memory >= {minimum}, "
                        "a smaller batch, or finer blocks (blocks=...)",
                        minimum_bytes=minimum, limiting_block=limiting_name)

    if solver not in ("auto", "greedy", "exact"):
        raise InputError(f"solver must be 'auto', 'greedy' or 'exact', got {solver!r}")
    use_exact = solver == "exact" or (solver == "auto" and len(names) <= EXACT_MAX_BLOCKS)
    best = None
    for prefetch in (1, 2, 3):
        run = simulator_for(profile, prefetch, max_pending_out_bytes)
        candidates = []
        if decisions:
            candidates.append(("given", [decisions[name] for name in names]))
        else:
            if solver != "exact":
                candidates.append(("greedy", greedy(run, profile, budget, ["keep"] * len(names))))
            if use_exact:
                found = exact(run, profile, budget)
                if found is not None:
                    candidates.append(("exact", relax(run, profile, budget, found)))
            # When the greedy stalls (no move lowers the peak), relaxing the most frugal plans back
            # towards keep still finds a fitting plan.
            if not any(run(chosen).activation_peak_bytes <= budget for _, chosen in candidates):
                candidates += [("relaxed", relax(run, profile, budget, [option] * len(names)))
                               for option in ("swap", "recompute")]
        for solver_name, chosen in candidates:
            timeline = run(chosen)
            fits = timeline.activation_peak_bytes <= budget
            key = (not fits, timeline.step_seconds if fits else timeline.activation_peak_bytes)
            if best is None or key < best[0]:
                best = (key, prefetch, chosen, timeline, solver_name)
    _, prefetch, chosen, timeline, solver_name = best
    if timeline.activation_peak_bytes > budget and decisions is None:
        raise PlanError(f"the planner found no plan within {format_bytes(memory_bytes)}; its best needs "
                        f"{format_bytes(static_bytes + reserve + timeline.activation_peak_bytes)}",
                        minimum_bytes=_with_margin(static_bytes + reserve + timeline.activation_peak_bytes))
    blocks = [BlockPlan(block.name, chosen[i], _reason(profile, i, chosen[i], timeline, budget, solver_name),
                        block.saved_bytes, block.forward_seconds, block.backward_seconds)
              for i, block in enumerate(profile.blocks)]
    notes = list(profile.notes) + [f"solver: {solver_name} ({len(names)} blocks, prefetch distance {prefetch})"]
    if decisions is not None and timeline.activation_peak_bytes > budget:
        notes.append(f"the given decisions are predicted to exceed the activation budget by "
                     f"{format_bytes(timeline.activation_peak_bytes - budget)}")
    return Plan(
        memory_bytes=memory_bytes, device=profile.device, static_bytes=static_bytes, reserve_bytes=reserve,
        activation_budget=budget, predicted_peak_bytes=static_bytes + reserve + timeline.activation_peak_bytes,
        predicted_activation_peak_bytes=timeline.activation_peak_bytes,
        predicted_step_seconds=timeline.step_seconds,
        plain_peak_bytes=static_bytes + reserve + plain.activation_peak_bytes,
        plain_step_seconds=plain.step_seconds, blocks=blocks, prefetch_blocks=prefetch,
        min_swap_bytes=min_swap_bytes,
        static_breakdown=static, notes=notes)
