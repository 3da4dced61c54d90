"""A refusal on one rank is every rank's: where one rank decides for all (the data-parallel plan, a
pipeline's cut, each stage's plan taken from its replica 0), its `PlanError` or `InputError` is raised
on every rank with the same message, rather than the others failing in their next collective with
"connection closed by peer" (or waiting there until the timeout); a refusal on a rank whose answer
is not taken (replica 1 of a stage) refuses nothing. gloo on CPU."""

import pytest
import torch

import oomless
from oomless.errors import InputError
from oomless.parallel.stage_fit import StageShare, _plan_stage, _profile_stage
from tests.parallel_workers import results_of_rank, run_jobs, run_outcomes
from tests.pipeline_workers import run_refusals

MIB = 2**20


def test_the_first_ranks_outcome_reaches_every_rank(tmp_path):
    first, second = run_outcomes(tmp_path)
    refused = {"error": "PlanError", "message": "no plan fits 1 byte", "minimum_bytes": 5 * MIB,
               "limiting_block": "layers.0", "floor_block": "layers.0"}
    assert first[0] == second[0] == refused                                   # rank 0 refused: both raise it
    assert first[1] == second[1] == {"value": "rank 0's plan"}                # rank 1 alone refused: rank 0's plan
    assert first[2] == second[2] == {"value": "rank 0 alone"}                 # only rank 0 computed


def test_a_stages_refusal_is_raised_on_every_rank_and_replica_zero_decides(tmp_path):
    # 2 stages x 2 replicas: ranks 0, 1 hold stage 0 (replicas 0, 1), ranks 2, 3 stage 1.
    by_rank = run_refusals(4, [[1], [2], [0, 2, 3]], tmp_path)
    replica_one, stage_one, both = zip(*by_rank)
    # Replica 1 of stage 0 refused alone: every rank runs replica 0's plan, nothing refused.
    assert all("error" not in outcome and outcome["installed"] == [True] for outcome in replica_one), replica_one
    # Replica 0 of stage 1 refused: every rank of both stages raises it, in per-rank terms, and no
    # stage keeps its plan.
    assert len({outcome["error"] for outcome in stage_one}) == 1, stage_one
    message, needed = stage_one[0]["error"], stage_one[0]["minimum_bytes"]
    assert message.startswith("stage 1: no plan fits its share of 64.00 MiB per rank (1 stage(s) on the rank, "
                              "1 micro-batch(es) in flight)") and "rank 2 refuses" in message, message
    # The stage's plan needed 3 MiB more than its budget; with one micro-batch in flight and one
    # stage a rank, that is 3 MiB more per rank (rounded up to a whole MiB).
    assert needed == 67 * MIB
    assert f"memory >= 67.00 MiB per rank ({needed} bytes) fits every stage at this cut" in message
    assert all(outcome["minimum_bytes"] == needed and outcome["installed"] == [False] for outcome in stage_one)
    # Both stages refused by their replica 0 (and stage 1 by its replica 1 too): one error naming each
    # stage once, the larger need. Stage 0
    # holds 2 micro-batches in flight under 1F1B, so 3 MiB more per micro-batch is 6 MiB more a rank.
    assert len({outcome["error"] for outcome in both}) == 1
    assert both[0]["error"].startswith("stage 0: ") and "; stage 1: " in both[0]["error"], both[0]["error"]
    assert both[0]["error"].count("stage 1: ") == 1 and both[0]["minimum_bytes"] == 70 * MIB


def test_the_training_loops_refusals_reach_every_rank(tmp_path):
    pipeline = dict(mode="pipeline", stages=2, microbatches=1)
    jobs = [("too-small", dict(parallel=pipeline, memory="1MiB", expect_refusal=True, steps=1, global_batch=4)),
            ("uneven", dict(parallel=dict(pipeline, microbatches=3), expect_refusal=True, steps=1, global_batch=4)),
            ("dp-too-small", dict(parallel=dict(mode="dp"), memory="1MiB", expect_refusal=True, steps=1,
                                  global_batch=4)),
            ("trains", dict(parallel=pipeline, steps=1, global_batch=4))]
    run_jobs(2, jobs, tmp_path)
    first, second = results_of_rank(0, tmp_path), results_of_rank(1, tmp_path)
    for name in ("too-small", "uneven", "dp-too-small"):
        assert first[name] == second[name], name
    assert first["too-small"]["error"] == "PlanError" and "stage 0: no plan fits its share of 1.00 MiB per rank" \
        in first["too-small"]["message"] and "; stage 1: " in first["too-small"]["message"]
    assert first["too-small"]["minimum_bytes"] > MIB
    assert first["uneven"] == {"error": "InputError", "minimum_bytes": None, "message": "4 volumes per replica do "
                               "not split into 3 equal micro-batches; choose a divisor"}
    assert first["dp-too-small"]["error"] == "PlanError"
    assert first["trains"]["steps_done"] == 1      # the group still works after the refusals


