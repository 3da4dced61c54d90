"""A storage two blocks save (a ReLU's output, which the next block's Linear or 1x1 convolution saves
as its input) is one entry of the runtime, moved as its first saver's plan says: swapped, it comes
back for the later block's backward, which runs first, and stays until its saver's backward. The
profile records such saves (`BlockProfile.saved_earlier`) and the simulator brings the entry back
there. Before, the simulator brought it back only for its saver's backward: `make demo`'s plan that
swapped the last decoder block (its output is the 1x1 head's input) measured 264 MiB for 255 MiB
predicted in its 256 MiB, the head's backward working memory with that 16 MiB storage on top."""

import dataclasses
import importlib

import torch
from torch import nn

import oomless
from oomless.plan.segments import coarsened, depth_cuts
from oomless.plan.simulate import simulate
from oomless.profile.profile import BlockProfile, LinkProfile, Profile
from oomless.runtime.install import installed_state
from tests.conftest import train_steps
from tests.test_swap import BATCH, WIDTH, LinearRelu

STORAGE = BATCH * WIDTH * 4    # LinearRelu's output
MiB = 2**20


def _four_op_model():
    """LinearRelu; a block of Linear, ReLU, Linear, ReLU (its first Linear saves the first block's
    output); a Linear."""
    torch.manual_seed(0)
    return nn.Sequential(LinearRelu(), nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                                                     nn.ReLU()), nn.Linear(WIDTH, WIDTH))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(LinearRelu(), nn.Linear(WIDTH, WIDTH)), torch.randn(BATCH, WIDTH)


def test_the_profile_names_the_earlier_blocks_storage_a_block_saves_again():
    model, inputs = _model()
    profile = oomless.profile(model, inputs, loss_fn=lambda out: out.square().mean())
    first, second = profile.blocks
    # The first block saves its ReLU's output (its input is the model's, never on the ledger); the
    # Linear after it saves that same storage as its input: none of its own, one of the block before.
    assert first.saved_sizes == [STORAGE] and first.saved_earlier == []
    assert second.saved_bytes == 0 and second.saved_earlier == [[1, 0, 0]]


def test_a_profile_on_meta_tensors_records_the_same_storages_and_shared_saves_as_the_measured_one():
    """Plans for a device one does not have (`target=`) replay shared storages as measured plans do."""
    inputs, loss_fn = torch.randn(BATCH, WIDTH, requires_grad=True), (lambda out: out.square().mean())
    blocks = ["0", "1", "2"]
    measured = oomless.profile(_four_op_model(), inputs, loss_fn=loss_fn, blocks=blocks)
    on_meta = oomless.profile(_four_op_model(), inputs, loss_fn=loss_fn, blocks=blocks, target="h100")
    assert [block.saved_sizes for block in on_meta.blocks] == [block.saved_sizes for block in measured.blocks]
    assert [block.saved_earlier for block in on_meta.blocks] == [block.saved_earlier for block in measured.blocks]
    assert on_meta.blocks[1].saved_earlier == [[1, 0, 0]] and on_meta.blocks[2].saved_earlier == [[1, 1, 0]]


