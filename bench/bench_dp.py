"""Data parallel benchmark: step time and per-bucket exposed communication of the overlapped update
vs plain DDP vs no communication, on N processes of one machine.

    /tmp/v/bin/python bench/bench_dp.py --world-size 2              # gloo on CPU
    python bench/bench_dp.py --world-size 2 --device cuda           # NCCL, one GPU per process

Variants (same model, data, buckets and optimizer; torch DDP in all three):
- ``no_communication``: torch's ``noop_hook`` (``ddp_comm_hooks.debugging_hooks``), the headroom bound
  its docstring recommends: what a step costs if all-reduce were free;
- ``plain_ddp``: DDP's default averaging all-reduce, optimizer step after backward;
- ``overlapped``: `oomless.parallel.overlap` (per-bucket update when the all-reduce lands, per-layer
  waits in the next forward).

Per bucket: ``communication_seconds`` (all-reduce launch to completion), ``exposed_after_backward_seconds``
(the part of it after the last bucket was launched, i.e. after backward's compute, not already counted
for an earlier bucket: DDP blocks backward until all of these land, in both DDP variants), and for the
overlapped variant ``forward_wait_seconds`` (time the next forward's layers waited for this bucket's
update). Means over the measured steps. Timing is measured here, never asserted in tests.
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:    # imported from its path rather than run as a script
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import provenance  # noqa: E402  (bench/common.py)

VARIANTS = ("no_communication", "plain_ddp", "overlapped")


def _timed(hook, timings: list):
    """Wrap a DDP comm hook: record (bucket index, launch, completion) perf_counter times."""

    def timed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        launched = time.perf_counter()
        future = hook(state, bucket)
        record = {"bucket": bucket.index(), "launched": launched, "done": None}
        timings.append(record)

        def mark(done_future):
            record["done"] = time.perf_counter()
            return done_future.value()

        return future.then(mark)

    return timed_hook


def _exposed_after_backward(records: list[dict]) -> dict[int, float]:
    last_launch = max(record["launched"] for record in records)
    exposed, covered_until = {}, last_launch
    for record in sorted(records, key=lambda item: item["done"]):
        exposed[record["bucket"]] = max(0.0, record["done"] - covered_until)
        covered_until = max(covered_until, record["done"])
    return exposed


def _worker(rank, world_size, port, args, out_path):
    from oomless.models import UNet3D
    from oomless.parallel.overlap import OverlappedUpdate, STATE_ATTRIBUTE
    from oomless.train.losses import segmentation_loss

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    generator = torch.Generator().manual_seed(rank)
    volumes = torch.randn(args.local_batch, 1, args.size, args.size, args.size, generator=generator).to(device)
    labels = (volumes[:, 0] > 1.0).long()
    results = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = UNet3D(1, 2, base_channels=args.base_channels, depth=args.depth).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        ddp = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None,
                                      bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
        timings: list[dict] = []
        update = None
        if variant == "no_communication":
            ddp.register_comm_hook(None, _timed(noop_hook, timings))
        elif variant == "plain_ddp":
            ddp.register_comm_hook(None, _timed(allreduce_hook, timings))
        else:
            update = OverlappedUpdate(ddp, optimizer)
            ddp.register_comm_hook(None, _timed(update.comm_hook, timings))
            setattr(ddp, STATE_ATTRIBUTE, update)
        step_seconds, per_bucket = [], {}
        for step in range(args.warmup + args.steps):
            timings.clear()
            if update is not None:
                update.wait_seconds_by_bucket.clear()
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            loss = segmentation_loss(ddp(volumes), labels)
            loss.backward()
            if update is None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            if step < args.warmup:
                continue
            step_seconds.append(elapsed)
            exposed = _exposed_after_backward(timings)
            for record in timings:
                entry = per_bucket.setdefault(record["bucket"], {"communication_seconds": 0.0,
                                                                 "exposed_after_backward_seconds": 0.0,
                                                                 "forward_wait_seconds": 0.0})
                entry["communication_seconds"] += (record["done"] - record["launched"]) / args.steps
                entry["exposed_after_backward_seconds"] += exposed[record["bucket"]] / args.steps
            if update is not None:      # waits in this step's forward, for the previous step's updates
                for bucket, waited in update.wait_seconds_by_bucket.items():
                    per_bucket.setdefault(bucket, {"forward_wait_seconds": 0.0})
                    per_bucket[bucket]["forward_wait_seconds"] += waited / args.steps
        step_seconds.sort()
        results[variant] = {
            "median_step_seconds": step_seconds[len(step_seconds) // 2],
            "mean_step_seconds": sum(step_seconds) / len(step_seconds),
            "buckets": {str(bucket): values for bucket, values in sorted(per_bucket.items())},
            "bucket_count": len(per_bucket),
        }
        if update is not None:
            update.remove()
        del ddp
        dist.barrier()
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", type=int, default=24)
    parser.add_argument("--base-channels", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--local-batch", type=int, default=1)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/dp-<device>-<backend>-<date>.json)")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    raw = BENCH_DIRECTORY / "results" / ".dp-raw.json"
    mp.start_processes(_worker, args=(args.world_size, port, args, str(raw)), nprocs=args.world_size,
                       start_method="spawn")
    per_rank = json.loads(raw.read_text())
    raw.unlink()
    summary = {}
    for variant in VARIANTS:
        # A synchronous step ends when the slowest rank's does: report the slowest rank's median.
        summary[variant] = {"median_step_seconds_slowest_rank": max(rank[variant]["median_step_seconds"]
                                                                    for rank in per_rank)}
    base = summary["no_communication"]["median_step_seconds_slowest_rank"]
    for variant in VARIANTS:
        summary[variant]["vs_no_communication"] = summary[variant]["median_step_seconds_slowest_rank"] / base
    result = {"provenance": provenance(args.device, world_size=args.world_size, backend=backend,
                                          threads=args.threads), "settings": vars(args),
              "summary": summary, "per_rank": per_rank}
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else BENCH_DIRECTORY / "results" / f"dp-{args.device}-{backend}-{date}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
