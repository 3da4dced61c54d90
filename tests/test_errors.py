"""Bad input gets a clear error that says what was wrong and what would work, and changes nothing."""

import copy

import pytest
import torch

import oomless
from oomless.models import SmallCNN
from oomless.plan.planner import named_margin_bytes, smallest_memory


def _model_and_inputs():
    torch.manual_seed(0)
    return SmallCNN(in_channels=3, num_classes=10), torch.randn(4, 3, 16, 16)


def _loss(out):
    return out.logsumexp(1).mean()


def _assert_untouched(model, before):
    assert not hasattr(model, "_oomless")
    for name, module in model.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, f"hooks left on {name!r}"
    for (name, expected), (_, actual) in zip(before.state_dict().items(), model.state_dict().items()):
        assert torch.equal(expected, actual), f"{name} changed"
    assert all(p.grad is None for p in model.parameters())


def test_memory_too_small_names_the_minimum_and_the_block():
    model, inputs = _model_and_inputs()
    before = copy.deepcopy(model)
    with pytest.raises(oomless.PlanError) as error:
        oomless.fit(model, inputs, "1KiB", loss_fn=_loss)
    assert error.value.minimum_bytes > 1024
    assert str(error.value.minimum_bytes) in str(error.value)
    assert error.value.limiting_block is None or error.value.limiting_block in dict(model.named_modules())
    _assert_untouched(model, before)
    # The named minimum is a budget that works.
    oomless.fit(model, inputs, error.value.minimum_bytes, loss_fn=_loss)


def test_a_deferred_refusal_names_its_budget_once_when_read_and_travels_named():
    """The planner's refusals name their smallest budget when it is read (`PlanError.deferred`): a
    planning call refuses many candidates and reports one. Read any way (the attribute, the message,
    a copy, a pickle, the plain data a collective carries), it is named once, the same."""
    import pickle

    from oomless.parallel.process_group import from_shared, shareable

    calls = []

    def named():
        calls.append(1)
        return f"no plan fits 1 byte: the smallest budget that fits is {5 * 2**20} bytes", 5 * 2**20, "layers.1"

    def refusal():
        return oomless.PlanError.deferred(named, limiting_block="layers.0")

    error = refusal()
    assert calls == [] and error.limiting_block == "layers.0" and calls == []
    assert error.floor_block == "layers.1" and calls == [1]
    error = refusal()
    assert error.minimum_bytes == 5 * 2**20 and str(5 * 2**20) in str(error) and calls == [1, 1]
    assert error.minimum_bytes == 5 * 2**20 and error.floor_block == "layers.1" and calls == [1, 1]
    for read in (str, repr, copy.copy, lambda e: pickle.loads(pickle.dumps(e)), lambda e: e.to_raise()):
        calls.clear()
        error = refusal()
        seen = read(error)
        assert calls == [1] and error.minimum_bytes == 5 * 2**20 and calls == [1]
        if isinstance(seen, oomless.PlanError):
            assert seen.minimum_bytes == 5 * 2**20 and str(seen) == str(error)
    shared = shareable(refusal())
    assert shared["attributes"]["minimum_bytes"] == 5 * 2**20
    with pytest.raises(oomless.PlanError, match=f"is {5 * 2**20} bytes") as raised:
        from_shared(shared)
    assert raised.value.minimum_bytes == 5 * 2**20 and raised.value.limiting_block == "layers.0"
    assert raised.value.floor_block == "layers.1"
    error = refusal()
    error.note_split("layers.0 in slabs")
    assert str(error).endswith("(layers.0 in slabs)") and error.minimum_bytes == 5 * 2**20
    with pytest.raises(AttributeError):
        refusal().not_an_attribute


def test_the_named_minimum_given_back_plans_from_the_same_measurements(monkeypatch):
    """Each profile of a step measures a little differently; the budget a PlanError names is a
    promise about the step it measured. Given back (or more) for the same step, plan reuses that
    profile, so it is accepted even where a new measurement would name more; anything else (a
    smaller budget, other inputs) measures again. Here every profile measures each block's working
    memory half as much again as the one before, far beyond the named budget's margin."""
    import dataclasses

    import oomless.api

    measured = []
    real = oomless.api.profile_configured

    def noisier(*args, **kwargs):
        profile = real(*args, **kwargs)
        grow = 1 + 0.5 * len(measured)
        measured.append(dataclasses.replace(profile, blocks=[dataclasses.replace(
            block, forward_transient_bytes=int(block.forward_transient_bytes * grow),
            backward_transient_bytes=int(block.backward_transient_bytes * grow)) for block in profile.blocks]))
        return measured[-1]

    monkeypatch.setattr(oomless.api, "profile_configured", noisier)
    torch.manual_seed(0)
    model, inputs = SmallCNN(in_channels=3, num_classes=10), torch.randn(32, 3, 64, 64)
    with pytest.raises(oomless.PlanError) as error:
        oomless.plan(model, inputs, "1KiB", loss_fn=_loss, split=False)
    named = error.value.minimum_bytes
    plan = oomless.plan(model, inputs, named, loss_fn=_loss, split=False)
    assert len(measured) == 1 and plan.memory_bytes == named
    # Within the named budget less the margin it carries for the step as it trains (a faster plan
    # filling the whole of it went 0.4 MiB over in CI's floor test).
    assert plan.predicted_peak_bytes <= named - named_margin_bytes(named)
    whole = oomless.plan(model, inputs, named, profile=measured[0], loss_fn=_loss, split=False)
    assert plan.activation_budget == whole.activation_budget - named_margin_bytes(named)
    # Not the same request: measured again each time.
    with pytest.raises(oomless.PlanError):
        oomless.plan(model, inputs, 1024, loss_fn=_loss, split=False)          # a smaller budget
    assert len(measured) == 2
    with pytest.raises(oomless.PlanError):
        oomless.plan(model, inputs[:16], 1024, loss_fn=_loss, split=False)    # other inputs
    assert len(measured) == 3
    # The last refusal's number, given back, is accepted from that refusal's own profile.
    with pytest.raises(oomless.PlanError) as again:
        oomless.plan(model, inputs, 1024, loss_fn=_loss, split=False)
    plan = oomless.plan(model, inputs, again.value.minimum_bytes, loss_fn=_loss, split=False)
    assert len(measured) == 4 and plan.predicted_peak_bytes <= again.value.minimum_bytes


