"""The planner on synthetic profiles: plain data in, plain data out, no model needed."""

import pytest

import oomless
from oomless.plan.planner import make_plan, smallest_memory, smallest_memory_for
from oomless.plan.simulate import simulate, with_swap_threshold
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


@pytest.mark.parametrize("sizes", [
    [(300, 20, 50), (20, 100, 10), (60, 100, 10), (100, 100, 50), (300, 50, 1)],
    [(100, 100, 50), (100, 1, 200), (60, 5, 200), (20, 100, 10), (20, 20, 200), (100, 1, 1)],
])
def test_the_smallest_memory_named_still_plans_when_the_next_profile_measures_a_slower_link(sizes):
    """A user gives back the budget a PlanError named; oomless profiles the step again and this time
    the link measures 20 % slower (disk writeback, a busy bus). Copies that ended before the peak now
    end after it, and the named budget must still plan. (saved MiB, forward ms, input MiB) per block:
    blocks whose input is larger than what they save gain nothing from recompute, so the smallest plan
    swaps and its peak depends on the link."""
    blocks = [_block(f"b{i}", saved, forward, input_mib=inputs) for i, (saved, forward, inputs) in enumerate(sizes)]
    with pytest.raises(oomless.PlanError) as error:
        make_plan(_profile(blocks), 100 * MiB)
    named = error.value.minimum_bytes
    plan = make_plan(_profile(blocks, link_bytes_per_second=0.8e9), named)
    assert plan.predicted_peak_bytes <= named


def _measured_block(name, saved_mib, forward_other_mib, forward_peak_mib, backward_other_mib, backward_peak_mib):
    """A block as the profiler measures it: one saved storage, working memory and peaks per phase."""
    return BlockProfile(name=name, forward_seconds=0.01, backward_seconds=0.02, saved_bytes=saved_mib * MiB,
                        largest_saved_bytes=saved_mib * MiB, saved_sizes=[saved_mib * MiB], input_bytes=MiB,
                        output_bytes=MiB, calls=1, forward_other_bytes=forward_other_mib * MiB,
                        forward_peak_bytes=forward_peak_mib * MiB, backward_other_bytes=backward_other_mib * MiB,
                        backward_peak_bytes=backward_peak_mib * MiB)


def test_a_swapped_block_keeps_what_the_runtime_does_not_move_and_the_plan_counts_it():
    """The runtime's pack keeps a swapped block's storages under ``min_swap_bytes`` and those it
    cannot move (recorded while profiling in `kept_when_swapped`); the simulator counts them on the
    device from the forward to their use, so the smallest budget with the default 64 KiB threshold is
    above the one that moves everything, and a plan that swaps them does not promise their bytes."""
    blocks = [_block(f"b{i}", 0, 10) for i in range(4)]
    for block in blocks:
        block.saved_sizes = [MiB, 32 * 1024, 32 * 1024]
        block.saved_bytes, block.largest_saved_bytes = MiB + 64 * 1024, MiB
    profile = _profile(blocks, link_bytes_per_second=1e10)
    moved_all = simulate(with_swap_threshold(profile, 0), ["swap"] * 4)
    small_kept = simulate(with_swap_threshold(profile, 64 * 1024), ["swap"] * 4)
    assert moved_all.forward_end_bytes == 0                       # every copy out ended before the loss
    assert small_kept.forward_end_bytes == 4 * 64 * 1024          # two 32 KiB storages per block stayed
    assert smallest_memory(profile, min_swap_bytes=64 * 1024) > smallest_memory(profile, min_swap_bytes=0)
    swapped = make_plan(profile, 2**40, decisions={block.name: "swap" for block in blocks})
    assert swapped.predicted_activation_peak_bytes >= 4 * 64 * 1024
    # A storage the runtime cannot move (a conjugate view, another device's tensor) stays too.
    blocks[0].kept_when_swapped = [0]
    pinned = simulate(with_swap_threshold(profile, 0), ["swap"] * 4)
    assert pinned.forward_end_bytes == MiB


