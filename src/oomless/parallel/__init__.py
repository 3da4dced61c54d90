"""Data, pipeline and hybrid parallel training on torch.distributed (gloo on CPU, NCCL on GPUs),
launched by ``torchrun``.

- `config.py`          `ParallelConfig`: mode dp | fsdp | local-sgd | async | pipeline | hybrid, overlap, bucket
                       size, timeout, stages, schedule, micro-batches, layout switches.
- `process_group.py`   join the group torchrun describes; equal shards of the global batch; collectives
                       that fail name the rank and the collective.
- `data_parallel.py`   the strategies the training loop calls; synchronous DDP.
- `sharded.py`         sharded data parallel on FSDP2 (fully_shard per block, then the root).
- `overlap.py`         per-bucket optimizer update after its all-reduce; each module's next forward
                       waits only for its own parameters' update.
- `relaxed.py`         local SGD and asynchronous averaging with bounded staleness.
- `batchnorm.py`       global-batch BatchNorm statistics (torch's SyncBatchNorm is CUDA-only).
- `rank_state.py`      every rank's RNG (and, in relaxed modes, weights and optimizer) for checkpoints.
- `block_sequence.py`  a model as named blocks that can be cut anywhere (skips cross cuts).
- `traced.py`          any other model traced with torch.export into such blocks, unmodified;
                       `traced_graph.py` cuts the exported graph.
- `pipeline.py`        pipeline stages and torch's schedules; a (pipeline x data) mesh.
- `stage_precision.py` bf16 / fp16 on stages: autocast per stage, crossing tensors in their autocast
                       dtype, the loss on fp32 outputs, fp16's loss scale and skips agreed by every rank.
- `stage_fit.py`       each stage's own memory plan (at the pipeline's precision), its blocks compiled.
- `pipeline_training.py` the loop's pipeline / hybrid layout: cut chosen by the partitioner.

    torchrun --nproc-per-node 2 -m oomless train --parallel dp --global-batch 4 --size 32
    torchrun --nproc-per-node 2 -m oomless train --parallel fsdp --global-batch 4 --size 32
    torchrun --nproc-per-node 4 -m oomless train --parallel hybrid --stages 2 --switch-at 10:dp
    torchrun --nproc-per-node 2 -m oomless train --parallel pipeline --stages 2 --precision bf16 --compile
"""

import torch

from oomless.errors import InputError
from oomless.parallel.config import PARALLEL_MODES, ParallelConfig
from oomless.parallel.data_parallel import SingleProcess, SynchronousDataParallel
from oomless.parallel.overlap import OverlappedUpdate, apply_overlapped_update
from oomless.parallel.process_group import Ranks, join_process_group, leave_process_group, shard_start
from oomless.parallel.relaxed import AsynchronousAveraging, LocalSGD


def make_strategy(config: ParallelConfig, ranks: Ranks, device: torch.device) -> SingleProcess:
    """The strategy object for ``config.mode`` (see `oomless.parallel.data_parallel`)."""
    if config.pipelined:
        from oomless.parallel.pipeline_training import PipelineTraining   # imports oomless.train's loss

        _check_pipeline_world(config, ranks)
        return PipelineTraining(config, ranks, device)
    if config.sharded:
        from oomless.parallel.sharded import ShardedDataParallel   # torch.distributed.fsdp only when asked

        return ShardedDataParallel(config, ranks, device)
    kinds = {"none": SingleProcess, "dp": SynchronousDataParallel, "local-sgd": LocalSGD,
             "async": AsynchronousAveraging}
    return kinds[config.mode](config, ranks, device)


def _check_pipeline_world(config: ParallelConfig, ranks: Ranks) -> None:
    world = ranks.world_size
    if config.mode == "pipeline" and world != config.stages:
        hint = f"; for {world // config.stages} replicas use --parallel hybrid" if world % config.stages == 0 else ""
        raise InputError(f"--parallel pipeline --stages {config.stages} needs {config.stages} processes, "
                         f"torchrun started {world}{hint}")
    if config.mode == "hybrid" and (world % config.stages or world == config.stages):
        raise InputError(f"--parallel hybrid --stages {config.stages} needs a multiple of {config.stages} "
                         f"processes and at least two replicas, torchrun started {world}")


__all__ = ["ParallelConfig", "PARALLEL_MODES", "Ranks", "join_process_group", "leave_process_group", "shard_start",
           "make_strategy", "SingleProcess", "SynchronousDataParallel", "LocalSGD", "AsynchronousAveraging",
           "OverlappedUpdate", "apply_overlapped_update"]
