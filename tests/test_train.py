"""The training loop: finite and falling loss, bitwise resume, safetensors outputs, refusals."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oomless.errors import InputError, SizeError
from oomless.models import TinyTransformer
from oomless.train import TrainConfig, latest_checkpoint, load_checkpoint, save_checkpoint, save_weights, train
from oomless.train.checkpoint import list_checkpoints
from oomless.train.losses import hard_dice, segmentation_loss
from tests.conftest import planner_forcing


def _config(**overrides) -> TrainConfig:
    settings = dict(size=16, steps=3, seed=0, global_batch=2, base_channels=4, depth=2, progress=False, device="cpu")
    settings.update(overrides)
    return TrainConfig(**settings)


def _assert_state_equal(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    different = [name for name in first if not torch.equal(first[name], second[name])]
    assert not different, f"differ: {different}"


def test_plain_training_gives_finite_falling_loss():
    result = train(_config(steps=6, log_every=1))
    assert result.steps_done == 6 and not result.oomless_applied and result.stats is None
    losses = [record["loss"] for record in result.history]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]
    assert 0.0 <= result.final_dice <= 1.0
    # Peak memory is resident memory above the loop's start: at this tiny size, in a test process
    # whose heap already holds freed pages from earlier tests, it can be 0; never negative.
    assert result.peak_memory_bytes >= 0 and result.volumes_per_second > 0
    assert result.voxels_per_second == pytest.approx(result.volumes_per_second * 16**3)


def test_same_seed_same_weights():
    first, second = train(_config(steps=2)), train(_config(steps=2))
    _assert_state_equal(first.model.state_dict(), second.model.state_dict())


def test_resume_after_a_crash_equals_an_uninterrupted_run_bitwise(tmp_path):
    uninterrupted = train(_config(steps=4, checkpoint_dir=tmp_path / "a"))
    # "Crash" after 2 steps: the second run stops there, the third resumes from its last checkpoint.
    train(_config(steps=2, checkpoint_dir=tmp_path / "b"))
    resumed = train(_config(steps=4, checkpoint_dir=tmp_path / "b", resume=True, log_every=1))
    assert [record["step"] for record in resumed.history] == [3, 4]
    _assert_state_equal(uninterrupted.model.state_dict(), resumed.model.state_dict())
    assert resumed.final_loss == uninterrupted.final_loss
    # Model, optimizer and RNG; not the log's sums (the runs log every 10 steps and every step).
    optimizer_a = {name: tensor for name, tensor in load_file(str(latest_checkpoint(tmp_path / "a"))).items()
                   if not name.startswith("log.")}
    optimizer_b = load_file(str(latest_checkpoint(tmp_path / "b")))
    _assert_state_equal(optimizer_a, optimizer_b)


def test_a_finished_run_resumed_plans_nothing_and_saves_its_weights(tmp_path, monkeypatch):
    """Resumed at its last step (or with --steps 0) a run has no step to train: it does not plan (a
    profile of steps, minutes for a large model; before, it planned and printed "loss nan"), the weights
    it saves are the checkpoint's, and the CLI says there was nothing to train."""
    finished = train(_config(steps=2, checkpoint_dir=tmp_path / "run", memory="1GiB"))
    import oomless.train.loop as loop

    def no_planning(*args, **kwargs):
        raise AssertionError("planned a run with no step to train")
    monkeypatch.setattr(loop, "_apply_oomless", no_planning)
    again = train(_config(steps=2, checkpoint_dir=tmp_path / "run", memory="1GiB", resume=True,
                          save=tmp_path / "again.safetensors"))
    assert again.steps_done == 2 and again.seconds_per_step is None and again.history == []
    _assert_state_equal(finished.model.state_dict(), load_file(str(tmp_path / "again.safetensors")))
    monkeypatch.undo()
    said = subprocess.run([sys.executable, "-m", "oomless", "train", "--size", "16", "--depth", "2",
                           "--base-channels", "4", "--global-batch", "2", "--steps", "2", "--device", "cpu",
                           "--checkpoint-dir", str(tmp_path / "run"), "--resume"],
                          capture_output=True, text=True, timeout=120)
    assert said.returncode == 0, said.stderr[-2000:]
    assert "done: no step to train, the run is at step 2 of --steps 2" in said.stdout and "nan" not in said.stdout


