"""The pipeline partitioner against brute force over every contiguous cut, on generated profiles and
on real small models' profiles, for one and several stages per rank; its memory arithmetic by hand;
its in-flight counts against torch's own schedule orders; the schedules' constraints; the choice of
the number of micro-batches; a clear error when nothing fits."""

import dataclasses
import importlib
import itertools
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

import oomless
from oomless.models import TinyTransformer, UNet3D
from oomless.plan.microbatches import choose_microbatches, scale_profile
from oomless.plan.partition import (SCHEDULES, Partition, StageCosts, in_flight_microbatches, microbatch_problem,
                                    partition_stages, predicted_step_seconds, rank_in_flight, stage_ranks)
from oomless.profile.profile import BlockProfile, LinkProfile, Profile

MiB = 2**20
partition_module = importlib.import_module("oomless.plan.partition")   # `oomless.plan` is also a function


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
    # Stage 0: params 4, grads 4, Adam 8, buffers 1, torch's receive buffers for all 4 micro-batches
    # (the input 5 in, b's crossing 3 back as gradients), 2 x saved 10, working 2 MiB.
    assert partition.stage_bytes[0] == (4 + 4 + 8 + 1 + 4 * (5 + 3) + 2 * 10 + 2) * MiB
    # Stage 1: params 8, grads 8, Adam 16, buffers 1, 4 x crossing 3 received, 1 x (saved 20 + loss 7), working 2 MiB.
    assert partition.stage_bytes[1] == (8 + 8 + 16 + 1 + 4 * 3 + 27 + 2) * MiB
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


# --- several stages per rank (interleaved-1f1b, zero-bubble, zbv) and the micro-batch count -----------

MULTI_STAGE = (("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zero-bubble", 2), ("zero-bubble", 3), ("zbv", 2))


def _brute_force_ranks(profile: Profile, ranks: int, per_rank: int, limits: list[int], microbatches: int,
                       schedule: str, link_bytes_per_second=None) -> float | None:
    """The least slowest-rank seconds over every contiguous cut whose ranks all fit, the seconds
    summed directly from the blocks (a rank's bytes from StageCosts.rank_bytes, checked by hand below)."""
    costs = StageCosts(profile, ranks, microbatches, schedule, link_bytes_per_second, per_rank)
    placement = stage_ranks(schedule, ranks, per_rank)
    n, best = len(profile.blocks), None
    for inner in itertools.combinations(range(1, n), ranks * per_rank - 1):
        cuts = [0, *inner, n]
        if any(used > limit for used, limit in zip(costs.rank_bytes(cuts), limits)):
            continue
        seconds = [0.0] * ranks
        for stage, (start, stop) in enumerate(zip(cuts, cuts[1:])):
            time = sum(block.forward_seconds + block.backward_seconds for block in profile.blocks[start:stop])
            time += profile.loss_seconds if stop == n else 0.0
            if link_bytes_per_second and start > 0 and placement[stage - 1] != placement[stage]:
                time += 2 * costs.crossing[start] / link_bytes_per_second
            seconds[placement[stage]] += time
        best = max(seconds) if best is None else min(best, max(seconds))
    return best


def _random_case(seed: int):
    rng = random.Random(2000 + seed)
    schedule, per_rank = rng.choice(MULTI_STAGE)
    ranks = rng.choice([1, 2, 3, 3])
    while True:
        microbatches = rng.choice([1, 2, 3, 4, 6, 8])
        if microbatch_problem(schedule, ranks, microbatches) is None:
            break
    stages = ranks * per_rank
    profile = _generated_profile(seed, blocks=rng.randint(stages, min(stages + 6, 13)))
    return profile, ranks, per_rank, microbatches, schedule, rng.choice([None, 1e9])


