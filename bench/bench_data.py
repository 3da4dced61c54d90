"""Data path of ``oomless train --data``: staging that resumes after a kill, and the data wait per step.

    python bench/bench_data.py                     # ~1 GiB staging set + the demo dataset, CPU
    python bench/bench_data.py --stage-gib 0.1 --steps 4 --size 32     # quick

1. Staging: writes a synthetic Decathlon-style set of about ``--stage-gib`` GiB of .nii.gz, stages it
   in a child process that is SIGKILLed half way through the bytes (tests/stage_kill_child.py), then
   stages again: how many files the resumed run verified and kept (their inode and modification time
   unchanged) and how many it copied, with the seconds each pass took.
2. Data wait: trains ``--steps`` steps on ``make-data --cases 8 --size 96`` through a stage, with 0 and
   2 loader workers in turn, in this one process: data wait as a share of step time for each.

Writes JSON with provenance to runs/bench/data-cpu-<date>.json (--out FOLDER|FILE.json; --out bench/results
for a result to commit).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

from oomless.data.config import DataConfig
from oomless.data.layout import find_dataset
from oomless.data.make_dataset import write_synthetic_dataset
from oomless.data.stage import files_of, stage_dataset
from oomless.errors import InputError
from oomless.train import TrainConfig, train

REPOSITORY = Path(__file__).resolve().parents[1]


def measure_staging(work: Path, gib: float) -> dict:
    # One 4-channel 160^3 float32 case is ~62 MiB of .nii.gz (noise barely compresses).
    side = 160
    case_bytes = 4 * side**3 * 4
    cases = max(2, round(gib * 2**30 / case_bytes))
    source = work / "shared" / "task"
    write_synthetic_dataset(source, cases=cases, size=side, channels=4, classes=4, seed=0)
    layout = find_dataset(source)
    files = files_of(layout)
    total_bytes = sum(path.stat().st_size for path in files)
    stage_dir = work / "local" / "stage"
    started = time.perf_counter()
    killed = subprocess.run([sys.executable, str(REPOSITORY / "tests" / "stage_kill_child.py"), str(source),
                             str(stage_dir), str(total_bytes // 2)],
                            env={**os.environ, "PYTHONPATH": str(REPOSITORY / "src")}, capture_output=True, text=True)
    killed_seconds = time.perf_counter() - started
    finished = [layout.relative(path) for path in files if (stage_dir / "files" / layout.relative(path)).is_file()]
    before = {relative: (stage_dir / "files" / relative).stat() for relative in finished}
    started = time.perf_counter()
    report = stage_dataset(layout, stage_dir)
    resumed_seconds = time.perf_counter() - started
    untouched = [relative for relative in finished
                 if (before[relative].st_ino, before[relative].st_mtime_ns) ==
                 ((stage_dir / "files" / relative).stat().st_ino, (stage_dir / "files" / relative).stat().st_mtime_ns)]
    started = time.perf_counter()
    again = stage_dataset(layout, stage_dir)
    verify_seconds = time.perf_counter() - started
    return {"files": len(files), "bytes": total_bytes, "killed_return_code": killed.returncode,
            "killed_after_seconds": killed_seconds, "finished_before_kill": len(finished),
            "resume_verified_and_kept": len(report.verified), "resume_copied": len(report.copied),
            "resume_copied_bytes": report.copied_bytes, "finished_files_untouched_by_resume": len(untouched),
            "resume_seconds": resumed_seconds, "complete_stage_verify_seconds": verify_seconds,
            "complete_stage_copied": len(again.copied)}


def measure_data_wait(work: Path, steps: int, size: int) -> dict:
    source = work / "demo"
    write_synthetic_dataset(source, cases=8, size=size, channels=4, classes=4, seed=0)
    results = {}
    for workers in (0, 2):
        data = DataConfig(path=source, stage=work / "demo-stage", workers=workers, run_dir=work / f"run-{workers}")
        config = TrainConfig(steps=steps, global_batch=2, seed=0, device="cpu", progress=False, data=data)
        started = time.perf_counter()
        result = train(config)
        seconds = time.perf_counter() - started
        waits = result.data_wait_seconds_per_step
        step_seconds = 2 / result.volumes_per_second
        results[f"workers_{workers}"] = {
            "seconds_per_step": step_seconds, "data_wait_seconds_per_step": waits,
            "data_wait_share_after_first_step": sum(waits[1:]) / len(waits[1:]) / step_seconds if len(waits) > 1 else None,
            "data_wait_share_all_steps": result.data_wait_seconds / (step_seconds * steps),
            "run_seconds": seconds,
        }
    return {"size": size, "steps": steps, "global_batch": 2, "channels": 4, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage-gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
    parser.add_argument("--out", default=None, help="folder or .json file (default runs/bench/data-cpu-<date>.json)")
    args = parser.parse_args()
    try:
        out = common.result_path(args.out, "data-cpu")
    except InputError as error:
        parser.error(str(error))
    work = Path(args.work or tempfile.mkdtemp(prefix="oomless-bench-data-"))
    try:
        record = {"provenance": common.provenance("cpu"),
                  "staging": measure_staging(work / "staging", args.stage_gib),
                  "data_wait": measure_data_wait(work / "wait", args.steps, args.size)}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    common.write_result(out, record)


if __name__ == "__main__":
    main()
