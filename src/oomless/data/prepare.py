"""Read every case once before training: check it, normalise it, and optionally cache it as .npy.

Checks, each an InputError naming the file: unreadable or truncated NIfTI, a label map with more than
one channel, image and label of different shapes or affines, an image whose channel count differs from
the dataset's modalities (or from the other cases), label values that are not whole numbers or fall
outside the declared classes. A run that starts has read every byte of its data at least once.

Normalisation is per channel: zero mean and unit variance over the channel's non-zero voxels (MRI
skull-stripped backgrounds are exactly 0 and would otherwise dominate the statistics), with the
background kept at 0; a channel without zeros uses all its voxels.

With a cache folder (``--stage``), each case is decoded once into ``NAME.image.npy`` (float32,
normalised) and ``NAME.label.npy`` (uint8); ``NAME.json`` records what it was made from and is
written last, so a case whose record is missing or names another source is decoded again.
"""

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from oomless.data.layout import CaseFiles, DatasetLayout
from oomless.data.nifti import read_nifti
from oomless.errors import InputError
from oomless.train.checkpoint import atomic_write

# Image and label grids agree when their affines do to within this (mm; scanners' float32 headers).
_AFFINE_TOLERANCE_MM = 1e-3
_NORMALISATION_EPSILON = 1e-8
CACHE_FORMAT = 1


@dataclass(frozen=True)
class CaseRecord:
    """What reading a case established: its grid, channels, largest label and where its arrays are."""

    name: str
    shape: tuple[int, int, int]
    channels: int
    max_label: int
    affine: tuple[tuple[float, ...], ...]
    image: str                      # the NIfTI files (read on every access when not cached)
    label: str
    cached_image: str | None = None  # the .npy files when cached
    cached_label: str | None = None


@dataclass(frozen=True)
class PreparedDataset:
    """Every case checked, with the dataset's channel and class counts."""

    layout: DatasetLayout
    cases: tuple[CaseRecord, ...]
    channels: int
    classes: int
    class_names: tuple[str, ...]