def _limits_from_roomy_to_none(profile, ranks, per_rank, microbatches, schedule, link=None) -> list[int]:
    """Per-rank limits: what the fastest cut needs (memory does not bind), halfway down to the least
    any cut needs (memory shapes the cut), that least (only the leanest cuts fit), one byte less."""
    costs = StageCosts(profile, ranks, microbatches, schedule, link, per_rank)
    n = len(profile.blocks)
    cuts = [[0, *inner, n] for inner in itertools.combinations(range(1, n), ranks * per_rank - 1)]
    fastest = min(cuts, key=lambda cut: max(costs.rank_seconds(cut)))
    least, fast = min(max(costs.rank_bytes(cut)) for cut in cuts), max(costs.rank_bytes(fastest))
    return [fast, (least + fast) // 2, least, least - 1]


@pytest.mark.parametrize("seed", range(24))
def test_several_stages_per_rank_match_brute_force(seed):
    profile, ranks, per_rank, microbatches, schedule, link = _random_case(seed)
    for limit in _limits_from_roomy_to_none(profile, ranks, per_rank, microbatches, schedule, link):
        limits = [limit] * ranks
        best = _brute_force_ranks(profile, ranks, per_rank, limits, microbatches, schedule, link)
        if best is None:
            with pytest.raises(oomless.PlanError) as refused:
                partition_stages(profile, ranks, limits, microbatches, schedule, link, per_rank)
            # What the error says fits does fit (not proven the least with several stages per rank).
            enough = refused.value.minimum_bytes
            fitted = partition_stages(profile, ranks, enough, microbatches, schedule, link, per_rank)
            assert max(fitted.rank_bytes) <= enough
            continue
        partition = partition_stages(profile, ranks, limits, microbatches, schedule, link, per_rank)
        # The branch and bound finished (no note says it stopped): exact, equal to brute force.
        assert not any("search stopped" in note for note in partition.notes)
        assert partition.bottleneck_seconds == pytest.approx(best, rel=1e-9)
        assert all(used <= limit for used, limit in zip(partition.rank_bytes, partition.memory_limits))
        assert len(partition.stage_blocks) == ranks * per_rank and all(partition.stage_blocks)
        assert [name for stage in partition.stage_blocks for name in stage] == [block.name for block in profile.blocks]


def test_a_stopped_search_says_so(monkeypatch):
    # With 100 steps the search stops on many of these cuts. What it then guarantees: a cut that
    # fits, no better than brute force (a sanity check of both), a note with its distance from the
    # lower bound; a refusal that says the search stopped. Exact results need it to finish (above).
    monkeypatch.setattr(partition_module, "SEARCH_STEPS", 100)
    stopped = 0
    for seed in range(24):
        profile, ranks, per_rank, microbatches, schedule, link = _random_case(seed)
        for limit in _limits_from_roomy_to_none(profile, ranks, per_rank, microbatches, schedule, link)[:3]:
            limits = [limit] * ranks
            best = _brute_force_ranks(profile, ranks, per_rank, limits, microbatches, schedule, link)
            try:
                partition = partition_stages(profile, ranks, limits, microbatches, schedule, link, per_rank)
            except oomless.PlanError as error:
                assert best is None or "the search stopped: one may exist" in str(error)
                continue
            assert best is not None and partition.bottleneck_seconds >= best * (1 - 1e-9)
            assert all(used <= limit for used, limit in zip(partition.rank_bytes, partition.memory_limits))
            notes = [note for note in partition.notes if "search stopped" in note]
            stopped += bool(notes)
            if notes:
                compute = sum(block.forward_seconds + block.backward_seconds for block in profile.blocks)
                lower = (compute + profile.loss_seconds) / ranks
                assert f"{partition.bottleneck_seconds / lower - 1:.1%} above the lower bound" in notes[0]
            else:
                assert partition.bottleneck_seconds == pytest.approx(best, rel=1e-9)
    assert stopped >= 5   # the budget did bind: this exercised the stopped path


@pytest.mark.parametrize("model", ["transformer", "unet"])
@pytest.mark.parametrize("schedule,per_rank", [("interleaved-1f1b", 2), ("zbv", 2)])
def test_real_profiles_several_stages_per_rank_match_brute_force(real_profiles, model, schedule, per_rank):
    profile = real_profiles[model]
    costs = StageCosts(profile, 2, 4, schedule, None, per_rank)
    roomy = max(costs.bytes(stage, 0, len(profile.blocks)) for stage in range(2 * per_rank))
    for share in (1.0, 0.5, 0.3):
        limits = [int(roomy * share)] * 2
        best = _brute_force_ranks(profile, 2, per_rank, limits, 4, schedule)
        if best is None:
            with pytest.raises(oomless.PlanError):
                partition_stages(profile, 2, limits, 4, schedule, stages_per_rank=per_rank)
            continue
        partition = partition_stages(profile, 2, limits, 4, schedule, stages_per_rank=per_rank)
        assert partition.bottleneck_seconds == pytest.approx(best, rel=1e-9)


def _four_block_profile() -> Profile:
    common = dict(largest_saved_bytes=MiB, output_bytes=MiB, calls=1, forward_transient_bytes=MiB)
    blocks = [BlockProfile("a", 1.0, 2.0, saved_bytes=10 * MiB, input_bytes=MiB, parameter_bytes=4 * MiB,
                           backward_transient_bytes=2 * MiB, **common),
              BlockProfile("b", 3.0, 1.0, saved_bytes=20 * MiB, input_bytes=MiB, parameter_bytes=8 * MiB,
                           held_forward_bytes=3 * MiB, backward_transient_bytes=2 * MiB, **common),
              BlockProfile("c", 2.0, 2.0, saved_bytes=6 * MiB, input_bytes=2 * MiB, parameter_bytes=2 * MiB,
                           backward_transient_bytes=5 * MiB, **common),
              BlockProfile("d", 1.0, 1.0, saved_bytes=4 * MiB, input_bytes=MiB, parameter_bytes=2 * MiB,
                           backward_transient_bytes=2 * MiB, **common)]
    return Profile(device="cpu", blocks=blocks, parameter_bytes=16 * MiB, gradient_bytes=16 * MiB, buffer_bytes=MiB,
                   optimizer_state_bytes=32 * MiB, input_bytes=5 * MiB, unassigned_saved_bytes=7 * MiB,
                   loss_seconds=0.5, link=LinkProfile("pcie", 1e9, 1e9))


def test_rank_memory_and_seconds_by_hand():
    # Four blocks, four stages: the cut is forced, what is checked is the arithmetic. Crossing into
    # a, b, c, d: the input 5, b's held 3, c's input 2, d's input 1 MiB. Working bytes: 2, except c's 5.
    profile = _four_block_profile()
    looped = partition_stages(profile, 2, "1GiB", microbatches=2, schedule="interleaved-1f1b",
                              link_bytes_per_second=MiB, stages_per_rank=2)
    assert looped.stage_ranks == [0, 1, 0, 1]
    # Rank 0 runs all 2 x 2 forwards before its first backward; rank 1's last stage frees each at once.
    assert looped.in_flight == [2, 2, 2, 1]
    # Receive buffers, M = 2 x (crossing in front + crossing behind): a 2 x (5 + 3), b 2 x (3 + 2),
    # c 2 x (2 + 1), d 2 x 1.
    # Rank 0 (a, c): params + grads + Adam 16 + 8, received 16 + 6, in flight 2 x 10 + 2 x 6, buffers 1
    # once, working max(2, 5).
    # Rank 1 (b, d): 32 + 8, received 10 + 2, 2 x 20 + 1 x (4 + loss 7), buffers 1, working 2.
    assert looped.rank_bytes == [(16 + 8 + 22 + 20 + 12 + 1 + 5) * MiB, (32 + 8 + 12 + 40 + 11 + 1 + 2) * MiB]
    assert looped.stage_bytes[0] == (16 + 16 + 20 + 1 + 2) * MiB   # stage a alone: its own buffers and working
    # Seconds at 1 MiB/s: a 3; b 4 + 2 x 3; c 4 + 2 x 2; d 2 + loss 0.5 + 2 x 1.
    assert looped.stage_seconds == pytest.approx([3.0, 10.0, 8.0, 4.5])
    assert looped.rank_seconds == pytest.approx([11.0, 14.5]) and looped.bottleneck_rank == 1
    # Narayanan et al.: M T + (P - 1) T / V; bubble (P - 1) / (V M + P - 1) = 1 / 5.
    assert looped.predicted_step_seconds == pytest.approx(2 * 14.5 + 14.5 / 2)
    assert looped.predicted_bubble_fraction == pytest.approx(1 / 5) == looped.bubble_fraction

    v_shape = partition_stages(profile, 2, "1GiB", microbatches=2, schedule="zbv",
                               link_bytes_per_second=MiB, stages_per_rank=2)
    assert v_shape.stage_ranks == [0, 1, 1, 0]
    assert v_shape.in_flight == [2, 2, 2, 1]   # min(2P - r, M), min(r + 1, M)
    # Rank 0 (a, d): 16 + 8, received 16 + 2, 2 x 10 + 1 x 11, buffers 1, working 2.
    # Rank 1 (b, c): 32 + 8, received 10 + 6, 2 x 20 + 2 x 6, 1, 5.
    assert v_shape.rank_bytes == [(24 + 18 + 20 + 11 + 1 + 2) * MiB, (40 + 16 + 40 + 12 + 1 + 5) * MiB]
    # b -> c stays on rank 1: no communication charged for c.
    assert v_shape.stage_seconds == pytest.approx([3.0, 10.0, 4.0, 4.5])
    assert v_shape.rank_seconds == pytest.approx([7.5, 14.0])

    # Zero bubble, 4 micro-batches: each stage peaks at 4 and 2, but not together. Both ranks hold
    # (first stage, second stage) = (2, 2), (3, 1) or (4, 0) at their busiest moments.
    zero_bubble = partition_stages(profile, 2, "1GiB", microbatches=4, schedule="zero-bubble", stages_per_rank=2)
    assert zero_bubble.in_flight == [4, 4, 2, 2]
    assert rank_in_flight("zero-bubble", 0, 2, 2, 4)[1] == [(2, 2), (3, 1), (4, 0)]
    # Rank 0: max(2 x 10 + 2 x 6, 3 x 10 + 6, 4 x 10) = 40, not 4 x 10 + 2 x 6 = 52; with 24 static,
    # received 4 x (5 + 3) + 4 x (2 + 1) = 44, 1, 5.
    # Rank 1: max(2 x 20 + 2 x 11, 3 x 20 + 11, 4 x 20) = 80, not 102; with 40 static, received
    # 4 x (3 + 2) + 4 x 1 = 24, 1, 2.
    assert zero_bubble.rank_bytes == [(24 + 44 + 40 + 1 + 5) * MiB, (40 + 24 + 80 + 1 + 2) * MiB]


def _torch_live_counts(schedule: str, ranks: int, per_rank: int, microbatches: int) -> list[set] | None:
    """Per rank, the in-flight counts of its stages (in stage order) right after each forward in
    torch's own order for ``schedule``: micro-batches forwarded and not yet freed by a full
    backward or a weight-gradient pass. None if torch refuses the schedule. Built from stand-in
    stages: torch computes every rank's order at construction, no process group needed."""
    from torch.distributed.pipelining import (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)
    from torch.distributed.pipelining.schedules import _ComputationType

    classes = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble,
               "zbv": ScheduleZBVZeroBubble}
    placement, count = stage_ranks(schedule, ranks, per_rank), ranks * per_rank
    stand_ins = [SimpleNamespace(group_size=ranks, group_rank=0, num_stages=count, stage_index=stage,
                                 is_first=stage == 0, is_last=stage == count - 1, submod=torch.nn.Linear(1, 1))
                 for stage in range(count) if placement[stage] == 0]
    try:
        order = classes[schedule](stand_ins, microbatches).pipeline_order
    except ValueError:
        return None
    frees = (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT)
    moments = []
    for rank in range(ranks):
        local = [stage for stage in range(count) if placement[stage] == rank]
        live, seen = dict.fromkeys(local, 0), set()
        for action in filter(None, order[rank]):
            if action.computation_type == _ComputationType.FORWARD:
                live[action.stage_index] += 1
                seen.add(tuple(live[stage] for stage in local))
            elif action.computation_type in frees:
                live[action.stage_index] -= 1
        moments.append(seen)
    return moments