def test_checkpoints_are_rotated_and_leave_no_temporaries(tmp_path):
    train(_config(steps=5, checkpoint_dir=tmp_path, checkpoint_every=2, keep_checkpoints=2))
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4, 5]     # every 2 steps, and the last
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000004.safetensors", "step-00000005.safetensors"]
    # A write that died half way leaves a temporary, which resume must never pick up.
    (tmp_path / ".step-00000009.safetensors.abc.tmp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step-00000005.safetensors"


def test_resume_refuses_a_checkpoint_from_different_settings(tmp_path):
    train(_config(steps=1, checkpoint_dir=tmp_path))
    with pytest.raises(InputError, match="seed 0 -> 1"):
        train(_config(steps=2, seed=1, checkpoint_dir=tmp_path, resume=True))


def test_save_writes_the_final_state_dict_as_safetensors(tmp_path):
    path = tmp_path / "out" / "final.safetensors"
    result = train(_config(steps=1, save=path))
    _assert_state_equal(load_file(str(path)), result.model.state_dict())
    assert list(path.parent.iterdir()) == [path]


def test_checkpoint_round_trip_with_tied_weights_and_dropout_rng(tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=16, dim=8, depth=1, heads=2, max_len=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 16, (2, 4))).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, model, optimizer, step=1, data_position=2)
    expected_draw = torch.rand(3)

    torch.manual_seed(99)
    restored = TinyTransformer(vocab_size=16, dim=8, depth=1, heads=2, max_len=4)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    state = load_checkpoint(path, restored, restored_optimizer)
    assert (state.step, state.data_position) == (1, 2)
    assert torch.equal(torch.rand(3), expected_draw)                 # RNG continues where it was saved
    assert restored.head.weight is restored.token_embedding.weight   # loading kept the tie
    _assert_state_equal(model.state_dict(), restored.state_dict())
    for before, after in zip(optimizer.state.values(), restored_optimizer.state.values()):
        _assert_state_equal(before, after)
    assert restored_optimizer.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]
    weights = load_file(str(save_weights(tmp_path / "tied.safetensors", model)))
    assert torch.equal(weights["head.weight"], weights["token_embedding.weight"])


def test_config_validation_names_the_problem():
    with pytest.raises(InputError, match="divisible by 2\\*\\*depth = 4"):
        _config(size=18).validate()
    with pytest.raises(SizeError, match="does not parse"):
        _config(memory="lots").validate()
    with pytest.raises(InputError, match="unknown model"):
        _config(model="resnet").validate()
    with pytest.raises(InputError, match="checkpoint directory"):
        _config(resume=True).validate()


def test_losses_on_a_perfect_prediction():
    labels = torch.zeros(1, 4, 4, 4, dtype=torch.long)
    labels[0, 1:3, 1:3, 1:3] = 1
    logits = torch.stack([(labels == 0).float(), (labels == 1).float()], dim=1) * 20
    assert hard_dice(logits, labels).item() == 1.0
    assert segmentation_loss(logits, labels).item() < 1e-3
    empty = torch.zeros_like(labels)
    assert hard_dice(torch.stack([torch.ones(1, 4, 4, 4), torch.zeros(1, 4, 4, 4)], dim=1), empty).item() == 1.0


def test_the_steps_hard_dice_counts_a_batch_in_small_slabs_exactly():
    # The step takes it beside the loss, where a plan holds the most and counts nothing for it: the
    # demo's batch (2 x 64^3) rose 9-13 MiB with slabs of 2**20 voxels, which went over its budget.
    from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system
    from oomless.train.losses import dice_per_class, predicted_class

    torch.manual_seed(0)
    logits = torch.randn(2, 2, 64, 64, 64)
    labels = (torch.rand(2, 64, 64, 64) > 0.5).long()
    whole = dice_per_class(predicted_class(logits), labels, 2).mean()
    hard_dice(logits[:, :, :8], labels[:, :8])     # first calls' one-time costs (kernels' caches) not counted
    return_freed_memory_to_the_system()
    reset_peak_rss()
    baseline = current_rss_bytes()
    in_slabs = hard_dice(logits, labels)
    rise = peak_rss_bytes() - baseline
    assert torch.equal(in_slabs, whole)
    assert rise < 2 * 2**20, f"hard_dice rose {rise / 2**20:.1f} MiB"


