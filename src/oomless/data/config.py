"""The typed configuration of training on files (``oomless train --data DIR``); see ``oomless.data.open``."""

from dataclasses import dataclass
from pathlib import Path

from oomless.errors import InputError


@dataclass
class DataConfig:
    """Where the volumes are and how they reach the network.

    ``path``: a Medical Segmentation Decathlon task folder or a folder of NAME_image/NAME_label pairs.
    ``stage``: a local folder to copy the dataset into once and decode to .npy there (resumable).
    ``shape``: resample every case onto this (D, H, W) grid; None pads each case up to the largest
    case rounded up to the network's multiple (no interpolation).
    ``workers``: loader processes preparing the next batches while a step runs (0: in the main process).
    ``validation_fraction`` of the cases (at least one) are held out, chosen by the run's seed;
    ``validate_every`` N steps (and after the last) they are segmented whole and scored by Dice.
    ``run_dir``: where the split, validation scores and a predicted segmentation are written
    (default ``runs/<dataset folder name>``).
    """

    path: Path | str
    stage: Path | str | None = None
    shape: tuple[int, int, int] | None = None
    workers: int = 2
    validation_fraction: float = 0.2
    validate_every: int = 0                 # 0: only after the last step
    augment: bool = True
    run_dir: Path | str | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir is not None else Path("runs") / Path(self.path).resolve().name

    def validate(self, multiple: int) -> "DataConfig":
        if self.shape is not None and (len(self.shape) != 3 or any(side <= 0 or side % multiple for side in self.shape)):
            raise InputError(f"with --data, --size {self.shape} resamples every case and must be positive and "
                             f"divisible by 2**depth = {multiple}; omit it to pad each case to the largest instead")
        if self.workers < 0:
            raise InputError(f"workers must be 0 or more, got {self.workers}")
        if not 0 <= self.validation_fraction < 1:
            raise InputError(f"validation fraction must be in [0, 1), got {self.validation_fraction}")
        if self.validate_every < 0:
            raise InputError(f"validate-every must be 0 (after the last step) or a number of steps, got {self.validate_every}")
        return self

    def trajectory(self) -> dict:
        """What a resumed run must agree on: which cases train, in which order, augmented or not."""
        return {"validation_fraction": self.validation_fraction, "augment": self.augment,
                "shape": list(self.shape) if self.shape is not None else None}
