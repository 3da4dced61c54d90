"""Pipeline and hybrid layouts under ``--precision bf16|fp16`` and ``--compile`` train what one process
trains: gloo on CPU, 2 pipeline ranks and a 2 x 2 pipeline x data hybrid, 5 SGD-momentum steps
(tests/pipeline_workers.py), then the training loop itself (6 Adam steps, `oomless train`'s U-Net).

The reference is one process with the whole forward under ``torch.autocast``, the loss in fp32 on its
output brought to fp32, fp16 with ``torch.amp.GradScaler`` (`train_reference`; what oomless's
precision does in one process, tests/test_precision.py), the same global batch. With micro-batches or
replicas the reference accumulates over the same chunks of the global batch, as tests/test_pipeline.py's
U-Net reference does: under bf16 a chunk's weight gradient is rounded to bf16 by the matmul or
convolution that makes it, so one whole-batch gradient is another rounding (the transformer with 4
micro-batches against the whole batch: 4.8e-4, as far as bf16 is from fp32).

Tolerances, and why:
- bitwise (``torch.equal``) where the arithmetic is the same: one replica and no tied weight. Every op
  runs on the same values in the same dtypes: a bf16 tensor crosses a cut as bf16, the micro-batch
  mean divides by a power of two (exact), and so does fp16's unscaling. Measured bitwise for every
  such job, plans, recompute, swap and compiled (aot_eager) blocks included.
- 1e-6 absolute (tests/test_pipeline.py's) where fp32 sums run in another order: a tied weight's
  gradient is the sum of its two stages' parts, and the replica average adds replicas' gradients
  rather than accumulating chunks. Measured 7e-9 to 9e-8.
- Under fp16 those fp32 differences can flip the rounding of a weight cast to fp16, and that one
  element's gradient differs by an fp16 ulp: the transformer's zero-bubble job (tied weights, the
  overflow skipped at step 1) agreed to 1.9e-9 after four steps and 4.9e-6 after the fifth on an AMD
  EPYC (torch 2.13.0+cpu, 2026-11-29; 149 of its 78,848 weights beyond 1e-6, the 1f1b cut the same;
  9e-8 or less on the Intel Xeon before). A non-exact fp16 job may have `FLIP_SHARE` of its weights
  beyond 1e-6 and none beyond `FLIP_TOLERANCE`; a layout that lost a chunk's gradient or unscaled
  twice moves most of them, far further.
- Every comparison also checks that the reference at its precision is further from the fp32 one than
  100x the tolerance (bf16: 5.5e-4 for the transformer, 1.1e-2 for the U-Net), so a layout that
  silently trained in fp32 would fail.
- The training loop's hybrid normalises BatchNorm over the replicas (`GlobalBatchNorm`, fp32 statistics
  summed per replica, then across): its statistics differ from one process's kernel in the last fp32
  bit, which flips the bf16 rounding of some normalised elements, and 6 Adam steps spread that over
  the weights (1.5e-3 bf16 and 2.5e-3 fp16 max, 8e-4 for dp; bf16 vs fp32 is 3.5e-3), so no weight
  tolerance separates it from fp32 there. Its first loss (no step yet) is compared instead, to 1e-6
  relative (measured 7e-8; fp32's differs by 7e-4 from bf16's, 1.2e-5 from fp16's), and its run with
  per-stage plans to the one without, bitwise.
"""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from oomless.errors import InputError
from oomless.parallel.block_sequence import unet_sequence
from oomless.parallel.pipeline import PipelineParallel, stage_shapes
from oomless.parallel.stage_fit import _stage_inputs
from oomless.runtime.precision import LossScaler
from tests.parallel_workers import run_jobs, tiny_config
from tests.pipeline_workers import STEPS, build, run_pipeline_jobs, train_reference

TOLERANCE = 1e-6
FLIP_TOLERANCE = 2e-5       # under fp16: an fp16 rounding flipped by fp32 sum-order differences (see above)
FLIP_SHARE = 0.01           # ... in at most this share of the weights
COMPILE = {"backend": "aot_eager"}       # inductor takes minutes on this CPU; aot_eager runs the same ops


def _differences(first: dict, second: dict) -> list[torch.Tensor]:
    """Each tensor's elementwise absolute difference, in float64."""
    assert first.keys() == second.keys()
    return [(first[name].double() - second[name].double()).abs() for name in first]


def _max_difference(first: dict, second: dict) -> float:
    return max(difference.max().item() for difference in _differences(first, second))


