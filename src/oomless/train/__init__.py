"""Training: ``TrainConfig`` -> ``train(config)`` -> ``TrainResult``, with checkpoints and resume."""

from oomless.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_weights
from oomless.train.config import TrainConfig
from oomless.train.loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "save_weights"]