def test_training_under_a_memory_budget_matches_plain_pytorch(monkeypatch):
    # Needs the oomless core (oomless.fit, oomless.stats). A budget changes where activations live,
    # never the math: the weights after training must be the plain run's, bit for bit.
    import oomless

    plain = train(_config(steps=2))
    roomy = train(_config(steps=2, memory="1GiB"))
    assert roomy.oomless_applied and roomy.stats is not None
    assert set(oomless.installed_plan(roomy.model).decisions.values()) == {"keep"}
    assert roomy.stats.offloaded_bytes == 0 and roomy.stats.recomputed_blocks == 0
    _assert_state_equal(plain.model.state_dict(), roomy.model.state_dict())
    # A tight budget for a plan no measurement picks (see planner_forcing): blocks swapped, recomputed
    # and kept in turn, with the smallest memory that plan fits. The loop plans with it; ``memory``
    # only switches oomless on.
    planner = planner_forcing(["swap", "recompute", "keep"])
    monkeypatch.setattr(oomless, "plan", planner)
    tight = train(_config(steps=2, memory="1GiB"))
    [(plan, budget)] = planner.made
    assert oomless.installed_plan(tight.model) is plan and plan.memory_bytes == budget
    assert plan.decisions["encoders.0.0"] == "swap" and plan.decisions["encoders.0.1"] == "recompute"
    # The runtime did what the plan says, counted: every byte of the swapped blocks left the device
    # and every recomputed block ran again, in both steps; and the ledger stayed within the plan's
    # activation budget. (Not compared with the plain step's activations: on CPU the working memory
    # two profiles measure differs by more than this model's saved activations, and so does the budget.)
    stats = tight.stats
    swapped_bytes = sum(block.saved_bytes for block in plan.blocks if block.decision == "swap")
    recomputed = sum(block.decision == "recompute" for block in plan.blocks)
    assert swapped_bytes > 0 and stats.offloaded_bytes == 2 * swapped_bytes, (stats, swapped_bytes)
    assert stats.recomputed_blocks == 2 * recomputed, (stats, recomputed)
    assert stats.peak_activation_bytes <= plan.activation_budget, (stats, plan.activation_budget)
    _assert_state_equal(plain.model.state_dict(), tight.model.state_dict())


def test_resume_with_the_optimizer_state_and_parameters_off_the_device_equals_plain_bitwise(tmp_path, monkeypatch):
    """Checkpoints save and restore the state wherever it lives: with the update in backward, the
    optimizer state and the parameters in their files off the device (forced through a stand-in for
    the planner the loop calls), a run that stops after 2 steps and resumes equals 4 steps of plain
    PyTorch bit for bit, parameters and optimizer state."""
    import oomless
    from oomless.api import plan as plan_for_memory
    from oomless.train.checkpoint_files import read_checkpoint_file

    made = []

    def moving_static(model, example_inputs, memory, **kwargs):
        kwargs.update(split=False, update_in_backward=True, offload_optimizer_state=True, offload_parameters=True)
        made.append(plan_for_memory(model, example_inputs, 2**40, **kwargs))
        return made[-1]

    plain = train(_config(steps=4, checkpoint_dir=tmp_path / "plain"))
    monkeypatch.setattr(oomless, "plan", moving_static)
    train(_config(steps=2, memory="1GiB", checkpoint_dir=tmp_path / "moved"))
    resumed = train(_config(steps=4, memory="1GiB", checkpoint_dir=tmp_path / "moved", resume=True))
    assert len(made) == 2 and all(plan.offload_optimizer_state and plan.offload_parameters for plan in made)
    assert [record["step"] for record in resumed.history][-1] == 4
    _assert_state_equal(plain.model.state_dict(), resumed.model.state_dict())
    # The last checkpoints (step 4) hold the same optimizer state, tensor for tensor.
    (_, expected), (_, actual) = (read_checkpoint_file(latest_checkpoint(tmp_path / name)) for name in ("plain", "moved"))
    expected, actual = ({name: tensor for name, tensor in tensors.items() if name.startswith("optimizer.")}
                        for tensors in (expected, actual))
    assert expected and expected.keys() == actual.keys()
    _assert_state_equal(expected, actual)


def test_the_batch_planned_on_is_not_held_through_the_steps(monkeypatch):
    """The plan counts one batch (the inputs and the loss's targets): each step's own. The first
    batch, which the loop plans on, must not stay alive beside it through the steps."""
    import weakref

    from oomless.parallel.data_parallel import SingleProcess
    from oomless.train import loop

    planned_on, alive_at_steps = [], []
    apply_oomless = loop._apply_oomless

    def remembering(model, optimizer, example, *args):
        planned_on.extend(weakref.ref(tensor) for tensor in example)
        return apply_oomless(model, optimizer, example, *args)

    train_step = SingleProcess.train_step

    def checking(self, train_model, volumes, labels):
        alive_at_steps.append([ref() is not None for ref in planned_on])
        return train_step(self, train_model, volumes, labels)

    monkeypatch.setattr(loop, "_apply_oomless", remembering)
    monkeypatch.setattr(SingleProcess, "train_step", checking)
    train(_config(steps=2, memory="1GiB"))
    assert len(planned_on) == 2 and len(alive_at_steps) == 2
    assert alive_at_steps[1] == [False, False], "the planning batch is still held at the second step"


