"""The floor guarantee (issue 15): wherever PyTorch's own checkpointing of every block trains, oomless
plans too, and its smallest budget is below what checkpointing needs.

For each model, in fresh processes (bench/floor_child.py: one step's peak resident memory above a
warm-up baseline, glibc told to return freed memory; the model, Adam's state and planning count):
``torch.utils.checkpoint`` on every block (U-Net stages, transformer layers) measures its peak C;
oomless is then asked for exactly C. It must accept it, its measured peak must stay within C, and
the smallest budget it names (PlanError's, with its margin) must be below C. The measured figures
print with -s.
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


def _child(config: dict) -> dict:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    completed = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "floor_child.py"), json.dumps(config)],
                               capture_output=True, text=True, env=environment, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_oomless_plans_wherever_checkpointing_every_block_trains(name):
    if name == "gpt2":
        pytest.importorskip("transformers")
    config = MODELS[name]
    checkpointed = _child({**config, "mode": "checkpoint"})
    memory = checkpointed["peak_bytes"]
    planned = _child({**config, "mode": "oomless", "memory": memory, "report_floor": True})
    print(f"{name}: checkpoint every block {memory / MiB:.0f} MiB; oomless at that memory measured "
          f"{planned.get('peak_bytes', 0) / MiB:.0f} MiB (predicted {planned.get('predicted_peak_bytes', 0) / MiB:.0f}), "
          f"decisions {planned.get('decisions')}; smallest budget oomless plans for "
          f"{planned.get('floor_bytes', 0) / MiB:.0f} MiB")
    assert "refused" not in planned, planned.get("refused")
    assert planned["peak_bytes"] <= memory
    assert planned["floor_bytes"] < memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_the_smallest_budget_oomless_names_trains_within_it():
    """Issue 15 item 4 on the 3D U-Net: the budget PlanError names, given back, is accepted, and the
    step (planning included, three steps) stays within it in resident memory. Before swapped storages
    stayed on the ledger while the forward held them, this step went 2-3 MB over whenever copies ran
    faster than in the profiling step. (The transformers are not here yet: a fresh process's profile
    sometimes measures a block's working memory 3-6 MiB higher, on main as well, so the budget named
    by one profile is refused by the next; see the closing note of issue 15.)"""
    name = "unet3d"
    planned = _child({**MODELS[name], "mode": "oomless", "memory": "floor", "steps": 3})
    print(f"{name}: named {planned['memory_bytes'] / MiB:.1f} MiB, measured {planned.get('peak_bytes', 0) / MiB:.1f} MiB "
          f"(predicted {planned.get('predicted_peak_bytes', 0) / MiB:.1f}), decisions {planned.get('decisions')}")
    assert "refused" not in planned, planned.get("refused")
    assert planned["peak_bytes"] <= planned["memory_bytes"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_the_smallest_budget_predicts_the_gpt2_step_it_measures():
    """Issue 15's target on its GPT-2: at the smallest budget oomless names (the update in backward,
    the optimizer state and the layers' parameters off the device), the predicted peak is within 10 %
    of the step's measured peak, and the step stays within the budget. Before each phase was counted
    with the static bytes those placements really hold in it (`plan.static_phases`), every phase was
    counted with the most of each at once (a few modules' state, three layers' parameters): 98 MiB
    named and predicted for a step measuring 78 MiB."""
    pytest.importorskip("transformers")
    planned = _child({**MODELS["gpt2"], "mode": "oomless", "memory": "floor"})
    print(f"gpt2: named {planned['memory_bytes'] / MiB:.1f} MiB, predicted {planned.get('predicted_peak_bytes', 0) / MiB:.1f}, "
          f"measured {planned.get('peak_bytes', 0) / MiB:.1f} MiB, decisions {planned.get('decisions')}")
    assert "refused" not in planned, planned.get("refused")
    assert planned["peak_bytes"] <= planned["memory_bytes"]
    assert planned["predicted_peak_bytes"] <= 1.1 * planned["peak_bytes"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_a_bf16_step_with_every_chain_in_slabs_trains_within_its_plan():
    """``precision="bf16", split=True`` (the outer level streamed, the chains below it split, each op in
    the dtype autocast gives it) planned for the 3D U-Net at 1.15x the smallest budget it names, then
    three steps (planning included) within that budget in resident memory. Measured: named 70.0 MiB
    (fp32 with split=True: 87.0); at 1.1x, planned for 77.0, predicted 73.3-73.8, peak 75.6-76.2 MiB
    (one run of five, beside other jobs, went over). The prediction is 2-3 MiB (3 %) under the
    measured peak, where fp32's is above it (fp32 at its own floor: predicted 86.5, measured 84.0 of
    87.0); at the named budget itself the bf16 step went 2.2 MiB over (72.2 of 70.0).
    Measured cause (peak RSS between marks at every block, slab graph and backward node, in training
    and in the profiling steps): the step's phases are profiled right (the peak is the decoder's
    backward in slabs, the profile's loss phase, within 1.5 MiB of training's; Adam's state and
    the absent gradients are static bytes); what no plan counts is 3.9 MiB the bf16 checks leave
    resident before the profile takes its baseline (check_precision's probe 1.1 MiB,
    check_slabs_run_in's 2.8; 3.1 MiB of them libtorch's code pages). The profile's baseline above
    static bytes is 4.1 MiB under bf16, 0.1 under fp32 (no probe). Running the slab probe only where
    a split step fails lowered the measured peak (named 72.0, predicted 71.2, measured 71.0), but the
    first profiling step then kept 13.7 MiB (10.5 anonymous, not freed heap, about 6 more than fp32's:
    kernels for the slabs' shapes; 3.2 code pages), at profile.profiler's COLD_START_SHARE line (a
    quarter of its 54.6 MiB rise): in 2 runs of 3 it was taken for a fresh process's start-up and
    left out (named 58.0, measured 70.4-70.7). With the probe the first step keeps 11-12.6 MiB, 1-2
    under that line: the bf16 floor stands on it too."""
    config = {**MODELS["unet3d"], "mode": "oomless", "memory": "floor", "over_floor": 1.15, "precision": "bf16",
              "split": True, "steps": 3}
    planned = _child(config)
    print(f"unet3d bf16 split=True: named {planned['floor_bytes'] / MiB:.1f} MiB, planned for "
          f"{planned['memory_bytes'] / MiB:.1f}, measured {planned.get('peak_bytes', 0) / MiB:.1f} MiB "
          f"(predicted {planned.get('predicted_peak_bytes', 0) / MiB:.1f}), split {planned.get('split')}")
    assert "refused" not in planned, planned.get("refused")
    assert "" in planned["split"]
    assert planned["peak_bytes"] <= planned["memory_bytes"]