def test_the_predicted_ledger_fits_the_activation_budget_where_resident_memory_missed_it():
    """Measured phases whose peak did not grow with the block's own storage brought back (it reused
    freed pages): the ledger then holds more than the phase's budget less its measured working memory.
    The plan still promises the ledger its activation budget (the budget less the least working memory
    of any phase), so the smallest budget counts the ledger's peak on top of that least working memory."""
    blocks = [_measured_block(f"b{i}", 6, forward_other_mib=5, forward_peak_mib=8, backward_other_mib=8,
                              backward_peak_mib=8) for i in range(2)]
    profile = _profile(blocks, link_bytes_per_second=1e10)
    profile.loss_other_bytes = profile.loss_peak_bytes = 5 * MiB
    smallest = smallest_memory(profile, min_swap_bytes=0)
    for decisions in (None, {"b0": "swap", "b1": "swap"}):
        plan = make_plan(profile, smallest, decisions=decisions, min_swap_bytes=0)
        assert plan.predicted_peak_bytes <= smallest
        assert plan.predicted_activation_peak_bytes <= plan.activation_budget, plan


def test_each_phase_is_limited_to_the_budget_less_its_own_working_memory():
    """The runtime lets saved activations onto the device up to each phase's limit: the budget beyond
    static bytes and the margin, less what that phase holds besides them (measured). The plan's
    activation budget is the limit of the phase that holds the least, so no phase's limit passes it,
    and static bytes plus it stay within the memory given."""
    others = [(5, 8), (3, 9), (7, 4)]       # (forward, backward) working memory in MiB, as measured
    blocks = [_measured_block(f"b{i}", 6, forward_other_mib=forward, forward_peak_mib=forward + 6,
                              backward_other_mib=backward, backward_peak_mib=backward + 6)
              for i, (forward, backward) in enumerate(others)]
    profile = _profile(blocks, link_bytes_per_second=1e10)
    profile.loss_other_bytes = profile.loss_peak_bytes = 6 * MiB
    plan = make_plan(profile, smallest_memory(profile, min_swap_bytes=0) + 20 * MiB, min_swap_bytes=0)
    limits = [(block.forward_limit_bytes, block.backward_limit_bytes) for block in plan.blocks]
    top = plan.activation_budget
    assert limits == [(top - (forward - 3) * MiB, top - (backward - 3) * MiB) for forward, backward in others]
    assert plan.static_bytes + plan.activation_budget + 3 * MiB <= plan.memory_bytes


def test_selective_recompute_is_named_on_the_blocks_that_get_it():
    """A block given "selective" is planned as a recompute that keeps its matmul and convolution
    outputs (`BlockPlan.selective`); a block given "recompute" re-runs whole, and the other decisions
    carry no selective flag."""
    blocks = [_block(f"b{i}", 40, 20) for i in range(4)]
    for block in blocks:
        block.selective_kept_bytes, block.selective_unsaved_bytes, block.selective_time_share = 10 * MiB, 30 * MiB, 0.3
    decisions = {"b0": "selective", "b1": "recompute", "b2": "keep", "b3": "swap"}
    plan = make_plan(_profile(blocks), 2**40, decisions=decisions)
    assert plan.decisions == {"b0": "recompute", "b1": "recompute", "b2": "keep", "b3": "swap"}
    assert [block.selective for block in plan.blocks] == [True, False, False, False]
    assert "selective" in plan.blocks[0].reason and "selective" not in plan.blocks[1].reason


def test_the_simulated_forward_ends_holding_what_each_decision_keeps():
    """At the end of the forward the simulated ledger holds, per block: everything it saved (keep),
    its input (recompute), its input and its kept matmul/convolution outputs (selective); the
    prefetch of the backward starts from that."""
    blocks = [_block(f"b{i}", 40, 20, input_mib=2) for i in range(4)]
    for block in blocks:
        block.selective_kept_bytes, block.selective_unsaved_bytes, block.selective_time_share = 10 * MiB, 30 * MiB, 0.3
    profile = _profile(blocks)
    assert simulate(profile, ["keep"] * 4).forward_end_bytes == 4 * 40 * MiB
    assert simulate(profile, ["recompute"] * 4).forward_end_bytes == 4 * 2 * MiB
    assert simulate(profile, ["selective"] * 4).forward_end_bytes == 4 * (2 + 10) * MiB
    assert simulate(profile, ["selective", "recompute", "keep", "recompute"]).forward_end_bytes == (12 + 2 + 40 + 2) * MiB


