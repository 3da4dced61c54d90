"""The typed configuration of ``oomless train``; the CLI maps its flags onto this and nothing else."""

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from oomless.data.config import DataConfig
from oomless.errors import InputError
from oomless.parallel.config import ParallelConfig
from oomless.sizes import parse_bytes

SEGMENTATION_MODELS = ("unet3d", "monai-unet")

# Fields that change the trajectory of a run: resuming under different values would silently
# produce a run that equals neither the old nor the new configuration, so it is refused.
TRAJECTORY_FIELDS = ("model", "size", "seed", "global_batch", "lr", "channels", "classes", "base_channels", "depth",
                     "max_grad_norm")


def _check_creatable(path: Path, flag: str, directory: bool) -> None:
    """Raise `InputError` unless ``path`` is (or can be made as) a directory / a file to write."""
    if path.exists():
        if directory and not path.is_dir():
            raise InputError(f"{flag} {path} is a file; name a directory (created if missing)")
        if not directory and path.is_dir():
            raise InputError(f"{flag} {path} is a directory; name a file, e.g. {path / 'weights.safetensors'}")
    parent = path if directory and path.is_dir() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path} cannot be created: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path} cannot be created: {parent} is not writable")


@dataclass
class TrainConfig:
    """One training run: 3D segmentation of synthetic MRI-like volumes (see ``oomless.train.loop``).

    ``memory`` is the device budget for the whole step ("1GiB", bytes as int); None trains with
    plain PyTorch, no oomless. ``size`` is the side of the cubic volume (or (D, H, W)) and must be
    divisible by ``2**depth``. ``global_batch`` volumes are used per optimizer step.
    With ``data`` the volumes come from NIfTI files, and ``size``, ``channels`` and ``classes``
    (background included) are taken from the dataset when training starts.
    """

    size: int | tuple[int, int, int] = 48
    memory: str | int | None = None
    steps: int = 20
    seed: int = 0
    global_batch: int = 2
    lr: float = 1e-3
    model: str = "unet3d"
    channels: int = 1
    classes: int = 2
    base_channels: int = 8
    depth: int = 3
    device: str = "auto"
    save: Path | str | None = None
    checkpoint_dir: Path | str | None = None
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    resume: bool = False
    log_every: int = 10                     # steps per logged line (a host sync); each logs the mean since the last
    progress: bool = True
    deterministic: bool = False
    max_grad_norm: float | None = None      # clip gradients to this global L2 norm before each step
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.size,) * 3 if isinstance(self.size, int) else tuple(self.size)

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_bytes(self.memory)

    def validate(self) -> "TrainConfig":
        """Raise an ``OomlessError`` naming the first bad field; return self so calls chain."""
        if self.model not in SEGMENTATION_MODELS:
            raise InputError(f"unknown model {self.model!r} for training; choose one of {', '.join(SEGMENTATION_MODELS)}")
        if self.depth < 1:
            raise InputError(f"depth must be at least 1, got {self.depth}")
        multiple = 2**self.depth
        shape = self.shape
        if len(shape) != 3 or any(side <= 0 or side % multiple for side in shape):
            raise InputError(f"size {self.size} must be positive and divisible by 2**depth = {multiple} (depth={self.depth})")
        for name in ("steps", "global_batch", "channels", "classes", "base_channels", "checkpoint_every", "log_every",
                     "keep_checkpoints"):
            minimum = {"steps": 0, "classes": 2}.get(name, 1)
            if getattr(self, name) < minimum:
                raise InputError(f"{name.replace('_', '-')} must be at least {minimum}, got {getattr(self, name)}")
        if not self.lr > 0:
            raise InputError(f"lr must be positive, got {self.lr}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise InputError(f"max-grad-norm must be positive, got {self.max_grad_norm}")
        self.parallel.validate()
        if self.data is not None:
            self.data.validate(multiple)
        if self.memory is not None:
            parse_bytes(self.memory)            # raises SizeError with the accepted formats
        if self.resume and self.checkpoint_dir is None:
            raise InputError("resume needs a checkpoint directory (--checkpoint-dir)")
        # Checked now, not when the first checkpoint or the final weights are written, after the steps.
        if self.checkpoint_dir is not None:
            _check_creatable(Path(self.checkpoint_dir), "checkpoint-dir", directory=True)
        if self.save is not None:
            _check_creatable(Path(self.save), "save", directory=False)
        self.resolve_device()
        return self

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as error:
            raise InputError(f"device {self.device!r} is not a torch device: {error}") from error
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device {self.device!r} asked for, but CUDA is not available here")
        return device

    def trajectory(self) -> dict:
        """The fields a checkpoint must agree on to be resumed, JSON-ready."""
        values = dataclasses.asdict(self)
        trajectory = {name: list(values[name]) if isinstance(values[name], tuple) else values[name]
                      for name in TRAJECTORY_FIELDS}
        if self.data is not None:
            trajectory["data"] = self.data.trajectory()
        return trajectory
