"""The typed configuration of data parallel training; `TrainConfig.parallel` holds one.

Modes (see `oomless.parallel` for the trade-offs):

- ``none``: one process, no torch.distributed.
- ``dp``: synchronous data parallel on torch DDP; with ``overlap`` each bucket's optimizer update runs
  as soon as its all-reduce lands and each layer's next forward waits only for its own parameters.
- ``local-sgd``: every rank steps on its own shard; parameters are averaged every ``average_every`` steps.
- ``async``: every rank steps on its own shard; the parameter average of step k runs while step k+1
  computes and is applied one step late (staleness bounded by one step).
"""

from dataclasses import dataclass

from oomless.errors import InputError

PARALLEL_MODES = ("none", "dp", "local-sgd", "async")
SYNCHRONOUS_MODES = ("none", "dp")


@dataclass
class ParallelConfig:
    """How the processes started by ``torchrun`` share the work of one training run."""

    mode: str = "none"
    overlap: bool = True                 # dp only: per-bucket update in the comm hook
    average_every: int = 4               # local-sgd only: steps between parameter averages (H)
    bucket_cap_mb: float = 25.0          # DDP gradient bucket size; smaller buckets overlap earlier
    timeout_seconds: float = 600.0       # a collective slower than this fails, naming rank and collective
    backend: str = "auto"                # auto: nccl on CUDA, gloo on CPU

    @property
    def distributed(self) -> bool:
        return self.mode != "none"

    @property
    def synchronous(self) -> bool:
        return self.mode in SYNCHRONOUS_MODES

    def validate(self) -> "ParallelConfig":
        if self.mode not in PARALLEL_MODES:
            raise InputError(f"unknown parallel mode {self.mode!r}; choose one of {', '.join(PARALLEL_MODES)}")
        if self.average_every < 1:
            raise InputError(f"average-every must be at least 1, got {self.average_every}")
        if not self.bucket_cap_mb > 0:
            raise InputError(f"bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        if not self.timeout_seconds > 0:
            raise InputError(f"timeout must be positive, got {self.timeout_seconds}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise InputError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        return self
