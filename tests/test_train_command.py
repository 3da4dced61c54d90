"""`oomless simulate`'s "run it" line: the `oomless train` command of the recommended layout, read
back by the trainer's own parser into the config it would run, and no command where the trainer
cannot train the step simulated."""

import json
import shlex

import pytest
import torch

import oomless
from oomless.cli.main import build_parser, main
from oomless.cli.train import config_from_args
from oomless.cli.train_command import memory_flag, train_command
from oomless.models import UNet3D
from oomless.plan.cluster import make_cluster
from oomless.plan.devices import find_device
from oomless.plan.layouts import estimate_data_parallel, estimate_fsdp, estimate_pipeline
from oomless.profile.fake import profile_for_target
from oomless.sizes import parse_bytes

SHAPE = (2, 1, 32, 32, 32)


def trainer_config(command: str):
    """The `TrainConfig` the trainer would run from ``command``, and the launcher's arguments."""
    tokens = shlex.split(command)
    if tokens[0] == "oomless":
        launcher, arguments = [], tokens[1:]
    else:
        start = tokens.index("-m")
        assert tokens[start + 1] == "oomless"
        launcher, arguments = tokens[:start], tokens[start + 2:]
    return config_from_args(build_parser().parse_args(arguments)), launcher


@pytest.fixture(scope="module")
def unet_profile():
    with torch.device("meta"):
        model = UNet3D(base_channels=4, depth=2)
    volumes = torch.zeros(SHAPE, device="meta")
    return profile_for_target(model, volumes, "h100", loss_fn=oomless.sum_of_outputs,
                              optimizer=torch.optim.Adam(model.parameters()))


def test_each_layout_becomes_the_trainer_config_that_runs_it(unet_profile):
    h100 = find_device("h100")
    model_kwargs = {"base_channels": 4, "depth": 2}
    four = make_cluster("h100", 4, 1)
    hybrid = estimate_pipeline(unet_profile, four, 8, 2, 2, "zbv")
    assert hybrid.layout == "hybrid" and hybrid.fits
    config, launcher = trainer_config(train_command("unet3d", model_kwargs, SHAPE, 8, 4, 1, h100.memory_bytes,
                                                    hybrid, precision="bf16"))
    assert launcher == ["torchrun", "--standalone", "--nproc-per-node", "4"]
    parallel = config.parallel
    assert (parallel.mode, parallel.stages, parallel.schedule, parallel.microbatches) == \
        ("hybrid", 2, "zbv", hybrid.microbatches)
    assert parallel.resolved_stages_per_rank == 2
    assert (config.model, config.size, config.channels, config.base_channels, config.depth) == \
        ("unet3d", 32, 1, 4, 2)
    assert config.global_batch == 8 and config.precision == "bf16" and config.device == "cuda"
    assert parse_bytes(config.memory) == h100.memory_bytes

    pipeline = estimate_pipeline(unet_profile, make_cluster("h100", 2, 1), 8, 2, 2, "1f1b")
    config, _ = trainer_config(train_command("unet3d", model_kwargs, SHAPE, 8, 2, 1, h100.memory_bytes, pipeline))
    assert (config.parallel.mode, config.parallel.schedule, config.parallel.resolved_stages_per_rank) == \
        ("pipeline", "1f1b", 1)
    assert config.precision == "fp32"

    fsdp = estimate_fsdp(unet_profile, four, 2)
    config, launcher = trainer_config(train_command("unet3d", model_kwargs, SHAPE, 8, 4, 1, h100.memory_bytes, fsdp))
    assert config.parallel.mode == "fsdp" and launcher[-1] == "4"
    one = estimate_data_parallel(unet_profile, make_cluster("h100", 1, 1), 8)
    command = train_command("unet3d", model_kwargs, SHAPE, 8, 1, 1, h100.memory_bytes, one)
    config, launcher = trainer_config(command)
    assert command.startswith("oomless train") and launcher == [] and config.parallel.mode == "none"

    # Two nodes: torchrun's rendezvous on the first node, its address left for the shell.
    sixteen = make_cluster("h100", 16, 2)
    dp = estimate_data_parallel(unet_profile, sixteen, 1)
    command = train_command("unet3d", model_kwargs, SHAPE, 16, 16, 2, h100.memory_bytes, dp)
    assert " --rdzv-endpoint $HEAD_NODE:29500 " in command
    config, launcher = trainer_config(command.replace("$HEAD_NODE", "node0"))
    assert launcher[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"] and config.parallel.mode == "dp"
    # A side per axis where they differ.
    config, _ = trainer_config(train_command("unet3d", {}, (1, 2, 32, 64, 64), 8, 1, 1, h100.memory_bytes, one))
    assert config.size == (32, 64, 64) and config.channels == 2 and config.base_channels == 8 and config.depth == 3


def test_no_command_where_the_trainer_cannot_train_the_step_simulated(unet_profile):
    one = estimate_data_parallel(unet_profile, make_cluster("h100", 1, 1), 8)
    memory = find_device("h100").memory_bytes
    assert train_command("unet3d", {}, SHAPE, 8, 1, 1, memory, one) is not None
    assert train_command("transformer", {}, (1, 128), 8, 1, 1, memory, one) is None
    assert train_command("unet3d", {"out_channels": 4}, SHAPE, 8, 1, 1, memory, one) is None     # 2 classes only
    assert train_command("unet3d", {}, SHAPE, 8, 1, 1, memory, one, optimizer="sgd") is None     # Adam only
    assert train_command("unet3d", {}, SHAPE, 8, 1, 1, memory, one, dtype="bf16") is None
    assert train_command("unet3d", {}, SHAPE, 8, 1, 1, memory, None) is None


def test_memory_is_written_in_the_unit_it_is_whole_in():
    assert [memory_flag(size) for size in (80 * 2**30, 80 * 10**9, 96 * 2**20, 5 * 10**6, 12345)] == \
        ["80GiB", "80GB", "96MiB", "5MB", "12345"]
    for size in (80 * 2**30, 80 * 10**9, 96 * 2**20, 5 * 10**6, 12345):
        assert parse_bytes(memory_flag(size)) == size


def test_simulate_prints_the_command_of_its_recommended_layout(capsys):
    arguments = ["simulate", "unet3d", "--input-shape", "2,1,32,32,32", "--global-batch", "8", "--gpus", "4",
                 "--model-arg", "base_channels=4", "--model-arg", "depth=2"]
    assert main([*arguments, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    best = next(layout for layout in result["layouts"] if layout["name"] == result["recommended"])
    config, launcher = trainer_config(result["train_command"])
    assert launcher[-1] == "4" and config.global_batch == 8
    expected_mode = best["layout"]
    assert config.parallel.mode == expected_mode
    assert main(arguments) == 0
    assert f"run it: {result['train_command']}" in capsys.readouterr().out.splitlines()
    assert main(["simulate", "transformer", "--input-shape", "2,32", "--global-batch", "8", "--gpus", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["train_command"] is None