def profiled_and_planned(module, inputs, loss_fn, where: StageShare, in_flight: int, policy, optimizer_class,
                         min_swap_bytes: int, precision: str, compile):
    """A stage's plan as `fit_stages` makes it: profiled, then planned for its share."""
    profile = _profile_stage(module, inputs, loss_fn, optimizer_class, precision, compile)
    return _plan_stage(module, inputs, profile, where, in_flight, policy, min_swap_bytes, precision, compile)


def test_a_forced_policy_that_cannot_fit_its_stage_is_refused_in_memory_per_rank():
    """`fit_stages(..., policy=...)` forces one decision on every block; `oomless.plan` keeps given
    decisions whatever they need, so a share they cannot fit was planned and trained over it. Now it
    is refused before any step, naming the memory per rank that fits, and that memory given back plans."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()) for _ in range(4)))
    inputs = (torch.randn(512, 128),)

    def plan_for(per_rank):
        return profiled_and_planned(module, inputs, oomless.sum_of_outputs, StageShare(0, 2, per_rank), 2,
                                    "recompute", torch.optim.Adam, 0, "fp32", None)
    with pytest.raises(oomless.PlanError, match="every block recompute") as refused:
        plan_for(2**20)
    needed = refused.value.minimum_bytes
    assert needed is not None and needed > 2**20 and "per rank" in str(refused.value)
    plan = plan_for(needed)
    assert set(plan.decisions.values()) == {"recompute"}


def test_a_stage_without_parameters_plans_with_no_optimizer_state():
    """The partitioner may cut a U-Net's pooling alone onto a stage (a hybrid zero-bubble run of
    the 16^3 U-Net did: stage 1 = ``pool1``). Its plan counts no optimizer state; before, Adam
    refused the empty parameter list and two of four ranks died in planning."""
    stage = torch.nn.Sequential(torch.nn.MaxPool3d(2))
    inputs = (torch.randn(2, 8, 16, 16, 16, requires_grad=True),)
    plan = profiled_and_planned(stage, inputs, oomless.sum_of_outputs, StageShare(1, 2, 64 * 2**20), 4, None,
                                torch.optim.Adam, 64 * 1024, "fp32", None)
    assert plan.static_breakdown["optimizer state"] == 0 and plan.static_breakdown["parameters"] == 0
    assert list(plan.decisions) == ["0"]


def test_a_stage_plan_is_the_stages_own_for_its_share_and_says_why_it_updates_after_the_schedule():
    """A stage with 2 micro-batches in flight is planned for one within part of its share; the plan
    returned is the stage's: its budget the share (it printed the one micro-batch's, 33.47 MiB for
    64), its activation budget within what the share leaves beside the static bytes (the one
    micro-batch's times 2 printed 64.46 MiB for 64), its peak with both micro-batches' activations.
    The optimizer is passed to the planner (its step's temporaries counted), and the note says why
    the update is not in backward (it said "no optimizer was given" while counting its state). What
    the rank holds outside its stages' plans comes off the share and is in a refusal's budget."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()) for _ in range(4)))
    inputs = (torch.randn(256, 128),)
    share = 64 * MIB
    plan = profiled_and_planned(module, inputs, oomless.sum_of_outputs, StageShare(0, 1, share), 2, None,
                                torch.optim.Adam, 64 * 1024, "fp32", None)
    assert plan.memory_bytes == share
    assert plan.static_bytes + plan.activation_budget <= share
    assert plan.predicted_peak_bytes <= share
    notes = " ".join(plan.notes)
    assert "no optimizer was given" not in notes and "steps its optimizer after the schedule" in notes
    with pytest.raises(oomless.PlanError, match="held by the rank outside its stages' plans") as refused:
        profiled_and_planned(module, inputs, oomless.sum_of_outputs, StageShare(0, 1, 40 * MIB, 39 * MIB), 2,
                             None, torch.optim.Adam, 64 * 1024, "fp32", None)
    assert refused.value.minimum_bytes > 40 * MIB
