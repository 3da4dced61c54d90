"""Crash-safe checkpoints in one safetensors file: model, optimizer, RNG states, step, data position.

Under data parallel, rank 0 writes the one file for every rank: its own state at the top level and,
for each other rank r, what differs there under ``rank.<r>.`` (its RNG always; its weights and optimizer
in the relaxed modes, where ranks drift apart between averages). `load_checkpoint(..., rank=r)` restores
rank r's own entries where the file has them and rank 0's otherwise.

Why safetensors for everything: a checkpoint may come from anywhere, and unpickling runs code.
Tensors go in as tensors; everything else (step, optimizer hyper-parameters, Python/NumPy RNG
state) goes in the file's string metadata as JSON. Nothing here ever calls ``pickle``.

Why atomic: a run killed mid-write must leave the previous checkpoint intact. Each file is written
to a temporary name in the same directory (same filesystem, so the rename is atomic), flushed to
disk, then ``os.replace``d over its final name.
"""

import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from oomless.errors import InputError

FORMAT_VERSION = 1
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)\.safetensors$")


def atomic_write(path: Path | str, write: Callable[[str], None]) -> Path:
    """Call ``write(temporary_path)``, fsync, then rename onto ``path``; no partial file is ever visible."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _to_savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (tied weights): the second name gets its own copy.
    seen: set[tuple[int, int]] = set()
    savable = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        seen.add((tensor.untyped_storage().data_ptr(), tensor.storage_offset()))
        savable[name] = tensor
    return savable


def save_weights(path: Path | str, model: nn.Module) -> Path:
    """Write ``model.state_dict()`` as a safetensors file, atomically; load with ``safetensors.torch.load_file``."""
    tensors = _to_savable(model.state_dict())
    return atomic_write(path, lambda temporary: save_file(tensors, temporary, metadata={"format": "pt"}))


def _json_ready(value):
    if isinstance(value, tuple):
        return [_json_ready(item) for item in value]
    if isinstance(value, list):
        return [_json_ready(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} in checkpoint metadata")


def _split_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors: dict[str, torch.Tensor] = {}
    state_meta: dict[str, dict] = {}
    for param_id, param_state in state_dict["state"].items():
        state_meta[str(param_id)] = {}
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.state.{param_id}.{name}"] = value
            else:
                state_meta[str(param_id)][name] = _json_ready(value)
    groups = []
    for index, group in enumerate(state_dict["param_groups"]):
        plain = {}
        for name, value in group.items():
            if isinstance(value, torch.Tensor):            # e.g. a tensor learning rate
                tensors[f"optimizer.param_groups.{index}.{name}"] = value
            else:
                plain[name] = _json_ready(value)
        groups.append(plain)
    return tensors, {"state": state_meta, "param_groups": groups}


def _join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {int(param_id): dict(values) for param_id, values in meta["state"].items()}
    groups = [dict(group) for group in meta["param_groups"]]
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[:2] == ["optimizer", "state"]:
            state.setdefault(int(parts[2]), {})[".".join(parts[3:])] = tensor
        elif parts[:2] == ["optimizer", "param_groups"]:
            groups[int(parts[2])][".".join(parts[3:])] = tensor
    for group in groups:
        # JSON has no tuples; optimizers such as Adam unpack betas and accept either, but keep the type.
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{index}"] = state
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    tensors["rng.numpy.keys"] = torch.from_numpy(keys.astype(np.int64))
    meta = {
        "numpy": [kind, int(position), int(has_gauss), float(cached_gaussian)],
        "python": _json_ready(random.getstate()),
    }
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda_states = [tensors[f"rng.cuda.{index}"] for index in range(torch.cuda.device_count())
                   if f"rng.cuda.{index}" in tensors]
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    kind, position, has_gauss, cached_gaussian = meta["numpy"]
    np.random.set_state((kind, tensors["rng.numpy.keys"].numpy().astype(np.uint32), position, has_gauss,
                         cached_gaussian))
    version, internal, gauss_next = meta["python"]
    random.setstate((version, tuple(internal), gauss_next))


@dataclass
class CheckpointState:
    """What a checkpoint says besides the tensors it restores in place."""

    step: int
    data_position: int
    trajectory: dict = field(default_factory=dict)
    path: Path | None = None


def checkpoint_path(directory: Path | str, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.safetensors"


def list_checkpoints(directory: Path | str) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in ``directory``, oldest first; temporaries are ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in directory.iterdir()
             if (match := _CHECKPOINT_NAME.match(entry.name))]
    return sorted(found)


def latest_checkpoint(directory: Path | str) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def process_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """This process's RNG states and, if given, model and optimizer: (tensors, JSON-ready metadata)."""
    tensors, meta = {}, {}
    if model is not None:
        tensors.update({f"model.{name}": tensor.detach().cpu() for name, tensor in model.state_dict().items()})
    if optimizer is not None:
        optimizer_tensors, meta["optimizer"] = _split_optimizer_state(optimizer.state_dict())
        tensors.update({name: tensor.detach().cpu() for name, tensor in optimizer_tensors.items()})
    rng_tensors, meta["rng"] = _rng_state()
    tensors.update(rng_tensors)
    return tensors, meta


