"""The collectives data parallel builds on: the differentiable cross-rank sum (its gradient under
gloo equals one process's autograd over every rank's inputs), BatchNorm over every rank's shard
(`GlobalBatchNorm`: one process's BatchNorm on the whole batch, in one collective each way), and
which GPU each local process takes (never an ordinal that does not exist; more NCCL processes than
GPUs refused before starting)."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from oomless.errors import InputError
from oomless.parallel.batchnorm import convert_batchnorm_for_data_parallel
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


def _batchnorm_shard(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s input and output gradient: shards whose means differ by far more than their
    spread (where E[x^2] - E[x]^2 would cancel), a channel of constant value among them."""
    generator = torch.Generator().manual_seed(10 + rank)
    values = torch.randn(2, 3, 4, 4, 4, generator=generator) + torch.tensor([1000.0 * (rank + 1), -5.0, 0.0]).view(1, 3, 1, 1, 1)
    values[:, 2] = 7.0
    return values.to(dtype), torch.randn(2, 3, 4, 4, 4, generator=generator).to(dtype)


def _batchnorm_worker(rank: int, world_size: int, port: int, out_dir: str, dtype_name: str) -> None:
    join(rank, world_size, port)
    try:
        counts = {"all_gather": 0, "all_reduce": 0}
        for name in counts:
            original = getattr(dist, name)

            def counted(*args, name=name, original=original, **kwargs):
                counts[name] += 1
                return original(*args, **kwargs)

            setattr(dist, name, counted)
        torch.manual_seed(0)
        layer = nn.BatchNorm3d(3, momentum=0.3)
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-1, 1)
        convert_batchnorm_for_data_parallel(layer_holder := nn.Sequential(layer), torch.device("cpu"))
        values, gradient = _batchnorm_shard(rank, getattr(torch, dtype_name))
        values.requires_grad_()
        output = layer_holder(values)
        forward_counts = dict(counts)
        output.backward(gradient)
        bn = layer_holder[0]
        torch.save({"output": output.detach(), "grad": values.grad, "weight_grad": bn.weight.grad,
                    "bias_grad": bn.bias.grad, "running_mean": bn.running_mean, "running_var": bn.running_var,
                    "forward_counts": forward_counts, "counts": counts}, Path(out_dir, f"bn{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_global_batchnorm_equals_one_process_batchnorm_in_one_collective_each_way(dtype_name, tmp_path):
    """Two ranks' `GlobalBatchNorm` against torch's BatchNorm on both shards in one process: outputs,
    the input gradients (the loss is the sum of the ranks' losses), the weight and bias gradients
    (each rank its own shard's part; DDP averages them) and the running statistics, with one
    all-gather in forward and one all-reduce in backward. Shards 1000 apart in mean and a constant
    channel: a variance from sums of squares would lose them (fp32 has 24 bits)."""
    world_size, dtype = 2, getattr(torch, dtype_name)
    with rendezvous() as port:
        mp.start_processes(_batchnorm_worker, args=(world_size, port, str(tmp_path), dtype_name), nprocs=world_size,
                           start_method="spawn")
    torch.manual_seed(0)
    reference = nn.BatchNorm3d(3, momentum=0.3)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-1, 1)
    single = copy.deepcopy(reference)       # torch's own fp32 BatchNorm, for its rounding
    reference.double()          # the exact answer, nearly
    shards = [_batchnorm_shard(rank, dtype) for rank in range(world_size)]
    gradients = torch.cat([gradient for _, gradient in shards])
    values = torch.cat([shard for shard, _ in shards]).double().requires_grad_()
    output = reference(values)
    output.backward(gradients.double())
    values32 = values.detach().float().requires_grad_()
    output32 = single(values32)
    output32.backward(gradients.float())
    # fp32: no further from the exact answer than twice torch's own BatchNorm on the whole batch (its
    # CPU kernel's x * scale + (bias - mean * scale) is 1.6e-5 off on the constant channel).
    off = lambda ours, exact: (ours.double() - exact).abs().max().item()       # noqa: E731
    if dtype == torch.float32:
        output_tolerance = dict(rtol=0, atol=max(1e-6, 2 * off(output32.detach(), output.detach())))
        grad_tolerance = dict(rtol=0, atol=max(1e-6, 2 * off(values32.grad, values.grad)))
    else:
        output_tolerance = grad_tolerance = dict(rtol=1e-2, atol=1e-2)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    results = [torch.load(tmp_path / f"bn{rank}.pt", weights_only=True) for rank in range(world_size)]
    for rank, result in enumerate(results):
        assert result["forward_counts"] == {"all_gather": 1, "all_reduce": 0}
        assert result["counts"] == {"all_gather": 1, "all_reduce": 1}
        assert result["output"].dtype == result["grad"].dtype == dtype
        rows = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(result["output"].double(), output.detach()[rows], **output_tolerance)
        torch.testing.assert_close(result["grad"].double(), values.grad[rows], **grad_tolerance)
        torch.testing.assert_close(result["running_mean"].double(), reference.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result["running_var"].double(), reference.running_var, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(result["weight_grad"] for result in results).double(), reference.weight.grad,
                               **tolerance)
    torch.testing.assert_close(sum(result["bias_grad"] for result in results).double(), reference.bias.grad, **tolerance)


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
