"""Selective recompute (runtime/selective.py): what the profile measures, when the planner chooses it,
what the runtime holds, and where it is refused. Equality with plain PyTorch under it is in
tests/test_fit_equality.py and tests/test_model_zoo.py (kind "selective")."""

import copy

import pytest
import torch
import torch.nn as nn

import oomless
from oomless.errors import InputError
from oomless.plan.planner import make_plan
from oomless.profile.profile import BlockProfile, LinkProfile, Profile
from tests.conftest import needs_selective

MiB = 2**20


class Layer(nn.Module):
    """Two matrix products around a pointwise tail: what a selective block keeps is known exactly."""

    def __init__(self, width: int = 64, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(torch.tanh(self.up(x)) * 2.0))


class InPlaceLayer(Layer):
    def forward(self, x):
        hidden = self.up(x)
        hidden.mul_(0.5)            # writes into a kept output: torch's cache would refuse it
        return self.norm(x + self.down(torch.tanh(hidden)))


def _stack(layer=Layer, depth: int = 3):
    return nn.Sequential(*[layer() for _ in range(depth)])


def _loss(out):
    return out.square().mean()


def test_the_profile_measures_what_a_selective_block_keeps():
    needs_selective()
    torch.manual_seed(0)
    model, x = _stack(), torch.randn(32, 64)
    profile = oomless.profile(model, x, loss_fn=_loss, blocks=["0", "1", "2"])
    for block in profile.blocks:
        # The outputs of up (32 x 256) and down (32 x 64), float32.
        assert block.selective_kept_bytes == 32 * (256 + 64) * 4
        # Backward saves neither: tanh saves its own output (not up's), the add saves nothing and
        # the LayerNorm saves the sum.
        assert block.selective_unsaved_bytes == 32 * (256 + 64) * 4
        assert 0.0 < block.selective_time_share <= 1.0


def test_a_block_that_writes_into_a_kept_output_is_not_offered():
    torch.manual_seed(0)
    model, x = _stack(InPlaceLayer, 2), torch.randn(32, 64)
    profile = oomless.profile(model, x, loss_fn=_loss, blocks=["0", "1"])
    assert all(block.selective_kept_bytes is None for block in profile.blocks)
    with pytest.raises(InputError, match="selective recompute of"):
        oomless.plan(model, x, "1GiB", loss_fn=_loss, profile=profile, decisions={"0": "selective", "1": "keep"})


def test_selective_runs_bit_equal_and_holds_its_kept_outputs_on_the_ledger():
    needs_selective()
    torch.manual_seed(0)
    model, x = _stack(), torch.randn(32, 64)
    reference = copy.deepcopy(model)
    profile = oomless.profile(model, x, loss_fn=_loss, blocks=["0", "1", "2"])
    plan = oomless.plan(model, x, "1GiB", loss_fn=_loss, profile=profile, min_swap_bytes=0,
                        decisions={"0": "selective", "1": "selective", "2": "selective"})
    assert plan.decisions == {"0": "recompute", "1": "recompute", "2": "recompute"}
    assert all(block.selective for block in plan.blocks)
    assert "selective" in str(plan)
    oomless.apply(model, plan)
    for net in (model, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            _loss(net(x)).backward()
            optimizer.step()
    for expected, actual in zip(reference.parameters(), model.parameters()):
        assert torch.equal(expected, actual)
    stats = oomless.stats(model)
    assert stats.recomputed_blocks == 6
    kept = sum(block.selective_kept_bytes for block in profile.blocks)
    inputs = 3 * 32 * 64 * 4
    # At the end of the forward the ledger holds every block's input and kept outputs (the last
    # block's output is the loss's, not on the ledger), and never more than the plan predicted.
    assert stats.peak_activation_bytes >= kept + inputs - 32 * 64 * 4
    assert stats.peak_activation_bytes <= plan.predicted_activation_peak_bytes


def _hand_profile(share: float) -> Profile:
    """Two blocks of 40 MiB saved each: selective keeps 8 MiB of them at ``share`` of a 100 ms forward;
    swapping over a slow link costs seconds."""
    blocks = [BlockProfile(name=f"b{i}", forward_seconds=0.1, backward_seconds=0.2, saved_bytes=40 * MiB,
                           largest_saved_bytes=10 * MiB, input_bytes=MiB, output_bytes=MiB, calls=1,
                           forward_transient_bytes=MiB, backward_transient_bytes=MiB,
                           selective_kept_bytes=8 * MiB, selective_unsaved_bytes=0, selective_time_share=share)
              for i in range(2)]
    return Profile(device="cpu", blocks=blocks, parameter_bytes=MiB, gradient_bytes=MiB, buffer_bytes=0,
                   optimizer_state_bytes=0, input_bytes=MiB, unassigned_saved_bytes=0, loss_seconds=0.001,
                   link=LinkProfile("pcie", 1e7, 1e7))


@pytest.mark.parametrize("solver", ["greedy", "exact"])
def test_the_planner_chooses_selective_where_it_fits_and_costs_less(solver):
    profile = _hand_profile(share=0.8)
    roomy = make_plan(profile, 10**12)
    everything_held = roomy.predicted_peak_bytes
    # Room for one block's saved bytes and the other's kept outputs, not for both blocks kept.
    memory = everything_held - 30 * MiB
    plan = make_plan(profile, memory, solver=solver)
    assert plan.predicted_peak_bytes <= memory
    assert [block.selective for block in plan.blocks].count(True) == 1
    assert "selective recompute" in " ".join(block.reason for block in plan.blocks)
    # Selective re-runs a fifth of the forward; full recompute all of it.
    recompute = make_plan(profile, memory, decisions={"b0": "recompute", "b1": "keep"}, solver=solver)
    assert plan.predicted_step_seconds < recompute.predicted_step_seconds


def test_selective_is_not_chosen_where_it_saves_no_time():
    profile = _hand_profile(share=0.0)      # its kept ops take no time: recompute holds less for the same
    memory = make_plan(profile, 10**12).predicted_peak_bytes - 30 * MiB
    plan = make_plan(profile, memory)
    assert not any(block.selective for block in plan.blocks)
