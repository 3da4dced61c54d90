"""Recompute segments (`oomless.plan.segments`): a module around consecutive blocks recomputed as one,
holding its own inputs only, as ``torch.utils.checkpoint`` on it does. Recomputed one by one, blocks
of a stage each hold the one before's output and save nothing."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import oomless
from oomless.models import UNet3D
from oomless.plan.planner import make_plan
from oomless.plan.segments import best_of_granularities, coarsened, depth_cuts
from oomless.plan.simulate import simulate
from oomless.profile.profile import Profile

from .conftest import train_steps

WIDTH, ROWS, STAGES = 128, 256, 3


class _Stages(nn.Module):
    """Residual stages of four blocks each (their items are the default blocks), functional code
    between them, and a head."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU())
                                    for _ in range(STAGES))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        for stage in self.stages:
            x = x + stage(x)
        return self.head(x)


def _case():
    torch.manual_seed(0)
    return _Stages(), torch.randn(ROWS, WIDTH), (lambda out: out.square().mean())


def _slow_link(profile: Profile) -> Profile:
    """The profile with a swap tier so slow that swapping never pays."""
    return dataclasses.replace(profile, link=dataclasses.replace(profile.link, out_bytes_per_second=1e3,
                                                                 in_bytes_per_second=1e3))


def test_the_profile_lists_the_modules_around_blocks_with_their_inputs():
    model, inputs, loss_fn = _case()
    profile = oomless.profile(model, inputs, loss_fn=loss_fn)
    names = [block.name for block in profile.blocks]
    assert names == [f"stages.{s}.{k}" for s in range(STAGES) for k in range(4)] + ["head"]
    # The ModuleList around the stages is never called: no segment.
    assert [(segment.name, segment.first, segment.last) for segment in profile.segments] == [
        (f"stages.{s}", 4 * s, 4 * s + 3) for s in range(STAGES)]
    activation = ROWS * WIDTH * 4
    assert all(segment.input_bytes == activation for segment in profile.segments)
    # The first stage's input is the model's: resident, never on the ledger.
    assert profile.segments[0].input_held_earlier == [[activation, -2, []]]
    assert Profile.from_json(profile.to_json()).segments == profile.segments


def test_a_coarsened_profile_merges_each_segments_blocks():
    model, inputs, loss_fn = _case()
    profile = oomless.profile(model, inputs, loss_fn=loss_fn)
    [cut] = depth_cuts(profile)
    coarse = coarsened(profile, cut)
    assert [block.name for block in coarse.blocks] == [f"stages.{s}" for s in range(STAGES)] + ["head"]
    for s, block in enumerate(coarse.blocks[:STAGES]):
        members = profile.blocks[4 * s:4 * s + 4]
        assert block.saved_bytes == sum(member.saved_bytes for member in members)
        assert block.saved_sizes == [size for member in members for size in member.saved_sizes]
        assert block.forward_seconds == sum(member.forward_seconds for member in members)
        assert block.input_bytes == profile.segments[s].input_bytes
        assert len(block.saved_alive_blocks) == len(block.saved_sizes)
    assert coarse.blocks[-1] == dataclasses.replace(profile.blocks[-1], saved_alive_blocks=coarse.blocks[-1].saved_alive_blocks)
    # Recomputing whole stages holds less than recomputing every block, and keeping all is the same.
    every = simulate(profile, ["recompute"] * 12 + ["keep"])
    stages = simulate(coarse, ["recompute"] * STAGES + ["keep"])
    assert stages.activation_peak_bytes < every.activation_peak_bytes
    assert simulate(coarse, ["keep"] * 4).activation_peak_bytes == simulate(profile, ["keep"] * 13).activation_peak_bytes


def _budget_only_segments_meet(profile: Profile) -> int:
    """Activation budget where recomputing whole stages fits and no plan of single blocks does
    without swapping (swapping, on the slow link, is never worth it)."""
    coarse = coarsened(profile, depth_cuts(profile)[0])
    stages = make_plan(coarse, 2**40, decisions={block.name: ("recompute" if block.name.startswith("stages") else "keep")
                                                 for block in coarse.blocks}, min_swap_bytes=0)
    return stages.predicted_peak_bytes


