"""A small synthetic dataset in the Medical Segmentation Decathlon's layout, for demos and tests.

    oomless make-data data/demo --cases 8 --size 96          # 4 channels, 4 classes, seed 0

writes ``dataset.json`` (``modality``, ``labels``, ``training`` pairs), ``imagesTr/case_NNN.nii.gz``
(float32, X x Y x Z x channels) and ``labelsTr/case_NNN.nii.gz`` (uint8) from the seeded ellipsoid
generator of ``oomless.data.synthetic``, so ``oomless train --data data/demo`` runs offline exactly as
it would on a downloaded Decathlon task. Every file is written atomically and ``dataset.json`` last:
a folder whose writing was interrupted has no ``dataset.json`` and is refused, never half used.
"""

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from oomless.data.nifti import nifti_bytes
from oomless.data.synthetic import make_volume
from oomless.errors import InputError
from oomless.train.checkpoint import atomic_write

# Named as the Decathlon's brain-tumour task names its four MRI contrasts, so the demo reads like it.
_BRAIN_MODALITIES = ("FLAIR", "T1w", "T1gd", "T2w")
# Not the identity: 1 x 1 x 1.5 mm voxels, LPS-flipped axes and an origin off zero, as scanners write
# them, so a reader that dropped or mixed up affines would show in the tests.
_AFFINE = np.array([[-1.0, 0.0, 0.0, 90.0], [0.0, -1.0, 0.0, 110.0], [0.0, 0.0, 1.5, -70.0], [0.0, 0.0, 0.0, 1.0]])


def write_synthetic_dataset(directory: Path | str, cases: int = 8, size: int | tuple[int, int, int] = 96,
                            channels: int = 4, classes: int = 4, seed: int = 0,
                            on_case: Callable[[int], None] | None = None) -> Path:
    """Write ``cases`` image/label pairs under ``directory`` (new or empty); return its dataset.json path."""
    directory = Path(directory)
    shape = (size,) * 3 if isinstance(size, int) else tuple(size)
    if cases < 1 or channels < 1 or classes < 2 or len(shape) != 3 or min(shape) < 2:
        raise InputError(f"need cases >= 1, channels >= 1, classes >= 2 and sides >= 2; got cases={cases}, "
                         f"channels={channels}, classes={classes}, size={size}")
    if directory.exists() and any(directory.iterdir()):
        raise InputError(f"{directory} is not empty; give a new or empty folder for the dataset")
    training = []
    for index in range(cases):
        volume, label = make_volume(shape, seed, index, channels, classes)
        name = f"case_{index:03d}.nii.gz"
        image_bytes = nifti_bytes(volume.numpy(), _AFFINE)
        label_bytes = nifti_bytes(label.numpy().astype(np.uint8), _AFFINE)
        _write_shared(directory / "imagesTr" / name, image_bytes)
        _write_shared(directory / "labelsTr" / name, label_bytes)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
        if on_case is not None:
            on_case(index)
    modalities = _BRAIN_MODALITIES if channels == len(_BRAIN_MODALITIES) else tuple(
        f"channel {index}" for index in range(channels))
    description = {
        "name": "oomless-synthetic",
        "description": f"synthetic MRI-like volumes with ellipsoid lesions (oomless make-data, seed {seed})",
        "tensorImageSize": "4D" if channels > 1 else "3D",
        "modality": {str(index): name for index, name in enumerate(modalities)},
        "labels": {"0": "background", **{str(index): f"lesion type {index}" for index in range(1, classes)}},
        "numTraining": cases,
        "numTest": 0,
        "training": training,
        "test": [],
    }
    return _write_shared(directory / "dataset.json", (json.dumps(description, indent=2) + "\n").encode())


def _write_shared(path: Path, data: bytes) -> Path:
    """Atomically, with the permissions the umask gives new files (`atomic_write` does: a dataset on
    shared storage must stay readable by the group that trains on it)."""
    return atomic_write(path, lambda temporary: Path(temporary).write_bytes(data))
