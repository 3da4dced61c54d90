"""A torch.profiler trace of one training step with every block swapped, and how far the copies
hid behind compute.

    python bench/swap_trace.py --device cuda --out bench/results/swap-trace.json
    python bench/swap_trace.py --device cpu --quick --out /tmp/trace.json     # the code path, on CPU

The 3D U-Net of bench/common.py is planned with every block forced to swap (``decisions=``,
``min_swap_bytes=0``), trained two steps (the pinned pool fills, kernels load), then one step is
recorded. From the trace's device events (Kineto's chrome trace: ``cat`` "kernel", "gpu_memcpy",
``ts``/``dur`` in microseconds, ``args.stream``) it measures, per copy direction, the copy time spent
while some kernel ran (``overlapped``) and while none did (``exposed``: the device only copied), and
the streams each kind of work used (copies should run on streams no kernel ran on). Written next to
the JSON: the trace itself, gzipped (chrome://tracing or https://ui.perfetto.dev open it).
"""

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch

from oomless.runtime.install import installed_state

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:    # imported from its path rather than run as a script
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import SIZES, build_model, provenance, write_result  # noqa: E402  (bench/common.py)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _covered(interval: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    """Length of ``interval`` inside the union ``merged``."""
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged if a < end and b > start)


def _direction(name: str) -> str:
    for key, direction in (("DtoH", "device_to_host"), ("HtoD", "host_to_device"), ("DtoD", "device_to_device")):
        if key in name:
            return direction
    return "other"


def summarize_trace(events: list[dict]) -> dict:
    """Copy/compute overlap from chrome-trace events (times in microseconds, as Kineto writes them).

    Copies within one direction are merged first (two copies at once count their wall time once)."""
    complete = [event for event in events if event.get("ph") == "X" and "dur" in event]
    kernels = [event for event in complete if event.get("cat") == "kernel"]
    copies = [event for event in complete if event.get("cat") == "gpu_memcpy"]
    kernel_union = _merged([(event["ts"], event["ts"] + event["dur"]) for event in kernels])
    summary = {
        "kernel_count": len(kernels),
        "kernel_busy_seconds": sum(b - a for a, b in kernel_union) / 1e6,
        "kernel_streams": sorted({event.get("args", {}).get("stream") for event in kernels}, key=str),
        "copy_count": len(copies),
        "pageable_copy_count": sum("Pageable" in event.get("name", "") for event in copies),
        "directions": {},
    }
    for direction in sorted({_direction(event.get("name", "")) for event in copies}):
        chosen = [event for event in copies if _direction(event.get("name", "")) == direction]
        union = _merged([(event["ts"], event["ts"] + event["dur"]) for event in chosen])
        seconds = sum(b - a for a, b in union) / 1e6
        overlapped = sum(_covered(interval, kernel_union) for interval in union) / 1e6
        summary["directions"][direction] = {
            "count": len(chosen),
            "bytes": sum(event.get("args", {}).get("bytes", 0) or 0 for event in chosen),
            "seconds": seconds,
            "overlapped_seconds": overlapped,
            "exposed_seconds": seconds - overlapped,
            "overlap_fraction": overlapped / seconds if seconds > 0 else None,
            "streams": sorted({event.get("args", {}).get("stream") for event in chosen}, key=str),
        }
    host_copies = [summary["directions"][d] for d in ("device_to_host", "host_to_device") if d in summary["directions"]]
    total = sum(entry["seconds"] for entry in host_copies)
    summary["host_copy_seconds"] = total
    summary["host_copy_overlap_fraction"] = (sum(entry["overlapped_seconds"] for entry in host_copies) / total
                                             if total > 0 else None)
    copy_streams = {stream for entry in host_copies for stream in entry["streams"]}
    summary["copies_share_a_stream_with_kernels"] = bool(copy_streams & set(summary["kernel_streams"]))
    return summary


def _step(model, inputs, loss_fn, optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(inputs)).backward()
    optimizer.step()


def run(device: torch.device, quick: bool, out: Path, trace_path: Path) -> dict:
    sizes = SIZES["quick" if quick else device.type]["unet3d"]
    model, inputs, loss_fn = build_model("unet3d", sizes, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer)
    decisions = {block.name: "swap" for block in profile.blocks}
    oomless.fit(model, inputs, 2**40, loss_fn=loss_fn, optimizer=optimizer, profile=profile, decisions=decisions,
                min_swap_bytes=0)
    for _ in range(2):
        _step(model, inputs, loss_fn, optimizer)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)      # the warm-up's copies stay out of the recorded step
    before = oomless.stats(model)
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profiler:
        with torch.profiler.record_function("oomless_swap_step"):
            _step(model, inputs, loss_fn, optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # every copy of the step completes inside the trace
    step_seconds = time.perf_counter() - started
    after = oomless.stats(model)
    tier = installed_state(model).tier
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        text = raw.read_text()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(trace_path, "wt") as compressed:
        compressed.write(text)
    summary = summarize_trace(json.loads(text).get("traceEvents", []))
    oomless.remove(model)
    result = {
        "provenance": provenance(device), "sizes": sizes, "blocks": len(decisions),
        "step_seconds_with_profiler": step_seconds,
        "offloaded_bytes": after.offloaded_bytes - before.offloaded_bytes,
        "stall_seconds": after.stall_seconds - before.stall_seconds,
        "dedicated_copy_streams": getattr(tier, "dedicated_streams", None),
        "trace_file": trace_path.name, "trace": summary,
    }
    write_result(out, result)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny model: checks the program, not the overlap")
    parser.add_argument("--out", default=str(BENCH_DIRECTORY / "results" / "swap-trace.json"))
    parser.add_argument("--trace", default=None, help="gzipped chrome trace (default: next to --out, .trace.json.gz)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    trace_path = Path(args.trace) if args.trace else out.with_suffix(".trace.json.gz")
    result = run(torch.device(args.device), args.quick, out, trace_path)
    print(json.dumps(result["trace"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