@pytest.mark.parametrize("schedule,per_rank", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                               ("zero-bubble", 2), ("zero-bubble", 3), ("zbv", 2)])
def test_in_flight_counts_match_torch_schedule_order(schedule, per_rank):
    for ranks in (1, 2, 3, 4):
        for microbatches in range(1, 13):
            torch_moments = _torch_live_counts(schedule, ranks, per_rank, microbatches)
            # What torch refuses is what the partitioner refuses.
            assert (torch_moments is None) == (microbatch_problem(schedule, ranks, microbatches) is not None)
            if torch_moments is None:
                continue
            placement = stage_ranks(schedule, ranks, per_rank)
            for rank, seen in enumerate(torch_moments):
                peaks, moments = rank_in_flight(schedule, rank, ranks, per_rank, microbatches)
                local = [stage for stage in range(ranks * per_rank) if placement[stage] == rank]
                assert peaks == [max(moment[index] for moment in seen) for index in range(per_rank)]
                assert peaks == [in_flight_microbatches(schedule, stage, ranks, microbatches, per_rank)
                                 for stage in local]
                # The kept moments are torch's and cover every one of torch's: so for any bytes per
                # micro-batch of the rank's stages, the most held at once is the same.
                assert set(moments) <= seen
                assert all(any(all(map(int.__ge__, kept, other)) for kept in moments) for other in seen)


