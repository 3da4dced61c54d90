"""The showcase (seed 000, Fig. 6): the largest whole 3D volume, or 2D image, each method trains within
a fixed memory.

    python bench/bench_max_size.py                          # CPU: 1 GiB of resident memory
    python bench/bench_max_size.py --device cuda --memory 8GiB
    python bench/bench_max_size.py --quick --out /tmp/ms    # 48 MiB, sides 16 and 24 (dry runs)
    python bench/bench_max_size.py --model deeplabv3        # torchvision's DeepLabv3-ResNet-50, square images
    python bench/bench_max_size.py --sides plain:112,plain:120,oomless-split:248,oomless-split:256
                                                            # these trials only, no search

For the project's 3D U-Net (base 8 channels, depth 3, one volume per step, two classes; cubic volumes,
sides a multiple of 8), or with ``--model deeplabv3`` torchvision's DeepLabv3 (``--backbone resnet50``,
the default, or ``mobilenet_v3_large``; no weights, two classes, two RGB images per step: it trains at
a batch of 2 or more; square images, sides a multiple of 16; needs torchvision: pip install
oomless[vision]), and each method: plain PyTorch, ``torch.utils.checkpoint`` on every block (the
U-Net's stages; DeepLabv3's bottlenecks and head modules, oomless's default blocks), ``save_on_cpu``
(CUDA only: on CPU it moves nothing off the device), and oomless planned for the memory, the largest
side whose training step fits. Every trial is a fresh process (bench/floor_child.py):
on CPU its peak resident memory above a warm-up baseline, on CUDA ``max_memory_allocated`` under
``torch.cuda.set_per_process_memory_fraction`` (an out-of-memory error is "does not fit"). oomless
fits when it accepts the budget and its measured peak stays within it (a plan that goes over is
recorded as a broken promise, not as a fit). The search doubles the side until a trial fails, then
bisects. Reported per method: the largest side, its voxels (pixels: side^2 of one image) relative to
plain PyTorch's, and voxels (pixels) trained per second in the last step there, the whole batch's.
JSON with provenance (default runs/bench/max-size-<device>-<date>.json, for DeepLabv3
max-size-deeplabv3-<backbone>-<device>-<date>.json) and a bar chart next to it; ``--table`` prints the
README's Markdown table from a result file.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

BENCH_DIRECTORY = Path(__file__).resolve().parent
ROOT = BENCH_DIRECTORY.parent
if str(BENCH_DIRECTORY) not in sys.path:
    sys.path.insert(0, str(BENCH_DIRECTORY))

METHODS = ("plain", "checkpoint", "save_on_cpu", "oomless", "oomless-split", "oomless-split-loss")
# "oomless-split": oomless.plan(..., split=True), every U-Net stage computed in slabs (README, "Chains
# computed in slabs"); "oomless" lets the planner decide (it splits only where no plan without fits);
# "oomless-split-loss": split=True and the loss computed in slabs too (oomless.loss_in_slabs), the
# one change to the user's training step among the methods.
METHOD_COLORS = {"plain": "tab:red", "checkpoint": "tab:orange", "save_on_cpu": "tab:gray", "oomless": "tab:blue",
                 "oomless-split": "tab:cyan", "oomless-split-loss": "tab:green"}
TRIAL_TIMEOUT_SECONDS = 1800
OVER_LIMIT_EXIT_STATUS = 3   # bench/floor_child.py's exit status when its CPU trial passed the limit


@dataclasses.dataclass(frozen=True)
class SearchedModel:
    """A model the search trains: its trial's settings (bench/floor_child.py) and its input's shape."""

    trial: dict                    # model, batch (and backbone) of every trial
    dimensions: int                # the input is a cube (3) or a square (2) of side ``side``
    multiple: int                  # every side searched is a multiple of this
    start: int                     # the side the search starts from
    stop: int                      # ... and the largest it tries
    quick_sides: tuple[int, int]   # --quick: these two
    quick_memory: str
    label: str                     # for the plot's title

    @property
    def unit(self) -> str:
        return "voxels" if self.dimensions == 3 else "pixels"


MODELS = {
    "unet3d": SearchedModel({"model": "unet3d", "batch": 1}, dimensions=3, multiple=8,   # 2**depth of the U-Net
                            start=16, stop=1024, quick_sides=(16, 24), quick_memory="48MiB", label="3D U-Net"),
    # Sides a multiple of 16, the backbones' largest output stride (MobileNetV3's; ResNet-50's is 8).
    "deeplabv3": SearchedModel({"model": "deeplabv3", "batch": 2}, dimensions=2, multiple=16, start=64, stop=4096,
                               quick_sides=(32, 48), quick_memory="256MiB", label="DeepLabv3"),
}


def searched_model(name: str, backbone: str | None = None) -> SearchedModel:
    model = MODELS[name]
    if backbone is None:
        return model
    return dataclasses.replace(model, trial={**model.trial, "backbone": backbone},
                               label=f"{model.label}-{backbone}")


def run_trial(method: str, side: int, memory_bytes: int, device: str, threads: int, steps: int,
              precision: str = "fp32", model: SearchedModel = MODELS["unet3d"]) -> dict:
    """One training configuration in a fresh process; adds ``fits``."""
    config = {**model.trial, "side": side, "mode": method, "device": device, "threads": threads,
              "steps": steps, "memory_limit_bytes": memory_bytes, "precision": precision}
    if method.startswith("oomless"):
        config["memory"] = memory_bytes
        config["split"] = True if method.startswith("oomless-split") else None
        config["loss_in_slabs"] = method == "oomless-split-loss"
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
        # Out of memory: the allocator's error on CUDA, the child's own stop past the limit on CPU
        # (exit status 3), or the system's out-of-memory killer (SIGKILL). Anything else is a bug
        # in the trial, not a size that does not fit: the run fails once the search is done.
        out_of_memory = ("out of memory" in completed.stderr.lower()
                         or completed.returncode in (OVER_LIMIT_EXIT_STATUS, -signal.SIGKILL))
        trial = {"side": side, "fits": False, "error": "out of memory" if out_of_memory else tail[0][:300],
                 "wall_seconds": time.perf_counter() - started}
        if not out_of_memory:
            trial["crashed"] = True
        return trial
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
                 stop: int, log, precision: str = "fp32",
                 model: SearchedModel = MODELS["unet3d"]) -> tuple[int | None, list[dict]]:
    """The largest multiple of ``model.multiple`` in [start, stop] whose trial fits (None: not even ``start``)."""
    trials = []

    def fits(side: int) -> bool:
        trial = run_trial(method, side, memory_bytes, device, threads, steps, precision, model)
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
    while bad - good > model.multiple:
        middle = (good + bad) // 2 // model.multiple * model.multiple
        if middle <= good:
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, trials


def summarise(method: str, side: int | None, trials: list[dict], model: SearchedModel = MODELS["unet3d"]) -> dict:
    """The method's largest side, its voxels (pixels) and, from the last step there, those of the whole
    batch trained per second."""
    best = next((trial for trial in trials if trial["side"] == side and trial["fits"]), None)
    size = side**model.dimensions if side else 0
    record = {"largest_side": side, model.unit: size, "trials": trials,
              "broken_promises": [trial["side"] for trial in trials if trial.get("broken_promise")]}
    if best is not None:
        seconds = best["step_seconds"][-1]
        record.update({"peak_bytes": best["peak_bytes"], "step_seconds": seconds,
                       f"{model.unit}_per_second": model.trial["batch"] * size / seconds})
    return record


def _searched(result: dict) -> SearchedModel:
    """The model a result file was searched for (files from before DeepLabv3 name only the U-Net)."""
    return searched_model(result["model"]["name"], result["model"].get("backbone"))


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    model = _searched(result)
    methods = [name for name in METHODS if name in result["methods"]]
    sides = [result["methods"][name]["largest_side"] or 0 for name in methods]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    bars = axes.bar(methods, [side**model.dimensions / 1e6 for side in sides],
                    color=[METHOD_COLORS[name] for name in methods])
    for bar, side in zip(bars, sides):
        axes.annotate(f"{side}^{model.dimensions}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                      va="bottom", fontsize=8)
    axes.set_ylabel(f"largest trainable {'volume' if model.dimensions == 3 else 'image'} (million {model.unit})")
    axes.set_title(f"{model.label} within {result['memory_bytes'] / 2**30:.2f} GiB on "
                   f"{result['provenance']['device_name'][:40]}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def markdown_table(result: dict) -> str:
    model = _searched(result)
    unit, speed_key = model.unit, f"{model.unit}_per_second"
    plain = result["methods"].get("plain", {})
    rows = [f"| method | largest side | {unit} vs plain | {unit}/s at its largest | per-{unit[:-1]} speed vs plain |",
            "|---|---|---|---|---|"]
    for name in METHODS:
        record = result["methods"].get(name)
        if record is None:
            continue
        side = record["largest_side"]
        ratio = record[unit] / plain[unit] if plain.get(unit) else float("nan")
        speed = record.get(speed_key)
        relative = speed / plain[speed_key] if speed and plain.get(speed_key) else float("nan")
        rows.append(f"| {name} | {f'{side}^{model.dimensions}' if side else 'none'} | {ratio:.2f}x | "
                    f"{f'{speed:,.0f}' if speed else '-'} | {relative:.2f} |")
    return "\n".join(rows)


def _chosen_sides(parser, text: str, model: SearchedModel) -> dict[str, list[int]]:
    """{method: sides} of ``--sides METHOD:SIDE,...``, in the order given."""
    chosen: dict[str, list[int]] = {}
    for item in text.split(","):
        method, _, side = item.partition(":")
        if method not in METHODS or not side.isdigit() or int(side) % model.multiple:
            parser.error(f"--sides takes METHOD:SIDE items, METHOD one of {', '.join(METHODS)} and SIDE a multiple "
                         f"of {model.multiple}; got {item!r}")
        chosen.setdefault(method, []).append(int(side))
    return chosen


def main(argv: list[str] | None = None) -> int:
    from common import provenance, write_result   # bench/common.py
    from oomless.sizes import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=tuple(MODELS), default="unet3d",
                        help="unet3d: cubic volumes; deeplabv3: torchvision's DeepLabv3, square images (needs torchvision)")
    parser.add_argument("--backbone", choices=("resnet50", "mobilenet_v3_large"), default=None,
                        help="DeepLabv3's backbone (default resnet50)")
    parser.add_argument("--memory", default=None,
                        help="the fixed memory (default 1GiB on CPU, 8GiB on CUDA; with --quick 48MiB, DeepLabv3 256MiB)")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--start", type=int, default=None,
                        help="the side the search starts from (a multiple of 8, DeepLabv3 16; default 16, DeepLabv3 64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="every method trains under this autocast (oomless: precision=; plain and checkpoint: "
                             "torch.autocast around the step); bf16 on CPU is slow (no bf16 conv kernels worth it)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per trial (the last one is timed)")
    parser.add_argument("--sides", default=None, metavar="METHOD:SIDE,...",
                        help="run these trials instead of searching (e.g. plain:112,plain:120); a method's largest "
                             "side is the largest that fits, 'bracketed' where the next multiple ran and did not")
    parser.add_argument("--quick", action="store_true",
                        help="48 MiB, sides 16 and 24 (DeepLabv3: 256 MiB, 32 and 48), plain and oomless only, "
                             "one step per trial (dry runs)")
    parser.add_argument("--out", default=None, help="folder or .json path (default runs/bench/)")
    parser.add_argument("--table", default=None, metavar="RESULT.json", help="print the Markdown table of a result and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return 0
    if args.backbone and args.model != "deeplabv3":
        parser.error("--backbone is DeepLabv3's (--model deeplabv3)")
    if args.model == "deeplabv3" and importlib.util.find_spec("torchvision") is None:
        parser.error("--model deeplabv3 needs torchvision, which is not installed: pip install oomless[vision]")
    model = searched_model(args.model, args.backbone or ("resnet50" if args.model == "deeplabv3" else None))
    memory = args.memory or (model.quick_memory if args.quick else "8GiB" if args.device == "cuda" else "1GiB")
    memory_bytes = parse_bytes(memory)
    steps = 1 if args.quick else args.steps
    chosen = _chosen_sides(parser, args.sides, model) if args.sides else None
    methods = list(chosen) if chosen else args.methods.split(",") if args.methods else \
        ["plain", "oomless"] if args.quick else [m for m in METHODS if m != "save_on_cpu" or args.device == "cuda"]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    start, stop = model.quick_sides if args.quick else (args.start or model.start, model.stop)
    if start % model.multiple:
        parser.error(f"--start {start} is not a multiple of {model.multiple}")
    described = {"name": "unet3d", "base_channels": 8, "depth": 3} if args.model == "unet3d" else \
        {"name": "deeplabv3", "backbone": model.trial["backbone"]}
    result = {"model": {**described, "batch": model.trial["batch"], "classes": 2},
              "memory": memory, "memory_bytes": memory_bytes, "steps_per_trial": steps, "precision": args.precision,
              "methods": {}}
    result["provenance"] = provenance(args.device)
    out = Path(args.out) if args.out else ROOT / "runs" / "bench"
    if out.suffix != ".json":
        precision = "" if args.precision == "fp32" else f"-{args.precision}"
        name = "" if args.model == "unet3d" else f"-{args.model}-{model.trial['backbone']}"
        out = out / f"max-size{name}-{args.device}{precision}-{date.today().isoformat()}.json"
    started = time.perf_counter()
    for method in methods:
        if chosen:
            print(f"{method}: sides {chosen[method]} within {memory}", flush=True)
            trials = [run_trial(method, side, memory_bytes, args.device, args.threads, steps, args.precision, model)
                      for side in chosen[method]]
            fitting = [trial["side"] for trial in trials if trial["fits"]]
            side = max(fitting) if fitting else None
            result["methods"][method] = summarise(method, side, trials, model)
            result["methods"][method]["bracketed"] = side is not None and any(
                trial["side"] == side + model.multiple and not trial["fits"] for trial in trials)
        else:
            print(f"{method}: searching the largest side within {memory}", flush=True)
            side, trials = largest_side(method, memory_bytes, args.device, args.threads, steps, start, stop,
                                        lambda line: print(line, flush=True), args.precision, model)
            result["methods"][method] = summarise(method, side, trials, model)
        result["seconds"] = time.perf_counter() - started
        write_result(out, result)   # after each method: a run stopped at a time limit keeps what it found
    picture = plot(result, out.with_suffix(".png"))
    if picture is not None:
        print(f"wrote {picture}")
    print(markdown_table(result))
    crashed = [f"{method} side {trial['side']}: {trial['error']}" for method, outcome in result["methods"].items()
               for trial in outcome["trials"] if trial.get("crashed")]
    if crashed:
        print("trials that failed for another reason than memory (a bug, not a size that does not fit):\n  "
              + "\n  ".join(crashed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
