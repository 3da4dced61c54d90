"""Recompute blocks whose inputs change in place, and a second backward through a recomputed block.

A block whose forward changes its own input in place (a LeakyReLU(inplace=True) as its first op,
``x.mul_(...)``) left its recompute starting from the changed values: the recomputed saved tensors
differed from the forward's, and the gradients were wrong without a word (torch's checkpoint refuses
the same block). The profile now records it (`BlockProfile.changes_input`) and its recompute starts
from a copy of its inputs taken before its forward, and a plan that did not see the change refuses it.
(An input the model changes after the block ran: tests/test_changed_after_saved.py.) A backward with
``create_graph=True`` (a gradient penalty) through a recomputed block with BatchNorm raised in its
second backward."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import oomless


class Doubles(nn.Module):
    """Doubles its input in place, then a linear layer and dropout."""

    def __init__(self, width):
        super().__init__()
        self.linear, self.dropout = nn.Linear(width, width), nn.Dropout(0.3)

    def forward(self, x):
        return self.dropout(self.linear(x.mul_(2.0)))


class Net(nn.Module):
    def __init__(self, middle, width=32):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), middle, nn.Linear(width, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _leaky(width=32):
    return nn.Sequential(nn.LeakyReLU(0.1, inplace=True), nn.Linear(width, width), nn.Dropout(0.3))


def _loss(out):
    return out.square().mean()


def _train(model, inputs, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        torch.manual_seed(100 + step)
        _loss(model(inputs)).backward()
        optimizer.step()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def _assert_same(model, reference, gradients, reference_gradients):
    for name, parameter in reference.named_parameters():
        assert torch.equal(gradients[name], reference_gradients[name]), name
        assert torch.equal(dict(model.named_parameters())[name], parameter), name


@pytest.mark.parametrize("middle", [_leaky, lambda: Doubles(32)], ids=["leaky-relu-in-place", "mul-in-place"])
def test_a_block_that_changes_its_input_in_place_recomputes_from_its_input_as_it_was(middle):
    torch.manual_seed(0)
    model, inputs = Net(middle()), torch.randn(64, 32)
    reference = copy.deepcopy(model)
    reference_gradients = _train(reference, inputs)
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["a", "b", "c"],
                        decisions={"a": "keep", "b": "recompute", "c": "keep"})
    assert {block.name: block.changes_input for block in plan.blocks} == {"a": False, "b": True, "c": False}
    oomless.apply(model, plan)
    _assert_same(model, reference, _train(model, inputs), reference_gradients)


def test_a_profile_on_meta_tensors_sees_the_change_in_place_too():
    profile = oomless.profile(Net(_leaky()), torch.randn(64, 32), loss_fn=_loss, blocks=["a", "b", "c"], target="h100")
    assert [block.changes_input for block in profile.blocks] == [False, True, False]


def test_a_profile_without_a_budget_rehearses_its_recompute_from_a_copy():
    """Without a budget the profile's timing step recomputes every block: it refused such a block
    ("changed its own input in place ... which its profile did not show": the sizing step's finding
    was not passed to the timing step)."""
    profile = oomless.profile(Net(_leaky()), torch.randn(64, 32), loss_fn=_loss, blocks=["a", "b", "c"])
    assert [block.changes_input for block in profile.blocks] == [False, True, False]


def test_a_plan_that_did_not_see_the_change_is_refused_at_the_forward_naming_the_block():
    torch.manual_seed(0)
    model, inputs = Net(_leaky()), torch.randn(64, 32)
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["a", "b", "c"],
                        decisions={"a": "keep", "b": "recompute", "c": "keep"})
    # As a plan saved before profiles recorded it would read.
    unseen = dataclasses.replace(plan, blocks=[dataclasses.replace(block, changes_input=False) for block in plan.blocks])
    oomless.apply(model, unseen)
    with pytest.raises(oomless.ApplyError, match=r"block b changed its own input in place.*plan again"):
        model(inputs)


class ChangedAfter(nn.Module):
    """``squash`` (a Tanh: saves its output, not its input) reads ``h``; the forward then halves
    ``h`` in place. Plain PyTorch trains: nothing saved reads ``h``. A recompute of ``squash`` does."""

    def __init__(self, width=32):
        super().__init__()
        self.stem, self.squash, self.head = nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)

    def forward(self, x):
        h = self.stem(x)
        squashed = self.squash(h)
        h.mul_(0.5)
        return self.head(squashed + h)


@pytest.mark.parametrize("profile_on", ["cpu", "meta"])
def test_a_block_whose_input_the_model_changes_after_its_call_recomputes_from_its_input_as_it_was(profile_on):
    """The profile sees the change (after the call, before backward) as it sees a block's own: the
    recompute starts from a copy taken at the call (it raised autograd's error, as torch's checkpoint
    does, where plain PyTorch trains)."""
    torch.manual_seed(0)
    model, inputs = ChangedAfter(), torch.randn(64, 32)
    reference = copy.deepcopy(model)
    reference_gradients = _train(reference, inputs)
    blocks = ["stem", "squash", "head"]
    if profile_on == "meta":
        profile = oomless.profile(model, inputs, loss_fn=_loss, blocks=blocks, target="h100")
        assert [block.changes_input for block in profile.blocks] == [False, True, False]
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=blocks,
                        decisions={"stem": "keep", "squash": "recompute", "head": "keep"})
    assert [block.changes_input for block in plan.blocks] == [False, True, False]
    oomless.apply(model, plan)
    _assert_same(model, reference, _train(model, inputs), reference_gradients)
    assert oomless.stats(model).recomputed_blocks >= 2


def test_a_gradient_penalty_through_a_recomputed_batchnorm_block_equals_plain_pytorch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()),
                          nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    inputs = torch.randn(32, 8)

    def step(net):
        x = inputs.clone().requires_grad_()
        out = net(x)
        slope, = torch.autograd.grad(out.sum(), x, create_graph=True)
        (_loss(out) + slope.square().mean()).backward()

    step(reference)
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["0", "1", "2"],
                        decisions={"0": "keep", "1": "recompute", "2": "keep"})
    oomless.apply(model, plan)
    step(model)
    for name, parameter in reference.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name].grad, parameter.grad), name
    for name, buffer in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
