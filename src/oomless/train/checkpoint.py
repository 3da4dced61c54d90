"""Crash-safe checkpoints in one safetensors file: model, optimizer, RNG states, step, data position.

Under data parallel, rank 0 writes the one file for every rank: its own state at the top level and,
for each other rank r, what differs there under ``rank.<r>.`` (its RNG always; its weights and optimizer
in the relaxed modes, where ranks drift apart between averages). `load_checkpoint(..., rank=r)` restores
rank r's own entries where the file has them and rank 0's otherwise.

Why safetensors for everything: a checkpoint may come from anywhere, and unpickling runs code.
Tensors go in as tensors; everything else (step, optimizer hyper-parameters, Python/NumPy RNG
state) goes in the file's string metadata as JSON. Nothing here ever calls ``pickle``.

Why verified: a checkpoint is only ever read after its checksum matches, and a resumed run takes the
newest intact one (`oomless.train.checkpoint_files`: atomic writes, the checksum, the search). The
model's shapes are compared with the file's before any weight is loaded.
"""

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from oomless.errors import CheckpointError
from oomless.train.checkpoint_files import (atomic_write, checkpoint_path, latest_checkpoint, list_checkpoints,
                                            newest_intact_checkpoint, read_checkpoint_file, remove_temporaries,
                                            write_checkpoint_file)
from oomless.runtime.precision import load_loss_scale_state, loss_scale_state

__all__ = ["CheckpointState", "atomic_write", "check_settings", "checkpoint_path", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "newest_intact_checkpoint", "process_state", "save_checkpoint",
           "save_weights"]


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


def save_weights(path: Path | str, model: nn.Module, model_state: dict | None = None) -> Path:
    """Write ``model.state_dict()`` (or ``model_state``: the full state of a sharded model) as a
    safetensors file, atomically; load with ``safetensors.torch.load_file``."""
    tensors = _to_savable(model.state_dict() if model_state is None else model_state)
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
    # The training loop's sums since its last log line ({"loss_sum", "dice_sum": tensors; "steps",
    # "log_every", "world_size"}), so that a resumed run logs, and tests --switch-when on, the means
    # an uninterrupted one does.
    log_window: dict | None = None


def process_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                  full_state: tuple[dict, dict] | None = None, log_window: dict | None = None) -> tuple[dict, dict]:
    """This process's RNG states and, if given, model and optimizer: (tensors, JSON-ready metadata).
    ``full_state``: (model state, optimizer state) to write instead of the model's and optimizer's
    own state_dict (a sharded layout's full tensors, gathered by its strategy's ``full_state``);
    ``log_window``: the loop's sums since its last log (`CheckpointState.log_window`)."""
    tensors, meta = {}, {}
    if log_window is not None:
        tensors.update({f"log.{name}": log_window[name].detach().cpu() for name in ("loss_sum", "dice_sum")})
        meta["log_window"] = {name: value for name, value in log_window.items() if not isinstance(value, torch.Tensor)}
    model_state, optimizer_state = full_state if full_state is not None else (
        model.state_dict() if model is not None else None, optimizer.state_dict() if optimizer is not None else None)
    if model is not None:
        tensors.update({f"model.{name}": tensor.detach().cpu() for name, tensor in model_state.items()})
    if optimizer is not None:
        optimizer_tensors, meta["optimizer"] = _split_optimizer_state(optimizer_state)
        tensors.update({name: tensor.detach().cpu() for name, tensor in optimizer_tensors.items()})
    if model is not None and loss_scale_state(model) is not None:
        meta["loss_scale"] = loss_scale_state(model)        # fp16: resuming continues with the same scale
    rng_tensors, meta["rng"] = _rng_state()
    tensors.update(rng_tensors)
    return tensors, meta


