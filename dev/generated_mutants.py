"""Mutation testing by generated mutants: a seeded sample of mechanical one-token edits of the runtime,
planner and parallel modules, each run against the tests that exercise its module.

    python dev/generated_mutants.py                          # the sample (seed 17, 100 mutants)
    python dev/generated_mutants.py --list                   # print the sample, run nothing
    python dev/generated_mutants.py --only plan/solvers.py   # that module's share of the same sample
    python dev/generated_mutants.py --mutant 'saved.py:141'  # the sampled mutants whose id contains this
    make mutants-generated

Where dev/planted_bugs.py plants bugs a person chose, this script makes every edit of a few kinds
that ``ast`` finds in the target modules (``TESTS``' keys), then draws a sample, stratified by module
in proportion to the module's number of edits and seeded, so that a run is reproducible. The kinds:
comparison swapped (< and <=, > and >=, == and !=, is and is not, in and not in), arithmetic swapped
(+ and -, * and /, // to *, also in augmented assignments), ``and`` and ``or`` swapped, ``not``
removed, an integer constant n made n + 1 and 0 (-1 when n is 0), ``return X`` made ``return None``, a
statement call (``.wait()``, ``.record()``, ``x.append(y)``) or a ``del`` deleted, an ``if``
condition made ``True`` and ``False``.

Left out, so that the sample measures the tests of behaviour: ``raise`` and ``assert`` statements and
an ``if`` whose body only raises (argument validation: tests/test_bad_input.py and test_errors.py
check their messages, not this script); f-strings and every call to print, warnings.warn and logging
(message text); ``__repr__`` and ``__str__``; docstrings (no edit applies to a string); annotations;
decorators; parameter defaults and class-level field defaults (configuration values, not logic);
``if TYPE_CHECKING`` and code that runs only on CUDA (``CUDA_ONLY``, and the body of an ``if`` whose
condition names cuda): this machine has no GPU, tests/test_cuda.py and ``make gpu`` cover it.

Each mutant is written into one copy of the repository (dev/planted_bugs.py's ``copy_repository``:
the whole tree, so that tests starting subprocesses import the mutant too), its module's compiled
file removed, and ``TESTS[module]`` run with pytest -x (fast files first) under ``--timeout``
seconds. Outcomes: killed (a test failed), timeout (killed by the time limit, counted apart),
survived, invalid (does not compile, or the tests cannot import it: no kill), equivalent (listed in
``EQUIVALENT`` with the reason it changes nothing observable; not run, not counted). Score: killed
and timeouts over the sample less equivalent and invalid mutants. Results go to ``--out`` (default
bench/results/generated-mutants.json) after every mutant; a run of a subset (``--only``,
``--mutant``) replaces those mutants' entries in the file and keeps the others.
"""

import argparse
import ast
import copy
import datetime
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from planted_bugs import ROOT, copy_repository, run_tests, test_environment

# Module (under src/oomless/) -> the tests that exercise it, fastest first (pytest -x stops at the
# first failure, so a mutant the fast tests notice costs seconds). The slow inductor test of
# test_compile.py is left out: alone it takes minutes.
# The in-process tests of a test file whose other tests train under gloo in several processes (a
# minute or more each under load): the traced graphs and block sequences are built in-process.
_TRACED_IN_PROCESS = tuple(f"tests/test_traced_pipeline.py::{name}" for name in (
    "test_what_cannot_be_traced_says_why_and_what_works", "test_sequence_for_prefers_the_hand_written_cuts",
    "test_an_in_place_write_stays_in_the_block_that_made_the_tensor",
    "test_what_is_computed_from_sizes_alone_is_computed_again_in_each_block_never_sent",
    "test_candidate_blocks_keep_repeated_layers_whole", "test_rebuilt_blocks_call_the_modules_the_model_has_now",
    "test_project_models_with_code_between_modules_trace_exactly",
    "test_a_sequence_refuses_the_mode_it_was_not_traced_in_and_eval_traces_work",
    "test_gpt2_traced_equals_the_model_with_dropout_and_tied_weights",
    "test_monai_unet_traced_equals_the_model_and_moves_its_batchnorm_statistics"))
_PIPELINE_IN_PROCESS = ("tests/test_pipeline.py::test_a_cut_across_skips_carries_every_live_tensor",
                        "tests/test_pipeline.py::test_cuts_from_a_partition_must_follow_the_sequence")

