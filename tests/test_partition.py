"""The pipeline partitioner against brute force over every contiguous cut, on generated profiles and
on real small models' profiles; its memory arithmetic by hand; a clear error when nothing fits."""

import itertools
import random

import pytest
import torch

import oomless
from oomless.models import TinyTransformer, UNet3D
from oomless.plan.partition import Partition, StageCosts, in_flight_microbatches, partition_stages
from oomless.profile.profile import BlockProfile, LinkProfile, Profile

MiB = 2**20


def _generated_profile(seed: int, blocks: int) -> Profile:
    rng = random.Random(seed)
    made = [BlockProfile(name=f"b{i}", forward_seconds=rng.uniform(1e-3, 1e-2), backward_seconds=rng.uniform(1e-3, 2e-2),
                         saved_bytes=rng.randint(1, 64) * MiB, largest_saved_bytes=MiB,
                         input_bytes=rng.randint(1, 8) * MiB, output_bytes=rng.randint(1, 8) * MiB,
                         parameter_bytes=rng.randint(0, 32) * MiB, calls=1,
                         held_forward_bytes=rng.randint(0, 16) * MiB,
                         forward_transient_bytes=MiB, backward_transient_bytes=MiB)
            for i in range(blocks)]
    parameters = sum(block.parameter_bytes for block in made)
    return Profile(device="cpu", blocks=made, parameter_bytes=parameters, gradient_bytes=parameters, buffer_bytes=0,
                   optimizer_state_bytes=2 * parameters, input_bytes=4 * MiB, unassigned_saved_bytes=MiB,
                   loss_seconds=1e-3, link=LinkProfile("pcie", 1e9, 1e9))


def _brute_force(profile: Profile, stages: int, limits: list[int], microbatches: int, schedule: str,
                 link_bytes_per_second=None) -> float | None:
    """The least slowest-stage seconds over every contiguous cut that fits, computed directly."""
    costs = StageCosts(profile, stages, microbatches, schedule, link_bytes_per_second)
    n = len(profile.blocks)
    best = None
    for inner in itertools.combinations(range(1, n), stages - 1):
        cuts = (0, *inner, n)
        spans = list(zip(cuts, cuts[1:]))
        if any(costs.bytes(stage, start, stop) > limits[stage] for stage, (start, stop) in enumerate(spans)):
            continue
        slowest = 0.0
        for start, stop in spans:
            seconds = sum(block.forward_seconds + block.backward_seconds for block in profile.blocks[start:stop])
            seconds += profile.loss_seconds if stop == n else 0.0
            if link_bytes_per_second and start > 0:
                seconds += 2 * costs.crossing[start] / link_bytes_per_second
            slowest = max(slowest, seconds)
        best = slowest if best is None else min(best, slowest)
    return best


def _check_against_brute_force(profile, stages, limits, microbatches, schedule, link_bytes_per_second=None):
    best = _brute_force(profile, stages, limits, microbatches, schedule, link_bytes_per_second)
    if best is None:
        with pytest.raises(oomless.PlanError):
            partition_stages(profile, stages, limits, microbatches, schedule, link_bytes_per_second)
        return None
    partition = partition_stages(profile, stages, limits, microbatches, schedule, link_bytes_per_second)
    # Exact DP over the same cost model: equal to brute force up to float summation order.
    assert partition.bottleneck_seconds == pytest.approx(best, rel=1e-9)
    assert all(used <= limit for used, limit in zip(partition.stage_bytes, partition.memory_limits))
    names = [name for stage in partition.stage_blocks for name in stage]
    assert names == [block.name for block in profile.blocks] and all(partition.stage_blocks)
    return partition


@pytest.mark.parametrize("seed", range(12))
def test_generated_profiles_match_brute_force(seed):
    rng = random.Random(1000 + seed)
    profile = _generated_profile(seed, blocks=rng.randint(4, 10))
    stages = rng.randint(1, min(4, len(profile.blocks)))
    microbatches = rng.choice([1, 2, 4, 8])
    schedule = rng.choice(["gpipe", "1f1b"])
    link = rng.choice([None, 1e9])
    # Limits between "everything fits anywhere" and tight enough that memory shapes the cut.
    roomy = StageCosts(profile, stages, microbatches, schedule).bytes(0, 0, len(profile.blocks))
    for share in (1.0, 0.6, 0.45, 0.35):
        limits = [int(roomy * share * rng.uniform(0.8, 1.2)) for _ in range(stages)]
        _check_against_brute_force(profile, stages, limits, microbatches, schedule, link)


@pytest.fixture(scope="module")
def real_profiles():
    torch.manual_seed(0)
    transformer = TinyTransformer(depth=6, dim=32, heads=2)
    tokens = torch.randint(0, 256, (2, 16))
    unet = UNet3D(base_channels=2, depth=2)
    volume = torch.randn(1, 1, 16, 16, 16)
    return {
        "transformer": oomless.profile(transformer, tokens, loss_fn=oomless.sum_of_outputs,
                                       optimizer=torch.optim.Adam(transformer.parameters())),
        "unet": oomless.profile(unet, volume, loss_fn=oomless.sum_of_outputs,
                                optimizer=torch.optim.SGD(unet.parameters(), lr=0.1)),
    }


