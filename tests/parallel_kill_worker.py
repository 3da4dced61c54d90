"""Run by ``torchrun --max-restarts 1`` in tests/test_parallel_faults.py: the embedded training under
``--parallel`` with a checkpoint every step; with OOMLESS_TEST_KILL_AT_STEP=k, rank 1 of the first
attempt SIGKILLs itself in the middle of step k (after its forward), as a crashed machine would.

Right before the kill it writes OOMLESS_TEST_KILL_MARKER, so the test knows a worker really died
(torchrun only logs the first failure it sees, which can be rank 0's failed collective, not the -9)."""

import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
from oomless.cli.main import main  # noqa: E402
from oomless.train import losses  # noqa: E402

kill_at = int(os.environ.get("OOMLESS_TEST_KILL_AT_STEP", "0"))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if kill_at and first_attempt and os.environ.get("RANK") == "1":
    original_loss = losses.segmentation_loss
    calls = {"count": 0}

    def loss_then_die(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == kill_at:          # each attempt counts from its own start step
            if "OOMLESS_TEST_KILL_MARKER" in os.environ:
                Path(os.environ["OOMLESS_TEST_KILL_MARKER"]).write_text(f"rank 1 (pid {os.getpid()}) "
                                                                         f"SIGKILLed in step {kill_at}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return original_loss(*args, **kwargs)

    # The strategies look the loss up in oomless.train.losses at each step (`train_step`).
    losses.segmentation_loss = loss_then_die

sys.exit(main(["train", *sys.argv[1:]]))
