"""The typed configuration of ``oomless train``; the CLI maps its flags onto this and nothing else."""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from oomless.data.config import DataConfig
from oomless.errors import InputError
from oomless.output_paths import check_output_path
from oomless.parallel.config import ParallelConfig
from oomless.runtime.compile import check_compile_available, compile_options
from oomless.runtime.precision import autocast_dtype, check_precision
from oomless.sizes import parse_bytes

SEGMENTATION_MODELS = ("unet3d", "monai-unet")
# --split: the planner splits chains into slabs where no plan fits without (auto), every chain, or none.
SPLIT_CHOICES = ("auto", "all", "off")
SPLIT_REQUESTS = {"auto": None, "all": True, "off": False}

# Fields that change the trajectory of a run: resuming under different values would silently
# produce a run that equals neither the old nor the new configuration, so it is refused.
TRAJECTORY_FIELDS = ("model", "size", "seed", "global_batch", "lr", "channels", "classes", "base_channels", "depth",
                     "max_grad_norm", "precision", "compile")


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
    precision: str = "fp32"                 # "bf16" | "fp16": forward under torch.autocast (runtime/precision.py)
    # torch.compile each block in place (runtime/compile.py): True, or a dict of torch.compile options
    # ({"backend": "aot_eager"}, {"mode": "max-autotune-no-cudagraphs"}); the CLI's --compile is True.
    compile: bool | dict = False
    split: str = "auto"                     # chains in slabs (runtime/split.py): "auto" (the planner's choice) | "all" | "off"
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
        if not 0 < self.lr < math.inf:
            raise InputError(f"lr must be a positive finite number, got {self.lr}")
        if self.max_grad_norm is not None and not 0 < self.max_grad_norm < math.inf:
            raise InputError(f"max-grad-norm must be a positive finite number, got {self.max_grad_norm}")
        if not 0 <= self.seed < 2**32:              # NumPy's seed range; torch's and Python's are wider
            raise InputError(f"seed must be between 0 and 2**32 - 1, got {self.seed}")
        self.parallel.validate()
        if self.data is not None:
            self.data.validate(multiple)
        autocast_dtype(self.precision)          # raises InputError naming the choices
        if self.split not in SPLIT_CHOICES:
            raise InputError(f"split must be one of {', '.join(SPLIT_CHOICES)}, got {self.split!r}")
        if self.split == "all" and self.memory is None:
            raise InputError("--split all needs --memory (chains are split by the plan for a budget); add "
                             "--memory or use --split off")
        if self.split == "all" and self.parallel.mode != "none":
            raise InputError(f"--split all is for one process: under --parallel {self.parallel.mode} BatchNorm takes "
                             "global-batch statistics, which chains in slabs do not compute yet; use --split off")
        if self.memory is not None:
            parse_bytes(self.memory)            # raises SizeError with the accepted formats
        if self.resume and self.checkpoint_dir is None:
            raise InputError("resume needs a checkpoint directory (--checkpoint-dir)")
        # Checked now, not when the first checkpoint or the final weights are written, after the steps.
        if self.checkpoint_dir is not None:
            check_output_path(self.checkpoint_dir, "checkpoint-dir", directory=True)
        if self.save is not None:
            check_output_path(self.save, "save")
        device = self.resolve_device()
        if self.precision != "fp32":
            check_precision(self.precision, device)     # before any step: the option and what works instead
        options = compile_options(self.compile)     # raises InputError on a value that is not True/False/dict
        if options is not None:
            check_compile_available(options)
        return self

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise InputError(f"device {self.device!r} is not one of auto, cpu, cuda, cuda:N (oomless runs on CPUs "
                             "and NVIDIA GPUs)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device {self.device!r} asked for, but CUDA is not available here")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise InputError(f"device {self.device!r} asked for, but this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
        return device

    def trajectory(self) -> dict:
        """The fields a checkpoint must agree on to be resumed, JSON-ready."""
        values = dataclasses.asdict(self)
        trajectory = {name: list(values[name]) if isinstance(values[name], tuple) else values[name]
                      for name in TRAJECTORY_FIELDS}
        if self.data is not None:
            trajectory["data"] = self.data.trajectory()
        return trajectory
