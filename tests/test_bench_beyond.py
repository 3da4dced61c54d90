"""`bench/bench_beyond.py --quick` runs end to end: every method is measured in its own child process
at each depth it tries, the largest depth within the memory is found, the interleaved timing ran, and
the JSON has the provenance a committed result needs. No timing is asserted (DESIGN.md section 7)."""

import json
import subprocess
import sys
from pathlib import Path

PROVENANCE = {"device", "device_name", "torch_version", "oomless_version", "git_commit", "date_utc", "command", "threads"}


def test_quick_beyond_benchmark_finds_each_methods_largest_model(tmp_path):
    out = tmp_path / "beyond.json"
    script = Path(__file__).parent.parent / "bench" / "bench_beyond.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--memory", "256MiB", "--methods",
                           "plain,checkpoint,oomless", "--threads", "1", "--timing-rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert PROVENANCE <= set(report["provenance"])
    assert set(report["methods"]) == {"plain", "checkpoint", "oomless"}
    for name, result in report["methods"].items():
        # 256 MiB is far more than the tiny ladder needs: every depth fits, the deepest is found.
        assert result["largest_depth"] == report["ladder"][-1], name
        for run in result["runs"]:
            assert run["fits"] and run["peak_above_empty_bytes"] > 0 and run["step_seconds"] > 0
    timing = report["interleaved_timing"]
    assert timing["depth"] == report["ladder"][-1] and set(timing["step_seconds"]) == set(report["methods"])
