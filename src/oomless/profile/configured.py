"""One profiled step under the precision and compilation it will train with.

`oomless.plan` and `oomless.profile` call `profile_configured`: on a target device, the meta-tensor
profile (`profile.fake`) with autocast's casting policy emulated; otherwise the real step
(`profile.profiler`) with the model's forward under the precision's autocast hooks
(`runtime.precision`), with chains split into slabs (`runtime.split`) and, with compile, each block
compiled in place (`runtime.compile`; split chains run eagerly), so the saved bytes and times
measured are those of the step that will train.
"""

import torch.nn as nn

from oomless.errors import InputError
from oomless.profile.blocks import find_blocks
from oomless.profile.profile import Profile
from oomless.profile.profiler import profile_model
from oomless.profile.selective import without_selective
from oomless.profile.tensors import check_inputs_device
from oomless.runtime.compile import compile_blocks, remove_compile
from oomless.runtime.precision import profiling_precision
from oomless.runtime.split import apply_split, check_split_composes, remove_split


def profile_configured(model: nn.Module, example_inputs, loss_fn, optimizer, blocks, target, dtype,
                       memory_bytes: int | None, precision: str, compile_with: dict | None,
                       split: dict[str, int] | None = None) -> Profile:
    if split:
        check_split_composes(target, precision,
                             None if target is not None else check_inputs_device(model, example_inputs))
        # Split first: compiling then leaves the split chains eager, as `oomless.apply` does.
        apply_split(model, split, blocks=[name for name, _ in find_blocks(model, blocks)])
        try:
            measured = profile_configured(model, example_inputs, loss_fn, optimizer, blocks, target, dtype,
                                          memory_bytes, precision, compile_with)
        finally:
            remove_split(model)
        measured.split = dict(split)
        return without_selective(measured)
    if target is not None and compile_with is not None:
        raise InputError("compile=True cannot be profiled for a target device (meta tensors run no compiled code); "
                         "plan for the target with compile=False: sizes are those of the eager step")
    if target is not None:
        from oomless.profile.fake import profile_for_target
        check_inputs_device(model, example_inputs, allow_meta=True)
        return profile_for_target(model, example_inputs, target, loss_fn=loss_fn, optimizer=optimizer,
                                  blocks=blocks, dtype=dtype, precision=precision)
    device = check_inputs_device(model, example_inputs)
    with profiling_precision(model, precision, device):
        if compile_with is None:
            measured = profile_model(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks,
                                     memory_bytes=memory_bytes)
        else:
            measured = _profile_compiled(model, example_inputs, loss_fn, optimizer, blocks, memory_bytes,
                                         compile_with, device)
    measured.precision = precision
    return measured


def _profile_compiled(model, example_inputs, loss_fn, optimizer, blocks, memory_bytes, options, device) -> Profile:
    """The step with each block compiled. The blocks are the policy's repeated children (or
    ``blocks=``), not split further by size as eager plans are: each is a compiled region, and a
    region must never hold a plan block inside it (that block's hooks would be traced into its
    graph); a few larger regions also compile faster and fuse more than many small ones."""
    names = compile_blocks(model, options, device, blocks)
    try:
        measured = profile_model(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, blocks=names,
                                 memory_bytes=memory_bytes, selective=False)
    finally:
        remove_compile(model)
    measured.compiled = True
    return measured
