"""A language model's head and loss: plain PyTorch against oomless.linear_cross_entropy (chunks of rows).

    python bench/bench_linear_loss.py                          # GPT-2's head (768 x 50,257), 8 x 512 tokens
    python bench/bench_linear_loss.py --rows 4096 --width 768 --classes 50257 --precision bf16
    python bench/bench_linear_loss.py --device cuda --out bench/results

One step is the head's forward, the cross-entropy and their backward over existing hidden states
(``F.cross_entropy(F.linear(hidden, weight), target)`` against the fused loss at several chunk sizes),
each method in a fresh process after a warm-up step: the peak memory rise of a step (CPU: resident
memory with glibc told to return freed memory, as oomless measures it; CUDA: the allocator's peak)
and the median step time of ``--steps`` steps. Writes ``linear-loss-<device>-<date>.json``.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch
import torch.nn.functional as F

from oomless.runtime.linear_loss import default_chunk_rows
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance, result_path, write_result  # noqa: E402  (bench/common.py)


def _step(method: str, hidden, weight, target, chunk_rows, precision: str) -> torch.Tensor:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with torch.autocast(hidden.device.type, dtype=dtype, enabled=precision != "fp32"):
        if method == "plain":
            loss = F.cross_entropy(F.linear(hidden, weight), target)
        else:
            loss = oomless.linear_cross_entropy(hidden, weight, target, chunk_rows=chunk_rows)
    loss.backward()
    return loss.detach()


def child(config: dict) -> dict:
    device = torch.device(config["device"])
    torch.set_num_threads(config["threads"])
    if device.type == "cpu":
        return_freed_memory_to_the_system()
    generator = torch.Generator().manual_seed(0)
    rows, width, classes = config["rows"], config["width"], config["classes"]
    hidden = torch.randn(rows, width, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(classes, width, generator=generator) * 0.02).to(device).requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=generator).to(device)
    method, chunk_rows, precision = config["method"], config.get("chunk_rows"), config["precision"]
    _step(method, hidden[:64], weight, target[:64], chunk_rows, precision)        # kernels' first use
    hidden.grad = weight.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        reset_peak_rss()
        before = current_rss_bytes()
    seconds = []
    for _ in range(config["steps"]):
        hidden.grad = weight.grad = None
        started = time.perf_counter()
        loss = _step(method, hidden, weight, target, chunk_rows, precision)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()) - before
    return {"method": method, "chunk_rows": chunk_rows, "peak_rise_bytes": peak, "step_seconds": seconds,
            "median_step_seconds": statistics.median(seconds), "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="tokens per step (batch x sequence)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--classes", type=int, default=50257)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--chunk-rows", default="default,64,256,1024",
                        help="fused chunk sizes to run, comma-separated ('default': the library's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    out = result_path(args.out, f"linear-loss-{torch.device(args.device).type}")
    base = {"rows": args.rows, "width": args.width, "classes": args.classes, "precision": args.precision,
            "steps": args.steps, "threads": args.threads, "device": args.device}
    runs = [dict(base, method="plain")]
    for chunk in args.chunk_rows.split(","):
        runs.append(dict(base, method="fused", chunk_rows=None if chunk == "default" else int(chunk)))
    results = []
    for config in runs:
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], capture_output=True, text=True)
        if done.returncode != 0:
            results.append({"method": config["method"], "chunk_rows": config.get("chunk_rows"),
                            "error": done.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row = results[-1]
        print(f"{row['method']:>6} chunk_rows={row['chunk_rows']}: peak rise {row['peak_rise_bytes'] / 2**20:.0f} MiB, "
              f"median step {row['median_step_seconds']:.3f} s", flush=True)
    plain = results[0]
    for row in results[1:]:
        if "error" not in row and "error" not in plain:
            row["peak_vs_plain"] = row["peak_rise_bytes"] / plain["peak_rise_bytes"]
            row["time_vs_plain"] = row["median_step_seconds"] / plain["median_step_seconds"]
    record = {"provenance": provenance(args.device), "config": base, "logits_bytes": args.rows * args.classes * 4,
              "default_chunk_rows": default_chunk_rows(args.classes, low_precision=args.precision != "fp32"),
              "results": results}
    write_result(out, record)


if __name__ == "__main__":
    main()
