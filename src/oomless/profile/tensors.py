"""Small helpers on tensors and models shared by the profiler and the runtime."""

import torch
import torch.nn as nn

from oomless.errors import InputError


def tensors_in(value) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.untyped_storage()`` exists: not for sparse or nested tensors."""
    return not (tensor.is_sparse or tensor.is_nested)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for tensor in tensors:
        if tensor.is_sparse:            # COO: no storage of its own (untyped_storage() raises)
            seen[id(tensor)] = storage_bytes([tensor._indices(), tensor._values()])
        elif tensor.device.type == "meta":
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
        else:
            storage = tensor.untyped_storage()
            seen[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_inputs_device(model: nn.Module, example_inputs, allow_meta: bool = False) -> torch.device:
    """The device the model computes on; inputs must be there too (meta only when planning for a
    target device on fake tensors)."""
    device = model_device(model)
    for tensor in tensors_in(example_inputs):
        if allow_meta and "meta" in (tensor.device.type, device.type):
            continue
        if tensor.device != device:
            raise InputError(f"example input is on {tensor.device} but the model is on {device}; "
                             f"move the inputs with .to('{device}') (or the model to the inputs' device)")
    if device.type == "meta" and not allow_meta:
        raise InputError("the model is on the meta device: a real step cannot run there; move it to a "
                         "real device, or plan for a target device with target=...")
    return device


def call_model(model: nn.Module, example_inputs):
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)
