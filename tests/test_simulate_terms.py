"""The terms of `oomless simulate`'s model that measurement on gloo showed missing
(bench/bench_simulate.py): BatchNorm's collectives under data parallel, pipelines cut only where
the trainer can cut, torch's receive buffers of every micro-batch (tests/test_partition.py
checks those by hand), and gloo's collectives taking the cores compute runs on. Each formula is
checked against values computed by hand."""

import json
from dataclasses import replace

import pytest
import torch

import oomless
from oomless.models import UNet3D
from oomless.parallel.block_sequence import pipeline_block_groups
from oomless.plan.cluster import make_cluster
from oomless.plan.collectives import Group, batchnorm_sync_seconds
from oomless.plan.layouts import (estimate_data_parallel, estimate_fsdp, estimate_pipeline, shared_cores_seconds,
                                  with_batchnorm_sync)
from oomless.plan.microbatches import merge_blocks, scale_profile
from oomless.profile.profile import BlockProfile, LinkProfile, Profile

MiB = 2**20
LINK = {"intra_node": {"bytes_per_second": 1e9, "latency_seconds": 1e-3}, "efficiency": 1.0}


def test_batchnorm_collectives_by_hand_under_gloo_and_nccl():
    gloo = make_cluster("h100", 4, overrides={**LINK, "backend": "gloo"})
    nccl = make_cluster("h100", 4, overrides=LINK)
    assert nccl.backend == "nccl" and gloo.describe()["backend"] == "gloo"
    # gloo's GlobalBatchNorm, 64 channels: forward all-gathers 4 ranks' (mean, variance), 512 bytes each,
    # (n - 1) / n S / B + (n - 1) alpha; backward all-reduces 512 bytes, 2 (n - 1) / n S / B + 2 (n - 1) alpha.
    gathered = 0.75 * 4 * 512 / 1e9 + 3e-3
    all_reduce = 1.5 * 512 / 1e9 + 6e-3
    assert batchnorm_sync_seconds(gloo, Group(4), [64]) == pytest.approx((gathered, all_reduce))
    # torch's SyncBatchNorm: forward all-gathers 4 x (2 x 64 + 1) floats, (n - 1) / n S / B + (n - 1) alpha;
    # backward all-reduces 2 x 64 floats.
    gather = 0.75 * 4 * 516 / 1e9 + 3e-3
    reduce = 1.5 * 512 / 1e9 + 6e-3
    assert batchnorm_sync_seconds(nccl, Group(4), [64, 64]) == pytest.approx((2 * gather, 2 * reduce))
    assert batchnorm_sync_seconds(gloo, Group(1), [64]) == (0.0, 0.0)      # one replica: nothing to sync
    with pytest.raises(oomless.InputError, match="backend must be one of nccl, gloo"):
        make_cluster("h100", 4, overrides={"backend": "mpi"})


def _profile(blocks: list[BlockProfile]) -> Profile:
    parameters = sum(block.parameter_bytes for block in blocks)
    return Profile(device="cpu", blocks=blocks, parameter_bytes=parameters, gradient_bytes=parameters,
                   buffer_bytes=0, optimizer_state_bytes=2 * parameters, input_bytes=MiB, unassigned_saved_bytes=0,
                   loss_seconds=0.01, link=LinkProfile("disk", 1e9, 1e9))


