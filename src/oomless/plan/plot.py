"""The picture for a report: device memory over one training step, plain PyTorch against the plan,
with the budget line. Curves come from the timeline simulator, the same one the planner trusts.
Under them, the static bytes the plan keeps on the device, one band per kind (parameters, gradients,
optimizer state, buffers, inputs); what lives elsewhere (the disk tier, pinned host memory, one
module's at a time in backward) is named in the legend with its bytes.

    from oomless.plan.plot import plot_plan
    plot_plan(profile, plan, "plan.png")          # needs matplotlib: pip install oomless[plot]
"""

from pathlib import Path

from oomless.errors import OomlessError
from oomless.plan.plan import Plan
from oomless.plan.simulate import simulate, with_swap_threshold
from oomless.profile.profile import Profile
from oomless.sizes import format_bytes

GiB, MiB = 2**30, 2**20


def memory_curves(profile: Profile, plan: Plan) -> dict[str, list[tuple[float, int]]]:
    """{"plain": [(seconds, bytes)], "plan": [...]}: static bytes and what the step holds beyond them
    (saved activations and the running phase's working memory); the planner's margin is not drawn.
    Plain PyTorch holds every static byte on the device; the plan only those its placement leaves there."""
    moved = sum(part.total_bytes - part.device_bytes for part in plan.static_parts)
    curves = {}
    budget = plan.memory_bytes - plan.static_bytes
    profile = with_swap_threshold(profile, plan.min_swap_bytes)
    for label, decisions, prefetch, base in (
            ("plain", ["keep"] * len(profile.blocks), None, plan.static_bytes + moved),
            ("plan", [block.decision for block in plan.blocks], plan.prefetch_bytes, plan.static_bytes)):
        timeline = simulate(profile, decisions, prefetch, keep_curve=True, budget_bytes=budget)
        curves[label] = [(0.0, base)] + [(seconds, base + held) for seconds, held in timeline.curve]
    return curves


def static_bands(plan: Plan) -> list[tuple[str, int, int]]:
    """(label, bottom, top) bytes of each kind of static bytes the plan keeps on the device, stacked
    from zero; a kind partly or wholly elsewhere says where and how much in its label."""
    bands, bottom = [], 0
    for part in plan.static_parts:
        if part.total_bytes == 0:
            continue
        label = part.name
        if part.device_bytes < part.total_bytes:
            label += f": {format_bytes(part.device_bytes)} of {format_bytes(part.total_bytes)} ({part.where.split(';')[0]})"
        bands.append((label, bottom, bottom + part.device_bytes))
        bottom += part.device_bytes
    return bands


def plot_plan(profile: Profile, plan: Plan, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise OomlessError("--plot needs matplotlib; run: pip install oomless[plot]") from error
    curves = memory_curves(profile, plan)
    unit, unit_name = (GiB, "GiB") if plan.memory_bytes >= GiB else (MiB, "MiB")
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, color in (("plain", "tab:red"), ("plan", "tab:blue")):
        points = curves[label]
        seconds = [t * 1e3 for t, _ in points]
        memory = [b / unit for _, b in points]
        name = "plain PyTorch" if label == "plain" else "oomless plan"
        axes.step(seconds, memory, where="post", color=color, label=name)
    axes.axhline(plan.memory_bytes / unit, color="black", linestyle="--", label="budget")
    end = max(t for label in curves for t, _ in curves[label]) * 1e3
    bands = static_bands(plan)
    for (label, bottom, top), color in zip(bands, plt.get_cmap("Greys")([0.15, 0.3, 0.45, 0.6, 0.75])):
        axes.fill_between([0.0, end], bottom / unit, top / unit, color=color, alpha=0.6, linewidth=0,
                          label=f"static: {label}")
    if not bands:
        axes.axhline(plan.static_bytes / unit, color="gray", linestyle=":", label="static (params, grads, optimizer)")
    axes.set_xlabel("time in one step (ms)")
    axes.set_ylabel(f"device memory ({unit_name})")
    axes.set_title(f"{plan.device}: predicted peak {plan.predicted_peak_bytes / unit:.1f} {unit_name}, "
                   f"step {plan.predicted_step_seconds * 1e3:.0f} ms (plain {plan.plain_peak_bytes / unit:.1f} "
                   f"{unit_name}, {plan.plain_step_seconds * 1e3:.0f} ms)", fontsize=9)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=7)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)     # as `output_paths.check_output_path` promises
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
