"""The plan counts static bytes with where they live, and the planner decides the optimizer step in
backward for the budget (plan/static.py): off when the plain step fits, on when only the gradients
it frees make the plan fit, forced either way by the user, each decision printed with its reason."""

import copy

import pytest
import torch

import oomless
from oomless.errors import PlanError
from oomless.models import MLP
from oomless.plan.planner import smallest_memory
from oomless.plan.static import device_view, gradient_bytes_in_backward


def _case():
    torch.manual_seed(0)
    model = MLP((512,) * 9)                  # 8 layers of 1 MiB: gradients are most of the step
    inputs = torch.randn(4, 512)
    return model, inputs, (lambda out: out.square().mean())


@pytest.fixture(scope="module")
def profiled():
    model, inputs, loss_fn = _case()
    optimizer = torch.optim.Adam(model.parameters())
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer)
    in_backward_bytes = gradient_bytes_in_backward(model, profile)
    return profile, smallest_memory(profile), smallest_memory(device_view(profile, in_backward_bytes))


def _notes(plan) -> str:
    return " | ".join(plan.notes)


def test_a_roomy_budget_keeps_the_update_after_backward(profiled):
    profile, _, _ = profiled
    model, inputs, loss_fn = _case()
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters()),
                        profile=profile)
    assert not plan.update_in_backward and not plan.offload_optimizer_state
    assert "update in backward: off, optimizer state on the device, parameters on the device (the step fits with every block kept" in _notes(plan)
    gradients = {part.name: part for part in plan.static_parts}["gradients"]
    assert gradients.device_bytes == gradients.total_bytes == profile.gradient_bytes and gradients.where == "device"
    assert plan.static_bytes == sum(part.device_bytes for part in plan.static_parts)


def test_the_planner_steps_in_backward_when_only_that_fits_and_training_is_unchanged(profiled):
    profile, without_minimum, with_minimum = profiled
    largest_module_bytes = (512 * 512 + 512) * 4
    # Gradients counted from backward on: the peak is where they all exist (the last backward phase)
    # without, and a phase next to it with; their own working memory differs by a few KiB.
    assert with_minimum <= without_minimum - profile.gradient_bytes + largest_module_bytes + profile.gradient_bytes // 100
    memory = (with_minimum + without_minimum) // 2
    model, inputs, loss_fn = _case()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    with pytest.raises(PlanError):              # all on the device, it does not fit
        oomless.plan(model, inputs, memory, loss_fn=loss_fn, optimizer=optimizer, profile=profile,
                     update_in_backward=False, offload_optimizer_state=False)
    oomless.fit(model, inputs, memory, loss_fn=loss_fn, optimizer=optimizer, profile=profile)
    plan = oomless.installed_plan(model)
    # Moving the state too would fit, but its copies cost time: only the gradients move.
    assert plan.update_in_backward and not plan.offload_optimizer_state
    assert "update in backward: on, optimizer state on the device, parameters on the device (predicted step" in _notes(plan)
    assert "no plan fits with update in backward: off, optimizer state on the device, parameters on the device" in _notes(plan)
    gradients = {part.name: part for part in plan.static_parts}["gradients"]
    assert gradients.device_bytes == largest_module_bytes and gradients.total_bytes == profile.gradient_bytes
    assert "update in backward" in gradients.where
    assert plan.static_bytes + plan.reserve_bytes + plan.predicted_activation_peak_bytes <= memory
    assert plan.plain_peak_bytes > memory       # plain PyTorch holds every gradient
    printed = str(plan)
    assert "gradients 1.00 MiB of 8.02 MiB (device, one module's at a time" in printed
    assert "update in backward: on" in printed
    assert "optimizer state 16.03 MiB" in printed      # on the device, all of it

    for batch in range(3):
        for trained, trained_optimizer in ((reference, reference_optimizer), (model, optimizer)):
            trained_optimizer.zero_grad(set_to_none=True)
            loss_fn(trained(inputs + batch)).backward()
            trained_optimizer.step()
    for expected, actual in zip(reference.parameters(), model.parameters()):
        assert torch.equal(expected, actual)


def test_the_smallest_memory_reported_counts_what_can_move(profiled):
    profile, without_minimum, with_minimum = profiled
    model, inputs, loss_fn = _case()
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(PlanError, match="counting update in backward: on, optimizer state off the device, "
                                        "parameters off the device") as refused:
        oomless.plan(model, inputs, 1, loss_fn=loss_fn, optimizer=optimizer, profile=profile)
    assert refused.value.minimum_bytes < with_minimum < without_minimum
    plan = oomless.plan(model, inputs, refused.value.minimum_bytes, loss_fn=loss_fn, optimizer=optimizer,
                        profile=profile)
    assert plan.update_in_backward and plan.offload_optimizer_state and plan.offload_parameters
    with pytest.raises(PlanError):              # forced to keep the state on the device, it does not fit
        oomless.plan(model, inputs, refused.value.minimum_bytes, loss_fn=loss_fn, optimizer=optimizer,
                     profile=profile, offload_optimizer_state=False)


class _Refusing:
    """Stands for `plan.static._Candidates`: every placement refused, each naming its own smallest budget."""

    def __init__(self, minimums):
        self.minimums = minimums

    def plan(self, placement):
        return PlanError(f"no plan fits; the smallest budget is {self.minimums[placement]}",
                         minimum_bytes=self.minimums[placement])


