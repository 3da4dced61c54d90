"""A process that writes checkpoints and is killed while it does (tests/test_checkpoint_faults.py).

    python tests/checkpoint_writer_child.py DIRECTORY KILL_POINT KILL_STEP STEPS

Writes ``save_checkpoint`` for steps 1..STEPS (keep=2) of a small model whose every parameter holds
the step number, printing ``committed STEP`` once each call returns. At step KILL_STEP it sends
itself SIGKILL at KILL_POINT, a named moment inside the write (no cleanup code can run, as with a
real kill); KILL_POINT "none" writes every step (the parent then kills it at a random moment).
"""

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from oomless.train import checkpoint_files  # noqa: E402
from oomless.train.checkpoint import save_checkpoint  # noqa: E402


def model_at(step: int, width: int = 256) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The state a checkpoint at ``step`` must hold: every parameter and Adam moment equal to ``step``
    (~6 MB in all at the default width, so that a write takes a while)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(step)
            for moment in optimizer.state[parameter].values():
                moment.fill_(step)
    return model, optimizer


def _die(*_, **__):
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill_point: str) -> None:
    """Make the next write die at ``kill_point``."""
    if kill_point == "during-temporary-write":
        real_save = checkpoint_files.atomic_write

        def half_written(path, write):
            def write_half(temporary):
                write(temporary)
                size = os.path.getsize(temporary)
                os.truncate(temporary, size // 2)       # the bytes that reached the disk before the kill
                _die()
            return real_save(path, write_half)
        checkpoint_files.atomic_write = half_written
    elif kill_point == "before-fsync":                  # temporary written, not yet flushed
        os.fsync = _die
    elif kill_point == "before-rename":
        os.replace = _die
    elif kill_point == "after-rename":                  # before the directory is flushed and old files go
        checkpoint_files._fsync_directory = _die
    elif kill_point == "during-rotation":               # one older checkpoint deleted, the next not yet
        real_unlink = Path.unlink

        def unlink_then_die(self, missing_ok=False):
            real_unlink(self, missing_ok=missing_ok)
            _die()
        Path.unlink = unlink_then_die
    elif kill_point != "none":
        raise SystemExit(f"unknown kill point {kill_point!r}")


def main() -> None:
    directory, kill_point, kill_step, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for step in range(1, steps + 1):
        if step == kill_step:
            arm(kill_point)
        model, optimizer = model_at(step)
        save_checkpoint(directory, model, optimizer, step=step, data_position=step, keep=2)
        print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main()
