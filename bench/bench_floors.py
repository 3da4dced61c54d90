"""The floor guarantee on the model zoo (issue 15, item 5), measured: for each model, one training
step's peak memory and time under plain PyTorch, ``torch.utils.checkpoint`` on every block, oomless at
checkpointing's measured peak, and oomless at the smallest budget it names.

    python bench/bench_floors.py                                  # every model whose packages load, CPU
    python bench/bench_floors.py --models monai-segresnet,bert --out bench/results
    python bench/bench_floors.py --quick                          # tiny sizes: does it run

Every run is a fresh process (bench/floor_child.py): the peak is the rise above a baseline taken after
a warm-up step at a small size (on CPU the resident set with glibc told to return freed memory, on
CUDA the allocator's peak), of the training steps; the peak mark as planning left it is reported
apart (planning profiles the model whole on the device: where a plan moves the parameters off, it
holds more than the steps; the profiler resets the mark as it measures, so that is at least its last
profiling step's peak). Step time is the median of the steps after the first.
Writes JSON with provenance (default runs/bench/floors-<device>-<date>.json) and prints a table.

What the issue asks, per model: oomless accepts checkpointing's memory and trains within it, no
slower than checkpointing there (step times within this machine's noise, read from the JSON: a
median ratio, not a test), and the smallest budget it names is below checkpointing's peak. On CUDA
the same against ``torch.autograd.graph.save_on_cpu`` (two more runs: it, and oomless at its peak).
Separate processes run minutes apart, and a shared 2-core machine's speed drifts by 15 % in that
time: ``--speed-steps`` (default 12) runs once more checkpointing and oomless at checkpointing's
memory in one process, one step of each in turn (floor_child's ``versus``), and reports the median
ratio of neighbouring steps (``step_vs_checkpoint``'s "steps interleaved"; on CUDA against
save_on_cpu too). Six steps each were too few where oomless swaps to disk: a U-Net's pairs ranged
0.86-1.28x and read 1.11x, where twelve read 0.89x (2026-11-28).
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIRECTORY = Path(__file__).resolve().parent
ROOT = BENCH_DIRECTORY.parent
MiB = 2**20

# name: (floor_child settings, the quick run's, the packages it needs). Sizes: a plain step of a few
# hundred MiB and about a second on a 2-core CPU.
MODELS = {
    "unet3d": ({"model": "unet3d", "side": 64, "batch": 2}, {"model": "unet3d", "side": 16, "batch": 1}, ()),
    "transformer": ({"model": "transformer", "batch": 2, "length": 512, "dim": 256, "depth": 4},
                    {"model": "transformer", "batch": 2, "length": 32, "dim": 32, "depth": 2}, ()),
    "gpt2": ({"model": "gpt2", "batch": 8, "length": 256, "dim": 256, "layers": 6, "heads": 4, "vocab": 2000},
             {"model": "gpt2", "batch": 2, "length": 32, "dim": 32, "layers": 2, "heads": 2, "vocab": 64},
             ("transformers",)),
    "bert": ({"model": "bert", "batch": 8, "length": 256, "dim": 256, "layers": 6, "heads": 4, "vocab": 2000},
             {"model": "bert", "batch": 2, "length": 32, "dim": 32, "layers": 2, "heads": 2, "vocab": 64},
             ("transformers",)),
    "vit": ({"model": "vit", "batch": 16, "side": 224, "dim": 256, "layers": 6, "heads": 4},
            {"model": "vit", "batch": 2, "side": 32, "dim": 32, "layers": 2, "heads": 2}, ("transformers",)),
    "monai-unet": ({"model": "monai-unet", "side": 64, "batch": 2}, {"model": "monai-unet", "side": 16, "batch": 2},
                   ("monai",)),
    "monai-segresnet": ({"model": "monai-segresnet", "side": 48, "batch": 1},
                        {"model": "monai-segresnet", "side": 16, "batch": 1}, ("monai",)),
    # Batch 2: its batch norm's innermost level is 1^3 at the warm-up's 32^3.
    "monai-swin-unetr": ({"model": "monai-swin-unetr", "side": 64, "batch": 2},
                         {"model": "monai-swin-unetr", "side": 32, "batch": 2}, ("monai", "einops")),
    "resnet50": ({"model": "resnet50", "side": 128, "batch": 8}, {"model": "resnet50", "side": 64, "batch": 2},
                 ("torchvision",)),
}
# On CUDA (sizes of bench/common.py's SIZES["cuda"]; the default models there): PyTorch's offload of
# every saved tensor to pinned host memory is a baseline as well, and oomless is held against it too.
CUDA_CONFIGS = {"unet3d": {"model": "unet3d", "side": 128, "batch": 2, "base_channels": 16},
                "transformer": {"model": "transformer", "batch": 4, "length": 1024, "dim": 1024, "depth": 8}}
MODES = ("plain", "checkpoint", "oomless at checkpoint's memory", "oomless at its floor")
CUDA_MODES = ("save_on_cpu", "oomless at save_on_cpu's memory")
TRIAL_TIMEOUT_SECONDS = 1800


def missing_packages(name: str) -> list[str]:
    return [package for package in MODELS[name][2] if importlib.util.find_spec(package) is None]


def trial(config: dict) -> dict:
    """One floor_child run: its JSON, with the median step after the first and the wall time."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                                                os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, str(BENCH_DIRECTORY / "floor_child.py"), json.dumps(config)],
                               capture_output=True, text=True, env=environment, timeout=TRIAL_TIMEOUT_SECONDS)
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        raise RuntimeError(f"{json.dumps(config)} failed (exit status {completed.returncode}):\n"
                           f"{completed.stderr[-3000:]}")
    result = json.loads(lines[-1])
    steps = result.get("step_seconds") or []
    result["median_step_seconds"] = statistics.median(steps[1:] if len(steps) > 1 else steps) if steps else None
    result["wall_seconds"] = time.perf_counter() - started
    return result


