"""Data parallel training on torch.distributed (gloo on CPU, NCCL on GPUs), launched by ``torchrun``.

- `config.py`          `ParallelConfig`: mode dp | local-sgd | async, overlap, bucket size, timeout.
- `process_group.py`   join the group torchrun describes; equal shards of the global batch; collectives
                       that fail name the rank and the collective.
- `data_parallel.py`   the strategies the training loop calls; synchronous DDP.
- `overlap.py`         per-bucket optimizer update in a DDP comm hook; per-layer waits in forward.
- `relaxed.py`         local SGD and asynchronous averaging with bounded staleness.
- `batchnorm.py`       global-batch BatchNorm statistics (torch's SyncBatchNorm is CUDA-only).
- `rank_state.py`      every rank's RNG (and, in relaxed modes, weights and optimizer) for checkpoints.

    torchrun --nproc-per-node 2 -m oomless train --parallel dp --global-batch 4 --size 32
"""

import torch

from oomless.parallel.config import PARALLEL_MODES, ParallelConfig
from oomless.parallel.data_parallel import SingleProcess, SynchronousDataParallel
from oomless.parallel.overlap import OverlappedUpdate, apply_overlapped_update
from oomless.parallel.process_group import Ranks, join_process_group, leave_process_group, shard_start
from oomless.parallel.relaxed import AsynchronousAveraging, LocalSGD


def make_strategy(config: ParallelConfig, ranks: Ranks, device: torch.device) -> SingleProcess:
    """The strategy object for ``config.mode`` (see `oomless.parallel.data_parallel`)."""
    kinds = {"none": SingleProcess, "dp": SynchronousDataParallel, "local-sgd": LocalSGD,
             "async": AsynchronousAveraging}
    return kinds[config.mode](config, ranks, device)


__all__ = ["ParallelConfig", "PARALLEL_MODES", "Ranks", "join_process_group", "leave_process_group", "shard_start",
           "make_strategy", "SingleProcess", "SynchronousDataParallel", "LocalSGD", "AsynchronousAveraging",
           "OverlappedUpdate", "apply_overlapped_update"]
