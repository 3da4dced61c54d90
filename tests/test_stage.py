"""Staging: a copy killed mid-file resumes without copying finished files again, a half-copied stage
is never used, changed or damaged files are copied again, and decoded volumes are cached once."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nibabel")

import oomless.data.prepare as prepare_module                                      # noqa: E402
from oomless.data.layout import find_dataset                                        # noqa: E402
from oomless.data.make_dataset import write_synthetic_dataset                       # noqa: E402
from oomless.data.prepare import prepare_dataset                                    # noqa: E402
from oomless.data.stage import completed_stage, files_of, stage_dataset             # noqa: E402
from oomless.errors import InputError                                               # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("slow-storage") / "task"
    write_synthetic_dataset(directory, cases=4, size=32, channels=2, classes=3, seed=0)
    return directory


def _identity(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_ino, status.st_mtime_ns


def test_a_stager_killed_mid_file_resumes_without_copying_finished_files(source_dir, tmp_path):
    layout = find_dataset(source_dir)
    files = files_of(layout)
    sizes = [path.stat().st_size for path in files]
    assert sizes[5] > 3 * 64 * 1024                  # the sixth file (case_002's image) spans several chunks
    stage_dir = tmp_path / "stage"
    killed = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("stage_kill_child.py")), str(source_dir), str(stage_dir),
         str(sum(sizes[:5]) + 2 * 64 * 1024)],
        env={**os.environ, "PYTHONPATH": str(SOURCE)}, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    # Killed inside the sixth file: its temporary is there, nothing says the stage is complete.
    assert list((stage_dir / "files" / "imagesTr").glob(".case_002.nii.gz.*.tmp"))
    assert completed_stage(stage_dir) is None
    finished = [layout.relative(path) for path in files[:5]]
    before = {relative: _identity(stage_dir / "files" / relative) for relative in finished}

    report = stage_dataset(layout, stage_dir)
    assert list(report.verified) == finished
    assert list(report.copied) == [layout.relative(path) for path in files[5:]]
    assert {relative: _identity(stage_dir / "files" / relative) for relative in finished} == before
    assert not list((stage_dir / "files").rglob("*.tmp"))
    for path in files:
        assert (stage_dir / "files" / layout.relative(path)).read_bytes() == path.read_bytes()
    assert completed_stage(stage_dir) is not None
    assert [case.name for case in report.layout.cases] == [case.name for case in layout.cases]


def test_changed_and_damaged_files_are_copied_again_and_nothing_else(source_dir, tmp_path):
    source = tmp_path / "source"
    write_synthetic_dataset(source, cases=2, size=8, channels=1, classes=2, seed=1)
    layout = find_dataset(source)
    stage_dir = tmp_path / "stage"
    first = stage_dataset(layout, stage_dir)
    assert len(first.copied) == 5 and not first.verified
    assert stage_dataset(layout, stage_dir).copied == ()
    # A source file replaced (new contents and time), and a staged copy damaged on the local disk.
    replaced = source / "labelsTr" / "case_001.nii.gz"
    replaced.write_bytes((source / "labelsTr" / "case_000.nii.gz").read_bytes())
    damaged = stage_dir / "files" / "imagesTr" / "case_000.nii.gz"
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    again = stage_dataset(find_dataset(source), stage_dir)
    assert sorted(again.copied) == ["imagesTr/case_000.nii.gz", "labelsTr/case_001.nii.gz"]
    assert damaged.read_bytes() == (source / "imagesTr" / "case_000.nii.gz").read_bytes()
    with pytest.raises(InputError, match="inside the dataset"):
        stage_dataset(layout, source / "stage")


def test_decoded_cases_are_cached_once_and_redone_when_their_source_changes(source_dir, tmp_path, monkeypatch):
    report = stage_dataset(find_dataset(source_dir), tmp_path / "stage")
    ids = {case.name: report.checksums[report.layout.relative(case.image)] for case in report.layout.cases}
    cache = tmp_path / "stage" / "cache"
    first = prepare_dataset(report.layout, cache, ids)
    assert all(Path(record.cached_image).is_file() for record in first.cases)

    def no_decoding(*args, **kwargs):
        raise AssertionError("a cached case was decoded again")
    monkeypatch.setattr(prepare_module, "decode_case", no_decoding)
    assert prepare_dataset(report.layout, cache, ids) == first
    monkeypatch.undo()
    cached = np.load(first.cases[0].cached_image)
    assert cached.dtype == np.float32 and cached.shape == (2, 32, 32, 32)
    # Another checksum for case_001 (its source changed): that case alone is decoded again.
    decoded = []
    real_decode = prepare_module.decode_case
    monkeypatch.setattr(prepare_module, "decode_case", lambda case, channels: decoded.append(case.name) or real_decode(case, channels))
    prepare_dataset(report.layout, cache, {**ids, "case_001": "another"})
    assert decoded == ["case_001"]
