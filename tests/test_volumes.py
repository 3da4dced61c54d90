"""NIfTI datasets: make-data's files read back as generated, every bad input named before training,
normalisation, fitting to the network's grid and back, exact seeded augmentation, the seeded split."""

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nibabel")

from oomless.data.layout import find_dataset                                     # noqa: E402
from oomless.data.make_dataset import write_synthetic_dataset                    # noqa: E402
from oomless.data.nifti import nifti_bytes, read_nifti                           # noqa: E402
from oomless.data.open import split_cases                                        # noqa: E402
from oomless.data.prepare import normalise_channels, prepare_dataset             # noqa: E402
from oomless.data.synthetic import make_volume                                   # noqa: E402
from oomless.data.volumes import VolumeDataset                                   # noqa: E402
from oomless.errors import InputError                                            # noqa: E402

AFFINE = np.diag([2.0, 1.0, 1.5, 1.0])


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("msd")
    write_synthetic_dataset(directory, cases=4, size=16, channels=3, classes=4, seed=5)
    return directory


def _copy(dataset_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dataset_dir, tmp_path / "copy"))


def _write(path: Path, array: np.ndarray, affine=AFFINE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(nifti_bytes(array, affine))


def test_make_data_writes_a_decathlon_folder_that_reads_back_as_generated(dataset_dir, tmp_path):
    description = json.loads((dataset_dir / "dataset.json").read_text())
    assert len(description["modality"]) == 3 and len(description["labels"]) == 4
    assert [entry["image"] for entry in description["training"]] == [f"./imagesTr/case_{i:03d}.nii.gz" for i in range(4)]
    for index in range(4):
        volume, label = make_volume((16, 16, 16), seed=5, index=index, channels=3, classes=4)
        image, image_affine = read_nifti(dataset_dir / "imagesTr" / f"case_{index:03d}.nii.gz")
        stored_label, label_affine = read_nifti(dataset_dir / "labelsTr" / f"case_{index:03d}.nii.gz", dtype=None)
        assert np.array_equal(image, volume.numpy()) and np.array_equal(stored_label[0], label.numpy())
        assert stored_label.dtype == np.uint8 and np.array_equal(image_affine, label_affine)
    # Several lesion types appear, and the same seed writes the same bytes.
    labels = np.concatenate([read_nifti(path, dtype=None)[0].ravel() for path in sorted((dataset_dir / "labelsTr").iterdir())])
    assert len(np.unique(labels)) >= 3
    again = tmp_path / "again"
    write_synthetic_dataset(again, cases=4, size=16, channels=3, classes=4, seed=5)
    assert all((again / name).read_bytes() == (dataset_dir / name).read_bytes()
               for name in ("dataset.json", "imagesTr/case_002.nii.gz", "labelsTr/case_002.nii.gz"))
    with pytest.raises(InputError, match="not empty"):
        write_synthetic_dataset(again, cases=1, size=8)


def test_prepare_reads_channels_classes_and_affines(dataset_dir):
    prepared = prepare_dataset(find_dataset(dataset_dir))
    assert (prepared.channels, prepared.classes) == (3, 4)
    assert prepared.class_names == ("background", "lesion type 1", "lesion type 2", "lesion type 3")
    record = prepared.cases[0]
    assert record.shape == (16, 16, 16) and record.channels == 3
    assert np.array_equal(np.asarray(record.affine), read_nifti(dataset_dir / "imagesTr/case_000.nii.gz")[1])


def test_folder_of_pairs_infers_channels_and_classes(tmp_path):
    for name, label_max in (("a", 2), ("sub/b", 5)):
        label = np.zeros((8, 8, 8), np.uint8)
        label[2:4, 2:4, 2:4] = label_max
        _write(tmp_path / f"{name}_image.nii.gz", np.random.default_rng(0).random((2, 8, 8, 8), dtype=np.float32))
        _write(tmp_path / f"{name}_label.nii.gz", label)
    (tmp_path / "._a_image.nii.gz").write_bytes(b"macOS resource fork")      # as in the Decathlon tarballs
    layout = find_dataset(tmp_path)
    assert [case.name for case in layout.cases] == ["a", "sub/b"] and layout.labels is None
    prepared = prepare_dataset(layout)
    assert (prepared.channels, prepared.classes) == (2, 6)
    (tmp_path / "c_label.nii.gz").write_bytes((tmp_path / "a_label.nii.gz").read_bytes())
    with pytest.raises(InputError, match=r"c_label\.nii\.gz has no matching image file"):
        find_dataset(tmp_path)


def _bad_missing(root: Path) -> str:
    (root / "labelsTr" / "case_001.nii.gz").unlink()
    return r"lists files that do not exist: .*labelsTr/case_001\.nii\.gz"


def _bad_shape(root: Path) -> str:
    _write(root / "labelsTr" / "case_002.nii.gz", np.zeros((16, 16, 8), np.uint8))
    return r"labelsTr/case_002\.nii\.gz: shape \(16, 16, 8\) differs from its image"


def _bad_affine(root: Path) -> str:
    label, affine = read_nifti(root / "labelsTr" / "case_001.nii.gz", dtype=None)
    affine[0, 3] += 2.0
    _write(root / "labelsTr" / "case_001.nii.gz", label[0], affine)
    return r"labelsTr/case_001\.nii\.gz: affine differs from its image"


def _bad_class(root: Path) -> str:
    label, affine = read_nifti(root / "labelsTr" / "case_003.nii.gz", dtype=None)
    label[0, 0, 0, 0] = 7
    _write(root / "labelsTr" / "case_003.nii.gz", label[0], affine)
    return r"labelsTr/case_003\.nii\.gz: label value 7 is outside the declared classes 0\.\.3"


def _bad_truncated(root: Path) -> str:
    path = root / "imagesTr" / "case_002.nii.gz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return r"imagesTr/case_002\.nii\.gz: cannot read as NIfTI .*truncated"


def _bad_not_gzip(root: Path) -> str:
    (root / "imagesTr" / "case_000.nii.gz").write_bytes(b"<html>404 not found</html>")
    return r"imagesTr/case_000\.nii\.gz: cannot read as NIfTI"


def _bad_channels(root: Path) -> str:
    image, affine = read_nifti(root / "imagesTr" / "case_001.nii.gz")
    _write(root / "imagesTr" / "case_001.nii.gz", image[:2], affine)
    return r"imagesTr/case_001\.nii\.gz: 2 channel\(s\), but the dataset has 3"


def _bad_fractional_label(root: Path) -> str:
    label, affine = read_nifti(root / "labelsTr" / "case_000.nii.gz")
    _write(root / "labelsTr" / "case_000.nii.gz", label[0] + 0.5, affine)
    return r"labelsTr/case_000\.nii\.gz: label values must be whole class numbers"


def _bad_description(root: Path) -> str:
    (root / "dataset.json").write_text('{"training": [')
    return r"dataset\.json: not readable JSON"


@pytest.mark.parametrize("damage", [_bad_missing, _bad_shape, _bad_affine, _bad_class, _bad_truncated, _bad_not_gzip,
                                    _bad_channels, _bad_fractional_label, _bad_description])
def test_bad_input_is_one_error_naming_the_file_and_the_problem(dataset_dir, tmp_path, damage):
    root = _copy(dataset_dir, tmp_path)
    expected = damage(root)
    with pytest.raises(InputError, match=expected):
        prepare_dataset(find_dataset(root))


def test_normalisation_is_per_channel_over_the_foreground():
    rng = np.random.default_rng(0)
    image = np.zeros((2, 6, 6, 6), np.float32)
    image[0, 1:5, 1:5, 1:5] = rng.normal(300.0, 40.0, (4, 4, 4))     # skull-stripped: background exactly 0
    image[1] = rng.normal(-5.0, 2.0, (6, 6, 6))                        # no zeros: all voxels count
    normalised = normalise_channels(image)
    foreground = image[0] != 0
    assert abs(normalised[0][foreground].mean()) < 1e-5 and abs(normalised[0][foreground].std() - 1) < 1e-4
    assert np.all(normalised[0][~foreground] == 0)
    assert abs(normalised[1].mean()) < 1e-5 and abs(normalised[1].std() - 1) < 1e-4


def _uneven_cases(tmp_path: Path):
    shapes = [(12, 8, 16), (16, 12, 8)]
    for index, shape in enumerate(shapes):
        generated, label = make_volume(shape, seed=1, index=index, channels=2, classes=3)
        _write(tmp_path / f"c{index}_image.nii.gz", generated.numpy())
        _write(tmp_path / f"c{index}_label.nii.gz", label.numpy().astype(np.uint8))
    return prepare_dataset(find_dataset(tmp_path))


def test_padding_to_the_grid_and_cropping_back_are_exact(tmp_path):
    prepared = _uneven_cases(tmp_path)
    dataset = VolumeDataset(prepared.cases, shape=(16, 16, 16), classes=prepared.classes, augment=False)
    for index, record in enumerate(prepared.cases):
        image, label = dataset.native(index)
        volume, fitted_label = dataset.fitted(index)
        assert volume.shape == (2, 16, 16, 16) and fitted_label.shape == (16, 16, 16)
        x, y, z = record.shape
        assert torch.equal(volume[:, :x, :y, :z], torch.from_numpy(np.asarray(image)))
        assert volume.abs().sum() == volume[:, :x, :y, :z].abs().sum()               # zeros elsewhere
        assert torch.equal(dataset.unfit(volume, index), torch.from_numpy(np.asarray(image)))
    resampled = VolumeDataset(prepared.cases, shape=(8, 8, 8), classes=3, augment=False, resample=True)
    volume, label = resampled.fitted(0)
    assert volume.shape == (2, 8, 8, 8) and set(label.unique().tolist()) <= {0, 1, 2}
    assert resampled.unfit(torch.zeros(3, 8, 8, 8), 0).shape == (3, 12, 8, 16)


def test_augmentation_moves_voxels_exactly_and_is_seeded(dataset_dir):
    prepared = prepare_dataset(find_dataset(dataset_dir))
    plain = VolumeDataset(prepared.cases, (16, 16, 16), 4, seed=3, augment=False)
    augmented = VolumeDataset(prepared.cases, (16, 16, 16), 4, seed=3, augment=True)
    changed = 0
    for index in range(8):
        volume, label = augmented[index]
        reference_volume, reference_label = plain[index]
        changed += not torch.equal(volume, reference_volume)
        # A flip or a quarter turn only moves voxels: the same values, and each voxel keeps its label.
        assert torch.equal(volume.flatten(1).sort().values, reference_volume.flatten(1).sort().values)
        for lesion in range(4):
            assert torch.equal(volume[:, label == lesion].sort().values, reference_volume[:, reference_label == lesion].sort().values)
        again = VolumeDataset(prepared.cases, (16, 16, 16), 4, seed=3, augment=True)[index]
        assert torch.equal(volume, again[0]) and torch.equal(label, again[1])
    assert changed >= 5


def test_every_epoch_visits_every_case_once_in_a_seeded_order(dataset_dir):
    prepared = prepare_dataset(find_dataset(dataset_dir))
    dataset = VolumeDataset(prepared.cases, (16, 16, 16), 4, seed=0)
    epochs = [[dataset.case_of(epoch * 4 + position) for position in range(4)] for epoch in range(3)]
    assert all(sorted(order) == [0, 1, 2, 3] for order in epochs)
    assert len({tuple(order) for order in epochs}) > 1


def test_the_split_is_fixed_by_the_seed_disjoint_and_complete(dataset_dir):
    prepared = prepare_dataset(find_dataset(dataset_dir))
    train, held_out = split_cases(prepared, seed=0, validation_fraction=0.25)
    assert len(held_out) == 1 and len(train) == 3
    assert {case.name for case in train} | {case.name for case in held_out} == {case.name for case in prepared.cases}
    assert split_cases(prepared, seed=0, validation_fraction=0.25) == (train, held_out)
    assert {split_cases(prepared, seed=seed, validation_fraction=0.25)[1][0].name for seed in range(8)} != {held_out[0].name}
    assert split_cases(prepared, seed=0, validation_fraction=0.0)[1] == []


def test_a_gzip_cut_short_is_caught_even_when_its_header_reads(tmp_path):
    path = tmp_path / "x_image.nii.gz"
    _write(path, np.random.default_rng(0).random((32, 32, 32), dtype=np.float32))
    whole = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(whole)[:-200])
    with pytest.raises(InputError, match="x_image.nii.gz: cannot read as NIfTI"):
        read_nifti(path)
