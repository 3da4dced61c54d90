"""Everything oomless does on CUDA, in one command, with its results as JSON and a Markdown summary.

    make gpu                                              # = python bench/gpu_suite.py
    python bench/gpu_suite.py --out bench/results/gpu/my-run
    python bench/gpu_suite.py --dry-run --out /tmp/suite  # every piece on CPU at tiny sizes (CI runs this)

On a machine with a CUDA GPU, each piece in its own process, one after the other:

    cuda_tests        python -m pytest -m gpu tests (every test marked gpu: tests/test_cuda*.py and the
                      CUDA cases of the offload and update-in-backward files; one JSON line per test as it ends)
    swap_trace        bench/swap_trace.py: torch.profiler trace of one all-swap step, copy/compute overlap
    fit_bench         oomless bench --device cuda (bench/bench_fit.py): step time and peak against plain
                      PyTorch, torch.utils.checkpoint and save_on_cpu
    cuda_peak         bench/cuda_peak.py: what is live at the allocator's peak of the U-Net planned at 75 % of
                      plain's peak (tests/test_cuda.py's case), by the line that allocated it; per phase
                      the allocator's peak, the ledger and the plan's working memory
    cuda_peak_large   the same for bench_floors' U-Net (128^3, base 16) at checkpointing's share of plain (64 %)
    cuda_peak_transformer  the same for the transformer, every block recomputed at the smallest budget
                      that fits, and what is live at the peak of the profiler's sizing step
    fit_precision     oomless bench --device cuda --model transformer --precision bf16 --compile: bf16 and
                      compiled variants against plain bf16 and torch.compile(block) (issue 11's figures)
    predict           bench/bench_predict.py: predicted against measured step time and peak
    max_size          bench/bench_max_size.py, if present: the largest model trained within the memory
    dp_world_1        bench/bench_dp.py --world-size 1 (NCCL)
    dp_world_2        bench/bench_dp.py --world-size 2, where two GPUs exist
    simulate_world_1  bench/bench_simulate_cuda.py: oomless simulate (datasheet and calibrated) against dp and
                      fsdp trained through the trainer, NCCL at world size 1 (issue 14, item 4)
    linear_loss       bench/bench_linear_loss.py: GPT-2's head and loss in bf16, whole against in chunks
    floors            bench/bench_floors.py --models unet3d: the floor guarantee against checkpointing and
                      save_on_cpu (issue 15, item 5)

Needs only what a PyTorch machine has (torch with CUDA, numpy, pytest, rich, safetensors): it runs
from the source tree (``PYTHONPATH=src``), installs nothing. Each piece has a time limit; one that
fails or runs out of time is recorded as such and the suite goes on; the whole run stays within
``--time-budget`` seconds (default 540: 9 minutes). Output folder (default
``bench/results/gpu/<date>-<device>/``, meant to be committed): one JSON per piece, each with
provenance (device name, torch and CUDA versions, git commit, date, command), ``logs/<piece>.log``,
``suite.json`` (every piece: command, status, seconds, highlights) and ``summary.md``. In a copy of
the tree without ``.git``, set ``OOMLESS_GIT_COMMIT`` to the commit the copy was made from.
"""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

BENCH_DIRECTORY = Path(__file__).resolve().parent
REPOSITORY = BENCH_DIRECTORY.parent
if str(BENCH_DIRECTORY) not in sys.path:
    sys.path.insert(0, str(BENCH_DIRECTORY))
from suite_report import highlights, write_summary  # noqa: E402  (bench/suite_report.py)

TIME_BUDGET_SECONDS = 540
PIECE_LIMIT_SECONDS = {"cuda_tests": 240, "swap_trace": 40, "fit_bench": 90, "predict": 60, "cuda_peak": 40,
                       "cuda_peak_large": 60, "cuda_peak_transformer": 40, "max_size": 70,
                       "dp_world_1": 30, "dp_world_2": 30, "simulate_world_1": 60, "linear_loss": 90, "floors": 330,
                       "fit_precision": 120}
DRY_RUN_PIECE_LIMIT_SECONDS = 150
CUDA_TEST_PATHS = ["tests"]    # with -m gpu: every test marked gpu
MINIMUM_PIECE_SECONDS = 10          # less than this left of the budget: the piece is skipped, not started


def _environment(dry_run: bool) -> dict:
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(REPOSITORY / "src"), str(REPOSITORY)] + [p for p in environment.get("PYTHONPATH", "").split(":") if p]
    environment["PYTHONPATH"] = ":".join(paths)
    if dry_run:
        environment["CUDA_VISIBLE_DEVICES"] = ""    # CPU even on a GPU machine
        # One thread for each piece's torch (where it sets none itself): at the dry run's tiny sizes a
        # shared CPU's threads mostly wait on each other (a 16^3 U-Net's planned trial took 65 s at two
        # threads on a busy 2-core machine, under 20 s at one).
        environment["OMP_NUM_THREADS"] = "1"
    return environment


