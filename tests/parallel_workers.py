"""Helpers for the data-parallel tests: start N gloo processes on loopback, run training jobs in
each, and leave rank 0's ``--save`` files and results behind for the test to compare.

Processes are started with ``torch.multiprocessing`` spawn (a fork of a process that already ran
OpenMP kernels can hang); each runs one thread so 4 ranks share this machine's cores fairly.

The workers meet at a store the test process holds open (`rendezvous`), never at a port chosen
free and bound later: on a loaded machine spawned processes take seconds to start, and in that
window another process (another test's gloo listener, on a port the kernel handed out) can take a
free port; workers that connect there talk to a stranger's gloo, which aborts (SIGABRT) on the bytes.
"""

import contextlib
import hashlib
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TINY = dict(size=16, seed=0, base_channels=2, depth=1, progress=False, device="cpu", log_every=1)


# Joining waits this long for every rank: a spawned process can take seconds to start under load.
JOIN_TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    """A port free now (for a group of one, bound at once by this same process)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def rendezvous():
    """The port of a store this process serves while the block runs: bound from the moment the
    kernel picks it, so no other process can take it before the workers `join` there."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=JOIN_TIMEOUT)
    try:
        yield store.port
    finally:
        del store


def join(rank: int, world_size: int, port: int, timeout: timedelta | None = None) -> None:
    """Join the gloo group of ``world_size`` at the `rendezvous` store on ``port``; at exit, gloo's
    threads get their grace period (oomless.parallel.process_group.guard_gloo_exit)."""
    from oomless.parallel.process_group import guard_gloo_exit

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=JOIN_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            **({"timeout": timeout} if timeout is not None else {}))
    guard_gloo_exit()


def tiny_config(**overrides):
    from oomless.parallel import ParallelConfig
    from oomless.train import TrainConfig

    settings = dict(TINY)
    parallel = overrides.pop("parallel", {})
    settings.update(overrides)
    return TrainConfig(parallel=ParallelConfig(**parallel), **settings)