def test_stage_ranks_per_schedule():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert stage_ranks("gpipe", 3, 1) == stage_ranks("1f1b", 3, 1) == [0, 1, 2]
    assert stage_ranks("interleaved-1f1b", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert stage_ranks("zero-bubble", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert stage_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]
    # torch's own placement: "loop" for the interleaved schedules, "v" for ZB-V.
    for ranks in (1, 2, 4):
        loop = generate_stage_to_rank_mapping(ranks, 3 * ranks, style="loop")
        assert stage_ranks("interleaved-1f1b", ranks, 3) == [loop[stage] for stage in range(3 * ranks)]
        v_shape = generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v")
        assert stage_ranks("zbv", ranks, 2) == [v_shape[stage] for stage in range(2 * ranks)]
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"}


def test_schedule_constraints_are_input_errors():
    profile = _generated_profile(0, blocks=12)
    refused = [(dict(schedule="zbv", stages_per_rank=3), "exactly 2 stages per rank"),
               (dict(schedule="gpipe", stages_per_rank=2), "one stage per rank"),
               (dict(schedule="1f1b", stages_per_rank=2), "one stage per rank"),
               (dict(schedule="interleaved-1f1b", stages_per_rank=1), "at least 2 stages per rank"),
               (dict(schedule="zero-bubble", stages_per_rank=1), "at least 2 stages per rank"),
               (dict(schedule="zigzag", stages_per_rank=1), "schedule must be one of")]
    for arguments, message in refused:
        with pytest.raises(oomless.InputError, match=message):
            partition_stages(profile, 2, "10GiB", microbatches=4, **arguments)
        with pytest.raises(oomless.InputError, match=message):
            stage_ranks(arguments["schedule"], 2, arguments["stages_per_rank"])
    # torch's interleaved schedules: M a multiple of max(1, M // P): 9 on 4 ranks (2 rounds) is refused.
    with pytest.raises(oomless.InputError, match="multiple of max"):
        partition_stages(profile, 4, "10GiB", microbatches=9, schedule="interleaved-1f1b", stages_per_rank=2)
    with pytest.raises(oomless.InputError, match="multiple of max"):
        partition_stages(profile, 3, "10GiB", microbatches=7, schedule="zero-bubble", stages_per_rank=2)
    with pytest.raises(oomless.InputError, match="cannot cut 12 blocks into 16 stages"):
        partition_stages(profile, 4, "10GiB", microbatches=4, schedule="interleaved-1f1b", stages_per_rank=4)
    with pytest.raises(oomless.InputError, match="3 limits for 2 ranks"):
        partition_stages(profile, 2, ["10GiB"] * 3, microbatches=4, schedule="zbv", stages_per_rank=2)
    # 1f1b with fewer micro-batches than stages is still planned (earlier callers did), with a note.
    planned = partition_stages(profile, 3, "10GiB", microbatches=2)
    assert any("Schedule1F1B needs at least as many micro-batches" in note for note in planned.notes)


def test_predicted_step_per_schedule():
    T = 1.0
    assert predicted_step_seconds("gpipe", 4, 1, 8, T) == pytest.approx(11.0)
    assert predicted_step_seconds("1f1b", 4, 1, 8, T) == pytest.approx(11.0)
    assert predicted_step_seconds("interleaved-1f1b", 4, 2, 8, T) == pytest.approx(8 + 3 / 2)
    # Fewer micro-batches than ranks: the loop of P V stages of T / V comes round first.
    assert predicted_step_seconds("interleaved-1f1b", 4, 2, 2, T) == pytest.approx((2 + 8 - 1) / 2)
    # The zero-bubble schedules follow torch's order (plan/schedules.py simulates it; tests/test_schedules.py
    # checks every case against torch's own order). These replace the earlier ZB-H1 / ZB-V formulas,
    # which bench_pipeline.py's simulation of torch's order showed wrong for zbv and below the warm-up.
    # Zero bubble, M >= P: (P - 1) max(T_F, T_B) / V: with T_F = 0.25 < T_B = 0.375 the input-gradient
    # passes set it, not ZB-H1's (P - 1) (T_F + T_B - T_W) / V = (P - 1) T_F / V.
    assert predicted_step_seconds("zero-bubble", 4, 2, 8, T, forward_fraction=0.25) == pytest.approx(8 + 3 * 0.375 / 2)
    assert predicted_step_seconds("zero-bubble", 4, 2, 8, T, forward_fraction=0.5) == pytest.approx(8 + 3 * 0.5 / 2)
    # One micro-batch crosses 8 stage forwards, 7 input-gradient passes and stage 0's whole backward
    # (2 passes), T / 6 each: 17 / 6 (the loop estimate said (1 + 8 - 1) / 2 = 4; simulated bubble 0.65).
    assert predicted_step_seconds("zero-bubble", 4, 2, 1, T) == pytest.approx(17 / 6)
    # ZB-V with T_F = T_B = T_W and M >= 2P - 1: (P - 1) stage forwards idle, not zero (rank P - 1
    # cannot start before micro-batch 0 has crossed P - 1 stages): 7 + 3 / 6.
    assert predicted_step_seconds("zbv", 4, 2, 7, T, forward_fraction=1 / 3) == pytest.approx(7.5)
    assert predicted_step_seconds("zbv", 4, 2, 8, T) == pytest.approx(8.5)
    # Below 2P - 1, as one micro-batch: 8 forwards, 7 input-gradient passes, stage 0's 2, and rank 3's
    # weight pass of stage 4, which torch's order runs before stage 3's input gradient: 18 / 6.
    assert predicted_step_seconds("zbv", 4, 2, 1, T) == pytest.approx(3.0)
    # A slow forward leaves ZB-V more than (P - 1) T_F / 2 (no closed form: the simulation's 1.0).
    assert predicted_step_seconds("zbv", 4, 2, 8, T, forward_fraction=0.5) == pytest.approx(8 + 1.0)


def test_old_partition_json_loads_and_new_round_trips():
    partition = partition_stages(_generated_profile(1, blocks=8), 2, "10GiB", microbatches=4,
                                 schedule="interleaved-1f1b", stages_per_rank=2)
    assert Partition.from_json(partition.to_json()) == partition
    assert "rank" in str(partition) and "bytes per rank" in str(partition)
    old = json.loads(partition_stages(_generated_profile(1, blocks=8), 2, "10GiB", microbatches=4).to_json())
    for added in ("stages_per_rank", "rank_bytes", "overhead_seconds", "forward_fraction"):
        del old[added]
    loaded = Partition.from_json(json.dumps(old))
    assert loaded.stages_per_rank == 1 and loaded.rank_bytes == loaded.stage_bytes and loaded.ranks == 2


def test_scale_profile_scales_what_a_batch_carries():
    profile = _generated_profile(5, blocks=4)
    # Each block's storages as a measured profile has them (the simulator reads those, not saved_bytes).
    split = lambda block: [block.saved_bytes - block.saved_bytes // 3, block.saved_bytes // 3]
    profile = dataclasses.replace(profile, blocks=[dataclasses.replace(block, saved_sizes=split(block))
                                                   for block in profile.blocks])
    quarter = scale_profile(profile, 0.25)
    for whole, part in zip(profile.blocks, quarter.blocks):
        assert part.forward_seconds == pytest.approx(whole.forward_seconds / 4)
        assert part.backward_seconds == pytest.approx(whole.backward_seconds / 4)
        assert (part.saved_bytes, part.input_bytes, part.held_forward_bytes) == (
            math.ceil(whole.saved_bytes / 4), math.ceil(whole.input_bytes / 4), math.ceil(whole.held_forward_bytes / 4))
        assert part.saved_sizes == [math.ceil(size / 4) for size in whole.saved_sizes]
        assert part.parameter_bytes == whole.parameter_bytes
    assert quarter.input_bytes == profile.input_bytes // 4
    assert quarter.loss_seconds == pytest.approx(profile.loss_seconds / 4)
    assert (quarter.parameter_bytes, quarter.optimizer_state_bytes, quarter.buffer_bytes) == (
        profile.parameter_bytes, profile.optimizer_state_bytes, profile.buffer_bytes)


def _uniform_profile(blocks: int = 8) -> Profile:
    """Equal blocks, forward a third of the compute (T_F = T_B = T_W), no loss time: cuts balance exactly."""
    made = [BlockProfile(name=f"b{i}", forward_seconds=0.01, backward_seconds=0.02, saved_bytes=64 * MiB,
                         largest_saved_bytes=MiB, input_bytes=4 * MiB, output_bytes=4 * MiB, parameter_bytes=4 * MiB,
                         calls=1, forward_transient_bytes=MiB, backward_transient_bytes=MiB) for i in range(blocks)]
    return Profile(device="cpu", blocks=made, parameter_bytes=4 * MiB * blocks, gradient_bytes=4 * MiB * blocks,
                   buffer_bytes=0, optimizer_state_bytes=0, input_bytes=4 * MiB, unassigned_saved_bytes=0,
                   loss_seconds=0.0, link=LinkProfile("pcie", 1e9, 1e9))


def test_choose_microbatches_takes_the_most_when_free_and_roomy():
    # ZB-V too: its bubble, (P - 1) stage forwards for M >= 2P - 1 in torch's order, shrinks with M (this
    # test once expected M = 4, the fewest of those the earlier formula predicted no bubble for).
    for schedule, per_rank in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2), ("zbv", 2)):
        chosen = choose_microbatches(_uniform_profile(), 2, 16, "100GiB", schedule, per_rank, overhead_seconds=0.0)
        assert chosen.microbatches == 16, schedule   # the bubble shrinks with M and nothing else costs
        assert all(f"M={m}:" in chosen.notes[-2] for m in (1, 2, 4, 8, 16) if schedule != "1f1b" or m >= 2)