def _share_beyond(first: dict, second: dict, tolerance: float) -> float:
    """The share of all elements of ``first`` further than ``tolerance`` from ``second``'s."""
    differences = _differences(first, second)
    return sum(int((difference > tolerance).sum()) for difference in differences) / \
        sum(difference.numel() for difference in differences)


def _parameters(model) -> dict:
    return {name: parameter.detach() for name, parameter in model.named_parameters()}


def _check(results: dict, jobs: list[dict]) -> None:
    """Each job against one process at its precision: bitwise or within `TOLERANCE` (``exact``), the
    reference far from fp32's, fp16's skips and scale equal on every rank and GradScaler's."""
    for job in jobs:
        chunks = job.get("dp", 1) * job["microbatches"]
        model, scaler = train_reference(job["kind"], chunks, precision=job["precision"], overflow=job.get("overflow"))
        expected, result = _parameters(model), results[job["name"]]
        if job["exact"]:
            unequal = [name for name in expected if not torch.equal(result["parameters"][name], expected[name])]
            assert not unequal, (job["name"], unequal[:3], _max_difference(result["parameters"], expected))
        elif job["precision"] == "fp16":
            assert _max_difference(result["parameters"], expected) <= FLIP_TOLERANCE, job["name"]
            assert _share_beyond(result["parameters"], expected, TOLERANCE) <= FLIP_SHARE, job["name"]
        else:
            assert _max_difference(result["parameters"], expected) <= TOLERANCE, job["name"]
        fp32 = _parameters(train_reference(job["kind"], chunks)[0])
        assert _max_difference(expected, fp32) > 100 * TOLERANCE, (job["name"], "the reference ran in fp32")
        if job["precision"] == "fp16":
            assert scaler.get_scale() < 2.0**16, "the forced overflow was skipped, the scale halved"
            skipped = round(torch.log2(torch.tensor(2.0**16 / scaler.get_scale())).item())
            assert result["scalers"] == [{"scale": scaler.get_scale(), "skipped_steps": skipped}] * len(
                result["scalers"]), (job["name"], result["scalers"])
        stages = [stage for by_rank in result["stages"] for stage in by_rank]
        assert all(stage["precision"] == job["precision"] for stage in stages)
        if job.get("policy") == "recompute":
            assert all(stage["recomputed_blocks"] >= stage["saving_blocks"] * job["microbatches"] * STEPS > 0
                       for stage in stages), stages
        if job.get("policy") == "swap":
            assert all(stage["offloaded_bytes"] > 0 for stage in stages), stages
        if "compile" in job:        # every rank's stages ran compiled blocks
            assert all(compiled["modules"] > 0 and compiled["graphs"] > 0 for compiled in result["compiled"]), \
                result["compiled"]


