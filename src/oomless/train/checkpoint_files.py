"""Checkpoint files on disk: atomic writes, a checksum verified on every read, the newest intact one.

A checkpoint is one safetensors file, ``step-NNNNNNNN.safetensors``. Two ways it can go bad:

- The writer dies mid-write (killed, power lost). Each file is written under a temporary name in
  the same directory, flushed to disk, then renamed over its final name (``os.replace``: atomic on
  one filesystem), and the directory entry is flushed too; a final name therefore only ever holds a
  whole file. A dead writer leaves a ``.step-*.tmp`` temporary, which is never read and is removed
  by the next write.
- The bytes change afterwards (a truncated copy, a full disk, bit rot, a file edited by hand). The
  metadata carries a SHA-256 over the checkpoint's own metadata and every tensor (name, dtype,
  shape, bytes); a read recomputes it and refuses a file that does not match or does not parse.

Resuming walks the checkpoints from the newest down and takes the first intact one, saying in one
line which newer ones were damaged and why (`newest_intact_checkpoint`).
"""

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from oomless.errors import CheckpointError
from oomless.profile.rss import status_field

FORMAT_VERSION = 2               # 2: with a checksum; 1 (no checksum) is refused
METADATA_KEY = "oomless"
CHECKSUM_KEY = "oomless_sha256"
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)\.safetensors$")
_TEMPORARY_NAME = re.compile(r"^\.step-\d+\.safetensors\..*\.tmp$")


def atomic_write(path: Path | str, write: Callable[[str], None]) -> Path:
    """Call ``write(temporary_path)``, fsync, then rename onto ``path``; no partial file is ever visible."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        try:    # mkstemp makes it 0600: the mode open() would give it, where the filesystem keeps modes
            os.chmod(temporary, 0o666 & ~_umask())
        except OSError:
            pass
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _umask() -> int:
    """The process's file-creation mask, read without setting it where Linux says it (setting it to
    read it back is process-wide, and a thread creating a file meanwhile would get the wrong mode)."""
    mask = status_field("Umask")
    if mask is not None:
        return int(mask, 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_directory(directory: Path) -> None:
    # The rename lives in the directory's entries: without this, a power cut right after it can
    # bring back the old name (or none), and rotation may already have deleted the older file.
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:                       # a platform or filesystem without directory handles
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def checksum(metadata_text: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the metadata text and every tensor's name, dtype, shape and bytes, in name order
    (so it does not depend on how safetensors lays the tensors out in the file)."""
    digest = hashlib.sha256(metadata_text.encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def write_checkpoint_file(path: Path | str, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write ``tensors`` and ``meta`` (JSON-ready) with their checksum, atomically."""
    from safetensors.torch import save_file

    text = json.dumps({**meta, "format_version": FORMAT_VERSION})
    metadata = {METADATA_KEY: text, CHECKSUM_KEY: checksum(text, tensors)}
    return atomic_write(path, lambda temporary: save_file(tensors, temporary, metadata=metadata))


def read_checkpoint_file(path: Path | str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a checkpoint whose checksum matches; `CheckpointError` saying why not."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist", path) from None
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path} is damaged: not a readable safetensors file ({_short(error)})", path) from None
    text = metadata.get(METADATA_KEY)
    if text is None:
        raise CheckpointError(f"{path} is not an oomless checkpoint (no '{METADATA_KEY}' metadata)", path)
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        raise CheckpointError(f"{path} is damaged: its metadata is not JSON", path) from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {version}, this oomless reads format "
                              f"{FORMAT_VERSION} (with a checksum); start a new run in another directory", path)
    if metadata.get(CHECKSUM_KEY) != checksum(text, tensors):
        raise CheckpointError(f"{path} is damaged: its checksum does not match its contents", path)
    return meta, tensors


def _short(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 120 else text[:117] + "..."


def checkpoint_path(directory: Path | str, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.safetensors"


def list_checkpoints(directory: Path | str) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in ``directory``, oldest first; temporaries are ignored.
    Listed by name only: `newest_intact_checkpoint` says which of them can be read."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in directory.iterdir()
             if (match := _CHECKPOINT_NAME.match(entry.name))]
    return sorted(found)


def latest_checkpoint(directory: Path | str) -> Path | None:
    """The newest checkpoint file by name, intact or not (see `newest_intact_checkpoint`)."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def remove_temporaries(directory: Path | str, keep: Path | None = None) -> None:
    """Delete temporaries left by writers that died before their rename (only one process writes
    a run's checkpoints, so none of them can still be in progress)."""
    for entry in Path(directory).iterdir():
        if _TEMPORARY_NAME.match(entry.name) and entry != keep:
            entry.unlink(missing_ok=True)


def newest_intact_checkpoint(directory: Path | str, report: Callable[[str], None] = print) -> tuple[Path, dict] | None:
    """(path, metadata) of the newest checkpoint in ``directory`` whose checksum matches, or None if
    the directory holds no checkpoint. Each newer damaged file is reported in one line through
    ``report``; if every file is damaged, `CheckpointError` names them all."""
    found = list_checkpoints(directory)
    damaged: list[CheckpointError] = []
    for step, path in reversed(found):
        try:
            meta, _ = read_checkpoint_file(path)
        except CheckpointError as error:
            damaged.append(error)
            continue
        if meta.get("step") != step:
            # Intact but misnamed (copied or renamed by hand): taken first for its name, it would hide
            # the newer files on every later resume.
            damaged.append(CheckpointError(f"{path} holds step {meta.get('step')}, not the step {step} its name "
                                           "says: rename or remove it", path))
            continue
        for error in damaged:
            report(f"skipping a damaged checkpoint ({error}); resuming from {path.name}")
        return path, meta
    if damaged:
        reasons = "; ".join(str(error) for error in damaged)
        raise CheckpointError(f"no intact checkpoint in {directory} to resume from: {reasons}. Remove the "
                              "directory (or drop --resume) to start from step 0", Path(directory))
    return None
