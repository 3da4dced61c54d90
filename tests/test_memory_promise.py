"""The promise holds in real memory: a training step (planning included) peaks within `memory`.

On CPU the truth is the process's peak resident memory, measured in a child process above a
baseline taken after imports and a warm-up (library start-up is not the step's memory). The
budgets are well below what the plain step needs. Results (this machine, 2 cores): see the
closing note of the fit-engine issue; the margins are printed with -s.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_child(*arguments) -> dict:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "src")])}
    completed = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "rss_child.py"), *arguments],
                               capture_output=True, text=True, env=environment, timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


_plain_runs: dict[str, dict] = {}


def _plain(model: str) -> dict:
    """The plain step's child run of ``model``, once in this module: every test that compares with
    plain PyTorch's peak reads the same measurement."""
    if model not in _plain_runs:
        _plain_runs[model] = _run_child(model, "plain")
    return _plain_runs[model]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
@pytest.mark.parametrize("model, share", [("transformer", 0.5), ("unet3d", 0.85)])
def test_step_peaks_within_memory_well_below_plain(model, share):
    plain = _plain(model)
    memory = int(plain["peak_bytes"] * share)
    planned = _run_child(model, str(memory))
    margin = memory - planned["peak_bytes"]
    print(f"{model}: plain peak {plain['peak_bytes'] / 2**20:.0f} MiB, budget {memory / 2**20:.0f} MiB "
          f"({share:.0%}), measured {planned['peak_bytes'] / 2**20:.0f} MiB, margin {margin / 2**20:.0f} MiB, "
          f"predicted {planned['predicted_peak_bytes'] / 2**20:.0f} MiB, decisions {set(planned['decisions'].values())}")
    assert planned["peak_bytes"] <= memory
    assert set(planned["decisions"].values()) != {"keep"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_swapping_to_disk_really_lowers_resident_memory():
    plain = _plain("unet3d")
    swapped = _run_child("unet3d", str(int(plain["peak_bytes"] * 0.7)), "swap")
    print(f"unet3d all-swap: plain {plain['peak_bytes'] / 2**20:.0f} MiB, swapped {swapped['peak_bytes'] / 2**20:.0f} MiB")
    # Half the saved activations of this U-Net live in its encoder; with every block's saved
    # tensors on disk the step's resident peak must fall clearly below the plain step's.
    assert swapped["peak_bytes"] < 0.8 * plain["peak_bytes"]
