"""Pipeline parallel equals one process: gloo on CPU, 2 and 4 pipeline ranks, every schedule, a 2 x 2
pipeline x data hybrid; 5 SGD-momentum steps (lr 0.1), same global batch (why not Adam: see
`make_optimizer` in tests/pipeline_workers.py).

Stated tolerance: 1e-6 absolute on every parameter, and on every buffer (BatchNorm's running
statistics and batch counts) wherever the replicas of a stage share them (measured ~6e-8). The math is
the same but not the float summation order: gradients are sums of per-micro-batch gradients each
divided by the number of micro-batches (torch's schedule) rather than one mean over the global batch,
and a tied weight's gradient is the sum of its two stages' parts. BatchNorm normalises each
micro-batch of each replica by its own statistics (as GPipe does), so the U-Net's reference
accumulates gradients over the same chunks of the global batch; with one micro-batch and one replica
that is the plain global batch. A job with ``global_batchnorm`` takes BatchNorm's statistics over
the replicas instead (as the training loop's hybrid layout does), its reference over their union.
A job with a policy also checks that its stage plans say that policy and that the runtime carried it
out (blocks recomputed, bytes offloaded): equal weights alone would not tell a plan from none.
"""

import pytest
import torch

from oomless.errors import InputError
from oomless.models import TinyTransformer
from oomless.parallel.block_sequence import transformer_sequence, unet_sequence
from oomless.parallel.pipeline import cuts_from_stage_blocks
from tests.pipeline_workers import (STEPS, UNET_VOLUMES, buffers_agree, build, reference, reference_chunks,
                                    run_pipeline_jobs, runnable_here)

TOLERANCE = 1e-6


def _max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max(((first[name].double() - second[name].double()).abs().max().item() for name in first), default=0.0)


def _check(results: dict, jobs: list[dict]) -> None:
    for job in jobs:
        parameters, buffers = reference(job["kind"], reference_chunks(job), job.get("clip"),
                                        job.get("volumes", UNET_VOLUMES))
        result = results[job["name"]]
        difference = _max_difference(result["parameters"], parameters)
        assert difference <= TOLERANCE, (job["name"], difference)
        if buffers_agree(job):
            difference = _max_difference(result["buffers"], buffers)       # every buffer, on every rank holding it
            assert difference <= TOLERANCE, (job["name"], "buffers", difference)
        if "policy" in job:
            _check_stage_plans(job, result["stages"])


def _check_stage_plans(job: dict, stages_by_rank: list[list[dict]]) -> None:
    """Every stage's plan says ``policy`` on every block, and the stage's runtime did it: under
    recompute each of the plan's blocks that saves anything for backward re-ran at least once per
    micro-batch and step, under swap bytes went to the tier."""
    stages = [stage for by_rank in stages_by_rank for stage in by_rank]
    assert len(stages) == (len(job["cuts"]) - 1) * job.get("dp", 1)
    assert all(stage["decisions"] == [job["policy"]] for stage in stages), job["name"]
    # The schedule holds each stage's output into its backward: no plan counts it freed before.
    assert all(stage["output_freed_bytes"] == 0 for stage in stages), job["name"]
    for stage in stages:
        if job["policy"] == "recompute":
            runs = stage["saving_blocks"] * job["microbatches"] * STEPS
            assert stage["recomputed_blocks"] >= runs, (job["name"], stage)
        if job["policy"] == "swap":
            assert stage["offloaded_bytes"] > 0, (job["name"], stage)


def test_two_rank_pipelines_equal_one_process(tmp_path):
    unet = unet_sequence(build("unet")[0])
    jobs = [
        dict(name="gpipe", kind="transformer", cuts=[0, 4, 8], microbatches=4, schedule="gpipe"),
        dict(name="1f1b", kind="transformer", cuts=[0, 3, 8], microbatches=4, schedule="1f1b"),
        dict(name="interleaved", kind="transformer", cuts=[0, 2, 4, 6, 8], microbatches=4, schedule="interleaved-1f1b"),
        dict(name="zero-bubble", kind="transformer", cuts=[0, 2, 4, 6, 8], microbatches=4, schedule="zero-bubble"),
        dict(name="zbv", kind="transformer", cuts=[0, 2, 4, 6, 8], microbatches=4, schedule="zbv"),
        # A cut where two skips cross; one micro-batch: BatchNorm sees the whole global batch.
        dict(name="unet", kind="unet", cuts=[0, unet.index("bottleneck"), len(unet.blocks)], microbatches=1,
             schedule="gpipe"),
        dict(name="unet-1f1b", kind="unet", cuts=[0, 3, len(unet.blocks)], microbatches=2, schedule="1f1b"),
        # Each stage with its own fit-engine plan, several micro-batches in flight.
        dict(name="recompute", kind="transformer", cuts=[0, 3, 8], microbatches=4, schedule="1f1b", policy="recompute"),
        dict(name="swap", kind="unet", cuts=[0, 3, len(unet.blocks)], microbatches=2, schedule="gpipe", policy="swap"),
        # BatchNorm recomputed while other micro-batches' forwards run between (1F1B with 4 in flight
        # on stage 0: F0 F1 B0 F2 B1 ...): running statistics must still move once per micro-batch.
        dict(name="unet-1f1b-recompute", kind="unet", cuts=[0, 3, len(unet.blocks)], microbatches=4, schedule="1f1b",
             policy="recompute", volumes=4),
        # Backward split into input and weight passes: each recomputes the block, BatchNorm included.
        dict(name="unet-zero-bubble-recompute", kind="unet", cuts=[0, 2, 4, 6, 8], microbatches=2,
             schedule="zero-bubble", policy="recompute"),
        dict(name="zero-bubble-recompute", kind="transformer", cuts=[0, 2, 4, 6, 8], microbatches=4,
             schedule="zero-bubble", policy="recompute"),
    ]
    jobs = runnable_here(jobs)
    _check(run_pipeline_jobs(2, jobs, tmp_path), jobs)
    # The reference moved: the comparison is not of untouched initial weights.
    initial = {name: parameter.detach() for name, parameter in build("transformer")[0].named_parameters()}
    assert _max_difference(initial, reference("transformer")[0]) > 1e-4


