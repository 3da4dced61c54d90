"""Pipeline-parallel benchmark: the measured bubble fraction of each schedule against the textbook
(P - 1) / (M + P - 1), the partitioner's prediction and a simulation of torch's own action order (issue 5).

    python bench/bench_pipeline.py                            # ~3 minutes on 2 cores
    python bench/bench_pipeline.py --quick --out /tmp/pipeline.json   # seconds; what the test runs

Synthetic rows: on a 2-core CPU, P processes computing for real would contend for the cores and bury
the schedule's bubble under that contention. So the model is a chain of `SleepBlock`s whose forward,
input-gradient and weight-gradient parts each *sleep* one ``--unit`` (F = B = W, the ratio Qi et al.
2023 assume for zero-bubble schedules; a full backward is B + W = 2 units): known durations that use
no core. Every rank holds 2 blocks (GPipe/1F1B: one stage of 2 blocks; the multi-stage schedules: 2
stages of 1 block), so every rank's compute per step is C = M x 2 x 3 units in every schedule.

Per schedule, P pipeline ranks and M micro-batches, after ``--warmup`` steps, ``--steps`` timed steps:
the step lasts T = (latest end - earliest start over ranks) of `PipelineParallel.step` (all ranks
start after a barrier; ``time.monotonic`` is one clock for every process of a machine), and

    measured_bubble  = 1 - C / T                 the share of the step a rank is not computing
    textbook_bubble  = (P - 1) / (M + P - 1)     GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2021)
    simulated_bubble = 1 - C / T_sim             T_sim: torch's action order for this schedule run with
                                                 the same per-action times and free communication
    predicted_bubble = 1 - C / T_plan            T_plan: `oomless.plan.partition.predicted_step_seconds`

One real-model row per single-stage schedule (P = 2, TinyTransformer, one thread per process): there
the busy time of each rank is measured (the stage's forward, backward and loss calls, timed around
torch's `PipelineStage` compute methods, outside which the schedule waits for its receives) and
measured_bubble = 1 - mean busy / T; the simulation uses the measured per-stage times.
"""

import argparse
import importlib
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
import torch.nn.functional as F
from torch import nn

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:    # imported from its path rather than run as a script
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import provenance, result_path, write_result  # noqa: E402  (bench/common.py)

from oomless.errors import InputError  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
BLOCKS_PER_RANK = 2
MICROBATCH_ROWS = 4          # synthetic micro-batch: (4, 8) floats; its size does not matter
REAL_SIZES = {"full": dict(dim=256, depth=6, heads=8, vocab_size=512, batch=8, length=128, microbatches=4),
              "quick": dict(dim=32, depth=2, heads=2, vocab_size=64, batch=4, length=16, microbatches=2)}


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``forward_seconds`` and whose backward sleeps ``backward_seconds``."""

    @staticmethod
    def forward(ctx, tensor, forward_seconds: float, backward_seconds: float):
        time.sleep(forward_seconds)
        ctx.backward_seconds = backward_seconds
        return tensor.clone()

    @staticmethod
    def backward(ctx, gradient):
        time.sleep(ctx.backward_seconds)
        return gradient, None, None


class SleepBlock(nn.Module):
    """output = sleep(input) x sleep(weight): the forward sleeps one unit; backward, the input's
    gradient path sleeps one unit and the weight's another. They are separate autograd nodes, so
    torch's zero-bubble split (input gradients first, `stage_backward_weight` later, from the
    multiply's saved output gradient) runs exactly one of the two sleeps in each part."""

    def __init__(self, unit_seconds: float):
        super().__init__()
        self.unit_seconds = unit_seconds
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            # The model's input needs no gradient, and a real first layer skips that work; here the
            # first block does it too, so that every rank's compute is the same and C is exact.
            tensor = tensor.detach().requires_grad_()
        return _Sleep.apply(tensor, self.unit_seconds, self.unit_seconds) * _Sleep.apply(self.weight, 0.0,
                                                                                          self.unit_seconds)


def sleep_sequence(blocks: int, unit_seconds: float):
    from oomless.parallel.block_sequence import Block, BlockSequence

    return BlockSequence([Block(f"sleep{index}", SleepBlock(unit_seconds), ("x",), ("x",)) for index in range(blocks)],
                         inputs=("x",), output="x")


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in ("gpipe", "1f1b") else 2


# --- what the schedule alone predicts ---------------------------------------------------------

