"""The schedule arithmetic (`oomless.plan.schedules`) against torch's own schedules: its action orders
equal torch's, and its predicted step equals bench/bench_pipeline.py's simulation of torch's order
(the simulation that the benchmark's measured steps agree with). Torch's private order builders are
used here only, never by the library."""

import importlib.util
from pathlib import Path

import pytest

from oomless.plan.schedules import (SCHEDULES, microbatch_problem, predicted_step_seconds, rank_actions,
                                    simulated_step_seconds)

MULTI_STAGE = (("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zero-bubble", 2), ("zero-bubble", 3), ("zbv", 2))
FORWARD_FRACTIONS = (1 / 3, 0.2, 0.25, 0.4, 0.5)


@pytest.fixture(scope="module")
def bench():
    """bench/bench_pipeline.py as a module: its simulation and its reading of torch's orders."""
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_pipeline.py"
    spec = importlib.util.spec_from_file_location("bench_pipeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _per_rank(schedule: str) -> int:
    return 1 if schedule in ("gpipe", "1f1b") else 2


@pytest.mark.parametrize("schedule,per_rank", MULTI_STAGE)
def test_rank_actions_match_torch_schedule_order(schedule, per_rank):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from oomless.parallel.pipeline import SCHEDULE_CLASSES

    for ranks in (1, 2, 3, 4):
        for microbatches in range(1, 13):
            if microbatch_problem(schedule, ranks, microbatches):
                continue
            torch_order = get_schedule_ops(SCHEDULE_CLASSES[schedule], ranks, microbatches, per_rank)
            for rank, actions in enumerate(torch_order):
                expected = [(action.stage_index, action.computation_type.value, action.microbatch_index)
                            for action in actions if action is not None]
                assert rank_actions(schedule, rank, ranks, per_rank, microbatches) == expected, (ranks, microbatches)


def test_single_stage_orders_match_the_bench(bench):
    for schedule in ("gpipe", "1f1b"):
        for ranks in (1, 2, 4):
            for microbatches in range(ranks if schedule == "1f1b" else 1, 9):
                assert ([rank_actions(schedule, rank, ranks, 1, microbatches) for rank in range(ranks)]
                        == bench.rank_actions(schedule, ranks, microbatches))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_predicted_bubble_equals_simulated_torch_schedule_order(bench, schedule):
    """The bench's grid (P in 2, 4; M in 1, 2, 4, 8 where torch accepts M): the predicted bubble is the
    bench's simulated one, with its F = I = W sleep blocks and, to cover T_F != T_B, other forward
    shares (stage 0's input-gradient pass empty and its weight pass the whole backward, as torch runs it)."""
    per_rank = _per_rank(schedule)
    for ranks in (2, 4):
        for microbatches in (1, 2, 4, 8):
            if microbatch_problem(schedule, ranks, microbatches):
                continue
            orders = bench.rank_actions(schedule, ranks, microbatches)
            stages = ranks * per_rank
            # The bench's synthetic rows: 2 blocks per rank, 1 unit per forward, input- and weight-gradient part.
            seconds_of = bench.synthetic_seconds_of(1.0, bench.BLOCKS_PER_RANK // per_rank)
            ideal = microbatches * bench.BLOCKS_PER_RANK * 3
            simulated = 1 - ideal / bench.simulate_step_seconds(orders, seconds_of, stages)
            predicted = bench.partition_predicted_bubble(schedule, ranks, microbatches, ideal / microbatches, 1 / 3)
            assert predicted == pytest.approx(simulated, abs=1e-12), (ranks, microbatches)
            for forward_fraction in FORWARD_FRACTIONS:
                forward, backward = forward_fraction / per_rank, (1 - forward_fraction) / per_rank

                def seconds_of(stage, kind):
                    if kind in "FB":
                        return forward if kind == "F" else backward
                    return (0.0 if kind == "I" else backward) if stage == 0 else backward / 2

                simulated = bench.simulate_step_seconds(orders, seconds_of, stages)
                assert predicted_step_seconds(schedule, ranks, per_rank, microbatches, 1.0, forward_fraction) == (
                    pytest.approx(simulated, rel=1e-12)), (ranks, microbatches, forward_fraction)


def test_zero_bubble_steady_state_and_closed_forms():
    """Past torch's warm-up (zero-bubble M >= P, zbv M >= 2P - 1) each micro-batch adds exactly T, which
    `predicted_step_seconds` relies on to simulate up to that M only; and the closed forms the module
    docstring gives hold."""
    for schedule, per_rank in (("zero-bubble", 2), ("zero-bubble", 3), ("zero-bubble", 4), ("zbv", 2)):
        for ranks in range(1, 7):
            threshold = ranks if schedule == "zero-bubble" else 2 * ranks - 1
            for microbatches in range(1, 4 * ranks + 1):
                if microbatch_problem(schedule, ranks, microbatches):
                    continue
                for forward_fraction in FORWARD_FRACTIONS:
                    step = simulated_step_seconds(schedule, ranks, per_rank, microbatches, 1.0, forward_fraction)
                    key = (ranks, per_rank, microbatches, forward_fraction)
                    assert predicted_step_seconds(schedule, ranks, per_rank, microbatches, 1.0, forward_fraction) == (
                        pytest.approx(step, rel=1e-12)), key
                    forward, input_gradient = forward_fraction, (1 - forward_fraction) / 2
                    if microbatches < threshold:
                        continue
                    if schedule == "zero-bubble":
                        assert step == pytest.approx(
                            microbatches + (ranks - 1) * max(forward, input_gradient) / per_rank, rel=1e-12), key
                    elif forward <= input_gradient:
                        assert step == pytest.approx(microbatches + (ranks - 1) * input_gradient / 2, rel=1e-12), key


def test_closed_forms_of_the_other_schedules_equal_their_simulation():
    """gpipe, 1f1b and interleaved-1f1b are predicted by formula: it equals the simulation of their order."""
    for schedule, per_rank_counts in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved-1f1b", (2, 3, 4))):
        for ranks in range(1, 7):
            for per_rank in per_rank_counts:
                for microbatches in range(1, 17):
                    if microbatch_problem(schedule, ranks, microbatches):
                        continue
                    for forward_fraction in FORWARD_FRACTIONS:
                        assert predicted_step_seconds(schedule, ranks, per_rank, microbatches, 1.0, forward_fraction) == (
                            pytest.approx(simulated_step_seconds(schedule, ranks, per_rank, microbatches, 1.0,
                                                                 forward_fraction), rel=1e-12))


def test_a_split_backward_that_costs_more_lengthens_only_the_zero_bubble_schedules():
    """With the backward split into input- and weight-gradient passes costing r times the backward in
    one pass (measured by `oomless.profile.split_backward`), a zero-bubble rank's micro-batch takes
    T (f + r (1 - f)): past the warm-up each further micro-batch adds exactly that, and at r = 1 the
    prediction is unchanged; the schedules that do not split the backward ignore r."""
    for schedule in SCHEDULES:
        per_rank = 2 if schedule in ("interleaved-1f1b", "zero-bubble", "zbv") else 1
        for ranks in (2, 3, 4):
            microbatches = 4 * ranks
            if microbatch_problem(schedule, ranks, microbatches):
                continue
            for forward_fraction in FORWARD_FRACTIONS:
                plain = predicted_step_seconds(schedule, ranks, per_rank, microbatches, 1.0, forward_fraction)
                assert predicted_step_seconds(schedule, ranks, per_rank, microbatches, 1.0, forward_fraction,
                                              1.0) == plain
                split = [predicted_step_seconds(schedule, ranks, per_rank, m, 1.0, forward_fraction, 1.3)
                         for m in (microbatches, microbatches + 1)]
                if schedule in ("zero-bubble", "zbv"):
                    assert split[0] > plain
                    assert split[1] - split[0] == pytest.approx(forward_fraction + 1.3 * (1 - forward_fraction),
                                                                rel=1e-9)
                else:
                    assert split[0] == plain