def test_choose_microbatches_pays_the_overhead():
    # Per rank: 4 blocks of 30 ms for the whole batch; step(M) = (M + 1) (0.12 / M + o) under GPipe on 2
    # ranks, so o = 10 ms has its minimum at M = sqrt(0.12 / o) ~ 3.5: M = 4 of 1, 2, 4, 8, 16.
    chosen = choose_microbatches(_uniform_profile(), 2, 16, "100GiB", "gpipe", overhead_seconds=0.01)
    steps = {m: (m + 1) * (0.12 / m + 0.01) for m in (1, 2, 4, 8, 16)}
    assert chosen.microbatches == min(steps, key=steps.get) == 4
    assert chosen.predicted_step_seconds == pytest.approx(steps[4])
    assert "more micro-batches predict no faster step" in chosen.notes[-1] and "10 ms overhead" in chosen.notes[-1]
    assert choose_microbatches(_uniform_profile(), 2, 16, "100GiB", "gpipe", overhead_seconds=1.0).microbatches == 1


def test_choose_microbatches_when_memory_binds():
    profile = _uniform_profile()
    # GPipe holds all M micro-batches of 1 / M of the activations: the rank's bytes do not grow with M.
    gpipe = [partition_stages(scale_profile(profile, 1 / m), 2, "100GiB", m, "gpipe").rank_bytes[0] for m in (1, 4, 16)]
    assert gpipe[0] >= gpipe[1] >= gpipe[2] >= gpipe[0] - 4 * MiB   # only the working bytes shrink
    # 1F1B's stage 0 holds min(P, M) of them: more micro-batches, fewer bytes. With a 30 ms overhead
    # step(M) = (M + 1) (0.12 / M + 0.03) is least at M = 2; a limit only M >= 8 meets moves the choice there.
    free = choose_microbatches(profile, 2, 16, "100GiB", "1f1b", overhead_seconds=0.03)
    assert free.microbatches == 2
    needs = {m: partition_stages(scale_profile(profile, 1 / m), 2, "100GiB", m, "1f1b").rank_bytes[0]
             for m in (2, 4, 8)}
    assert needs[2] > needs[4] > needs[8]
    bound = choose_microbatches(profile, 2, 16, needs[8], "1f1b", overhead_seconds=0.03)
    assert bound.microbatches == 8 and max(bound.rank_bytes) <= needs[8]
    assert "M=4: does not fit" in bound.notes[-2] and "M=8 chosen" in bound.notes[-1]