def rank_actions(schedule: str, ranks: int, microbatches: int) -> list[list[tuple[int, str, int]]]:
    """Per rank, the (stage, "F" | "B" | "I" | "W", micro-batch) compute actions in the order torch
    runs them. GPipe and 1F1B: as their ``_step_microbatches`` loops run them (1F1B's
    ``pipeline_order`` IR in torch 2.13 misnumbers micro-batches, and the runtime does not read it);
    the multi-stage schedules: their ``pipeline_order``, which their runtime executes."""
    if schedule == "gpipe":
        return [[(rank, "F", m) for m in range(microbatches)] + [(rank, "B", m) for m in range(microbatches)]
                for rank in range(ranks)]
    if schedule == "1f1b":
        orders = []
        for rank in range(ranks):
            warmup = min(microbatches, ranks - rank)        # torch: num_stages - stage_index forwards first
            order = [(rank, "F", m) for m in range(warmup)]
            for backward in range(microbatches):
                order.append((rank, "B", backward))
                if warmup + backward < microbatches:
                    order.append((rank, "F", warmup + backward))
            orders.append(order)
        return orders
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from oomless.parallel.pipeline import SCHEDULE_CLASSES

    orders = get_schedule_ops(SCHEDULE_CLASSES[schedule], ranks, microbatches, stages_per_rank(schedule))
    return [[(action.stage_index, action.computation_type.value, action.microbatch_index) for action in order
             if action is not None and action.computation_type.value in "FBIW"] for order in orders]


def simulate_step_seconds(orders, seconds_of, stages: int) -> float:
    """Makespan of torch's ``orders`` ((stage, kind, micro-batch) per rank) with per-action
    ``seconds_of(stage, kind)`` and free communication: `oomless.plan.schedules.simulate_actions`,
    the simulator the partitioner's predictions use, run here on torch's own orders."""
    schedules = importlib.import_module("oomless.plan.schedules")   # `oomless.plan` is also a function
    actions = [[schedules.Action(*action) for action in order] for order in orders]
    named = 1 + max((action.stage for order in actions for action in order), default=0)
    if named != stages:
        raise ValueError(f"expected orders over {stages} stages, they name {named}")
    return schedules.simulate_actions(actions, seconds_of)


def synthetic_seconds_of(unit_seconds: float, blocks_per_stage: int):
    """Per-action seconds of `SleepBlock` stages; stage 0 skips its input-gradient action and does the
    whole backward in its weight action (torch's `backward_one_chunk(full_backward=False)`)."""
    unit = blocks_per_stage * unit_seconds
    table = {"F": unit, "B": 2 * unit, "I": unit, "W": unit}
    return lambda stage, kind: (0.0 if kind == "I" else 2 * unit) if stage == 0 and kind in "IW" else table[kind]


def textbook_bubble(ranks: int, microbatches: int) -> float:
    return (ranks - 1) / (microbatches + ranks - 1)


def partition_predicted_bubble(schedule: str, ranks: int, microbatches: int, rank_seconds: float,
                               forward_fraction: float) -> float | None:
    """The partitioner's schedule-aware prediction (`oomless.plan.partition.predicted_step_seconds`,
    its formulas and sources in that module's docstring): 1 - M T / step for a rank taking
    ``rank_seconds`` per micro-batch, ``forward_fraction`` of it in forward. None where the
    partitioner has no such function."""
    # `oomless.plan` the function shadows the package's name: import the module by its full name.
    schedules = importlib.import_module("oomless.plan.schedules")
    predict = getattr(schedules, "predicted_step_seconds", None)
    if predict is None:
        return None
    step = predict(schedule, ranks, stages_per_rank(schedule), microbatches, rank_seconds, forward_fraction)
    return 1 - microbatches * rank_seconds / step


# --- the processes ------------------------------------------------------------------------------

def _timed_stages(pipeline, busy: list[float], per_call: dict) -> None:
    """Add the wall time of every compute call of the pipeline's stages to ``busy[0]`` and to
    ``per_call[(stage, kind)]``. Wrapping the bound methods of these instances is for measurement
    only: torch has no hook around a stage's backward-weight call."""
    for stage in pipeline.stages:
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            method = getattr(stage, name)

            def timed(*args, _method=method, _key=(stage.stage_index, kind), **kwargs):
                started = time.monotonic()
                try:
                    return _method(*args, **kwargs)
                finally:
                    elapsed = time.monotonic() - started
                    busy[0] += elapsed
                    per_call.setdefault(_key, []).append(elapsed)

            setattr(stage, name, timed)