def save_checkpoint(directory: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    data_position: int, trajectory: dict | None = None, keep: int = 2,
                    other_ranks: list[tuple[dict, dict]] | None = None,
                    full_state: tuple[dict, dict] | None = None, log_window: dict | None = None) -> Path:
    """Write ``step-NNNNNNNN.safetensors`` atomically, with its checksum, then delete all but the
    newest ``keep`` (only once the new file is on disk, so a crash never leaves fewer).

    ``other_ranks[r - 1]`` is rank r's `process_state` (gathered by `oomless.parallel.rank_state`);
    ``full_state``, ``log_window``: as `process_state` takes them."""
    tensors, process_meta = process_state(model, optimizer, full_state, log_window)
    ranks_meta = {}
    for rank, (rank_tensors, rank_meta) in enumerate(other_ranks or [], start=1):
        tensors.update({f"rank.{rank}.{name}": tensor for name, tensor in rank_tensors.items()})
        ranks_meta[str(rank)] = rank_meta
    meta = {
        "step": step, "data_position": data_position,
        "optimizer": process_meta["optimizer"], "rng": process_meta["rng"],
        **{name: process_meta[name] for name in ("loss_scale", "log_window") if name in process_meta},
        "trajectory": _json_ready(trajectory or {}), "ranks": ranks_meta,
    }
    path = write_checkpoint_file(checkpoint_path(directory, step), _to_savable(tensors), meta)
    remove_temporaries(directory)
    for _, old in list_checkpoints(directory)[:-keep]:
        if old != path:         # a misnamed file named for a later step sorts after the one just written
            old.unlink(missing_ok=True)
    return path


def check_settings(path: Path | str, meta: dict, expected: dict) -> None:
    """Refuse a checkpoint whose run had other trajectory settings (`TrainConfig.trajectory`) than
    ``expected``: resuming it would train a model that equals neither run."""
    saved = meta.get("trajectory", {})
    different = {name: (saved.get(name), value) for name, value in expected.items()
                 if _same_setting(name, saved.get(name)) != _same_setting(name, value)}
    if different:
        listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in different.items())
        raise CheckpointError(f"cannot resume {path}: the run was started with different settings ({listed}); "
                              "resume with the old settings or start in another --checkpoint-dir", path)


def _same_setting(name: str, value):
    """A setting as compared across runs: ``size`` 16 is the cube [16, 16, 16] it stands for."""
    if name == "size" and isinstance(value, int):
        return [value] * 3
    return value


def _check_shapes(path: Path, model_state: dict[str, torch.Tensor], model: nn.Module,
                  optimizer: torch.optim.Optimizer | None, optimizer_meta: dict | None) -> None:
    # load_state_dict would copy matching tensors before failing on the first mismatch: compare first.
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    found = {name: tuple(tensor.shape) for name, tensor in model_state.items()}
    problems = [f"{name} missing" for name in expected if name not in found]
    problems += [f"{name} not in the model" for name in found if name not in expected]
    problems += [f"{name} {list(found[name])} in the file, {list(shape)} in the model"
                 for name, shape in expected.items() if name in found and found[name] != shape]
    if optimizer is not None and not problems:
        saved_groups = [len(group.get("params", [])) for group in (optimizer_meta or {}).get("param_groups", [])]
        groups = [len(group["params"]) for group in optimizer.param_groups]
        if saved_groups != groups:
            problems.append(f"optimizer parameter groups of sizes {saved_groups} in the file, {groups} here")
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(f"{path} does not fit this model ({'; '.join(problems[:3])}{more}): it was written "
                              "for another model or other settings", path)


def _copy_what_the_optimizer_kept(optimizer: torch.optim.Optimizer, file_tensors) -> None:
    """Replace the file's tensors that ``optimizer`` holds as they were loaded by copies of their own.

    The file's tensors are slices of one mapping of the whole file (safetensors' ``safe_open``), and each
    keeps all of it alive. ``load_state_dict`` keeps some as they are: Adam's step counters always (0-d,
    on the host), every state tensor already on the parameters' device and dtype (CPU). One kept tensor
    held the whole checkpoint resident through the run: with the state off the device, a resumed
    ``--size 32 --memory 52MiB`` run held 4.06 MiB (the file) more than a fresh one, and its steps
    measured 54.6-55.1 MiB against the plan's 52.0. Copied, the mapping goes when this returns."""
    from_file = {id(tensor) for tensor in file_tensors}
    for holder in [*optimizer.state.values(), *optimizer.param_groups]:
        for key, value in holder.items():
            if id(value) in from_file:
                holder[key] = value.clone()