TESTS: dict[str, tuple[str, ...]] = {
    "runtime/compile.py": ("tests/test_compile.py::test_remove_uncompiles_only_what_oomless_compiled",
                           "tests/test_compile.py::test_combinations_that_do_not_compose_are_refused",
                           "tests/test_compile.py::test_a_torch_nn_block_without_plan_hooks_is_really_compiled",
                           "tests/test_compile.py::test_every_plan_on_compiled_blocks_equals_plain_compiled"),
    "runtime/install.py": ("tests/test_swap.py", "tests/test_fit_equality.py"),
    "runtime/ledger.py": ("tests/test_ledger.py", "tests/test_swap.py"),
    "runtime/offload_parameters.py": ("tests/test_offload_parameters.py",),
    "runtime/offload_state.py": ("tests/test_offload_state.py",),
    "runtime/optimizer_slices.py": ("tests/test_optimizer_slices.py",),
    "runtime/pinned_pool.py": ("tests/test_pinned_pool.py",),
    "runtime/precision.py": ("tests/test_precision.py::test_fp16_equals_grad_scaler", "tests/test_precision.py"),
    "runtime/recompute.py": ("tests/test_swap.py", "tests/test_fit_equality.py"),
    "runtime/saved.py": ("tests/test_swap.py", "tests/test_ledger.py", "tests/test_fit_equality.py"),
    "runtime/slabs.py": ("tests/test_split.py::test_on_cpu_a_slab_after_an_upsampling_is_as_thick_as_onednn_needs_"
                         "in_the_upsampled_shape", "tests/test_split.py", "tests/test_stream.py"),
    "runtime/split.py": ("tests/test_split.py",),
    "runtime/stream.py": ("tests/test_stream.py",),
    "runtime/tiers.py": ("tests/test_swap.py", "tests/test_fit_equality.py"),
    "runtime/update_in_backward.py": ("tests/test_offload_state.py::test_after_a_step_in_backward_the_first_state_of_"
                                      "the_next_step_is_on_its_way_in", "tests/test_update_in_backward.py",
                                      "tests/test_offload_state.py"),
    "plan/planner.py": ("tests/test_planner.py", "tests/test_solvers.py", "tests/test_static_plan.py"),
    "plan/solvers.py": ("tests/test_solvers.py", "tests/test_planner.py"),
    "plan/simulate.py": ("tests/test_planner.py", "tests/test_solvers.py", "tests/test_ledger.py",
                         "tests/test_saved_lifetime.py"),
    "parallel/batchnorm.py": ("tests/test_parallel_equality.py::test_global_batchnorm_profiled_alone_runs_its_own_ops_"
                              "without_collectives", "tests/test_pipeline.py"),
    "parallel/block_sequence.py": ("tests/test_simulate_terms.py", *_PIPELINE_IN_PROCESS, *_TRACED_IN_PROCESS,
                                   "tests/test_pipeline.py"),
    "parallel/config.py": ("tests/test_pipeline_training.py", "tests/test_bad_input.py"),
    "parallel/data_parallel.py": ("tests/test_parallel_equality.py",),
    "parallel/overlap.py": ("tests/test_optimizer_slices.py", "tests/test_parallel_equality.py"),
    "parallel/pipeline.py": ("tests/test_pipeline.py", "tests/test_pipeline_training.py"),
    "parallel/pipeline_training.py": ("tests/test_pipeline_training.py",),
    "parallel/process_group.py": ("tests/test_collectives.py", "tests/test_parallel_equality.py",
                                  "tests/test_parallel_faults.py"),
    "parallel/rank_state.py": ("tests/test_checkpoint_faults.py",),
    "parallel/relaxed.py": ("tests/test_parallel_equality.py::test_relaxed_modes_average_exactly_when_they_say",
                            "tests/test_parallel_equality.py::test_relaxed_modes_reach_the_synchronous_loss"),
    "parallel/sharded.py": ("tests/test_fsdp.py",),
    "parallel/stage_fit.py": ("tests/test_pipeline.py", "tests/test_bad_input.py"),
    "parallel/traced.py": _TRACED_IN_PROCESS,
    "parallel/traced_graph.py": _TRACED_IN_PROCESS,
}

# Functions and classes (qualified names) that run only with CUDA.
CUDA_ONLY: dict[str, set[str]] = {
    "runtime/tiers.py": {"dedicated_copy_streams", "_driver_stream", "_CudaTicket", "PinnedHostTier"},
    "runtime/pinned_pool.py": {"allocate_pinned"},
    "runtime/precision.py": {"_cuda_has_bf16"},
}

