"""Data parallel benchmark: step time, optimizer work and per-bucket exposed communication of the
overlapped update (into the next forward, and in-backward) vs plain DDP vs no communication, on N
processes of one machine.

    python bench/bench_dp.py --world-size 2                 # gloo on CPU
    python bench/bench_dp.py --world-size 2 --device cuda           # NCCL, one GPU per process

Variants (same model, data, buckets and optimizer; torch DDP in all four):
- ``no_communication``: torch's ``noop_hook`` (``ddp_comm_hooks.debugging_hooks``), the headroom bound
  its docstring recommends: what a step costs if all-reduce were free;
- ``plain_ddp``: DDP's default averaging all-reduce, optimizer step after backward;
- ``overlapped_backward``: `oomless.parallel.overlap` with ``wait_in="backward"`` (each bucket's
  optimizer step chained on its all-reduce; DDP's backward returns when the last bucket's update is done);
- ``overlapped``: the default, ``wait_in="forward"`` (backward returns when the last all-reduce lands;
  the updates run on behind the next forward, each module waiting for its own parameters' update).

Side by side: the four variants live in every process at once and run round-robin, ``--steps-per-round``
consecutive steps each per round, the starting variant rotated each round, after a barrier; the first
``--warmup-rounds`` rounds are dropped. A round's time of a variant is its block of steps divided by the
number of steps. A synchronous step ends when
the slowest rank's does: per round the slowest rank's time is taken. ``paired_ratio_vs_*`` = median
over rounds of (this variant / the other in the same round), which cancels rounds slowed as a whole by
other processes on a shared machine; read it first.

Per bucket (field definitions in bench/README.md): ``communication_seconds``,
``exposed_after_backward_seconds`` and, for the overlapped variants, ``update_seconds``. Per variant, from
torch.optim's global step hooks: ``optimizer_step_calls_per_step`` and ``optimizer_step_seconds_per_step``;
for the overlapped variants, from `OverlappedUpdate`'s counters: ``module_waits_per_step`` (updates a
module's forward pre-hook waited for) and ``waited_while_running_per_step`` (of those, still running).
Means over the measured steps. Timing is measured here, never asserted in tests.

On CUDA (NCCL) the per-bucket times come from CUDA events (`BucketClock`: NCCL's futures complete
at enqueue, so wall time would read 0), and step times from wall time around a device
synchronisation; ``update_seconds`` and ``optimizer_step_seconds_per_step`` stay host wall time, which
on CUDA is the time to launch the update's kernels, not to run them. One GPU per process: ``--world-size``
above the number of GPUs is refused (NCCL refuses two ranks on one GPU).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:    # imported from its path rather than run as a script
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import provenance, result_path, write_result  # noqa: E402  (bench/common.py)

from oomless.errors import InputError  # noqa: E402
from oomless.parallel.process_group import cuda_device_for_local_rank  # noqa: E402

VARIANTS = ("no_communication", "plain_ddp", "overlapped_backward", "overlapped")


class BucketClock:
    """When each bucket's communication was launched and when it completed, in seconds.

    gloo (CPU): wall time, when DDP calls the comm hook and when the future's callback runs (the
    all-reduce has finished then). NCCL: a work's future completes when the collective is enqueued,
    not when it has run, so wall time would read ~0; the marks are CUDA events instead: one recorded
    on the current stream when DDP calls the hook (where the bucket's gradients are produced), one
    recorded in the future's callback, which torch runs on streams made to wait for the collective's
    completion. Events become seconds (relative to ``start_round``'s event) once the round is over and
    the device synchronised."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reference = None

    def start_round(self) -> None:
        if self.cuda:
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        return self.reference.elapsed_time(mark) / 1e3 if self.cuda else mark


def _timed(hook, timings: list, clock: BucketClock):
    """Wrap a DDP comm hook: record (bucket index, launch mark, completion mark)."""

    def timed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        launched = clock.mark()
        future = hook(state, bucket)
        record = {"bucket": bucket.index(), "launched": launched, "done": None}
        timings.append(record)

        def mark(done_future):
            record["done"] = clock.mark()
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


class OptimizerStepClock:
    """Calls of, and wall time inside, every ``torch.optim.Optimizer.step`` in this process, in total
    and per optimizer (the overlapped update runs one per bucket)."""

    def __init__(self):
        self.calls, self.seconds, self.seconds_by_optimizer, self._started = 0, 0.0, {}, {}
        register_optimizer_step_pre_hook(self._before)
        register_optimizer_step_post_hook(self._after)

    def _before(self, optimizer, args, kwargs):
        self._started[id(optimizer)] = time.perf_counter()

    def _after(self, optimizer, args, kwargs):
        seconds = time.perf_counter() - self._started.pop(id(optimizer))
        self.seconds += seconds
        self.seconds_by_optimizer[id(optimizer)] = self.seconds_by_optimizer.get(id(optimizer), 0.0) + seconds
        self.calls += 1

    def reset(self):
        self.calls, self.seconds = 0, 0.0
        self.seconds_by_optimizer.clear()


def _build(variant, args, device, timings, clock):
    from oomless.models import UNet3D
    from oomless.parallel.overlap import STATE_ATTRIBUTE, OverlappedUpdate

    torch.manual_seed(0)
    model = UNet3D(1, 2, base_channels=args.base_channels, depth=args.depth).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
    update = None
    if variant == "no_communication":
        ddp.register_comm_hook(None, _timed(noop_hook, timings, clock))
    elif variant == "plain_ddp":
        ddp.register_comm_hook(None, _timed(allreduce_hook, timings, clock))
    else:
        # apply_overlapped_update, with the hook timed
        update = OverlappedUpdate(ddp, optimizer, wait_in="backward" if variant == "overlapped_backward" else "forward")
        ddp.register_comm_hook(None, _timed(update.comm_hook, timings, clock))
        setattr(ddp, STATE_ATTRIBUTE, update)
    return ddp, optimizer, update


def _worker(rank, world_size, port, args, out_path):
    from oomless.train.losses import segmentation_loss

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # One process per GPU (main() refused more processes than GPUs before starting any).
    device = cuda_device_for_local_rank(rank, world_size) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    generator = torch.Generator().manual_seed(rank)
    volumes = torch.randn(args.local_batch, 1, args.size, args.size, args.size, generator=generator).to(device)
    labels = (volumes[:, 0] > 1.0).long()
    clock = OptimizerStepClock()
    timings = {variant: [] for variant in VARIANTS}
    bucket_clock = BucketClock(device)
    built = {variant: _build(variant, args, device, timings[variant], bucket_clock) for variant in VARIANTS}
    round_seconds = {variant: [] for variant in VARIANTS}       # per measured round: mean step seconds
    per_bucket = {variant: {} for variant in VARIANTS}
    optimizer_work = {variant: {"calls": 0, "seconds": 0.0, "module_waits": 0, "waited_while_running": 0}
                      for variant in VARIANTS}
    measured_steps = args.rounds * args.steps_per_round

    def add(variant, bucket, field, value):
        entry = per_bucket[variant].setdefault(bucket, {"communication_seconds": 0.0,
                                                        "exposed_after_backward_seconds": 0.0})
        entry[field] = entry.get(field, 0.0) + value / measured_steps

    for round_index in range(args.warmup_rounds + args.rounds):
        measured = round_index >= args.warmup_rounds
        order = VARIANTS[round_index % len(VARIANTS):] + VARIANTS[:round_index % len(VARIANTS)]
        for variant in order:
            ddp, optimizer, update = built[variant]
            dist.barrier()
            clock.reset()
            waits = (update.module_waits, update.waited_while_running) if update is not None else (0, 0)
            step_records = []
            if device.type == "cuda":
                torch.cuda.synchronize()    # the round's wall time starts with an idle device
            bucket_clock.start_round()
            started = time.perf_counter()
            for step in range(args.steps_per_round):
                timings[variant].clear()
                loss = segmentation_loss(ddp(volumes), labels)
                loss.backward()
                if update is None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                step_records.append(list(timings[variant]))
            if update is not None:
                update.synchronize()        # the last step's updates (wait_in="forward")
            if device.type == "cuda":
                torch.cuda.synchronize()    # every kernel and collective of the round has run: events readable
            elapsed = time.perf_counter() - started
            if not measured:
                continue
            for records in step_records:
                for record in records:
                    record["launched"] = bucket_clock.seconds(record["launched"])
                    record["done"] = bucket_clock.seconds(record["done"])
            round_seconds[variant].append(elapsed / args.steps_per_round)
            optimizer_work[variant]["calls"] += clock.calls
            optimizer_work[variant]["seconds"] += clock.seconds
            if update is not None:
                optimizer_work[variant]["module_waits"] += update.module_waits - waits[0]
                optimizer_work[variant]["waited_while_running"] += update.waited_while_running - waits[1]
            for records in step_records:
                exposed = _exposed_after_backward(records)
                for record in records:
                    add(variant, record["bucket"], "communication_seconds", record["done"] - record["launched"])
                    add(variant, record["bucket"], "exposed_after_backward_seconds", exposed[record["bucket"]])
            if update is not None:
                for bucket, bucket_update in update.bucket_updates.items():
                    seconds = clock.seconds_by_optimizer.get(id(bucket_update.optimizer), 0.0)
                    add(variant, bucket, "update_seconds", seconds)
    results = {}
    for variant in VARIANTS:
        results[variant] = {
            "round_step_seconds": round_seconds[variant],
            "median_step_seconds": statistics.median(round_seconds[variant]),
            "optimizer_step_calls_per_step": optimizer_work[variant]["calls"] / measured_steps,
            "optimizer_step_seconds_per_step": optimizer_work[variant]["seconds"] / measured_steps,
            "module_waits_per_step": optimizer_work[variant]["module_waits"] / measured_steps,
            "waited_while_running_per_step": optimizer_work[variant]["waited_while_running"] / measured_steps,
            "buckets": {str(bucket): values for bucket, values in sorted(per_bucket[variant].items())},
            "bucket_count": len(per_bucket[variant]),
        }
        if built[variant][2] is not None:
            built[variant][2].remove()
    dist.barrier()
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def summarize(per_rank: list[dict]) -> dict:
    """Per round the slowest rank's step; medians over rounds and paired ratios (module docstring)."""
    slowest = {variant: [max(rank[variant]["round_step_seconds"][index] for rank in per_rank)
                         for index in range(len(per_rank[0][variant]["round_step_seconds"]))]
               for variant in VARIANTS}
    summary = {}
    for variant in VARIANTS:
        summary[variant] = {"median_step_seconds_slowest_rank": statistics.median(slowest[variant])}
        for other in ("no_communication", "plain_ddp", "overlapped_backward"):
            summary[variant][f"paired_ratio_vs_{other}"] = statistics.median(
                mine / theirs for mine, theirs in zip(slowest[variant], slowest[other]))
        for field in ("optimizer_step_calls_per_step", "optimizer_step_seconds_per_step", "module_waits_per_step",
                      "waited_while_running_per_step"):
            summary[variant][field] = statistics.mean(rank[variant][field] for rank in per_rank)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", type=int, default=24)
    parser.add_argument("--base-channels", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--local-batch", type=int, default=1)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=40, help="measured rounds")
    parser.add_argument("--steps-per-round", type=int, default=2, help="consecutive steps of a variant per round")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", default=None, help="folder or .json file (default runs/bench/dp-<device>-<backend>-<date>.json)")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        try:
            cuda_device_for_local_rank(args.world_size - 1, args.world_size)    # more processes than GPUs: refused
        except InputError as error:
            parser.error(str(error))
    try:
        out = result_path(args.out, f"dp-{args.device}-{backend}")
    except InputError as error:
        parser.error(str(error))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    record = provenance(args.device, world_size=args.world_size, backend=backend, threads=args.threads)
    raw = Path(tempfile.gettempdir()) / f"oomless-dp-raw-{os.getpid()}.json"
    mp.start_processes(_worker, args=(args.world_size, port, args, str(raw)), nprocs=args.world_size,
                       start_method="spawn")
    per_rank = json.loads(raw.read_text())
    raw.unlink()
    record["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    summary = summarize(per_rank)
    result = {"provenance": record, "settings": vars(args), "summary": summary, "per_rank": per_rank}
    write_result(out, result)
    print(json.dumps(summary, indent=2))
    print(f"load average at start {record['load_average_at_start']}, at end {record['load_average_at_end']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
