"""A plan holds for the mode the model was in when it was made (``model.training``): dropout saves
its masks and BatchNorm its batch statistics only in training mode. A model planned in eval mode
(as ``from_pretrained`` returns it, or after a validation pass) and trained in training mode saves
more than planned; the step says so once."""

import json
import warnings

import torch
from torch import nn

import oomless


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.1), nn.ReLU(), nn.BatchNorm1d(256),
                                         nn.Linear(256, 64)) for _ in range(3)])


def _mode_warnings(model, inputs, grad=True) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.set_grad_enabled(grad):
            loss = model(inputs).sum()
        if grad:
            loss.backward()
    found = [warning for warning in caught if "mode" in str(warning.message)]
    assert all(warning.filename == __file__ for warning in found), "names the loop's line"
    return [str(warning.message) for warning in found]


def test_a_plan_made_in_eval_mode_warns_once_when_the_model_trains():
    model, inputs = _model(), torch.randn(256, 64)
    model.eval()
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=oomless.sum_of_outputs)
    assert plan.training is False
    oomless.apply(model, plan)
    model.train()
    warned = _mode_warnings(model, inputs)
    assert len(warned) == 1 and "training mode, but the plan was made with it in eval mode" in warned[0], warned
    assert "model.train(), then oomless.plan" in warned[0]
    # Why: the training-mode step saved more than the plan counted for it.
    assert oomless.stats(model).peak_activation_bytes > plan.predicted_activation_peak_bytes
    assert _mode_warnings(model, inputs) == []          # once


def test_a_plan_made_in_the_mode_trained_in_does_not_warn():
    model, inputs = _model(), torch.randn(256, 64)
    oomless.fit(model, inputs, "1GiB", loss_fn=oomless.sum_of_outputs)
    assert oomless.installed_plan(model).training is True
    assert _mode_warnings(model, inputs) == []
    model.eval()
    assert _mode_warnings(model, inputs, grad=False) == []      # evaluation without gradients is not a step


def test_the_mode_survives_json_and_a_plan_written_without_it_is_not_checked():
    model, inputs = _model(), torch.randn(256, 64)
    model.eval()
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=oomless.sum_of_outputs)
    assert oomless.Plan.from_json(plan.to_json()).training is False
    older = json.loads(plan.to_json())
    del older["training"]
    oomless.apply(model, oomless.Plan.from_json(json.dumps(older)))
    model.train()
    assert _mode_warnings(model, inputs) == []


def test_a_forward_with_gradients_in_eval_mode_is_warned_and_told_about_no_grad():
    model, inputs = _model(), torch.randn(256, 64)
    oomless.fit(model, inputs, "1GiB", loss_fn=oomless.sum_of_outputs)
    model.eval()
    warned = _mode_warnings(model, inputs)
    assert len(warned) == 1 and "eval mode, but the plan was made with it in training mode" in warned[0], warned
    assert "evaluation pass runs under torch.no_grad()" in warned[0]
