"""Small helpers on tensors and models shared by the profiler and the runtime."""

import torch
import torch.nn as nn

from oomless.errors import InputError


def tensors_in(value) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for tensor in tensors:
        if tensor.device.type == "meta":
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
        else:
            storage = tensor.untyped_storage()
            seen[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_inputs_device(model: nn.Module, example_inputs) -> torch.device:
    device = model_device(model)
    for tensor in tensors_in(example_inputs):
        if tensor.device != device and tensor.device.type != "meta" and device.type != "meta":
            raise InputError(f"example input is on {tensor.device} but the model is on {device}; "
                             f"move the inputs with .to('{device}') (or the model to the inputs' device)")
    return device


def call_model(model: nn.Module, example_inputs):
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)
