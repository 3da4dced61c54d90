"""A plan belongs to the model it was made for (`oomless.plan.model_digests`): applied to another
model with the same block names it ran silently with that model's budgets, limits and times; another
instance of the same architecture (fresh weights, a copy) takes it."""

import copy

import pytest
import torch
from torch import nn

import oomless


class _Net(nn.Module):
    def __init__(self, width=32, vocabulary=50):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(3)))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens):
        return self.norm(self.layers(self.embed(tokens))).square().mean(-1)


def _loss(out):
    return out.mean()


def _plan(model, tokens):
    return oomless.plan(model, tokens, "1GiB", loss_fn=_loss, blocks=[f"layers.{k}" for k in range(3)],
                        decisions={f"layers.{k}": "recompute" for k in range(3)})


def _tokens():
    return torch.randint(0, 50, (4, 16))


def test_a_plan_applied_to_another_instance_of_its_architecture_trains_as_plain_pytorch():
    torch.manual_seed(0)
    tokens = _tokens()
    plan = oomless.Plan.from_json(_plan(_Net(), tokens).to_json())
    assert set(plan.model_digests) == {"", "layers.0", "layers.1", "layers.2"}
    torch.manual_seed(1)
    model = _Net()
    reference = copy.deepcopy(model)
    oomless.apply(model, plan)
    _loss(model(tokens)).backward()
    _loss(reference(tokens)).backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name


def test_a_plan_applied_to_a_model_with_a_wider_block_names_that_block():
    tokens = _tokens()
    plan = _plan(_Net(), tokens)
    other = _Net()
    other.layers[1][0] = nn.Linear(32, 32, bias=False)
    with pytest.raises(oomless.ApplyError, match=r"made for another model: block 'layers.1' \(Sequential\).*"
                                                  r"now 0.weight 32x32 float32\).*oomless.plan\(model"):
        oomless.apply(other, plan)
    with pytest.raises(oomless.ApplyError, match="not applied"):
        oomless.remove(other)       # refused before anything was installed
    oomless.apply(_Net(), plan)     # the model it was made for, in a new instance, takes it


def test_a_plan_applied_to_a_model_that_differs_outside_its_blocks_says_so():
    tokens = _tokens()
    plan = _plan(_Net(), tokens)
    with pytest.raises(oomless.ApplyError, match=r"outside its blocks differ.*now embed.weight 60x32 float32, "
                                                  r"norm.weight 32 float32, norm.bias 32 float32\)"):
        oomless.apply(_Net(vocabulary=60), plan)
    with pytest.raises(oomless.ApplyError, match="block 'layers.0' .* float64"):
        oomless.apply(_Net().double(), plan)


def test_a_plan_written_before_digests_applies_as_before():
    import json

    data = json.loads(_plan(_Net(), _tokens()).to_json())
    del data["model_digests"]
    older = oomless.Plan.from_json(json.dumps(data))
    assert older.model_digests is None
    model = _Net()
    model.layers[0][0] = nn.Linear(32, 32, bias=False)
    oomless.apply(model, older)     # nothing to compare with
