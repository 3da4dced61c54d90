"""The planner on synthetic profiles: plain data in, plain data out, no model needed."""

import pytest

import oomless
from oomless.plan.planner import make_plan, smallest_memory
from oomless.plan.simulate import simulate
from oomless.profile.profile import BlockProfile, LinkProfile, Profile

MiB = 2**20


def _profile(blocks, link_bytes_per_second=1e9, kind="pcie"):
    return Profile(device="cuda:0", blocks=blocks, parameter_bytes=10 * MiB, gradient_bytes=10 * MiB,
                   buffer_bytes=0, optimizer_state_bytes=20 * MiB, input_bytes=MiB, unassigned_saved_bytes=0,
                   loss_seconds=0.001, link=LinkProfile(kind, link_bytes_per_second, link_bytes_per_second))


def _block(name, saved_mib, forward_ms, backward_ms=None, input_mib=1):
    return BlockProfile(name=name, forward_seconds=forward_ms / 1e3,
                        backward_seconds=(backward_ms if backward_ms is not None else 2 * forward_ms) / 1e3,
                        saved_bytes=saved_mib * MiB, largest_saved_bytes=saved_mib * MiB // 4,
                        input_bytes=input_mib * MiB, output_bytes=input_mib * MiB, calls=1,
                        forward_transient_bytes=MiB, backward_transient_bytes=MiB)


def test_everything_kept_when_it_fits():
    profile = _profile([_block(f"b{i}", 100, 10) for i in range(8)])
    plan = make_plan(profile, 10 * 2**30)
    assert set(plan.decisions.values()) == {"keep"}
    assert plan.predicted_step_seconds == pytest.approx(plan.plain_step_seconds)
    assert plan.predicted_activation_peak_bytes == 800 * MiB


@pytest.mark.parametrize("share", [0.75, 0.5, 0.3])
def test_plan_fits_the_budget_and_prefers_hidden_swaps(share):
    # 100 MiB per block at 1 GB/s is 0.1 s of copy behind 0.2 s of compute: swaps hide fully.
    profile = _profile([_block(f"b{i}", 100, 200) for i in range(8)])
    roomy = make_plan(profile, 10 * 2**30)
    memory = roomy.static_bytes + roomy.reserve_bytes + int(share * roomy.predicted_activation_peak_bytes)
    plan = make_plan(profile, memory)
    assert plan.predicted_activation_peak_bytes <= plan.activation_budget
    assert plan.predicted_peak_bytes <= memory
    if share >= 0.5:
        assert "recompute" not in plan.decisions.values()
        assert plan.predicted_step_seconds <= roomy.predicted_step_seconds * 1.01
    assert all("hidden" in block.reason for block in plan.blocks if block.decision == "swap")


def test_recompute_chosen_when_the_link_is_too_slow():
    # 100 MiB at 10 MB/s is 10 s per swap; recomputing a 1 ms block is far cheaper.
    profile = _profile([_block(f"b{i}", 100, 1) for i in range(8)], link_bytes_per_second=1e7)
    roomy = make_plan(profile, 10 * 2**30)
    plan = make_plan(profile, roomy.static_bytes + roomy.reserve_bytes + 400 * MiB)
    assert "recompute" in plan.decisions.values()
    assert "swap" not in plan.decisions.values()
    assert plan.predicted_activation_peak_bytes <= plan.activation_budget


def test_plan_error_names_the_smallest_memory_and_the_largest_block():
    blocks = [_block(f"b{i}", 10, 5) for i in range(6)]
    blocks[3] = _block("huge", 500, 5)
    profile = _profile(blocks)
    exact = smallest_memory(profile)
    with pytest.raises(oomless.PlanError) as error:
        make_plan(profile, exact - 1)
    assert error.value.limiting_block == "huge"
    assert error.value.minimum_bytes >= exact
    plan = make_plan(profile, error.value.minimum_bytes)
    assert plan.predicted_peak_bytes <= error.value.minimum_bytes


def test_static_bytes_alone_too_large():
    profile = _profile([_block("b0", 10, 5)])
    with pytest.raises(oomless.PlanError) as error:
        make_plan(profile, 5 * MiB)
    assert error.value.limiting_block is None
    assert "static bytes" in str(error.value)


def test_plan_round_trips_through_json():
    profile = _profile([_block(f"b{i}", 100, 10) for i in range(4)])
    plan = make_plan(profile, 300 * MiB)
    again = oomless.Plan.from_json(plan.to_json())
    assert again == plan
    text = str(plan)
    for block in plan.blocks:
        assert block.name in text and block.decision in text


def test_simulator_swap_is_free_only_when_transfers_hide():
    fast = _profile([_block(f"b{i}", 100, 200) for i in range(4)], link_bytes_per_second=1e10)
    slow = _profile([_block(f"b{i}", 100, 200) for i in range(4)], link_bytes_per_second=1e8)
    saved = {}
    for profile, hidden in ((fast, True), (slow, False)):
        keep = simulate(profile, ["keep"] * 4)
        swap = simulate(profile, ["swap"] * 4, prefetch_bytes=100 * MiB)   # a block's tensors ahead of use
        saved[hidden] = keep.activation_peak_bytes - swap.activation_peak_bytes
        assert (swap.step_seconds <= keep.step_seconds * 1.01) == hidden
    # Copies that do not keep up with compute free little before backward needs them back: on the
    # slow link only the first tensors' copies end before the peak.
    assert saved[True] >= 200 * MiB and 0 <= saved[False] < saved[True] / 2
    recompute = simulate(fast, ["recompute"] * 4)
    added = sum(block.forward_seconds for block in fast.blocks)
    assert recompute.step_seconds == pytest.approx(simulate(fast, ["keep"] * 4).step_seconds + added)


@pytest.mark.parametrize("solver", ["greedy", "exact", "auto"])
@pytest.mark.parametrize("link", [(1e9, "pcie"), (2e7, "disk")])
def test_every_solver_plans_at_the_smallest_memory_it_names(solver, link):
    """At PlanError's named minimum a plan exists (the most frugal one is the witness); each solver must
    find one that fits, not its fastest candidate over the budget. Mixed blocks: some whose copies hide,
    some cheaper to recompute, one large."""
    blocks = [_block(f"b{i}", saved, forward) for i, (saved, forward) in
              enumerate([(40, 50), (120, 2), (60, 80), (300, 5), (20, 1), (90, 120), (150, 3), (30, 40)])]
    profile = _profile(blocks, link_bytes_per_second=link[0], kind=link[1])
    with pytest.raises(oomless.PlanError) as error:
        make_plan(profile, smallest_memory(profile) - MiB, solver=solver)
    plan = make_plan(profile, error.value.minimum_bytes, solver=solver)
    assert plan.predicted_peak_bytes <= error.value.minimum_bytes
    assert set(plan.decisions.values()) != {"keep"}
