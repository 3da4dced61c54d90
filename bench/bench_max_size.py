"""The showcase (seed 000, Fig. 6): the largest whole 3D volume each method trains within a fixed memory.

    python bench/bench_max_size.py                          # CPU: 1 GiB of resident memory
    python bench/bench_max_size.py --device cuda --memory 8GiB
    python bench/bench_max_size.py --quick --out /tmp/ms    # 48 MiB, sides 16 and 24 (dry runs)

For the project's 3D U-Net (base 8 channels, depth 3, one volume per step, two classes), and each
method: plain PyTorch, ``torch.utils.checkpoint`` on every U-Net stage, ``save_on_cpu`` (CUDA only: on
CPU it moves nothing off the device), and oomless planned for the memory, the largest cubic side
(a multiple of 8) whose training step fits. Every trial is a fresh process (bench/floor_child.py):
on CPU its peak resident memory above a warm-up baseline, on CUDA ``max_memory_allocated`` under
``torch.cuda.set_per_process_memory_fraction`` (an out-of-memory error is "does not fit"). oomless
fits when it accepts the budget and its measured peak stays within it (a plan that goes over is
recorded as a broken promise, not as a fit). The search doubles the side until a trial fails, then
bisects. Reported per method: the largest side, its voxels relative to plain PyTorch's, and voxels
per second of the last step there. JSON with provenance (default runs/bench/max-size-<device>-<date>.json)
and a bar chart next to it; ``--table`` prints the README's Markdown table from a result file.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

BENCH_DIRECTORY = Path(__file__).resolve().parent
ROOT = BENCH_DIRECTORY.parent
if str(BENCH_DIRECTORY) not in sys.path:
    sys.path.insert(0, str(BENCH_DIRECTORY))

METHODS = ("plain", "checkpoint", "save_on_cpu", "oomless", "oomless-split")
# "oomless-split": oomless.plan(..., split=True), every U-Net stage computed in slabs (README, "Chains
# computed in slabs"); "oomless" lets the planner decide (it splits only where no plan without fits).
MULTIPLE = 8          # 2**depth of the U-Net
TRIAL_TIMEOUT_SECONDS = 1800


def run_trial(method: str, side: int, memory_bytes: int, device: str, threads: int, steps: int,
              precision: str = "fp32") -> dict:
    """One training configuration in a fresh process; adds ``fits``."""
    config = {"model": "unet3d", "side": side, "batch": 1, "mode": method, "device": device, "threads": threads,
              "steps": steps, "memory_limit_bytes": memory_bytes, "precision": precision}
    if method.startswith("oomless"):
        config["memory"] = memory_bytes
        config["split"] = True if method == "oomless-split" else None
    config["mode"] = "oomless" if method.startswith("oomless") else method
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    try:
        completed = subprocess.run([sys.executable, str(BENCH_DIRECTORY / "floor_child.py"), json.dumps(config)],
                                   capture_output=True, text=True, env=environment, timeout=TRIAL_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        return {"side": side, "fits": False, "error": f"timed out after {TRIAL_TIMEOUT_SECONDS} s"}
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        tail = completed.stderr.strip().splitlines()[-1:] or ["no output"]
        out_of_memory = "out of memory" in completed.stderr.lower()
        return {"side": side, "fits": False, "error": "out of memory" if out_of_memory else tail[0][:300],
                "wall_seconds": time.perf_counter() - started}
    result = json.loads(lines[-1])
    result.pop("config", None)
    result["side"] = side
    result["wall_seconds"] = time.perf_counter() - started
    if method.startswith("oomless") and "refused" in result:
        result["fits"] = False
    else:
        result["fits"] = result["peak_bytes"] <= memory_bytes
        if method.startswith("oomless") and not result["fits"]:
            result["broken_promise"] = True   # planned for the memory, measured over it
    return result


def largest_side(method: str, memory_bytes: int, device: str, threads: int, steps: int, start: int,
                 stop: int, log, precision: str = "fp32") -> tuple[int | None, list[dict]]:
    """The largest multiple of MULTIPLE in [start, stop] whose trial fits (None: not even ``start``)."""
    trials = []

    def fits(side: int) -> bool:
        trial = run_trial(method, side, memory_bytes, device, threads, steps, precision)
        trials.append(trial)
        peak = trial.get("peak_bytes")
        log(f"  {method:12s} side {side:4d}: {'fits' if trial['fits'] else 'does not fit'}"
            + (f", peak {peak / 2**20:.0f} MiB" if peak is not None else f" ({trial.get('error') or trial.get('refused', '')[:80]})"))
        return trial["fits"]

    if not fits(start):
        return None, trials
    good, bad = start, None
    while bad is None:
        candidate = min(good * 2, stop)
        if candidate == good:
            return good, trials
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad - good > MULTIPLE:
        middle = (good + bad) // 2 // MULTIPLE * MULTIPLE
        if middle <= good:
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, trials


def summarise(method: str, side: int | None, trials: list[dict]) -> dict:
    best = next((trial for trial in trials if trial["side"] == side and trial["fits"]), None)
    record = {"largest_side": side, "voxels": side**3 if side else 0, "trials": trials,
              "broken_promises": [trial["side"] for trial in trials if trial.get("broken_promise")]}
    if best is not None:
        seconds = best["step_seconds"][-1]
        record.update(peak_bytes=best["peak_bytes"], step_seconds=seconds, voxels_per_second=side**3 / seconds)
    return record


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    methods = [name for name in METHODS if name in result["methods"]]
    sides = [result["methods"][name]["largest_side"] or 0 for name in methods]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    bars = axes.bar(methods, [side**3 / 1e6 for side in sides], color=["tab:red", "tab:orange", "tab:gray", "tab:blue", "tab:cyan"][:len(methods)])
    for bar, side in zip(bars, sides):
        axes.annotate(f"{side}^3", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    axes.set_ylabel("largest trainable volume (million voxels)")
    axes.set_title(f"3D U-Net within {result['memory_bytes'] / 2**30:.2f} GiB on {result['provenance']['device_name'][:40]}",
                   fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def markdown_table(result: dict) -> str:
    plain = result["methods"].get("plain", {})
    rows = ["| method | largest side | voxels vs plain | voxels/s at its largest | per-voxel speed vs plain |",
            "|---|---|---|---|---|"]
    for name in METHODS:
        record = result["methods"].get(name)
        if record is None:
            continue
        side = record["largest_side"]
        ratio = record["voxels"] / plain["voxels"] if plain.get("voxels") else float("nan")
        speed = record.get("voxels_per_second")
        relative = speed / plain["voxels_per_second"] if speed and plain.get("voxels_per_second") else float("nan")
        rows.append(f"| {name} | {f'{side}^3' if side else 'none'} | {ratio:.2f}x | "
                    f"{f'{speed:,.0f}' if speed else '-'} | {relative:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from common import provenance, write_result   # bench/common.py
    from oomless.sizes import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--memory", default=None, help="the fixed memory (default 1GiB on CPU, 8GiB on CUDA; 256MiB with --quick)")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--start", type=int, default=16, help="the side the search starts from (a multiple of 8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="every method trains under this autocast (oomless: precision=; plain and checkpoint: "
                             "torch.autocast around the step); bf16 on CPU is slow (no bf16 conv kernels worth it)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per trial (the last one is timed)")
    parser.add_argument("--quick", action="store_true",
                        help="48 MiB, sides 16 and 24, plain and oomless only, one step per trial (dry runs)")
    parser.add_argument("--out", default=None, help="folder or .json path (default runs/bench/)")
    parser.add_argument("--table", default=None, metavar="RESULT.json", help="print the Markdown table of a result and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return 0
    memory = args.memory or ("48MiB" if args.quick else "8GiB" if args.device == "cuda" else "1GiB")
    memory_bytes = parse_bytes(memory)
    steps = 1 if args.quick else args.steps
    methods = args.methods.split(",") if args.methods else ["plain", "oomless"] if args.quick else \
        [m for m in METHODS if m != "save_on_cpu" or args.device == "cuda"]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    stop = 24 if args.quick else 1024
    result = {"model": {"name": "unet3d", "base_channels": 8, "depth": 3, "batch": 1, "classes": 2},
              "memory": memory, "memory_bytes": memory_bytes, "steps_per_trial": steps, "precision": args.precision,
              "methods": {}}
    started = time.perf_counter()
    for method in methods:
        print(f"{method}: searching the largest side within {memory}", flush=True)
        side, trials = largest_side(method, memory_bytes, args.device, args.threads, steps, args.start, stop,
                                    lambda line: print(line, flush=True), args.precision)
        result["methods"][method] = summarise(method, side, trials)
    result["seconds"] = time.perf_counter() - started
    result["provenance"] = provenance(args.device)
    out = Path(args.out) if args.out else ROOT / "runs" / "bench"
    if out.suffix != ".json":
        precision = "" if args.precision == "fp32" else f"-{args.precision}"
        out = out / f"max-size-{args.device}{precision}-{date.today().isoformat()}.json"
    write_result(out, result)
    picture = plot(result, out.with_suffix(".png"))
    if picture is not None:
        print(f"wrote {picture}")
    print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
