"""Faults under data parallel: a SIGKILLed worker under ``torchrun --max-restarts 1`` costs no steps and
changes no weight; a collective that times out names the rank and the collective; uneven shards are
refused before any collective could hang; checkpoints hold every rank's RNG state."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from oomless.errors import InputError
from oomless.parallel import Ranks, shard_start
from oomless.parallel.process_group import local_batch_size
from oomless.train.checkpoint import latest_checkpoint
from tests.parallel_workers import run_timeout

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _torchrun(tmp_path: Path, name: str, kill_at: int | None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if kill_at:
        environment["OOMLESS_TEST_KILL_AT_STEP"] = str(kill_at)
        environment["OOMLESS_TEST_KILL_MARKER"] = str(tmp_path / f"{name}.killed")
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1",
               "--monitor-interval", "0.2", str(ROOT / "tests" / "parallel_kill_worker.py"),
               "--parallel", "dp", "--size", "16", "--base-channels", "2", "--depth", "1", "--global-batch", "4",
               "--steps", "8", "--device", "cpu", "--quiet", "--checkpoint-dir", str(tmp_path / name),
               "--resume", "--save", str(tmp_path / f"{name}.safetensors")]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed beside this Python")
def test_sigkilled_worker_restarts_from_checkpoint_with_same_steps_and_weights(tmp_path):
    uninterrupted = _torchrun(tmp_path, "uninterrupted", kill_at=None)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    killed = _torchrun(tmp_path, "killed", kill_at=5)
    assert killed.returncode == 0, killed.stderr[-2000:]
    # A worker really died (written right before its SIGKILL; torchrun logs only the first failure it
    # sees, which may be rank 0's failed collective) and the restarted attempt resumed, not began at 0.
    marker = tmp_path / "killed.killed"
    assert marker.exists(), "no worker was killed: the kill hook in tests/parallel_kill_worker.py never ran"
    assert marker.read_text().startswith("rank 1")
    assert "resumed from" in killed.stderr and "at step 4" in killed.stderr
    assert "done: 8 steps" in killed.stdout and "done: 8 steps" in uninterrupted.stdout
    first = load_file(str(tmp_path / "uninterrupted.safetensors"))
    second = load_file(str(tmp_path / "killed.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)
    # The checkpoint holds every rank's RNG (rank 0 at the top level, rank 1 under rank.1.).
    with safe_open(str(latest_checkpoint(tmp_path / "killed")), framework="pt") as handle:
        names = set(handle.keys())
    assert {"rng.torch", "rank.1.rng.torch"} <= names


def test_collective_timeout_names_rank_and_collective(tmp_path):
    message = run_timeout(tmp_path)
    assert message.startswith("CollectiveError")
    assert "rank 0 of 2" in message and "test parameter all-reduce" in message and "timeout 2 s" in message


def test_uneven_shards_are_refused_not_hung():
    with pytest.raises(InputError, match="does not split evenly over 2 processes"):
        local_batch_size(3, 2)
    # Equal shards laid end to end are the one-process global batch.
    starts = [shard_start(5, 8, Ranks(rank, 4)) for rank in range(4)]
    assert starts == [40, 42, 44, 46]