def _worker(rank: int, world_size: int, port: int, jobs: list[tuple[str, dict]], out_dir: str) -> None:
    torch.set_num_threads(1)
    join(rank, world_size, port)
    from oomless.errors import OomlessError
    from oomless.train import train

    results = {}
    try:
        for name, overrides in jobs:
            overrides = dict(overrides)
            tight = overrides.pop("plan_tight", None)
            cycle = overrides.pop("plan_cycle", None)
            expect_refusal = overrides.pop("expect_refusal", False)
            start_loss_scale_at(overrides.pop("initial_loss_scale", None))
            config = tiny_config(save=Path(out_dir) / f"{name}.safetensors", **overrides)
            try:
                if cycle is not None:
                    result, measured = _train_cycling(config, cycle)
                else:
                    result, measured = (train(config), {}) if tight is None else _train_tight(config, tight)
            except OomlessError as refusal:
                if not expect_refusal:
                    raise
                results[name] = {"error": type(refusal).__name__, "message": str(refusal),
                                 "minimum_bytes": getattr(refusal, "minimum_bytes", None)}
                continue
            results[name] = {"losses": [record["loss"] for record in result.history],
                             "steps_done": result.steps_done, "layouts": result.layouts,
                             "skipped_steps": result.skipped_steps,
                             # Graphs dynamo compiled in this process so far (all jobs before too).
                             "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                             **_parameter_elements(result.model), **measured}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"results-rank{rank}.json").write_text(json.dumps(results))


def start_loss_scale_at(scale: float | None) -> None:
    """fp16 runs in this process start from loss scale ``scale`` (None: GradScaler's 2**16). The
    training loop has no option for it; a test sets it high enough that the first steps overflow
    and are skipped, so that carrying the scale (checkpoints, layout switches) is visible."""
    from oomless.runtime.precision import LossScaler

    defaults = LossScaler.__init__.__defaults__
    LossScaler.__init__.__defaults__ = (2.0**16 if scale is None else float(scale), *defaults[1:])


def _parameter_elements(model) -> dict:
    """Elements of the model's parameters in all, and those this rank holds (its shards under fsdp)."""
    from torch.distributed.tensor import DTensor

    parameters = list(model.parameters())
    local = [(param.to_local() if isinstance(param, DTensor) else param).detach() for param in parameters]
    return {"parameter_elements": sum(param.numel() for param in parameters),
            "local_parameter_elements": sum(param.numel() for param in local),
            # This rank's parameters, bit for bit: replicas that should be one model compare equal.
            "parameter_digest": hashlib.sha256(b"".join(param.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                                                        for param in local)).hexdigest()}


def run_jobs(world_size: int, jobs: list[tuple[str, dict]], out_dir: Path) -> dict:
    """Run ``jobs`` (name, TrainConfig overrides; ``expect_refusal=True``: an oomless error is recorded
    as the job's result, {"error", "message", "minimum_bytes"}) in order on ``world_size`` processes;
    rank 0's results (every rank's: `results_of_rank`)."""
    with rendezvous() as port:
        mp.start_processes(_worker, args=(world_size, port, jobs, str(out_dir)), nprocs=world_size,
                           start_method="spawn")
    return results_of_rank(0, out_dir)


def results_of_rank(rank: int, out_dir: Path) -> dict:
    return json.loads(Path(out_dir, f"results-rank{rank}.json").read_text())


def _relaxed_worker(rank: int, world_size: int, port: int, modes: list[str], average_every: int, steps: int,
                    out_dir: str) -> None:
    """Train a small MLP with BatchNorm under each relaxed mode, every rank on its own data, and record
    after every step what the mode averages (`averaged_tensors`, flattened): right after this rank's
    optimizer step ("stepped"), and after the mode's step ("finished"); then once more after
    `synchronize` ("synchronized"). Rank 0 writes every rank's records to ``out_dir/<mode>.pt``."""
    from torch import nn

    from oomless.parallel import ParallelConfig, Ranks, make_strategy
    from oomless.parallel.relaxed import averaged_tensors

    torch.set_num_threads(1)
    join(rank, world_size, port)
    try:
        for mode in modes:
            strategy = make_strategy(ParallelConfig(mode=mode, average_every=average_every),
                                     Ranks(rank, world_size), torch.device("cpu"))
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            train_model = strategy.prepare(model, optimizer, None)

            def flat():
                return torch.cat([tensor.detach().reshape(-1).clone() for tensor in averaged_tensors(model)])

            stepped, finished = [], []
            optimizer.register_step_post_hook(lambda *_: stepped.append(flat()))
            inputs = torch.randn(steps, 16, 4, generator=torch.Generator().manual_seed(1 + rank))
            for step in range(steps):
                train_model(inputs[step]).square().mean().backward()
                strategy.step(model, optimizer, step)
                finished.append(flat())
            strategy.synchronize(model)
            record = {"stepped": torch.stack(stepped), "finished": torch.stack(finished), "synchronized": flat()}
            records = [None] * world_size
            dist.all_gather_object(records, record)
            if rank == 0:
                torch.save(records, Path(out_dir) / f"{mode}.pt")
    finally:
        dist.destroy_process_group()


def run_relaxed(world_size: int, modes: list[str], average_every: int, steps: int, out_dir: Path) -> dict:
    """{mode: [rank 0's records, rank 1's, ...]} of `_relaxed_worker`."""
    with rendezvous() as port:
        mp.start_processes(_relaxed_worker, args=(world_size, port, modes, average_every, steps, str(out_dir)),
                           nprocs=world_size, start_method="spawn")
    return {mode: torch.load(Path(out_dir) / f"{mode}.pt", weights_only=True) for mode in modes}


def _timeout_worker(rank: int, port: int, out_dir: str) -> None:
    import time

    from oomless.parallel.process_group import named_collective

    # Joining gets a generous timeout (a spawned process can take seconds to start on a loaded
    # machine); only the group the collective runs on has the 2 s one under test.
    join(rank, 2, port, timeout=timedelta(seconds=120))
    group = dist.new_group(ranks=[0, 1], timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(5)               # never joins the all-reduce: rank 0 must time out, not hang
        return
    try:
        with named_collective("test parameter all-reduce", 2):
            dist.all_reduce(torch.ones(4), group=group)
        message = "no error"
    except Exception as error:      # noqa: BLE001 - the test inspects whatever came out
        message = f"{type(error).__name__}: {error}"
    Path(out_dir, "error.txt").write_text(message)
    # A group whose collective timed out cannot be torn down cleanly: gloo's destructor aborts the
    # process ("terminate called without an active exception"). Leave without running it.
    os._exit(0)


def run_timeout(out_dir: Path) -> str:
    with rendezvous() as port:
        mp.start_processes(_timeout_worker, args=(port, str(out_dir)), nprocs=2, start_method="spawn")
    return Path(out_dir, "error.txt").read_text()


def _train_tight(config, cycle: list[str]):
    """``train(config)`` with the plan's decisions ``cycle`` repeated over the blocks in order, made
    for the smallest memory that plan fits from the run's own profile (tests/conftest.py
    `planner_forcing`; ``config.memory`` only switches oomless on; every rank installs rank 0's
    plan). Asserts on this rank that the plan was made for the modules that ran (under dp the loop
    converts BatchNorm to global-batch statistics before it plans: every planned block is a module
    of the model as it trained, with the plan's hooks on it), that the runtime did what the plan
    says, counted (every byte of the swapped blocks offloaded and every recomputed block run again,
    each step), and that the ledger stayed within the plan's activation budget; returns the result
    and those numbers."""
    import oomless
    from oomless.runtime.install import installed_state
    from oomless.train import train
    from tests.conftest import planner_forcing

    planning = oomless.plan
    oomless.plan = planner_forcing(cycle)          # the loop calls oomless.plan
    try:
        result = train(config)
    finally:
        oomless.plan = planning
    plan, stats = oomless.installed_plan(result.model), result.stats
    modules = dict(result.model.named_modules())
    hooked = {name: module for _, name, module in installed_state(result.model).block_modules}
    assert all(hooked[name] is modules[name] for name in plan.decisions), \
        [name for name in plan.decisions if hooked[name] is not modules[name]]
    swapped = [block.name for block in plan.blocks if block.decision == "swap" and block.saved_bytes]
    recomputed = [name for name, decision in plan.decisions.items() if decision == "recompute"]
    swapped_bytes = sum(block.saved_bytes for block in plan.blocks if block.decision == "swap")
    assert stats.offloaded_bytes == config.steps * swapped_bytes, (stats, swapped_bytes)
    assert stats.recomputed_blocks == config.steps * len(recomputed), (stats, recomputed)
    assert stats.peak_activation_bytes <= plan.activation_budget, (stats, plan.activation_budget)
    return result, {"memory_bytes": plan.memory_bytes, "activation_budget": plan.activation_budget,
                    "swapped": swapped, "recomputed": recomputed,
                    "peak_activation_bytes": stats.peak_activation_bytes, "offloaded_bytes": stats.offloaded_bytes,
                    "recomputed_blocks": stats.recomputed_blocks, "resident_peak_bytes": result.peak_memory_bytes}


def _train_cycling(config, cycle: list[str]):
    """``train(config)`` with the plan's decisions forced to ``cycle`` repeated over the blocks in order
    (e.g. ["recompute", "swap"]), swaps of any size; returns the result and what the runtime did."""
    import oomless
    from oomless.train import train

    planning = oomless.plan

    def plan(model, example_inputs, memory, **kwargs):
        made = planning(model, example_inputs, "1TiB", min_swap_bytes=0, **kwargs)
        return made.with_decisions({name: cycle[index % len(cycle)] for index, name in enumerate(made.decisions)})

    oomless.plan = plan
    try:
        result = train(config)
    finally:
        oomless.plan = planning
    stats = result.stats
    return result, {"offloaded_bytes": stats.offloaded_bytes, "recomputed_blocks": stats.recomputed_blocks,
                    "peak_activation_bytes": stats.peak_activation_bytes,
                    "decisions": oomless.installed_plan(result.model).decisions}


def _outcome_worker(rank: int, port: int, out_dir: str) -> None:
    """`first_rank_outcome` on 2 ranks: rank 0 refuses (a PlanError), then rank 1 alone refuses, then
    only rank 0 computes; what each call gave this rank, to ``out_dir/outcome-rank<i>.json``."""
    from oomless.errors import PlanError
    from oomless.parallel.process_group import first_rank_outcome, refusal_or

    def refuse():
        raise PlanError("no plan fits 1 byte", minimum_bytes=5 * 2**20, limiting_block="layers.0")

    join(rank, 2, port)
    records = []
    try:
        for refusing_rank in (0, 1):
            compute = refuse if rank == refusing_rank else (lambda: f"rank {rank}'s plan")
            try:
                records.append({"value": first_rank_outcome(refusal_or(compute))})
            except PlanError as refusal:
                records.append({"error": type(refusal).__name__, "message": str(refusal),
                                "minimum_bytes": refusal.minimum_bytes, "limiting_block": refusal.limiting_block,
                                "floor_block": refusal.floor_block})
        records.append({"value": first_rank_outcome("rank 0 alone" if rank == 0 else None)})
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"outcome-rank{rank}.json").write_text(json.dumps(records))


def run_outcomes(out_dir: Path) -> list[list[dict]]:
    with rendezvous() as port:
        mp.start_processes(_outcome_worker, args=(port, str(out_dir)), nprocs=2, start_method="spawn")
    return [json.loads(Path(out_dir, f"outcome-rank{rank}.json").read_text()) for rank in range(2)]
