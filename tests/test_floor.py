"""The floor guarantee (issue 15): wherever PyTorch's own checkpointing of every block trains, oomless
plans too, and its smallest budget is below what checkpointing needs.

For each model, in fresh processes (bench/floor_child.py: one step's peak resident memory above a
warm-up baseline, glibc told to return freed memory; the model, Adam's state and planning count):
``torch.utils.checkpoint`` on every block (U-Net stages, transformer layers) measures its peak C;
oomless is then asked for exactly C. It must accept it, its measured peak must stay within C, and
the smallest budget it names (PlanError's, with its margin, asked for in a fresh process as a user
does: the run the smallest-budget tests train at) must be below C. The measured figures print with -s.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20

MODELS = {
    "unet3d": {"model": "unet3d", "side": 48, "batch": 2},
    "transformer": {"model": "transformer", "batch": 8, "length": 128, "dim": 256, "depth": 4},
    # The configuration: 6 layers, 256 dims, batch 8 x 256 tokens, vocabulary 2000.
    "gpt2": {"model": "gpt2", "batch": 8, "length": 256, "dim": 256, "layers": 6, "heads": 4, "vocab": 2000},
}


# Steps trained at the floor: three for the fresh-process test of the U-Net and the transformer; GPT-2's
# prediction test measures floor_child's default two.
STEPS_AT_FLOOR = {"unet3d": 3, "transformer": 3, "gpt2": 2}


def _child(config: dict) -> dict:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    completed = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "floor_child.py"), json.dumps(config)],
                               capture_output=True, text=True, env=environment, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


_at_floor: dict[str, dict] = {}


def _planned_at_its_floor(name: str) -> dict:
    """A fresh process that asks oomless for the smallest budget of ``MODELS[name]`` (PlanError's, with
    its margin, as a user reads it), plans at it and trains `STEPS_AT_FLOOR` steps there. Run once per
    model in this module: each test that reads that floor or that run reads the same one."""
    if name not in _at_floor:
        _at_floor[name] = _child({**MODELS[name], "mode": "oomless", "memory": "floor", "steps": STEPS_AT_FLOOR[name]})
    return _at_floor[name]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_oomless_plans_wherever_checkpointing_every_block_trains(name):
    if name == "gpt2":
        pytest.importorskip("transformers")
    config = MODELS[name]
    checkpointed = _child({**config, "mode": "checkpoint"})
    memory = checkpointed["peak_bytes"]
    planned = _child({**config, "mode": "oomless", "memory": memory})
    # The smallest budget as a user asks for it, in a fresh process (the next tests train there).
    floor = _planned_at_its_floor(name)["floor_bytes"]
    print(f"{name}: checkpoint every block {memory / MiB:.0f} MiB; oomless at that memory measured "
          f"{planned.get('peak_bytes', 0) / MiB:.0f} MiB (predicted {planned.get('predicted_peak_bytes', 0) / MiB:.0f}), "
          f"decisions {planned.get('decisions')}; smallest budget oomless plans for {floor / MiB:.0f} MiB")
    assert "refused" not in planned, planned.get("refused")
    assert planned["peak_bytes"] <= memory
    assert floor < memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
@pytest.mark.parametrize("name", ["transformer", "unet3d"])
def test_the_smallest_budget_oomless_names_trains_within_it_in_a_fresh_process(name):
    """Issue 15 item 4, as a user meets it: the budget PlanError names in one process, written into
    the script and run again (a fresh process, which profiles the step again), is accepted, and the
    step (planning included, three steps) stays within it in resident memory; in the process that
    named it too. Before swapped storages stayed on the ledger while the forward held them, the
    U-Net's step went 2-3 MB over whenever copies ran faster than in the profiling step. Planned
    from the profile that named it with the whole budget (the named margin used up by a faster
    plan) it went 0.4 MiB over in CI (named 74.0, predicted 73.9, measured 74.4); the margin is kept
    back now (`api._plan_given_back`): predicted 71.5-73.5, measured 68.0-73.1. Fresh processes
    named floors a few MiB apart while the profiler read its baseline with the garbage of what ran
    before it (`profiler.held_now`), and one's floor was refused by the next; measured since
    (2026-11-29, Xeon, quiet): the transformer named 35 MiB in 4 processes of 4 and measured
    32.1-32.3 there, the U-Net 73 MiB and 70.1."""
    named = _planned_at_its_floor(name)
    assert "refused" not in named, named.get("refused")
    assert named["peak_bytes"] <= named["memory_bytes"]
    given_back = _child({**MODELS[name], "mode": "oomless", "memory": named["memory_bytes"], "steps": 3})
    print(f"{name}: named {named['memory_bytes'] / MiB:.1f} MiB and measured {named['peak_bytes'] / MiB:.1f} "
          f"there; given back in a fresh process, measured {given_back.get('peak_bytes', 0) / MiB:.1f} MiB "
          f"(predicted {given_back.get('predicted_peak_bytes', 0) / MiB:.1f}), decisions {given_back.get('decisions')}")
    assert "refused" not in given_back, given_back.get("refused")
    assert given_back["peak_bytes"] <= named["memory_bytes"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_the_smallest_budget_predicts_the_gpt2_step_it_measures():
    """Issue 15's target on its GPT-2: at the smallest budget oomless names (the update in backward,
    the optimizer state and the layers' parameters off the device), the predicted peak is within 10 %
    of the step's measured peak, and the step stays within the budget. Before each phase was counted
    with the static bytes those placements really hold in it (`plan.static_phases`), every phase was
    counted with the most of each at once (a few modules' state, three layers' parameters): 98 MiB
    named and predicted for a step measuring 78 MiB."""
    pytest.importorskip("transformers")
    planned = _planned_at_its_floor("gpt2")
    print(f"gpt2: named {planned['memory_bytes'] / MiB:.1f} MiB, predicted {planned.get('predicted_peak_bytes', 0) / MiB:.1f}, "
          f"measured {planned.get('peak_bytes', 0) / MiB:.1f} MiB, decisions {planned.get('decisions')}")
    assert "refused" not in planned, planned.get("refused")
    assert planned["peak_bytes"] <= planned["memory_bytes"]
    assert planned["predicted_peak_bytes"] <= 1.1 * planned["peak_bytes"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_a_bf16_step_with_every_chain_in_slabs_trains_within_its_plan():
    """``precision="bf16", split=True`` (the outer level streamed, the chains below it split, each op in
    the dtype autocast gives it): the smallest budget it names for the 3D U-Net, given back, is
    accepted, and three steps (planning included) stay within it in resident memory. Measured
    (2026-11-26, 2-core Xeon): named 64-65 MiB (fp32 with split=True: 87.0), predicted 62.6-63.3,
    measured 59.9-61.0.
    Before that day it held only at 1.15x the named budget, for two reasons. The profiler took a first
    step that kept more than a quarter of its rise for a fresh process's start-up and left it out: this
    step's first profiling step keeps 11-13 MiB of kernel caches for the slabs' shapes, near that line,
    and in some runs it named 54 MiB for a step measuring 74.5 (CI, 2026-11-26). What a first step
    keeps is counted now, whatever its size. And bench/floor_child.py's warm-up ran a plain
    step only: the ~7 MiB of oomless's own start-up (its modules imported on first use, libtorch's code
    for autocast in slabs) counted as this step's, where plain PyTorch's start-up did not count as
    plain's; its warm-up now plans and trains the small model with oomless as the run does."""
    config = {**MODELS["unet3d"], "mode": "oomless", "memory": "floor", "precision": "bf16", "split": True,
              "steps": 3}
    planned = _child(config)
    print(f"unet3d bf16 split=True: named {planned['floor_bytes'] / MiB:.1f} MiB, "
          f"measured {planned.get('peak_bytes', 0) / MiB:.1f} MiB "
          f"(predicted {planned.get('predicted_peak_bytes', 0) / MiB:.1f}), split {planned.get('split')}")
    assert "refused" not in planned, planned.get("refused")
    assert "" in planned["split"]
    assert planned["peak_bytes"] <= planned["memory_bytes"]
