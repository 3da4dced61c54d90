"""`oomless simulate`: collectives by the alpha-beta formulas, fsdp's bytes per rank by hand, dp
against fsdp, the recommendation, the deep-model profile from a few layers, the command line and
its errors. Nothing here times anything: `oomless simulate`'s speed on a 70B model is measured by
hand (README), predictions against gloo runs are issue 14's item 4."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import oomless
from oomless.models import MLP, TinyTransformer, UNet3D
from oomless.plan.cluster import make_cluster
from oomless.plan.collectives import (Group, all_gather_seconds, all_reduce_seconds, point_to_point_seconds,
                                      reduce_scatter_seconds, ring_all_gather_seconds, ring_all_reduce_seconds,
                                      ring_reduce_scatter_seconds, send_seconds)
from oomless.plan.devices import Device, find_device, register_device
from oomless.plan.layouts import estimate_data_parallel, estimate_fsdp, estimate_layouts, recommend
from oomless.plan.microbatches import scale_profile
from oomless.profile.fake import format_flops, profile_for_target
from oomless.profile.repeated import profile_few_layers

SOURCE = Path(__file__).resolve().parents[1] / "src"
MiB = 2**20


def test_ring_formulas_against_hand_computed_values():
    # 1 GB over 8 ranks on 100 GB/s links with 10 us per step.
    assert ring_all_reduce_seconds(1e9, 8, 100e9, 1e-5) == pytest.approx(2 * 7 / 8 * 0.01 + 14e-5)   # 0.01764
    assert ring_all_gather_seconds(1e9, 8, 100e9, 1e-5) == pytest.approx(7 / 8 * 0.01 + 7e-5)       # 0.00882
    assert ring_reduce_scatter_seconds(1e9, 8, 100e9, 1e-5) == pytest.approx(0.00882)
    assert point_to_point_seconds(1e9, 100e9, 1e-5) == pytest.approx(0.01001)
    assert ring_all_reduce_seconds(1e9, 1, 100e9, 1e-5) == 0.0      # one rank: nothing to exchange


def test_collectives_on_a_cluster_one_node_is_the_ring_two_nodes_go_in_two_levels():
    links = {"intra_node": {"bytes_per_second": 100e9, "latency_seconds": 1e-5},
             "inter_node": {"bytes_per_second": 10e9, "latency_seconds": 5e-5}, "efficiency": 1.0}
    one_node = make_cluster("h100", 4, 1, overrides=links)
    assert all_reduce_seconds(one_node, Group(4), 4e9) == pytest.approx(2 * 3 / 4 * 0.04 + 6e-5)
    two_nodes = make_cluster("h100", 8, 2, overrides=links)
    size = 4e9
    # Reduce-scatter in the node, all-reduce of a quarter across the 2 nodes, all-gather in the node.
    intra = 3 / 4 * size / 100e9 + 3 * 1e-5
    across = 2 * 1 / 2 * (size / 4) / 10e9 + 2 * 5e-5
    assert all_reduce_seconds(two_nodes, Group(4, 2), size) == pytest.approx(2 * intra + across)
    gather = 1 / 2 * (size / 4) / 10e9 + 5e-5 + intra
    assert all_gather_seconds(two_nodes, Group(4, 2), size) == pytest.approx(gather)
    assert reduce_scatter_seconds(two_nodes, Group(4, 2), size) == pytest.approx(gather)
    assert all_reduce_seconds(two_nodes, Group(1, 2), size) == pytest.approx(2 * 1 / 2 * 0.4 + 2 * 5e-5)
    assert send_seconds(two_nodes, size, across_nodes=True) == pytest.approx(0.4 + 5e-5)
    # The default H100 node: NVLink 4 at 450 GB/s each way, InfiniBand NDR 400 Gb/s per GPU, 80 %.
    default = make_cluster("h100", 16, 2)
    assert default.intra_node.bytes_per_second == 450e9 and default.inter_node.bytes_per_second == 50e9
    assert default.effective(default.intra_node)[0] == pytest.approx(360e9)


SIZES = (256, 1024, 1024, 16)


def _mlp_profile(batch: int):
    model = MLP(SIZES)
    inputs = torch.randn(batch, SIZES[0])
    return profile_for_target(model, inputs, "h100", loss_fn=oomless.sum_of_outputs,
                              optimizer=torch.optim.Adam(model.parameters()))


def test_fsdp_bytes_per_rank_are_the_shards_two_blocks_unsharded_and_the_activations():
    ranks = 4
    cluster = make_cluster("h100", ranks, 1)
    profile = _mlp_profile(8)
    layers = [(width_in * width_out + width_out) * 4 for width_in, width_out in zip(SIZES, SIZES[1:])]
    parameters = sum(layers)                  # fp32 weights and biases of the three Linear layers
    assert profile.parameter_bytes == parameters and profile.optimizer_state_bytes == 2 * parameters
    fsdp = estimate_fsdp(profile, cluster, 8)
    largest = max(layers)                     # the 1024 x 1024 layer: running + prefetched
    sharded = math.ceil(parameters / ranks) + math.ceil(parameters / ranks) + math.ceil(2 * parameters / ranks)
    assert fsdp.static_bytes == sharded + 2 * largest + 2 * largest + profile.input_bytes
    dp = estimate_data_parallel(profile, cluster, 8)
    assert dp.static_bytes == 4 * parameters + profile.input_bytes
    assert fsdp.fits and dp.fits and fsdp.memory_plan == dp.memory_plan == "keep 5"
    # Beyond the static bytes both hold the same activations (and working memory) of 8 samples.
    assert fsdp.memory_per_rank_bytes - fsdp.static_bytes == dp.memory_per_rank_bytes - dp.static_bytes > 0
    assert set(fsdp.decisions.values()) == {"keep"} and list(fsdp.decisions) == [b.name for b in profile.blocks]


def test_fsdp_holds_less_per_rank_and_moves_more_than_dp():
    cluster = make_cluster("h100", 8, 1)
    profile = _mlp_profile(8)
    dp, fsdp = estimate_data_parallel(profile, cluster, 8), estimate_fsdp(profile, cluster, 8)
    assert fsdp.memory_per_rank_bytes < dp.memory_per_rank_bytes
    # all-gather twice and reduce-scatter once, (n-1)/n S each, against all-reduce's 2 (n-1)/n S.
    assert fsdp.communication_seconds > dp.communication_seconds


@pytest.fixture(scope="module")
def small_gpu():
    """A made-up 256 MiB device with H100 speeds: a 100 MiB model with Adam does not fit it whole."""
    h100 = find_device("h100")
    return register_device(Device("test-256mib", 256 * MiB, h100.memory_bytes_per_second, h100.bf16_flops,
                                  h100.fp16_flops, h100.fp32_flops, h100.tf32_flops,
                                  h100.host_to_device_bytes_per_second, h100.device_to_host_bytes_per_second,
                                  "made up for tests/test_simulate.py"))


def _deep_mlp():
    return MLP((1024,) * 26)                 # 25 layers of 4 MiB: 100 MiB of weights, 400 MiB with Adam


def test_a_model_too_big_for_dp_is_recommended_fsdp_or_a_pipeline(small_gpu):
    model = _deep_mlp()
    simulation = oomless.simulate(model, torch.randn(2, 1024), global_batch=16, target="test-256mib", gpus=8,
                                  loss_fn=oomless.sum_of_outputs, optimizer=torch.optim.Adam(model.parameters()))
    dp = simulation.layout("dp x8")
    assert not dp.fits and dp.memory_per_rank_bytes > small_gpu.memory_bytes
    best = simulation.best
    assert best is not None and best.layout in ("fsdp", "pipeline", "hybrid")
    assert best.memory_per_rank_bytes <= small_gpu.memory_bytes


def test_each_layout_reports_its_model_flops_utilisation(small_gpu):
    """MFU: a sample's traced operations (25 layers of 1024 x 1024: 6 x 1024^2 a layer and sample,
    forward and backward, less the first layer's input gradient) times the samples a second, over
    the GPUs' peak in the dtype the step computes in (fp32 here); none for a profile measured on a
    real device, whose operations are not counted."""
    model = _deep_mlp()
    simulation = oomless.simulate(model, torch.randn(2, 1024), global_batch=16, target="test-256mib", gpus=8,
                                  loss_fn=oomless.sum_of_outputs, optimizer=torch.optim.Adam(model.parameters()))
    assert simulation.flops_per_sample == (25 * 6 - 2) * 1024**2
    assert simulation.peak_flops_per_second == pytest.approx(small_gpu.fp32_flops)
    best = simulation.best
    expected = simulation.flops_per_sample * 16 / best.step_seconds / (8 * small_gpu.fp32_flops)
    assert simulation.model_flops_utilisation(best) == pytest.approx(expected) and 0 < expected < 1
    assert all(simulation.model_flops_utilisation(estimate) is None for estimate in simulation.layouts
               if not estimate.fits)
    entry = next(entry for entry in simulation.to_dict()["layouts"] if entry["name"] == best.name)
    assert entry["model_flops_utilisation"] == pytest.approx(expected)
    assert f"model FLOPs utilisation {100 * expected:.0f} %" in str(simulation)
    measured = oomless.profile(model, torch.randn(2, 1024), loss_fn=oomless.sum_of_outputs)
    assert measured.flops is None
    scaled = oomless.simulate(model, torch.randn(2, 1024), global_batch=16, target="test-256mib", gpus=8,
                              loss_fn=oomless.sum_of_outputs, profile=measured)
    assert scaled.flops_per_sample is None and scaled.model_flops_utilisation(scaled.layouts[0]) is None


def test_the_peak_an_mfu_is_read_against_is_each_operations_own():
    """Each op counts at the peak of the dtype and kind it runs in, as the roofline times it: an fp32
    3D U-Net's convolutions at TF32's (cuDNN's default), a transformer's matmuls under bf16 autocast
    at bf16's, whatever precision simulate is told."""
    h100 = find_device("h100")
    with torch.device("meta"):
        unet = UNet3D(base_channels=4, depth=2)
        transformer = TinyTransformer(vocab_size=256, dim=64, depth=2, heads=4, max_len=64)
    volume = profile_for_target(unet, torch.empty(1, 1, 16, 16, 16, device="meta"), h100,
                                loss_fn=oomless.sum_of_outputs)
    assert volume.peak_flops_per_second == pytest.approx(h100.tf32_flops)
    tokens = torch.zeros(2, 64, dtype=torch.long, device="meta")
    bf16 = profile_for_target(transformer, tokens, h100, loss_fn=oomless.sum_of_outputs, precision="bf16")
    assert bf16.peak_flops_per_second == pytest.approx(h100.bf16_flops)
    simulation = oomless.simulate(transformer, tokens, global_batch=16, target="h100", gpus=8,
                                  loss_fn=oomless.sum_of_outputs, profile=bf16)
    assert simulation.peak_flops_per_second == bf16.peak_flops_per_second


def test_the_recommended_layout_is_the_fastest_that_fits(small_gpu):
    model = _deep_mlp()
    profile = profile_for_target(model, torch.randn(2, 1024), small_gpu, loss_fn=oomless.sum_of_outputs,
                                 optimizer=torch.optim.Adam(model.parameters()))
    estimates = estimate_layouts(profile, 2, make_cluster(small_gpu, 8, 2), 32)
    names = {estimate.name for estimate in estimates}
    assert {"dp x8", "fsdp x8", "pipeline pp8 1f1b", "hybrid dp2 x pp4 zero-bubble", "hybrid dp4 x pp2 gpipe"} <= names
    fitting = [estimate for estimate in estimates if estimate.fits]
    assert fitting and any(not estimate.fits for estimate in estimates)
    best = recommend(estimates)
    fastest = min(estimate.step_seconds for estimate in fitting)
    close = [estimate for estimate in fitting if estimate.step_seconds <= fastest * 1.01]
    assert best.fits and best in close
    assert best.memory_per_rank_bytes == min(estimate.memory_per_rank_bytes for estimate in close)
    assert all(estimate.memory_per_rank_bytes <= small_gpu.memory_bytes for estimate in fitting)


def test_what_each_process_keeps_is_added_to_every_layouts_peak_per_rank(small_gpu):
    """Profile.process_held_bytes (kernel caches a rank keeps for its shapes, measured on CPU by
    bench_simulate's calibration): every rank holds its own, so every layout's peak per rank grows by
    it, and nothing else in the estimate changes."""
    from dataclasses import replace

    model = _deep_mlp()
    profile = profile_for_target(model, torch.randn(2, 1024), small_gpu, loss_fn=oomless.sum_of_outputs,
                                 optimizer=torch.optim.Adam(model.parameters()))
    cluster = make_cluster(small_gpu, 8, 2)
    without = {estimate.name: estimate for estimate in estimate_layouts(profile, 2, cluster, 32)}
    held = 7 * MiB
    with_held = {estimate.name: estimate
                 for estimate in estimate_layouts(replace(profile, process_held_bytes=held), 2, cluster, 32)}
    assert with_held.keys() == without.keys()
    fitting = [name for name, estimate in without.items() if estimate.fits]
    # Both kinds of estimate: data parallel (here fsdp: dp does not fit) and pipelines.
    assert any(name.startswith(("dp", "fsdp")) for name in fitting)
    assert any(name.startswith(("pipeline", "hybrid")) for name in fitting)
    for name in fitting:
        assert with_held[name].memory_per_rank_bytes == without[name].memory_per_rank_bytes + held, name
        assert with_held[name].step_seconds == without[name].step_seconds, name


def test_a_pipeline_too_tight_to_keep_every_block_recomputes_only_what_it_must():
    """Between every block kept and every block recomputed, a pipeline stage's plan may recompute
    three quarters, half or a quarter of the blocks, spread evenly (`layouts.recompute_profile`):
    the fastest that fits is taken. A transformer whose 2-stage 1F1B pipeline keeps every block in
    205 MiB a rank: at 60 % of that it recomputes 9 of its 13 blocks, faster than recomputing all."""
    from dataclasses import replace

    from oomless.plan.layouts import recompute_profile

    with torch.device("meta"):
        model = TinyTransformer(vocab_size=256, dim=128, depth=8, heads=4, max_len=256)
    tokens = torch.zeros(8, 256, dtype=torch.long, device="meta")
    profile = profile_for_target(model, tokens, "h100", loss_fn=oomless.sum_of_outputs,
                                 optimizer=torch.optim.Adam(model.parameters()))
    half = recompute_profile(profile, 0.5)
    recomputed = [i for i, (mine, theirs) in enumerate(zip(half.blocks, profile.blocks)) if mine != theirs]
    assert recomputed == list(range(1, len(profile.blocks), 2))
    assert half.blocks[1].backward_seconds == profile.blocks[1].backward_seconds + profile.blocks[1].forward_seconds
    h100 = find_device("h100")

    def pipeline(memory: int):
        device = register_device(replace(h100, name=f"test-pipeline-{memory}", aliases=(), memory_bytes=memory))
        estimates = estimate_layouts(profile, 8, make_cluster(device, 2, 1), 32)
        return next(estimate for estimate in estimates if estimate.name == "pipeline pp2 1f1b"), device

    roomy, _ = pipeline(80 * 1024 * MiB)
    assert roomy.memory_plan == "keep all"
    tight, device = pipeline(int(0.6 * roomy.memory_per_rank_bytes))
    every, _ = pipeline(int(0.4 * roomy.memory_per_rank_bytes))
    assert every.fits and every.memory_plan == "recompute all"
    assert tight.fits and tight.memory_per_rank_bytes <= device.memory_bytes
    assert tight.memory_plan == f"keep {len(profile.blocks) - 9}, recompute 9"
    assert roomy.step_seconds < tight.step_seconds < every.step_seconds


def test_a_pipeline_whose_cut_the_memory_bends_recomputes_to_cut_evenly():
    """Every block kept can fit a 4-stage 1F1B pipeline only by cutting unevenly (the first rank
    holds 4 micro-batches in flight, so it takes fewer blocks) and then runs slower than with no
    limit: recomputing some blocks lets the cut be even. The plans are compared by the layout's
    whole step, and the note says what keeping every block would have taken."""
    import re
    from dataclasses import replace

    with torch.device("meta"):
        model = TinyTransformer(vocab_size=256, dim=128, depth=8, heads=4, max_len=256)
    tokens = torch.zeros(8, 256, dtype=torch.long, device="meta")
    profile = profile_for_target(model, tokens, "h100", loss_fn=oomless.sum_of_outputs,
                                 optimizer=torch.optim.Adam(model.parameters()))
    h100 = find_device("h100")

    def pipeline(memory: int):
        device = register_device(replace(h100, name=f"test-bent-{memory}", aliases=(), memory_bytes=memory))
        estimates = estimate_layouts(profile, 8, make_cluster(device, 4, 1), 32)
        return next(estimate for estimate in estimates if estimate.name == "pipeline pp4 1f1b")

    roomy = pipeline(80 * 1024 * MiB)
    assert roomy.memory_plan == "keep all" and roomy.microbatches == 16
    assert not any("keep all: fits" in note for note in roomy.notes)     # nothing else tried
    tight_bytes = int(0.85 * roomy.memory_per_rank_bytes)
    tight = pipeline(tight_bytes)
    assert tight.fits and tight.memory_per_rank_bytes <= tight_bytes
    assert tight.memory_plan.startswith("keep ") and "recompute" in tight.memory_plan, tight.memory_plan
    kept = [re.search(r"keep all: fits, ([0-9.]+) ms a step \(([0-9.]+) ms with no memory limit\)", note)
            for note in tight.notes]
    kept = next(match for match in kept if match)
    bent, unbounded = float(kept.group(1)), float(kept.group(2))
    assert unbounded == pytest.approx(roomy.step_seconds * 1e3, abs=0.05)
    assert roomy.step_seconds * 1e3 < tight.step_seconds * 1e3 < bent


def test_of_layouts_predicted_as_fast_the_one_holding_least_memory_is_recommended():
    """GPipe and 1F1B predict the same step; 1F1B holds fewer micro-batches: it is recommended. A
    layout more than 1 % faster wins whatever its memory."""
    from dataclasses import replace

    from oomless.plan.layouts import LayoutEstimate

    def layout(name, seconds, memory):
        return LayoutEstimate(name, 1, 2, None, 8, 32, True, seconds, memory, 0, "keep all", 0.0, 0.0, seconds)

    gpipe, one_f_one_b, dp = layout("gpipe", 0.200, 40 << 20), layout("1f1b", 0.2015, 20 << 20), layout("dp", 0.3, 1)
    assert recommend([gpipe, one_f_one_b, dp]) is one_f_one_b
    faster = replace(gpipe, step_seconds=0.195)
    assert recommend([faster, one_f_one_b, dp]) is faster
    assert recommend([replace(gpipe, fits=False), replace(dp, fits=False)]) is None


def test_of_layouts_as_fast_and_as_full_on_their_fullest_rank_the_one_holding_least_over_all_ranks_wins():
    """With as many micro-batches as stages, GPipe's and 1F1B's first ranks hold the same; 1F1B's
    last rank holds one micro-batch where GPipe's holds them all. Both predict the same step and
    the same peak per rank: 1F1B holds less over all ranks and is recommended, whatever the order."""
    from oomless.plan.layouts import all_ranks_bytes, estimate_pipeline

    with torch.device("meta"):
        model = UNet3D(base_channels=8, depth=3)
    volume = torch.zeros(8, 1, 16, 16, 16, device="meta")
    profile = profile_for_target(model, volume, "h100", loss_fn=oomless.sum_of_outputs,
                                 optimizer=torch.optim.Adam(model.parameters()))
    cluster = make_cluster("h100", 4, 1)
    gpipe, one_f_one_b = (estimate_pipeline(profile, cluster, 4, 8, 2, schedule) for schedule in ("gpipe", "1f1b"))
    assert gpipe.microbatches == one_f_one_b.microbatches == 2
    assert gpipe.step_seconds == pytest.approx(one_f_one_b.step_seconds)
    # The first rank holds both micro-batches under either; the last, GPipe both and 1F1B one.
    assert gpipe.memory_per_rank_bytes == one_f_one_b.memory_per_rank_bytes
    assert gpipe.partition.rank_bytes[-1] > one_f_one_b.partition.rank_bytes[-1]
    assert all_ranks_bytes(gpipe) == pytest.approx(
        2 * (sum(gpipe.partition.rank_bytes) + 2 * profile.process_held_bytes))
    assert all_ranks_bytes(one_f_one_b) < all_ranks_bytes(gpipe)
    assert recommend([gpipe, one_f_one_b]) is one_f_one_b and recommend([one_f_one_b, gpipe]) is one_f_one_b
    dp = estimate_data_parallel(profile, cluster, 1)
    assert all_ranks_bytes(dp) == 4 * dp.memory_per_rank_bytes


def test_a_deep_model_is_profiled_from_three_layers_and_extended():
    with torch.device("meta"):
        model = TinyTransformer(vocab_size=500, dim=64, depth=9, heads=4, max_len=32)
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    optimizer = torch.optim.Adam(model.parameters())
    whole = profile_for_target(model, tokens, "h100", loss_fn=oomless.sum_of_outputs, optimizer=optimizer)
    few = profile_few_layers(model, tokens, "h100", loss_fn=oomless.sum_of_outputs, optimizer=optimizer)
    assert len(model.blocks) == 9                               # put back as found
    assert [block.name for block in few.blocks] == [block.name for block in whole.blocks]
    for mine, theirs in zip(few.blocks, whole.blocks):
        assert mine.saved_bytes == theirs.saved_bytes and mine.parameter_bytes == theirs.parameter_bytes
        assert mine.forward_seconds == pytest.approx(theirs.forward_seconds)
        assert mine.flops == pytest.approx(theirs.flops)
    for name in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "buffer_bytes",
                 "unassigned_saved_bytes", "input_bytes"):
        assert getattr(few, name) == getattr(whole, name), name
    # The step's operations count all nine layers, as the whole model's do, and the note says so.
    assert few.flops == pytest.approx(whole.flops) and whole.flops >= sum(block.flops for block in whole.blocks) > 0
    assert any("3 of the 9 identical layers" in note and f"the step with all 9 is {format_flops(few.flops)}" in note
               for note in few.notes)
    # Pipeline blocks merged and micro-batches scaled carry them along.
    from oomless.plan.microbatches import merge_blocks
    merged = merge_blocks(few, [("first", list(range(4))), ("rest", list(range(4, len(few.blocks))))])
    assert sum(block.flops for block in merged.blocks) == pytest.approx(sum(block.flops for block in few.blocks))
    half = scale_profile(few, 0.5)
    busiest = max(range(len(few.blocks)), key=lambda i: few.blocks[i].flops)
    assert half.flops == pytest.approx(few.flops / 2)
    assert half.blocks[busiest].flops == few.blocks[busiest].flops / 2 > 0


