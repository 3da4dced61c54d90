"""The collectives data parallel builds on: the differentiable cross-rank sum (its gradient under
gloo equals one process's autograd over every rank's inputs), and which GPU each local process
takes (never an ordinal that does not exist; more NCCL processes than GPUs refused before starting)."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oomless.errors import InputError
from oomless.parallel.process_group import cuda_device_for_local_rank, sum_across_ranks
from tests.parallel_workers import join, rendezvous

WORLD_SIZE = 3


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s input and the weights its loss puts on the global sum."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(4, generator=generator, dtype=torch.float64), torch.randn(4, generator=generator,
                                                                                 dtype=torch.float64)


def _loss(local: torch.Tensor, total: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # Reads both the rank's own input and the global sum, nonlinearly: the gradient has both parts.
    return (weights * total.sin()).sum() + local.square().sum() * total.sum()


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join(rank, world_size, port)
    try:
        values, weights = _inputs(rank)
        local = values.clone().requires_grad_()
        total = sum_across_ranks(local * 2.0)
        _loss(local, total, weights).backward()
        Path(out_dir, f"{rank}.json").write_text(json.dumps({"total": total.tolist(), "grad": local.grad.tolist()}))
    finally:
        dist.destroy_process_group()


def test_sum_across_ranks_gradient_equals_one_process_autograd(tmp_path):
    with rendezvous() as port:
        mp.start_processes(_worker, args=(WORLD_SIZE, port, str(tmp_path)), nprocs=WORLD_SIZE, start_method="spawn")
    # One process: every rank's input, the sum, and the sum of every rank's loss (what the ranks'
    # gradients add up to; DDP's average then divides by the world size).
    inputs = [_inputs(rank) for rank in range(WORLD_SIZE)]
    locals_ = [values.clone().requires_grad_() for values, _ in inputs]
    total = sum(local * 2.0 for local in locals_)
    sum(_loss(local, total, weights) for local, (_, weights) in zip(locals_, inputs)).backward()
    for rank, local in enumerate(locals_):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert torch.allclose(torch.tensor(result["total"], dtype=torch.float64), total.detach(), rtol=0, atol=1e-12)
        assert torch.allclose(torch.tensor(result["grad"], dtype=torch.float64), local.grad, rtol=0, atol=1e-12)


def test_each_local_process_takes_an_existing_gpu_and_nccl_never_shares_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_device_for_local_rank(0, 1) == torch.device("cuda", 0)
    with pytest.raises(InputError, match="2 processes on this machine need 2 GPUs under NCCL.*1 is visible"):
        cuda_device_for_local_rank(1, 2)
    # gloo may share a GPU; the ordinal still exists
    assert cuda_device_for_local_rank(1, 2, backend="gloo") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert cuda_device_for_local_rank(3, 4) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(InputError, match="sees no GPU"):
        cuda_device_for_local_rank(0, 1)
