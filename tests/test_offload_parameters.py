"""Parameters off the device (runtime/offload_parameters.py): each block's own parameters live in the
tier between uses and training is bit for bit plain PyTorch's, under keep, swap and recompute plans;
the planner moves them when the weights alone exceed the budget; on a CPU-only run resident memory
really holds a few blocks' weights (child process)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import oomless
from oomless.errors import InputError
from oomless.models import MLP, TinyTransformer
from oomless.runtime.update_in_backward import installed_update


def _transformer():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 32))
    return (TinyTransformer(vocab_size=256, dim=64, depth=3, heads=4, max_len=32),
            tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.roll(-1, 1).flatten()))


def _train(model, optimizer, inputs, loss_fn, steps=3):
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)                   # dropout
        loss_fn(model(inputs)).backward()
        optimizer.step()


@pytest.fixture(scope="module")
def transformer_profile():
    model, inputs, loss_fn = _transformer()
    return oomless.profile(model, inputs, loss_fn=loss_fn)


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_offloaded_parameters_train_bit_equal(policy, transformer_profile):
    model, inputs, loss_fn = _transformer()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(reference.parameters())
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, profile=transformer_profile,
                        offload_parameters=True, offload_optimizer_state=True, min_swap_bytes=0)
    assert plan.update_in_backward and plan.offload_parameters
    oomless.apply(model, plan.with_decisions({name: policy for name in plan.decisions}), optimizer=optimizer)
    offloaded = installed_update(model).parameters_off
    # The blocks' own weights are out; the tied embedding and head (outside the blocks) stay.
    assert all(param.shape == (0,) and not param.untyped_storage().nbytes() for param in model.blocks.parameters())
    assert model.token_embedding.weight.untyped_storage().nbytes() == 256 * 64 * 4
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    assert offloaded.brought_in_bytes >= 2 * 3 * offloaded.offloaded_bytes     # forward and backward, 3 steps
    assert all(param.shape == (0,) and not param.untyped_storage().nbytes() for param in model.blocks.parameters())      # out again between steps
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name
    state, expected_state = optimizer.state_dict(), reference_optimizer.state_dict()
    for index, entry in expected_state["state"].items():
        assert all(torch.equal(value, state["state"][index][key]) for key, value in entry.items()), index
    if policy == "swap":        # the brought-in weights are parameters to the saved-tensor engine, not activations
        swapped = oomless.stats(model).offloaded_bytes
        assert 0 < swapped <= 3 * sum(block.saved_bytes for block in plan.blocks)
    oomless.remove(model)
    for expected, actual in zip(reference.parameters(), model.parameters()):
        assert torch.equal(expected, actual)


def test_blocks_of_single_modules_whose_output_view_is_changed_in_place_train_bit_equal():
    """Blocks that are single Linear layers on 3D inputs (their output is a view of the matmul's) and
    a model that adds in place into an output: autograd rebuilds the view's history, so the hook on the
    block's output node never runs; the saved weight is brought back when backward unpacks it."""

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 32)
            self.fc_out = torch.nn.Linear(32, 16)

        def forward(self, x):
            branch = self.fc_out(F.gelu(self.fc(x)))
            branch += x                             # in place into fc_out's output, a view
            return branch

    torch.manual_seed(0)
    model = torch.nn.Sequential(Residual(), Residual())
    inputs = torch.randn(2, 8, 16)
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    loss_fn = lambda out: out.square().mean()      # noqa: E731
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, offload_parameters=True,
                blocks=[torch.nn.Linear])
    assert set(oomless.installed_plan(model).decisions) == {"0.fc", "0.fc_out", "1.fc", "1.fc_out"}
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_load_state_dict_writes_the_new_weights_out(transformer_profile):
    model, inputs, loss_fn = _transformer()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, profile=transformer_profile,
                offload_parameters=True)
    _train(model, optimizer, inputs, loss_fn, steps=1)
    model.load_state_dict(reference.state_dict())
    assert all(param.shape == (0,) and not param.untyped_storage().nbytes() for param in model.blocks.parameters())
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_it_needs_the_update_in_backward(transformer_profile):
    model, inputs, loss_fn = _transformer()
    common = dict(loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters()), profile=transformer_profile,
                  offload_parameters=True)
    with pytest.raises(InputError, match="needs the update in backward"):
        oomless.plan(model, inputs, "1TiB", update_in_backward=False, **common)
    with pytest.raises(InputError, match="offload_parameters=True is not possible: clipping"):
        oomless.plan(model, inputs, "1TiB", max_grad_norm=1.0, **common)