def _layout_table(simulation) -> dict:
    return {estimate.name: (estimate.fits, estimate.step_seconds, estimate.memory_per_rank_bytes,
                            estimate.microbatches) for estimate in simulation.layouts}


def test_each_layout_is_traced_at_the_batch_it_runs_whatever_the_examples():
    """dp's and fsdp's per-rank batch and each pipeline micro-batch are traced at their own batch,
    so the answer does not depend on the example's batch; scaling one batch's profile linearly
    instead misses what a small batch runs less efficiently (the roofline's per-kernel floor on a
    small model: dp's 4 samples a rank from 1 sample's profile predicted ~3x slower) and the
    working memory of a larger batch (the attention scores)."""
    with torch.device("meta"):
        model = TinyTransformer(vocab_size=1000, dim=128, depth=4, heads=4, max_len=64)
    simulate = lambda batch, **options: oomless.simulate(
        model, torch.zeros(batch, 64, dtype=torch.long, device="meta"), 64, target="h100", gpus=16, nodes=2,
        loss_fn=oomless.sum_of_outputs, **options)
    one, four = simulate(1), simulate(4)
    assert _layout_table(one) == _layout_table(four)
    assert one.recommended == four.recommended
    # dp x16 steps 4 samples a rank: the profile traced at 4, as a step of 4 would be planned alone.
    traced = profile_few_layers(model, torch.zeros(4, 64, dtype=torch.long, device="meta"), "h100",
                                loss_fn=oomless.sum_of_outputs)
    by_hand = estimate_data_parallel(traced, make_cluster("h100", 16, 2), 4)
    assert (one.layout("dp x16").step_seconds, one.layout("dp x16").memory_per_rank_bytes) == \
        (by_hand.step_seconds, by_hand.memory_per_rank_bytes)
    # A profile given is scaled (nothing to trace it with), and a note says so.
    given = profile_few_layers(model, torch.zeros(1, 64, dtype=torch.long, device="meta"), "h100",
                               loss_fn=oomless.sum_of_outputs)
    scaled = simulate(1, profile=given)
    assert scaled.layout("dp x16").step_seconds > 2 * by_hand.step_seconds
    assert scaled.layout("dp x16").memory_per_rank_bytes < by_hand.memory_per_rank_bytes
    assert any("scaled linearly" in note for note in scaled.notes)
    assert not any("scaled linearly" in note for note in one.notes)