def decode_case(case: CaseFiles, channels: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image float32 (C, X, Y, Z) normalised, label uint8 (X, Y, Z), affine) of one case, checked."""
    image, image_affine = read_nifti(case.image, np.float32)
    label, label_affine = read_nifti(case.label, dtype=None)
    if label.shape[0] != 1:
        raise InputError(f"{case.label}: a label map must have one channel, it has {label.shape[0]}")
    if image.shape[1:] != label.shape[1:]:
        raise InputError(f"{case.label}: shape {label.shape[1:]} differs from its image {case.image} "
                         f"{image.shape[1:]}; image and label must be on the same voxel grid")
    if not np.allclose(image_affine, label_affine, rtol=0, atol=_AFFINE_TOLERANCE_MM):
        raise InputError(f"{case.label}: affine differs from its image {case.image}'s "
                         f"(label {label_affine.round(4).tolist()}, image {image_affine.round(4).tolist()}); "
                         f"resample the label onto the image's grid")
    if channels is not None and image.shape[0] != channels:
        raise InputError(f"{case.image}: {image.shape[0]} channel(s), but the dataset has {channels} "
                         f"(its modalities, or the other cases)")
    label = label[0]
    if np.issubdtype(label.dtype, np.floating) and not np.array_equal(label, np.round(label)):
        raise InputError(f"{case.label}: label values must be whole class numbers, found fractions "
                         f"(was it resampled with interpolation instead of nearest neighbour?)")
    if label.size and (label.min() < 0 or label.max() > 255):
        raise InputError(f"{case.label}: label values must be class numbers 0..255, found {label.min()}..{label.max()}")
    return normalise_channels(image), label.astype(np.uint8), image_affine


def normalise_channels(image: np.ndarray) -> np.ndarray:
    """Per channel: zero mean, unit variance over non-zero voxels (all voxels if none is zero)."""
    normalised = np.empty_like(image, dtype=np.float32)
    for channel, values in enumerate(image):
        foreground = values != 0
        inside = values[foreground] if 0 < foreground.sum() < values.size else values.reshape(-1)
        mean, std = inside.mean(dtype=np.float64), inside.std(dtype=np.float64)
        normalised[channel] = (values - mean) / max(std, _NORMALISATION_EPSILON)
        if inside.size < values.size:
            normalised[channel][~foreground] = 0.0
    return normalised


def prepare_dataset(layout: DatasetLayout, cache_dir: Path | None = None,
                    source_ids: dict[str, str] | None = None,
                    on_case: Callable[[CaseFiles], None] | None = None) -> PreparedDataset:
    """Check every case of ``layout`` (and decode it into ``cache_dir``); ``source_ids`` maps a case
    name to an identity of its files (a checksum) that a cached copy must match to be reused."""
    channels = len(layout.modalities) if layout.modalities is not None else None
    records = []
    for case in layout.cases:
        identity = (source_ids or {}).get(case.name)
        record = _cached_record(cache_dir, case, identity) if cache_dir is not None else None
        if record is None:
            image, label, affine = decode_case(case, channels)
            record = CaseRecord(case.name, tuple(label.shape), image.shape[0], int(label.max(initial=0)),
                                tuple(tuple(float(value) for value in row) for row in affine),
                                str(case.image), str(case.label))
            if cache_dir is not None:
                record = _write_cache(cache_dir, record, image, label, identity)
        if channels is not None and record.channels != channels:
            raise InputError(f"{case.image}: {record.channels} channel(s), but the dataset has {channels}")
        channels = record.channels
        records.append(record)
        if on_case is not None:
            on_case(case)
    classes = _check_classes(layout, records)
    names = tuple(layout.labels[index] for index in range(classes)) if layout.labels else (
        ("background",) + tuple(f"class {index}" for index in range(1, classes)))
    return PreparedDataset(layout, tuple(records), channels, classes, names)


def _check_classes(layout: DatasetLayout, records: list[CaseRecord]) -> int:
    largest = max(records, key=lambda record: record.max_label)
    if layout.labels is None:
        return max(2, largest.max_label + 1)            # classes seen in the files; background and one more
    if largest.max_label >= len(layout.labels):
        raise InputError(f"{largest.label}: label value {largest.max_label} is outside the declared classes "
                         f"0..{len(layout.labels) - 1} ({layout.root / 'dataset.json'} 'labels')")
    return len(layout.labels)


def _cache_paths(cache_dir: Path, name: str) -> tuple[Path, Path, Path]:
    stem = name.replace("/", "__")
    return cache_dir / f"{stem}.image.npy", cache_dir / f"{stem}.label.npy", cache_dir / f"{stem}.json"


def _cached_record(cache_dir: Path, case: CaseFiles, identity: str | None) -> CaseRecord | None:
    """The record of a finished cache entry made from these very files, else None."""
    image_path, label_path, record_path = _cache_paths(cache_dir, case.name)
    if identity is None or not record_path.is_file():
        return None
    try:
        saved = json.loads(record_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if saved.get("format") != CACHE_FORMAT or saved.get("source") != identity:
        return None
    record = saved["record"]
    record = CaseRecord(**{**record, "shape": tuple(record["shape"]),
                           "affine": tuple(tuple(row) for row in record["affine"]),
                           "image": str(case.image), "label": str(case.label)})
    voxels = int(np.prod(record.shape))
    # Sizes as the header and data would make them: a cached file cut short is decoded again.
    if not (image_path.is_file() and label_path.is_file()
            and image_path.stat().st_size >= record.channels * voxels * 4
            and label_path.stat().st_size >= voxels):
        return None
    return record


def _write_cache(cache_dir: Path, record: CaseRecord, image: np.ndarray, label: np.ndarray,
                 identity: str | None) -> CaseRecord:
    image_path, label_path, record_path = _cache_paths(cache_dir, record.name)
    atomic_write(image_path, lambda temporary: _save_npy(temporary, image))
    atomic_write(label_path, lambda temporary: _save_npy(temporary, label))
    record = CaseRecord(**{**asdict(record), "cached_image": str(image_path), "cached_label": str(label_path)})
    text = json.dumps({"format": CACHE_FORMAT, "source": identity, "record": asdict(record)})
    atomic_write(record_path, lambda temporary: Path(temporary).write_text(text))   # last: the commit
    return record


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as file:          # a file object: np.save(path) would append ".npy" to the name
        np.save(file, array, allow_pickle=False)
