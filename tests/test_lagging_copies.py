"""The profile does not depend on how far the swap tier's copies happen to lag behind compute.

A disk (or PCIe link) busy with something else finishes its writes late now and then. Two things
in a profile read memory while copies run: the sizing step's per-phase peaks, and the timing step's
rehearsal of the plan (whose excess over its prediction every plan from the profile carries as its
margin). Each test below slows every write of the disk tier by 50 ms and checks what a fresh
process profiling a quick disk would read. Before, on the machine of these tests, a transformer's
four identical layers read one phase 1.5-3 MiB high in 4 processes of 22, and one process of 16
held 4.1 MiB over its rehearsal's prediction: the smallest budget those named was refused when
given back in another process (tests/test_floor.py).
"""

import gc
import time

import torch
from torch import nn

import oomless
from oomless.runtime.install import installed_state
from oomless.runtime.tiers import DiskTier

WIDTH = 1024
BATCH = 1024                       # each block's saved activation: BATCH x WIDTH float32, 4 MiB
ACTIVATION_BYTES = BATCH * WIDTH * 4
BLOCKS = 12
WRITE_DELAY_SECONDS = 0.05


class ScaledTanh(nn.Module):
    """Saves one new 4 MiB activation (tanh's output; its input is the block before's), and holds
    next to no parameters: what the step holds is its activations, so lagging writes show."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return torch.tanh(x * self.scale)


def _model() -> nn.Module:
    return nn.Sequential(*[ScaledTanh() for _ in range(BLOCKS)])


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _profile(model: nn.Module, inputs: torch.Tensor, memory=None):
    # Old garbage of earlier tests collected now, not during one of the profiles compared (the
    # profile collects the young generations only): in the full suite one block of the quick
    # profile read 12 MiB under the late one's once (2026-12-07).
    gc.collect()
    return oomless.profile(model, inputs, loss_fn=_loss, blocks=[str(index) for index in range(BLOCKS)], memory=memory)


def _slow_writes(monkeypatch) -> None:
    written = DiskTier._write

    def late(self, ticket, holding):
        time.sleep(WRITE_DELAY_SECONDS)
        written(self, ticket, holding)
    monkeypatch.setattr(DiskTier, "_write", late)


def test_the_sizing_steps_phase_peaks_do_not_hold_writes_that_lag(monkeypatch):
    model, inputs = _model(), torch.randn(BATCH, WIDTH)
    _profile(model, inputs)                 # start-up (kernels' caches) out of the two compared
    quick = _profile(model, inputs)
    _slow_writes(monkeypatch)
    late = _profile(model, inputs)
    differences = [late_block.forward_peak_bytes - quick_block.forward_peak_bytes
                   for quick_block, late_block in zip(quick.blocks, late.blocks)]
    # Page noise at most: each write is waited for before the next save. Letting 256 MiB lag, the
    # earlier blocks' activations were still resident at the later blocks' readings.
    assert max(differences) <= ACTIVATION_BYTES // 2, [difference / 2**20 for difference in differences]


def _floor(model: nn.Module, inputs: torch.Tensor) -> int:
    try:
        oomless.plan(model, inputs, 1, loss_fn=_loss, blocks=[str(index) for index in range(BLOCKS)])
    except oomless.PlanError as error:
        return error.minimum_bytes
    raise AssertionError("planned within 1 byte")


def test_the_rehearsal_keeps_the_plans_limits_when_writes_lag(monkeypatch):
    model, inputs = _model(), torch.randn(BATCH, WIDTH)
    _profile(model, inputs)
    floor = _floor(model, inputs)
    _slow_writes(monkeypatch)
    rehearsed = _profile(model, inputs, memory=floor)
    # Its plan swaps; its limits make the forward (and the loss) wait for the late writes, as
    # training does. Without them the rehearsal held the lagging activations beyond its prediction
    # (8.4 MiB here, once the sizing step no longer held them too), and every plan made from this
    # profile would have carried that as its margin.
    assert rehearsed.rehearsal_excess_bytes <= 2 * 2**20, rehearsed.rehearsal_excess_bytes / 2**20


def test_the_loss_starts_within_its_share_of_the_budget_when_writes_lag(monkeypatch):
    model, inputs = _model(), torch.randn(BATCH, WIDTH)
    _profile(model, inputs)
    plan = oomless.plan(model, inputs, _floor(model, inputs), loss_fn=_loss,
                        blocks=[str(index) for index in range(BLOCKS)])
    assert "swap" in plan.decisions.values(), plan.decisions
    oomless.apply(model, plan)
    ledger = installed_state(model).ledger
    at_the_loss = []

    def loss(output):
        at_the_loss.append(ledger.resident_activation_bytes)
        return _loss(output)
    _slow_writes(monkeypatch)
    loss(model(inputs)).backward()
    # The loss's working memory is larger than a block's: its share of the budget leaves less room
    # for saved activations than the last block's forward had, and the writes still running when the
    # forward returns finish before it starts (no block's limit guards the loss).
    last_forward_limit = plan.blocks[-1].forward_limit_bytes
    assert plan.loss_limit_bytes < last_forward_limit - ACTIVATION_BYTES, (plan.loss_limit_bytes, last_forward_limit)
    assert at_the_loss[0] <= plan.loss_limit_bytes, (at_the_loss[0] / 2**20, plan.loss_limit_bytes / 2**20)
    oomless.remove(model)
