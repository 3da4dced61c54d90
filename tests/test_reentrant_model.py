"""A model that calls itself inside its own forward (a refinement pass over its own first output)
runs under the plan throughout: the inner call's end does not take the outer forward's hooks off.
Before, every tensor the outer forward saved after the inner call returned escaped the plan: kept
on the device, on no ledger (a swap plan offloaded 2 MiB of its 4.5)."""

import copy

import torch
from torch import nn

import oomless


class RefinesItself(nn.Module):
    """Its forward runs its blocks on the input, then on that output, once through a call of itself."""

    def __init__(self, calls_itself: bool = True):
        super().__init__()
        self.calls_itself = calls_itself
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)])

    def forward(self, x, inner: bool = False):
        first = self.blocks(x)
        if inner:
            return first
        again = self(first, inner=True) if self.calls_itself else self.blocks(first)
        return self.blocks(again)


def _swap_everything(model: nn.Module, inputs: torch.Tensor) -> nn.Module:
    decisions = {f"blocks.{index}": "swap" for index in range(4)}
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=lambda out: out.square().mean(), decisions=decisions,
                        min_swap_bytes=0, blocks=list(decisions))
    return oomless.apply(model, plan)


def test_a_model_calling_itself_keeps_its_saves_under_the_plan_and_equals_plain_pytorch():
    torch.manual_seed(0)
    inputs = torch.randn(512, 256)
    model = RefinesItself()
    reference = copy.deepcopy(model)
    unrolled = RefinesItself(calls_itself=False)        # the same step written without the inner call
    unrolled.load_state_dict(model.state_dict())
    reference(inputs).square().mean().backward()
    for applied in (model, unrolled):
        _swap_everything(applied, inputs)
        applied(inputs).square().mean().backward()
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.grad, dict(reference.named_parameters())[name].grad), name
    # Every block's saves swapped in all three passes through the blocks, as when unrolled.
    assert oomless.stats(model).offloaded_bytes == oomless.stats(unrolled).offloaded_bytes > 0
