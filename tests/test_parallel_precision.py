"""bf16, fp16 and compile under the data-parallel layouts (``--parallel dp|fsdp``): gloo on CPU,
2 ranks, 4 Adam steps of the embedded 3D U-Net task at global batch 4, against the one-process run
(1 thread, as the workers) with the same global batch, precision and compile.

Tolerances, and why:
- fsdp against dp, same precision: 1e-5 absolute on every weight and buffer, as fsdp against one
  process in fp32 (tests/test_fsdp.py). Both ranks compute their half of the batch alike under either
  layout; the layouts differ in how the halves' gradients meet (DDP's all-reduce of gradients
  divided first, FSDP's reduce-scatter of sums divided after: the same for two ranks) and in
  where Adam updates (whole tensors, shards). Measured: bitwise.
- dp or fsdp against one process under bf16/fp16: 2e-3 relative L2 over the weights, 5e-4 over the
  BatchNorm running statistics, and each step's loss to 1e-3. Under autocast the weight gradient of
  a convolution is rounded to bf16 (fp16) as a sum over the rank's two volumes before the ranks
  average it in fp32, where one process rounds one sum over four: gradients differ by up to one
  rounding (2^-8 relative in bf16), and Adam's first steps move each weight by about the learning
  rate whatever its gradient's size, so near-zero gradients of other roundings move weights apart
  by up to 2e-3 absolute here. Measured: 8.8e-4 (bf16) and 7.7e-4 (fp16) on the weights, 1.7e-4
  and 1.4e-4 on the running statistics; before `GlobalBatchNorm` normalised bf16/fp16 inputs in
  fp32 (its sums were rounded to the input's dtype), 3.7e-3 and 1.2e-2 on the weights. And the run
  is closer to the one process of its precision than to the fp32 one (3.2e-3 bf16, 1.2e-3 fp16):
  it really ran in that precision.
- Bitwise where the arithmetic is the same: a plan's swap against keeping every block (fsdp bf16).

Also here: an overflow in one rank's shard skips the step on every rank (the vote of
`LossScaler.agreement_group`), and gradients are unscaled by FSDP's reduce-scatter when backward
returns, so clipping and logging see true gradients.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch import nn

from oomless.train import train
from tests.parallel_workers import join, rendezvous, run_jobs, tiny_config

GLOBAL_BATCH = 4
STEPS = 4
LAYOUT_TOLERANCE = 1e-5
AUTOCAST_WEIGHTS = 2e-3
AUTOCAST_STATISTICS = 5e-4
COMPILE = {"backend": "aot_eager"}


def _max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[name].double() - second[name].double()).abs().max().item() for name in first)


def _relative_l2(first: dict, second: dict, running_statistics: bool = False) -> float:
    """||first - second|| / ||second|| over the weights (or the BatchNorm running statistics)."""
    assert first.keys() == second.keys()
    names = [name for name in first if "num_batches" not in name and ("running_" in name) == running_statistics]
    difference = sum(((first[name].double() - second[name].double()) ** 2).sum() for name in names)
    return (difference / sum((second[name].double() ** 2).sum() for name in names)).sqrt().item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("parallel_precision")
    common = dict(steps=STEPS, global_batch=GLOBAL_BATCH)
    references = {"fp32": {}, "bf16": dict(precision="bf16"), "fp16": dict(precision="fp16"),
                  "bf16_compiled": dict(precision="bf16", compile=COMPILE)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # the workers run one thread; CPU kernels' sums depend on the split
    try:
        one_process = {name: train(tiny_config(save=directory / f"{name}.safetensors", **common, **overrides))
                       for name, overrides in references.items()}
    finally:
        torch.set_num_threads(threads)
    jobs = [(f"{layout}_{precision}", dict(common, precision=precision, parallel=dict(mode=layout)))
            for layout in ("dp", "fsdp") for precision in ("bf16", "fp16")]
    jobs += [
        # Every block swapped, at the smallest budget that plan fits for this rank's shard, in bf16.
        ("fsdp_bf16_swap", dict(common, precision="bf16", memory="1GiB", plan_tight=["swap"],
                                parallel=dict(mode="fsdp"))),
        ("fsdp_bf16_compiled", dict(common, precision="bf16", compile=COMPILE, parallel=dict(mode="fsdp"))),
    ]
    results = run_jobs(2, jobs, directory)
    saved = {name: load_file(str(directory / f"{name}.safetensors")) for name in [*references, *(n for n, _ in jobs)]}
    return one_process, results, saved


def test_bf16_and_fp16_under_dp_and_fsdp_equal_one_process(runs):
    one_process, results, saved = runs
    for precision in ("bf16", "fp16"):
        # The layouts against each other: the same arithmetic on each half of the batch.
        assert _max_difference(saved[f"fsdp_{precision}"], saved[f"dp_{precision}"]) <= LAYOUT_TOLERANCE, precision
        for layout in ("dp", "fsdp"):
            name = f"{layout}_{precision}"
            assert results[name]["steps_done"] == STEPS and results[name]["layouts"] == [[0, layout]], name
            weights = _relative_l2(saved[name], saved[precision])
            statistics = _relative_l2(saved[name], saved[precision], running_statistics=True)
            assert weights <= AUTOCAST_WEIGHTS and statistics <= AUTOCAST_STATISTICS, (name, weights, statistics)
            assert results[name]["losses"] == pytest.approx([r["loss"] for r in one_process[precision].history],
                                                            rel=1e-3), name
            # It really ran in that precision: nearer the one process of its precision than the fp32 one.
            assert _relative_l2(saved[name], saved["fp32"]) > weights, name
    # At this size nothing overflowed: the fp16 runs took every step, as one process did.
    assert results["fsdp_fp16"]["skipped_steps"] == results["dp_fp16"]["skipped_steps"] == \
        one_process["fp16"].skipped_steps == 0


def test_fsdp_bf16_composes_with_swap_plans_and_compiled_blocks(runs):
    _, results, saved = runs
    swapped = results["fsdp_bf16_swap"]
    assert swapped["offloaded_bytes"] > 0 and swapped["peak_activation_bytes"] <= swapped["activation_budget"]
    assert _max_difference(saved["fsdp_bf16_swap"], saved["fsdp_bf16"]) == 0.0       # swap is exact
    # Compiled blocks (aot_eager) under FSDP: the uncompiled fsdp run's arithmetic (aot_eager runs the
    # same aten ops), against the compiled one-process run as above.
    assert _max_difference(saved["fsdp_bf16_compiled"], saved["fsdp_bf16"]) <= LAYOUT_TOLERANCE
    assert _relative_l2(saved["fsdp_bf16_compiled"], saved["bf16_compiled"]) <= AUTOCAST_WEIGHTS
    assert results["fsdp_bf16_swap"]["compiled_graphs"] == 0 < results["fsdp_bf16_compiled"]["compiled_graphs"]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _overflow_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """fp16 under FSDP on an MLP: step 1 clean, step 2 with inf written into rank 1's shard of one
    gradient only, step 3 clean. Rank 0 writes what it saw."""
    from oomless.parallel.sharded import apply_fsdp
    from oomless.runtime.precision import apply_precision, precision_state

    torch.set_num_threads(1)
    join(rank, world_size, port)
    try:
        model = _mlp()
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        optimizer_before = torch.optim.SGD(model.parameters(), lr=0.1)
        apply_precision(model, "fp16", optimizer_before)
        before = dict(model.named_parameters())
        apply_fsdp(model, ["0", "2", "4"])
        from oomless.parallel.sharded import rebind_optimizer

        rebind_optimizer(optimizer_before, before, model)
        scaler = precision_state(model).scaler
        record = {"scales": [], "skipped": [], "changed": [], "gradient_ratio": None}
        for step in range(3):
            optimizer_before.zero_grad(set_to_none=True)
            model(inputs).square().mean().backward()
            if step == 0:
                # The true gradient when backward returns: the fp32 model's, within fp16's rounding
                # (a gradient still scaled would be 65536 times it).
                reference = _mlp()
                reference(inputs).square().mean().backward()
                dist.all_reduce(reference[0].weight.grad)
                true = reference[0].weight.grad / world_size
                record["gradient_ratio"] = (model[0].weight.grad.full_tensor().norm() / true.norm()).item()
            if step == 1 and rank == 1:
                model[2].weight.grad.to_local()[0, 0] = float("inf")
            weights = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
            optimizer_before.step()
            record["changed"].append(any(not torch.equal(weights[name], p.full_tensor())
                                         for name, p in model.named_parameters()))
            record["scales"].append(scaler.scale)
            record["skipped"].append(scaler.skipped_steps)
        if rank == 0:
            torch.save(record, f"{out_dir}/overflow.pt")
        # Every rank ends with the same record: each checks its own against rank 0's.
        gathered = [None] * world_size
        dist.all_gather_object(gathered, {k: record[k] for k in ("scales", "skipped", "changed")})
        assert gathered[0] == gathered[1], gathered
    finally:
        dist.destroy_process_group()


def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    with rendezvous() as port:
        mp.start_processes(_overflow_worker, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn")
    record = torch.load(tmp_path / "overflow.pt", weights_only=True)
    assert record["changed"] == [True, False, True]           # step 2 skipped, on rank 0 too
    assert record["skipped"] == [0, 1, 1]
    assert record["scales"] == [2.0**16, 2.0**15, 2.0**15]
    assert record["gradient_ratio"] == pytest.approx(1.0, rel=1e-2)


def test_fp16_after_a_callers_own_fully_shard_unscales_in_the_reduce_scatter(tmp_path):
    """One rank: the caller shards the model after oomless installed fp16; the first forward finds
    it and moves the unscaling into FSDP's reduce-scatter, and the gradients equal the unsharded
    model's, bitwise (one rank's reduce-scatter only divides)."""
    from torch.distributed.fsdp import fully_shard

    from oomless.runtime.precision import apply_precision, remove_precision

    inputs = torch.randn(8, 16)
    plain = _mlp()
    apply_precision(plain, "fp16", torch.optim.SGD(plain.parameters(), lr=0.1))
    plain(inputs).square().mean().backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _mlp()
        apply_precision(model, "fp16", torch.optim.SGD(model.parameters(), lr=0.1))
        for index in ("0", "2", "4"):
            fully_shard(model.get_submodule(index))
        fully_shard(model)
        model(inputs).square().mean().backward()
        for (name, expected), parameter in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(parameter.grad.full_tensor(), expected.grad), name
        # Removed: fp32 again, and FSDP's plain average (no division by the old scale left behind).
        remove_precision(model)
        for parameter in model.parameters():
            parameter.grad = None
        model(inputs).square().mean().backward()
        fp32 = _mlp()
        fp32(inputs).square().mean().backward()
        for (name, expected), parameter in zip(fp32.named_parameters(), model.parameters()):
            assert torch.equal(parameter.grad.full_tensor(), expected.grad), name
    finally:
        dist.destroy_process_group()
