"""``oomless bench``: run bench/bench_fit.py, the side-by-side step-time and memory benchmark.

    oomless bench --device cuda --model all --steps 10
    oomless bench --quick --out /tmp/bench.json
    oomless bench --device cpu --out bench/results       # a result to commit

The benchmark is a program in the repository (bench/, next to its committed results), not part of
the installed package: this subcommand loads it from the source checkout oomless was installed from
(pip install -e .). Its flags live here so that both entry points take the same ones.
"""

import argparse
import importlib.util
import shlex
import sys
from pathlib import Path

from oomless.errors import InputError, OomlessError

BENCH_PROGRAM = Path(__file__).resolve().parents[3] / "bench" / "bench_fit.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto (default %(default)s)")
    parser.add_argument("--model", choices=("transformer", "unet3d", "gpt2", "all"), default="all",
                        help="all: transformer and unet3d; gpt2 (Hugging Face's, needs transformers) on its own")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per variant (default 7 CPU, 10 CUDA)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured warm-up steps per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 steps: checks the program, not speed")
    parser.add_argument("--precision", choices=("bf16", "fp16"), default=None,
                        help="add plain/keep/plan_50 variants under autocast in this dtype (same budget as fp32's)")
    parser.add_argument("--compile", action="store_true",
                        help="add plain/keep/plan_50 variants with every block torch.compile'd (slow to compile on CPU)")
    parser.add_argument("--out", default=None, metavar="FOLDER|FILE.json",
                        help="where the JSON goes (default runs/bench/fit-<device>-<date>.json; results to commit: "
                             "--out bench/results)")


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "bench", help="time oomless against plain PyTorch, checkpointing and save_on_cpu; write JSON",
        description="Step time and peak memory of plain PyTorch, oomless (all-keep and planned budgets), "
                    "torch.utils.checkpoint on every block and save_on_cpu, side by side in one run.",
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


def load_benchmark():
    if not BENCH_PROGRAM.is_file():
        raise OomlessError(f"the benchmark program is not at {BENCH_PROGRAM}: 'oomless bench' runs from a source "
                           "checkout (git clone, then pip install -e .), not from an installed wheel")
    spec = importlib.util.spec_from_file_location("oomless_bench_fit", BENCH_PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise InputError(f"--steps must be at least 1, got {args.steps}")
    load_benchmark().run(args, command=shlex.join(sys.argv))
    return 0
