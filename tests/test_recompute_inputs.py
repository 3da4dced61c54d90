"""A recompute block's inputs that an earlier block already holds cost nothing more: the runtime's
entries are per storage. Chains of in-place ops pass one storage from block to block (a norm's
output is ReLU(inplace=True)'s input, output and the next layer's input); the profile records which
earlier block holds each input (`BlockProfile.input_held_earlier`) and which saves are the block's own
inputs (`input_saved_bytes`), and the simulator counts each storage once, as the ledger does."""

import dataclasses

import pytest
import torch
from torch import nn

import oomless
from oomless.plan.planner import make_plan

WIDTH, ROWS = 256, 512


def _chain(depth=4):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 8))


def _case():
    torch.manual_seed(0)
    model, inputs = _chain(), torch.randn(ROWS, WIDTH)
    return model, inputs, (lambda out: out.square().mean())


BLOCKS = [nn.Linear, nn.LayerNorm, nn.ReLU]


@pytest.mark.parametrize("target", [None, "h100"])
def test_the_profile_names_the_earlier_block_that_holds_each_input(target):
    model, inputs, loss_fn = _case()
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, blocks=BLOCKS, target=target)
    names = [block.name for block in profile.blocks]
    activation = ROWS * WIDTH * 4
    relu, after = profile.blocks[names.index("2")], profile.blocks[names.index("3")]
    # ReLU(inplace) saves its output, the norm's output it was given: its own input.
    assert relu.input_saved_bytes == activation
    # The next Linear's input is that storage: saved first by the ReLU, an input of it too.
    assert after.input_held_earlier == [[activation, names.index("2"), [names.index("2")]]]
    # The first layer's input is the model's input: resident, never on the ledger.
    assert profile.blocks[0].input_held_earlier == [[ROWS * WIDTH * 4, -2, []]]


def test_recompute_plans_count_each_storage_once_as_the_ledger_does():
    model, inputs, loss_fn = _case()
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, blocks=BLOCKS)
    decisions = {block.name: "recompute" for block in profile.blocks}
    plan = make_plan(profile, 2**40, decisions=decisions, min_swap_bytes=0)
    unshared = dataclasses.replace(profile, blocks=[dataclasses.replace(block, input_held_earlier=[], input_saved_bytes=0)
                                                    for block in profile.blocks])
    counted_twice = make_plan(unshared, 2**40, decisions=decisions, min_swap_bytes=0)
    assert plan.predicted_activation_peak_bytes < counted_twice.predicted_activation_peak_bytes

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    reference = _chain()
    reference.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    oomless.apply(model, plan)
    for net, opt in ((model, optimizer), (reference, reference_optimizer)):
        for _ in range(2):
            opt.zero_grad()
            loss_fn(net(inputs)).backward()
            opt.step()
    stats = oomless.stats(model)
    # The ledger (per storage) reaches what the simulator predicts, and the step equals plain PyTorch.
    assert stats.peak_activation_bytes == plan.predicted_activation_peak_bytes
    assert stats.recomputed_blocks > 0
    for expected, actual in zip(reference.parameters(), model.parameters()):
        assert torch.equal(expected, actual)


class _Reordered(nn.Module):
    """Blocks registered in another order than they run (the profile lists them as they ran)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(WIDTH, 8)
        self.act = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.first = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.out(self.act(self.norm(self.first(x))))


@pytest.mark.parametrize("target", [None, "h100"])
def test_the_earlier_blocks_are_named_by_their_place_in_the_profile(target):
    torch.manual_seed(0)
    model, inputs = _Reordered(), torch.randn(ROWS, WIDTH)
    profile = oomless.profile(model, inputs, loss_fn=lambda out: out.square().mean(), blocks=BLOCKS, target=target)
    names = [block.name for block in profile.blocks]
    assert names == ["first", "norm", "act", "out"]
    # `out` reads the norm's output that ReLU(inplace) passed on: saved first by `act`, its input too.
    assert profile.blocks[3].input_held_earlier == [[ROWS * WIDTH * 4, 2, [2]]]


def test_a_block_called_twice_holds_its_inputs_whatever_its_neighbours_do():
    """A block is placed at its first call; a later call's input may be held by a block that runs
    after that first call and is freed before this block's backward: only resident inputs are left out."""
    from oomless.plan.simulate import recompute_held_bytes
    from oomless.profile.profile import BlockProfile

    twice = BlockProfile("shared", calls=2, input_bytes=300, input_held_earlier=[[100, 0, []], [100, -2, []]])
    assert recompute_held_bytes(twice, 2, ["keep", "keep", "recompute"]) == 200
    once = dataclasses.replace(twice, calls=1)
    assert recompute_held_bytes(once, 2, ["keep", "keep", "recompute"]) == 100
    # A holder named after the block itself (a stale or later index) is not trusted.
    later = dataclasses.replace(once, input_held_earlier=[[100, 3, []]])
    assert recompute_held_bytes(later, 2, ["keep", "keep", "recompute", "keep"]) == 300
