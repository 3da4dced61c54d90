"""The picture for a report: device memory over one training step, plain PyTorch against the plan,
with the budget line. Curves come from the timeline simulator, the same one the planner trusts.

    from oomless.plan.plot import plot_plan
    plot_plan(profile, plan, "plan.png")          # needs matplotlib: pip install oomless[plot]
"""

from oomless.errors import OomlessError
from oomless.plan.plan import Plan
from oomless.plan.simulate import simulate, with_swap_threshold
from oomless.profile.profile import Profile

GiB = 2**30


def memory_curves(profile: Profile, plan: Plan) -> dict[str, list[tuple[float, int]]]:
    """{"plain": [(seconds, bytes)], "plan": [...]}: static bytes and what the step holds beyond them
    (saved activations and the running phase's working memory); the planner's margin is not drawn."""
    base = plan.static_bytes
    curves = {}
    budget = plan.memory_bytes - plan.static_bytes
    profile = with_swap_threshold(profile, plan.min_swap_bytes)
    for label, decisions, prefetch in (("plain", ["keep"] * len(profile.blocks), None),
                                       ("plan", [block.decision for block in plan.blocks], plan.prefetch_bytes)):
        timeline = simulate(profile, decisions, prefetch, keep_curve=True, budget_bytes=budget)
        start = [(0.0, base)]
        curves[label] = start + [(seconds, base + held) for seconds, held in timeline.curve]
    return curves


def plot_plan(profile: Profile, plan: Plan, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise OomlessError("--plot needs matplotlib; run: pip install oomless[plot]") from error
    curves = memory_curves(profile, plan)
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for label, color in (("plain", "tab:red"), ("plan", "tab:blue")):
        points = curves[label]
        seconds = [t * 1e3 for t, _ in points]
        memory = [b / GiB for _, b in points]
        name = "plain PyTorch" if label == "plain" else "oomless plan"
        axes.step(seconds, memory, where="post", color=color, label=name)
    axes.axhline(plan.memory_bytes / GiB, color="black", linestyle="--", label="budget")
    axes.axhline(plan.static_bytes / GiB, color="gray", linestyle=":", label="static (params, grads, optimizer)")
    axes.set_xlabel("time in one step (ms)")
    axes.set_ylabel("device memory (GiB)")
    axes.set_title(f"{plan.device}: predicted peak {plan.predicted_peak_bytes / GiB:.1f} GiB, "
                   f"step {plan.predicted_step_seconds * 1e3:.0f} ms (plain {plan.plain_peak_bytes / GiB:.1f} GiB, "
                   f"{plan.plain_step_seconds * 1e3:.0f} ms)", fontsize=9)
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