def test_block_forcing_the_minimum_is_named_when_static_bytes_fit():
    model, inputs = _model_and_inputs()
    profile = oomless.profile(model, inputs, loss_fn=_loss)
    roomy = oomless.plan(model, inputs, "1GiB", profile=profile)
    between = roomy.static_bytes + (smallest_memory(profile) - roomy.static_bytes) // 2   # static bytes fit, the step not
    with pytest.raises(oomless.PlanError) as error:
        oomless.plan(model, inputs, between, profile=profile)
    assert error.value.limiting_block in [block.name for block in profile.blocks]
    assert error.value.limiting_block in str(error.value)


def test_a_profile_given_without_its_loss_is_refused_as_measured():
    """Splitting the chain that sets the floor measures the step again; planned from the caller's
    profile without loss_fn, the step's loss is not known, and the PlanError stands (it was an
    InputError about the model's output wherever the floor fell in a chain: a U-Net's stages are)."""
    from oomless.models import UNet3D

    torch.manual_seed(0)
    model, volume = UNet3D(base_channels=4, depth=2), torch.randn(1, 1, 16, 16, 16)
    profile = oomless.profile(model, volume, loss_fn=oomless.sum_of_outputs)
    roomy = oomless.plan(model, volume, "1GiB", profile=profile)
    between = roomy.static_bytes + (smallest_memory(profile) - roomy.static_bytes) // 2
    with pytest.raises(oomless.PlanError) as error:
        oomless.plan(model, volume, between, profile=profile)
    assert error.value.limiting_block is not None


@pytest.mark.parametrize("size", ["20 gigs", "GiB", "-5GiB", "1.5XB", "", 0])
def test_size_that_does_not_parse(size):
    model, inputs = _model_and_inputs()
    before = copy.deepcopy(model)
    with pytest.raises(oomless.SizeError, match="memory size"):
        oomless.fit(model, inputs, size, loss_fn=_loss)
    _assert_untouched(model, before)


@pytest.mark.parametrize("text, expected", [("512MiB", 512 * 2**20), ("20GiB", 20 * 2**30), ("1.5GB", 1_500_000_000),
                                            ("1 kb", 1000), (4096, 4096), ("4096", 4096), ("2e3", 2000)])
def test_sizes_parse(text, expected):
    assert oomless.parse_bytes(text) == expected


def test_inputs_on_another_device_than_the_model():
    model, inputs = _model_and_inputs()
    before = copy.deepcopy(model)
    with pytest.raises(oomless.InputError, match="move the inputs"):
        oomless.fit(model, inputs.to("meta"), "1GiB", loss_fn=_loss)
    _assert_untouched(model, before)
    with pytest.raises(oomless.InputError, match="meta device"):
        oomless.fit(model.to("meta"), inputs.to("meta"), "1GiB", loss_fn=_loss)


def test_apply_twice():
    model, inputs = _model_and_inputs()
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss)
    oomless.apply(model, plan)
    hooks = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}
    with pytest.raises(oomless.ApplyError, match="already applied"):
        oomless.apply(model, plan)
    with pytest.raises(oomless.ApplyError, match="already applied"):
        oomless.fit(model, inputs, "1GiB", loss_fn=_loss)
    assert hooks == {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}
    oomless.remove(model)
    with pytest.raises(oomless.ApplyError, match="not applied"):
        oomless.remove(model)


def test_output_not_a_scalar_loss_and_no_loss_fn():
    model, inputs = _model_and_inputs()
    before = copy.deepcopy(model)
    with pytest.raises(oomless.InputError, match="not a scalar loss.*loss_fn"):
        oomless.fit(model, inputs, "1GiB")
    _assert_untouched(model, before)
    oomless.fit(model, inputs, "1GiB", loss_fn=oomless.sum_of_outputs)  # the suggested fix works


@pytest.mark.parametrize("target", [None, "h100"])
def test_a_loss_without_gradient_names_why(target):
    model, inputs = _model_and_inputs()
    frozen = copy.deepcopy(model).requires_grad_(False)
    with pytest.raises(oomless.InputError, match="does not require grad.*requires_grad=True"):
        oomless.fit(frozen, inputs, "1GiB", loss_fn=_loss, target=target)
    _assert_untouched(frozen, model)
    with pytest.raises(oomless.InputError, match="does not require grad.*detached"):
        oomless.fit(model, inputs, "1GiB", loss_fn=lambda out: _loss(out.detach()), target=target)
    with torch.no_grad(), pytest.raises(oomless.InputError, match=r"gradients off.*torch.no_grad\(\)"):
        oomless.fit(model, inputs, "1GiB", loss_fn=_loss, target=target)
    _assert_untouched(model, frozen)


def test_plan_for_another_model():
    model, inputs = _model_and_inputs()
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(oomless.ApplyError, match="does not have"):
        oomless.apply(other, plan)
    assert not hasattr(other, "_oomless")


def test_blocks_that_do_not_exist():
    model, inputs = _model_and_inputs()
    with pytest.raises(oomless.InputError, match="not modules of the model"):
        oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["no.such.block"])
