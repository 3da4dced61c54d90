"""Models as users write them, every block forced to a decision, against plain PyTorch bit for bit.

Found by forcing each block of small models in turn to keep, swap, recompute and selective
recompute (and all of them at once), with fp32 and bf16 autocast, and comparing parameters,
gradients and buffers after two SGD-with-momentum steps against a deepcopy trained without oomless.
Each test here is a case that was not bit-equal, or raised where plain PyTorch does not.
"""

import copy

import pytest
import torch
from torch import nn

import oomless
from tests.conftest import needs_selective


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.linear, self.dropout = nn.Linear(width, width), nn.Dropout(0.2)

    def forward(self, x):
        return self.dropout(torch.tanh(self.linear(x)))


class CalledTwice(nn.Module):
    """Block ``a`` runs twice in one forward (weight sharing): ``a(b(a(x)))``."""

    def __init__(self, width=16):
        super().__init__()
        self.a, self.b, self.c = Block(width), Block(width), nn.Linear(width, 1)

    def forward(self, x):
        return self.c(self.a(self.b(self.a(x))))


def _loss(output):
    return output.float().square().mean()


def _train(model, inputs, autocast_dtype=None, steps=2):
    """SGD with momentum; the forward under autocast where ``autocast_dtype`` is given (plain
    PyTorch's bf16), its output brought back to fp32 for the loss as oomless does. Returns each
    step's gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gradients = []
    for step in range(steps):
        optimizer.zero_grad()
        torch.manual_seed(100 + step)
        if autocast_dtype is None:
            output = model(inputs)
        else:
            with torch.autocast("cpu", dtype=autocast_dtype):
                output = model(inputs)
            output = output.float()
        _loss(output).backward()
        gradients.append({name: parameter.grad.clone() for name, parameter in model.named_parameters()})
        optimizer.step()
    return gradients


def _assert_same(model, reference, gradients, reference_gradients):
    for step, (these, those) in enumerate(zip(gradients, reference_gradients)):
        for name in those:
            assert torch.equal(these[name], those[name]), f"step {step}: gradient of {name}"
    parameters = dict(model.named_parameters())
    for name, parameter in reference.named_parameters():
        assert torch.equal(parameters[name], parameter), name
    buffers = dict(model.named_buffers())
    for name, buffer in reference.named_buffers():
        assert torch.equal(buffers[name], buffer), name


@pytest.mark.parametrize("selective", [["a"], ["a", "b", "c"]], ids=["a-selective", "all-selective"])
def test_bf16_selective_recompute_of_a_block_called_twice_equals_plain_autocast(selective):
    """Autocast caches its bf16 copy of a weight for the forward: the second call of ``a`` casts
    none, but its recompute (in an autocast of its own) casts again. Torch's selective checkpoint
    looked every op of the recompute up among the forward's, and raised on the cast it had not seen
    ("aten._to_copy.default encountered during backward but not found in storage")."""
    needs_selective()
    torch.manual_seed(0)
    model, inputs = CalledTwice(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    reference_gradients = _train(reference, inputs, torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    decisions = {name: "selective" if name in selective else "keep" for name in ("a", "b", "c")}
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, optimizer=optimizer, precision="bf16",
                        blocks=["a", "b", "c"], decisions=decisions, update_in_backward=False)
    assert [block.selective for block in plan.blocks] == [name in selective for name in ("a", "b", "c")]
    oomless.apply(model, plan)
    _assert_same(model, reference, _train(model, inputs), reference_gradients)


class ChangesASavedOutput(nn.Module):
    """Adds to ``a``'s output in place after ``c`` read it: ``a``'s Tanh saved that output for its
    backward, so plain PyTorch's backward refuses (autograd's version check)."""

    def __init__(self, width=16):
        super().__init__()
        self.a, self.c = nn.Sequential(nn.Linear(width, width), nn.Tanh()), nn.Linear(width, 1)
        self.changes = True

    def forward(self, x):
        hidden = self.a(x)
        out = self.c(hidden)
        if self.changes:
            hidden.add_(1.0)
        return out


def test_a_kept_tensor_changed_in_place_after_it_was_saved_is_refused_as_plain_pytorch_refuses_it():
    """Saved-tensor hooks (the plan's, around the whole forward) take autograd's version check away:
    a kept block's backward read the changed output and gave wrong gradients without a word."""
    torch.manual_seed(0)
    model, inputs = ChangesASavedOutput(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _loss(reference(inputs)).backward()
    options = dict(loss_fn=_loss, blocks=["a", "c"], decisions={"a": "keep", "c": "keep"})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        oomless.plan(model, inputs, "1GiB", **options)      # its profiling step, as plain PyTorch's
    model.changes = False
    plan = oomless.plan(model, inputs, "1GiB", **options)
    oomless.apply(model, plan)
    model.changes = True
    for _ in range(3):      # the counted forwards of an all-keep plan, and one past them
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _loss(model(inputs)).backward()
