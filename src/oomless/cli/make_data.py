"""``oomless make-data DIR``: write a small synthetic Medical Segmentation Decathlon-style dataset.

    oomless make-data data/demo --cases 8 --size 96
    oomless train --data data/demo --steps 20

Multi-channel NIfTI images (4 MRI-like contrasts by default) with several lesion types, seeded, so
the demo and the tests train on files exactly as a downloaded Decathlon task is laid out.
"""

import argparse


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "make-data", help="write a small synthetic Decathlon-style NIfTI dataset (offline demo data)",
        description="Write DIR/dataset.json, DIR/imagesTr/*.nii.gz and DIR/labelsTr/*.nii.gz: synthetic "
                    "MRI-like volumes with ellipsoid lesions of several types, deterministic in --seed.",
    )
    parser.add_argument("directory", metavar="DIR", help="new or empty folder to write")
    parser.add_argument("--cases", type=int, default=8, help="image/label pairs (default %(default)s)")
    parser.add_argument("--size", default="96", help="volume side, or X,Y,Z (default %(default)s)")
    parser.add_argument("--channels", type=int, default=4, help="image channels, MRI contrasts (default %(default)s)")
    parser.add_argument("--classes", type=int, default=4,
                        help="label classes, background included (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from oomless.cli.train import parse_size
    from oomless.data.make_dataset import write_synthetic_dataset

    from oomless.errors import InputError
    from oomless.output_paths import check_output_path

    check_output_path(args.directory, "DIR", directory=True)
    if not 0 <= args.seed < 2**32:
        raise InputError(f"--seed must be between 0 and 2**32 - 1, got {args.seed}")
    console = Console(stderr=True)
    with Progress(console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("writing cases", total=args.cases)
        path = write_synthetic_dataset(args.directory, cases=args.cases, size=parse_size(args.size),
                                       channels=args.channels, classes=args.classes, seed=args.seed,
                                       on_case=lambda index: progress.advance(task))
    print(f"wrote {args.cases} cases to {path.parent} ({path})")
    return 0