def test_profiles_measured_at_several_batches_are_each_scaled_to_the_batches_nearest_them():
    """``profile={samples: Profile}`` (measured profiles, as a CPU benchmark takes them): each layout's
    batch is scaled from the nearest measured one, so one measured at dp's per-rank batch gives dp
    exactly what a profile at that batch alone gives, and the micro-batches of one sample keep the
    one-sample profile's time, not a larger batch's scaled down; what is malformed is refused."""
    with torch.device("meta"):
        model = TinyTransformer(vocab_size=1000, dim=128, depth=4, heads=4, max_len=64)
    at = lambda batch: profile_few_layers(model, torch.zeros(batch, 64, dtype=torch.long, device="meta"), "h100",
                                          loss_fn=oomless.sum_of_outputs)
    simulate = lambda batch, **options: oomless.simulate(
        model, torch.zeros(batch, 64, dtype=torch.long, device="meta"), 64, target="h100", gpus=16, nodes=2,
        loss_fn=oomless.sum_of_outputs, **options)
    one, four = at(1), at(4)
    both = simulate(1, profile={1: one, 4: four})
    alone_at_four = simulate(4, profile=four)
    assert both.layout("dp x16").step_seconds == alone_at_four.layout("dp x16").step_seconds
    assert both.layout("dp x16").memory_per_rank_bytes == alone_at_four.layout("dp x16").memory_per_rank_bytes
    # Replicas of 2 stages taking 8 micro-batches of one sample: from the one-sample profile, slower per
    # sample than four samples' profile scaled down (the roofline's per-kernel floor).
    name = "hybrid dp8 x pp2 zbv"
    assert (both.layout(name).microbatches, both.layout(name).samples_per_replica) == (8, 8)
    assert both.layout(name).step_seconds > 1.5 * alone_at_four.layout(name).step_seconds
    assert both.layout(name).step_seconds == simulate(1, profile=one).layout(name).step_seconds
    assert any("profiled at batches of 1, 4" in note for note in both.notes)
    with pytest.raises(oomless.InputError, match="must hold a profile at the example's batch of 2 samples; it has 1, 4"):
        simulate(2, profile={1: one, 4: four})
    with pytest.raises(oomless.InputError, match="must map batch sizes"):
        simulate(1, profile={1: one, "4": four})


