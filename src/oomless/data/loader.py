"""The batches of a stretch of steps, prepared ahead by worker processes while the steps run.

    waits = []
    for volumes, labels in step_batches(dataset, shards, workers=2, pin_memory=True, waits=waits):
        ...                                  # waits[-1]: seconds this step waited for its batch

``shards`` lists, per step, this rank's (first item, count) of the global batch; every worker builds
whole step batches (``dataset.batch``) and torch's DataLoader keeps ``2 x workers`` of them in flight
(``prefetch_factor``), so while step s computes, steps s+1, s+2, ... are being read. With CUDA the
batches land in pinned (page-locked) host memory, from which ``.to(device, non_blocking=True)`` is a
DMA that does not hold up the host. Items depend only on their index (seeded per item), so which
worker made a batch never changes its contents.

Time blocked waiting for a batch is recorded per step: the data wait that ``oomless train`` logs. A
loader that keeps up shows ~0 after the first step (which includes starting the workers).
"""

import time
from collections.abc import Iterator

import torch


class _StepBatches(torch.utils.data.Dataset):
    """Position ``i`` -> the whole batch of the ``i``-th step of the stretch (one worker task per step)."""

    def __init__(self, dataset, shards: list[tuple[int, int]]):
        self.dataset, self.shards = dataset, shards

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, position: int):
        return self.dataset.batch(*self.shards[position])


def step_batches(dataset, shards: list[tuple[int, int]], workers: int = 0, pin_memory: bool = False,
                 waits: list[float] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``dataset.batch(*shard)`` for each shard in order, appending each wait to ``waits``."""
    if workers == 0 and not pin_memory:
        # No DataLoader at all: the synthetic default and `--workers 0` build batches in the step's thread.
        batches = (dataset.batch(*shard) for shard in shards)
    else:
        loader = torch.utils.data.DataLoader(
            _StepBatches(dataset, shards), batch_size=None, shuffle=False, num_workers=workers,
            pin_memory=pin_memory, prefetch_factor=2 if workers else None, persistent_workers=False)
        batches = iter(loader)
    try:
        for _ in shards:
            started = time.perf_counter()
            batch = next(batches)
            if waits is not None:
                waits.append(time.perf_counter() - started)
            yield batch
    finally:
        # Closing the iterator stops its workers now, also when the loop leaves early (a layout switch).
        del batches
