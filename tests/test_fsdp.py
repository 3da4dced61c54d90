"""Sharded data parallel (``--parallel fsdp``, FSDP2 per block then the root) equals one process:
gloo on CPU, 2 ranks, 4 Adam steps of the embedded 3D U-Net task at global batch 4, against the
one-process run (1 thread, as the workers) with the same global batch.

Stated tolerance, as for dp (tests/test_parallel_equality.py): 1e-5 absolute on every weight,
buffer (BatchNorm running statistics) and Adam moment; the gradient is a sum of per-shard sums and
the BatchNorm / Dice statistics sums over ranks, so float addition order differs from one process
(measured ~1e-7). Bitwise where the arithmetic is the same: one rank against one process, and a run
resumed from its own fsdp checkpoint against the run that was not interrupted.

Also here: the static bytes a sharded plan counts, and the combinations refused before any step.
bf16, fp16 and compile under fsdp: tests/test_parallel_precision.py.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import oomless
from oomless.errors import InputError
from oomless.parallel import ParallelConfig
from oomless.plan.static import SHARDED_BLOCKS_UNSHARDED, sharded_device_bytes
from oomless.train import train
from oomless.train.checkpoint_files import read_checkpoint_file
from tests.parallel_workers import run_jobs, tiny_config

GLOBAL_BATCH = 4
STEPS = 4
TOLERANCE = 1e-5


def _max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    assert all(first[name].shape == second[name].shape and first[name].dtype == second[name].dtype for name in first)
    return max((first[name].double() - second[name].double()).abs().max().item() for name in first)


def _last_checkpoint(directory) -> tuple[dict, dict]:
    path = sorted(directory.glob("step-*.safetensors"))[-1]
    return read_checkpoint_file(path)


def _optimizer_tensors(tensors: dict) -> dict:
    return {name: tensor for name, tensor in tensors.items() if name.startswith("optimizer.")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process references and every 2-rank fsdp job, run once for the tests below."""
    directory = tmp_path_factory.mktemp("fsdp")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # the workers run one thread; CPU kernels' sums depend on the split
    try:
        common = dict(steps=STEPS, global_batch=GLOBAL_BATCH)
        train(tiny_config(save=directory / "reference.safetensors", checkpoint_dir=directory / "reference", **common))
        train(tiny_config(save=directory / "reference_clipped.safetensors", max_grad_norm=0.05, **common))
    finally:
        torch.set_num_threads(threads)
    fsdp = dict(mode="fsdp")
    half = dict(common, steps=STEPS // 2)
    jobs = [
        ("fsdp", dict(common, checkpoint_dir=directory / "fsdp", parallel=fsdp)),
        # Clipping by global norm: the norm of DTensor gradients covers every rank's shard.
        ("fsdp_clipped", dict(common, max_grad_norm=0.05, parallel=fsdp)),
        # Every block swapped, under the smallest budget that plan fits, made for this rank's shard
        # (tests/parallel_workers.py asserts the runtime moved what the plan says, within its budget).
        ("fsdp_swap", dict(common, memory="1GiB", plan_tight=["swap"], parallel=fsdp)),
        # Recompute and swap in alternate blocks: non-reentrant checkpoint inside FSDP's hooks.
        ("fsdp_recompute", dict(common, memory="1GiB", plan_cycle=["recompute", "swap"], parallel=fsdp)),
        # Interrupted after 2 steps, resumed to 4 (under fsdp, and across layouts both ways).
        ("fsdp_half", dict(half, checkpoint_dir=directory / "resumed", parallel=fsdp)),
        ("fsdp_resumed", dict(common, checkpoint_dir=directory / "resumed", resume=True, parallel=fsdp)),
        ("dp_half", dict(half, checkpoint_dir=directory / "dp_to_fsdp", parallel=dict(mode="dp"))),
        ("fsdp_from_dp", dict(common, checkpoint_dir=directory / "dp_to_fsdp", resume=True, parallel=fsdp)),
        ("fsdp_half_for_dp", dict(half, checkpoint_dir=directory / "fsdp_to_dp", parallel=fsdp)),
        ("dp_from_fsdp", dict(common, checkpoint_dir=directory / "fsdp_to_dp", resume=True, parallel=dict(mode="dp"))),
    ]
    results = run_jobs(2, jobs, directory)
    saved = {name: load_file(str(directory / f"{name}.safetensors"))
             for name in ["reference", "reference_clipped"] + [name for name, _ in jobs]}
    return directory, results, saved


def test_fsdp_equals_one_process_parameters_buffers_and_optimizer_state(runs):
    directory, results, saved = runs
    assert all(results[name]["steps_done"] == STEPS and results[name]["layouts"] == [[0, "fsdp"]]
               for name in ("fsdp", "fsdp_clipped", "fsdp_swap", "fsdp_recompute"))
    # Rank 0 holds about half of every parameter (dim 0 split in two, rounded up), plus nothing else.
    held = results["fsdp"]["local_parameter_elements"] / results["fsdp"]["parameter_elements"]
    assert 0.5 <= held < 0.6, held
    assert any("running_mean" in name for name in saved["fsdp"])        # buffers are compared too
    assert _max_difference(saved["fsdp"], saved["reference"]) <= TOLERANCE
    assert _max_difference(saved["fsdp_clipped"], saved["reference_clipped"]) <= TOLERANCE
    # The clip changed the trajectory, so the clipped comparison tested something.
    assert _max_difference(saved["reference_clipped"], saved["reference"]) > 10 * TOLERANCE

    # The fsdp checkpoint holds full tensors in the file format of one process: the same names (plus
    # rank 1's RNG), the same optimizer groups, Adam's moments equal to the reference's.
    meta, tensors = _last_checkpoint(directory / "fsdp")
    reference_meta, reference_tensors = _last_checkpoint(directory / "reference")
    assert meta["step"] == reference_meta["step"] == STEPS
    assert {name for name in tensors if not name.startswith("rank.1.")} == set(reference_tensors)
    assert {name for name in tensors if name.startswith("rank.1.")} == {"rank.1.rng.torch", "rank.1.rng.numpy.keys"}
    assert meta["optimizer"] == reference_meta["optimizer"]
    optimizer_state, reference_state = _optimizer_tensors(tensors), _optimizer_tensors(reference_tensors)
    assert any(name.endswith("exp_avg_sq") for name in optimizer_state)
    assert _max_difference(optimizer_state, reference_state) <= TOLERANCE
    assert torch.equal(tensors["optimizer.state.0.step"], reference_tensors["optimizer.state.0.step"])


def test_fsdp_composes_with_swap_and_recompute_plans(runs):
    _, results, saved = runs
    swapped, mixed = results["fsdp_swap"], results["fsdp_recompute"]
    assert swapped["offloaded_bytes"] > 0 and swapped["peak_activation_bytes"] <= swapped["activation_budget"]
    assert set(mixed["decisions"].values()) == {"recompute", "swap"}
    assert mixed["recomputed_blocks"] > 0 and mixed["offloaded_bytes"] > 0, mixed
    for name in ("fsdp_swap", "fsdp_recompute"):
        assert _max_difference(saved[name], saved["reference"]) <= TOLERANCE, name
    # Same arithmetic as the plain fsdp run (swap and recompute are exact): bitwise.
    assert _max_difference(saved["fsdp_recompute"], saved["fsdp"]) == 0.0
    assert _max_difference(saved["fsdp_swap"], saved["fsdp"]) == 0.0


def test_fsdp_checkpoints_resume_under_fsdp_and_across_layouts(runs):
    _, results, saved = runs
    assert results["fsdp_resumed"]["layouts"] == [[STEPS // 2, "fsdp"]]
    assert _max_difference(saved["fsdp_resumed"], saved["fsdp"]) == 0.0
    assert _max_difference(saved["fsdp_from_dp"], saved["reference"]) <= TOLERANCE
    assert _max_difference(saved["dp_from_fsdp"], saved["reference"]) <= TOLERANCE
    assert results["dp_from_fsdp"]["layouts"] == [[STEPS // 2, "dp"]]


def test_fsdp_without_torchrun_is_one_rank_and_bitwise_the_plain_run(tmp_path):
    train(tiny_config(steps=2, global_batch=2, save=tmp_path / "plain.safetensors"))
    train(tiny_config(steps=2, global_batch=2, save=tmp_path / "alone.safetensors", parallel=dict(mode="fsdp")))
    plain, alone = load_file(str(tmp_path / "plain.safetensors")), load_file(str(tmp_path / "alone.safetensors"))
    assert _max_difference(plain, alone) == 0.0
    assert not torch.distributed.is_initialized()


def _mlp() -> nn.Module:
    # Blocks: the layers of the Sequential; the root's own parameter is `scale`.
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            hidden = [layer for _ in range(4) for layer in (nn.Linear(64, 64), nn.ReLU())]
            self.layers = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), *hidden, nn.Linear(64, 3))
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, inputs):
            return self.layers(inputs) * self.scale

    torch.manual_seed(0)
    return Model()


def test_a_sharded_plan_counts_one_ranks_shard_and_two_blocks_unsharded():
    model, inputs = _mlp(), torch.randn(8, 16)
    optimizer = torch.optim.Adam(model.parameters())
    whole = oomless.plan(model, inputs, "1GiB", optimizer=optimizer, loss_fn=oomless.sum_of_outputs)
    sharded = oomless.plan(model, inputs, "1GiB", optimizer=optimizer, loss_fn=oomless.sum_of_outputs, shard_over=4)
    blocks = [block.name for block in sharded.blocks]
    assert blocks == [f"layers.{index}" for index in range(11)]
    # By hand, in float32 elements: Linear(16, 64) 1088, 4 x Linear(64, 64) 4160, Linear(64, 3) 195,
    # scale 3 (the root's). Shards of dim 0 over 4 ranks, rounded up: 16x16+16, 4 x (16x64+16),
    # 1x64+1, 1 (3 / 4 rounded up). Unsharded: the root's 3 and the two largest blocks'.
    shard = (16 * 16 + 16) + 4 * (16 * 64 + 16) + (1 * 64 + 1) + 1
    unsharded = 3 + SHARDED_BLOCKS_UNSHARDED * 4160
    parts = {part.name: part for part in sharded.static_parts}
    assert parts["parameters"].total_bytes == 4 * (1088 + 4 * 4160 + 195 + 3) > 4 * (shard + unsharded)
    assert parts["parameters"].device_bytes == 4 * (shard + unsharded)
    assert parts["gradients"].device_bytes == 4 * (shard + unsharded)
    assert parts["optimizer state"].device_bytes == 2 * 4 * shard            # Adam: two moments
    assert "sharded over 4 ranks" in parts["parameters"].where
    whole_static = sum(part.device_bytes for part in whole.static_parts)
    assert sum(part.device_bytes for part in sharded.static_parts) < whole_static
    assert sharded.static_bytes < whole.static_bytes and sharded.shard_over == 4 and whole.shard_over == 1
    assert oomless.Plan.from_json(sharded.to_json()).shard_over == 4
    assert sharded_device_bytes(model, oomless.profile(model, inputs, optimizer=optimizer, loss_fn=oomless.sum_of_outputs), 1)[2] == \
        parts["optimizer state"].total_bytes                    # one rank: everything, never more


@pytest.mark.parametrize("option", ["update_in_backward", "offload_optimizer_state", "offload_parameters"])
def test_a_sharded_plan_refuses_moving_what_fsdp_owns(option):
    model, inputs = _mlp(), torch.randn(8, 16)
    with pytest.raises(InputError, match=f"{option}=True is not possible: .*sharded over 2 ranks"):
        oomless.plan(model, inputs, "1GiB", optimizer=torch.optim.Adam(model.parameters()), shard_over=2, loss_fn=oomless.sum_of_outputs,
                     **{option: True})


@pytest.mark.parametrize("overrides, named", [
    (dict(parallel=dict(mode="fsdp", switch=[(2, "dp")])), "switching layout to or from fsdp"),
    (dict(parallel=dict(mode="dp", switch=[(2, "fsdp")])), "switching layout to or from fsdp"),
    (dict(parallel=dict(mode="hybrid", stages=2, switch_when=[("loss<0.5", "fsdp")])), "switching layout"),
])
def test_fsdp_refuses_what_does_not_compose_before_any_step(overrides, named):
    overrides.setdefault("parallel", dict(mode="fsdp"))
    with pytest.raises(InputError, match=named) as refused:
        tiny_config(**overrides).validate()
    assert "fsdp" in str(refused.value)


def test_cli_accepts_parallel_fsdp():
    from oomless.cli.main import build_parser

    args = build_parser().parse_args(["train", "--parallel", "fsdp", "--size", "16"])
    assert args.parallel == "fsdp"
    assert ParallelConfig(mode="fsdp").validate().sharded


def test_apply_fsdp_shards_each_block_with_parameters_and_then_the_root(tmp_path):
    """`apply_fsdp` makes each named block holding parameters its own FSDP2 unit, and the root one
    too, so that parameters outside every block (the root's `scale`) are sharded and their gradients
    reduced like the rest. One rank of gloo, in this process."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from oomless.parallel.sharded import apply_fsdp

    model = _mlp()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = apply_fsdp(model, [f"layers.{index}" for index in range(11)])
        assert sharded == [f"layers.{index}" for index in range(0, 11, 2)]
        assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
        assert not isinstance(model.layers[1], FSDPModule)         # a ReLU: nothing to shard
        assert all(isinstance(parameter, DTensor) for parameter in model.parameters())
        model(torch.randn(8, 16)).sum().backward()
        assert isinstance(model.scale.grad, DTensor) and model.scale.grad.abs().sum() > 0
    finally:
        torch.distributed.destroy_process_group()