def test_a_loss_of_the_examples_targets_is_traced_at_each_batch_with_example_at():
    """A loss that reads the example's own targets cannot run on other inputs: without
    ``example_at`` the example's batch is scaled (and a note asks for it); with it every batch is
    traced, each with its own loss, and asked for once."""
    with torch.device("meta"):
        model = TinyTransformer(vocab_size=1000, dim=64, depth=3, heads=4, max_len=32)

    def example(batch):
        tokens = torch.zeros(batch, 32, dtype=torch.long, device="meta")
        return tokens, lambda logits: torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    asked = []

    def example_at(batch):
        asked.append(batch)
        return example(batch)

    tokens, loss_fn = example(2)
    scaled = oomless.simulate(model, tokens, 16, target="h100", gpus=4, loss_fn=loss_fn)
    assert any("pass example_at" in note for note in scaled.notes)
    traced = oomless.simulate(model, tokens, 16, target="h100", gpus=4, loss_fn=loss_fn, example_at=example_at)
    assert len(asked) == len(set(asked)) and 4 in asked           # dp's 16 / 4 samples a rank, traced once
    assert all(16 % batch == 0 and batch != 2 for batch in asked)  # micro-batches; the example's own not again
    alone = oomless.simulate(model, *example(4)[:1], 16, target="h100", gpus=4, loss_fn=example(4)[1],
                             example_at=example)
    assert _layout_table(traced) == _layout_table(alone)
    with pytest.raises(oomless.InputError, match="example_at must be a function"):
        oomless.simulate(model, tokens, 16, target="h100", gpus=4, loss_fn=loss_fn, example_at=4)
    with pytest.raises(oomless.InputError, match=r"example_at\(4\) must return \(example_inputs, loss_fn\)"):
        oomless.simulate(model, tokens, 16, target="h100", gpus=4, loss_fn=loss_fn,
                         example_at=lambda batch: example(batch)[0])
    with pytest.raises(oomless.InputError, match=r"example_at\(4\) returned inputs of 2 samples"):
        oomless.simulate(model, tokens, 16, target="h100", gpus=4, loss_fn=loss_fn, example_at=lambda batch: example(2))
    with pytest.raises(oomless.InputError, match="a profile or example_at, not both"):
        oomless.simulate(model, tokens, 16, target="h100", gpus=4, loss_fn=loss_fn, example_at=example,
                         profile=scaled_profile(model, tokens, loss_fn))


