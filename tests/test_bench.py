"""`oomless bench --quick` runs end to end and writes the JSON its README describes.

Timing is never asserted (DESIGN.md section 7): only that every variant ran and was timed, and that
the provenance a committed result needs is there.
"""

import json

from oomless.cli.main import main

VARIANTS = {"plain", "keep", "plan_50", "plan_25", "plan_ckpt_memory", "checkpoint", "save_on_cpu"}
PROVENANCE = {"device", "device_name", "torch_version", "oomless_version", "git_commit", "date_utc", "command", "threads"}


def test_quick_benchmark_writes_every_variant_with_provenance(tmp_path, capsys):
    out = tmp_path / "fit.json"
    # One thread: on a busy machine multi-threaded kernels on tiny tensors wait on each other for ms.
    assert main(["bench", "--quick", "--device", "cpu", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert PROVENANCE <= set(report["provenance"])
    assert report["provenance"]["device"] == "cpu" and report["provenance"]["threads"] == 1
    assert set(report["models"]) == {"transformer", "unet3d"}
    for model_report in report["models"].values():
        variants = model_report["variants"]
        assert set(variants) == VARIANTS
        for name, result in variants.items():
            assert len(result["step_seconds"]) == report["steps"]
            assert all(seconds > 0 for seconds in result["step_seconds"]), name
            assert result["median_step_seconds"] > 0 and result["ratio_vs_plain"] > 0
            assert result["measured_peak_bytes"] > 0
        for name in ("keep", "plan_50", "plan_25", "plan_ckpt_memory"):
            assert variants[name]["oomless_stats"]["steps"] == report["steps"] + report["warmup_steps"]
            assert variants[name]["predicted_step_seconds"] > 0
        assert set(variants["keep"]["decisions"].values()) == {"keep"}
    assert "wrote" in capsys.readouterr().out
