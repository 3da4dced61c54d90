"""A storage two blocks save (a ReLU's output, which the next block's Linear or 1x1 convolution saves
as its input) is one entry of the runtime, moved as its first saver's plan says: swapped, it comes
back for the later block's backward, which runs first, and stays until its saver's backward. The
profile records such saves (`BlockProfile.saved_earlier`) and the simulator brings the entry back
there. Before, the simulator brought it back only for its saver's backward: `make demo`'s plan that
swapped the last decoder block (its output is the 1x1 head's input) measured 264 MiB for 255 MiB
predicted in its 256 MiB, the head's backward working memory with that 16 MiB storage on top."""

import dataclasses

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
    assert second.saved_bytes == 0 and second.saved_earlier == [[1, 0]]


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
    # Its copy back starts when the second block's backward does: the step waits for it there (1 ms).
    assert shared.block_stall_seconds[1] > 0 and shared.block_stall_seconds[0] == 0
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