# Mutant id -> why the edit changes nothing a caller can observe. Read from survivors, one by one.
EQUIVALENT: dict[str, str] = {
    "parallel/pipeline_training.py::_broadcast::and/or::tensor.device == device or device.type == \"cpu\" -> "
    "(tensor.device == device and device.type == 'cpu')":
        "differs only where the communication device is not the CPU and the tensor is on it already: the "
        "mutant then broadcasts a same-device copy and copies it back, the same values by one more copy",
    "parallel/relaxed.py::AsynchronousAveraging.step::if False::self.ranks.world_size == 1 -> False":
        "alone (a group of one) the mutant starts an average of one: averaged = snapshot / 1 = snapshot, and "
        "snapshot + (current - snapshot) is current exactly whenever a step changes a value by less than a "
        "factor of two (Sterbenz: the difference is exact): a world-of-one run of three steps in mode async "
        "was bitwise the plain run under the mutant (checked by hand). Only a collective's time is added",
    "runtime/optimizer_slices.py::OptimizerSlice.step::if True::self.optimizer is not None -> True":
        "unreachable: the one caller that can hold a slice without an optimizer (overlap.BucketUpdate.run) "
        "checks slice.optimizer first; update_in_backward makes slices only of parameters the optimizer "
        "holds. tests/test_optimizer_slices.py's head-only fine-tuning runs such buckets",
    "runtime/saved.py::SavedTensorEngine.pack::return None::return tensor -> return None":
        "unreachable: pack runs only inside the saved_tensors_hooks the model's forward pre-hook enters "
        "after begin_forward has made the registry (never reset to None), and autograd packs only tensors",
    "parallel/sharded.py::ShardedDataParallel.prepare::if True::plan is not None -> True":
        "check_sharded_plan(None) refuses nothing: getattr(None, name, False) is False for each of the "
        "three placements it checks",
    "parallel/stage_fit.py::_replica_zero_plan::constant::0 -> (1)":
        "the replicas of a stage broadcast replica 1's plan in place of replica 0's: every replica still "
        "installs one and the same plan (the function returns early for a group of one, so replica 1 "
        "exists), each replica's plan is for the same stage on a shard of the same shape, and a plan "
        "changes no value, only where the saved tensors live",
}

_COMPARE_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITHMETIC_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}
_MESSAGE_CALLS = {"print", "warn", "debug", "info", "warning", "error", "exception", "log"}


@dataclass
class Mutant:
    id: str             # module::scope::kind::original -> mutated (#n when repeated): stable while the code is
    module: str         # under src/oomless/
    line: int
    kind: str
    start: int          # character offsets of the replaced text in the module's source
    end: int
    replacement: str

    def apply(self, source: str) -> str:
        return source[:self.start] + self.replacement + source[self.end:]


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= 60 else line[:57] + "..."


def _called_name(call: ast.Call) -> str:
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def _only_raises(body: list[ast.stmt]) -> bool:
    return isinstance(body[-1], ast.Raise) and all(
        isinstance(statement, (ast.Raise, ast.Assign)) or
        (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
         and _called_name(statement.value) in _MESSAGE_CALLS) for statement in body)