def measure(config: dict, steps: int, device: str, threads: int, speed_steps: int = 0) -> dict:
    """The four runs of one model, and how they compare; with ``speed_steps``, the speed half once
    more with checkpointing's steps and oomless's interleaved in one process (floor_child's ``versus``)."""
    common = {**config, "steps": steps, "device": device, "threads": threads}
    runs = {"plain": trial({**common, "mode": "plain"}), "checkpoint": trial({**common, "mode": "checkpoint"})}
    checkpoint_peak = runs["checkpoint"]["peak_bytes"]
    runs["oomless at checkpoint's memory"] = trial({**common, "mode": "oomless", "memory": checkpoint_peak,
                                                    "report_floor": True})
    runs["oomless at its floor"] = trial({**common, "mode": "oomless", "memory": "floor"})
    at_checkpoint, at_floor = runs["oomless at checkpoint's memory"], runs["oomless at its floor"]
    offloaded = {}
    if device.startswith("cuda"):
        runs["save_on_cpu"] = trial({**common, "mode": "save_on_cpu"})
        offload_peak = runs["save_on_cpu"]["peak_bytes"]
        runs["oomless at save_on_cpu's memory"] = at_offload = trial({**common, "mode": "oomless",
                                                                      "memory": offload_peak})
        offloaded = {"accepts_save_on_cpus_memory": "refused" not in at_offload,
                     "within_save_on_cpus_memory": bool(at_offload.get("steps_fit"))}

    interleaved = {}
    if speed_steps:
        versus = {**common, "mode": "versus", "steps": speed_steps}
        runs["interleaved with checkpoint"] = trial({**versus, "memory": checkpoint_peak})
        interleaved["at checkpoint's memory, steps interleaved"] = runs["interleaved with checkpoint"].get(
            "median_step_ratio")
        if offloaded:
            runs["interleaved with save_on_cpu"] = trial({**versus, "memory": offload_peak, "baseline": "save_on_cpu"})

    def ratio(run: dict, baseline: dict | None = None) -> float | None:
        reference = (baseline or runs["checkpoint"])["median_step_seconds"]
        return None if not (run.get("median_step_seconds") and reference) else run["median_step_seconds"] / reference

    floor = at_checkpoint.get("floor_bytes", at_floor.get("floor_bytes"))
    return {
        "config": config, "runs": runs,
        "checkpoint_peak_bytes": checkpoint_peak,
        "smallest_budget_bytes": floor,
        "guarantee": {
            "accepts_checkpoints_memory": "refused" not in at_checkpoint,
            "within_it": bool(at_checkpoint.get("steps_fit")),
            "smallest_budget_below_checkpoints_peak": floor is not None and floor < checkpoint_peak,
            # The training steps: planning profiles the model whole on the device, so where the plan
            # moves parameters off (a model whose weights and Adam state dominate, ResNet-50) planning
            # holds more than the steps (`planning_peak_bytes` in the run).
            "floor_steps_within_its_budget": bool(at_floor.get("steps_fit")),
            **offloaded,
        },
        # Separate processes' medians, and (where measured) the median ratio of interleaved steps:
        # the steadier reading on a machine whose speed drifts.
        "step_vs_checkpoint": {"plain": ratio(runs["plain"]), "at checkpoint's memory": ratio(at_checkpoint),
                               "at its floor": ratio(at_floor), **interleaved},
        **({"step_vs_save_on_cpu": ratio(runs["oomless at save_on_cpu's memory"], runs["save_on_cpu"])}
           if offloaded else {}),
        **({"step_vs_save_on_cpu_interleaved": runs["interleaved with save_on_cpu"].get("median_step_ratio")}
           if "interleaved with save_on_cpu" in runs else {}),
    }


