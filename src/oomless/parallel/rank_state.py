"""Every rank's part of a checkpoint, gathered to rank 0, which writes the one atomic file.

Synchronous modes: the weights and optimizer state are identical on every rank, so only each rank's
RNG states (and the training loop's loss sums since its last log) travel. Relaxed modes: ranks hold
different weights and Adam moments between averages, so those travel too. The gather uses
``gather_object`` (pickle between this run's own processes, in memory); the file itself stays
safetensors + JSON and is never unpickled.
"""

import torch.distributed as dist
from torch import nn

from oomless.parallel.data_parallel import SingleProcess
from oomless.train.checkpoint import process_state


def gather_other_ranks(strategy: SingleProcess, model: nn.Module, optimizer,
                       log_window: dict | None = None) -> list[tuple[dict, dict]] | None:
    """On rank 0: ``[state of rank 1, ..., state of rank N-1]``; on other ranks None (they send theirs).
    ``log_window``: this rank's sums since the training loop's last log (each rank's own loss)."""
    ranks = strategy.ranks
    if ranks.world_size == 1:
        return [] if ranks.is_first else None
    mine = (process_state(model, optimizer, log_window=log_window) if strategy.relaxed
            else process_state(None, None, log_window=log_window))
    received = [None] * ranks.world_size if ranks.is_first else None
    with strategy.collective("checkpoint gather of every rank's state"):
        dist.gather_object(mine if not ranks.is_first else None, received, dst=0)
    return received[1:] if ranks.is_first else None