def test_planning_leaves_nothing_of_its_callers_frames_alive():
    """Refusals the planner keeps as values (each static placement's, the floor it probes before
    splitting) carry no traceback: one would hold the frames of the call and of its callers, with
    their locals, in a cycle only the garbage collector breaks. A trainer's batch stayed alive
    through every step that way. Here a caller's local must be freed as the caller returns."""
    import gc
    import weakref

    import torch
    import torch.nn.functional as F

    from oomless.models import UNet3D

    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(2, 1, 16, 16, 16)
    labels = (volume[:, 0] > 0.5).long()
    loss_fn = lambda out: F.cross_entropy(out, labels)      # noqa: E731
    with pytest.raises(oomless.PlanError) as refused:
        oomless.plan(model, volume, 1, loss_fn=loss_fn, split=False)
    smallest = refused.value.minimum_bytes
    del refused

    def plan_in_a_helper():
        held_by_the_caller = torch.ones(1024)
        # Near the floor: the planner probes the floor and tries splitting; every placement is planned.
        oomless.plan(model, volume, smallest, loss_fn=loss_fn)
        return weakref.ref(held_by_the_caller)

    gc.collect()
    gc.disable()
    try:
        watched = plan_in_a_helper()
        assert watched() is None, "a frame of the planning call is still alive"
    finally:
        gc.enable()


def test_a_profile_may_name_its_own_margin():
    """Working memory traced on meta tensors carries the 20 % margin, measured the 5 %; a profile that
    says its share (the unsplit floor's estimate, traced but a lower bound) is planned with that."""
    from oomless.plan.planner import ESTIMATED_MARGIN, MEASURED_MARGIN, reserve_bytes

    profile = _profile([_measured_block(f"b{i}", 10, 20, 30, 40, 50) for i in range(3)])
    profile.loss_other_bytes = 0
    measured = reserve_bytes(profile)
    profile.memory_traced = True
    traced = reserve_bytes(profile)
    profile.margin_share = MEASURED_MARGIN
    assert traced - measured == int(40 * MiB * ESTIMATED_MARGIN) - int(40 * MiB * MEASURED_MARGIN)
    assert reserve_bytes(profile) == measured


@pytest.mark.parametrize("decision", ["swap", "recompute", "keep"])
def test_given_decisions_plan_within_the_smallest_memory_named_for_them(decision):
    """`smallest_memory_for`: at that budget a plan of those decisions fits (bringing swapped bytes
    back as early as that budget allows); no budget needs less."""
    profile = _profile([_block(f"b{i}", 100, 200) for i in range(8)], link_bytes_per_second=1e8)
    decisions = {block.name: decision for block in profile.blocks}
    smallest = smallest_memory_for(profile, decisions)
    plan = make_plan(profile, smallest, decisions=decisions)
    assert plan.predicted_peak_bytes <= smallest
    roomy = make_plan(profile, 2**40, decisions=decisions)
    assert roomy.predicted_peak_bytes >= smallest
    # The whole-model minimum is no more than any one set of decisions needs.
    assert smallest_memory(profile) <= smallest


@pytest.mark.parametrize("held_mib, said", [(0, None), (30, "30.00 MiB of it what earlier steps left"),
                                            (40, "nearly all of it what earlier steps left")])
def test_a_refusal_names_what_the_process_held_from_the_steps_start(held_mib, said):
    # A phase's working memory as measured counts what earlier steps left held (kernels' caches,
    # compiled code, start-up): the refusal that blames the phase says how much of it that is.
    blocks = [_measured_block(f"b{i}", 1, 2, 3, 4 if i else 40, 5 if i else 41) for i in range(3)]
    profile = _profile(blocks)
    profile.held_from_start_bytes = held_mib * MiB
    with pytest.raises(oomless.PlanError) as refused:
        make_plan(profile, 50 * MiB)
    message = str(refused.value)
    assert "block b0's backward sets it: 40.00 MiB of working memory" in message
    if said is None:
        assert "earlier steps" not in message and "held tensors, gradients in flight" in message
    else:
        assert said in message, message
        assert ("10.00 MiB its own" in message) == (held_mib == 30)
