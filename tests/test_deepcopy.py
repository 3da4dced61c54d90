"""``copy.deepcopy`` of a model oomless is applied to (an EMA of the weights, a mean teacher, a
snapshot): the copy is the model as it was before `oomless.apply`, trains bit for bit as plain
PyTorch, and leaves the original applied and working; a plan that steps the optimizer itself
refuses to be copied, saying how (`runtime/deepcopy.py`)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import oomless
from oomless.models import SmallCNN, UNet3D
from tests.conftest import plan_under, train_steps


def _cnn():
    return SmallCNN(in_channels=3, num_classes=10), torch.randn(8, 3, 32, 32), lambda out: out.logsumexp(1).mean()


def _hooks(model) -> int:
    return sum(len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules())


def _assert_copy_is_plain_and_trains_as_plain(model, before, inputs, loss_fn):
    """``model`` is applied; ``before`` a deepcopy of it made before `apply`."""
    copied = copy.deepcopy(model)
    assert not any(name.startswith("_oomless") or name == "__deepcopy__" for module in copied.modules()
                   for name in vars(module)), "no oomless state on the copy"
    assert _hooks(copied) == _hooks(before) == 0
    assert [type(module) for module in copied.modules()] == [type(module) for module in before.modules()]
    reference = copy.deepcopy(before)
    reference.load_state_dict(model.state_dict())
    for one in (copied, reference):
        torch.manual_seed(7)
        loss_fn(one(inputs)).backward()
    for (name, mine), theirs in zip(copied.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs) and torch.equal(mine.grad, theirs.grad), name
    for (name, mine), theirs in zip(copied.named_buffers(), reference.buffers()):
        assert torch.equal(mine, theirs), name
    return copied


@pytest.mark.parametrize("policy", ["swap", "recompute", "planned", "mixed"])
def test_a_copy_is_the_model_before_apply_and_the_original_still_runs_its_plan(policy):
    torch.manual_seed(0)
    model, inputs, loss_fn = _cnn()
    before = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    optimizer, plain_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(plain.parameters())
    if policy == "mixed":       # swap and recompute in turn: a recompute block's hooks hold the engine and its tier
        swapped, _ = plan_under(model, inputs, loss_fn, "swap", optimizer=optimizer)
        plan = swapped.with_decisions({name: ("swap", "recompute")[index % 2]
                                       for index, name in enumerate(swapped.decisions)})
    else:
        plan, _ = plan_under(model, inputs, loss_fn, policy, optimizer=optimizer)
    oomless.apply(model, plan)
    train_steps(model, optimizer, inputs, loss_fn, steps=1)
    train_steps(plain, plain_optimizer, inputs, loss_fn, steps=1)
    copied = _assert_copy_is_plain_and_trains_as_plain(model, before, inputs, loss_fn)
    assert copied.training == model.training
    # The original keeps its plan, its hooks and its counts, and trains as plain PyTorch.
    assert oomless.installed_plan(model) is plan and oomless.stats(model).steps == 1
    train_steps(model, optimizer, inputs, loss_fn, steps=1)
    train_steps(plain, plain_optimizer, inputs, loss_fn, steps=1)
    assert oomless.stats(model).steps == 2
    for (name, mine), theirs in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(mine, theirs), name


def test_an_average_of_the_weights_copies_a_u_net_computed_in_slabs_and_in_bf16():
    """`torch.optim.swa_utils.AveragedModel` deep-copies the model it averages: here one whose
    outer level streams in slabs and whose step runs under bf16 autocast."""
    torch.manual_seed(0)
    volume = torch.randn(2, 1, 16, 16, 16)
    model = UNet3D(base_channels=4, depth=2)

    def loss_fn(out):
        return F.cross_entropy(out.float(), (volume[:, 0] > 0).long())

    before = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters())
    oomless.fit(model, volume, "1GiB", loss_fn=loss_fn, optimizer=optimizer, split={"": 2}, precision="bf16")
    assert oomless.installed_plan(model).split
    _assert_copy_is_plain_and_trains_as_plain(model, before, volume, loss_fn)
    average = torch.optim.swa_utils.AveragedModel(model)
    train_steps(model, optimizer, volume, loss_fn, steps=1)
    average.update_parameters(model)
    for mine, theirs in zip(average.module.parameters(), model.parameters()):
        assert torch.equal(mine, theirs)        # the first average is the model's own weights
    assert _hooks(average.module) == 0


def test_a_plan_stepping_the_optimizer_itself_refuses_a_copy_and_says_how():
    torch.manual_seed(0)
    model, inputs, loss_fn = _cnn()
    optimizer = torch.optim.Adam(model.parameters())
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True)
    with pytest.raises(oomless.ApplyError, match="Copy the model before oomless.apply"):
        copy.deepcopy(model)
    oomless.remove(model)
    assert "__deepcopy__" not in vars(model)        # the model exactly as before
    assert _hooks(copy.deepcopy(model)) == 0