def test_two_stage_pipelines_under_bf16_fp16_and_compile_equal_one_process(tmp_path):
    unet = unet_sequence(build("unet")[0])
    across_skips = [0, unet.index("bottleneck"), len(unet.blocks)]     # skip0, x and skip1 cross, skips in bf16
    jobs = [
        dict(name="unet-bf16", kind="unet", cuts=across_skips, microbatches=1, schedule="gpipe", precision="bf16",
             exact=True),
        dict(name="unet-bf16-1f1b", kind="unet", cuts=[0, 3, len(unet.blocks)], microbatches=2, schedule="1f1b",
             precision="bf16", exact=True),
        # The tied embedding and head on different ranks: their gradients are summed across them.
        dict(name="transformer-bf16", kind="transformer", cuts=[0, 3, 8], microbatches=4, schedule="1f1b",
             precision="bf16", exact=False),
        # An inf in one rank's gradient (stage 0's): both ranks skip that step and halve the scale.
        dict(name="unet-fp16-overflow", kind="unet", cuts=across_skips, microbatches=1, schedule="gpipe",
             precision="fp16", exact=True, overflow=dict(step=2, rank=0, parameter="encoders.0.0.weight")),
        # Weight gradients in the bubbles (autograd.grad on the weights): each is still unscaled as it
        # accumulates; the inf this time on rank 1, in the last stage's norm.
        dict(name="transformer-fp16-zero-bubble", kind="transformer", cuts=[0, 2, 4, 6, 8], microbatches=4,
             schedule="zero-bubble", precision="fp16", exact=False,
             overflow=dict(step=1, rank=1, parameter="ln_f.weight")),
        # Stage plans profiled and planned in bf16 (their saved bytes below), recomputed under autocast.
        dict(name="unet-bf16-recompute", kind="unet", cuts=[0, 3, len(unet.blocks)], microbatches=2,
             schedule="1f1b", precision="bf16", exact=True, policy="recompute"),
        dict(name="unet-fp32-recompute", kind="unet", cuts=[0, 3, len(unet.blocks)], microbatches=2,
             schedule="1f1b", precision="fp32", exact=True, policy="recompute"),
        # Each stage's blocks compiled in place, alone and composed with a swap plan.
        dict(name="unet-bf16-compiled", kind="unet", cuts=across_skips, microbatches=1, schedule="gpipe",
             precision="bf16", exact=True, compile=COMPILE),
        dict(name="unet-fp16-compiled-swap", kind="unet", cuts=[0, 3, len(unet.blocks)], microbatches=2,
             schedule="1f1b", precision="fp16", exact=True, compile=COMPILE, policy="swap",
             overflow=dict(step=3, rank=1, parameter="head.weight")),
    ]
    results = run_pipeline_jobs(2, jobs, tmp_path)
    _check(results, [job for job in jobs if job["precision"] != "fp32"])
    # The same plan and job in fp32 trains other weights: the bf16 stages ran in bf16.
    assert _max_difference(results["unet-fp32-recompute"]["parameters"],
                           results["unet-bf16-recompute"]["parameters"]) > 100 * TOLERANCE
    # Plans sized for bf16 bytes: each stage's saved activations, as planned, under fp32's. Not half:
    # CPU autocast keeps max-pool in fp32, and the bf16 copies of the weights autocast makes are saved
    # too, a large share at one 8^3 volume (measured 0.83 and 0.82; the U-Net at 16^3 in
    # tests/test_precision.py: 0.62). A stage profiled in fp32 would give 1.
    for bf16, fp32 in zip(*(sum(results[name]["stages"], []) for name in ("unet-bf16-recompute",
                                                                           "unet-fp32-recompute"))):
        assert 0 < bf16["saved_bytes"] < 0.9 * fp32["saved_bytes"], (bf16, fp32)
    # Compiled equals eager bitwise (both equal the reference bitwise; said once more directly).
    for name, parameter in results["unet-bf16"]["parameters"].items():
        assert torch.equal(parameter, results["unet-bf16-compiled"]["parameters"][name]), name


def test_a_two_by_two_hybrid_under_bf16_and_fp16_equals_one_process(tmp_path):
    jobs = [
        dict(name="transformer-hybrid-bf16", kind="transformer", cuts=[0, 3, 8], microbatches=2, schedule="1f1b",
             dp=2, precision="bf16", exact=False),
        # Each replica's BatchNorm on its own shard (the reference's chunks); the inf on rank 3 only
        # (stage 1 of replica 1), after the replica average: every rank of the mesh still skips.
        dict(name="unet-hybrid-fp16-overflow", kind="unet", cuts=[0, 4, 8], microbatches=1, schedule="gpipe", dp=2,
             precision="fp16", exact=False, overflow=dict(step=2, rank=3, parameter="head.weight")),
    ]
    _check(run_pipeline_jobs(4, jobs, tmp_path), jobs)


def test_traced_stages_of_gpt2_and_monai_unet_under_bf16_and_compile_equal_one_process(tmp_path):
    """Models traced with torch.export (`oomless.parallel.traced`): their blocks' ATen ops dispatch
    through autocast as the model's own calls do. GPT-2's tied embedding and head sit on two ranks
    (1e-6); MONAI's UNet, two tensors crossing the cut, bitwise. Compiled (``--compile`` on traced
    stages: each block a graph module of ATen calls, compiled in place), the same."""
    pytest.importorskip("transformers")
    pytest.importorskip("monai")
    gpt2, unet = build("gpt2")[1], build("monai-unet")[1]
    jobs = [dict(name="gpt2-bf16", kind="gpt2", cuts=[0, gpt2.index("transformer_h_1"), len(gpt2.blocks)],
                 microbatches=1, schedule="gpipe", precision="bf16", exact=False),
            dict(name="monai-bf16", kind="monai-unet", cuts=[0, unet.index("model_1_submodule_1"), len(unet.blocks)],
                 microbatches=1, schedule="gpipe", precision="bf16", exact=True)]
    jobs += [dict(job, name=f"{job['name']}-compiled", compile=COMPILE) for job in jobs]
    _check(run_pipeline_jobs(2, jobs, tmp_path), jobs)


