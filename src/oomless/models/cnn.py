"""A small 2D CNN test model: BatchNorm (running statistics) and Dropout (RNG) inside every block,
the two things an exact recompute must get right."""

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Conv2d-BatchNorm2d-ReLU-Dropout-MaxPool blocks in ``self.blocks``, then a linear classifier."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, channels: tuple[int, ...] = (16, 32, 32),
                 dropout: float = 0.1):
        super().__init__()
        widths = (in_channels, *channels)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width_in, width_out, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(width_out),
                nn.ReLU(inplace=True),
                nn.Dropout(dropout),
                nn.MaxPool2d(2),
            )
            for width_in, width_out in zip(widths[:-1], widths[1:])
        )
        self.classifier = nn.Linear(widths[-1], num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for block in self.blocks:
            x = block(x)
        # Global average pooling keeps the classifier independent of the image size.
        return self.classifier(x.mean(dim=(2, 3)))
