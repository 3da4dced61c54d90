"""Whole volumes for the network: fitted to its grid, augmented with a seed, ordered by epoch.

    dataset = VolumeDataset(records, shape=(96, 96, 96), classes=4, seed=0, augment=True)
    volumes, labels = dataset.batch(start=8, count=2)     # float32 (2, C, 96, 96, 96), int64 (2, 96, 96, 96)

Item ``i`` is case ``permutation(epoch)[i mod n]`` of epoch ``i // n``, augmented by a draw seeded
from ``(seed, i)``: like ``SyntheticVolumes``, an item depends on nothing but its index, so data
parallel ranks take their shards of a step by index and a resumed run sees exactly the same data.

Fitting to the network's grid: ``resample=False`` pads each volume at the far end of every axis up to
``shape`` (the largest case rounded up to the U-Net's multiple; padding is undone exactly for
predictions); ``resample=True`` interpolates every case onto ``shape`` (trilinear for images,
nearest for labels), for volumes too large to train whole at their own resolution.

Augmentation: a random flip of each axis and a random number of 90-degree turns in one plane whose
two sides are equal. Both only move voxels, so they are exact and cost a copy, not an interpolation.
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from oomless.data.layout import CaseFiles
from oomless.data.prepare import CaseRecord, decode_case


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(key)))


# Streams of the seed: separate so that adding augmentation never changes the order of cases.
_ORDER_STREAM, _AUGMENT_STREAM = 1, 2


class VolumeDataset(torch.utils.data.Dataset):
    """Training items over ``cases`` (any number of epochs; the index runs on)."""

    def __init__(self, cases: list[CaseRecord] | tuple[CaseRecord, ...], shape: tuple[int, int, int], classes: int,
                 seed: int = 0, augment: bool = True, resample: bool = False):
        if not cases:
            raise ValueError("a VolumeDataset needs at least one case")
        self.cases = tuple(cases)
        self.shape = tuple(shape)
        self.classes = classes
        self.channels = self.cases[0].channels
        self.seed = seed
        self.augment = augment
        self.resample = resample

    def __len__(self) -> int:
        # Items are indexed across epochs; a sampler never runs out (the loop decides how many steps).
        return 2**62

    def case_of(self, index: int) -> int:
        epoch, position = divmod(index, len(self.cases))
        return int(_rng(self.seed, _ORDER_STREAM, epoch).permutation(len(self.cases))[position])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        volume, label = self.fitted(self.case_of(index))
        if self.augment:
            volume, label = self._augmented(volume, label, _rng(self.seed, _AUGMENT_STREAM, index))
        return volume, label

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Items ``start .. start+count-1`` stacked: volumes (N, C, D, H, W), labels (N, D, H, W) int64."""
        items = [self[start + offset] for offset in range(count)]
        return torch.stack([volume for volume, _ in items]), torch.stack([label for _, label in items])

    def native(self, case_index: int) -> tuple[np.ndarray, np.ndarray]:
        """The case as stored, normalised: image float32 (C, X, Y, Z), label uint8 (X, Y, Z)."""
        record = self.cases[case_index]
        if record.cached_image is not None:
            # Memory-mapped: a worker reads the pages it touches, straight from the page cache.
            return np.load(record.cached_image, mmap_mode="r"), np.load(record.cached_label, mmap_mode="r")
        image, label, _ = decode_case(CaseFiles(record.name, Path(record.image), Path(record.label)), record.channels)
        return image, label

    def fitted(self, case_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The case on the network's grid, unaugmented: volume (C, D, H, W) float32, label (D, H, W) int64."""
        image, label = self.native(case_index)
        volume = torch.from_numpy(np.array(image, dtype=np.float32))
        label = torch.from_numpy(np.array(label, dtype=np.int64))
        if self.resample:
            if tuple(volume.shape[1:]) != self.shape:
                volume = F.interpolate(volume[None], size=self.shape, mode="trilinear", align_corners=False)[0]
                label = F.interpolate(label[None, None].float(), size=self.shape, mode="nearest")[0, 0].long()
            return volume, label
        padding = [amount for side, target in zip(reversed(volume.shape[1:]), reversed(self.shape))
                   for amount in (0, target - side)]
        # Normalised intensities are 0 where MRI background is, so padding continues the background.
        return F.pad(volume, padding), F.pad(label, padding)

    def unfit(self, logits: torch.Tensor, case_index: int) -> torch.Tensor:
        """Per-class scores (K, D, H, W) on the network's grid back on the case's own grid (K, X, Y, Z)."""
        native_shape = self.cases[case_index].shape
        if self.resample:
            return F.interpolate(logits[None].float(), size=native_shape, mode="trilinear", align_corners=False)[0]
        return logits[:, :native_shape[0], :native_shape[1], :native_shape[2]]

    def _augmented(self, volume: torch.Tensor, label: torch.Tensor, rng: np.random.Generator):
        flips = [axis for axis in range(3) if rng.random() < 0.5]
        square_planes = [(a, b) for a, b in ((0, 1), (0, 2), (1, 2)) if self.shape[a] == self.shape[b]]
        turns = int(rng.integers(0, 4))
        plane = square_planes[int(rng.integers(0, len(square_planes)))] if square_planes else None
        if flips:
            volume = volume.flip([axis + 1 for axis in flips])
            label = label.flip(flips)
        if plane is not None and turns:
            volume = volume.rot90(turns, [plane[0] + 1, plane[1] + 1])
            label = label.rot90(turns, list(plane))
        return volume.contiguous(), label.contiguous()
