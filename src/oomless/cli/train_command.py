"""The `oomless train` command that runs a layout `oomless simulate` recommends: from a prediction to
a run, on the cluster simulated.

    oomless simulate unet3d --input-shape 2,1,128,128,128 --global-batch 16 --gpus 8 --target h100
    ...
    run it: torchrun --standalone --nproc-per-node 8 -m oomless train --model unet3d --size 128 \\
        --channels 1 --base-channels 8 --depth 3 --global-batch 16 --memory 80GiB --device cuda \\
        --parallel hybrid --stages 2 --schedule zbv --microbatches 8

`oomless train` trains the segmentation models (`unet3d`, `monai-unet`) with Adam: for those, with
model arguments it has flags for, the command is given; for any other model there is none (train it
with your own loop under the layout's settings: the table has them). The trainer cuts its stages
and plans each rank's memory from its own profile of that step, as simulate did, so its cut and
memory plan are its own choice for the budget (its loss is the segmentation loss, simulate's
``--loss`` sum by default).
"""

import shlex

from oomless.plan.layouts import LayoutEstimate
from oomless.plan.schedules import SINGLE_STAGE_SCHEDULES

# Model arguments `oomless train` has a flag for (the number of classes is its synthetic data's 2).
_TRAIN_FLAGS = {"in_channels": "--channels", "base_channels": "--base-channels", "depth": "--depth"}
_CLASSES = 2
RENDEZVOUS_PORT = 29500


def memory_flag(memory_bytes: int) -> str:
    """A byte count as `--memory` takes it: whole GiB, GB (a datasheet's 80 GB), MiB or MB where it
    is one, else bytes."""
    for unit, size in (("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6)):
        if memory_bytes % size == 0:
            return f"{memory_bytes // size}{unit}"
    return str(memory_bytes)


def train_command(model: str, model_kwargs: dict, input_shape: tuple[int, ...], global_batch: int, gpus: int,
                  nodes: int, memory_bytes: int, estimate: LayoutEstimate | None, precision: str = "fp32",
                  optimizer: str = "adam", dtype: str | None = None) -> str | None:
    """The command line that trains ``model`` (built with ``model_kwargs``, its input ``input_shape``
    batch first) in ``estimate``'s layout on ``gpus`` GPUs over ``nodes`` nodes of ``memory_bytes``
    each; None where `oomless train` cannot train that step: no layout fits, a model it does not
    train, a model argument it has no flag for, another optimizer than its Adam, or parameters cast
    to another dtype (`--dtype`)."""
    from oomless.models import model_defaults
    from oomless.train.config import SEGMENTATION_MODELS

    if estimate is None or not estimate.fits or model not in SEGMENTATION_MODELS:
        return None
    if optimizer != "adam" or dtype is not None or len(input_shape) != 5:
        return None
    arguments = {**model_defaults(model), **model_kwargs}
    if set(model_kwargs) - set(_TRAIN_FLAGS) - {"out_channels"} or arguments.get("out_channels") != _CLASSES:
        return None
    sides = input_shape[2:]
    size = str(sides[0]) if len(set(sides)) == 1 else ",".join(map(str, sides))
    train = ["-m", "oomless", "train", "--model", model, "--size", size,
             "--channels", str(input_shape[1])]
    for name, flag in _TRAIN_FLAGS.items():
        if name != "in_channels":
            train += [flag, str(arguments[name])]
    train += ["--global-batch", str(global_batch), "--memory", memory_flag(memory_bytes), "--device", "cuda"]
    if precision != "fp32":
        train += ["--precision", precision]
    if estimate.layout in ("pipeline", "hybrid"):
        train += ["--parallel", estimate.layout, "--stages", str(estimate.pipeline_parallel),
                  "--schedule", estimate.schedule, "--microbatches", str(estimate.microbatches)]
        if estimate.schedule not in SINGLE_STAGE_SCHEDULES:
            train += ["--stages-per-rank", "2"]       # as simulate cut them (`layouts.estimate_pipeline`)
    elif estimate.layout == "fsdp" or gpus > 1:
        train += ["--parallel", estimate.layout]
    if gpus == 1 and "--parallel" not in train:
        return shlex.join(["oomless", *train[2:]])
    if nodes == 1:
        return shlex.join(["torchrun", "--standalone", "--nproc-per-node", str(gpus), *train])
    # Started on every node; $HEAD_NODE (left for the shell): the first node's address, which every node reaches.
    launcher = shlex.join(["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(gpus // nodes),
                           "--rdzv-backend", "c10d", "--rdzv-endpoint"])
    return f"{launcher} $HEAD_NODE:{RENDEZVOUS_PORT} {shlex.join(train)}"