def table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    modes = [*MODES, *(CUDA_MODES if any("save_on_cpu" in result.get("runs", {}) for result in results.values())
                       else ())]
    shown = Table(title="training steps' peak memory rise (MiB; planning's where higher) and median step (s)")
    interleaved = any("interleaved with checkpoint" in result.get("runs", {}) for result in results.values())
    for column in ("model", *modes, "oomless's smallest budget", *(("step vs checkpoint, interleaved",)
                                                                    if interleaved else ()), "guarantee"):
        shown.add_column(column, justify="left" if column in ("model", "guarantee") else "right")
    for name, result in results.items():
        if "skipped" in result or "failed" in result:
            why = result.get("skipped") or "FAILED: " + result["failed"].strip().splitlines()[-1][:80]
            shown.add_row(name, *["-"] * (len(modes) + 1), why)
            continue
        cells = []
        for mode in modes:
            run = result["runs"].get(mode)
            if run is None:
                cells.append("-")
                continue
            if "refused" in run:
                cells.append("refused")
                continue
            cells.append(f"{run['steps_peak_bytes'] / MiB:.1f} / {run['median_step_seconds']:.2f}"
                         + (f" (planning {run['planning_peak_bytes'] / MiB:.0f})"
                            if run["planning_peak_bytes"] > run["steps_peak_bytes"] else ""))
        kept = all(result["guarantee"].values())
        cells.append(f"{(result['smallest_budget_bytes'] or 0) / MiB:.1f}")
        if interleaved:
            speed = result["step_vs_checkpoint"].get("at checkpoint's memory, steps interleaved")
            cells.append("-" if speed is None else f"{speed:.2f}x")
        shown.add_row(name, *cells,
                      "kept" if kept else "BROKEN: " + ", ".join(k for k, v in result["guarantee"].items() if not v))
    Console(width=200).print(shown)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(BENCH_DIRECTORY))
    from common import provenance, result_path, write_result   # bench/common.py

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None,
                        help=f"comma-separated, of: {', '.join(MODELS)} (default: all whose packages load; on "
                             f"CUDA {', '.join(CUDA_CONFIGS)}, at larger sizes)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed-steps", type=int, default=12,
                        help="steps of checkpointing and of oomless at its memory interleaved in one process, "
                             "each (0: none)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps: checks that it runs")
    parser.add_argument("--out", default=None, help="a .json file or a folder (default runs/bench/)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    chosen = args.models or ",".join(CUDA_CONFIGS if cuda else MODELS)
    names = [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    out = result_path(args.out, f"floors-{args.device}{'-quick' if args.quick else ''}")
    steps = 2 if args.quick else args.steps
    results = {}
    for name in names:
        missing = missing_packages(name)
        if missing:
            results[name] = {"skipped": f"needs {', '.join(missing)}"}
            continue
        config = MODELS[name][1] if args.quick else CUDA_CONFIGS.get(name, MODELS[name][0]) if cuda else MODELS[name][0]
        print(f"{name}: {json.dumps(config)}", flush=True)
        try:
            results[name] = measure(config, steps, args.device, args.threads,
                                    min(args.speed_steps, 2) if args.quick else args.speed_steps)
        except (RuntimeError, subprocess.TimeoutExpired) as error:   # a run that crashed: recorded, the others go on
            results[name] = {"config": config, "failed": str(error)[-3000:]}
        # Written after each model: a run stopped part way keeps what it measured.
        write_result(out, {"provenance": provenance(args.device, threads=args.threads), "steps": steps,
                           "quick": args.quick, "models": results})
    table(results)
    return 1 if any("failed" in result for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
