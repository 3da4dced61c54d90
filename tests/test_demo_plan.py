"""`make demo` is a user's first run: planning its configuration in fresh processes gives one answer
(issue 16). Three fresh processes each profile and plan the demo (3D U-Net 64^3, batch 2, 256 MiB):
every one accepts the budget within it, and every one names the same smallest budget, with the demo's
budget at least 1.3x above it (the stated headroom: the demo runs nowhere near its floor; 1.67x on the
machine of 2026-11-23, 1.33x on the Xeon of 2026-11-24, where the same step's 3D convolutions take
more working memory in backward: plain PyTorch measured 316 MiB there against 283 MiB). Which
equal-sized blocks are swapped may differ with measured times; the budget, the floor and the outcome do not."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3
HEADROOM = 1.3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_the_demo_plans_the_same_in_fresh_processes():
    environment = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    results = []
    for _ in range(RUNS):
        completed = subprocess.run([sys.executable, str(ROOT / "tests" / "demo_plan_child.py"), "256MiB"],
                                   capture_output=True, text=True, env=environment, timeout=600)
        assert completed.returncode == 0, completed.stderr[-2000:]
        results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    budget = 256 * 2**20
    for result in results:
        assert result["accepted"], result.get("error")
        assert result["predicted_peak_bytes"] <= budget
        assert result["smallest_bytes"] * HEADROOM <= budget, result["smallest_bytes"]
    smallest = [result["smallest_bytes"] for result in results]
    # One answer: PlanError's named minimum is rounded to whole MiB, so two runs whose exact floors
    # straddle a MiB may differ by one. The 150-153 MiB spread seen on 2026-11-24 (the bound was 4 MiB
    # then) came from the profiler of that day (f4bc981: 150 and 151 MiB with and without cached
    # bytecode alike, so not the empty __pycache__); since its rehearsal and start-up fixes, nine fresh
    # processes, six with an empty __pycache__, named 153 MiB each, exact floors within 0.2 MB.
    assert max(smallest) - min(smallest) <= 2 * 2**20, smallest