def test_data_parallel_compute_waits_for_each_batchnorm_layers_collectives():
    block = dict(saved_bytes=MiB, largest_saved_bytes=MiB, input_bytes=MiB, output_bytes=MiB, parameter_bytes=1024,
                 calls=1, forward_transient_bytes=MiB, backward_transient_bytes=MiB)
    plain = _profile([BlockProfile("a", 0.1, 0.2, **block), BlockProfile("b", 0.1, 0.2, **block)])
    normed = _profile([BlockProfile("a", 0.1, 0.2, batchnorm_channels=[8, 16], **block),
                       BlockProfile("b", 0.1, 0.2, **block)])
    cluster = make_cluster("h100", 2, overrides={**LINK, "backend": "gloo"})
    # Per layer under gloo at 2 ranks: forward all-gathers 2 x 8 C bytes, 1/2 x 16 C / 1e9 + 1e-3;
    # backward all-reduces 8 C bytes, 2 x 1/2 x 8 C / 1e9 + 2e-3.
    forward = sum(8 * channels / 1e9 + 1e-3 for channels in (8, 16))
    backward = sum(8 * channels / 1e9 + 2e-3 for channels in (8, 16))
    expected = forward + backward
    lengthened = with_batchnorm_sync(normed, cluster, 2)
    assert lengthened.blocks[0].forward_seconds == pytest.approx(0.1 + forward)
    assert lengthened.blocks[0].backward_seconds == pytest.approx(0.2 + backward)
    assert lengthened.blocks[1] == normed.blocks[1] and with_batchnorm_sync(normed, cluster, 1) is normed
    # The gradient all-reduce after backward is the same in both: the step grows by the collectives.
    assert (estimate_data_parallel(normed, cluster, 1).step_seconds
            == pytest.approx(estimate_data_parallel(plain, cluster, 1).step_seconds + expected))


def test_merged_blocks_add_times_and_bytes_and_keep_the_ends():
    first = BlockProfile("conv", 0.1, 0.3, saved_bytes=4 * MiB, largest_saved_bytes=3 * MiB, saved_sizes=[3 * MiB, MiB],
                         input_bytes=2 * MiB, output_bytes=5 * MiB, parameter_bytes=100, calls=1,
                         held_forward_bytes=7 * MiB, held_backward_bytes=MiB, forward_other_bytes=6 * MiB,
                         backward_other_bytes=9 * MiB, forward_transient_bytes=MiB, backward_transient_bytes=2 * MiB,
                         batchnorm_channels=[])
    second = BlockProfile("norm", 0.2, 0.4, saved_bytes=5 * MiB, largest_saved_bytes=5 * MiB, saved_sizes=[5 * MiB],
                          input_bytes=5 * MiB, output_bytes=5 * MiB, parameter_bytes=16, calls=1,
                          held_forward_bytes=8 * MiB, held_backward_bytes=3 * MiB, forward_other_bytes=8 * MiB,
                          backward_other_bytes=None, forward_transient_bytes=4 * MiB, backward_transient_bytes=MiB,
                          batchnorm_channels=[8])
    third = BlockProfile("head", 0.05, 0.05, saved_bytes=MiB, input_bytes=5 * MiB, output_bytes=MiB, calls=1)
    merged = merge_blocks(_profile([first, second, third]), [("stage", [0, 1]), ("head", [2])])
    stage = merged.blocks[0]
    assert [block.name for block in merged.blocks] == ["stage", "head"] and merged.blocks[1] == \
        BlockProfile("head", 0.05, 0.05, saved_bytes=MiB, input_bytes=5 * MiB, output_bytes=MiB, calls=1)
    assert (stage.forward_seconds, stage.backward_seconds) == pytest.approx((0.3, 0.7))
    assert (stage.saved_bytes, stage.largest_saved_bytes, stage.saved_sizes) == (9 * MiB, 5 * MiB,
                                                                                 [3 * MiB, MiB, 5 * MiB])
    # What crosses a cut in front of the group is its first block's; its backward starts at its last.
    assert (stage.input_bytes, stage.held_forward_bytes) == (2 * MiB, 7 * MiB)
    assert (stage.output_bytes, stage.held_backward_bytes) == (5 * MiB, 3 * MiB)
    assert (stage.parameter_bytes, stage.batchnorm_channels) == (116, [8])
    assert (stage.forward_other_bytes, stage.forward_transient_bytes) == (8 * MiB, 4 * MiB)
    assert stage.backward_other_bytes is None          # unmeasured in one block: the planner estimates it
    with pytest.raises(oomless.InputError, match="consecutive"):
        merge_blocks(_profile([first, second, third]), [("a", [0, 2]), ("b", [1])])