def _build_job(job: dict, ranks: int):
    """(sequence, stage count, loss_fn, inputs, target) of a job, the same in every process."""
    from oomless.models import TinyTransformer
    from oomless.parallel.block_sequence import transformer_sequence

    if job["kind"] == "synthetic":
        sequence = sleep_sequence(ranks * BLOCKS_PER_RANK, job["unit_seconds"])
        rows = job["microbatches"] * MICROBATCH_ROWS
        return sequence, ranks * stages_per_rank(job["schedule"]), F.mse_loss, torch.ones(rows, 8), torch.zeros(rows, 8)
    sizes = job["sizes"]
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=sizes["vocab_size"], dim=sizes["dim"], depth=sizes["depth"],
                            heads=sizes["heads"], max_len=sizes["length"], dropout=0.0)
    tokens = torch.randint(0, sizes["vocab_size"], (sizes["batch"], sizes["length"] + 1))
    return (transformer_sequence(model), ranks * stages_per_rank(job["schedule"]),
            lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten()),
            tokens[:, :-1], tokens[:, 1:])


def _run_job(job: dict, ranks: int, warmup: int) -> dict:
    from oomless.errors import InputError
    from oomless.parallel.pipeline import PipelineParallel, even_cuts

    sequence, stages, loss_fn, inputs, target = _build_job(job, ranks)
    busy, per_call = [0.0], {}

    def timed_loss(output, expected):
        started = time.monotonic()
        loss = loss_fn(output, expected)
        busy[0] += time.monotonic() - started
        per_call.setdefault((stages - 1, "loss"), []).append(time.monotonic() - started)
        return loss

    try:
        pipeline = PipelineParallel(sequence, even_cuts(len(sequence.blocks), stages), timed_loss,
                                    job["microbatches"], job["schedule"],
                                    example=(inputs.chunk(job["microbatches"])[0],))
    except (InputError, ValueError) as error:     # every rank refuses alike: nothing was sent yet
        return {"refused": f"{type(error).__name__}: {error}"}
    _timed_stages(pipeline, busy, per_call)
    starts, ends, busy_per_step = [], [], []
    for step in range(warmup + job["steps"]):
        for parameter in pipeline.parameters():
            parameter.grad = None
        if step == warmup:
            per_call.clear()
        dist.barrier()
        busy[0] = 0.0
        started = time.monotonic()
        pipeline.step(inputs, target=target)
        ended = time.monotonic()
        if step >= warmup:
            starts.append(started)
            ends.append(ended)
            busy_per_step.append(busy[0])
    dist.barrier()
    return {"starts": starts, "ends": ends, "busy_seconds": busy_per_step,
            "median_call_seconds": {f"{stage}{kind}": statistics.median(values)
                                    for (stage, kind), values in sorted(per_call.items())}}


