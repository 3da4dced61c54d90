"""`oomless simulate` against measurement: every layout the trainer runs, on this machine's processes
over gloo, at world sizes 1, 2 and 4 (issue 14, item 4).

    python bench/bench_simulate.py --out bench/results             # ~20 minutes on 2 shared cores
    python bench/bench_simulate.py --quick --out /tmp/simulate.json   # world size 2, dp and 1F1B, a tiny U-Net

How this machine is described to the simulator: **measured, then predicted; nothing is fitted to
the training runs it is compared with.** Per world size N, in N fresh processes, a calibration:

- Compute: simulate's measured-profile path (`oomless.simulate(profile=...)`), not its roofline of a
  device table (written for GPUs' kernels). The 3D U-Net's step is profiled for real
  (`oomless.profile`: per block forward and backward seconds, saved, held and working bytes) at one
  rank's batch and a rank's threads, by rank 0 while the other N - 1 wait at a barrier: one rank
  with the cores to itself, the per-block median of ``--profiles`` profiles (after one discarded,
  which every rank runs at once). Simulate scales it to each layout's (micro-)batch, and slows it
  by the ranks computing at once on the machine's cores (`Cluster.contention`; all N under dp and
  fsdp, fewer in a pipeline's bubble), measured: a plain step of the model in k = 1 .. N ranks at
  once while the others wait (`_busy_step_seconds`), the cluster's ``contention`` in place of the
  formula busy x threads / cores (on the 2-core Xeon, 4 ranks: 1.87-2.30x measured, 2x by the
  formula). Profiling all N at once and reading rank 0's, as before, put the scheduler's
  whims in the prediction: a rank's profile of 4 on 2 cores varied by a quarter between rounds.
  At N > 1 the same profiles at the micro-batch the pipelines run, which simulate scales the
  pipelines' micro-batches from (a small batch runs slower per sample than the rank's batch scaled
  down: `oomless.simulate(profile={samples: Profile})`). Also what the zero-bubble schedules' split
  backward costs against the backward in one pass (`oomless.profile.split_backward`, torch's own stage backward functions), at the micro-batch
  their pipelines run; the profile carries the ranks' median (``split_backward_ratio``).
- Links: gloo all-reduces of 4 KiB to 4 MiB between the N processes after a barrier, fitted to the
  ring formula 2(n-1) alpha + 2(n-1)/n S/B (`oomless.plan.collectives`) for B; alpha from what a
  small all-reduce adds to a 10 ms burst of compute it follows (`_collective_after_compute`), since
  the ranks of a training step do not reach a collective together. They become the cluster's
  ``intra_node`` link (efficiency 1, backend gloo, no overlap: the ranks' threads fill the cores,
  so gloo's reductions and copies take turns with compute).
- FSDP2's own work around each collective (`_fsdp_collective_seconds`): a step of 16 tiny
  Linear units each under ``fully_shard`` against the same step unsharded, per collective, less
  what the fitted link gives such a collective; the cluster's ``fsdp_host_seconds`` (without it,
  fsdp x2 had been predicted 0.6-0.76 of its measured step: 35 units, 105 collectives a step).
  At N = 1 as well: FSDP2 skips a collective of one rank but not its copies in and out and its hooks
  (fsdp x1 had been predicted 0.82 of its measured step, 0.067 s short).
- Memory bandwidth (the optimizer step's roofline): a streaming copy, by rank 0 alone.
- The device registered (`oomless.register_device`): the machine's memory / N, that bandwidth.

Then `oomless.simulate` predicts every layout for the global batch, and each layout run here (dp,
fsdp, pipelines and, at N = 4, dp x pp hybrids under ``--schedules``) trains in N fresh processes
through the trainer's own code path (`oomless.parallel.make_strategy`, ``prepare``, ``train_step``,
``step``: the pipeline cut by the trainer's partitioner from its own profile, with the micro-batch
count simulate chose) for ``--warmup`` + ``--steps`` steps.

Threads: ``--threads auto`` gives 2 // N per process (processes x threads = the 2 cores) unless the
1-minute load average is above the core count, then 1: with other work runnable, a 2-thread kernel
waits on its descheduled partner at every parallel region (a U-Net step took 5.5 s on 2 threads
against 0.8 s on 1 at load 9). At N = 4 it is 1 either way: four processes share two cores.

Measured: the step, the median over measured steps of (latest rank's end of the step - latest
rank's end of the step before), every rank stepping without barriers as the trainer does; each
rank's peak resident memory during the measured steps above a warm baseline taken before the model
is built (as bench/floor_child.py: imports, the process group and a tiny step of the same model
first; glibc told to return freed memory); the row's peak is the fullest rank's. Compared with
simulate's ``step_seconds`` and ``memory_per_rank_bytes`` (the fullest rank's predicted peak).

The machine is shared: every round calibrates, predicts and runs each world size in turn, the
order of world sizes and layouts rotated each round, so load falls on all layouts alike and each
prediction is made minutes before its runs; medians over rounds. The load average is recorded
before and after each round. The recommendation check takes the layout predicted fastest among
those run (simulate's own recommendation may be a schedule not run) and compares its measured step
with the measured fastest (target: within 5 %).

Output: JSON with provenance, default runs/bench/simulate-cpu-<date>.json; ``--out bench/results``
for a result to commit. Fields in bench/README.md.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:    # imported from its path rather than run as a script
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import provenance, result_path, write_result  # noqa: E402  (bench/common.py)

from oomless.errors import InputError  # noqa: E402
from oomless.plan.collectives import ring_all_gather_seconds  # noqa: E402
from oomless.plan.layouts import all_ranks_bytes  # noqa: E402

SIZES = {"full": dict(size=16, base_channels=8, depth=3, global_batch=32),
         "quick": dict(size=8, base_channels=2, depth=2, global_batch=4)}
ALL_REDUCE_BYTES = (2**12, 2**16, 2**20, 2**22)     # the link calibration's sizes
BURST_SECONDS = 0.01            # compute before each collective in the latency calibration
TRAINER_SCHEDULES = None    # every schedule simulate predicts; the trainer runs them all


def threads_for(world_size: int, choice: str) -> int:
    """Threads per process: ``choice`` a number, or "auto": processes x threads = the machine's cores
    where possible (2 // N at least 1), but 1 while other work keeps more threads runnable than there
    are cores (1-minute load average above the core count): a 2-thread kernel then waits on its
    descheduled partner at every parallel region (a U-Net step measured 5.5 s on 2 threads against
    0.8 s on 1 at load 9 on 2 cores)."""
    if choice != "auto":
        return int(choice)
    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        return 1
    return max(1, cores // world_size)


# --- processes ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, task: str, settings: dict, out_path: str) -> None:
    from oomless.parallel import ParallelConfig, join_process_group, leave_process_group
    from oomless.profile.rss import return_freed_memory_to_the_system

    torch.set_num_threads(settings["threads"])
    return_freed_memory_to_the_system()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = join_process_group(ParallelConfig(mode="dp", timeout_seconds=300), torch.device("cpu"))
    try:
        result = TASKS[task](rank, world_size, settings)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            Path(out_path).write_text(json.dumps(gathered))
    finally:
        leave_process_group(ranks)
    # As bench_pipeline.py: gloo's threads can abort the interpreter's exit after the results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_processes(world_size: int, task: str, settings: dict) -> list:
    """Every rank's result of ``task`` run in ``world_size`` fresh processes."""
    raw = Path(tempfile.gettempdir()) / f"oomless-simulate-{os.getpid()}-{task}.json"
    mp.start_processes(_worker, args=(world_size, _free_port(), task, settings, str(raw)), nprocs=world_size,
                       start_method="spawn")
    gathered = json.loads(raw.read_text())
    raw.unlink()
    return gathered


# --- calibration ----------------------------------------------------------------------------------

def _time_all_reduce(rank: int, world_size: int, settings: dict) -> dict:
    """Median seconds of a gloo all-reduce at each size (after a barrier, so all ranks start together)."""
    seconds = {}
    for size in ALL_REDUCE_BYTES:
        tensor = torch.ones(size // 4)
        times = []
        for repeat in range(settings["repeats"] + 2):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            if repeat >= 2:
                times.append(time.perf_counter() - started)
        seconds[size] = statistics.median(times)
    return seconds


def _collective_after_compute(settings: dict) -> float:
    """Seconds a small all-reduce adds to a burst of compute (``BURST_SECONDS`` of matmuls on this
    rank's threads) when it follows it, as BatchNorm's collectives follow each layer's compute: the
    wire time, and the wait for the rank the machine's other work delayed and for the scheduler to
    wake the process. Bursts alone and bursts with the collective alternate; medians."""
    matrix, statistics_tensor = torch.randn(96, 96), torch.ones(64)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < BURST_SECONDS:
        matrix @ matrix
        count += 1
    alone, followed = [], []
    for _ in range(settings["repeats"]):
        for times, collective in ((alone, False), (followed, True)):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(count):
                matrix @ matrix
            if collective:
                dist.all_reduce(statistics_tensor)
            times.append(time.perf_counter() - started)
    return max(statistics.median(followed) - statistics.median(alone), 0.0)


FSDP_UNITS, FSDP_WIDTH = 16, 64     # the FSDP calibration's model: 16 Linear(64, 64) units


def _fsdp_collective_seconds(settings: dict) -> float:
    """Seconds one FSDP2 collective (an all-gather or a reduce-scatter of one unit) adds to a step
    on these ranks: a step of ``FSDP_UNITS`` tiny Linear units each under ``fully_shard`` (an all-gather
    before each forward and each backward, a reduce-scatter after each backward) against the same
    step unsharded, every rank at once after a barrier, divided by the collectives. The units' bytes
    are small, so this is FSDP2's work around each collective (copies in and out, its hooks) and the
    latency; medians."""
    import copy

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    local = nn.Sequential(*[nn.Linear(FSDP_WIDTH, FSDP_WIDTH) for _ in range(FSDP_UNITS)])
    sharded = copy.deepcopy(local)
    for unit in sharded:
        fully_shard(unit)
    fully_shard(sharded)
    inputs = torch.randn(4, FSDP_WIDTH)
    times = {"local": [], "sharded": []}
    for repeat in range(settings["repeats"] + 2):
        for name, model in (("local", local), ("sharded", sharded)):
            dist.barrier()
            started = time.perf_counter()
            model(inputs).sum().backward()
            if repeat >= 2:
                times[name].append(time.perf_counter() - started)
    added = statistics.median(times["sharded"]) - statistics.median(times["local"])
    return max(added, 0.0) / (3 * FSDP_UNITS)


def _memory_bandwidth(threads: int, megabytes: int = 64, repeats: int = 5) -> float:
    """Bytes per second of a streaming copy (read + write) on this process's threads."""
    source, target = torch.ones(megabytes * 2**18), torch.empty(megabytes * 2**18)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return 2 * source.numel() * 4 / statistics.median(times)


def _calibrate(rank: int, world_size: int, settings: dict) -> dict:
    """This rank's real profiles of the U-Net step at one rank's batch (no communication) and the
    memory bandwidth, while every rank does the same; then the all-reduce times."""
    import gc

    import oomless
    from oomless.profile.rss import current_rss_bytes
    from oomless.train.losses import segmentation_loss

    # From the baseline the measured runs take (after the same warm-up), what this process keeps
    # once it has run one plain step at the rank's batch and let its tensors go: kernel caches for
    # the rank's shapes (taken before profiling, which runs more than the trainer's step does).
    _warm_up(settings)
    baseline = current_rss_bytes()
    model, optimizer, volumes, labels = _build(settings, settings["batch"], rank)
    segmentation_loss(model(volumes), labels).backward()
    optimizer.step()
    del model, optimizer, volumes, labels
    gc.collect()
    held = max(0, current_rss_bytes() - baseline)
    model, optimizer, volumes, labels = _build(settings, settings["batch"], rank)
    loss_fn = lambda logits: segmentation_loss(logits, labels)      # noqa: E731
    # Timed under the plan for a rank's memory (`cpu_device`'s share), as simulate plans each layout:
    # without a budget the profiler times every block recomputed, and a block's backward less its
    # forward read ~20 % below a kept block's backward (3D U-Net, 32 x 16^3, 2 threads).
    memory = _machine_memory_bytes() // world_size
    # The first profile of a process pays start-up (kernels' first calls, thread pools): discarded.
    oomless.profile(model, volumes, loss_fn=loss_fn, optimizer=optimizer, memory=memory)
    # Times of one rank with the cores to itself, as simulate reads a profile: the other ranks wait
    # (simulate slows it by the ranks computing at once, `Cluster.contention`).
    measured = {"process_held_bytes": held}
    from oomless.plan.layouts import microbatch_candidates

    # The micro-batch the pipelines run (simulate's largest micro-batch count for this many ranks).
    samples = settings["global_batch"]
    micro = max(1, samples // max(microbatch_candidates(samples, world_size)))
    if world_size > 1:
        dist.barrier()
    def profiles(step_model, step_volumes, step_loss, step_optimizer) -> list[str]:
        """``settings["profiles"]`` profiles of that step, as JSON."""
        return [oomless.profile(step_model, step_volumes, loss_fn=step_loss, optimizer=step_optimizer,
                                memory=memory).to_json() for _ in range(settings["profiles"])]

    if rank == 0:
        measured["profiles"] = profiles(model, volumes, loss_fn, optimizer)
        measured["memory_bytes_per_second"] = _memory_bandwidth(settings["threads"])
        if world_size > 1 and micro != settings["batch"]:
            # The same at that micro-batch: a small batch runs slower per sample than the rank's batch
            # scaled down (one thread, Intel Xeon: 4 volumes of 16^3 1.5-2.0x slower per sample than 16).
            small, small_optimizer, small_volumes, small_labels = _build(settings, micro, rank)
            small_loss = lambda logits: segmentation_loss(logits, small_labels)      # noqa: E731
            oomless.profile(small, small_volumes, loss_fn=small_loss, optimizer=small_optimizer, memory=memory)
            measured["micro_profiles"] = profiles(small, small_volumes, small_loss, small_optimizer)
            measured["micro_batch"] = micro
            del small, small_optimizer, small_volumes, small_labels, small_loss
    if world_size > 1:
        dist.barrier()
        measured["busy_step_seconds"] = _busy_step_seconds(rank, world_size, model, optimizer, volumes, labels)
    if world_size > 1:
        # The zero-bubble schedules' split backward against the backward in one pass, at the
        # micro-batch their pipelines run.
        from oomless.profile.split_backward import measure_split_backward_ratio

        model, _, volumes, labels = _build(settings, micro, rank)
        measured["split_backward_ratio"] = measure_split_backward_ratio(
            model, volumes, lambda logits: segmentation_loss(logits, labels))
        measured["split_backward_batch"] = micro
    # At one rank too: FSDP2 skips the collective there but not its copies and hooks.
    measured["fsdp_collective_seconds"] = _fsdp_collective_seconds(settings)
    if world_size == 1:
        return measured
    return {**measured,
            "all_reduce_seconds": _time_all_reduce(rank, world_size, settings),
            "all_reduce_after_compute_seconds": _collective_after_compute(settings)}


def _busy_step_seconds(rank: int, world_size: int, model, optimizer, volumes, labels, rounds: int = 7) -> dict:
    """For k = 1 .. N busy ranks: this rank's median plain step (forward, loss, backward, Adam) while
    ranks 0 .. k - 1 step at once and the others wait at the barrier; {k: seconds} where this rank
    was busy. Their ratio to one rank alone is the machine's measured contention (`Cluster.contention`).
    The counts take turns, round after round (the first discarded), so the machine's drift over the
    seconds this takes falls on all of them alike."""
    from oomless.train.losses import segmentation_loss

    times = {busy: [] for busy in range(1, world_size + 1)}
    for round_ in range(rounds):
        for busy in times:
            dist.barrier()
            if rank < busy:
                start = time.perf_counter()
                segmentation_loss(model(volumes), labels).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if round_:
                    times[busy].append(time.perf_counter() - start)
    return {busy: statistics.median(each) for busy, each in times.items() if each}


def _build(settings: dict, batch: int, first_item: int):
    """The trainer's model, its Adam and ``batch`` of its synthetic volumes from item ``first_item``."""
    from oomless.data.synthetic import SyntheticVolumes
    from oomless.train.loop import build_segmentation_model, seed_everything

    config = _train_config(settings)
    seed_everything(config.seed)
    model = build_segmentation_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    volumes, labels = SyntheticVolumes(config.shape, seed=config.seed).batch(first_item, batch)
    return model, optimizer, volumes, labels


def _train_config(settings: dict, parallel=None):
    from oomless.train.config import TrainConfig

    kwargs = {} if parallel is None else {"parallel": parallel}
    return TrainConfig(size=settings["size"], base_channels=settings["base_channels"], depth=settings["depth"],
                       global_batch=settings["global_batch"], seed=0, **kwargs)


def median_profile(texts: list[str]):
    """The per-block median of several profiles of the same step: times, and each byte count (the
    profiles agree on the blocks)."""
    from oomless.profile.profile import Profile

    profiles = [Profile.from_json(text) for text in texts]
    first = profiles[0]
    median = lambda values: statistics.median(values)       # noqa: E731
    blocks = [replace(block, forward_seconds=median([p.blocks[i].forward_seconds for p in profiles]),
                      backward_seconds=median([p.blocks[i].backward_seconds for p in profiles]))
              for i, block in enumerate(first.blocks)]
    return replace(first, blocks=blocks, loss_seconds=median([p.loss_seconds for p in profiles]))


def fit_ring(seconds_by_bytes: dict, world_size: int, after_compute_seconds: float | None = None) -> dict:
    """alpha (latency per ring step) and B (bytes per second) of 2(n-1) alpha + 2(n-1)/n S/B, by least
    squares over the measured sizes; a link entry for the cluster file. With ``after_compute_seconds``
    (a small all-reduce's cost after compute, `_collective_after_compute`) alpha is taken from it:
    the ranks of a training step do not reach a collective together as they do after a barrier."""
    sizes = [float(size) for size in seconds_by_bytes]
    times = [seconds_by_bytes[size] for size in seconds_by_bytes]
    mean_size, mean_time = statistics.fmean(sizes), statistics.fmean(times)
    slope = sum((s - mean_size) * (t - mean_time) for s, t in zip(sizes, times)) / sum(
        (s - mean_size) ** 2 for s in sizes)
    intercept = mean_time - slope * mean_size
    n = world_size
    latency = (after_compute_seconds if after_compute_seconds is not None else max(intercept, 0.0)) / (2 * (n - 1))
    return {"name": f"gloo loopback, {n} processes", "bytes_per_second": 2 * (n - 1) / n / max(slope, 1e-15),
            "latency_seconds": latency,
            "source": "measured: gloo all-reduce between local processes, ring formula fitted (bench_simulate.py)"}


# --- measurement ----------------------------------------------------------------------------------

def _warm_up(settings: dict) -> None:
    """A step of the same model at a tiny volume and a collective: kernels' first calls, thread pools
    and lazily imported code are start-up, not the layout's memory (as bench/floor_child.py)."""
    from oomless.train.losses import segmentation_loss

    tiny = {**settings, "size": 2 ** (settings["depth"] + 1)}
    model, optimizer, volumes, labels = _build(tiny, 1, 0)
    segmentation_loss(model(volumes), labels).backward()
    optimizer.step()
    if dist.get_world_size() > 1:
        dist.all_reduce(torch.ones(4))


def prepared(strategy, config, device: torch.device, example):
    """The trainer's model and Adam for ``config``, seeded, on ``device``, and the module ``strategy``
    trains (its ``prepare`` given this rank's first batch ``example``), in training mode."""
    from oomless.train.loop import build_segmentation_model, seed_everything

    seed_everything(config.seed)
    model = build_segmentation_model(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    train_model = strategy.prepare(model, optimizer, None, example=example)
    model.train()
    return model, optimizer, train_model


def _train_layout(rank: int, world_size: int, settings: dict) -> dict:
    """``settings["steps"]`` steps of one layout through the trainer's strategy: each step's end
    (time.monotonic, one clock for every process of the machine) and the peak resident memory over
    the measured steps above the warm baseline."""
    from oomless.data.synthetic import SyntheticVolumes
    from oomless.parallel import ParallelConfig, Ranks, make_strategy
    from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    device = torch.device("cpu")
    _warm_up(settings)
    layout = settings["layout"]
    parallel = ParallelConfig(mode=layout["mode"], stages=layout.get("stages", 2),
                              schedule=layout.get("schedule") or "1f1b", microbatches=layout.get("microbatches"),
                              timeout_seconds=300)
    config = _train_config(settings, parallel)
    strategy = make_strategy(parallel, Ranks(rank, world_size), device)
    steps = settings["warmup"] + settings["steps"]
    dataset = SyntheticVolumes(config.shape, seed=config.seed)
    # Made before the baseline: the trainer makes each step's batch as it goes, and holds one or
    # two (its clone below); the loader's time is not the step's.
    batches = [dataset.batch(*strategy.shard(step, config.global_batch)) for step in range(steps)]
    baseline = current_rss_bytes()
    model, optimizer, train_model = prepared(strategy, config, device, batches[0])
    ends = []
    for step, (volumes, labels) in enumerate(batches):
        if step == settings["warmup"]:
            # Preparing (the pipeline's profile for its cut) and the first steps' start-up are not the steady step.
            reset_peak_rss()
        strategy.train_step(train_model, volumes.clone(), labels.clone())
        strategy.step(model, optimizer, step)
        ends.append(time.monotonic())
    peak = peak_rss_bytes()
    strategy.finish(model)
    record = {"ends": ends, "peak_rise_bytes": peak - baseline}
    partition = getattr(strategy, "partition", None)
    if partition is not None:
        record.update(stage_blocks=partition.stage_blocks, microbatches=partition.microbatches)
    return record


TASKS = {"calibrate": _calibrate, "train": _train_layout}


# --- prediction -----------------------------------------------------------------------------------

def calibrate(world_size: int, settings: dict) -> dict:
    """The profile, link and memory bandwidth of world size ``world_size`` (module docstring)."""
    threads = settings["threads"][world_size]
    batch = settings["global_batch"] // world_size
    measured = run_processes(world_size, "calibrate", {**settings, "threads": threads, "batch": batch,
                                                       "repeats": settings["link_repeats"]})
    # Each rank runs the same shapes: the most any rank kept.
    held = max(rank["process_held_bytes"] for rank in measured)
    split = ({"split_backward_ratio": statistics.median(rank["split_backward_ratio"] for rank in measured)}
             if "split_backward_ratio" in measured[0] else {})
    profile = replace(median_profile(measured[0]["profiles"]), process_held_bytes=held, **split)
    record = {"world_size": world_size, "threads": threads, "profiled_batch": batch,
              "profile": profile.to_json(),
              "memory_bytes_per_second": measured[0]["memory_bytes_per_second"]}
    if "micro_profiles" in measured[0]:
        record.update(micro_batch=measured[0]["micro_batch"], micro_profile=replace(
            median_profile(measured[0]["micro_profiles"]), process_held_bytes=held, **split).to_json())
    # Every rank waits for the slowest here too.
    fsdp = max(rank["fsdp_collective_seconds"] for rank in measured)
    record.update(fsdp_collective_seconds=fsdp, fsdp_host_seconds=fsdp)
    if world_size > 1:
        # Every rank waits for the slowest: the collective's time is the latest rank's.
        seconds = {int(size): max(rank["all_reduce_seconds"][size] for rank in measured)
                   for size in measured[0]["all_reduce_seconds"]}
        after_compute = statistics.median(rank["all_reduce_after_compute_seconds"] for rank in measured)
        link = fit_ring(seconds, world_size, after_compute)
        # What the link's formula already counts is not FSDP's.
        unit_bytes = 4 * (FSDP_WIDTH * FSDP_WIDTH + FSDP_WIDTH)
        on_the_link = ring_all_gather_seconds(unit_bytes, world_size, link["bytes_per_second"],
                                              link["latency_seconds"])
        record.update(all_reduce_seconds=seconds, all_reduce_after_compute_seconds=after_compute, link=link,
                      fsdp_host_seconds=max(fsdp - on_the_link, 0.0))
        # Each count of busy ranks (JSON's string keys): the median over them of their median step,
        # against rank 0 alone.
        busy = {count: statistics.median(rank["busy_step_seconds"][count] for rank in measured
                                         if count in rank["busy_step_seconds"])
                for count in measured[0]["busy_step_seconds"]}
        record.update(busy_step_seconds=busy, contention={count: busy[count] / busy["1"] for count in busy})
    return record


def _machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_device(calibration: dict):
    """This machine's share for one of N ranks as a simulate target: its memory and streaming
    bandwidth (the optimizer step's roofline: the device table's rate times MEMORY_EFFICIENCY, so
    the measured rate is stored divided by it). Compute comes from the measured profile; the
    FLOP rates are not read."""
    from oomless.plan.devices import MEMORY_EFFICIENCY, Device, register_device

    total = _machine_memory_bytes()
    rate = calibration["memory_bytes_per_second"]
    n = calibration["world_size"]
    return register_device(Device(
        f"cpu-here-{n}-ranks", total // n, rate / MEMORY_EFFICIENCY, 0.0, 0.0, 0.0, 0.0, rate, rate,
        f"measured by bench/bench_simulate.py: 1 of {n} processes on {os.cpu_count()} cores"))


def predict(calibration: dict, settings: dict):
    """`oomless.simulate` of every layout at this world size, from the calibration alone."""
    import oomless
    from oomless.profile.profile import Profile
    from oomless.train.loop import build_segmentation_model

    device = cpu_device(calibration)
    with torch.device("meta"):
        model = build_segmentation_model(_train_config(settings))
    side = settings["size"]
    example = torch.empty(calibration["profiled_batch"], 1, side, side, side, device="meta")
    # The ranks share this machine's cores, each with the calibration's threads.
    cluster = {"backend": "gloo", "overlap": False, "cores_per_node": os.cpu_count() or 1,
               "threads_per_rank": calibration["threads"],
               "fsdp_host_seconds": calibration.get("fsdp_host_seconds", 0.0)}
    if "link" in calibration:
        cluster.update(intra_node=calibration["link"], efficiency=1.0)
    if "contention" in calibration:
        cluster.update(contention=calibration["contention"])
    profile = Profile.from_json(calibration["profile"])
    if "micro_profile" in calibration:
        # Measured at the pipelines' micro-batch too: each layout's batch scaled from the nearest.
        profile = {calibration["profiled_batch"]: profile,
                   calibration["micro_batch"]: Profile.from_json(calibration["micro_profile"])}
    return oomless.simulate(model, example, settings["global_batch"], target=device.name,
                            gpus=calibration["world_size"], cluster=cluster, profile=profile)


def runnable(estimate, schedules: tuple[str, ...]) -> dict | None:
    """The trainer's layout for a simulated one; None where it does not fit or its schedule is not
    among ``schedules`` (the benchmark's time)."""
    if not estimate.fits or (estimate.schedule is not None and estimate.schedule not in schedules):
        return None
    if estimate.layout in ("dp", "fsdp"):
        return {"mode": estimate.layout}
    return {"mode": estimate.layout, "stages": estimate.pipeline_parallel, "schedule": estimate.schedule,
            "microbatches": estimate.microbatches}


# --- rows -----------------------------------------------------------------------------------------

def step_seconds(records: list[dict], warmup: int) -> list[float]:
    """Each measured step: the latest rank's end minus the latest rank's end of the step before."""
    ends = [max(record["ends"][i] for record in records) for i in range(len(records[0]["ends"]))]
    return [ends[i] - ends[i - 1] for i in range(max(warmup, 1), len(ends))]


def _without_pools(stages: list[list[str]] | None) -> list[list[str]] | None:
    """A cut's stages without the U-Net's pooling blocks: simulate's pipeline blocks hold the pooling
    module in the encoder before it (`parallel.block_sequence.pipeline_block_groups`)."""
    return None if stages is None else [[name for name in stage if not name.startswith("pool")] for stage in stages]


def layout_row(world_size: int, estimates: list, runs: list[list[dict]], warmup: int) -> dict:
    """Predicted (each round's calibration) against measured (each round's run) for one layout."""
    steps = [seconds for records in runs for seconds in step_seconds(records, warmup)]
    peaks = [max(record["peak_rise_bytes"] for record in records) for records in runs]
    per_rank = [max(records[rank]["peak_rise_bytes"] for records in runs) for rank in range(world_size)]
    predicted_step = statistics.median(estimate.step_seconds for estimate in estimates)
    predicted_peak = statistics.median(estimate.memory_per_rank_bytes for estimate in estimates)
    predicted_all_ranks = statistics.median(all_ranks_bytes(estimate) for estimate in estimates)
    measured_step, measured_peak = statistics.median(steps), statistics.median(peaks)
    first = estimates[0]
    row = {"layout": first.name, "world_size": world_size, "kind": first.layout, "schedule": first.schedule,
           "microbatches": first.microbatches, "memory_plan": first.memory_plan,
           "predicted": {"step_seconds": predicted_step, "peak_bytes": predicted_peak,
                         "all_ranks_bytes": predicted_all_ranks,
                         "step_seconds_each_round": [estimate.step_seconds for estimate in estimates],
                         "peak_bytes_each_round": [estimate.memory_per_rank_bytes for estimate in estimates],
                         "compute_seconds": first.compute_seconds,
                         "exposed_communication_seconds": first.exposed_communication_seconds},
           "measured": {"step_seconds": measured_step, "peak_bytes": measured_peak,
                        "step_seconds_each": steps, "peak_bytes_each_round": peaks,
                        "peak_bytes_per_rank": per_rank},
           "ratio": {"step_seconds": predicted_step / measured_step, "peak_bytes": predicted_peak / measured_peak},
           "notes": list(first.notes)}
    if first.partition is not None:
        trainer_cut = runs[0][0].get("stage_blocks")
        row["predicted"]["stage_blocks"] = first.partition.stage_blocks
        row["measured"]["stage_blocks"] = trainer_cut
        if _without_pools(trainer_cut) != _without_pools(first.partition.stage_blocks):
            row["notes"].append("the trainer's partitioner cut its own profile differently from simulate's")
    return row


def recommendation_check(world_size: int, simulation, rows: list[dict]) -> dict:
    """Whether the layout simulate would recommend among those run (its rule, `layouts.recommend`:
    the fastest predicted, the least memory per rank and then over all ranks among those within 1 %
    of it) is the measured fastest,
    or within 5 % of it (simulate's own recommendation may be a layout not run: it is recorded too)."""
    from oomless.plan.layouts import RECOMMEND_TIE

    here = [row for row in rows if row["world_size"] == world_size]
    fastest = min(here, key=lambda row: row["measured"]["step_seconds"])
    quickest = min(row["predicted"]["step_seconds"] for row in here)
    recommended = min((row for row in here if row["predicted"]["step_seconds"] <= quickest * (1 + RECOMMEND_TIE)),
                      key=lambda row: (row["predicted"]["peak_bytes"], row["predicted"].get("all_ranks_bytes", 0)))
    slower = recommended["measured"]["step_seconds"] / fastest["measured"]["step_seconds"] - 1
    return {"world_size": world_size, "simulate_recommended": simulation.recommended,
            "recommended_among_run": recommended["layout"], "measured_fastest": fastest["layout"],
            "recommended_slower_than_fastest_by": slower, "met": slower <= TARGETS["recommended_within"]}


TARGETS = {"step_seconds": 0.15, "peak_bytes": 0.10, "recommended_within": 0.05}


def summary(rows: list[dict], checks: list[dict]) -> dict:
    steps = [abs(row["ratio"]["step_seconds"] - 1) for row in rows]
    peaks = [abs(row["ratio"]["peak_bytes"] - 1) for row in rows]
    return {"targets": TARGETS, "layouts": len(rows),
            "step_within_target": sum(error <= TARGETS["step_seconds"] for error in steps),
            "peak_within_target": sum(error <= TARGETS["peak_bytes"] for error in peaks),
            "max_step_error": max(steps), "max_peak_error": max(peaks),
            "recommended_met": {str(check["world_size"]): check["met"] for check in checks}}


def print_row(row: dict) -> None:
    predicted, measured, ratio = row["predicted"], row["measured"], row["ratio"]
    print(f"{row['layout']:>34} M={row['microbatches']:<3} step predicted {predicted['step_seconds']:.3f} s "
          f"measured {measured['step_seconds']:.3f} s ({ratio['step_seconds']:.2f}x)  peak predicted "
          f"{predicted['peak_bytes'] / 2**20:.1f} MiB measured {measured['peak_bytes'] / 2**20:.1f} MiB "
          f"({ratio['peak_bytes']:.2f}x)", flush=True)


def run_round(world_size: int, settings: dict, schedules: tuple[str, ...], layouts: list[str] | None,
              shift: int) -> tuple[dict, object, dict]:
    """Calibrate, predict, then run every layout of this world size (``layouts``: those of the first
    round, by name; the order rotated by ``shift``). Returns (calibration, simulation, {name: run})."""
    calibration = calibrate(world_size, settings)
    simulation = predict(calibration, settings)
    print(simulation, flush=True)
    chosen = {estimate.name: estimate for estimate in simulation.layouts if runnable(estimate, schedules)
              and (settings["fsdp"] or estimate.layout != "fsdp")}
    names = layouts if layouts is not None else list(chosen)
    first_round = layouts is None
    runs = {}
    for index in range(len(names)):
        name = names[(index + shift) % len(names)]
        estimate = chosen.get(name) or simulation.layout(name)
        # The trainer's layout as the first round chose it (the same micro-batches every round).
        layout = settings["layouts"][name] if not first_round else runnable(estimate, schedules)
        settings["layouts"][name] = layout
        runs[name] = run_processes(world_size, "train", {**settings, "threads": settings["threads"][world_size],
                                                         "layout": layout})
        print(f"  ran {name}", flush=True)
    return calibration, simulation, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny U-Net, world size 2, dp and one pipeline: seconds")
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default 1,2,4; quick 2)")
    parser.add_argument("--schedules", default=None,
                        help="pipeline schedules run (default gpipe,1f1b,zbv; quick 1f1b)")
    parser.add_argument("--no-fsdp", action="store_true", help="leave fsdp out (quick leaves it out)")
    parser.add_argument("--threads", default="auto", help="per process: a number, or auto (threads_for)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 4; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps per run before measuring (default 2; quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="calibrate and run every layout, this many times "
                                                                 "(default 2; quick 1)")
    parser.add_argument("--profiles", type=int, default=None, help="profiles per calibration, median taken (default 3; quick 1)")
    parser.add_argument("--out", default=None, help="folder or .json file (default runs/bench/simulate-cpu-<date>.json)")
    args = parser.parse_args(argv)
    try:
        out = result_path(args.out, "simulate-cpu")
    except InputError as error:
        parser.error(str(error))
    quick = args.quick
    world_sizes = tuple(int(n) for n in (args.world_sizes or ("2" if quick else "1,2,4")).split(","))
    schedules = tuple((args.schedules or ("1f1b" if quick else "gpipe,1f1b,zbv")).split(","))
    settings = {**SIZES["quick" if quick else "full"],
                "warmup": args.warmup if args.warmup is not None else (1 if quick else 2),
                "steps": args.steps or (2 if quick else 4),
                "profiles": args.profiles or (1 if quick else 3), "link_repeats": 3 if quick else 10,
                "threads": {n: threads_for(n, args.threads) for n in world_sizes}, "layouts": {},
                "fsdp": not (args.no_fsdp or quick)}
    rounds = args.rounds or (1 if quick else 2)
    started = time.perf_counter()
    record = {"provenance": provenance("cpu", backend="gloo"),
              "settings": {**{key: value for key, value in settings.items() if key != "layouts"}, "rounds": rounds,
                           "world_sizes": list(world_sizes), "schedules": list(schedules), "model": "UNet3D",
                           "threads_choice": args.threads},
              "load_average": {"before": list(os.getloadavg())}}
    names: dict[int, list[str] | None] = {n: None for n in world_sizes}
    calibrations, simulations, runs = {n: [] for n in world_sizes}, {n: [] for n in world_sizes}, {}
    for round_index in range(rounds):
        # Rotated each round: a stretch of heavier load on the machine falls on other world sizes and layouts.
        order = world_sizes[round_index % len(world_sizes):] + world_sizes[:round_index % len(world_sizes)]
        for n in order:
            calibration, simulation, ran = run_round(n, settings, schedules, names[n], round_index)
            names[n] = names[n] or list(ran)
            calibrations[n].append(calibration)
            simulations[n].append(simulation)
            for name, records in ran.items():
                runs.setdefault((n, name), []).append(records)
        record["load_average"][f"after_round_{round_index + 1}"] = list(os.getloadavg())
    rows = [layout_row(n, [simulation.layout(name) for simulation in simulations[n]], runs[n, name],
                       settings["warmup"]) for n in world_sizes for name in names[n]]
    for row in rows:
        print_row(row)
    checks = [recommendation_check(n, simulations[n][0], rows) for n in world_sizes]
    record.update(calibration={str(n): calibrations[n] for n in world_sizes},
                  simulations={str(n): [simulation.to_dict() for simulation in simulations[n]] for n in world_sizes},
                  trainer_layouts=settings["layouts"], rows=rows, recommendation=checks,
                  summary=summary(rows, checks), elapsed_seconds=time.perf_counter() - started)
    for check in checks:
        print(f"world size {check['world_size']}: fastest predicted of those run {check['recommended_among_run']}, "
              f"measured fastest {check['measured_fastest']} (+{check['recommended_slower_than_fastest_by']:.1%}); "
              f"simulate recommends {check['simulate_recommended']}")
    write_result(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
