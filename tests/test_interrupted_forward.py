"""A step stopped half way, and the loop goes on: a forward interrupted by Ctrl-C (a notebook:
interrupt, then run the cell again), a backward that raised.

torch calls a module's ``always_call`` forward hooks when its forward raises an ``Exception``, not
a ``KeyboardInterrupt``: what the plan's pre-hooks opened stayed open. A recompute block's
checkpoint took every later forward's saves (wrong parameters after, or CheckpointError); under
keep and swap every later forward was taken for a call inside the interrupted one, whose registry
grew by each step's saves; bf16's autocast stayed on around everything after. The next forward
closes what the interrupted one left open (`oomless.runtime.open_calls`).
"""

import copy

import pytest
import torch
from torch import nn

import oomless
from tests.conftest import RaisesInBackward


class Interrupts(nn.Module):
    def __init__(self):
        super().__init__()
        self.now = False

    def forward(self, inputs):
        if self.now:
            raise KeyboardInterrupt
        return inputs


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32), Interrupts(), nn.Tanh()),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _loss(out):
    return out.square().mean()


def _train_interrupted(model, batches, interrupted_at=(1, 3)):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        model[1][1].now = step in interrupted_at
        try:
            _loss(model(batch)).backward()
        except KeyboardInterrupt:
            continue
        optimizer.step()
    model[1][1].now = False


def _no_saved_tensor_hooks_left() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_training_after_an_interrupted_forward_equals_plain_pytorch(policy):
    batches = [torch.randn(64, 32) for _ in range(6)]
    model = _model()
    reference = copy.deepcopy(model)
    oomless.fit(model, batches[0], "1TiB", loss_fn=_loss, min_swap_bytes=0, blocks=["0", "1", "2", "4"],
                decisions={"0": "keep", "1": policy, "2": policy, "4": "keep"})
    _train_interrupted(reference, batches)
    _train_interrupted(model, batches)
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected, actual), name
    assert _no_saved_tensor_hooks_left()
    # Every forward after the interrupted one was a step of its own (not a call inside that one).
    assert oomless.stats(model).steps == len(batches)


def test_an_interrupted_bf16_forward_leaves_no_autocast_after_the_next_one():
    batches = [torch.randn(64, 32) for _ in range(3)]
    model = _model()
    oomless.fit(model, batches[0], "1TiB", loss_fn=_loss, precision="bf16", blocks=["0", "1", "2", "4"],
                decisions={"0": "keep", "1": "recompute", "2": "swap", "4": "keep"}, min_swap_bytes=0)
    _train_interrupted(model, batches, interrupted_at=(1,))
    assert not torch.is_autocast_enabled("cpu")
    assert _no_saved_tensor_hooks_left()
    with torch.no_grad():
        assert model(batches[0]).dtype == torch.float32


def test_a_backward_that_raised_after_a_recompute_leaves_nothing_on_the_ledger():
    """The recomputed block's bytes leave the ledger at the end of backward (a queued callback),
    which a backward that raised never reaches: they stayed counted through the evaluation after,
    as saved activations no step held, until the next backward."""
    batches = [torch.randn(64, 32) for _ in range(2)]
    model = _model()
    oomless.fit(model, batches[0], "1TiB", loss_fn=_loss, min_swap_bytes=0, blocks=["0", "1", "2", "4"],
                decisions={"0": "keep", "1": "recompute", "2": "keep", "4": "keep"})
    # Inside block 1: its backward raises after its recompute.
    raising = model[1][0].register_forward_hook(lambda module, args, output: RaisesInBackward.apply(output))
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        _loss(model(batches[1])).backward()
    raising.remove()
    model.zero_grad()
    with torch.no_grad():
        model(batches[0])
    assert oomless.stats(model).resident_activation_bytes == 0
