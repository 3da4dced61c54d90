"""Plan `make demo`'s configuration once in this fresh process, as `oomless train` does, and print
JSON: whether its budget was accepted, the predicted peak, the decisions, and the smallest budget the
same profile names (tests/test_demo_plan.py runs several of these)."""

import json
import sys

import torch

import oomless
from oomless.data import SyntheticVolumes
from oomless.errors import PlanError
from oomless.train.config import TrainConfig
from oomless.train.loop import build_segmentation_model, seed_everything
from oomless.train.losses import segmentation_loss


def demo_step(memory: str = "256MiB", threads: int = 2):
    """(config, model, optimizer, volumes, loss_fn) of the demo's command line (Makefile): --size 64
    --global-batch 2 --memory 256MiB --seed 0."""
    config = TrainConfig(size=64, global_batch=2, memory=memory, seed=0)
    torch.set_num_threads(threads)
    seed_everything(config.seed)
    model = build_segmentation_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    volumes, labels = SyntheticVolumes(config.shape, seed=config.seed, channels=config.channels,
                                       classes=config.classes).batch(0, config.global_batch)
    return config, model, optimizer, volumes, lambda logits: segmentation_loss(logits, labels)


def main(argv: list[str]) -> None:
    config, model, optimizer, volumes, loss_fn = demo_step(argv[0] if argv else "256MiB",
                                                           int(argv[1]) if len(argv) > 1 else 2)
    profile = oomless.profile(model, volumes, loss_fn=loss_fn, optimizer=optimizer, memory=config.memory_bytes)
    result = {"memory_bytes": config.memory_bytes}
    try:
        plan = oomless.plan(model, volumes, config.memory_bytes, loss_fn=loss_fn, optimizer=optimizer, profile=profile,
                            max_grad_norm=config.max_grad_norm)
        result.update(accepted=True, predicted_peak_bytes=plan.predicted_peak_bytes, decisions=plan.decisions)
    except PlanError as error:
        result.update(accepted=False, error=str(error))
    try:
        oomless.plan(model, volumes, 1, loss_fn=loss_fn, optimizer=optimizer, profile=profile)
    except PlanError as error:
        result["smallest_bytes"] = error.minimum_bytes
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