def test_a_unet_pipeline_is_cut_between_its_pipeline_blocks_and_dp_plans_its_layers():
    with torch.device("meta"):
        model = UNet3D(base_channels=4, depth=2)
    volumes = torch.empty(2, 1, 16, 16, 16, device="meta")
    simulation = oomless.simulate(model, volumes, 8, target="h100", gpus=2, loss_fn=oomless.sum_of_outputs)
    groups = ["encoder0", "encoder1", "bottleneck", "decoder0", "decoder1", "head"]
    assert f"pipelines cut between the model's 6 pipeline blocks ({', '.join(groups)})" in simulation.notes
    for estimate in simulation.layouts:
        if estimate.partition is not None:
            assert [name for stage in estimate.partition.stage_blocks for name in stage] == groups
    # dp plans (and fsdp shards) the finer blocks the memory planner chooses: each layer of a stage.
    assert len(simulation.layout("dp x2").decisions) > len(groups)


def test_block_groups_follow_the_hand_written_sequence_and_the_shared_pool_joins_the_block_before():
    model = UNet3D(base_channels=2, depth=1)
    names = ["encoders.0.0", "encoders.0.1", "pool", "encoders.1", "decoders.0", "head"]
    assert pipeline_block_groups(model, names) == [("encoder0", [0, 1, 2]), ("bottleneck", [3]),
                                                   ("decoder0", [4]), ("head", [5])]
    assert pipeline_block_groups(torch.nn.Linear(2, 2), ["weight"]) is None     # no hand-written sequence
    assert json.loads(json.dumps(pipeline_block_groups(model, names)))      # plain data


def test_collectives_on_the_compute_cores_add_to_the_step_and_beside_compute_hide():
    block = dict(saved_bytes=MiB, largest_saved_bytes=MiB, input_bytes=MiB, output_bytes=MiB,
                 parameter_bytes=64 * MiB, calls=1, forward_transient_bytes=MiB, backward_transient_bytes=MiB)
    profile = _profile([BlockProfile(name, 0.1, 0.2, **block) for name in "abcd"])
    beside = make_cluster("h100", 2, overrides={**LINK, "backend": "gloo", "overlap": True})
    sharing = make_cluster("h100", 2, overrides={**LINK, "backend": "gloo"})
    assert (sharing.overlap, beside.overlap, make_cluster("h100", 2).overlap) == (False, True, True)
    assert sharing.describe()["overlap"] is False
    for estimate in (estimate_fsdp, estimate_data_parallel):
        hidden, shared = estimate(profile, beside, 1), estimate(profile, sharing, 1)
        assert shared.communication_seconds > 0
        assert hidden.communication_seconds == pytest.approx(shared.communication_seconds)
        # compute_seconds: the blocks, the loss and the optimizer step, the same either way.
        assert shared.compute_seconds > 4 * (0.1 + 0.2) + 0.01
        assert hidden.compute_seconds == pytest.approx(shared.compute_seconds)
        # Sharing the cores, compute waits for every collective: the step is their sum.
        assert shared.exposed_communication_seconds == pytest.approx(shared.communication_seconds)
        assert shared.step_seconds == pytest.approx(shared.compute_seconds + shared.communication_seconds)
        if estimate is estimate_fsdp:       # gathers ahead of use and reduce-scatters behind hide
            assert hidden.step_seconds < shared.step_seconds - 0.5 * shared.communication_seconds
    with pytest.raises(oomless.InputError, match="overlap must be true or false"):
        make_cluster("h100", 2, overrides={"overlap": "no"})


