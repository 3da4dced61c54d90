"""Gradients are made in backward (plan/simulate.py `gradients_absent_bytes`): a step that starts
from ``optimizer.zero_grad()`` (set_to_none, PyTorch's default) holds none in its forward and its loss,
and in a block's backward those accumulated so far, the later blocks' first. The plan counts them so:
the room they do not take yet is room for activations (the forward's peak is plain PyTorch's too).
Not where gradients live through the step: accumulation, data parallel, FSDP, pipeline stages."""

import dataclasses

import pytest
import torch
from torch import nn

import oomless
from oomless.models import MLP
from oomless.plan.planner import make_plan, smallest_memory


def _case():
    torch.manual_seed(0)
    model = MLP((256, 512, 512, 512, 512, 256))
    return model, torch.randn(512, 256), (lambda out: out.square().mean())


@pytest.fixture(scope="module")
def profiled():
    model, inputs, loss_fn = _case()
    return oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters()))


def test_each_block_records_the_gradients_accumulated_by_the_end_of_its_backward(profiled):
    model, _, _ = _case()
    modules = dict(model.named_modules())
    owned = [sum(p.nbytes for p in modules[block.name].parameters()) for block in profiled.blocks]
    assert profiled.gradients_from_backward
    for index, block in enumerate(profiled.blocks):
        # Backward runs the blocks in reverse: this one's and every later one's gradients exist.
        assert block.backward_gradient_bytes == sum(owned[index:]), block.name
    assert profiled.blocks[0].backward_gradient_bytes == profiled.gradient_bytes


def test_the_forward_has_the_gradients_room_and_the_floor_drops(profiled):
    counted_whole = dataclasses.replace(profiled, gradients_from_backward=False)
    assert smallest_memory(profiled) < smallest_memory(counted_whole)
    assert smallest_memory(counted_whole) - smallest_memory(profiled) <= profiled.gradient_bytes
    roomy = make_plan(profiled, 2**40)
    whole = make_plan(counted_whole, 2**40)
    assert roomy.plain_peak_bytes < whole.plain_peak_bytes
    assert roomy.gradients_from_backward and not whole.gradients_from_backward
    # The forward's limits have the room of the gradients not made yet, the first block's backward none.
    assert roomy.blocks[0].forward_limit_bytes - whole.blocks[0].forward_limit_bytes == \
        profiled.gradient_bytes + (whole.static_bytes - roomy.static_bytes)


def test_gradient_accumulation_counts_every_gradient_for_the_whole_step(profiled):
    model, inputs, loss_fn = _case()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    one = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, profile=profiled)
    accumulating = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, profile=profiled,
                                accumulation_steps=4)
    assert one.gradients_from_backward and not accumulating.gradients_from_backward
    assert accumulating.plain_peak_bytes > one.plain_peak_bytes


def test_a_step_that_starts_with_gradients_is_warned_about_once(profiled):
    model, inputs, loss_fn = _case()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    roomy = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, profile=profiled,
                         update_in_backward=False)
    # Where they could not take the step past the plan's memory, nothing is said.
    oomless.apply(model, roomy)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model(inputs)).backward()
        loss_fn(model(inputs)).backward()
    oomless.remove(model)
    model.zero_grad()
    # A plan that fills its memory: the gradients of a step without zero_grad could pass it.
    tight = roomy.predicted_peak_bytes + profiled.gradient_bytes // 2
    oomless.fit(model, inputs, tight, loss_fn=loss_fn, optimizer=optimizer, profile=profiled,
                update_in_backward=False)
    loss_fn(model(inputs)).backward()
    optimizer.step()
    with pytest.warns(UserWarning, match="starts with .* of gradients"):
        loss_fn(model(inputs)).backward()     # no zero_grad: the gradients of the last step are still there
    optimizer.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model(inputs)).backward()     # from zero_grad: nothing to say
        model(inputs)                         # with gradients again, but said once already
    oomless.remove(model)


def test_a_plain_step_measured_peaks_where_the_plan_counts_the_gradients(tmp_path):
    """The model of the step is plain PyTorch's: with every block kept, the plan's prediction of a
    plain step (the plain peak) is no lower than the measured one (resident memory, child process)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = r"""
import gc, json, torch
import oomless
from oomless.models import MLP
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system
torch.set_num_threads(1)
return_freed_memory_to_the_system()
def case():
    torch.manual_seed(0)
    return MLP((256, 512, 512, 512, 512, 256)), torch.randn(512, 256)
warm, x = case(); o = torch.optim.Adam(warm.parameters()); warm(x).square().mean().backward(); o.step(); del warm, o; gc.collect()
model, x = case()
optimizer = torch.optim.Adam(model.parameters())
plan = oomless.plan(model, x, "1TiB", loss_fn=lambda out: out.square().mean(), optimizer=optimizer)
gc.collect()
for _ in range(2):                                   # Adam's state exists from the first step on
    optimizer.zero_grad(); model(x).square().mean().backward(); optimizer.step()
optimizer.zero_grad(); gc.collect()
base = current_rss_bytes() - plan.static_bytes + plan.static_breakdown["gradients"]    # less the static bytes held now
reset_peak_rss()
model(x).square().mean().backward(); optimizer.step()
print(json.dumps({"measured": peak_rss_bytes() - base, "predicted_plain": plan.plain_peak_bytes}))
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.path.join(root, "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["measured"] <= found["predicted_plain"], found
