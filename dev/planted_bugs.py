"""Mutation testing by planted bugs: does the test suite fail when the behaviour it claims breaks?

    python dev/planted_bugs.py                 # every bug, each in a fresh copy of src/, its tests run
    python dev/planted_bugs.py --only ledger   # the bugs whose name contains "ledger"
    make mutants

Each bug is one edit of the source (a line that matters, changed the way a slip of the hand would:
a wait that never happens, an offset dropped, an average never applied), planted alone in a temporary
copy of ``src/``; the tests that should notice run against that copy. A bug is killed when they fail,
survived when they pass. The list starts with the four that issue 17 found the suite let through, and
covers the runtime, the planner, parallel and the slabs. An edit whose text is no longer in the source
is reported as stale, never as killed: the list must follow the code. Prints a table and the score,
and writes JSON (default runs/planted-bugs.json); exit status 1 when any bug survives.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class PlantedBug:
    name: str
    path: str           # under src/oomless/
    original: str       # text that must occur exactly once
    planted: str
    tests: tuple[str, ...]


BUGS = [
    PlantedBug("swapped view rebuilt at storage offset 0", "runtime/saved.py",
               "data.untyped_storage(), packed.storage_offset, packed.size, packed.stride)",
               "data.untyped_storage(), 0, packed.size, packed.stride)", ("tests/test_swap.py",)),
    PlantedBug("swapped view rebuilt contiguous (strides dropped)", "runtime/saved.py",
               "data.untyped_storage(), packed.storage_offset, packed.size, packed.stride)",
               "data.untyped_storage(), packed.storage_offset, packed.size)", ("tests/test_swap.py",)),
    PlantedBug("prefetch ignores the activation budget", "runtime/saved_entries.py",
               "if not entry.on_ledger and not engine.has_room(",
               "if False and not engine.has_room(", ("tests/test_swap.py",)),
    PlantedBug("a swap never waits for earlier copies", "runtime/saved.py",
               "while not self.has_room(num_bytes, limit) and self.pending_out:",
               "while False and self.pending_out:", ("tests/test_swap.py",)),
    PlantedBug("local SGD never averages", "parallel/relaxed.py",
               "average_parameters(iter(averaged_tensors(model)), None)",
               "pass", ("tests/test_parallel_equality.py::test_relaxed_modes_average_exactly_when_they_say",)),
    PlantedBug("async never applies the average", "parallel/relaxed.py",
               "_write_back(tensors, averaged + (current - snapshot))",
               "pass", ("tests/test_parallel_equality.py::test_relaxed_modes_average_exactly_when_they_say",)),
    PlantedBug("pipeline stage plans made but never installed", "parallel/stage_fit.py",
               "            oomless.apply(module, dataclasses.replace(plan, precision=\"fp32\"))\n",
               "            pass\n", ("tests/test_pipeline.py",)),
    PlantedBug("recompute updates BatchNorm statistics twice", "runtime/recompute_buffers.py",
               "torch.autograd.Variable._execution_engine.queue_callback(restore)",
               "pass", ("tests/test_fit_equality.py",)),
    PlantedBug("the ledger never counts a saved tensor", "runtime/ledger.py",
               "self.resident_activation_bytes += num_bytes",
               "self.resident_activation_bytes += 0", ("tests/test_ledger.py",)),
    PlantedBug("update in backward keeps every gradient", "runtime/update_in_backward.py",
               "param.grad = None       # this gradient's memory is free for the rest of backward",
               "pass", ("tests/test_update_in_backward.py",)),
    PlantedBug("the planner calls every plan fitting", "plan/planner.py",
               "fits = timeline.total_peak_bytes <= budget",
               "fits = True", ("tests/test_planner.py",)),
    PlantedBug("slab halos one row short", "runtime/slabs.py",
               "first, last = max(0, low - node.halo), min(self.depths[before], high + node.halo)",
               "first, last = max(0, low - node.halo + 1), min(self.depths[before], high + node.halo)",
               ("tests/test_split.py",)),
    PlantedBug("slabbed normalisation without its statistics' backward", "runtime/slabs.py",
               "grouped.addcmul_(values_grouped, 2 * grad_variance).add_(grad_mean - 2 * grad_variance * mean)",
               "pass", ("tests/test_split.py",)),
]


def plant(bug: PlantedBug, source: Path) -> str | None:
    """Write ``bug`` into ``source`` (a copy of src/oomless); an error message if it no longer applies."""
    path = source / bug.path
    text = path.read_text()
    if text.count(bug.original) != 1:
        return f"stale: the original text occurs {text.count(bug.original)} times in src/oomless/{bug.path}"
    path.write_text(text.replace(bug.original, bug.planted))
    return None


def copy_repository(directory: Path) -> Path:
    """The repository's files (tracked and new, not ignored) copied under ``directory``; its root.

    The whole tree, not only src/: tests that start subprocesses put ``<their own root>/src`` on
    PYTHONPATH, so with src/ copied alone those subprocesses would import the unplanted source."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    copy = directory / "repository"
    for relative in filter(None, listed):
        if (ROOT / relative).is_file():
            (copy / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, copy / relative)
    return copy