def test_what_crosses_a_cut_keeps_its_autocast_dtype():
    """The shapes `PipelineStage` is built with (its receive buffers) are the dtypes a stage really
    produces under autocast: a U-Net's skips (BatchNorm and ReLU after a convolution) cross in bf16,
    the max-pooled tensor in fp32 (CPU autocast runs max-pool in fp32), the last stage's output is
    fp32 for the loss; and fp32 declares fp32 everywhere."""
    model = build("unet")[0]
    sequence = unet_sequence(model)
    cuts = [0, sequence.index("bottleneck"), len(sequence.blocks)]
    volume = torch.randn(2, 1, 8, 8, 8)
    shapes = stage_shapes(sequence, cuts, (volume,), torch.bfloat16)
    (first_in, first_out), (second_in, second_out) = shapes
    assert sequence.crossing(cuts[1]) == ("skip0", "x", "skip1")
    assert [tensor.dtype for tensor in first_out] == [torch.bfloat16, torch.float32, torch.bfloat16]
    assert [tensor.dtype for tensor in second_in] == [tensor.dtype for tensor in first_out]
    assert [tensor.dtype for tensor in second_out] == [torch.float32]
    # What the stage computes for real, under autocast (its BatchNorm statistics put back after).
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        produced = sequence.stage(cuts[0], cuts[1])(volume)
    model.load_state_dict(state)
    assert [tensor.dtype for tensor in produced] == [tensor.dtype for tensor in first_out]
    assert [tuple(tensor.shape) for tensor in produced] == [tuple(tensor.shape) for tensor in first_out]
    # A stage's plan is profiled on what it receives: the same dtypes (`stage_fit`).
    pipeline = SimpleNamespace(sequence=sequence, cuts=cuts, example=(volume,), stage_indices=[0, 1],
                               device=torch.device("cpu"), autocast_dtype=torch.bfloat16)
    received = _stage_inputs(pipeline)[1]
    assert [tensor.dtype for tensor in received] == [tensor.dtype for tensor in second_in]
    assert all(torch.equal(before, after) for before, after in zip(state.values(), model.state_dict().values()))
    fp32 = stage_shapes(sequence, cuts, (volume,))
    assert {tensor.dtype for stage in fp32 for side in stage for tensor in side} == {torch.float32}


def test_fp16_pipelines_need_the_models_loss_scaler():
    """The scaler is the whole model's (`apply_precision`): it unscales every parameter's gradient and
    skips overflowed steps; a pipeline with none of its own would scale and never unscale."""
    sequence = unet_sequence(build("unet")[0])
    with pytest.raises(InputError, match=r"needs the model's loss scaler: apply_precision\(model, 'fp16'"):
        PipelineParallel(sequence, [0, 4, 8], None, 1, example=(torch.randn(1, 1, 8, 8, 8),), precision="fp16")
    with pytest.raises(InputError, match="precision must be one of fp32, bf16, fp16"):
        PipelineParallel(sequence, [0, 4, 8], None, 1, example=(torch.randn(1, 1, 8, 8, 8),), precision="fp8")


def _train_one_process(tmp_path, name: str, **overrides) -> dict:
    """`oomless train` in this process (one thread, as the workers), its ``--save``d weights."""
    from oomless.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(tiny_config(save=tmp_path / f"{name}.safetensors", **overrides))
    finally:
        torch.set_num_threads(threads)
    return {"weights": load_file(str(tmp_path / f"{name}.safetensors")), "result": result}


def _assert_bitwise(first: dict, second: dict, label) -> None:
    assert first.keys() == second.keys()
    unequal = [name for name in first if not torch.equal(first[name], second[name])]
    assert not unequal, (label, unequal[:3], _max_difference(first, second))


LOOP = dict(steps=6, global_batch=4)
PIPELINE = dict(mode="pipeline", stages=2, microbatches=1)
# Memory per rank for the runs with per-stage plans: room for every stage whatever its profile reads.
# These stages keep every block at 4 MiB already, but 4 ranks on 2 shared cores read a stage's floor
# at 1-7 MiB in processes that trained before, 17 MiB in fresh ones (kernel caches counted as held):
# at 4 MiB a replica was refused in about 1 run of 6.
STAGE_MEMORY = "64MiB"
# Where the first fp16 steps overflow (the U-Net's scaled gradients pass 65504): steps 0 and 1 are
# skipped, the scale halves twice, and the run trains from 2**17 on. Carrying the scale through a
# checkpoint or a layout switch then shows: a scale started afresh would skip twice more.
OVERFLOWING_SCALE = 2.0**19


