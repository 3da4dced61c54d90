"""Whole-volume validation during ``oomless train --data``: per-class and mean Dice, JSON, a NIfTI.

Every ``validate_every`` steps (and after the last) each held-out case is segmented whole, in eval
mode and without gradients, at the grid the network trains on; the scores are taken back to the
case's own grid (padding cropped, or resampled) and compared there with its label, so the Dice is
that of the prediction a user would open. Per case and class, Dice = 2|P n T| / (|P| + |T|) (1 when
the class is in neither); each class's score is the mean over cases, and the mean Dice is the mean
over the foreground classes (the Decathlon's way of scoring). ``RUN/validation.json`` holds every
validation so far; ``RUN/prediction-CASE.nii.gz`` is the latest segmentation of the first validation
case, written with that case's affine so it overlays the image in any NIfTI viewer.

Validation reads the weights of rank 0: under ``local-sgd``/``async`` those are that rank's own.
"""

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from oomless.data.nifti import nifti_bytes
from oomless.data.volumes import VolumeDataset
from oomless.train.checkpoint import atomic_write
from oomless.train.losses import dice_per_class, predicted_class


@torch.no_grad()
def validate_volumes(model: nn.Module, dataset: VolumeDataset, device: torch.device, class_names: tuple[str, ...],
                     step: int, prediction_dir: Path | None = None, cases: int | None = None) -> dict:
    """Segment every case of ``dataset`` (or its first ``cases``) with ``model``: {"step", "mean_dice",
    "dice": {class: score}, "cases": {case: {class: score}}, "seconds"}; writes the first case's
    prediction into ``prediction_dir``."""
    started = time.perf_counter()
    was_training = model.training
    model.eval()           # BatchNorm from its running statistics: a prediction depends on its volume alone
    try:
        per_case = {}
        for index, record in enumerate(dataset.cases[:cases]):
            volume, _ = dataset.fitted(index)
            logits = model(volume[None].to(device))[0]
            predicted = predicted_class(dataset.unfit(logits, index), dim=0)
            label = torch.from_numpy(np.array(dataset.native(index)[1], dtype=np.int64)).to(device)
            scores = dice_per_class(predicted, label, dataset.classes).tolist()
            per_case[record.name] = dict(zip(class_names[1:], scores))
            if index == 0 and prediction_dir is not None:
                _write_prediction(prediction_dir, record, predicted)
    finally:
        model.train(was_training)
    by_class = {name: float(np.mean([scores[name] for scores in per_case.values()])) for name in class_names[1:]}
    return {"step": step, "mean_dice": float(np.mean(list(by_class.values()))), "dice": by_class,
            "cases": per_case, "seconds": time.perf_counter() - started}


class _NoClass(nn.Module):
    """A stand-in network: every voxel's logits zero."""

    def __init__(self, classes: int):
        super().__init__()
        self.classes = classes

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        return volume.new_zeros((volume.shape[0], self.classes, *volume.shape[2:]))


def warm_up_validation(dataset: VolumeDataset, class_names: tuple[str, ...], device: torch.device) -> None:
    """Run validation's own code once, on the first case with a stand-in network, into a folder
    thrown away: reading a label at its native grid, scoring it, writing a NIfTI. The trainer calls
    this before it counts memory: that code's start-up is not a training step's, and once made
    after the count began, every step after the first validation held it (a 24^3 run planned at
    54.6 MiB of 64 stepped at 71.2 MiB after its validations)."""
    with tempfile.TemporaryDirectory() as directory:
        validate_volumes(_NoClass(dataset.classes), dataset, device, class_names, 0, Path(directory), cases=1)


def _write_prediction(directory: Path, record, predicted: torch.Tensor) -> Path:
    data = nifti_bytes(predicted.to(torch.uint8).cpu().numpy(), np.asarray(record.affine))
    path = Path(directory) / f"prediction-{record.name.replace('/', '__')}.nii.gz"
    return atomic_write(path, lambda temporary: Path(temporary).write_bytes(data))


class Validation:
    """When to validate, and the record of every validation of the run (``RUN/validation.json``)."""

    def __init__(self, dataset: VolumeDataset, class_names: tuple[str, ...], run_dir: Path, every: int,
                 total_steps: int, start_step: int = 0):
        self.dataset, self.class_names, self.run_dir = dataset, class_names, Path(run_dir)
        self.every, self.total_steps = every, total_steps
        self.records: list[dict] = []
        if start_step > 0:
            # A resumed run continues the file: the validations before its checkpoint stay.
            try:
                self.records = [record for record in json.loads((self.run_dir / "validation.json").read_text())
                                if record["step"] <= start_step]
            except (OSError, ValueError, KeyError, TypeError):
                self.records = []

    def due(self, steps_done: int) -> bool:
        return steps_done == self.total_steps or (self.every > 0 and steps_done % self.every == 0)

    def run(self, model: nn.Module, device: torch.device, step: int) -> dict:
        record = validate_volumes(model, self.dataset, device, self.class_names, step, self.run_dir)
        self.records.append(record)
        text = json.dumps(self.records, indent=1) + "\n"
        atomic_write(self.run_dir / "validation.json", lambda temporary: Path(temporary).write_text(text))
        return record

    @staticmethod
    def describe(record: dict) -> str:
        classes = "  ".join(f"{name} {score:.3f}" for name, score in record["dice"].items())
        return (f"validation at step {record['step']}: mean dice {record['mean_dice']:.3f}  ({classes}) "
                f"on {len(record['cases'])} whole volume(s), {record['seconds']:.1f} s")