class SideBranch(torch.nn.Module):
    """Its middle block's output feeds only a statistic kept aside, not the loss: that block runs
    forward but its weights get no gradient."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.side = None

    def forward(self, x):
        h = torch.relu(self.blocks[0](x))
        self.side = self.blocks[1](h).detach().mean()
        return self.blocks[2](h)


def test_weights_without_a_gradient_are_placeholders_between_steps_too():
    """A block that ran forward but got no gradient has its weights freed after its forward under
    their real shape; after the step they too become the empty placeholder (reading one gives
    nothing, never a real shape over no memory), as every block's do after a forward under no_grad;
    training equals plain PyTorch."""
    torch.manual_seed(0)
    model, inputs = SideBranch(), torch.randn(8, 32)
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, offload_parameters=True,
                        offload_optimizer_state=True, min_swap_bytes=0, blocks=["blocks.0", "blocks.1", "blocks.2"])
    oomless.apply(model, plan, optimizer=optimizer)
    _train(reference, reference_optimizer, inputs, loss_fn, steps=2)
    _train(model, optimizer, inputs, loss_fn, steps=2)
    assert all(param.shape == (0,) and not param.untyped_storage().nbytes() for param in model.blocks.parameters())
    with torch.no_grad():           # a forward that no backward follows puts them out at its end
        assert torch.equal(model(inputs), reference(inputs))
    assert all(param.shape == (0,) and not param.untyped_storage().nbytes() for param in model.blocks.parameters())
    oomless.remove(model)
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name
    assert torch.equal(model.side, reference.side)

def test_a_model_with_weights_over_twice_the_budget_trains_bit_equal():
    torch.manual_seed(0)
    # 48 layers of 1 MiB: the smallest budget is three blocks' parameters, gradients and state in
    # flight plus the measurement margin (a few MiB of resident-memory noise on CPU, whatever the
    # model's size), so the weights must be large against that for "twice the budget" to mean it.
    model, inputs = MLP((512,) * 49), torch.randn(4, 512)
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer)
    with pytest.raises(oomless.PlanError) as refused:
        oomless.plan(model, inputs, 1, loss_fn=loss_fn, optimizer=optimizer, profile=profile)
    memory = refused.value.minimum_bytes
    assert profile.parameter_bytes >= 2 * memory, (profile.parameter_bytes, memory)
    oomless.fit(model, inputs, memory, loss_fn=loss_fn, optimizer=optimizer, profile=profile)
    plan = oomless.installed_plan(model)
    assert plan.offload_parameters and plan.offload_optimizer_state and plan.update_in_backward
    assert "parameters off the device" in " ".join(plan.notes)
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_resident_memory_of_a_step_is_under_half_the_weights():
    """Child process, CPU-only: a 32-layer MLP, 128 MiB of weights (and 256 MiB of Adam state) trains
    three steps with everything on disk; the peak resident memory above the process before the model
    was built (planning excluded: it profiles the model whole) is under half the weights."""
    script = Path(__file__).with_name("update_in_backward_child.py")
    done = subprocess.run([sys.executable, str(script), "everything", "32"], capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nweights {measured['parameter_bytes'] / 2**20:.1f} MiB, peak above the empty process "
          f"{measured['peak_above_empty_bytes'] / 2**20:.1f} MiB")
    assert measured["parameter_bytes"] >= 2 * measured["peak_above_empty_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_weights_live_in_pinned_host_memory_and_training_is_bit_equal():
    """Pinned host tier: between steps the device holds none of the blocks' weights or Adam state."""
    torch.manual_seed(0)
    model, inputs = MLP((1024,) * 17).cuda(), torch.randn(8, 1024, device="cuda")
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, offload_parameters=True,
                offload_optimizer_state=True)
    torch.cuda.synchronize()
    weights = sum(param.nbytes for param in reference.parameters())
    before = torch.cuda.memory_allocated()
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    torch.cuda.synchronize()
    # The reference's gradients and state (3x its weights) are new on the device; the model's next to nothing.
    assert torch.cuda.memory_allocated() - before <= 3 * weights + weights // 2
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name