def test_the_planner_recomputes_whole_stages_where_that_is_fastest_and_trains_as_plain():
    model, inputs, loss_fn = _case()
    profile = _slow_link(oomless.profile(model, inputs, loss_fn=loss_fn))
    memory = _budget_only_segments_meet(profile)

    def make(device_profile):
        return make_plan(device_profile, memory, min_swap_bytes=0)
    fine = make(profile)
    plan = best_of_granularities(profile, make)
    stages = {block.name: block.decision for block in plan.blocks if block.name.startswith("stages")}
    assert list(stages) == [f"stages.{s}" for s in range(STAGES)]
    recomputed = [name for name, decision in stages.items() if decision == "recompute"]
    assert recomputed and set(stages.values()) <= {"keep", "recompute"}
    assert plan.predicted_step_seconds < fine.predicted_step_seconds

    # Through the public API, from the same profile.
    planned = oomless.plan(model, inputs, memory, loss_fn=loss_fn, profile=profile, min_swap_bytes=0)
    assert [block.name for block in planned.blocks] == [block.name for block in plan.blocks]

    reference = _Stages()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    oomless.apply(model, planned)
    train_steps(model, optimizer, inputs, loss_fn)
    train_steps(reference, reference_optimizer, inputs, loss_fn)
    stats = oomless.stats(model)
    assert stats.recomputed_blocks == 2 * len(recomputed)
    assert stats.peak_activation_bytes <= planned.activation_budget
    for expected, actual in zip(reference.parameters(), model.parameters()):
        assert torch.equal(expected, actual)


def test_without_a_faster_segment_plan_the_plan_keeps_the_measured_blocks():
    model, inputs, loss_fn = _case()
    profile = oomless.profile(model, inputs, loss_fn=loss_fn)
    plan = oomless.plan(model, inputs, 2**34, loss_fn=loss_fn, profile=profile)
    assert [block.name for block in plan.blocks] == [block.name for block in profile.blocks]
    assert set(plan.decisions.values()) == {"keep"}


def test_a_recomputed_unet_stage_updates_batchnorm_once_and_equals_plain():
    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(2, 1, 16, 16, 16)
    target = (volume[:, 0] > 0).long()
    loss_fn = lambda out: F.cross_entropy(out, target)   # noqa: E731
    profile = oomless.profile(model, volume, loss_fn=loss_fn)
    assert profile.segments, "the U-Net's stages are modules around blocks"
    cut = depth_cuts(profile)[-1]
    coarse = coarsened(profile, cut)
    names = {segment.name for segment in cut}
    decisions = {block.name: ("recompute" if block.name in names else "keep") for block in coarse.blocks}
    plan = make_plan(coarse, 2**40, decisions=decisions)
    reference = UNet3D(base_channels=4, depth=2)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    oomless.apply(model, plan, optimizer=optimizer)
    train_steps(model, optimizer, volume, loss_fn)
    train_steps(reference, reference_optimizer, volume, loss_fn)
    assert oomless.stats(model).recomputed_blocks >= 2 * len(names)
    for expected, actual in zip(reference.state_dict().values(), model.state_dict().values()):
        assert torch.equal(expected, actual)


def test_no_segments_where_static_bytes_move_during_the_step():
    """Parameters off the device (or the update in backward) move static bytes per block: a merged
    block would count its least absent member's, so such placements plan the measured blocks."""
    model, inputs, loss_fn = _case()
    profile = _slow_link(oomless.profile(model, inputs, loss_fn=loss_fn))
    memory = _budget_only_segments_meet(profile)
    moving = dataclasses.replace(profile, blocks=[dataclasses.replace(block, backward_static_absent_bytes=1)
                                                  for block in profile.blocks])

    def make(device_profile):
        return make_plan(device_profile, memory, min_swap_bytes=0)
    assert any(block.name == "stages.0" for block in best_of_granularities(profile, make).blocks)
    try:
        plan = best_of_granularities(moving, make)
    except oomless.PlanError:
        return      # refused by the measured blocks' own plan: also no segment
    assert [block.name for block in plan.blocks] == [block.name for block in profile.blocks]