def _clocked_run(monkeypatch, **overrides):
    """Train under a clock that moves only here: planning 100 s, the first step 50 s, each later
    step 1 s, each checkpoint written 10 s."""
    import types

    import oomless
    from oomless.train import loop

    now = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    real_plan, real_accumulate, real_checkpoint = oomless.plan, loop._Run._accumulate, loop._Run._checkpoint

    def slow_plan(*args, **kwargs):
        now[0] += 100.0
        return real_plan(*args, **kwargs)

    def timed_accumulate(run):
        now[0] += 50.0 if run.timed_since is None else 1.0
        return real_accumulate(run)

    def slow_checkpoint(run, *args):
        now[0] += 10.0
        return real_checkpoint(run, *args)

    monkeypatch.setattr(oomless, "plan", slow_plan)
    monkeypatch.setattr(loop._Run, "_accumulate", timed_accumulate)
    monkeypatch.setattr(loop._Run, "_checkpoint", slow_checkpoint)
    return train(_config(memory="1GiB", log_every=10, **overrides))


def test_the_step_time_a_plan_is_compared_with_counts_neither_planning_nor_the_first_step(monkeypatch, tmp_path):
    # `make demo` compared 1.9 s predicted with 3.4 s "measured": planning's 9 s spread over its steps.
    result = _clocked_run(monkeypatch, steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert result.seconds_per_step == 1.0
    assert result.volumes_per_second == pytest.approx(4 * 2 / (100 + 50 + 3 + 2 * 10))   # all of it


def test_a_run_of_one_step_reports_that_step_as_its_time(monkeypatch):
    assert _clocked_run(monkeypatch, steps=1).seconds_per_step == 50.0


def _peak_of_run(command: list[str], cwd, environment: dict | None = None) -> float:
    """The MiB the trainer's ``done:`` line reports as its peak."""
    finished = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", **(environment or {})},
                              capture_output=True, text=True, timeout=300, cwd=cwd)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return float(re.search(r"peak memory ([0-9.]+) MiB", finished.stdout).group(1))


def test_a_monai_unet_trains_within_its_budget_its_librarys_start_up_not_counted(tmp_path):
    """The trainer counts memory from after start-up: MONAI's import (~99 MB resident, made when the
    model is built) and torch.export's first trace (~30 MB, where a pipeline traces the model) are
    start-up too, done before it counts. Before, one process of ``--memory 64MiB`` measured 134 MiB
    for a plan predicted at 34, and a 2-stage pipeline 165 MiB. In fresh processes: each import once."""
    pytest.importorskip("monai")
    arguments = ["train", "--model", "monai-unet", "--size", "16", "--depth", "2", "--base-channels", "4",
                 "--global-batch", "8", "--steps", "3", "--device", "cpu", "--memory", "64MiB", "--quiet"]
    one = _peak_of_run([sys.executable, "-m", "oomless", *arguments], tmp_path)
    torchrun = Path(sys.executable).with_name("torchrun")
    pipeline = _peak_of_run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "oomless", *arguments,
                             "--parallel", "pipeline", "--stages", "2"], tmp_path)
    assert one <= 64 and pipeline <= 64, (one, pipeline)


def test_compiled_blocks_train_within_the_budget_the_compilers_start_up_not_counted(tmp_path):
    """With --compile, inductor's start-up (its lazy imports, the backward compiler, the C++
    toolchain's caches: ~20 MiB of what a 16^3 U-Net's first compiled step left resident) is start-up
    too, done before the trainer counts (`runtime.compile.warm_up_compile`). In a fresh process with
    a cold compile cache (its own cache folder: a warm one leaves ~20 MiB less), ``--compile --memory
    92MiB`` was refused, the smallest budget named 101 MiB; it now names 81 and trains."""
    from oomless.runtime.compile import _probe
    if _probe("inductor") is not None:
        pytest.skip(f"torch.compile cannot run here: {_probe('inductor')}")
    arguments = ["train", "--size", "16", "--steps", "2", "--device", "cpu", "--compile", "--memory", "92MiB",
                 "--quiet"]
    cold = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert _peak_of_run([sys.executable, "-m", "oomless", *arguments], tmp_path, cold) <= 92