def load_checkpoint(path: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True, rank: int = 0, expected_settings: dict | None = None,
                    load_state=None, average_replicas: bool = False) -> CheckpointState:
    """Restore model, optimizer and RNG states in place from ``path``; return step and data position.

    The file's checksum, then ``expected_settings`` (`check_settings`), then every shape are checked
    before anything is restored: a refused checkpoint (`CheckpointError`) leaves the model as it was.
    ``rank``: a data-parallel rank restores its own entries (``rank.<r>.``) where the file has them.
    ``average_replicas``: a layout whose ranks hold one model (dp, fsdp, a pipeline, one process)
    resuming a relaxed mode's file, whose ranks held their own: every rank restores the mean of
    the file's replicas (weights, floating-point buffers and optimizer state), what a switch of
    layout there would have given (`oomless.parallel.relaxed`'s ``finish``).
    ``load_state(model, optimizer, model_state, optimizer_state)`` loads the file's full tensors
    instead of ``load_state_dict`` (a sharded layout keeps its shard of each: the strategy's
    ``load_full_state``)."""
    path = Path(path)
    meta, tensors = read_checkpoint_file(path)
    if expected_settings is not None:
        check_settings(path, meta, expected_settings)
    if average_replicas:
        tensors = _replicas_averaged(tensors)
    if rank:
        prefix = f"rank.{rank}."
        own = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
        for kind in ("model.", "optimizer.", "rng.", "log."):
            if any(name.startswith(kind) for name in own):
                tensors = {name: tensor for name, tensor in tensors.items() if not name.startswith(kind)}
                tensors.update({name: tensor for name, tensor in own.items() if name.startswith(kind)})
        meta = {**meta, **meta.get("ranks", {}).get(str(rank), {})}
    tensors = {name: tensor for name, tensor in tensors.items() if not name.startswith("rank.")}
    model_state = {name[len("model."):]: tensor for name, tensor in tensors.items() if name.startswith("model.")}
    _check_shapes(path, model_state, model, optimizer, meta.get("optimizer"))
    optimizer_state = None
    if optimizer is not None:
        optimizer_tensors = {name: tensor for name, tensor in tensors.items() if name.startswith("optimizer.")}
        optimizer_state = _join_optimizer_state(optimizer_tensors, meta["optimizer"])
    if load_state is not None:
        load_state(model, optimizer, model_state, optimizer_state)
    else:
        model.load_state_dict(model_state)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
    if optimizer is not None:
        _copy_what_the_optimizer_kept(optimizer, optimizer_tensors.values())
    load_loss_scale_state(model, meta.get("loss_scale"))
    if restore_rng:
        _set_rng_state({name: tensor for name, tensor in tensors.items() if name.startswith("rng.")}, meta["rng"])
    log_window = None
    if meta.get("log_window") and "log.loss_sum" in tensors and "log.dice_sum" in tensors:
        log_window = {"loss_sum": tensors["log.loss_sum"].clone(), "dice_sum": tensors["log.dice_sum"].clone(),
                      **meta["log_window"]}
    return CheckpointState(step=meta["step"], data_position=meta["data_position"],
                           trajectory=meta.get("trajectory", {}), path=path, log_window=log_window)


def _replicas_averaged(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each floating-point model and optimizer entry the mean over the file's
    replicas (rank 0's at the top level, rank r's under ``rank.<r>.``), summed in rank order and
    divided by their number, as the relaxed modes' final average is; the ranks' own entries dropped."""
    replicated = ("model.", "optimizer.")
    ranks = sorted({int(name.split(".")[1]) for name in tensors
                    if name.startswith("rank.") and name.split(".", 2)[2].startswith(replicated)})
    if not ranks:
        return tensors
    averaged = {name: tensor for name, tensor in tensors.items()
                if not (name.startswith("rank.") and name.split(".", 2)[2].startswith(replicated))}
    for name, tensor in tensors.items():
        replicas = [tensors.get(f"rank.{rank}.{name}") for rank in ranks]
        if name.startswith(replicated) and tensor.is_floating_point() and all(r is not None for r in replicas):
            total = tensor.clone()
            for replica in replicas:
                total += replica
            averaged[name] = total / (len(ranks) + 1)
    return averaged
