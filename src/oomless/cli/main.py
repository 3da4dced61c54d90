"""The ``oomless`` command: one entry point, each subcommand in its own module.

    oomless train --size 48 --memory 1GiB --steps 20 --seed 0
    oomless plan unet3d --input-shape 1,1,64,64,64 --memory 2GiB
    oomless simulate transformer --input-shape 1,128 --global-batch 64 --target h100 --gpus 16 --nodes 2
    oomless make-data data/demo --cases 8 --size 96
    python -m oomless --help

Errors oomless raises on purpose (bad sizes, unknown models, budgets no plan fits) print one line
and exit with status 2, like argparse's own usage errors; anything else is a bug and keeps its traceback.
Under torchrun every rank parses the same flags: a bad one is reported by rank 0 alone.
"""

import argparse
import os
import re
import sys
import time

from oomless.errors import InputError, OomlessError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on an error; one line with a pointer to --help reads better."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from oomless.cli import bench, make_data, plan, simulate, train

    parser = OneLineErrorParser(
        prog="oomless",
        description="Train PyTorch models larger than GPU memory: swap, recompute and plan activations for a budget.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    subcommands.required = True
    for module in (train, make_data, plan, simulate, bench):
        module.add_parser(subcommands)
    return parser


# "-1GiB" after a flag: argparse takes any token starting with "-" for an option unless it is a plain
# negative number, and would report "--memory: expected one argument" instead of a bad size.
_NEGATIVE_VALUE = re.compile(r"^-[0-9.]")
# An error every rank meets alike (flags, sizes, files) waits this long on ranks other than 0 before
# it is printed: torchrun stops them when rank 0 exits, so the run prints it once, not once per rank.
# Long, as waiting costs nothing when rank 0 fails too (torchrun ends the wait): on a loaded machine
# rank 0 reached its error more than 5 s after rank 1, which then printed it a second time.
_OTHER_RANKS_WAIT_SECONDS = 30.0


def attach_negative_values(argv: list[str]) -> list[str]:
    """``["--memory", "-1GiB"]`` -> ``["--memory=-1GiB"]``, so the value reaches the size check."""
    attached: list[str] = []
    for token in argv:
        previous = attached[-1] if attached else ""
        if _NEGATIVE_VALUE.match(token) and previous.startswith("--") and "=" not in previous:
            attached[-1] = f"{previous}={token}"
        else:
            attached.append(token)
    return attached


def report(command: str, error: OomlessError) -> None:
    """Print ``error`` in one line; under torchrun, say an error every rank shares from rank 0 only."""
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank and isinstance(error, InputError):
        time.sleep(_OTHER_RANKS_WAIT_SECONDS)        # usually ended here by torchrun once rank 0 exits
    prefix = f"rank {rank}: " if rank else ""
    print(f"oomless {command}: error: {prefix}{error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else list(argv)))
    try:
        return args.run(args)
    except OomlessError as error:
        report(args.command, error)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"oomless {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`oomless plan ... --json | head`): not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