def _worker(rank: int, ranks: int, port: int, jobs: list[dict], warmup: int, raw_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        results = [_run_job(job, ranks, warmup) for job in jobs]
        gathered = [None] * ranks if rank == 0 else None
        dist.gather_object(results, gathered, dst=0)
        if rank == 0:
            Path(raw_path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()
    # About 1 run in 12 the process aborted at interpreter exit, after destroy_process_group had
    # returned ("terminate called without an active exception": a C++ thread still joinable when
    # static objects are destroyed). The results are written by then; leave without the destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_jobs(ranks: int, jobs: list[dict], warmup: int, raw_path: Path) -> list[list[dict]]:
    """Per job, per rank, the worker's record (``raw_path`` is scratch)."""
    mp.start_processes(_worker, args=(ranks, _free_port(), jobs, warmup, str(raw_path)), nprocs=ranks,
                       start_method="spawn")
    per_rank = json.loads(raw_path.read_text())
    raw_path.unlink()
    return [[per_rank[rank][index] for rank in range(ranks)] for index in range(len(jobs))]


# --- rows ---------------------------------------------------------------------------------------

def _row(job: dict, ranks: int, records: list[dict]) -> dict:
    schedule, microbatches = job["schedule"], job["microbatches"]
    row = {"model": job["kind"] if job["kind"] == "synthetic" else "TinyTransformer", "schedule": schedule,
           "steps": job["steps"],
           "pipeline_ranks": ranks, "stages_per_rank": stages_per_rank(schedule), "microbatches": microbatches,
           "textbook_bubble": textbook_bubble(ranks, microbatches), "notes": []}
    if "refused" in records[0]:
        row.update(status="refused", predicted_bubble=None, notes=[records[0]["refused"]])
        return row
    steps = [max(record["ends"][i] for record in records) - min(record["starts"][i] for record in records)
             for i in range(len(records[0]["ends"]))]
    busy = [statistics.median(record["busy_seconds"]) for record in records]
    median_step = statistics.median(steps)
    stages = ranks * row["stages_per_rank"]
    orders = rank_actions(schedule, ranks, microbatches)
    if job["kind"] == "synthetic":
        blocks_per_stage = BLOCKS_PER_RANK // row["stages_per_rank"]
        ideal = microbatches * BLOCKS_PER_RANK * 3 * job["unit_seconds"]
        seconds_of = synthetic_seconds_of(job["unit_seconds"], blocks_per_stage)
        row.update(blocks_per_stage=blocks_per_stage, unit_seconds=job["unit_seconds"])
        rank_seconds, forward_fraction = ideal / microbatches, 1 / 3
    else:
        calls = {}
        for record in records:
            calls.update(record["median_call_seconds"])
        ideal = statistics.mean(busy)

        def seconds_of(stage, kind):
            return calls.get(f"{stage}{kind}", 0.0) + (calls.get(f"{stage}loss", 0.0) if kind == "F" else 0.0)

        row.update(sizes=job["sizes"], median_call_seconds=calls)
        # The partitioner's T is the slowest rank's seconds per micro-batch, its forward share measured.
        slowest = max(range(ranks), key=lambda rank: busy[rank])
        rank_seconds = busy[slowest] / microbatches
        forward_fraction = seconds_of(slowest, "F") / (seconds_of(slowest, "F") + seconds_of(slowest, "B"))
        row["notes"].append("ideal_seconds: the mean over ranks of their measured busy time (stages are "
                            "not balanced: even cut by blocks); step includes the tied embedding's gradient all-reduce")
    simulated = simulate_step_seconds(orders, seconds_of, stages)
    row["predicted_bubble"] = partition_predicted_bubble(schedule, ranks, microbatches, rank_seconds, forward_fraction)
    row.update(status="ran", median_step_seconds=median_step, step_seconds=steps, ideal_seconds=ideal,
               busy_seconds_per_rank=busy, measured_bubble=1 - ideal / median_step,
               simulated_step_seconds=simulated, simulated_bubble=1 - ideal / simulated,
               overhead_vs_simulated=median_step / simulated - 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", type=float, default=None,
                        help="seconds one block's forward (and each backward part) sleeps (default 0.02; quick 0.01)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5; quick 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="P = 2, M in (1, 2), tiny real model: seconds")
    parser.add_argument("--out", default=None, help="folder or .json file (default runs/bench/pipeline-cpu-<date>.json)")
    args = parser.parse_args(argv)
    unit = args.unit if args.unit is not None else (0.01 if args.quick else 0.02)
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    rank_counts, microbatch_counts = ((2,), (1, 2)) if args.quick else ((2, 4), (1, 2, 4, 8))
    real_sizes = REAL_SIZES["quick" if args.quick else "full"]
    try:
        out = result_path(args.out, "pipeline-cpu")
    except InputError as error:
        parser.error(str(error))
    record = {"provenance": provenance("cpu", threads=1, backend="gloo"),
              "settings": {"unit_seconds": unit, "steps": steps, "warmup_steps": args.warmup, "quick": args.quick,
                           "schedules": list(SCHEDULES), "pipeline_ranks": list(rank_counts),
                           "microbatches": list(microbatch_counts), "blocks_per_rank": BLOCKS_PER_RANK,
                           "microbatch_shape": [MICROBATCH_ROWS, 8], "real_model_sizes": real_sizes},
              "rows": []}
    for ranks in rank_counts:
        jobs = [{"kind": "synthetic", "schedule": schedule, "microbatches": microbatches, "unit_seconds": unit,
                 "steps": steps} for schedule in SCHEDULES for microbatches in microbatch_counts]
        if ranks == 2:
            # Real kernels vary from step to step (and with other work on the machine): twice the steps.
            jobs += [{"kind": "real", "schedule": schedule, "microbatches": real_sizes["microbatches"],
                      "sizes": real_sizes, "steps": 2 * steps} for schedule in ("gpipe", "1f1b")]
        raw = Path(tempfile.gettempdir()) / f"oomless-pipeline-raw-{os.getpid()}.json"
        for job, records in zip(jobs, run_jobs(ranks, jobs, args.warmup, raw)):
            row = _row(job, ranks, records)
            record["rows"].append(row)
            predicted = "-" if row["predicted_bubble"] is None else f"{row['predicted_bubble']:.3f}"
            shown = (f"measured {row['measured_bubble']:.3f}  simulated {row['simulated_bubble']:.3f}  "
                     f"predicted {predicted}"
                     if row["status"] == "ran" else row["notes"][0][:60])
            print(f"{row['model']:>15} {row['schedule']:>16} P={ranks} M={row['microbatches']}  "
                  f"textbook {row['textbook_bubble']:.3f}  {shown}", flush=True)
    write_result(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
