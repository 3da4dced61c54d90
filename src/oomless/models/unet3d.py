"""A compact 3D U-Net for volumetric segmentation (the embedded default of ``oomless train``).

Encoder and decoder stages are items of ``nn.ModuleList``s so oomless's "repeated children" block
policy finds them without configuration: each stage is one unit of keep/swap/recompute decision.

    model = UNet3D(in_channels=1, out_channels=2, base_channels=8, depth=3)
    logits = model(torch.randn(2, 1, 64, 64, 64))   # (2, 2, 64, 64, 64)
"""

import torch
import torch.fx
from torch import nn

from oomless.errors import InputError


class ConvStage(nn.Sequential):
    """Two (Conv3d 3x3x3, BatchNorm3d, ReLU) layers; padding keeps the spatial size."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(
            # No conv bias: BatchNorm's shift makes it redundant.
            nn.Conv3d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm3d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv3d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm3d(out_channels),
            nn.ReLU(inplace=True),
        )


class DecoderStage(nn.Module):
    """Upsample by 2 with a transposed convolution, concatenate the skip, then a ConvStage."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int):
        super().__init__()
        self.up = nn.ConvTranspose3d(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = ConvStage(out_channels + skip_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


@torch.fx.wrap
def check_volume(volume: torch.Tensor, depth: int) -> None:
    """UNet3D's input: (N, C, D, H, W) with sides divisible by 2**depth. Wrapped for torch.fx: a traced
    forward (oomless streams the outer level of a traced model) calls it rather than tracing into it."""
    if volume.dim() != 5:
        raise InputError(f"UNet3D expects (N, C, D, H, W), got shape {tuple(volume.shape)}")
    multiple = 2**depth
    if any(side % multiple for side in volume.shape[2:]):
        raise InputError(f"UNet3D(depth={depth}) needs D, H, W divisible by {multiple}, got {tuple(volume.shape[2:])}")


class UNet3D(nn.Module):
    """3D U-Net with ``depth`` down/up steps; spatial sizes must be divisible by ``2**depth``."""

    def __init__(self, in_channels: int = 1, out_channels: int = 2, base_channels: int = 8, depth: int = 3):
        super().__init__()
        if depth < 1:
            raise InputError(f"UNet3D depth must be at least 1, got {depth}")
        self.depth = depth
        widths = [base_channels * 2**level for level in range(depth + 1)]
        # encoders[-1] is the bottleneck: it runs after the last pooling and has no skip of its own.
        self.encoders = nn.ModuleList(
            ConvStage(in_channels if level == 0 else widths[level - 1], widths[level]) for level in range(depth + 1)
        )
        self.pool = nn.MaxPool3d(kernel_size=2, stride=2)
        self.decoders = nn.ModuleList(
            DecoderStage(widths[level + 1], widths[level], widths[level]) for level in reversed(range(depth))
        )
        self.head = nn.Conv3d(widths[0], out_channels, kernel_size=1)

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        check_volume(volume, self.depth)
        skips = []
        x = volume
        for encoder in self.encoders[:-1]:
            x = encoder(x)
            skips.append(x)
            x = self.pool(x)
        x = self.encoders[-1](x)
        for decoder, skip in zip(self.decoders, reversed(skips)):
            x = decoder(x, skip)
        return self.head(x)
