"""Pipeline parallel equals one process: gloo on CPU, 2 stages, 5 SGD-momentum steps (lr 0.1), same
global batch (why not Adam: see `make_optimizer` in tests/pipeline_workers.py).

Stated tolerance: 1e-6 absolute on every parameter (measured ~6e-8). The math is the same but not the float
summation order: gradients are sums of per-micro-batch gradients each divided by the number of
micro-batches (torch's schedule) rather than one mean over the global batch, and a tied weight's
gradient is the sum of its two stages' parts. The U-Net runs one micro-batch (BatchNorm statistics
over a micro-batch would differ from the global batch's by design), cut where two skips cross.
"""

import pytest
import torch

from oomless.errors import InputError
from oomless.models import TinyTransformer
from oomless.parallel.block_sequence import transformer_sequence, unet_sequence
from oomless.parallel.pipeline import cuts_from_stage_blocks
from tests.pipeline_workers import build, reference, run_pipeline_jobs

TOLERANCE = 1e-6


def _max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[name].double() - second[name].double()).abs().max().item() for name in first)


def test_two_stage_pipelines_equal_one_process(tmp_path):
    unet = unet_sequence(build("unet")[0])
    jobs = [
        dict(name="gpipe", kind="transformer", cuts=[0, 3, 6], microbatches=4, schedule="gpipe"),
        dict(name="1f1b", kind="transformer", cuts=[0, 2, 6], microbatches=4, schedule="1f1b"),
        dict(name="unet", kind="unet", cuts=[0, unet.index("bottleneck"), len(unet.blocks)], microbatches=1, schedule="gpipe"),
    ]
    results = run_pipeline_jobs(2, jobs, tmp_path)
    expected = {"transformer": reference("transformer"), "unet": reference("unet")}
    for job in jobs:
        difference = _max_difference(results[job["name"]], expected[job["kind"]])
        assert difference <= TOLERANCE, (job["name"], difference)
    # The reference moved: the comparison is not of untouched initial weights.
    initial = {name: parameter.detach() for name, parameter in build("transformer")[0].named_parameters()}
    assert _max_difference(initial, expected["transformer"]) > 1e-4


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
