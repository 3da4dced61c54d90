"""`make demo` is a user's first run: planning its configuration in fresh processes gives one answer (issue
16). Three fresh processes each profile and plan the demo (3D U-Net 64^3, batch 2, 256 MiB): every one
accepts the budget within it, and every one names the same smallest budget (to within the noise of the
streamed step that sets it), with the demo's budget at least 1.3x above it (the stated headroom: the demo runs
nowhere near its floor; 1.67x on the machine of 2026-11-23, 1.33x on the Xeon of 2026-11-24, where the
same step's 3D convolutions take more working memory in backward: plain PyTorch measured 316 MiB there
against 283 MiB). Which equal-sized blocks are swapped may differ with measured times; the budget, the
floor and the outcome do not."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3
HEADROOM = 1.3
STREAMED_FLOOR_NOISE = 0.10     # what floors named in fresh processes may differ by, as a share
ENVIRONMENT = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}     # fresh processes of the source tree


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_the_demo_plans_the_same_in_fresh_processes():
    results = []
    for _ in range(RUNS):
        completed = subprocess.run([sys.executable, str(ROOT / "tests" / "demo_plan_child.py"), "256MiB"],
                                   capture_output=True, text=True, env=ENVIRONMENT, timeout=600)
        assert completed.returncode == 0, completed.stderr[-2000:]
        results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    budget = 256 * 2**20
    for result in results:
        assert result["accepted"], result.get("error")
        assert result["predicted_peak_bytes"] <= budget
        assert result["smallest_bytes"] * HEADROOM <= budget, result["smallest_bytes"]
    smallest = [result["smallest_bytes"] for result in results]
    # One answer, to within the noise of the step that sets it. While the floor was the unsplit
    # step's (190-193 MiB on every machine) it agreed within the 2 % margin the named floor carries
    # (planner.with_margin). Now a floor request streams the outer level in slabs, and the floor is
    # read from resident memory of that streamed step: its loss phase (`Profile.loss_peak_bytes`).
    # What the process holds then varies between fresh processes by a few MiB, the same amount in
    # every phase of the step: glibc's main heap (small objects and tensors under the 64 KiB mmap
    # threshold, `rss.return_freed_memory_to_the_system`) re-faults the pages `held_now` trimmed in
    # a different pattern each time. In 4 processes (AMD EPYC, quiet, 2026-11-29) its resident
    # pages at the loss phase were 118.4-129.1 MiB, file pages the same to 0.3 MiB, and what the
    # first streamed step kept, read after collecting and trimming, the same to 0.1 MiB. Not the
    # hash seed, the thread count, glibc's arenas or huge pages: with each fixed the spread stayed
    # 6-10 MiB. It is the process's, not the step's: three more streamed steps in one process read
    # their loss phase within 1.3 MiB of its first, so measuring the step again would not narrow it.
    # The floors named: 114, 121, 121 in CI (stop 50); 115-124 in 12 processes here. The bound is
    # 10 %, plus the whole MiB the floor is rounded up to; a plan that lost the streamed step
    # (196-198 MiB) or accepted in one process and refused in another fails it.
    least = min(smallest)
    assert max(smallest) - least <= STREAMED_FLOOR_NOISE * least + 2**20, smallest


TRAIN_CHILD = """
import json, sys
import oomless                      # first, as the `oomless` command imports it
from oomless.train import TrainConfig, train
result = train(TrainConfig(size=64, global_batch=2, memory="256MiB", steps=4, seed=0, progress=False, device="cpu"))
print(json.dumps({"peak_bytes": result.peak_memory_bytes, "predicted_bytes": oomless.installed_plan(result.model).predicted_peak_bytes}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_the_demo_trains_within_its_budget_in_fresh_processes():
    # Its peak counts from before the model is built (the trainer's MemoryProbe mark). Before the
    # memory rule held from that mark, what the model's construction and the first batch left in
    # glibc's heap came on top: 254-265 MiB for plans predicted at 255.7 (4 runs of 6 over), 263-266
    # MiB in this test. Quiet, it measures 252.6-254.8 MiB; with two busy threads beside it, one run
    # of two measured 257.4 MiB (its copies to disk slower than profiled): the bound is the budget and
    # the planner's 2 % margin (`planner.with_margin`), 2-5 MiB under the old code's runs.
    for _ in range(2):
        completed = subprocess.run([sys.executable, "-c", TRAIN_CHILD], capture_output=True, text=True,
                                   env=ENVIRONMENT, timeout=600, cwd=ROOT)
        assert completed.returncode == 0, completed.stderr[-2000:]
        result = json.loads(completed.stdout.strip().splitlines()[-1])
        assert result["predicted_bytes"] <= 256 * 2**20
        assert result["peak_bytes"] <= 256 * 2**20 * 1.02, result