class _Sites(ast.NodeVisitor):
    """Every mutant of one module's source, in source order."""

    def __init__(self, module: str, source: str):
        self.module, self.source = module, source
        self.line_starts = [0]
        for line in source.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.scope: list[str] = []
        self.mutants: list[Mutant] = []
        self.seen: dict[str, int] = {}

    def _offset(self, line: int, column_bytes: int) -> int:
        start = self.line_starts[line - 1]
        text = self.source[start:self.line_starts[line]]
        return start + len(text.encode()[:column_bytes].decode())

    def add(self, node: ast.AST, kind: str, replacement: str) -> None:
        start = self._offset(node.lineno, node.col_offset)
        end = self._offset(node.end_lineno, node.end_col_offset)
        original = self.source[start:end]
        scope = ".".join(self.scope) or "<module>"
        key = f"{self.module}::{scope}::{kind}::{_first_line(original)} -> {_first_line(replacement)}"
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] > 1:
            key += f" #{self.seen[key]}"
        self.mutants.append(Mutant(key, self.module, node.lineno, kind, start, end, replacement))

    def add_expression(self, node: ast.expr, kind: str, mutated: ast.expr) -> None:
        self.add(node, kind, "(" + ast.unparse(mutated) + ")")    # parentheses keep the precedence

    # Left out entirely (see the module docstring).
    def visit_Raise(self, node): pass
    def visit_Assert(self, node): pass
    def visit_JoinedStr(self, node): pass

    def visit_Call(self, node: ast.Call) -> None:
        if _called_name(node) not in _MESSAGE_CALLS:
            self.generic_visit(node)

    def _visit_scope(self, node, body_fields) -> None:
        self.scope.append(node.name)
        if node.name not in ("__repr__", "__str__") and ".".join(self.scope) not in CUDA_ONLY.get(self.module, ()):
            for field in body_fields:
                for statement in getattr(node, field):
                    self.visit(statement)
        self.scope.pop()

    def visit_FunctionDef(self, node): self._visit_scope(node, ("body",))
    def visit_AsyncFunctionDef(self, node): self._visit_scope(node, ("body",))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        if ".".join(self.scope) not in CUDA_ONLY.get(self.module, ()):
            for statement in node.body:
                if not isinstance(statement, ast.AnnAssign):      # field defaults
                    self.visit(statement)
        self.scope.pop()

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_If(self, node: ast.If) -> None:
        condition = ast.unparse(node.test)
        if _only_raises(node.body) or "TYPE_CHECKING" in condition or "__name__" in condition:
            pass
        elif "cuda" in condition:
            pass
        else:
            self.add(node.test, "if True", "True")
            self.add(node.test, "if False", "False")
            self.visit(node.test)
            for statement in node.body:
                self.visit(statement)
        for statement in node.orelse:
            self.visit(statement)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Call) and _called_name(node.value) not in _MESSAGE_CALLS:
            self.add(node, "statement deleted", "pass")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self.add(node, "statement deleted", "pass")

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self.add(node, "return None", "return None")
            self.visit(node.value)

    def visit_Compare(self, node: ast.Compare) -> None:
        for index, operator in enumerate(node.ops):
            if type(operator) in _COMPARE_SWAP:
                mutated = copy.deepcopy(node)
                mutated.ops[index] = _COMPARE_SWAP[type(operator)]()
                self.add_expression(node, "comparison", mutated)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if type(node.op) in _ARITHMETIC_SWAP:
            mutated = copy.deepcopy(node)
            mutated.op = _ARITHMETIC_SWAP[type(node.op)]()
            self.add_expression(node, "arithmetic", mutated)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if type(node.op) in _ARITHMETIC_SWAP:
            mutated = copy.deepcopy(node)
            mutated.op = _ARITHMETIC_SWAP[type(node.op)]()
            self.add(node, "arithmetic", ast.unparse(mutated))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        mutated = copy.deepcopy(node)
        mutated.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.add_expression(node, "and/or", mutated)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self.add_expression(node, "not removed", node.operand)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if type(node.value) is int:
            self.add(node, "constant", f"({node.value + 1})")
            self.add(node, "constant", "(0)" if node.value != 0 else "(-1)")

    # Parameter defaults, annotations and decorators are not visited: _visit_scope visits bodies only.
    def visit_arguments(self, node): pass


def generate(module: str) -> list[Mutant]:
    source = (ROOT / "src" / "oomless" / module).read_text()
    sites = _Sites(module, source)
    sites.visit(ast.parse(source))
    return sites.mutants


def sample(seed: int, count: int) -> list[Mutant]:
    """``count`` mutants over ``TESTS``' modules, each module's share in proportion to its number of
    mutants (largest remainders, at least one), drawn with a generator seeded by seed and module."""
    everything = {module: generate(module) for module in TESTS}
    total = sum(map(len, everything.values()))
    exact = {module: count * len(mutants) / total for module, mutants in everything.items()}
    shares = {module: max(1, int(value)) for module, value in exact.items()}
    for module in sorted(exact, key=lambda module: int(exact[module]) - exact[module]):
        if sum(shares.values()) >= count:
            break
        shares[module] += 1
    chosen = []
    for module, mutants in everything.items():
        drawn = random.Random(f"{seed}:{module}").sample(range(len(mutants)), min(shares[module], len(mutants)))
        chosen.extend(mutants[index] for index in sorted(drawn))
    return chosen


