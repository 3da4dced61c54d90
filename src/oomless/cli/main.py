"""The ``oomless`` command: one entry point, each subcommand in its own module.

    oomless train --size 48 --memory 1GiB --steps 20 --seed 0
    oomless plan unet3d --input-shape 1,1,64,64,64 --memory 2GiB
    oomless make-data data/demo --cases 8 --size 96
    python -m oomless --help

Errors oomless raises on purpose (bad sizes, unknown models, budgets no plan fits) print one line
and exit with status 2, like argparse's own usage errors; anything else is a bug and keeps its traceback.
"""

import argparse
import sys

from oomless.errors import OomlessError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on an error; one line with a pointer to --help reads better."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from oomless.cli import bench, make_data, plan, train

    parser = OneLineErrorParser(
        prog="oomless",
        description="Train PyTorch models larger than GPU memory: swap, recompute and plan activations for a budget.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    subcommands.required = True
    for module in (train, make_data, plan, bench):
        module.add_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except OomlessError as error:
        print(f"oomless {args.command}: error: {error}", file=sys.stderr)
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