def test_the_runtime_brings_a_swapped_storage_back_for_the_later_block_and_the_simulator_too():
    model, inputs = _model()
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=lambda out: out.square().mean(), min_swap_bytes=0,
                        decisions={"0": "swap", "1": "keep"})
    oomless.apply(model, plan)
    seen = []

    def second_block_done(module, grad_input, grad_output):
        seen.append(installed_state(model).ledger.resident_activation_bytes)

    model[1].register_full_backward_hook(second_block_done)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs, lambda out: out.square().mean(), 1)
    # At the end of the second block's backward the first block's swapped storage is back on the ledger.
    assert seen == [STORAGE]

    # The simulator: with a second block whose backward needs 8 MiB of working memory, that storage comes
    # on top of it; without the record it would have been back only for the first block's backward.
    def profile(saved_earlier):
        blocks = [BlockProfile(name="0", forward_seconds=0.01, backward_seconds=0.02, saved_bytes=MiB,
                               largest_saved_bytes=MiB, saved_sizes=[MiB], input_bytes=MiB, output_bytes=MiB, calls=1,
                               forward_other_bytes=0, backward_other_bytes=0),
                  BlockProfile(name="1", forward_seconds=0.01, backward_seconds=0.02, saved_bytes=0,
                               largest_saved_bytes=0, saved_sizes=[], input_bytes=MiB, output_bytes=MiB, calls=1,
                               forward_other_bytes=0, backward_other_bytes=8 * MiB, saved_earlier=saved_earlier)]
        return Profile(device="cuda:0", blocks=blocks, parameter_bytes=0, gradient_bytes=0, buffer_bytes=0,
                       optimizer_state_bytes=0, input_bytes=0, unassigned_saved_bytes=0, loss_seconds=0.01,
                       link=LinkProfile("pcie", 1e9, 1e9), loss_other_bytes=0)

    shared = simulate(profile([[1, 0]]), ["swap", "keep"], prefetch_bytes=0)
    assert shared.total_peak_bytes == 9 * MiB and shared.peak_phase == ("backward", 1)
    assert shared.peak_holders == {0: MiB}
    # Its copy back starts when the second block's backward does: the step waits for it there (1 ms),
    # booked to the first block, whose swap it is (`planner._reason` calls a swap without waits hidden).
    assert shared.block_stall_seconds[0] > 0 and shared.block_stall_seconds[1] == 0
    alone = simulate(profile([]), ["swap", "keep"], prefetch_bytes=0)
    assert alone.total_peak_bytes == 8 * MiB


def test_a_coarsened_profile_names_the_same_storage_in_the_merged_block():
    from tests.test_segments import _case
    model, inputs, loss_fn = _case()
    profile = oomless.profile(model, inputs, loss_fn=loss_fn)
    # As a head saving the last stage's last storage would record it: one place back, its first storage.
    head = dataclasses.replace(profile.blocks[-1], saved_earlier=[[1, 0]])
    profile = dataclasses.replace(profile, blocks=[*profile.blocks[:-1], head])
    [cut] = depth_cuts(profile)
    coarse = coarsened(profile, cut)
    last_stage = profile.blocks[-5:-1]
    # The last stage is one block now, one place before the head; that storage follows its other members' saves.
    assert coarse.blocks[-1].saved_earlier == [[1, sum(len(block.saved_sizes) for block in last_stage[:3])]]
    assert coarse.blocks[-2].saved_sizes[coarse.blocks[-1].saved_earlier[0][1]] == last_stage[3].saved_sizes[0]


def _simulated_ledger_by_backward(profile, decisions, prefetch_bytes, monkeypatch) -> dict[int, int]:
    """The simulator's most ledger bytes (prefetched ones included) during each block's backward."""
    simulation = importlib.import_module("oomless.plan.simulate")    # oomless.plan is also a function
    captured = {}
    sweep = simulation._sweep

    def capturing(events, *rest):
        captured["events"] = list(events)
        return sweep(events, *rest)
    monkeypatch.setattr(simulation, "_sweep", capturing)
    simulation.simulate(simulation.with_swap_threshold(profile, 0), decisions, prefetch_bytes=prefetch_bytes)
    events = captured["events"]
    resident, phase, most = 0, None, {}
    for _, index in sorted((time, index) for index, (time, *_) in enumerate(events)):
        _, delta, kind, entered, block = events[index]
        if entered is not None:
            phase = entered.block if entered.kind == "backward" else None
        elif kind != simulation.AHEAD:
            resident += delta
        if phase is not None:
            most[phase] = max(most.get(phase, 0), resident)
    return most


