"""`oomless simulate` against measurement on one GPU, NCCL at world size 1 (issue 14, item 4: "on the
GPU machine when lent, the same at world size 1 with NCCL").

    python bench/bench_simulate_cuda.py --out bench/results/gpu/simulate-cuda.json   # ~1 minute on an H100
    python bench/bench_simulate_cuda.py --device cpu --quick --out /tmp/s.json       # the code path on gloo

The trainer's 3D U-Net (`bench_simulate.py`'s model, at a GPU's size) trains through the trainer's own
strategies (`oomless.parallel.make_strategy`: dp, then fsdp) in this one process, in a world of one
on NCCL; each layout's step (median of ``--steps`` after ``--warmup``, the device synchronised) and
its peak (the allocator's, from the memory allocated before the model was built: parameters,
gradients, optimizer state and the step's activations) against two predictions made before:

- **datasheet**: `oomless.simulate` as a user runs it before buying the GPU: the model on meta
  tensors, the roofline of the device table's entry for this GPU (`oomless.plan.devices`), traced
  at the layout's batch; nothing measured;
- **calibrated**: `oomless.simulate(profile=...)` with this GPU's real profile of the step (the
  per-block median of ``--profiles`` `oomless.profile` runs) and its memory, as `bench_simulate.py`
  calibrates the CPU.

Ratio = predicted / measured; targets as `bench_simulate.py` (step within 15 %, peak within 10 %).
On CPU (``--device cpu``, gloo) the peak is the resident memory's rise and the datasheet is an
H100's: a check that the code runs, not a comparison. Output: JSON with provenance.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them.
import oomless  # noqa: I001

import torch

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:
    sys.path.insert(0, str(BENCH_DIRECTORY))
from bench_simulate import TARGETS, _build, _free_port, _train_config, median_profile, prepared  # noqa: E402
from common import provenance, result_path, write_result  # noqa: E402

SIZES = {"cuda": {"size": 96, "base_channels": 16, "depth": 3, "global_batch": 4},
         "cpu": {"size": 16, "base_channels": 4, "depth": 2, "global_batch": 2}}
LAYOUTS = ("dp", "fsdp")


def table_device(name: str, total_bytes: int) -> str | None:
    """The device table's entry for a CUDA device name (torch.cuda.get_device_name), or None."""
    lowered = name.lower()
    if "h200" in lowered:
        return "h200"
    if "h100" in lowered:
        return "h100-pcie" if "pcie" in lowered else "h100-sxm"
    if "a100" in lowered:
        return "a100-80gb" if total_bytes > 50 * 2**30 else "a100-40gb"
    if "l4" in lowered.split():
        return "l4"
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    from oomless.profile.rss import current_rss_bytes

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else current_rss_bytes()


def _reset_peak(device: torch.device) -> None:
    from oomless.profile.rss import reset_peak_rss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def _peak(device: torch.device) -> int:
    from oomless.profile.rss import peak_rss_bytes

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def _on(device: torch.device, settings: dict, batch: int):
    model, optimizer, volumes, labels = _build(settings, batch, 0)
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=optimizer.defaults["lr"])
    return model, optimizer, volumes.to(device), labels.to(device)


def measure(layout: str, device: torch.device, settings: dict) -> dict:
    """``settings["steps"]`` steps of ``layout`` through the trainer's strategy in this process."""
    import gc

    from oomless.data.synthetic import SyntheticVolumes
    from oomless.parallel import ParallelConfig, Ranks, make_strategy

    parallel = ParallelConfig(mode=layout, timeout_seconds=300)
    config = _train_config(settings, parallel)
    strategy = make_strategy(parallel, Ranks(0, 1), device)
    batches = [SyntheticVolumes(config.shape, seed=config.seed).batch(*strategy.shard(step, config.global_batch))
               for step in range(settings["warmup"] + settings["steps"])]
    batches = [(volumes.to(device), labels.to(device)) for volumes, labels in batches]
    gc.collect()
    _synchronize(device)
    baseline = _allocated(device)
    model, optimizer, train_model = prepared(strategy, config, device, batches[0])
    seconds = []
    for step, (volumes, labels) in enumerate(batches):
        if step == settings["warmup"]:
            _synchronize(device)
            _reset_peak(device)
        _synchronize(device)
        started = time.perf_counter()
        strategy.train_step(train_model, volumes, labels)
        strategy.step(model, optimizer, step)
        _synchronize(device)
        if step >= settings["warmup"]:
            seconds.append(time.perf_counter() - started)
    peak = _peak(device) - baseline
    strategy.finish(model)
    del model, optimizer, train_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_seconds": statistics.median(seconds), "step_seconds_each": seconds, "peak_bytes": peak}


def _meta_step(settings: dict, batch: int):
    """The model on meta, ``batch`` of its volumes and the loss of their labels, as simulate traces them."""
    from oomless.train.losses import segmentation_loss
    from oomless.train.loop import build_segmentation_model

    config = _train_config(settings)
    with torch.device("meta"):
        model = build_segmentation_model(config)
    volumes = torch.empty(batch, 1, *config.shape, device="meta")
    labels = torch.empty(batch, *config.shape, dtype=torch.long, device="meta")
    return model, volumes, lambda logits: segmentation_loss(logits, labels)


def predict_datasheet(target: str, settings: dict):
    """`oomless.simulate` from the device table alone (the roofline on meta tensors)."""
    batch = settings["global_batch"]
    model, volumes, loss_fn = _meta_step(settings, batch)
    optimizer = torch.optim.Adam(model.parameters())
    return oomless.simulate(model, volumes, batch, target=target, gpus=1, loss_fn=loss_fn, optimizer=optimizer,
                            example_at=lambda samples: _meta_step(settings, samples)[1:])


