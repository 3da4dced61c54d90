"""Predicted against measured: step time and peak activation bytes of planned runs, and solver speed.

    python bench/bench_predict.py                        # CPU here (CUDA where available)
    python bench/bench_predict.py --quick --out /tmp/p.json

For each of the fit engine's benchmark models (bench/common.py's sizes), in one process: profile
one real step, plan it at three budgets (leaving 100 %, 50 % and 25 % of the plain step's saved
activations; clamped up to the smallest feasible memory, the clamp recorded), apply each plan, run
warm-up + measured steps (forward, loss, backward), and record the median measured step seconds and
the ledger's peak activation bytes (`oomless.stats`) next to the plan's predictions. Error is
(predicted - measured) / measured. Then the solver alone: make_plan on generated profiles of 1000
blocks (greedy) and 300 blocks (exact), timed (a tenth of that with --quick). Output: JSON with provenance, default
bench/results/predict-<device>-<date>.json.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch

from oomless.errors import InputError, PlanError
from oomless.plan.planner import make_plan, smallest_memory
from oomless.profile.profile import BlockProfile, LinkProfile, Profile

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:    # imported from its path rather than run as a script
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import SIZES, build_model, provenance, result_path, write_result  # noqa: E402  (bench/common.py)

SHARES = (1.0, 0.5, 0.25)


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, inputs, loss_fn, plan, device, steps: int) -> dict:
    oomless.apply(model, plan)
    try:
        seconds, peaks = [], []
        for step in range(steps + 1):
            model.zero_grad(set_to_none=True)
            _synchronize(device)
            started = time.perf_counter()
            loss_fn(model(inputs)).backward()
            _synchronize(device)
            stats = oomless.stats(model)
            if step:  # the first step warms up caches and the swap tier
                seconds.append(time.perf_counter() - started)
                peaks.append(stats.peak_activation_bytes)
    finally:
        oomless.remove(model)
    return {"step_seconds": statistics.median(seconds), "peak_activation_bytes": max(peaks)}


def predict_against_measure(name: str, sizes: dict, device: torch.device, steps: int) -> list[dict]:
    model, inputs, loss_fn = build_model(name, sizes, device)
    profile = oomless.profile(model, inputs, loss_fn=loss_fn)
    roomy = make_plan(profile, 10**15)
    rows = []
    for share in SHARES:
        memory = roomy.static_bytes + roomy.reserve_bytes + int(share * roomy.predicted_activation_peak_bytes)
        clamped = memory < smallest_memory(profile)
        memory = max(memory, smallest_memory(profile) + 2**20)
        try:
            plan = make_plan(profile, memory)
        except PlanError as error:
            rows.append({"model": name, "share": share, "error": str(error)})
            continue
        measured = measure(model, inputs, loss_fn, plan, device, steps)
        predicted = {"step_seconds": plan.predicted_step_seconds,
                     "peak_activation_bytes": plan.predicted_activation_peak_bytes}
        rows.append({
            "model": name, "share": share, "memory_bytes": memory, "clamped_to_minimum": clamped,
            "decisions": {d: list(plan.decisions.values()).count(d) for d in ("keep", "swap", "recompute")},
            "predicted": predicted, "measured": measured,
            "error": {key: (predicted[key] - measured[key]) / measured[key] if measured[key] else None
                      for key in predicted},
        })
        print(f"{name} {share:>4}: step predicted {predicted['step_seconds']:.3f} s measured "
              f"{measured['step_seconds']:.3f} s; peak activations predicted "
              f"{predicted['peak_activation_bytes'] / 2**20:.1f} MiB measured "
              f"{measured['peak_activation_bytes'] / 2**20:.1f} MiB", flush=True)
    return rows


def generated_profile(blocks: int, seed: int) -> Profile:
    rng, MiB = random.Random(seed), 2**20
    made = [BlockProfile(name=f"b{i}", forward_seconds=(f := rng.uniform(1, 50) / 1e3), backward_seconds=2 * f,
                         saved_bytes=(s := rng.randint(1, 100) * MiB), largest_saved_bytes=s // 4,
                         input_bytes=rng.randint(1, 10) * MiB, output_bytes=MiB, calls=1,
                         forward_transient_bytes=MiB, backward_transient_bytes=MiB) for i in range(blocks)]
    return Profile(device="cuda:0", blocks=made, parameter_bytes=10 * MiB, gradient_bytes=10 * MiB, buffer_bytes=0,
                   optimizer_state_bytes=20 * MiB, input_bytes=MiB, unassigned_saved_bytes=0, loss_seconds=0.001,
                   link=LinkProfile("pcie", 2e9, 2e9))


def solver_speed(quick: bool = False) -> list[dict]:
    rows = []
    # --quick (the GPU suite's dry run) checks that the timing runs: a tenth of the blocks (the full
    # sizes took 3 of the quick run's 7 s on a 2-core CPU).
    sizes = (((100, "greedy"), (30, "exact"), (30, "greedy")) if quick else
             ((1000, "greedy"), (300, "exact"), (300, "greedy")))
    for blocks, solver in sizes:
        for share in (0.5, 0.3):
            profile = generated_profile(blocks, 0)
            roomy = make_plan(profile, 10**15)
            memory = max(roomy.static_bytes + roomy.reserve_bytes + int(share * roomy.predicted_activation_peak_bytes),
                         smallest_memory(profile) + 2**20)
            started = time.perf_counter()
            plan = make_plan(profile, memory, solver=solver)
            rows.append({"blocks": blocks, "solver": solver, "share": share,
                         "plan_seconds": time.perf_counter() - started,
                         "slowdown": plan.predicted_step_seconds / plan.plain_step_seconds})
            print(f"solver {solver} {blocks} blocks at {share}: {rows[-1]['plan_seconds']:.3f} s", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=("transformer", "unet3d", "all"), default="all")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per plan (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="tiny models")
    parser.add_argument("--out", default=None, help="folder or .json file (default runs/bench/predict-<device>-<date>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    try:
        out = result_path(args.out, f"predict-{device.type}")
    except InputError as error:
        parser.error(str(error))
    sizes = SIZES["quick" if args.quick else device.type]
    names = ("transformer", "unet3d") if args.model == "all" else (args.model,)
    result = {"provenance": provenance(device), "sizes": {name: sizes[name] for name in names},
              "rows": [row for name in names for row in predict_against_measure(name, sizes[name], device, args.steps)],
              "solver_speed": solver_speed(args.quick)}
    errors = [abs(row["error"][key]) for row in result["rows"] if isinstance(row.get("error"), dict)
              for key in ("step_seconds", "peak_activation_bytes")]
    result["max_abs_error"] = max(errors) if errors else None
    write_result(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