def test_ranks_sharing_cores_slow_by_the_busy_ranks_threads_over_the_cores():
    block = dict(saved_bytes=MiB, largest_saved_bytes=MiB, input_bytes=MiB, output_bytes=MiB,
                 parameter_bytes=1024, calls=1, forward_transient_bytes=MiB, backward_transient_bytes=MiB)
    profile = _profile([BlockProfile(name, 0.1, 0.2, **block) for name in "abcdefgh"])
    alone = make_cluster("h100", 4, overrides={**LINK, "backend": "gloo"})
    shared = make_cluster("h100", 4, overrides={**LINK, "backend": "gloo", "cores_per_node": 2,
                                                "threads_per_rank": 1})
    roomy = make_cluster("h100", 4, overrides={**LINK, "backend": "gloo", "cores_per_node": 8, "threads_per_rank": 2})
    assert alone.contention(4) == 1.0 and roomy.contention(4) == 1.0
    assert shared.contention(4) == 2.0 and shared.contention(1) == 1.0 and shared.contention(3) == 1.5
    assert shared.describe()["cores_per_node"] == 2 and "share 2 cores" in shared.summary()
    # dp and fsdp: all 4 ranks compute at once on 2 cores, so blocks, loss and update take twice as long;
    # the collectives (measured between the ranks as they are) do not.
    for estimate in (estimate_data_parallel, estimate_fsdp):
        one, two = estimate(profile, alone, 1), estimate(profile, shared, 1)
        assert two.compute_seconds == pytest.approx(2 * one.compute_seconds)
        assert two.communication_seconds == pytest.approx(one.communication_seconds)
        assert (two.step_seconds - two.exposed_communication_seconds
                == pytest.approx(2 * (one.step_seconds - one.exposed_communication_seconds)))
        assert estimate(profile, roomy, 1).step_seconds == pytest.approx(one.step_seconds)
    # A pipeline of 4 ranks: its ranks give their cores up in the bubble and on receives, so its step
    # is the longer of the schedule at full speed and the average rank's work with all 4 on 2 cores
    # (twice its compute); its sends (1 ms latency each way per micro-batch and stage) are not slowed.
    for schedule in ("gpipe", "1f1b"):
        one = estimate_pipeline(profile, alone, 8, 8, 4, schedule)
        two = estimate_pipeline(profile, shared, 8, 8, 4, schedule)
        assert two.partition.stage_blocks == one.partition.stage_blocks
        partition = one.partition
        work = 2 * sum(partition.rank_seconds) / 4 * partition.microbatches
        assert shared_cores_seconds(partition, shared) == pytest.approx(work)
        assert shared_cores_seconds(partition, alone) == 0.0
        # (the optimizer step, twice as long shared, is nanoseconds for these 8 KiB of weights)
        assert two.step_seconds - one.step_seconds == pytest.approx(
            max(partition.predicted_step_seconds, work) - partition.predicted_step_seconds, abs=1e-6)
        assert partition.microbatches > 3 and one.step_seconds < two.step_seconds  # (M + 3) T against 2 M T
    with pytest.raises(oomless.InputError, match="cores_per_node must be a positive integer"):
        make_cluster("h100", 2, overrides={"cores_per_node": 0})
    with pytest.raises(oomless.InputError, match="threads_per_rank must be a positive integer"):
        make_cluster("h100", 2, overrides={"threads_per_rank": 1.5})
    with pytest.raises(oomless.InputError, match="threads_per_rank must be a positive integer"):
        make_cluster("h100", 2, overrides={"cores_per_node": 2, "threads_per_rank": None})


def test_a_measured_contention_replaces_the_formula_interpolated_between_the_counts_measured():
    """``contention`` measured ({busy ranks: slowdown}, as bench/bench_simulate.py times it) is used in
    place of busy x threads / cores: linear between the counts, 1 for one rank, in proportion past the
    last; dp at 4 ranks is slowed by the measured 1.5, not the formula's 2; malformed tables refused."""
    block = dict(saved_bytes=MiB, largest_saved_bytes=MiB, input_bytes=MiB, output_bytes=MiB,
                 parameter_bytes=1024, calls=1, forward_transient_bytes=MiB, backward_transient_bytes=MiB)
    profile = _profile([BlockProfile(name, 0.1, 0.2, **block) for name in "abcd"])
    settings = {**LINK, "backend": "gloo", "cores_per_node": 2, "threads_per_rank": 1}
    measured = make_cluster("h100", 4, overrides={**settings, "contention": {"2": 1.1, "4": 1.5}})
    formula, alone = make_cluster("h100", 4, overrides=settings), make_cluster("h100", 4, overrides=LINK)
    assert [measured.contention(busy) for busy in (0.5, 1, 2, 3, 4, 8)] == pytest.approx([1, 1, 1.1, 1.3, 1.5, 3.0])
    assert formula.contention(4) == 2.0
    assert measured.describe()["contention"] == {"2": 1.1, "4": 1.5} and formula.describe()["contention"] is None
    one, slowed_down = estimate_data_parallel(profile, alone, 1), estimate_data_parallel(profile, measured, 1)
    assert slowed_down.compute_seconds == pytest.approx(1.5 * one.compute_seconds)
    for bad in ({}, {"two": 1.1}, {"0": 1.0}, {"2": -1.0}, {"2": True}, [1.1]):
        with pytest.raises(oomless.InputError, match="cluster contention must be"):
            make_cluster("h100", 4, overrides={"contention": bad})


