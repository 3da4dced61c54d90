"""Staging: copy a dataset once from slow shared storage to a local folder, resumably and atomically.

    oomless train --data /shared/Task01_BrainTumour --stage /local/ssd/brats ...

``STAGE/files/`` receives ``dataset.json`` and every training image and label, at the same relative
paths. Each file is copied to a temporary name in its destination folder, fsynced and renamed, then a
line {path, size, mtime_ns, sha256} is appended to ``STAGE/copied.jsonl``. A later run (after a kill,
or a second run on the same node) verifies each finished file by recomputing its checksum locally and
copies only what is missing, changed at the source (size or modification time), or fails to verify;
temporaries from a killed copy are deleted. ``STAGE/complete.json`` is written last and removed
before anything is copied again, so a half-copied stage is never taken for a finished one.
A lock file keeps two stagers (two runs on one node) from writing the same folder at once.
"""

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomless.data.layout import DatasetLayout, find_dataset
from oomless.errors import InputError
from oomless.train.checkpoint import atomic_write

_CHUNK_BYTES = 8 * 2**20
_RECORDS = "copied.jsonl"
_COMPLETE = "complete.json"


@dataclass(frozen=True)
class StageReport:
    """What staging did: files copied now and files found finished and verified."""

    layout: DatasetLayout            # the dataset as it lies in the stage
    copied: tuple[str, ...]
    verified: tuple[str, ...]
    copied_bytes: int
    checksums: dict[str, str]        # relative path -> sha256, every file of the stage


def files_of(layout: DatasetLayout) -> list[Path]:
    """Every file a training run reads: dataset.json (if any), then each case's image and label."""
    description = layout.root / "dataset.json"
    files = [description] if description.is_file() else []
    return files + [path for case in layout.cases for path in (case.image, case.label)]


def stage_dataset(layout: DatasetLayout, stage_dir: Path | str,
                  on_bytes: Callable[[int], None] | None = None) -> StageReport:
    """Bring ``stage_dir`` to a complete, verified copy of ``layout``'s files; ``on_bytes(n)`` is called
    as bytes are copied or verified (a progress bar)."""
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    files_dir = stage_dir / "files"
    if layout.root.resolve() == files_dir.resolve() or files_dir.resolve().is_relative_to(layout.root.resolve()):
        raise InputError(f"--stage {stage_dir} is inside the dataset {layout.root}; stage to another folder")
    with open(stage_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # held until the with ends, released by the kernel if killed
        _remove_temporaries(files_dir)
        records = _read_records(stage_dir / _RECORDS)
        copied, verified, checksums, copied_bytes = [], [], {}, 0
        for source in files_of(layout):
            relative = layout.relative(source)
            destination = files_dir / relative
            status = source.stat()
            record = records.get(relative)
            if record and _finished(record, status, destination, on_bytes):
                verified.append(relative)
                checksums[relative] = record["sha256"]
                continue
            (stage_dir / _COMPLETE).unlink(missing_ok=True)     # the stage is changing: not complete
            checksum = _copy(source, destination, on_bytes)
            _append_record(stage_dir / _RECORDS, {"path": relative, "size": status.st_size,
                                                  "mtime_ns": status.st_mtime_ns, "sha256": checksum})
            copied.append(relative)
            checksums[relative] = checksum
            copied_bytes += status.st_size
        text = json.dumps({"source": str(layout.root), "files": checksums}, indent=1)
        atomic_write(stage_dir / _COMPLETE, lambda temporary: Path(temporary).write_text(text))
    return StageReport(find_dataset(files_dir), tuple(copied), tuple(verified), copied_bytes, checksums)


def completed_stage(stage_dir: Path | str) -> StageReport | None:
    """A finished stage as another process left it (no copying, no verifying), else None."""
    stage_dir = Path(stage_dir)
    try:
        complete = json.loads((stage_dir / _COMPLETE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return StageReport(find_dataset(stage_dir / "files"), (), tuple(complete["files"]), 0, complete["files"])


def _finished(record: dict, source_status: os.stat_result, destination: Path,
              on_bytes: Callable[[int], None] | None) -> bool:
    """True when ``destination`` is a verified copy of the source ``record`` describes, unchanged since."""
    if (record["size"], record["mtime_ns"]) != (source_status.st_size, source_status.st_mtime_ns):
        return False
    try:
        if destination.stat().st_size != record["size"]:
            return False
        return _sha256(destination, on_bytes) == record["sha256"]
    except FileNotFoundError:
        return False


def _sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()


def _copy(source: Path, destination: Path, on_bytes: Callable[[int], None] | None) -> str:
    """Copy through a temporary name (atomic) and return the sha256 of the bytes copied."""
    digest = hashlib.sha256()

    def write(temporary: str) -> None:
        with open(source, "rb") as reader, open(temporary, "wb") as writer:
            while chunk := reader.read(_CHUNK_BYTES):
                digest.update(chunk)
                writer.write(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
    try:
        atomic_write(destination, write)
    except OSError as error:
        raise InputError(f"staging {source} to {destination} failed: {error}") from None
    return digest.hexdigest()


def _append_record(path: Path, record: dict) -> None:
    # One line per finished file, flushed to disk: a kill can cut the last line short, which
    # _read_records skips, and that file is then verified against nothing and copied again.
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")
        log.flush()
        os.fsync(log.fileno())


def _read_records(path: Path) -> dict[str, dict]:
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                records[record["path"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return records


def _remove_temporaries(files_dir: Path) -> None:
    """Delete what a killed copy left: atomic_write's temporaries, named ``.NAME.XXXX.tmp``."""
    if files_dir.is_dir():
        for temporary in files_dir.rglob(".*.tmp"):
            temporary.unlink(missing_ok=True)
