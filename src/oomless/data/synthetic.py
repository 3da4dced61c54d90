"""Synthetic MRI-like volumes with lesion labels, generated on the fly from (seed, index).

No download and no disk: a smooth "brain" ellipsoid with low-frequency intensity texture and noise,
carrying 1-4 brighter ellipsoid "lesions"; the label map marks lesion voxels. Item ``i`` depends only
on ``(seed, i)``, never on the global RNG, so a resumed run sees exactly the data it would have seen.
With ``classes > 2`` each lesion draws a type 1..classes-1, brightest in its own channel (type k in
channel (k-1) mod C), so the types can be told apart; ``oomless make-data`` writes these as NIfTI.

    dataset = SyntheticVolumes(size=64, seed=0)
    volume, label = dataset[3]        # float32 (1, 64, 64, 64), int64 (64, 64, 64)
"""

import numpy as np
import torch
import torch.nn.functional as F

# Intensities on a 0..~1.3 scale, loosely a normalised T2/FLAIR: bright lesions on darker tissue.
_TISSUE_INTENSITY = 0.45
_TEXTURE_AMPLITUDE = 0.12
_LESION_CONTRAST = 0.45
_NOISE_STD = 0.04
_TEXTURE_GRID = 6        # coarse random grid upsampled into smooth texture
_OTHER_CHANNEL_SHARE = 0.3   # a lesion type's contrast outside its own channel


def _item_seed(seed: int, index: int) -> int:
    # SeedSequence mixes (seed, index) well, unlike seed * K + index, so neighbouring seeds do not
    # produce shifted copies of each other's items.
    return int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _uniform(generator: torch.Generator, low: float, high: float, *shape: int) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64)


def make_volume(shape: tuple[int, int, int], seed: int, index: int, channels: int = 1,
                classes: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """One (volume float32 (C, D, H, W), label int64 (D, H, W) in 0..classes-1) pair; deterministic in
    (seed, index). ``classes`` counts the background; with 2 every lesion is class 1."""
    generator = torch.Generator().manual_seed(_item_seed(seed, index))
    # Draw every random parameter first, in a fixed order, so the volume is stable under refactoring
    # of the arithmetic below.
    brain_center = _uniform(generator, -0.08, 0.08, 3)
    brain_radii = _uniform(generator, 0.65, 0.85, 3)
    lesion_count = int(torch.randint(1, 5, (1,), generator=generator))
    lesion_offsets = _uniform(generator, -0.55, 0.55, lesion_count, 3)
    lesion_radii = _uniform(generator, 0.14, 0.32, lesion_count, 3)
    lesion_contrast = _uniform(generator, 0.8, 1.2, lesion_count)
    channel_gain = _uniform(generator, 0.8, 1.2, channels)
    texture = torch.randn((1, channels, _TEXTURE_GRID, _TEXTURE_GRID, _TEXTURE_GRID), generator=generator)
    noise = torch.randn((channels, *shape), generator=generator)
    # Drawn after everything else, so the two-class volumes stay what they were before types existed.
    lesion_classes = (torch.randint(1, classes, (lesion_count,), generator=generator) if classes > 2
                      else torch.ones(lesion_count, dtype=torch.long))

    axes = [torch.linspace(-1.0, 1.0, side, dtype=torch.float32) for side in shape]

    def radius_squared(center: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        # Separable per axis, broadcast to (D, H, W): no coordinate grid is materialised.
        d, h, w = (((axis - float(c)) / float(r)) ** 2 for axis, c, r in zip(axes, center, radii))
        return d.view(-1, 1, 1) + h.view(1, -1, 1) + w.view(1, 1, -1)

    brain_r2 = radius_squared(brain_center, brain_radii)
    # A soft edge (sigmoid) looks like a partial-volume boundary rather than a staircase.
    brain = torch.sigmoid((1.0 - brain_r2) * 12.0)
    smooth_texture = F.interpolate(texture, size=shape, mode="trilinear", align_corners=True)[0]

    label = torch.zeros(shape, dtype=torch.long)
    intensity_by_class = torch.zeros((classes, *shape))
    for center, radii, contrast, lesion_class in zip(lesion_offsets, lesion_radii, lesion_contrast, lesion_classes):
        # Lesion centres are placed relative to the brain so they land inside it.
        r2 = radius_squared(brain_center + center * brain_radii, radii)
        inside = (r2 < 1.0) & (brain_r2 < 1.0)
        label[inside] = lesion_class                 # where lesions overlap, the later one's type shows
        intensity_by_class[lesion_class] = torch.maximum(intensity_by_class[lesion_class], inside * float(contrast))

    tissue = brain * (_TISSUE_INTENSITY + _TEXTURE_AMPLITUDE * smooth_texture)
    lesion = torch.zeros((channels, *shape))
    for lesion_class in range(1, classes):
        gain = channel_gain.float() * _type_channel_profile(lesion_class, classes, channels)
        # Masked by the final label map so the intensity a voxel shows is its own label's.
        visible = intensity_by_class[lesion_class] * (label == lesion_class)
        lesion = lesion + _LESION_CONTRAST * visible * gain.view(channels, 1, 1, 1)
    volume = tissue + lesion + _NOISE_STD * noise
    return volume.float().contiguous(), label


def _type_channel_profile(lesion_class: int, classes: int, channels: int) -> torch.Tensor:
    """Per-channel contrast of lesion type ``lesion_class``: all 1 with two classes; otherwise full in
    its own channel and dimmer elsewhere, with one channel the types also differ in brightness."""
    if classes == 2:
        return torch.ones(channels)
    profile = torch.full((channels,), _OTHER_CHANNEL_SHARE)
    profile[(lesion_class - 1) % channels] = 1.0
    if channels == 1:
        profile *= 0.5 + 0.5 * (lesion_class - 1) / (classes - 2)
    return profile


class SyntheticVolumes(torch.utils.data.Dataset):
    """Indexable dataset of synthetic MRI-like volumes; ``size`` is an int (cube) or a (D, H, W) tuple."""

    def __init__(self, size: int | tuple[int, int, int], seed: int = 0, channels: int = 1, length: int = 1_000_000,
                 classes: int = 2):
        shape = (size, size, size) if isinstance(size, int) else tuple(int(side) for side in size)
        if len(shape) != 3 or any(side < 2 for side in shape):
            raise ValueError(f"size must be an int or a (D, H, W) tuple of sides >= 2, got {size!r}")
        if channels < 1:
            raise ValueError(f"channels must be at least 1, got {channels}")
        if classes < 2:
            raise ValueError(f"classes (background included) must be at least 2, got {classes}")
        self.shape = shape
        self.seed = seed
        self.channels = channels
        self.classes = classes
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} volumes")
        return make_volume(self.shape, self.seed, index, self.channels, self.classes)

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Items ``start .. start+count-1`` stacked: volumes (N, C, D, H, W), labels (N, D, H, W)."""
        items = [self[start + offset] for offset in range(count)]
        return torch.stack([volume for volume, _ in items]), torch.stack([label for _, label in items])


def synthetic_tokens(batch: int, length: int, vocab_size: int = 256, seed: int = 0) -> torch.Tensor:
    """Learnable token sequences (N, T): each row counts up from a random start by a random stride, mod vocab.

    A language model can drive the loss on these well below log(vocab), which makes a useful sanity check.
    """
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + stride * torch.arange(length)) % vocab_size