def test_choose_microbatches_refuses_what_cannot_fit():
    profile = _uniform_profile()
    with pytest.raises(oomless.PlanError, match="no micro-batch count of the batch of 16 fits") as refused:
        choose_microbatches(profile, 2, 16, "10MiB", "1f1b")
    # The least of what each M would need (M = 1 is skipped: torch's 1F1B needs M >= 2 here); it fits.
    needs = []
    for m in (2, 4, 8, 16):
        with pytest.raises(oomless.PlanError) as alone:
            partition_stages(scale_profile(profile, 1 / m), 2, "10MiB", m, "1f1b")
        needs.append(alone.value.minimum_bytes)
    assert refused.value.minimum_bytes == min(needs)
    assert choose_microbatches(profile, 2, 16, refused.value.minimum_bytes, "1f1b").microbatches == 16
    with pytest.raises(oomless.InputError, match="must divide the batch of 16"):
        choose_microbatches(profile, 2, 16, "10GiB", candidates=[3])
    # 9 of 18 on 4 ranks is refused by torch's interleaved schedules: skipped with a note.
    chosen = choose_microbatches(_uniform_profile(16), 4, 18, "100GiB", "interleaved-1f1b", 2, candidates=[6, 9])
    assert chosen.microbatches == 6 and "M=9: skipped" in chosen.notes[-2]