def scaled_profile(model, tokens, loss_fn):
    return profile_few_layers(model, tokens, "h100", loss_fn=loss_fn)


def test_a_batch_the_step_does_not_run_at_is_scaled_and_a_note_says_why():
    """BatchNorm in training needs two samples: dp over 8 GPUs steps one a rank. That batch is
    scaled from the example's, as before tracing, and the simulation still answers."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*[layer for _ in range(4) for layer in
                                      (torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU())])
    example = torch.zeros(8, 64, device="meta")
    simulation = oomless.simulate(model, example, 8, target="h100", gpus=8, loss_fn=oomless.sum_of_outputs)
    assert any("could not be traced at a batch of 1" in note and "Expected more than 1 value per channel" in note
               and "scaled from the example's 8" in note for note in simulation.notes)
    scaled = oomless.simulate(model, example, 8, target="h100", gpus=8, loss_fn=oomless.sum_of_outputs,
                              profile=profile_few_layers(model, example, "h100", loss_fn=oomless.sum_of_outputs))
    assert simulation.layout("dp x8").step_seconds == scaled.layout("dp x8").step_seconds
    assert simulation.recommended is not None


def run_oomless(*arguments: str, cwd=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(SOURCE)}
    return subprocess.run([sys.executable, "-m", "oomless", *arguments], capture_output=True, text=True,
                          env=environment, cwd=cwd, timeout=300)


def test_the_command_line_prints_json_that_parses_and_draws_the_timeline(tmp_path):
    completed = run_oomless("simulate", "transformer", "--input-shape", "2,32", "--global-batch", "16",
                            "--target", "h100", "--gpus", "4", "--nodes", "2", "--json",
                            "--plot", str(tmp_path / "timeline.png"), "--model-arg", "depth=4",
                            "--model-arg", "max_len=32")
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)
    assert result["recommended"] in [layout["name"] for layout in result["layouts"]]
    assert result["cluster"]["gpus"] == 4 and result["cluster"]["nodes"] == 2
    assert {layout["layout"] for layout in result["layouts"]} == {"dp", "fsdp", "pipeline", "hybrid"}
    assert (tmp_path / "timeline.png").stat().st_size > 0
    # The example's batch does not change the answer: each layout's step is traced at its own, with
    # the next-token loss of that batch's tokens.
    other = run_oomless("simulate", "transformer", "--input-shape", "1,32", "--global-batch", "16",
                        "--target", "h100", "--gpus", "4", "--nodes", "2", "--json", "--model-arg", "depth=4",
                        "--model-arg", "max_len=32")
    assert other.returncode == 0, other.stderr
    layouts = lambda answer: [{key: value for key, value in layout.items() if key != "timeline"}
                              for layout in answer["layouts"]]
    assert layouts(json.loads(other.stdout)) == layouts(result)


@pytest.mark.parametrize("arguments, message", [
    (("--target", "h900", "--gpus", "8"), "unknown target device 'h900'; known: "),
    (("--gpus", "12", "--nodes", "5"), "12 GPUs do not spread evenly over 5 nodes: give a number of nodes dividing 12 "
                                       "(1, 2, 3, 4, 6, 12)"),
    (("--gpus", "8", "--global-batch", "20"), "a global batch of 20 does not split evenly over 8 GPUs"),
])
def test_bad_input_is_one_line_naming_what_would_work(arguments, message):
    base = {"--global-batch": "16", "--input-shape": "2,32"}
    flags = dict(zip(arguments[::2], arguments[1::2]))
    completed = run_oomless("simulate", "transformer", *[item for pair in {**base, **flags}.items() for item in pair])
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], completed.stderr


def test_an_input_shape_the_model_cannot_take_is_one_line():
    completed = run_oomless("simulate", "mlp", "--input-shape", "2,64", "--global-batch", "16", "--gpus", "8")
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and "model 'mlp' fails on its example input of shape (2, 64)" in lines[0], completed.stderr
    assert "--input-shape N,C" in lines[0]


def test_bad_input_in_the_python_api_raises_input_error():
    model = MLP(SIZES)
    inputs = torch.randn(2, SIZES[0])
    with pytest.raises(oomless.InputError, match="use a multiple of 8: 16 or 24"):
        oomless.simulate(model, inputs, global_batch=20, gpus=8)
    with pytest.raises(oomless.InputError, match="known: "):
        oomless.simulate(model, inputs, global_batch=16, target="tpu", gpus=8)
    with pytest.raises(oomless.InputError, match=r"\(1, 2, 4, 8\)"):
        oomless.simulate(model, inputs, global_batch=16, gpus=8, nodes=3)
    with pytest.raises(oomless.InputError, match="unknown keys"):
        oomless.simulate(model, inputs, global_batch=16, gpus=8, cluster={"nvlink": 1})


def test_a_cluster_file_overrides_the_links_and_names_unknown_keys(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"inter_node": {"name": "RoCE 200G", "bytes_per_second": 25e9}, "efficiency": 0.9}))
    cluster = make_cluster("h100", 16, 2, path=str(path))
    assert cluster.inter_node.name == "RoCE 200G" and cluster.inter_node.bytes_per_second == 25e9
    assert cluster.inter_node.latency_seconds == make_cluster("h100", 16, 2).inter_node.latency_seconds
    assert cluster.intra_node.bytes_per_second == 450e9 and cluster.efficiency == 0.9
    slower = all_reduce_seconds(cluster, Group(8, 2), 1e9)
    assert slower > all_reduce_seconds(make_cluster("h100", 16, 2), Group(8, 2), 1e9)
    path.write_text(json.dumps({"inter_node": {"gbps": 200}}))
    with pytest.raises(oomless.InputError, match="unknown fields"):
        make_cluster("h100", 16, 2, path=str(path))


class _IndexedStack(nn.Module):
    """Reads its stack by a count of its own: cut to three layers, its forward cannot run."""

    def __init__(self, depth: int = 8):
        super().__init__()
        self.depth = depth
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(depth)])

    def forward(self, x):
        for index in range(self.depth):
            x = torch.relu(self.layers[index](x))
        return x


def test_a_model_reading_its_stack_by_its_own_count_is_profiled_whole():
    """`profile_few_layers` raised IndexError from inside the forward (`oomless simulate` crashed)."""
    model = _IndexedStack()
    profile = profile_few_layers(model, torch.zeros(4, 64, device="meta"), "h100", loss_fn=oomless.sum_of_outputs)
    assert [block.name for block in profile.blocks] == [f"layers.{index}" for index in range(8)]
    assert len(model.layers) == 8


def test_a_device_typed_by_hand_is_checked_where_it_is_made(tmp_path):
    """A zero, a string or a lone alias string in a datasheet gave a ZeroDivisionError deep in a
    prediction, 'no layout fits -1 B', or a target for each letter of the alias; a bad OOMLESS_DEVICES
    file a traceback at import."""
    from oomless.errors import InputError
    from oomless.plan.devices import load_devices

    h100 = find_device("h100")
    fields = {**h100.__dict__, "name": "mine", "aliases": ()}
    for field, value in (("fp32_flops", -1.0), ("memory_bytes", "48GB"), ("memory_bytes", -1),
                         ("memory_bytes_per_second", float("nan")), ("host_to_device_bytes_per_second", 0),
                         ("aliases", ("",))):
        with pytest.raises(InputError, match=field):
            Device(**{**fields, field: value})
    entry = {**fields, "name": "my-card", "aliases": "mycard"}
    (tmp_path / "devices.json").write_text(json.dumps([entry]))
    load_devices(str(tmp_path / "devices.json"))
    assert find_device("mycard").name == "my-card" and find_device("my-card") is find_device("mycard")
    with pytest.raises(InputError):
        find_device("m")
    (tmp_path / "bad.json").write_text(json.dumps([{**entry, "memory_bytes_per_second": 0}]))
    completed = subprocess.run([sys.executable, "-m", "oomless", "simulate", "mlp", "--input-shape", "8,16",
                                "--global-batch", "16", "--target", "h100", "--gpus", "2"], capture_output=True,
                               text=True, timeout=120,
                               env={**os.environ, "OOMLESS_DEVICES": str(tmp_path / "bad.json"),
                                    "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    assert completed.returncode == 2 and "Traceback" not in completed.stderr, completed.stderr[-2000:]
    assert "OOMLESS_DEVICES" in completed.stderr and "memory_bytes_per_second must be a positive number" \
        in completed.stderr


@pytest.mark.parametrize("settings", [
    {"intra_node": {"bytes_per_second": "450e9"}}, {"intra_node": {"bytes_per_second": None}},
    {"intra_node": {"bytes_per_second": True}}, {"intra_node": {"latency_seconds": "3us"}},
    {"inter_node": {"latency_seconds": float("nan")}}, {"inter_node": {"latency_seconds": float("inf")}},
    {"fsdp_host_seconds": float("inf")}, {"contention": {"2": float("inf")}}, {"efficiency": True}])
def test_cluster_settings_of_the_wrong_kind_are_refused(settings):
    """A string, null, true, NaN or infinity gave a TypeError traceback, or a recommendation of
    'step inf s, 0 tokens/s' (NaN latencies dropped silently by some layouts)."""
    from oomless.errors import InputError

    with pytest.raises(InputError):
        make_cluster("h100", 8, 2, overrides=settings)
