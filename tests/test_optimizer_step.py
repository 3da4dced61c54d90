"""The optimizer's step after backward as a phase of the plan (src/oomless/plan/optimizer_step.py):
its temporaries and the state it brings in, with every gradient on the device."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import oomless
from oomless.plan.optimizer_step import step_temporary_bytes
from oomless.profile.profile import LinkProfile, Profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _profile(device: str, parameters) -> Profile:
    elements = sum(parameter.numel() for parameter in parameters)
    return Profile(device=device, blocks=[], parameter_bytes=4 * elements, gradient_bytes=4 * elements,
                   buffer_bytes=0, optimizer_state_bytes=8 * elements, input_bytes=0, unassigned_saved_bytes=0,
                   loss_seconds=0.0, link=LinkProfile("host", 1e9, 1e9))


@pytest.mark.parametrize("optimizer_class, settings, device, expected", [
    # one tensor at a time (torch's default on CPU): sqrt and its quotient, two of the largest at once
    (torch.optim.Adam, {}, "cpu", 2 * 1000),
    (torch.optim.AdamW, {"weight_decay": 0.1}, "cpu", 2 * 1000),      # decoupled decay: in place
    (torch.optim.Adam, {"weight_decay": 0.1}, "cpu", 3 * 1000),       # L2 decay: grad + param, a third
    # foreach (torch's default on a GPU): one tensor per parameter of the group at once
    (torch.optim.Adam, {}, "cuda:0", 1000 + 300 + 10),
    (torch.optim.Adam, {"foreach": False}, "cuda:0", 2 * 1000),
    (torch.optim.Adam, {"fused": True}, "cuda:0", 0),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}, "cpu", 2 * 1000),
    (torch.optim.SGD, {"lr": 0.1}, "cpu", 0),
    (torch.optim.RMSprop, {}, "cpu", 0),                            # not known: the margin covers it
])
def test_temporaries_follow_torchs_implementations(optimizer_class, settings, device, expected):
    parameters = [nn.Parameter(torch.zeros(size)) for size in (1000, 300, 10)]
    optimizer = optimizer_class(parameters, **settings)
    assert step_temporary_bytes(optimizer, _profile(device, parameters), one_parameter_at_a_time=False) == 4 * expected


def test_one_parameter_at_a_time_and_groups_each_their_own():
    parameters = [nn.Parameter(torch.zeros(size)) for size in (1000, 300, 10)]
    foreach = torch.optim.Adam(parameters)
    assert step_temporary_bytes(foreach, _profile("cuda:0", parameters), one_parameter_at_a_time=True) == 4 * 1000
    grouped = torch.optim.Adam([{"params": parameters[:1]}, {"params": parameters[1:]}])
    assert step_temporary_bytes(grouped, _profile("cuda:0", parameters), one_parameter_at_a_time=False) == 4 * 1000


def _embedding_model(rows: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(rows, 128), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 16))
    tokens = torch.randint(0, rows, (4, 64))
    labels = torch.randint(0, 16, (4, 64))
    return model, tokens, lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten())


def test_where_the_step_sets_the_peak_the_plan_predicts_it_and_names_it():
    """An embedding of 200,000 x 128 (98 MiB) and small activations: Adam's step, one tensor at a time
    on CPU, holds two of the embedding's size beyond the static bytes, more than any phase before
    it. Measured in a fresh process (resident memory, three steps): 587 MiB for 591 predicted (494
    before the step was a phase)."""
    completed = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "optimizer_step_child.py"), "200000",
                                "1GiB"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["peak"] <= result["predicted"] <= 1.10 * result["peak"], result
    model, tokens, loss_fn = _embedding_model(200_000)
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(oomless.PlanError, match="the optimizer's step after backward sets it") as refused:
        oomless.plan(model, tokens, "420MiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=False,
                     offload_optimizer_state=False)
    embedding_bytes = 200_000 * 128 * 4
    assert refused.value.minimum_bytes > 2 * embedding_bytes + 4 * embedding_bytes     # static + temporaries
    # The update in backward steps one module at a time: it fits there.
    plan = oomless.plan(model, tokens, refused.value.minimum_bytes, loss_fn=loss_fn, optimizer=optimizer)
    assert plan.predicted_peak_bytes <= plan.memory_bytes