def test_environment(copy: Path) -> dict:
    """The environment under which the tests import ``copy``'s source (checked, not assumed)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy / "src"), str(copy)])}
    imported = subprocess.run([sys.executable, "-c", "import oomless; print(oomless.__file__)"], env=environment,
                              cwd=copy, capture_output=True, text=True).stdout.strip()
    if not imported.startswith(str(copy)):
        raise RuntimeError(f"the tests would import {imported}, not the copy under {copy}")
    return environment


def run_tests(copy: Path, environment: dict, tests, timeout_seconds: int) -> dict:
    """Run ``tests`` (paths or node ids) with pytest -x in ``copy``: outcome killed, survived, timeout
    or error, the summary line, and seconds."""
    started = time.perf_counter()
    try:
        completed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                                   cwd=copy, env=environment, capture_output=True, text=True,
                                   timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "detail": f"tests timed out after {timeout_seconds} s",
                "seconds": round(time.perf_counter() - started, 1)}
    tail = (completed.stdout.strip().splitlines() or ["no output"])[-1]
    # Exit status 1: tests failed; anything else but 0 (collection error, usage) is not a kill.
    outcome = {0: "survived", 1: "killed"}.get(completed.returncode, "error")
    return {"outcome": outcome, "detail": tail, "seconds": round(time.perf_counter() - started, 1)}


def run_bug(bug: PlantedBug, timeout_seconds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="planted-") as directory:
        copy = copy_repository(Path(directory))
        stale = plant(bug, copy / "src" / "oomless")
        if stale:
            return {"bug": bug.name, "outcome": "stale", "detail": stale}
        try:
            environment = test_environment(copy)
        except RuntimeError as error:
            return {"bug": bug.name, "outcome": "error", "detail": str(error)}
        result = run_tests(copy, environment, bug.tests, timeout_seconds)
        if result["outcome"] == "timeout":        # a bug that hangs the tests is noticed
            result["outcome"] = "killed"
        return {"bug": bug.name, **result, "tests": list(bug.tests)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="run the bugs whose name contains this")
    parser.add_argument("--out", default=str(ROOT / "runs" / "planted-bugs.json"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per bug's tests")
    args = parser.parse_args()
    bugs = [bug for bug in BUGS if args.only is None or args.only in bug.name]
    results = []
    for bug in bugs:
        result = run_bug(bug, args.timeout)
        results.append(result)
        print(f"{result['outcome']:9s} {bug.name}: {result['detail']}", flush=True)
    killed = sum(result["outcome"] == "killed" for result in results)
    print(f"score: {killed} of {len(results)} planted bugs killed")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"killed": killed, "planted": len(results), "results": results}, indent=2))
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
