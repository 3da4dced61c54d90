"""`oomless bench --quick` and `bench/bench_pipeline.py --quick` run end to end and write the JSON
bench/README.md describes.

Timing is never asserted (DESIGN.md section 7): only that every variant ran and was timed, and that
the provenance a committed result needs is there. One exception is a behaviour, not a speed: GPipe
with one micro-batch must leave its two ranks idle for a large share of the step.
"""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_quick_benchmark_of_gpt2_plans_the_hugging_face_model_and_checkpoints_its_layers(tmp_path):
    """`--model gpt2`: Hugging Face's GPT-2 with its next-token loss; checkpointing wraps every block
    the profile found (its layers among them) and recomputes each; the plans train it."""
    pytest.importorskip("transformers")
    out = tmp_path / "fit.json"
    assert main(["bench", "--quick", "--device", "cpu", "--threads", "1", "--model", "gpt2", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["models"]["gpt2"]["variants"]
    assert set(variants) == VARIANTS
    assert any(name.startswith("transformer.h.") for name in variants["keep"]["decisions"])
    assert set(variants["keep"]["decisions"].values()) == {"keep"}
    assert "recompute" in variants["plan_ckpt_memory"]["decisions"].values()
    assert "in-place" not in " ".join(variants["checkpoint"]["notes"])


def test_quick_pipeline_benchmark_measures_each_schedules_bubble(tmp_path):
    """bench/bench_pipeline.py --quick: every schedule at P = 2, M in (1, 2), refusals recorded with
    their reason, and GPipe's one-micro-batch step really serialises its two ranks (half of it is
    bubble in theory; a bound this loose is a check of the schedule, not of timing precision)."""
    out = tmp_path / "pipeline.json"
    program = Path(__file__).resolve().parents[1] / "bench" / "bench_pipeline.py"
    subprocess.run([sys.executable, str(program), "--quick", "--out", str(out)], check=True, timeout=600)
    report = json.loads(out.read_text())
    assert PROVENANCE <= set(report["provenance"])
    synthetic = {(row["schedule"], row["microbatches"]): row for row in report["rows"] if row["model"] == "synthetic"}
    assert set(synthetic) == {(schedule, microbatches) for schedule in
                              ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv") for microbatches in (1, 2)}
    assert synthetic["1f1b", 1]["status"] == "refused" and synthetic["1f1b", 1]["notes"][0]    # the reason
    for key, row in synthetic.items():
        assert row["pipeline_ranks"] == 2 and row["textbook_bubble"] == 1 / (row["microbatches"] + 1)
        if row["status"] == "refused":
            continue
        assert len(row["step_seconds"]) == row["steps"] and row["median_step_seconds"] > 0, key
        assert 0 < row["measured_bubble"] < 1 and 0 <= row["simulated_bubble"] < 1, key
        assert row["ideal_seconds"] == pytest.approx(row["microbatches"] * 2 * 3 * row["unit_seconds"]), key
    assert synthetic["gpipe", 1]["measured_bubble"] > 0.3
    # The simulation of torch's orders is exact arithmetic: GPipe's is the textbook's, the split
    # backward of zero-bubble leaves less idle than 1F1B.
    assert abs(synthetic["gpipe", 2]["simulated_bubble"] - synthetic["gpipe", 2]["textbook_bubble"]) < 1e-9
    assert synthetic["zero-bubble", 2]["simulated_bubble"] < synthetic["1f1b", 2]["simulated_bubble"]
    real = [row for row in report["rows"] if row["model"] == "TinyTransformer"]
    assert {row["schedule"] for row in real} == {"gpipe", "1f1b"}
    assert all(len(row["busy_seconds_per_rank"]) == 2 and min(row["busy_seconds_per_rank"]) > 0 for row in real)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_quick_floors_benchmark_measures_the_guarantee_for_each_model_asked(tmp_path):
    """bench/bench_floors.py --quick on the tiny transformer: its four runs, each in a process of its own,
    and the guarantee's terms as read from them; and the speed half again with checkpointing's steps and
    oomless's interleaved in one process, at checkpointing's memory. What is checked is the benchmark's
    bookkeeping, the same for every model: the transformer's four runs and the interleaved one took 45 s
    on a busy 2-core CPU at one thread, the U-Net's 133 s (each oomless run's warm-up plans a 16^3 U-Net
    at its floor) and 460 s at two threads, whose kernels wait on each other when the cores are shared.
    (The floor guarantee itself, measured, is tests/test_floor.py's.)"""
    out = tmp_path / "floors.json"
    program = Path(__file__).resolve().parents[1] / "bench" / "bench_floors.py"
    completed = subprocess.run([sys.executable, str(program), "--quick", "--models", "transformer", "--threads", "1",
                                "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    assert PROVENANCE <= set(report["provenance"]) and report["quick"] and set(report["models"]) == {"transformer"}
    result = report["models"]["transformer"]
    runs = result["runs"]
    assert set(runs) == {"plain", "checkpoint", "oomless at checkpoint's memory", "oomless at its floor",
                         "interleaved with checkpoint"}
    interleaved = runs.pop("interleaved with checkpoint")
    assert interleaved["baseline"] == "checkpoint" and interleaved["memory_bytes"] == result["checkpoint_peak_bytes"]
    steps = interleaved["oomless_step_seconds"]
    assert len(steps) == len(interleaved["baseline_step_seconds"]) == 2 and min(steps) > 0
    assert interleaved["step_ratios"] == [ours / theirs for ours, theirs in
                                          zip(steps, interleaved["baseline_step_seconds"])]
    assert result["step_vs_checkpoint"]["at checkpoint's memory, steps interleaved"] == \
        interleaved["median_step_ratio"] == statistics.median(interleaved["step_ratios"])
    for name, run in runs.items():
        assert len(run["step_seconds"]) == report["steps"] and run["median_step_seconds"] > 0, name
        assert run["peak_bytes"] == max(run["steps_peak_bytes"], run["planning_peak_bytes"]) > 0, name
    at_checkpoint, at_floor = runs["oomless at checkpoint's memory"], runs["oomless at its floor"]
    assert at_checkpoint["memory_bytes"] == result["checkpoint_peak_bytes"] == runs["checkpoint"]["peak_bytes"]
    assert at_floor["memory_bytes"] == at_floor["floor_bytes"]
    guarantee = result["guarantee"]
    assert guarantee["accepts_checkpoints_memory"] == ("refused" not in at_checkpoint)
    assert guarantee["within_it"] == (at_checkpoint["steps_peak_bytes"] <= result["checkpoint_peak_bytes"])
    assert guarantee["smallest_budget_below_checkpoints_peak"] == (result["smallest_budget_bytes"]
                                                                   < result["checkpoint_peak_bytes"])
    assert guarantee["floor_steps_within_its_budget"] == (at_floor["steps_peak_bytes"] <= at_floor["memory_bytes"])
    assert "transformer" in completed.stdout     # the table


def test_results_go_to_runs_bench_unless_out_says_otherwise(tmp_path, monkeypatch):
    """Benchmarks never write into the source tree by default: runs/bench/ under the current
    directory, one date format (YYYY-MM-DD); --out names a folder or a .json file."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        from common import result_path
    finally:
        sys.path.pop(0)
    monkeypatch.chdir(tmp_path)
    default = result_path(None, "fit-cpu")
    assert default.parent == Path("runs") / "bench"
    assert re.fullmatch(r"fit-cpu-\d{4}-\d{2}-\d{2}\.json", default.name)
    assert result_path("elsewhere", "fit-cpu") == Path("elsewhere") / default.name
    assert result_path("one.json", "fit-cpu") == Path("one.json")
    assert list(tmp_path.iterdir()) == []                  # checked, nothing created before the run


def test_max_size_trials_train_in_the_precision_asked(tmp_path):
    """bench_max_size --precision bf16: each trial (bench/floor_child.py) trains under that autocast,
    oomless through precision= and planning for it: its saved activations shrink (not to half: autocast
    runs normalisation in fp32, which saves fp32 tensors; 0.73 measured at 24^3)."""
    root = Path(__file__).resolve().parents[1]
    environment = {"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"}
    ledger = {}
    for precision in ("fp32", "bf16"):
        config = {"model": "unet3d", "side": 24, "batch": 1, "mode": "oomless", "device": "cpu", "threads": 1,
                  "steps": 1, "memory": 512 * 2**20, "precision": precision}
        completed = subprocess.run([sys.executable, str(root / "bench" / "floor_child.py"), json.dumps(config)],
                                   capture_output=True, text=True, env=environment, timeout=600)
        assert completed.returncode == 0, completed.stderr[-2000:]
        result = json.loads(completed.stdout.strip().splitlines()[-1])
        assert result["fits"] and result["config"]["precision"] == precision
        ledger[precision] = result["ledger_peak_bytes"]
    assert 0.4 < ledger["bf16"] / ledger["fp32"] < 0.85, ledger


def test_quick_simulate_benchmark_writes_predicted_and_measured_for_each_layout(tmp_path):
    """bench/bench_simulate.py --quick: world size 2, dp and a 1F1B pipeline, calibrated, predicted
    by oomless simulate and run through the trainer's strategies. Structure only: both the
    prediction and the measurement are there and positive (their agreement is the benchmark's to
    report, not a test's)."""
    out = tmp_path / "simulate.json"
    program = Path(__file__).resolve().parents[1] / "bench" / "bench_simulate.py"
    subprocess.run([sys.executable, str(program), "--quick", "--out", str(out)], check=True, timeout=600)
    report = json.loads(out.read_text())
    assert PROVENANCE <= set(report["provenance"]) and report["provenance"]["backend"] == "gloo"
    assert len(report["load_average"]["before"]) == 3 and "after_round_1" in report["load_average"]
    calibration = report["calibration"]["2"][0]
    assert calibration["link"]["bytes_per_second"] > 0 and calibration["link"]["latency_seconds"] >= 0
    assert calibration["memory_bytes_per_second"] > 0 and calibration["threads"] >= 1
    # The machine's contention, measured, is what simulate was given.
    assert calibration["contention"]["1"] == 1.0 and calibration["contention"]["2"] > 0
    assert report["simulations"]["2"][0]["cluster"]["contention"] == calibration["contention"]
    rows = {row["layout"]: row for row in report["rows"]}
    assert set(rows) == {"dp x2", "pipeline pp2 1f1b"}
    for row in rows.values():
        assert row["world_size"] == 2
        for side in ("predicted", "measured"):
            assert row[side]["step_seconds"] > 0 and row[side]["peak_bytes"] > 0, (row["layout"], side)
        assert row["ratio"]["step_seconds"] > 0 and row["ratio"]["peak_bytes"] > 0
        assert len(row["measured"]["step_seconds_each"]) == report["settings"]["steps"]
        assert len(row["measured"]["peak_bytes_per_rank"]) == 2
    assert rows["pipeline pp2 1f1b"]["measured"]["stage_blocks"] and rows["pipeline pp2 1f1b"]["microbatches"] >= 2
    (check,) = report["recommendation"]
    assert check["measured_fastest"] in rows and isinstance(check["met"], bool)
    assert report["summary"]["layouts"] == 2


def test_max_size_searches_deeplabv3_square_images(tmp_path):
    """bench_max_size --model deeplabv3: every trial trains torchvision's DeepLabv3 on square images in a
    fresh process, and the result has the U-Net's format in pixels (side^2) with the whole batch's pixels
    per second. MobileNetV3 backbone, 256 MiB, sides 32 and 48 (--quick): plain PyTorch peaks at 184 MiB."""
    try:
        import torchvision  # noqa: F401     (importable here through tests/conftest.py, if installed)
    except Exception as error:                   # not installed, or built for another torch
        pytest.skip(f"needs torchvision: {type(error).__name__}: {str(error)[:200]}")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "deeplabv3.json"
    completed = subprocess.run(
        [sys.executable, str(root / "bench" / "bench_max_size.py"), "--model", "deeplabv3", "--backbone",
         "mobilenet_v3_large", "--quick", "--methods", "plain,checkpoint,oomless", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model"] == {"name": "deeplabv3", "backbone": "mobilenet_v3_large", "batch": 2, "classes": 2}
    assert report["memory_bytes"] == 256 * 2**20 and PROVENANCE <= set(report["provenance"])
    assert set(report["methods"]) == {"plain", "checkpoint", "oomless"}
    for name, record in report["methods"].items():
        assert [trial["side"] for trial in record["trials"]] == [32, 48], name
        assert record["largest_side"] == 48 and record["pixels"] == 48**2, name
        assert 0 < record["peak_bytes"] <= report["memory_bytes"], name
        assert record["pixels_per_second"] == pytest.approx(2 * 48**2 / record["step_seconds"]), name
    # Checkpointed: oomless's blocks (the backbone's and the head's; in-place ones stay plain), not
    # the ASPP's five parallel branches, the model's one nn.ModuleList.
    from oomless.models import build_deeplabv3
    from oomless.profile.blocks import find_blocks
    blocks = find_blocks(build_deeplabv3(backbone="mobilenet_v3_large"))
    wrapped = len([name for name, block in blocks if not getattr(block, "inplace", False)])
    assert report["methods"]["checkpoint"]["trials"][-1]["wrapped_blocks"] == wrapped > 5
    assert report["methods"]["oomless"]["trials"][-1]["decisions"]
    assert out.with_suffix(".png").is_file()
    sys.path.insert(0, str(root / "bench"))
    try:
        from bench_max_size import markdown_table
    finally:
        sys.path.pop(0)
    assert "| plain | 48^2 | 1.00x |" in markdown_table(report)


def test_max_size_runs_the_sides_given_instead_of_searching(tmp_path):
    """bench_max_size --sides: exactly those trials, each method's largest side the largest that fits,
    'bracketed' where the next multiple of 8 ran and did not fit; a malformed item is refused."""
    root = Path(__file__).resolve().parents[1]
    program = [sys.executable, str(root / "bench" / "bench_max_size.py")]
    out = tmp_path / "sides.json"
    subprocess.run([*program, "--sides", "plain:16,plain:24,plain:32", "--memory", "24MiB", "--steps", "1",
                    "--threads", "1", "--out", str(out)], check=True, timeout=600, capture_output=True)
    record = json.loads(out.read_text())["methods"]["plain"]
    trials = {trial["side"]: trial["fits"] for trial in record["trials"]}
    assert list(trials) == [16, 24, 32]
    fitting = [side for side, fits in trials.items() if fits]
    assert record["largest_side"] == (max(fitting) if fitting else None)
    assert record["bracketed"] == (bool(fitting) and trials.get(max(fitting) + 8) is False)
    refused = subprocess.run([*program, "--sides", "plain:20"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "multiple of 8" in refused.stderr
