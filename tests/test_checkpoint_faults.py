"""Checkpoints that survive damage: a writer killed mid-write, files truncated, zeroed, flipped or
removed. Nothing committed is lost, a damaged or partial file is never used, and a resumed run
equals an uninterrupted one."""

import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from oomless.errors import CheckpointError
from oomless.train import TrainConfig, load_checkpoint, save_checkpoint, train
from oomless.train.checkpoint_files import list_checkpoints, newest_intact_checkpoint, read_checkpoint_file
from tests.checkpoint_writer_child import model_at
from tests.test_cli import run_oomless

CHILD = Path(__file__).resolve().parent / "checkpoint_writer_child.py"


def _config(**overrides) -> TrainConfig:
    settings = dict(size=16, steps=4, seed=0, global_batch=2, base_channels=4, depth=2, progress=False,
                    device="cpu", keep_checkpoints=3, log_every=1)
    settings.update(overrides)
    return TrainConfig(**settings)


@pytest.fixture(scope="module")
def uninterrupted():
    return train(_config()).model.state_dict()


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A run stopped after step 3 with checkpoints at steps 1, 2 and 3."""
    directory = tmp_path_factory.mktemp("three-steps")
    train(_config(steps=3, checkpoint_dir=directory))
    assert [step for step, _ in list_checkpoints(directory)] == [1, 2, 3]
    return directory


def _truncate_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte_in_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01                      # inside the last tensor's bytes: parses, checksum differs
    path.write_bytes(bytes(data))


def _flip_byte_in_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[40] ^= 0x20                        # inside the JSON header (names, offsets)
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated": _truncate_half,
    "empty": lambda path: path.write_bytes(b""),
    "zeroed": lambda path: path.write_bytes(bytes(path.stat().st_size)),
    "flipped-data": _flip_byte_in_data,
    "flipped-header": _flip_byte_in_header,
    "random-bytes": lambda path: path.write_bytes(random.Random(0).randbytes(path.stat().st_size)),
    "removed": Path.unlink,
    # Intact, but another step's file under this name (copied by hand): taken first for its name, it
    # hid every newer checkpoint on each later resume.
    "misnamed": lambda path: shutil.copyfile(path.with_name("step-00000001.safetensors"), path),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_newest_checkpoint_resumes_from_the_newest_intact_one(damage, three_steps, uninterrupted, tmp_path):
    directory = tmp_path / "run"
    shutil.copytree(three_steps, directory)
    DAMAGES[damage](directory / "step-00000003.safetensors")
    output = io.StringIO()
    # Narrow, as a piped console is (80 columns): the line is still one line.
    resumed = train(_config(checkpoint_dir=directory, resume=True), console=Console(file=output, width=80))
    lines = output.getvalue().splitlines()
    if damage != "removed":
        skipped = [line for line in lines if line.startswith("skipping a damaged checkpoint (")]
        assert len(skipped) == 1 and "step-00000003.safetensors" in skipped[0], lines
        assert "damaged" in skipped[0] and skipped[0].endswith("resuming from step-00000002.safetensors")
    assert any(line.endswith("at step 2") and line.startswith("resumed from") for line in lines), lines
    assert [record["step"] for record in resumed.history] == [3, 4]
    state = resumed.model.state_dict()
    assert state.keys() == uninterrupted.keys()
    assert all(torch.equal(state[name], uninterrupted[name]) for name in state)
    # The run wrote step 3 again over the damaged file: every checkpoint left is intact.
    assert [step for step, _ in list_checkpoints(directory)] == [2, 3, 4]
    for _, path in list_checkpoints(directory):
        read_checkpoint_file(path)


def test_no_intact_checkpoint_names_every_file(three_steps, tmp_path):
    directory = tmp_path / "run"
    shutil.copytree(three_steps, directory)
    for step, path in list_checkpoints(directory):
        DAMAGES[["truncated", "zeroed", "flipped-data"][step - 1]](path)
    with pytest.raises(CheckpointError) as refused:
        train(_config(checkpoint_dir=directory, resume=True))
    message = str(refused.value)
    assert "no intact checkpoint" in message and "\n" not in message
    assert all(f"step-0000000{step}.safetensors" in message for step in (1, 2, 3))
    completed = run_oomless("train", "--size", "16", "--depth", "2", "--base-channels", "4", "--steps", "4",
                            "--device", "cpu", "--checkpoint-dir", str(directory), "--resume", "--keep-checkpoints", "3")
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1 and "no intact checkpoint" in completed.stderr


def test_changed_settings_refused_before_any_weight_is_loaded(three_steps, tmp_path):
    directory = tmp_path / "run"
    shutil.copytree(three_steps, directory)
    before = sorted((path.name, path.stat().st_mtime_ns) for path in directory.iterdir())
    for flag, value, change in (("--depth", "1", "depth 2 -> 1"), ("--base-channels", "8", "base_channels 4 -> 8")):
        settings = {"--depth": "2", "--base-channels": "4", flag: value}
        completed = run_oomless("train", "--size", "16", "--steps", "4", "--device", "cpu", "--checkpoint-dir",
                                str(directory), "--resume", *[item for pair in settings.items() for item in pair])
        assert completed.returncode == 2 and "Traceback" not in completed.stderr
        lines = completed.stderr.strip().splitlines()
        assert len(lines) == 1 and change in lines[0] and "different settings" in lines[0], lines
    assert sorted((path.name, path.stat().st_mtime_ns) for path in directory.iterdir()) == before   # nothing written


def test_load_checkpoint_checks_shapes_before_loading(tmp_path):
    model, optimizer = model_at(1)
    path = save_checkpoint(tmp_path, model, optimizer, step=1, data_position=1)
    other = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 128))
    other_optimizer = torch.optim.Adam(other.parameters())
    before = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"1.weight \[256, 512\] in the file, \[128, 512\] in the model"):
        load_checkpoint(path, other, other_optimizer)
    assert all(torch.equal(before[name], tensor) for name, tensor in other.state_dict().items())
    assert not other_optimizer.state


def test_every_flipped_byte_is_caught_or_harmless(tmp_path):
    """Flip bytes across the whole file: each read either refuses the file or restores exactly the
    saved state (a flip in the header's padding changes nothing that is read)."""
    model, optimizer = model_at(7, width=4)
    path = save_checkpoint(tmp_path / "original", model, optimizer, step=7, data_position=7)
    original = path.read_bytes()
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    header_bytes = 8 + int.from_bytes(original[:8], "little")
    positions = sorted(set(range(0, header_bytes, max(1, header_bytes // 200)))
                       | set(range(header_bytes, len(original), max(1, (len(original) - header_bytes) // 100))))
    refused = 0
    for position in positions:
        damaged = bytearray(original)
        damaged[position] ^= 0x10
        copy = tmp_path / "damaged.safetensors"
        copy.write_bytes(bytes(damaged))
        restored, restored_optimizer = model_at(0, width=4)
        try:
            state = load_checkpoint(copy, restored, restored_optimizer, restore_rng=False)
        except CheckpointError as error:
            assert "damaged" in str(error) or "not an oomless checkpoint" in str(error) or "format" in str(error)
            refused += 1
            continue
        assert state.step == 7
        assert all(torch.equal(expected[name], tensor) for name, tensor in restored.state_dict().items()), position
    assert refused >= 100                 # every flip in the tensors' bytes at least


def _run_child(directory: Path, kill_point: str, kill_step: int, steps: int = 6) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHILD), str(directory), kill_point, str(kill_step), str(steps)],
                          capture_output=True, text=True, timeout=120)


def _committed(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("committed ")]


def _assert_nothing_committed_lost(directory: Path, committed: list[int]) -> int:
    """Every checkpoint file is whole and holds its own step's state; the newest committed step (or a
    later one whose rename happened just before the kill) is there. Returns the newest step."""
    files = list_checkpoints(directory)
    for step, path in files:
        restored, optimizer = model_at(0)
        state = load_checkpoint(path, restored, optimizer, restore_rng=False)
        assert state.step == step
        assert all(bool((parameter == step).all()) for parameter in restored.parameters())
        assert all(bool((moment == step).all()) for per_parameter in optimizer.state.values()
                   for name, moment in per_parameter.items() if name != "step")
    found = newest_intact_checkpoint(directory, report=pytest.fail)
    newest = found[1]["step"] if found else 0
    assert newest >= (committed[-1] if committed else 0)
    assert newest <= (committed[-1] if committed else 0) + 1
    return newest


@pytest.mark.parametrize("kill_point", ["during-temporary-write", "before-fsync", "before-rename", "after-rename",
                                        "during-rotation"])
def test_writer_killed_inside_a_write_loses_nothing_committed(kill_point, tmp_path):
    completed = _run_child(tmp_path, kill_point, kill_step=4)
    assert completed.returncode == -signal.SIGKILL, completed.stderr
    committed = _committed(completed.stdout)
    assert committed == [1, 2, 3]
    newest = _assert_nothing_committed_lost(tmp_path, committed)
    assert newest == (4 if kill_point in ("after-rename", "during-rotation") else 3)
    # The next write (a resumed run) clears the dead writer's temporary and rotates as usual.
    model, optimizer = model_at(5)
    save_checkpoint(tmp_path, model, optimizer, step=5, data_position=5, keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"step-0000000{newest}.safetensors",
                                                                 "step-00000005.safetensors"]


def test_writer_killed_at_random_moments_loses_nothing_committed(tmp_path):
    generator = random.Random(0)
    for attempt in range(4):
        directory = tmp_path / f"attempt-{attempt}"
        child = subprocess.Popen([sys.executable, str(CHILD), str(directory), "none", "0", "1000"],
                                 stdout=subprocess.PIPE, text=True)
        first = child.stdout.readline()             # start-up done, writes under way
        assert first.startswith("committed ")
        time.sleep(generator.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL
        _assert_nothing_committed_lost(directory, _committed(first + rest))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_written_files_take_the_mode_the_umask_gives(umask, mode, tmp_path):
    # Weights, checkpoints and predictions were all 0600 (mkstemp's), whatever the umask: other users
    # could not read the weights, nor open a prediction in a viewer.
    import stat

    from oomless.train.checkpoint_files import atomic_write
    before = os.umask(umask)
    try:
        path = atomic_write(tmp_path / "weights.safetensors", lambda temporary: Path(temporary).write_bytes(b"x"))
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_misnamed_checkpoint_does_not_make_the_run_delete_its_new_ones(three_steps, tmp_path):
    """Named for a later step than every real one, it sorts last: rotation kept it and deleted each
    checkpoint as soon as it was written, and the next resume found nothing intact."""
    directory = tmp_path / "run"
    shutil.copytree(three_steps, directory)
    shutil.copyfile(directory / "step-00000002.safetensors", directory / "step-00000099.safetensors")
    train(_config(checkpoint_dir=directory, resume=True, keep_checkpoints=1), console=Console(file=io.StringIO()))
    assert "step-00000004.safetensors" in {path.name for path in directory.iterdir()}
    again = train(_config(checkpoint_dir=directory, resume=True, keep_checkpoints=1, steps=5),
                  console=Console(file=io.StringIO()))
    assert again.steps_done == 5
