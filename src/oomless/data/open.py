"""From ``--data DIR`` (and ``--stage``) to checked, split, network-ready datasets, before step 0.

    data, config = open_training_data(config, console, ranks)
    data.train.batch(0, 2); data.validation          # VolumeDatasets (or SyntheticVolumes without --data)

Order: find the layout; stage it (copy and verify, on each node's first process only, the others
wait); read and check every case (decoding into the stage's .npy cache); choose the grid; split the
cases into train and validation by the seed and write the split next to the run. The returned
config has ``size``, ``channels`` and ``classes`` set from the dataset.
"""

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TransferSpeedColumn)

from oomless.data.layout import find_dataset
from oomless.data.prepare import PreparedDataset, prepare_dataset
from oomless.data.stage import completed_stage, files_of, stage_dataset
from oomless.data.synthetic import SyntheticVolumes
from oomless.data.volumes import VolumeDataset
from oomless.errors import InputError
from oomless.train.checkpoint import atomic_write

_SPLIT_STREAM = 3      # seed stream of the train/validation split (volumes.py uses 1 and 2)


@dataclass
class TrainingData:
    """What the loop trains and validates on; ``prepared`` and ``validation`` only with files."""

    train: VolumeDataset | SyntheticVolumes
    validation: VolumeDataset | None = None
    prepared: PreparedDataset | None = None
    workers: int = 0
    run_dir: Path | None = None

    @property
    def items_per_epoch(self) -> int | None:
        return len(self.train.cases) if isinstance(self.train, VolumeDataset) else None


def open_training_data(config, console: Console, ranks):
    """(TrainingData, config with the dataset's size, channels and classes) for a ``TrainConfig``."""
    if config.data is None:
        return TrainingData(SyntheticVolumes(config.shape, seed=config.seed, channels=config.channels,
                                             classes=config.classes)), config
    data = config.data
    layout = find_dataset(data.path)
    # Each node's first process stages and decodes; the others wait, then find it all done.
    leads_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    for turn in ("lead", "others"):
        if (turn == "lead") == leads_node:
            prepared = _prepare(layout, data, console, may_write=leads_node)
        if ranks.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
    multiple = 2**config.depth
    resample = data.shape is not None
    shape = tuple(data.shape) if resample else tuple(
        math.ceil(max(case.shape[axis] for case in prepared.cases) / multiple) * multiple for axis in range(3))
    train_cases, validation_cases = split_cases(prepared, config.seed, data.validation_fraction)
    run_dir = data.output_dir
    if ranks.is_first:
        _write_split(run_dir / "split.json", prepared, config.seed, train_cases, validation_cases)
    console.print(f"data: {len(prepared.cases)} cases of {layout.root} ({prepared.channels} channel(s): "
                  f"{', '.join(layout.modalities or ('unnamed',))}; {prepared.classes} classes), "
                  f"{len(train_cases)} train / {len(validation_cases)} validation, "
                  f"{'resampled' if resample else 'padded'} to {'x'.join(map(str, shape))}; run folder {run_dir}",
                  soft_wrap=True)
    train_set = VolumeDataset(train_cases, shape, prepared.classes, config.seed, data.augment, resample)
    validation_set = (VolumeDataset(validation_cases, shape, prepared.classes, config.seed, False, resample)
                      if validation_cases else None)
    resolved = dataclasses.replace(config, size=shape, channels=prepared.channels, classes=prepared.classes)
    return TrainingData(train_set, validation_set, prepared, data.workers, run_dir), resolved.validate()


def split_cases(prepared: PreparedDataset, seed: int, validation_fraction: float):
    """(train cases, validation cases): a seeded permutation; at least one of each when there are two."""
    cases = prepared.cases
    count = round(len(cases) * validation_fraction)
    if validation_fraction > 0 and len(cases) >= 2:
        count = min(max(count, 1), len(cases) - 1)
    order = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_STREAM])).permutation(len(cases))
    held_out = set(order[:count].tolist())
    return ([case for index, case in enumerate(cases) if index not in held_out],
            [case for index, case in enumerate(cases) if index in held_out])


def _prepare(layout, data, console: Console, may_write: bool) -> PreparedDataset:
    cache_dir, source_ids = None, None
    if data.stage is not None:
        report = _staged(layout, data, console) if may_write else completed_stage(data.stage)
        if report is None:
            raise InputError(f"--stage {data.stage}: this node's first process (LOCAL_RANK 0) did not finish staging")
        layout = report.layout
        cache_dir = Path(data.stage) / "cache"
        # A cached decode is reused only if made from files with these very checksums.
        source_ids = {case.name: report.checksums[layout.relative(case.image)] + ":" +
                      report.checksums[layout.relative(case.label)] for case in layout.cases}
    with _progress(console, MofNCompleteColumn()) as progress:
        task = progress.add_task("reading and checking cases", total=len(layout.cases))
        return prepare_dataset(layout, cache_dir, source_ids, on_case=lambda case: progress.advance(task))


def _staged(layout, data, console: Console):
    total_bytes = sum(path.stat().st_size for path in files_of(layout))
    with _progress(console, DownloadColumn(), TransferSpeedColumn()) as progress:
        # Verifying a finished file reads it once, as copying does: the bar counts both.
        task = progress.add_task(f"staging to {data.stage}", total=total_bytes)
        report = stage_dataset(layout, data.stage, on_bytes=lambda count: progress.advance(task, count))
    console.print(f"staged {layout.root} -> {data.stage}: {len(report.copied)} file(s) copied "
                  f"({report.copied_bytes / 2**20:.1f} MiB), {len(report.verified)} verified by checksum and kept",
                  soft_wrap=True)
    return report


def _progress(console: Console, *columns) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), *columns, TimeElapsedColumn(),
                    console=console, disable=not console.is_terminal)


def _write_split(path: Path, prepared: PreparedDataset, seed: int, train_cases, validation_cases) -> None:
    split = {"seed": seed, "dataset": str(prepared.layout.root),
             "train": [case.name for case in train_cases],
             "validation": [case.name for case in validation_cases]}
    if path.is_file():
        try:
            before = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            before = None
        if before is not None and (before.get("train"), before.get("validation")) != (split["train"], split["validation"]):
            raise InputError(f"{path} holds another train/validation split (other seed, fraction or cases); "
                             f"give this run its own --run-dir or remove the file")
    text = json.dumps(split, indent=1) + "\n"
    atomic_write(path, lambda temporary: Path(temporary).write_text(text))
