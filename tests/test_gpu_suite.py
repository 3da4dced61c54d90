"""bench/gpu_suite.py, the one command for a CUDA machine, must not rot while no GPU is at hand:
its dry run (every piece on CPU at tiny sizes) runs end to end here and writes what a GPU run
writes. Also: a piece past its time limit is stopped with its children and recorded, and the
trace summary measures copy/compute overlap from Kineto's events as it should."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY / "bench"))

import cuda_peak  # noqa: E402  (bench/cuda_peak.py)
from gpu_suite import run_piece  # noqa: E402  (bench/gpu_suite.py)
from swap_trace import summarize_trace  # noqa: E402  (bench/swap_trace.py)

PIECES = {"cuda_tests", "swap_trace", "fit_bench", "predict", "cuda_peak", "cuda_peak_large", "cuda_peak_transformer", "max_size", "dp_world_1", "dp_world_2",
          "simulate_world_1", "linear_loss", "floors", "fit_precision"}
PROVENANCE = {"device_name", "torch_version", "cuda_version", "git_commit", "date_utc", "command"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY / "src"))
    completed = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", str(out)],
                               cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return out


def test_the_dry_run_reports_every_piece_with_provenance(dry_run):
    suite = json.loads((dry_run / "suite.json").read_text())
    assert suite["dry_run"] and PROVENANCE <= set(suite["provenance"])
    records = {record["name"]: record for record in suite["pieces"]}
    assert set(records) == PIECES
    for name, record in records.items():
        assert record["status"] in ("passed", "skipped", "not_present"), (name, record.get("log_tail"))
        if record["status"] == "passed":
            assert record["files"] and record["highlights"] and "unreadable" not in record["highlights"], name
            assert (dry_run / record["log"]).is_file()
            for file in record["files"]:
                result = json.loads((dry_run / file).read_text())
                assert PROVENANCE <= set(result["provenance"]), (name, file)
                assert result["provenance"]["device"] == "cpu"
        else:
            assert record["reason"]
    # The pieces that need no GPU to exist really ran; bench_max_size.py is there or said not to be.
    assert all(records[name]["status"] == "passed" for name in ("cuda_tests", "swap_trace", "fit_bench", "predict",
                                                                "dp_world_1", "simulate_world_1", "linear_loss",
                                                                "floors", "fit_precision"))
    present = (REPOSITORY / "bench" / "bench_max_size.py").is_file()
    assert records["max_size"]["status"] == ("passed" if present else "not_present")


def test_the_dry_run_records_each_cuda_test_and_writes_the_summary(dry_run):
    tests = json.loads((dry_run / "cuda-tests.json").read_text())
    # pytest's own tally of the tests the piece ran (-m gpu), its log's last line ("71 skipped, 1280
    # deselected in 8.75s"), against the plugin's one line per test: counted by pytest's terminal
    # report, not by the plugin, in the same run (collecting them again took a fresh pytest 10-17 s).
    tally = (dry_run / "logs" / "cuda_tests.log").read_text().strip().splitlines()[-1]
    ran = {outcome: int(number) for number, outcome in re.findall(r"(\d+) (\w+)", tally)
           if outcome in ("passed", "failed", "skipped", "error", "errors", "xfailed", "xpassed")}
    count = sum(ran.values())
    assert count > 30 and len(tests["tests"]) == count == tests["counts"]["skipped"], tally   # no CUDA here
    assert all(test["message"] for test in tests["tests"])
    summary = (dry_run / "summary.md").read_text()
    assert "Dry run" in summary and all(f"| {name} |" in summary for name in PIECES)
    assert "## Compare with" in summary


def test_a_piece_past_its_limit_is_stopped_with_its_children_and_recorded(tmp_path):
    (tmp_path / "logs").mkdir()
    marker = tmp_path / "child-still-running"
    # The piece starts a child that would write the marker after 4 s: stopping the piece's process
    # group must end it too.
    child = f"import time, pathlib; time.sleep(4); pathlib.Path({str(marker)!r}).write_text('x')"
    code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
            "print('started', flush=True); time.sleep(60)")
    piece = {"name": "sleeper", "writes": ["sleeper.json"], "command": [sys.executable, "-c", code]}
    started = time.monotonic()
    record = run_piece(piece, tmp_path, dict(os.environ), limit_seconds=1.5)
    assert record["status"] == "timed_out" and time.monotonic() - started < 30
    assert "started" in record["log_tail"]
    time.sleep(5)
    assert not marker.exists()

    failing = {"name": "failing", "writes": ["failing.json"], "command": [sys.executable, "-c", "raise SystemExit(3)"]}
    record = run_piece(failing, tmp_path, dict(os.environ), limit_seconds=60)
    assert (record["status"], record["return_code"]) == ("failed", 3)


def _event(category, name, start, duration, stream, **args):
    return {"ph": "X", "cat": category, "name": name, "ts": start, "dur": duration, "args": dict(stream=stream, **args)}


def test_the_trace_summary_measures_copy_time_hidden_behind_kernels():
    events = [
        _event("kernel", "conv", 0, 100, 7), _event("kernel", "relu", 150, 50, 7),
        # device->host: 80 us, of which 60 under "conv" (40-100) and 20 in the gap (100-120)
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 40, 80, 20, bytes=1000),
        # host->device: two copies overlapping each other (wall time counted once): 120-180,
        # of which 30 under "relu"
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 120, 40, 21, bytes=500),
        _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 140, 40, 7, bytes=500),
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 500},
    ]
    summary = summarize_trace(events)
    assert summary["kernel_count"] == 2 and summary["kernel_busy_seconds"] == pytest.approx(150e-6)
    out, back = summary["directions"]["device_to_host"], summary["directions"]["host_to_device"]
    assert (out["seconds"], out["overlapped_seconds"]) == (pytest.approx(80e-6), pytest.approx(60e-6))
    assert (back["seconds"], back["overlapped_seconds"]) == (pytest.approx(60e-6), pytest.approx(30e-6))
    assert back["bytes"] == 1000 and back["count"] == 2 and out["streams"] == [20]
    assert summary["host_copy_overlap_fraction"] == pytest.approx(90 / 140)
    assert summary["pageable_copy_count"] == 1 and summary["copies_share_a_stream_with_kernels"]


def test_cuda_peak_records_stacks_of_allocations_only(monkeypatch):
    """Stacks at frees too lose torch's checkpoint's early-stop exception on autograd's device thread
    (torch 2.11, Python < 3.13): every recomputed backward under the history failed with
    "run_backward returned NULL without setting an exception" (`cuda_peak.allocation_history`).
    The history is turned off also when the recorded step raises."""
    calls = []
    monkeypatch.setattr(cuda_peak.torch.cuda.memory, "_record_memory_history",
                        lambda *args, **kwargs: calls.append((args, kwargs)))
    with pytest.raises(ValueError), cuda_peak.allocation_history():
        raise ValueError("the step failed")
    assert calls == [((), {"context": "alloc", "stacks": "python", "max_entries": 500_000}),
                     ((), {"enabled": None})]
