"""Profile a deep model for a target device from a few of its identical layers.

    profile = profile_few_layers(model, tokens, "h100", loss_fn=oomless.sum_of_outputs)

A 70-billion-parameter transformer is 80-odd identical layers; profiling each on meta tensors
costs time for numbers that are all the same. Here the model's largest stack of identical layers
(an `nn.ModuleList` or `nn.Sequential` whose children have one class and the same parameter
shapes) is cut to its first ``kept_layers`` for the meta-tensor step (`profile.fake`), then put
back; the profile is extended to the full depth: the first and last layers as profiled, every
layer between a copy of the second one (times, FLOPs, saved bytes, held bytes), and the static totals
(parameters, gradients, optimizer state, buffers) grown by the layers not run. The profile's notes
say so. A model without such a stack (or not deeper than ``kept_layers``) is profiled whole.
"""

from dataclasses import replace

import torch
import torch.nn as nn

from oomless.profile.blocks import find_blocks
from oomless.profile.fake import format_flops, profile_for_target
from oomless.profile.profile import Profile, flops_of

KEPT_LAYERS = 3


def _signature(module: nn.Module) -> tuple:
    return type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def find_layer_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(qualified name, container) of the stack of identical layers holding the most parameters."""
    best, best_count = None, 0
    for name, module in model.named_modules():
        if not name or not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        layers = list(module)
        if len({_signature(layer) for layer in layers}) != 1:
            continue
        count = sum(p.numel() for p in module.parameters())
        if count > best_count:
            best, best_count = (name, module), count
    return best


def cast_bytes(tensors, dtype: torch.dtype | None) -> int:
    """Bytes of ``tensors`` as profiled with ``dtype`` (floating-point ones cast to it; None: their own)."""
    total = 0
    for tensor in tensors:
        size = torch.empty((), dtype=dtype).element_size() if dtype is not None and tensor.is_floating_point() \
            else tensor.element_size()
        total += tensor.numel() * size
    return total


def profile_few_layers(model: nn.Module, example_inputs, target, loss_fn=None, optimizer=None,
                       dtype: torch.dtype | None = None, precision: str = "fp32",
                       kept_layers: int = KEPT_LAYERS) -> Profile:
    """`profile_for_target` of ``model``, run on ``kept_layers`` (at least 3) of its deepest stack
    of identical layers and extended to all of them (module docstring)."""
    kept_layers = max(kept_layers, 3)
    found = find_layer_stack(model)
    if found is None or len(found[1]) <= kept_layers:
        return profile_for_target(model, example_inputs, target, loss_fn=loss_fn, optimizer=optimizer, dtype=dtype,
                                  precision=precision)
    stack_name, stack = found
    # The full model's blocks, named for the cut one: a block policy run on three layers would
    # split them (each holds over a quarter of the saved bytes there, not in the full model).
    names = [name for name, _ in find_blocks(model, None)]
    kept = [name for name in names if not name.startswith(stack_name + ".")
            or int(name[len(stack_name) + 1:].partition(".")[0]) < kept_layers]
    parent_name, _, attribute = stack_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    depth = len(stack)
    layers = list(stack)
    setattr(parent, attribute, type(stack)(layers[:kept_layers]) if isinstance(stack, nn.ModuleList)
            else nn.Sequential(*layers[:kept_layers]))
    try:
        profile = profile_for_target(model, example_inputs, target, loss_fn=loss_fn, optimizer=optimizer,
                                     blocks=kept, dtype=dtype, precision=precision)
    except (IndexError, KeyError, AttributeError):
        # A forward that reads the stack by a count of its own (``for i in range(self.depth):
        # self.layers[i](x)``) cannot run cut: profiled whole.
        profile = None
    finally:
        setattr(parent, attribute, stack)     # the model exactly as found
    if profile is None:
        return profile_for_target(model, example_inputs, target, loss_fn=loss_fn, optimizer=optimizer, dtype=dtype,
                                  precision=precision)
    return extend_profile(profile, stack_name, kept_layers, depth, layers[1], dtype)


def extend_profile(profile: Profile, stack_name: str, kept_layers: int, depth: int, layer: nn.Module,
                   dtype: torch.dtype | None) -> Profile:
    """``profile`` of a model whose stack ``stack_name`` ran ``kept_layers`` layers, extended to
    ``depth`` layers like ``layer`` (module docstring)."""
    def index_of(name: str) -> int | None:
        if name == stack_name or not name.startswith(stack_name + "."):
            return None
        head = name[len(stack_name) + 1:].partition(".")[0]
        return int(head) if head.isdigit() else None

    def renamed(blocks, index: int):
        return [replace(block, name=f"{stack_name}.{index}{block.name[len(stack_name) + 1 + len(str(old)):]}",
                        saved_sizes=list(block.saved_sizes), kept_when_swapped=list(block.kept_when_swapped))
                for block in blocks for old in [index_of(block.name)]]

    by_layer = {i: [b for b in profile.blocks if index_of(b.name) == i] for i in range(kept_layers)}
    positions = [i for i, block in enumerate(profile.blocks) if index_of(block.name) is not None]
    first, last = positions[0], positions[-1]
    middle = [block for i in range(1, depth - 1) for block in renamed(by_layer[1], i)]
    blocks = (profile.blocks[:first] + by_layer[0] + middle + renamed(by_layer[kept_layers - 1], depth - 1)
              + profile.blocks[last + 1:])
    # Which earlier block holds an input names blocks by their position in the profile as measured;
    # the copies move those: left out (every input counts).
    blocks = [replace(block, input_held_earlier=[]) for block in blocks]
    added = depth - kept_layers
    layer_parameter_bytes = cast_bytes(dict.fromkeys(layer.parameters()), dtype)
    layer_gradient_bytes = cast_bytes([p for p in dict.fromkeys(layer.parameters()) if p.requires_grad], dtype)
    gradient_bytes = profile.gradient_bytes + added * layer_gradient_bytes
    state_per_gradient_byte = profile.optimizer_state_bytes / profile.gradient_bytes if profile.gradient_bytes else 0
    layer_flops = flops_of(by_layer[1])
    flops = None if profile.flops is None or layer_flops is None else profile.flops + added * layer_flops
    return replace(
        profile, blocks=blocks,
        parameter_bytes=profile.parameter_bytes + added * layer_parameter_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=round(gradient_bytes * state_per_gradient_byte),
        buffer_bytes=profile.buffer_bytes + added * cast_bytes(dict.fromkeys(layer.buffers()), dtype),
        flops=flops,
        notes=[*profile.notes, f"profiled {kept_layers} of the {depth} identical layers of {stack_name} on meta "
                               f"tensors; layers 1 to {depth - 2} are copies of layer 1's profile, and the static "
                               f"bytes count all {depth}"
                               + ("" if flops is None else f"; the step with all {depth} is {format_flops(flops)} "
                                                           f"(the figure above counts the {kept_layers} run)")])
