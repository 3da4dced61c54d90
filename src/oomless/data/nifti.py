"""Reading and writing NIfTI volumes with nibabel (``pip install "oomless[medical]"``).

Arrays come back channels-first for PyTorch: a 3D file (X, Y, Z) is (1, X, Y, Z), a 4D file
(X, Y, Z, C), the Medical Segmentation Decathlon's multi-modal layout, is (C, X, Y, Z). The voxel
axes are kept in file order (no reorientation), so a prediction written back with the input's affine
lies exactly on the input in any viewer.

Every failure to read names the file and what is wrong: a truncated ``.nii.gz`` only shows itself
when the whole stream is decompressed, so ``read_nifti`` always reads the data, never just the header.
"""

import gzip
import zlib
from pathlib import Path

import numpy as np

from oomless.errors import InputError

INSTALL_HINT = 'reading NIfTI needs nibabel: pip install "oomless[medical]"'


def nibabel():
    """The nibabel module, or an InputError saying how to install it."""
    try:
        import nibabel as module
    except ImportError:
        raise InputError(INSTALL_HINT) from None
    return module


def read_nifti(path: Path | str, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(array channels-first (C, X, Y, Z) as ``dtype`` (None: as stored), affine (4, 4) float64) of a
    .nii or .nii.gz file."""
    nib = nibabel()
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    try:
        image = nib.load(str(path))
        data = np.asanyarray(image.dataobj)
    except (OSError, EOFError, zlib.error, ValueError, nib.filebasedimages.ImageFileError) as error:
        # EOFError / zlib.error: a truncated or corrupt gzip stream; OSError: not gzip at all;
        # ImageFileError / ValueError: not a NIfTI header, or data shorter than the header says.
        raise InputError(f"{path}: cannot read as NIfTI ({type(error).__name__}: {error}); "
                         f"the file is truncated or not a NIfTI volume, copy or export it again") from None
    if data.ndim == 3:
        data = data[np.newaxis]
    elif data.ndim == 4:
        data = np.moveaxis(data, -1, 0)
    elif data.ndim == 5 and data.shape[3] == 1:          # (X, Y, Z, 1, C): NIfTI's vector intent
        data = np.moveaxis(data[:, :, :, 0], -1, 0)
    else:
        raise InputError(f"{path}: expected a 3D volume or 4D (X, Y, Z, channels), got shape {data.shape}")
    if not np.issubdtype(data.dtype, np.number):
        raise InputError(f"{path}: voxel type {data.dtype} is not numeric")
    return np.ascontiguousarray(data, dtype=dtype or data.dtype), np.asarray(image.affine, dtype=np.float64)


def nifti_bytes(array: np.ndarray, affine: np.ndarray, compress: bool = True) -> bytes:
    """A channels-first array (C, X, Y, Z) or a 3D one as the bytes of a .nii.gz (or .nii) file.

    Bytes rather than a path so callers write them atomically (nibabel picks the format from the file
    name, which a temporary name would hide)."""
    nib = nibabel()
    if array.ndim == 4:
        array = array[0] if array.shape[0] == 1 else np.moveaxis(array, 0, -1)
    image = nib.Nifti1Image(np.ascontiguousarray(array), np.asarray(affine, dtype=np.float64))
    image.header.set_xyzt_units("mm")
    raw = image.to_bytes()
    # Level 1: volumes of noisy floats barely compress further, and level 9 costs 5-10x the time.
    return gzip.compress(raw, compresslevel=1, mtime=0) if compress else raw