def fsdp_host_seconds(device: torch.device, repeats: int) -> float:
    """Seconds FSDP2's own work adds per collective at one rank (its copies in and out and hooks):
    a step of 16 tiny Linear units each under ``fully_shard`` against the same step unsharded, the
    device synchronised, divided by the 48 collectives (`bench_simulate._fsdp_collective_seconds`
    on this device)."""
    import copy

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    local = nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)]).to(device)
    sharded = copy.deepcopy(local)
    for unit in sharded:
        fully_shard(unit)
    fully_shard(sharded)
    inputs = torch.randn(4, 64, device=device)
    times = {"local": [], "sharded": []}
    for repeat in range(repeats + 2):
        for name, model in (("local", local), ("sharded", sharded)):
            _synchronize(device)
            started = time.perf_counter()
            model(inputs).sum().backward()
            _synchronize(device)
            if repeat >= 2:
                times[name].append(time.perf_counter() - started)
    return max(statistics.median(times["sharded"]) - statistics.median(times["local"]), 0.0) / 48


def predict_calibrated(device: torch.device, target: str, settings: dict):
    """`oomless.simulate` of this device's measured profile, with its memory and FSDP2's work per
    collective measured here."""
    from dataclasses import replace

    from oomless.plan.devices import find_device, register_device
    from oomless.train.losses import segmentation_loss

    batch = settings["global_batch"]
    model, optimizer, volumes, labels = _on(device, settings, batch)
    loss_fn = lambda logits: segmentation_loss(logits, labels)      # noqa: E731
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 8 * 2**30
    oomless.profile(model, volumes, loss_fn=loss_fn, optimizer=optimizer, memory=memory)  # start-up, discarded
    profile = median_profile([oomless.profile(model, volumes, loss_fn=loss_fn, optimizer=optimizer,
                                              memory=memory).to_json() for _ in range(settings["profiles"])])
    del model, optimizer, volumes, labels
    here = register_device(replace(find_device(target), name=f"{target}-measured-here", aliases=(),
                                   memory_bytes=memory))
    meta_model, meta_volumes, meta_loss = _meta_step(settings, batch)
    host = fsdp_host_seconds(device, 10)
    simulation = oomless.simulate(meta_model, meta_volumes, batch, target=here.name, gpus=1, loss_fn=meta_loss,
                                  optimizer=torch.optim.Adam(meta_model.parameters()), profile=profile,
                                  cluster={"fsdp_host_seconds": host})
    simulation.notes.append(f"calibrated: this device's profile, its memory, FSDP2 {host * 1e6:.0f} us a collective")
    return simulation


def row(layout: str, measured: dict, predictions: dict) -> dict:
    entry = {"layout": f"{layout} x1", "measured": measured, "predicted": {}, "ratio": {}}
    for kind, simulation in predictions.items():
        estimate = simulation.layout(f"{layout} x1")
        entry["predicted"][kind] = {"step_seconds": estimate.step_seconds, "peak_bytes": estimate.memory_per_rank_bytes,
                                    "fits": estimate.fits, "memory_plan": estimate.memory_plan}
        entry["ratio"][kind] = {"step_seconds": estimate.step_seconds / measured["step_seconds"],
                                "peak_bytes": estimate.memory_per_rank_bytes / max(measured["peak_bytes"], 1)}
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer steps and profiles")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per layout (default 10; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 3; quick 1)")
    parser.add_argument("--profiles", type=int, default=None, help="profiles for the calibration (default 3; quick 1)")
    parser.add_argument("--out", default=None, help="folder or .json file (default runs/bench/simulate-<device>-<date>.json)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; --device cpu runs the same code path on gloo")
    out = result_path(args.out, f"simulate-{args.device}-world-1")
    from oomless.parallel import ParallelConfig, join_process_group, leave_process_group

    device = torch.device(args.device)
    quick = args.quick
    settings = {**SIZES[args.device], "warmup": args.warmup or (1 if quick else 3),
                "steps": args.steps or (2 if quick else 10), "profiles": args.profiles or (1 if quick else 3)}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    target = table_device(name, total) if device.type == "cuda" else "h100"
    started = time.perf_counter()
    record = {"provenance": provenance(device, backend="nccl" if device.type == "cuda" else "gloo"),
              "settings": {**settings, "model": "UNet3D", "world_size": 1, "target": target}, "targets": TARGETS}
    # A world of one on a port of its own: variables inherited from a parent that ran one itself (a
    # test process) would name a port that parent still listens on.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    ranks = join_process_group(ParallelConfig(mode="dp", timeout_seconds=300), device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        predictions = {}
        if target is None:
            record["notes"] = [f"{name!r} is not in the device table: no datasheet prediction"]
        else:
            predictions["datasheet"] = predict_datasheet(target, settings)
            predictions["calibrated"] = predict_calibrated(device, target, settings)
        rows = []
        for layout in LAYOUTS:
            rows.append(row(layout, measure(layout, device, settings), predictions))
            print(rows[-1], flush=True)
    finally:
        leave_process_group(ranks)
    record.update(simulations={kind: simulation.to_dict() for kind, simulation in predictions.items()}, rows=rows,
                  summary={kind: {"step_within_target": sum(abs(r["ratio"][kind]["step_seconds"] - 1)
                                                            <= TARGETS["step_seconds"] for r in rows),
                                  "peak_within_target": sum(abs(r["ratio"][kind]["peak_bytes"] - 1)
                                                            <= TARGETS["peak_bytes"] for r in rows),
                                  "layouts": len(rows)} for kind in predictions},
                  elapsed_seconds=time.perf_counter() - started)
    write_result(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