def test_fsdps_own_work_around_each_collective_adds_to_the_step_where_compute_waits_at_every_world_size():
    block = dict(saved_bytes=MiB, largest_saved_bytes=MiB, input_bytes=MiB, output_bytes=MiB,
                 parameter_bytes=1024, calls=1, forward_transient_bytes=MiB, backward_transient_bytes=MiB)
    profile = _profile([BlockProfile(name, 0.1, 0.2, **block) for name in "abcde"])
    sharing = {**LINK, "backend": "gloo"}
    plain = make_cluster("h100", 2, overrides=sharing)
    costly = make_cluster("h100", 2, overrides={**sharing, "fsdp_host_seconds": 0.004})
    assert plain.fsdp_host_seconds == 0.0 and costly.describe()["fsdp_host_seconds"] == 0.004
    # 5 units: an all-gather before each forward and each backward, a reduce-scatter after each backward.
    without, with_host = estimate_fsdp(profile, plain, 1), estimate_fsdp(profile, costly, 1)
    assert with_host.communication_seconds == pytest.approx(without.communication_seconds + 15 * 0.004)
    assert with_host.step_seconds == pytest.approx(without.step_seconds + 15 * 0.004)
    # dp has no FSDP units. One rank shards nothing, but FSDP2 still does its copies and runs its
    # hooks around each collective it skips there (measured: fsdp x1 had been predicted 18 % short).
    assert estimate_data_parallel(profile, costly, 1).step_seconds == pytest.approx(
        estimate_data_parallel(profile, plain, 1).step_seconds)
    one = {**sharing, "fsdp_host_seconds": 0.004}
    assert estimate_fsdp(profile, make_cluster("h100", 1, overrides=one), 1).step_seconds == pytest.approx(
        estimate_fsdp(profile, make_cluster("h100", 1, overrides=sharing), 1).step_seconds + 15 * 0.004)
    with pytest.raises(oomless.InputError, match="fsdp_host_seconds must be a number of seconds >= 0"):
        make_cluster("h100", 2, overrides={"fsdp_host_seconds": -1})


def test_a_merged_group_holds_its_earlier_parts_saves_while_a_later_part_peaks():
    first = BlockProfile("conv", 0.1, 0.1, saved_bytes=4 * MiB, forward_other_bytes=6 * MiB, backward_other_bytes=6 * MiB,
                         forward_own_peak_bytes=7 * MiB, backward_own_peak_bytes=9 * MiB)
    second = BlockProfile("norm", 0.1, 0.1, saved_bytes=5 * MiB, forward_other_bytes=3 * MiB, backward_other_bytes=3 * MiB,
                          forward_own_peak_bytes=6 * MiB, backward_own_peak_bytes=5 * MiB)
    stage = merge_blocks(_profile([first, second]), [("stage", [0, 1])]).blocks[0]
    # While the norm runs, the conv's 4 MiB are held (kept, in forward and in backward alike).
    assert (stage.forward_own_peak_bytes, stage.backward_own_peak_bytes) == (10 * MiB, 9 * MiB)
    unmeasured = replace(second, backward_own_peak_bytes=None)
    assert merge_blocks(_profile([first, unmeasured]), [("stage", [0, 1])]).blocks[0].backward_own_peak_bytes is None
    # Scaled to a smaller batch the measured most still bounds it; to a larger one it does not.
    assert scale_profile(_profile([first]), 0.5).blocks[0].forward_own_peak_bytes == 7 * MiB
    assert scale_profile(_profile([first]), 2.0).blocks[0].forward_own_peak_bytes is None
