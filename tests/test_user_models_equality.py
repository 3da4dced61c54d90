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


def test_a_second_backward_after_a_recomputed_relu_in_place_equals_plain_pytorch():
    """A ReLU(inplace=True) block's recompute changes its input in place again, to the same values:
    the next block's saved input (that storage) reads a higher version in a second backward
    (retain_graph=True; a zero-bubble pipeline's weight pass alike). A check of kept tensors'
    versions refused this valid step; the values, and so the gradients, are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 1))
    reference, inputs = copy.deepcopy(model), torch.randn(16, 32)

    def step(net):
        loss = _loss(net(inputs))
        loss.backward(retain_graph=True)
        loss.backward()

    step(reference)
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["0", "1", "2"],
                        decisions={"0": "keep", "1": "recompute", "2": "keep"})
    oomless.apply(model, plan)
    step(model)
    for name, parameter in reference.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name].grad, parameter.grad), name
