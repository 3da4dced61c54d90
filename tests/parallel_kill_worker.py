"""Run by ``torchrun --max-restarts 1`` in tests/test_parallel_faults.py: the embedded training under
``--parallel`` with a checkpoint every step; with OOMLESS_TEST_KILL_AT_STEP=k, rank 1 of the first
attempt SIGKILLs itself in the middle of step k (after its forward), as a crashed machine would."""

import os
import signal
import sys

import torch

torch.set_num_threads(1)
from oomless.cli.main import main  # noqa: E402
from oomless.train import loop  # noqa: E402

kill_at = int(os.environ.get("OOMLESS_TEST_KILL_AT_STEP", "0"))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if kill_at and first_attempt and os.environ.get("RANK") == "1":
    original_loss = loop.segmentation_loss
    calls = {"count": 0}

    def loss_then_die(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == kill_at:          # each attempt counts from its own start step
            os.kill(os.getpid(), signal.SIGKILL)
        return original_loss(*args, **kwargs)

    loop.segmentation_loss = loss_then_die

sys.exit(main(["train", *sys.argv[1:]]))