def test_four_stage_and_two_by_two_hybrid_equal_one_process(tmp_path):
    jobs = [
        dict(name="4-stage", kind="transformer", cuts=[0, 2, 4, 6, 8], microbatches=4, schedule="1f1b"),
        dict(name="4-stage-zbv", kind="transformer", cuts=list(range(9)), microbatches=4, schedule="zbv"),
        # Clipping by the global norm with the tied embedding on stages 0 and 3 (counted once).
        dict(name="4-stage-clipped", kind="transformer", cuts=[0, 2, 4, 6, 8], microbatches=4, schedule="1f1b",
             clip=0.5),
        dict(name="unet-4-stage", kind="unet", cuts=[0, 2, 4, 6, 8], microbatches=2, schedule="gpipe"),
        dict(name="hybrid", kind="transformer", cuts=[0, 3, 8], microbatches=2, schedule="1f1b", dp=2),
        dict(name="unet-hybrid", kind="unet", cuts=[0, 4, 8], microbatches=1, schedule="gpipe", dp=2),
        # BatchNorm over both replicas (what the training loop's hybrid layout runs), recomputed: its
        # all-reduces run again in backward, and its running statistics must still move once per step.
        dict(name="unet-hybrid-recompute", kind="unet", cuts=[0, 4, 8], microbatches=1, schedule="gpipe", dp=2,
             policy="recompute", global_batchnorm=True),
    ]
    jobs = runnable_here(jobs)
    _check(run_pipeline_jobs(4, jobs, tmp_path), jobs)
    assert _max_difference(reference("transformer", clip=0.5)[0], reference("transformer")[0]) > 1e-4   # it clipped


def test_a_cut_across_skips_carries_every_live_tensor():
    model = build("unet")[0].eval()
    sequence = unet_sequence(model)
    cut = sequence.index("bottleneck")
    assert sequence.crossing(cut) == ("skip0", "x", "skip1")
    volume = torch.randn(2, 1, 8, 8, 8)
    first, second = sequence.stage(0, cut), sequence.stage(cut, len(sequence.blocks))
    assert torch.equal(second(*first(volume)), model(volume))


def test_cuts_from_a_partition_must_follow_the_sequence():
    sequence = transformer_sequence(TinyTransformer(depth=2))
    assert cuts_from_stage_blocks(sequence, [["embed", "block0"], ["block1", "head"]]) == [0, 2, 4]
    with pytest.raises(InputError, match="sequence continues with"):
        cuts_from_stage_blocks(sequence, [["embed", "block1"], ["block0", "head"]])
    with pytest.raises(InputError, match="cover 3 of 4"):
        cuts_from_stage_blocks(sequence, [["embed"], ["block0", "block1"]])


def test_a_stage_profile_holds_its_output_through_backward_as_the_schedule_does():
    """The profiling step drops a stage's output before backward where its loss (the sum of outputs)
    does not save it; torch's schedules keep it until the micro-batch's backward is done, so a
    stage's plan counts it in every backward phase (`stage_fit.held_by_the_schedule`)."""
    import dataclasses

    import oomless
    from oomless.parallel.stage_fit import held_by_the_schedule

    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4096))
    profile = oomless.profile(stage, torch.randn(512, 64), loss_fn=oomless.sum_of_outputs)
    output_bytes = 512 * 4096 * 4
    assert profile.output_freed_bytes == output_bytes          # 8 MiB the sum does not save
    held = held_by_the_schedule(profile)
    assert held.output_freed_bytes == 0
    for before, after in zip(profile.blocks, held.blocks):
        assert after.backward_other_bytes == before.backward_other_bytes + output_bytes, after.name
        assert after.backward_peak_bytes == before.backward_peak_bytes + output_bytes, after.name
        assert after.backward_own_peak_bytes == before.backward_own_peak_bytes + output_bytes, after.name
        assert dataclasses.replace(after, backward_other_bytes=before.backward_other_bytes,
                                   backward_peak_bytes=before.backward_peak_bytes,
                                   backward_own_peak_bytes=before.backward_own_peak_bytes) == before
    assert held_by_the_schedule(held) is held                   # nothing freed: unchanged
    # The plan made from it counts the output held, so more memory than from the step as profiled.
    assert oomless.plan(stage, torch.randn(512, 64), 2**40, profile=held).predicted_peak_bytes > \
        oomless.plan(stage, torch.randn(512, 64), 2**40, profile=profile).predicted_peak_bytes