def probe(environment: dict, dry_run: bool) -> dict:
    """Provenance and the device, from a child process: importing CUDA here would hold a context
    (hundreds of MiB of device memory) in this process for the whole suite."""
    code = ("import json, sys, torch; sys.path.insert(0, 'bench'); from common import provenance; "
            "cuda = torch.cuda.is_available(); "
            "record = provenance('cuda' if cuda else 'cpu', command=sys.argv[1]); "
            "record['device_count'] = torch.cuda.device_count() if cuda else 0; "
            "record['device_memory_bytes'] = torch.cuda.get_device_properties(0).total_memory if cuda else None; "
            "print(json.dumps(record))")
    command = shlex.join([sys.executable, *sys.argv])
    completed = subprocess.run([sys.executable, "-c", code, command], cwd=REPOSITORY, env=environment,
                               capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"could not start Python with torch from the source tree:\n{completed.stderr[-2000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def plan_pieces(out: Path, device: dict, dry_run: bool, max_size_memory: str | None) -> list[dict]:
    """Every piece: name, command, the JSON files it writes, a skip reason if it cannot run here."""
    python = sys.executable
    cuda = not dry_run
    device_name = "cuda" if cuda else "cpu"
    dp = (["--size", "64", "--base-channels", "16", "--depth", "3", "--local-batch", "2", "--bucket-cap-mb", "25",
           "--rounds", "10", "--warmup-rounds", "2"] if cuda else
          ["--size", "8", "--base-channels", "2", "--depth", "1", "--rounds", "2", "--warmup-rounds", "1"])
    pieces = [
        {"name": "cuda_tests", "writes": ["cuda-tests.json"],
         "command": [python, "-m", "pytest", "-q", "-m", "gpu", *CUDA_TEST_PATHS, "-p", "bench.pytest_jsonl",
                     "--results-jsonl", str(out / "logs" / "cuda-tests.jsonl"), "-p", "no:cacheprovider"]},
        {"name": "swap_trace", "writes": ["swap-trace.json"],
         "command": [python, "bench/swap_trace.py", "--device", device_name, "--out", str(out / "swap-trace.json")]
         + ([] if cuda else ["--quick"])},
        {"name": "fit_bench", "writes": ["fit.json"],
         "command": [python, "-m", "oomless", "bench", "--device", device_name, "--out", str(out / "fit.json")]
         + (["--steps", "3", "--warmup", "1"] if cuda else ["--quick", "--threads", "1"])},
        {"name": "predict", "writes": ["predict.json"],
         "command": [python, "bench/bench_predict.py", "--device", device_name, "--out", str(out / "predict.json")]
         + ([] if cuda else ["--quick", "--model", "transformer", "--steps", "1"])},
        {"name": "cuda_peak", "writes": ["cuda-peak.json"],
         "command": [python, "bench/cuda_peak.py", "--model", "unet3d", "--decisions", "planned", "--share", "0.75",
                     "--out", str(out / "cuda-peak.json")],
         **({} if cuda else {"skip": "needs CUDA (the allocator's history)"})},
        # bench_floors' U-Net (128^3, base 16) at checkpointing's share of plain (2663 of 4143 MiB on
        # the H200, 2026-11-29), where its step measured 6 % over the plan: which phase passes it.
        {"name": "cuda_peak_large", "writes": ["cuda-peak-large.json"],
         "command": [python, "bench/cuda_peak.py", "--model", "unet3d-128", "--decisions", "planned", "--share", "0.64",
                     "--out", str(out / "cuda-peak-large.json")],
         **({} if cuda else {"skip": "needs CUDA (the allocator's history)"})},
        # The transformer's working memory as profiled on CUDA (forward 945, backward 1153 MiB beyond
        # the ledger per block, H200, 2026-11-27) against what its recomputed step shows.
        {"name": "cuda_peak_transformer", "writes": ["cuda-peak-transformer.json"],
         "command": [python, "bench/cuda_peak.py", "--model", "transformer", "--decisions", "recompute",
                     "--memory", "smallest", "--profile-history", "--out", str(out / "cuda-peak-transformer.json")],
         **({} if cuda else {"skip": "needs CUDA (the allocator's history)"})},
    ]
    max_size = {"name": "max_size", "writes": [], "command": None}
    if (BENCH_DIRECTORY / "bench_max_size.py").is_file():
        # On the GPU a search takes too long for the piece (each trial a fresh process, ~10 s; oomless's
        # at large sides tens of seconds): fixed sides within 2 GiB instead, around plain's largest
        # (152 fitted, H200, 2026-11-27) and where oomless should reach (CPU: 2.3x plain's side at 1 GiB).
        memory = max_size_memory or ("2GiB" if cuda else "48MiB")
        max_size["command"] = [python, "bench/bench_max_size.py", "--device", device_name, "--memory", memory,
                               "--out", str(out / "max-size")] + (
            ["--sides", "plain:160,oomless:288"] if cuda else ["--sides", "plain:16,oomless:16", "--steps", "1",
                                                                 "--threads", "1"])
    else:
        max_size["not_present"] = "bench/bench_max_size.py is not in this checkout"
    pieces.append(max_size)
    for world_size in (1, 2):
        piece = {"name": f"dp_world_{world_size}", "writes": [f"dp-world-{world_size}.json"],
                 "command": [python, "bench/bench_dp.py", "--world-size", str(world_size), "--device", device_name,
                             "--out", str(out / f"dp-world-{world_size}.json"), *dp]}
        if world_size > 1 and dry_run:
            piece["skip"] = "dry run: world size 1 only (gloo at world sizes 2-4 is what tests/test_parallel_*.py run)"
        elif world_size > 1 and device["device_count"] < world_size:
            piece["skip"] = (f"needs {world_size} GPUs (NCCL puts each rank on its own GPU); "
                             f"this machine has {device['device_count']}")
        pieces.append(piece)
    # Issue 14's item 4 on the GPU: simulate (from the datasheet, and calibrated here) against dp and
    # fsdp trained through the trainer's strategies, NCCL at world size 1.
    pieces.append({"name": "simulate_world_1", "writes": ["simulate-world-1.json"],
                   "command": [python, "bench/bench_simulate_cuda.py", "--device", device_name,
                               "--out", str(out / "simulate-world-1.json")] + ([] if cuda else ["--quick"])})
    # GPT-2's head and loss over 16 x 1024 tokens in bf16: the logits 3.3 GB in fp32, whole or in chunks.
    pieces.append({"name": "linear_loss", "writes": ["linear-loss.json"],
                   "command": [python, "bench/bench_linear_loss.py", "--device", device_name,
                               "--out", str(out / "linear-loss.json")]
                   + (["--rows", "16384", "--precision", "bf16", "--chunk-rows", "default,256,1024,4096"] if cuda else
                      ["--rows", "256", "--width", "16", "--classes", "1000", "--steps", "1", "--threads", "1",
                       "--chunk-rows", "default"])})
    # Issue 15's floor guarantee on CUDA: the U-Net under plain PyTorch, checkpointing, save_on_cpu and
    # oomless at each one's peak and at its own floor, a fresh process each (~10 s apiece; 307 s in
    # all on the H200, 2026-11-29, where split plans stepped in 3-4 s: past the old 100 s limit). The dry run
    # checks the piece with the tiny transformer and without the steps interleaved in one process:
    # tests/test_bench.py runs the quick transformer with them (the quick U-Net's four trials took 2
    # minutes on a 2-core CPU at one thread, the transformer's 45 s).
    pieces.append({"name": "floors", "writes": ["floors.json"],
                   "command": [python, "bench/bench_floors.py", "--device", device_name,
                               "--models", "unet3d" if cuda else "transformer", "--out", str(out / "floors.json")]
                   + ([] if cuda else ["--quick", "--threads", "1", "--speed-steps", "0"])})
    # Last: inductor compiles the transformer's block first (tens of seconds on a GPU). The dry run
    # checks the bf16 variants only: compiling on CI's CPU takes a minute more.
    pieces.append({"name": "fit_precision", "writes": ["fit-precision.json"],
                   "command": [python, "-m", "oomless", "bench", "--device", device_name, "--model", "transformer",
                               "--precision", "bf16", "--out", str(out / "fit-precision.json")]
                   + (["--compile", "--steps", "3", "--warmup", "1"] if cuda else ["--quick", "--threads", "1"])})
    return pieces


def _stop(process: subprocess.Popen) -> None:
    """End the piece and every process it started (bench_dp's workers): its own process group."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run_piece(piece: dict, out: Path, environment: dict, limit_seconds: float) -> dict:
    record = {"name": piece["name"], "command": shlex.join(piece["command"]) if piece["command"] else None,
              "limit_seconds": round(limit_seconds, 1), "seconds": 0.0, "return_code": None, "files": []}
    reason = piece.get("not_present") or piece.get("skip")
    if reason:
        record["status"], record["reason"] = "not_present" if piece.get("not_present") else "skipped", reason
        return record
    for stale in [*piece["writes"], "logs/cuda-tests.jsonl"]:     # an earlier run's results must not count
        (out / stale).unlink(missing_ok=True)
    log_path = out / "logs" / f"{piece['name']}.log"
    record["log"] = str(log_path.relative_to(out))
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(piece["command"], cwd=REPOSITORY, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            record["return_code"] = process.wait(timeout=limit_seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            _stop(process)
            timed_out = True
    record["seconds"] = round(time.monotonic() - started, 1)
    if piece["name"] == "cuda_tests":
        _write_test_results(out, record, piece)
    written = [name for name in piece["writes"] if (out / name).is_file()]
    if piece["name"] == "max_size" and (out / "max-size").is_dir():
        written = [str(path.relative_to(out)) for path in sorted((out / "max-size").rglob("*.json"))]
    record["files"] = written
    if timed_out:
        record["status"], record["reason"] = "timed_out", f"ran past its limit of {limit_seconds:.0f} s"
    elif record["return_code"] != 0:
        record["status"], record["reason"] = "failed", f"exit status {record['return_code']}; see {record['log']}"
    elif len(written) < len(piece["writes"]) or (piece["name"] == "max_size" and not written):
        record["status"], record["reason"] = "failed", "exited 0 without writing its JSON"
    else:
        record["status"] = "passed"
    if record["status"] != "passed":
        record["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return record


def _write_test_results(out: Path, record: dict, piece: dict) -> None:
    """cuda-tests.json from the plugin's JSON lines (present even when pytest was killed)."""
    lines_path = out / "logs" / "cuda-tests.jsonl"
    tests = [json.loads(line) for line in lines_path.read_text().splitlines()] if lines_path.is_file() else []
    counts = {outcome: sum(test["outcome"] == outcome for test in tests)
              for outcome in ("passed", "failed", "error", "skipped")}
    result = {"provenance": dict(piece["provenance"], command=record["command"]), "counts": counts,
              "return_code": record["return_code"], "tests": tests}
    (out / "cuda-tests.json").write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results folder (default bench/results/gpu/<date>-<device>/)")
    parser.add_argument("--dry-run", action="store_true", help="every piece on CPU at tiny sizes: checks the suite")
    parser.add_argument("--time-budget", type=float, default=TIME_BUDGET_SECONDS, help="seconds for the whole suite")
    parser.add_argument("--only", action="append", default=None, metavar="PIECE", help="run only these pieces")
    parser.add_argument("--max-size-memory", default=None, help="--memory for bench_max_size (default 2GiB on CUDA, at fixed sides)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.time_budget
    environment = _environment(args.dry_run)
    device = probe(environment, args.dry_run)
    if not args.dry_run and device["device"] != "cuda":
        print("no CUDA device is visible to PyTorch here; `python bench/gpu_suite.py --dry-run` checks the suite on CPU",
              file=sys.stderr)
        return 2
    suffix = "dry-run-cpu" if args.dry_run else _slug(device["device_name"])
    out = Path(args.out) if args.out else BENCH_DIRECTORY / "results" / "gpu" / f"{date.today().isoformat()}-{suffix}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    records = []
    for piece in plan_pieces(out, device, args.dry_run, args.max_size_memory):
        if args.only and piece["name"] not in args.only:
            continue
        piece["provenance"] = device
        limit = min(DRY_RUN_PIECE_LIMIT_SECONDS if args.dry_run else PIECE_LIMIT_SECONDS[piece["name"]],
                    deadline - time.monotonic())
        if limit < MINIMUM_PIECE_SECONDS:
            piece.setdefault("skip", "the suite's time budget is spent")
        print(f"[{piece['name']}] {shlex.join(piece['command']) if piece['command'] else ''}", flush=True)
        record = run_piece(piece, out, environment, limit)
        record["highlights"] = highlights(record, out)
        print(f"[{piece['name']}] {record['status']} in {record['seconds']} s {record.get('reason', '')}", flush=True)
        records.append(record)
    suite = {"provenance": device, "dry_run": args.dry_run, "time_budget_seconds": args.time_budget,
             "seconds": round(args.time_budget - (deadline - time.monotonic()), 1), "pieces": records}
    (out / "suite.json").write_text(json.dumps(suite, indent=2) + "\n")
    write_summary(out / "summary.md", suite)
    print(f"wrote {out / 'suite.json'} and {out / 'summary.md'}")
    return 0 if all(record["status"] in ("passed", "skipped", "not_present") for record in records) else 1


if __name__ == "__main__":
    sys.exit(main())