def test_the_training_loop_pipelines_under_bf16_fp16_and_compile_as_one_process(tmp_path, monkeypatch):
    """``oomless train --parallel pipeline --precision bf16|fp16 [--memory] [--compile]`` with one
    micro-batch trains bitwise what one process trains at that precision; fp16's skipped steps and
    scale go through a checkpoint and a switch from dp."""
    fp16 = dict(precision="fp16", initial_loss_scale=OVERFLOWING_SCALE)
    run = tmp_path / "run"
    jobs = [
        ("bf16", dict(parallel=PIPELINE, precision="bf16", **LOOP)),
        ("bf16-planned", dict(parallel=PIPELINE, precision="bf16", memory=STAGE_MEMORY, **LOOP)),
        ("bf16-compiled", dict(parallel=PIPELINE, precision="bf16", compile=COMPILE, **LOOP)),
        ("bf16-compiled-planned", dict(parallel=PIPELINE, precision="bf16", compile=COMPILE, memory=STAGE_MEMORY,
                                       **LOOP)),
        ("fp16", dict(parallel=PIPELINE, **fp16, **LOOP)),
        ("fp16-first-half", dict(parallel=PIPELINE, checkpoint_dir=str(run), **fp16, steps=3, global_batch=4)),
        ("fp16-resumed", dict(parallel=PIPELINE, checkpoint_dir=str(run), resume=True, **fp16, **LOOP)),
        ("fp16-dp-to-pipeline", dict(parallel=dict(mode="dp", microbatches=1, switch=[(3, "pipeline:2")]), **fp16,
                                     **LOOP)),
    ]
    results = run_jobs(2, jobs, tmp_path)
    weights = {name: load_file(str(tmp_path / f"{name}.safetensors")) for name, _ in jobs}
    bf16 = _train_one_process(tmp_path, "one-bf16", precision="bf16", **LOOP)
    fp32 = _train_one_process(tmp_path, "one-fp32", **LOOP)
    monkeypatch.setattr(LossScaler.__init__, "__defaults__",        # what start_loss_scale_at does in the workers
                        (OVERFLOWING_SCALE, *LossScaler.__init__.__defaults__[1:]))
    one_fp16 = _train_one_process(tmp_path, "one-fp16", precision="fp16", **LOOP)
    for name in ("bf16", "bf16-planned", "bf16-compiled", "bf16-compiled-planned"):
        _assert_bitwise(weights[name], bf16["weights"], name)
    assert _max_difference(bf16["weights"], fp32["weights"]) > 1e-3, "bf16 trained other weights than fp32"
    assert one_fp16["result"].skipped_steps == 2, "steps 0 and 1 overflow at 2**19"
    for name in ("fp16", "fp16-resumed"):
        _assert_bitwise(weights[name], one_fp16["weights"], name)
        assert results[name]["skipped_steps"] == 2, name
    assert len(results["fp16-resumed"]["losses"]) == 3 and results["fp16-first-half"]["skipped_steps"] == 2
    # dp skipped steps 0 and 1; the pipeline went on from step 3 at the scale dp left (2**17), not 2**19.
    assert results["fp16-dp-to-pipeline"]["layouts"] == [[0, "dp"], [3, "pipeline with 2 stages (1f1b)"]]
    assert results["fp16-dp-to-pipeline"]["skipped_steps"] == 2


def test_the_training_loops_hybrid_runs_under_bf16_and_fp16(tmp_path):
    """``--parallel hybrid`` (2 x 2, BatchNorm over the replicas) under bf16 and fp16: the first loss
    equals one process's at that precision (see the module docstring for why not the weights), the
    stages' plans change nothing, and the run really trained at its precision."""
    hybrid = dict(mode="hybrid", stages=2, microbatches=1)
    jobs = [("bf16", dict(parallel=hybrid, precision="bf16", **LOOP)),
            ("bf16-planned", dict(parallel=hybrid, precision="bf16", memory=STAGE_MEMORY, **LOOP)),
            ("fp16", dict(parallel=hybrid, precision="fp16", **LOOP))]
    results = run_jobs(4, jobs, tmp_path)
    _assert_bitwise(load_file(str(tmp_path / "bf16.safetensors")),
                    load_file(str(tmp_path / "bf16-planned.safetensors")), "bf16-planned")
    first = {precision: _train_one_process(tmp_path, f"one-{precision}", precision=precision, **LOOP)["result"]
             .history[0]["loss"] for precision in ("fp32", "bf16", "fp16")}
    for precision in ("bf16", "fp16"):       # measured 7e-8 from their own; from fp32's 7e-4 (bf16), 1.2e-5 (fp16)
        assert results[precision]["losses"][0] == pytest.approx(first[precision], rel=1e-6), precision
        assert results[precision]["losses"][0] != pytest.approx(first["fp32"], rel=1e-6), precision