@pytest.mark.parametrize("model", ["transformer", "unet"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_real_profiles_match_brute_force(real_profiles, model, stages):
    profile = real_profiles[model]
    for schedule, microbatches in (("gpipe", 4), ("1f1b", 4)):
        roomy = StageCosts(profile, stages, microbatches, schedule).bytes(0, 0, len(profile.blocks))
        for share in (1.0, 0.7, 0.5):
            _check_against_brute_force(profile, stages, [int(roomy * share)] * stages, microbatches, schedule)


def test_unet_cut_carries_the_skips(real_profiles):
    # Cutting in front of the decoders, the encoder outputs still referenced cross with the input.
    profile = real_profiles["unet"]
    costs = StageCosts(profile, 2, 1, "1f1b")
    decoder = next(index for index, block in enumerate(profile.blocks) if block.name.startswith("decoders"))
    assert costs.crossing[decoder] > profile.blocks[decoder].input_bytes


def test_memory_arithmetic_by_hand():
    block = dict(largest_saved_bytes=MiB, calls=1, forward_transient_bytes=MiB, backward_transient_bytes=2 * MiB)
    blocks = [BlockProfile("a", 1.0, 2.0, saved_bytes=10 * MiB, input_bytes=MiB, output_bytes=MiB,
                           parameter_bytes=4 * MiB, **block),
              BlockProfile("b", 3.0, 1.0, saved_bytes=20 * MiB, input_bytes=MiB, output_bytes=MiB,
                           parameter_bytes=8 * MiB, held_forward_bytes=3 * MiB, **block)]
    profile = Profile(device="cpu", blocks=blocks, parameter_bytes=12 * MiB, gradient_bytes=12 * MiB, buffer_bytes=MiB,
                      optimizer_state_bytes=24 * MiB, input_bytes=5 * MiB, unassigned_saved_bytes=7 * MiB,
                      loss_seconds=0.5, link=LinkProfile("pcie", 1e9, 1e9))
    partition = partition_stages(profile, 2, "1GiB", microbatches=4, schedule="1f1b", link_bytes_per_second=MiB)
    assert partition.stage_blocks == [["a"], ["b"]]
    assert partition.in_flight == [2, 1]
    # Stage 0: params 4, grads 4, Adam 8, buffers 1, 2 x (saved 10 + input 5), working 2 MiB.
    assert partition.stage_bytes[0] == (4 + 4 + 8 + 1 + 2 * 15 + 2) * MiB
    # Stage 1: params 8, grads 8, Adam 16, buffers 1, 1 x (saved 20 + crossing 3 + loss 7), working 2 MiB.
    assert partition.stage_bytes[1] == (8 + 8 + 16 + 1 + 30 + 2) * MiB
    assert partition.stage_seconds == pytest.approx([3.0, 4.0 + 0.5 + 2 * 3.0])
    assert partition.bottleneck == 1
    assert partition.predicted_step_seconds == pytest.approx(5 * 10.5)
    assert partition.bubble_fraction == pytest.approx(1 / 5)
    assert [in_flight_microbatches("gpipe", stage, 2, 4) for stage in (0, 1)] == [4, 4]


def test_infeasible_memory_names_what_would_fit():
    profile = _generated_profile(3, blocks=6)
    with pytest.raises(oomless.PlanError) as refused:
        partition_stages(profile, 3, 10 * MiB, microbatches=2)
    error = refused.value
    assert "no cut into 3 stages fits" in str(error) and "per stage would fit" in str(error)
    assert error.limiting_block in {block.name for block in profile.blocks}
    # The reported minimum is exact: it fits, one byte less does not.
    fitted = partition_stages(profile, 3, error.minimum_bytes, microbatches=2)
    assert max(fitted.stage_bytes) <= error.minimum_bytes
    with pytest.raises(oomless.PlanError):
        partition_stages(profile, 3, error.minimum_bytes - 1, microbatches=2)


def test_bad_arguments_are_input_errors():
    profile = _generated_profile(0, blocks=3)
    with pytest.raises(oomless.InputError, match="cannot cut 3 blocks into 4 stages"):
        partition_stages(profile, 4, "1GiB")
    with pytest.raises(oomless.InputError, match="2 limits for 3 stages"):
        partition_stages(profile, 3, ["1GiB", "1GiB"])
    with pytest.raises(oomless.InputError, match="schedule"):
        partition_stages(profile, 2, "1GiB", schedule="zigzag")


def test_partition_prints_and_round_trips():
    profile = _generated_profile(1, blocks=8)
    partition = partition_stages(profile, 3, "10GiB", microbatches=4)
    assert Partition.from_json(partition.to_json()) == partition
    text = str(partition)
    assert "bottleneck: stage" in text and "b0" in text
    assert partition.stage_of()["b0"] == 0