def save_checkpoint(directory: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    data_position: int, trajectory: dict | None = None, keep: int = 2,
                    other_ranks: list[tuple[dict, dict]] | None = None) -> Path:
    """Write ``step-NNNNNNNN.safetensors`` atomically and delete all but the newest ``keep``.

    ``other_ranks[r - 1]`` is rank r's `process_state` (gathered by `oomless.parallel.rank_state`)."""
    tensors, process_meta = process_state(model, optimizer)
    ranks_meta = {}
    for rank, (rank_tensors, rank_meta) in enumerate(other_ranks or [], start=1):
        tensors.update({f"rank.{rank}.{name}": tensor for name, tensor in rank_tensors.items()})
        ranks_meta[str(rank)] = rank_meta
    tensors = _to_savable(tensors)
    meta = {
        "format_version": FORMAT_VERSION, "step": step, "data_position": data_position,
        "optimizer": process_meta["optimizer"], "rng": process_meta["rng"],
        "trajectory": _json_ready(trajectory or {}), "ranks": ranks_meta,
    }
    path = atomic_write(checkpoint_path(directory, step),
                        lambda temporary: save_file(tensors, temporary, metadata={"oomless": json.dumps(meta)}))
    for _, old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True, rank: int = 0) -> CheckpointState:
    """Restore model, optimizer and RNG states in place from ``path``; return step and data position.

    ``rank``: a data-parallel rank restores its own entries (``rank.<r>.``) where the file has them."""
    path = Path(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        raw = (handle.metadata() or {}).get("oomless")
    if raw is None:
        raise InputError(f"{path} is not an oomless checkpoint (no 'oomless' metadata)")
    meta = json.loads(raw)
    if meta.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{path} has checkpoint format {meta.get('format_version')}, expected {FORMAT_VERSION}")
    tensors = load_file(str(path))
    if rank:
        prefix = f"rank.{rank}."
        own = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
        for kind in ("model.", "optimizer.", "rng."):
            if any(name.startswith(kind) for name in own):
                tensors = {name: tensor for name, tensor in tensors.items() if not name.startswith(kind)}
                tensors.update({name: tensor for name, tensor in own.items() if name.startswith(kind)})
        meta = {**meta, **meta.get("ranks", {}).get(str(rank), {})}
    tensors = {name: tensor for name, tensor in tensors.items() if not name.startswith("rank.")}
    model_state = {name[len("model."):]: tensor for name, tensor in tensors.items() if name.startswith("model.")}
    model.load_state_dict(model_state)
    if optimizer is not None:
        optimizer_tensors = {name: tensor for name, tensor in tensors.items() if name.startswith("optimizer.")}
        optimizer.load_state_dict(_join_optimizer_state(optimizer_tensors, meta["optimizer"]))
    if restore_rng:
        _set_rng_state({name: tensor for name, tensor in tensors.items() if name.startswith("rng.")}, meta["rng"])
    return CheckpointState(step=meta["step"], data_position=meta["data_position"],
                           trajectory=meta.get("trajectory", {}), path=path)
