"""The command line, run as a user runs it: ``python -m oomless`` in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oomless.cli.main import build_parser, main
from oomless.errors import InputError
from oomless.cli.train import config_from_args, parse_size

SOURCE = Path(__file__).resolve().parents[1] / "src"


def run_oomless(*arguments: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(SOURCE)}
    return subprocess.run([sys.executable, "-m", "oomless", *arguments], capture_output=True, text=True,
                          env=environment, cwd=cwd, timeout=120)


@pytest.mark.parametrize("arguments, message", [
    (("train", "--size", "20", "--steps", "1"), "divisible by 2**depth = 8"),
    (("train", "--size", "16", "--memory", "lots"), "memory size 'lots' does not parse"),
    (("train", "--model", "resnet"), "invalid choice: 'resnet'"),
    (("plan", "nope", "--memory", "1GiB"), "unknown model 'nope'"),
])
def test_bad_input_exits_2_with_one_line_and_no_traceback(arguments, message):
    completed = run_oomless(*arguments)
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], completed.stderr


def test_bad_input_in_process_exits_2(capsys):
    assert main(["train", "--size", "abc"]) == 2
    assert main(["plan", "mlp", "--memory", "1GiB", "--input-shape", "4,x"]) == 2
    assert main(["plan", "mlp", "--memory", "1GiB", "--model-arg", "=3"]) == 2
    assert main(["plan", "unet3d", "--memory", "1GiB", "--batch", "0"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 4 and all(line.startswith(("oomless train: error:", "oomless plan: error:")) for line in errors)
    assert "is not comma-separated integers" in errors[1]
    with pytest.raises(SystemExit) as exited:
        main(["train", "--steps", "many"])
    assert exited.value.code == 2


def test_train_flags_map_onto_the_config():
    args = build_parser().parse_args([
        "train", "--size", "32,48,64", "--memory", "1GiB", "--steps", "7", "--seed", "3", "--global-batch", "4",
        "--model", "monai-unet", "--checkpoint-dir", "ck", "--resume", "--device", "cpu", "--save", "w.safetensors",
        "--quiet",
    ])
    config = config_from_args(args)
    assert (config.size, config.memory, config.steps, config.seed, config.global_batch) == ((32, 48, 64), "1GiB", 7, 3, 4)
    assert (config.model, config.checkpoint_dir, config.resume, config.device, config.save) == (
        "monai-unet", "ck", True, "cpu", "w.safetensors")
    assert config.progress is False and parse_size("16") == 16


def test_train_saves_weights_and_reports(tmp_path):
    completed = run_oomless("train", "--size", "16", "--depth", "2", "--base-channels", "4", "--steps", "2",
                            "--device", "cpu", "--save", "out.safetensors", "--checkpoint-dir", "ck", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("done: 2 steps, loss ")
    assert "step 2/2" in completed.stderr
    weights = load_file(str(tmp_path / "out.safetensors"))
    assert "encoders.0.0.weight" in weights and all(torch.isfinite(tensor.float()).all() for tensor in weights.values())
    assert sorted(path.name for path in (tmp_path / "ck").iterdir()) == ["step-00000001.safetensors",
                                                                          "step-00000002.safetensors"]


def test_plan_prints_json():
    # Needs the oomless core (oomless.plan).
    completed = run_oomless("plan", "mlp", "--memory", "1GiB", "--batch", "4", "--json")
    assert completed.returncode == 0, completed.stderr
    plan = json.loads(completed.stdout)
    assert plan["memory_bytes"] == 1024**3
    # The default MLP is Linear, ReLU, Linear, ReLU, Linear: one block per Sequential item.
    assert [block["name"] for block in plan["blocks"]] == ["0", "1", "2", "3", "4"]
    assert {block["decision"] for block in plan["blocks"]} <= {"keep", "swap", "recompute"}


@pytest.mark.parametrize("flags", [(), ("--split", "off"), ("--target", "h100")])
def test_plan_plot_is_written_however_the_step_is_measured(flags, tmp_path):
    # With --split or --target the profile is measured first; the plot was then skipped, rc 0.
    # Into a folder that does not exist yet: the writer makes it (it raised FileNotFoundError after
    # printing the plan).
    path = tmp_path / "new" / "plan.png"
    completed = run_oomless("plan", "mlp", "--memory", "64MiB", "--batch", "4", *flags, "--plot", str(path))
    assert completed.returncode == 0, completed.stderr
    assert path.stat().st_size > 0 and f"written to {path}" in completed.stdout


def test_split_flag_chooses_chains_in_slabs(tmp_path):
    """`--split all` computes every chain in slabs, `off` none (`auto`, the default, only where no plan fits)."""
    common = ("plan", "unet3d", "--memory", "4GiB", "--size", "16", "--model-arg", "base_channels=4",
              "--model-arg", "depth=2", "--json")
    every = run_oomless(*common, "--split", "all")
    assert every.returncode == 0, every.stderr
    # The outer level streamed ("") and the chains below it split.
    assert set(json.loads(every.stdout)["split"]) == {"", "encoders.1", "encoders.2", "decoders.0"}
    none = run_oomless(*common, "--split", "off")
    assert none.returncode == 0, none.stderr
    assert json.loads(none.stdout)["split"] == {}
    args = build_parser().parse_args(["train", "--memory", "1GiB", "--split", "all"])
    assert config_from_args(args).split == "all"
    refused = run_oomless("train", "--size", "16", "--split", "all", "--steps", "1", cwd=tmp_path)
    assert refused.returncode == 2 and "--split all needs --memory" in refused.stderr
    args = build_parser().parse_args(["train", "--memory", "1GiB", "--split", "all", "--parallel", "dp"])
    with pytest.raises(InputError, match="global-batch statistics"):
        config_from_args(args).validate()
    trained = run_oomless("train", "--size", "16", "--depth", "2", "--base-channels", "4", "--steps", "2",
                          "--device", "cpu", "--memory", "2GiB", "--split", "all", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert trained.stdout.startswith("done: 2 steps, loss ")