def _runtime_ledger_by_backward(model, plan, inputs, loss_fn) -> dict[int, int]:
    """The runtime's most ledger bytes during each block's backward, read at every change, and at the
    block's start once the copies out have ended (the simulator's copies of 1 KiB end at once; the
    disk tier's take a file each) and the runtime has polled."""
    oomless.apply(model, plan)
    state = installed_state(model)
    ledger = state.ledger

    def settled():
        for entry in list(state.engine.pending_out):
            if entry.ticket is not None:
                state.tier.wait_out(entry.ticket)
        state.engine.poll()
    phase, most = [None], {}
    add, remove = ledger.add, ledger.remove

    def note():
        if phase[0] is not None:
            most[phase[0]] = max(most.get(phase[0], 0), ledger.resident_activation_bytes)
    ledger.add = lambda num_bytes: (add(num_bytes), note())
    ledger.remove = lambda num_bytes: (remove(num_bytes), note())
    for index, block in enumerate(model):
        block.register_full_backward_pre_hook(
            lambda module, grad, index=index: (phase.__setitem__(0, index), settled(), note()) and None)
    loss_fn(model(inputs)).backward()
    oomless.remove(model)
    return most


def test_each_blocks_backward_holds_what_the_simulator_says_whoever_saves_the_shared_storage(monkeypatch):
    """Three blocks: LinearRelu, a Linear saving its output again, LinearRelu. The runtime's ledger
    in each block's backward against the simulator's, for plans where the shared storage's first saver
    swaps it (back for the Linear's backward), is recomputed (the Linear's save makes the entry), or the
    Linear is recomputed (it holds the storage as its input, fetching nothing)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(LinearRelu(), nn.Linear(WIDTH, WIDTH), LinearRelu())
    inputs, loss_fn = torch.randn(BATCH, WIDTH, requires_grad=True), (lambda out: out.square().mean())
    profile = oomless.profile(model(), inputs, loss_fn=loss_fn)
    assert profile.blocks[1].saved_earlier == [[1, 0, 0]]
    for decisions in (["swap", "keep", "keep"], ["swap", "swap", "swap"], ["swap", "recompute", "swap"],
                      ["swap", "selective", "swap"], ["recompute", "keep", "swap"], ["recompute", "swap", "swap"],
                      ["keep", "swap", "keep"]):
        plan = oomless.plan(model(), inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, profile=profile,
                            decisions=dict(zip("012", ["recompute" if d == "selective" else d for d in decisions])))
        if "selective" in decisions:
            plan.blocks[1].selective = True
        measured = _runtime_ledger_by_backward(model(), plan, inputs, loss_fn)
        simulated = _simulated_ledger_by_backward(profile, decisions, plan.prefetch_bytes, monkeypatch)
        # The last block's backward is left out: whether the model's output (its ReLU's, which the loss
        # holds too) has left the ledger when it starts depends on when autograd frees the loss's nodes.
        assert {block: simulated[block] for block in (0, 1)} == {block: measured[block] for block in (0, 1)}, decisions


def test_in_a_block_of_several_ops_the_shared_storage_comes_back_no_later_than_its_op_needs_it(monkeypatch):
    """The second block's first Linear saves the first block's output; its own ReLUs' outputs are
    saved after it, so backward uses them first. The simulator brings the shared storage back before
    the block's first own storage is used (its op comes later still: at most one storage early)."""
    inputs, loss_fn = torch.randn(BATCH, WIDTH, requires_grad=True), (lambda out: out.square().mean())
    profile = oomless.profile(_four_op_model(), inputs, loss_fn=loss_fn, blocks=["0", "1", "2"])
    assert profile.blocks[1].saved_earlier == [[1, 0, 0]] and len(profile.blocks[1].saved_sizes) == 2
    for decisions in (["swap", "swap", "swap"], ["swap", "keep", "keep"], ["recompute", "swap", "swap"]):
        plan = oomless.plan(_four_op_model(), inputs, "1TiB", loss_fn=loss_fn, blocks=["0", "1", "2"], min_swap_bytes=0,
                            profile=profile,
                            decisions=dict(zip("012", decisions)))
        measured = _runtime_ledger_by_backward(_four_op_model(), plan, inputs, loss_fn)
        simulated = _simulated_ledger_by_backward(profile, decisions, plan.prefetch_bytes, monkeypatch)
        assert all(measured[block] <= simulated[block] <= measured[block] + STORAGE for block in (0, 1)), (
            decisions, measured, simulated)