def run_mutant(mutant: Mutant, copy: Path, environment: dict, timeout_seconds: int) -> dict:
    path = copy / "src" / "oomless" / mutant.module
    original = path.read_text()
    mutated = mutant.apply(original)
    base = {"id": mutant.id, "line": mutant.line, "kind": mutant.kind}
    try:
        compile(mutated, str(path), "exec")
    except SyntaxError as error:
        return {**base, "outcome": "invalid", "detail": f"does not compile: {error}"}

    def forget_compiled():
        # A mutant of the same length written within the same second would pass the compiled file's
        # (mtime, size) check, and the tests would run the previous mutant.
        for compiled in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
            compiled.unlink()

    try:
        path.write_text(mutated)
        forget_compiled()
        result = run_tests(copy, environment, TESTS[mutant.module], timeout_seconds)
    finally:
        path.write_text(original)
        forget_compiled()
    if result["outcome"] == "error":
        result["outcome"] = "invalid"
    return {**base, **result}


def score(results: list[dict]) -> dict:
    counted = [result for result in results if result["outcome"] not in ("equivalent", "invalid")]
    killed = sum(result["outcome"] == "killed" for result in counted)
    timeouts = sum(result["outcome"] == "timeout" for result in counted)
    return {"generated": len(results), "equivalent": sum(result["outcome"] == "equivalent" for result in results),
            "invalid": sum(result["outcome"] == "invalid" for result in results), "counted": len(counted),
            "killed": killed, "killed_by_timeout": timeouts,
            "survived": sum(result["outcome"] == "survived" for result in counted),
            "score": round((killed + timeouts) / len(counted), 4) if counted else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--count", type=int, default=100, help="mutants in the sample")
    parser.add_argument("--only", default=None, help="run the sampled mutants of this module (e.g. plan/solvers.py)")
    parser.add_argument("--mutant", default=None, help="run the sampled mutants whose id contains this")
    parser.add_argument("--list", action="store_true", help="print the sample and run nothing")
    parser.add_argument("--survivors", action="store_true", help="run the mutants --out records as survived")
    parser.add_argument("--resume", action="store_true", help="run only the mutants --out has no result for")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per mutant's tests")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "generated-mutants.json"))
    args = parser.parse_args()
    chosen = sample(args.seed, args.count)
    selected = [mutant for mutant in chosen if (args.only is None or mutant.module == args.only)
                and (args.mutant is None or args.mutant in f"{mutant.id} {mutant.module}:{mutant.line}")]
    # Run in a seeded shuffle of the sample, so that a run cut short has sampled every module alike.
    random.Random(args.seed).shuffle(selected)
    if args.list:
        for mutant in selected:
            print(f"{mutant.module}:{mutant.line}  {mutant.id.split('::', 2)[2]}")
        print(f"{len(selected)} of {len(chosen)} sampled mutants")
        return 0
    out = Path(args.out)
    previous = {}
    if out.exists():
        saved = json.loads(out.read_text())
        if (saved.get("seed"), saved.get("count")) == (args.seed, args.count):
            previous = {result["id"]: result for result in saved["results"]}
    if args.survivors:
        selected = [mutant for mutant in selected if previous.get(mutant.id, {}).get("outcome") == "survived"]
    if args.resume:
        selected = [mutant for mutant in selected if mutant.id not in previous]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutants-") as directory:
        copy = copy_repository(Path(directory))
        environment = test_environment(copy)
        for number, mutant in enumerate(selected, 1):
            if mutant.id in EQUIVALENT:
                result = {"id": mutant.id, "line": mutant.line, "kind": mutant.kind, "outcome": "equivalent",
                          "detail": EQUIVALENT[mutant.id]}
            else:
                result = run_mutant(mutant, copy, environment, args.timeout)
            previous[mutant.id] = result
            print(f"[{number}/{len(selected)}] {result['outcome']:10s} {mutant.module}:{mutant.line} "
                  f"{mutant.id.split('::', 2)[2]}  ({result.get('seconds', 0)} s) {result['detail']}", flush=True)
            results = [previous[each.id] for each in chosen if each.id in previous]
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({
                "seed": args.seed, "count": args.count, "commit": commit, "date": datetime.date.today().isoformat(),
                "machine": f"{platform.machine()} {platform.node()}, Python {platform.python_version()}",
                "timeout_seconds": args.timeout, "score": score(results),
                "modules": {module: TESTS[module] for module in TESTS}, "results": results}, indent=1) + "\n")
    summary = score([previous[each.id] for each in chosen if each.id in previous])
    print(f"score: {summary['killed']} killed + {summary['killed_by_timeout']} by timeout of {summary['counted']} "
          f"counted ({summary['equivalent']} equivalent, {summary['invalid']} invalid, {summary['survived']} "
          f"survived); this run {time.perf_counter() - started:.0f} s")
    return 0 if summary["survived"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
