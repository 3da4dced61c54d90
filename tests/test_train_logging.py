"""What the training loop reads from the device, and when: a logged line is a host synchronisation
(.item()), so it happens every `log_every` steps (default 10), and what it logs is the mean of every
step since the last line, accumulated on the device. Also the switch to deterministic kernels."""

import os
import sys

import pytest
import torch

import oomless
from oomless.train import TrainConfig, train
from oomless.train.loop import use_deterministic_kernels


def _config(**overrides) -> TrainConfig:
    settings = dict(size=16, steps=3, seed=0, global_batch=2, base_channels=4, depth=2, progress=False, device="cpu")
    settings.update(overrides)
    return TrainConfig(**settings)


def test_by_default_the_loop_reads_the_device_every_tenth_step_not_every_step(monkeypatch):
    """Counted: .item() called from oomless's code (torch's CPU Adam reads its step counters, which
    live on the host even when training on CUDA: no device synchronisation there)."""
    item = torch.Tensor.item
    package = os.path.dirname(oomless.__file__)
    calls = []

    def counted(tensor):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(package):
            calls.append(caller)
        return item(tensor)

    monkeypatch.setattr(torch.Tensor, "item", counted)
    result = train(_config(steps=20))
    assert [record["step"] for record in result.history] == [10, 20]
    assert len(calls) == 2 * len(result.history) + 2       # loss and Dice per line, and the final pair


def test_a_logged_loss_is_the_mean_of_the_steps_since_the_last_line():
    every_step = [record["loss"] for record in train(_config(steps=6, log_every=1)).history]
    grouped = train(_config(steps=6, log_every=4)).history
    assert [record["step"] for record in grouped] == [4, 6]
    assert grouped[0]["loss"] == pytest.approx(sum(every_step[:4]) / 4, rel=1e-6)
    assert grouped[1]["loss"] == pytest.approx(sum(every_step[4:]) / 2, rel=1e-6)


def test_deterministic_kernels_are_strict_on_cpu_and_warn_only_on_cuda(monkeypatch):
    """On CUDA strict mode raises in ops the 3D task runs (nll_loss2d's reduction has no
    deterministic kernel): `--deterministic` must warn there, not stop training."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic_kernels(torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        use_deterministic_kernels(torch.device("cuda", 0))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
