"""The memory planner: from a Profile and a budget in bytes, choose keep / swap / recompute per
block so the simulated peak fits with the least simulated added time.

Budget arithmetic (DESIGN.md section 3): memory = static (parameters, gradients, buffers, optimizer
state, the step's inputs) + reserve (transient memory of forward and backward, estimated from the
profile) + activation budget (saved activations, the ledger's domain).
"""

from oomless.errors import PlanError
from oomless.plan.plan import BlockPlan, Plan
from oomless.plan.simulate import simulate
from oomless.profile.profile import Profile
from oomless.sizes import format_bytes

DECISIONS = ("keep", "swap", "recompute")


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


class _Search:
    def __init__(self, profile: Profile, budget: int, prefetch_blocks: int, max_pending_out_bytes):
        self.profile = profile
        self.budget = budget
        self.prefetch_blocks = prefetch_blocks
        self.max_pending = max_pending_out_bytes

    def run(self, decisions):
        return simulate(self.profile, decisions, self.prefetch_blocks, self.max_pending)

    def greedy(self, start: list[str]) -> list[str]:
        """Move the block that buys the most bytes per added second until the plan fits, then
        undo moves that are no longer needed, cheapest-first."""
        decisions = list(start)
        current = self.run(decisions)
        while current.activation_peak_bytes > self.budget:
            best, best_score, best_timeline = None, 0.0, None
            for i, decision in enumerate(decisions):
                for option in (("swap", "recompute") if decision == "keep" else
                               ("recompute",) if decision == "swap" else ()):
                    trial = decisions[:i] + [option] + decisions[i + 1:]
                    timeline = self.run(trial)
                    saved = (current.activation_peak_bytes - timeline.activation_peak_bytes
                             + 0.01 * (current.forward_end_bytes - timeline.forward_end_bytes))
                    if saved <= 0:
                        continue
                    added = max(timeline.step_seconds - current.step_seconds, 0.0)
                    score = saved / (added + 1e-6)
                    if score > best_score:
                        best, best_score, best_timeline = trial, score, timeline
            if best is None:
                break
            decisions, current = best, best_timeline
        return self.relax(decisions)

    def relax(self, decisions: list[str]) -> list[str]:
        improved = True
        while improved:
            improved = False
            base = self.run(decisions)
            for i, decision in enumerate(decisions):
                for option in {"recompute": ("keep", "swap"), "swap": ("keep",), "keep": ()}[decision]:
                    trial = decisions[:i] + [option] + decisions[i + 1:]
                    timeline = self.run(trial)
                    if (timeline.activation_peak_bytes <= max(self.budget, base.activation_peak_bytes)
                            and timeline.step_seconds < base.step_seconds - 1e-12):
                        decisions, base, improved = trial, timeline, True
                        break
        return decisions


def _reason(profile, index, decisions, search, timeline) -> str:
    block, decision = profile.blocks[index], decisions[index]
    if decision == "keep":
        return "fits: kept on the device"
    kept = decisions[:index] + ["keep"] + decisions[index + 1:]
    swap = decisions[:index] + ["swap"] + decisions[index + 1:]
    recompute = decisions[:index] + ["recompute"] + decisions[index + 1:]
    added = {name: search.run(trial).step_seconds - search.run(kept).step_seconds
             for name, trial in (("swap", swap), ("recompute", recompute))}
    if decision == "swap":
        hidden = "transfer hidden behind compute" if added["swap"] <= 1e-4 else \
            f"adds {added['swap'] * 1e3:.1f} ms"
        return f"swap: {hidden}; recompute would add {added['recompute'] * 1e3:.1f} ms"
    return f"recompute: adds {added['recompute'] * 1e3:.1f} ms; swap would add {added['swap'] * 1e3:.1f} ms" \
        if search.run(swap).activation_peak_bytes <= search.budget else \
        f"recompute: adds {added['recompute'] * 1e3:.1f} ms; swap alone would not fit"


def smallest_memory(profile: Profile, max_pending_out_bytes: int | None = None) -> int:
    """The smallest budget the most frugal plan (all swap, or all recompute) fits, for this profile."""
    if profile.link.kind == "disk" and max_pending_out_bytes is None:
        max_pending_out_bytes = 256 * 2**20
    frugal_peak = min(simulate(profile, [option] * len(profile.blocks), 1, max_pending_out_bytes).activation_peak_bytes
                      for option in ("swap", "recompute"))
    return sum(static_breakdown(profile).values()) + reserve_bytes(profile) + frugal_peak


def _with_margin(num_bytes: int) -> int:
    """``num_bytes`` plus 5 % (at least 1 MiB), rounded up to whole MiB."""
    padded = num_bytes + max(num_bytes // 20, 2**20)
    return -(-padded // 2**20) * 2**20


def make_plan(profile: Profile, memory_bytes: int, decisions: dict[str, str] | None = None,
              max_pending_out_bytes: int | None = None, min_swap_bytes: int = 64 * 1024) -> Plan:
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

    best = None
    for prefetch in (1, 2, 3):
        search = _Search(profile, budget, prefetch, max_pending_out_bytes)
        if decisions:
            candidates = [[decisions[name] for name in names]]
        else:
            # Greedy from all-keep is usually best; when it stalls (no single move lowers the peak),
            # relaxing the most frugal plans back towards keep still finds a fitting plan.
            candidates = [search.greedy(["keep"] * len(names))] + \
                [search.relax([option] * len(names)) for option in ("swap", "recompute")]
        for chosen in candidates:
            timeline = search.run(chosen)
            fits = timeline.activation_peak_bytes <= budget
            key = (not fits, timeline.step_seconds if fits else timeline.activation_peak_bytes)
            if best is None or key < best[0]:
                best = (key, prefetch, chosen, timeline, search)
    _, prefetch, chosen, timeline, search = best
    if timeline.activation_peak_bytes > budget and decisions is None:
        raise PlanError(f"the planner found no plan within {format_bytes(memory_bytes)}; its best needs "
                        f"{format_bytes(static_bytes + reserve + timeline.activation_peak_bytes)}",
                        minimum_bytes=_with_margin(static_bytes + reserve + timeline.activation_peak_bytes))
    blocks = [BlockPlan(block.name, chosen[i], _reason(profile, i, chosen, search, timeline),
                        block.saved_bytes, block.forward_seconds, block.backward_seconds)
              for i, block in enumerate(profile.blocks)]
    notes = list(profile.notes)
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