def test_where_no_placement_fits_the_refusal_names_the_smallest_budget_of_any():
    # Moving more off the device lowers static bytes but takes working memory of its own (the
    # copies back): the placement that holds least need not name the least budget.
    from oomless.plan.static import Placement, _choose
    placements = [Placement(), Placement(True), Placement(True, True), Placement(True, True, True)]
    minimums = dict(zip(placements, (9 * 2**20, 7 * 2**20, 8 * 2**20, 8 * 2**20)))
    with pytest.raises(PlanError) as refused:
        _choose(_Refusing(minimums), placements)
    assert refused.value.minimum_bytes == 7 * 2**20
    assert "counting update in backward: on, optimizer state on the device, parameters on the device" in \
        str(refused.value)
    assert "parameters off the device, the least the device can hold, the smallest budget is 8.00 MiB" in \
        str(refused.value)
    # Where it does name the least (ties included), it is the one named.
    minimums[placements[1]] = 8 * 2**20
    with pytest.raises(PlanError) as refused:
        _choose(_Refusing(minimums), placements)
    assert refused.value.minimum_bytes == 8 * 2**20
    assert "parameters off the device, the least the device can hold; no placement" in str(refused.value)


def test_forced_on_at_a_roomy_budget_and_saved_as_json(profiled):
    profile, _, _ = profiled
    model, inputs, loss_fn = _case()
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        profile=profile, update_in_backward=True, accumulation_steps=2)
    assert plan.update_in_backward and plan.accumulation_steps == 2
    assert "update in backward: on, optimizer state on the device, parameters on the device (the step fits with every block kept" in _notes(plan)
    # With accumulation every gradient is alive in the last micro-batch: counted at full size.
    gradients = {part.name: part for part in plan.static_parts}["gradients"]
    assert gradients.device_bytes == gradients.total_bytes
    loaded = oomless.Plan.from_json(plan.to_json())
    assert loaded == plan
    with pytest.raises(oomless.ApplyError, match="pass the optimizer"):
        oomless.apply(model, loaded)
    assert not hasattr(model, "_oomless")


def test_the_memory_plot_draws_each_static_part_where_it_lives(profiled, tmp_path):
    pytest.importorskip("matplotlib")
    from oomless.plan.plot import memory_curves, plot_plan, static_bands

    profile, _, _ = profiled
    model, inputs, loss_fn = _case()
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters()),
                        profile=profile, update_in_backward=True, offload_optimizer_state=True)
    parts = {part.name: part for part in plan.static_parts}
    moved = sum(part.total_bytes - part.device_bytes for part in plan.static_parts)
    assert moved >= parts["gradients"].total_bytes // 2 + parts["optimizer state"].total_bytes // 2
    curves = memory_curves(profile, plan)
    # Plain PyTorch holds every static byte on the device; the plan only those it leaves there.
    assert curves["plain"][0][1] == plan.static_bytes + moved
    assert curves["plan"][0][1] == plan.static_bytes
    bands = static_bands(plan)
    assert [bottom for _, bottom, _ in bands[1:]] == [top for _, _, top in bands[:-1]]
    assert bands[0][1] == 0 and bands[-1][2] == plan.static_bytes
    labels = dict((label.split(":")[0], label) for label, _, _ in bands)
    assert "in backward" in labels["gradients"] and "disk" in labels["optimizer state"]
    assert labels["parameters"] == "parameters"          # all on the device: nothing to say
    path = plot_plan(profile, plan, str(tmp_path / "plan.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_each_static_part_reads_once_in_the_plans_summary():
    """A part all on the device reads as its bytes; one partly elsewhere, as how much of it and where;
    one whose kind needs saying, as what it is (it read "targets 0 B of 0 B (device (tensors the
    loss function holds))" before)."""
    from oomless.plan.plan import StaticPart

    assert StaticPart("parameters", 2**20, 2**20, "device").describe() == "parameters 1.00 MiB"
    assert StaticPart("targets", 0, 0, "device: tensors the loss function holds").describe() == \
        "targets 0 B (device: tensors the loss function holds)"
    assert StaticPart("gradients", 2**20, 2**10, "freed in backward").describe() == \
        "gradients 1.00 KiB of 1.00 MiB (freed in backward)"


def test_a_placement_moving_more_is_chosen_only_where_it_is_faster_by_more_than_the_noise():
    """Of placements that fit, the simplest (fewest things moved off the device) is kept unless another
    is predicted faster by more than `SIMPLER_WITHIN`: `make demo` moved its parameters to disk in
    some processes for a step predicted 1 % faster, and kept them in others."""
    import dataclasses

    from oomless.plan.planner import make_plan
    from oomless.plan.static import SIMPLER_WITHIN, Placement, _choose
    from tests.test_planner import _block, _profile

    swapping = make_plan(_profile([_block(f"b{i}", 100, 10) for i in range(8)]), 600 * 2**20)
    assert set(swapping.decisions.values()) != {"keep"}
    simplest, moving = Placement(), Placement(update_in_backward=True)

    class Candidates:
        def __init__(self, seconds):
            self.plans = {placement: dataclasses.replace(swapping, predicted_step_seconds=value)
                          for placement, value in seconds.items()}

        def plan(self, placement):
            return self.plans[placement]

        def added_seconds(self, placement):
            return 0.0, ""

    close = 1.0 / (1 + SIMPLER_WITHIN / 2)
    chosen, why = _choose(Candidates({simplest: 1.0, moving: close}), [simplest, moving])
    assert chosen == simplest and "simplest within" in why
    chosen, why = _choose(Candidates({simplest: 1.0, moving: 0.9}), [simplest, moving])
    assert chosen == moving and "simplest" not in why
