"""Profile one training step for a target device on the meta device: nothing is allocated.

    profile = profile_for_target(model, example_inputs, "h100", dtype=torch.bfloat16)

The model may live on the meta device (built under ``with torch.device("meta"):``) or anywhere
else: its parameters and buffers are replaced for the step by meta stand-ins through
`torch.func.functional_call`, so the model itself is left exactly as found. Forward, loss and
backward then run on meta tensors, which carry shapes, dtypes and storages but no data.

Per block, the same numbers the real profiler measures:
- saved-activation bytes, by storage, with the runtime's semantics (`runtime/saved.py`): the first
  block to save a storage owns it, parameters, buffers and the forward's inputs never count, saves
  outside every block are "unassigned";
- input, output and held bytes (earlier blocks' outputs still alive at a block's start, gradients
  alive when its backward starts);
- seconds from a roofline per aten op (`profile.roofline`);
- working memory ("other" and peak bytes per phase, as the real profiler's all-swap step measures
  them): the meta storages alive after each op (`profile.fake_memory`), without kernels' workspaces
  or the allocator's rounding, for which the planner keeps its larger margin.
- attention (`torch.nn.functional.scaled_dot_product_attention`) as the GPU's fused kernel, not the
  math fallback meta tensors would take (`profile.fake_attention`), and dropout as its fused
  kernel, which keeps a boolean mask, not the noise in the input's dtype (`profile.fake_dropout`).
"""

import itertools
import time
import weakref
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from oomless.plan.devices import find_device
from oomless.profile.blocks import batchnorm_channels, find_blocks
from oomless.profile.fake_attention import FusedAttention
from oomless.profile.fake_autocast import FakeAutocast
from oomless.profile.fake_dropout import FusedDropout
from oomless.profile.fake_memory import MetaMemory, PhasePeaks
from oomless.profile.profile import BlockProfile, Profile
from oomless.profile.profiler import _OPTIMIZER_STATE_COPIES, _refined, loss_of
from oomless.profile.roofline import Roofline
from oomless.profile.tensors import (ChangedAfterCalls, InputSharing, add_saved_earlier, alive_bytes, attributes_kept,
                                     earlier_saves_by_place, holders_by_place, parameters_read_by,
                                     stand_ins_swapped, tensor_bytes, tensors_in, versions)

_LOSS = -1


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _FakeRecorder:
    """Block boundaries, saved storages and held bytes during the meta step."""

    def __init__(self, names: list[str], resident: set[int]):
        self.blocks = {index: BlockProfile(name, flops=0.0) for index, name in enumerate(names)}
        self.order: list[int] = []
        self.resident = resident
        self.sharing = InputSharing(_storage_key)   # blocks' inputs an earlier block had
        self.input_versions: dict = {}              # a running block's inputs' versions (`versions`)
        self.changed_after = ChangedAfterCalls()    # and whether the model changes them after the call
        self.memory = MetaMemory(set(resident))
        self.peaks = PhasePeaks()
        self.phase: tuple | None = None     # as `PhasePeaks` names them
        self.forward_block: int | None = None
        self.backward_block: int | None = None
        self.in_backward = False
        self.loss_seconds = 0.0
        self.unassigned_saved_bytes = 0
        # {storage key: (weak reference, its number in the order saved, bytes, (its first saver, its
        # index in that block's saved_sizes) or None)} of the storages saved in the forward, and {that
        # number: the tensors brought back for backward, while one is alive}.
        self.saved_storages: dict[int, tuple[StorageWeakRef, int, int, tuple[int, int] | None]] = {}
        self.numbers = itertools.count()
        self.brought_back: dict[int, list[weakref.ref]] = {}
        self.bringing_back = False      # an unpack's own allocation: not read as "other" (it is the ledger's)
        self.live_outputs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_gradients: dict[int, tuple[StorageWeakRef, int]] = {}

    def made(self, out) -> None:
        """After each op: its outputs counted, and the memory alive now read for the running phase."""
        self.memory.made(tensors_in(out))
        if not self.bringing_back:
            self.peaks.read(self.phase, self.memory.alive())

    def accumulated(self, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            self.memory.accumulated(parameter.grad)

    def charge(self, seconds: float, flops: float) -> None:
        if self.in_backward:
            if self.backward_block is None:
                self.loss_seconds += seconds
            else:
                self.blocks[self.backward_block].backward_seconds += seconds
                self.blocks[self.backward_block].flops += flops
        elif self.forward_block is not None:
            self.blocks[self.forward_block].forward_seconds += seconds
            self.blocks[self.forward_block].flops += flops
        else:
            self.loss_seconds += seconds  # between blocks and after them: embeddings' glue, the loss

    def pack(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.is_sparse or tensor.is_nested:
            return tensor
        key = _storage_key(tensor)
        if key in self.resident:
            return tensor
        described = (tensor.dtype, tensor.storage_offset(), tensor.shape, tensor.stride())
        if self.forward_block is not None:
            # On the runtime's ledger from its save while the storage lives (`profile.fake_memory`):
            # what the forward still holds of it is not working memory. A save outside every block
            # is not on it (the runtime keeps such a tensor as plain PyTorch does).
            self.memory.on_ledger(tensor)
        seen = self.saved_storages.get(key)
        if seen is not None and not seen[0].expired():
            # A storage already saved in this forward: counted once, by its first saver, and, as the
            # runtime swaps a storage once for all its saves, brought back once for all of them.
            self._saved_again(seen[3])
            return (seen[1], seen[2], *described)
        storage = tensor.untyped_storage()
        num_bytes = storage.nbytes()
        number = next(self.numbers)
        first = None
        if self.forward_block is None:
            self.unassigned_saved_bytes += num_bytes
        else:
            block = self.blocks[self.forward_block]
            if self.sharing.saved(self.forward_block, tensor):
                block.input_saved_bytes += num_bytes
            if not self.in_backward:
                first = (self.forward_block, len(block.saved_sizes))
            block.saved_bytes += num_bytes
            block.saved_sizes.append(num_bytes)
            block.largest_saved_bytes = max(block.largest_saved_bytes, num_bytes)
        self.saved_storages[key] = (StorageWeakRef(storage), number, num_bytes, first)
        # Keep only the description, as the profiling runtime's swap does: the saved tensor must
        # not keep its storage (and so the held-bytes tracking) alive until backward.
        return (number, num_bytes, *described)

    def _saved_again(self, first: tuple[int, int] | None) -> None:
        """The running block saves a storage ``first`` (its saver, its index there) saved first: as
        the real recorder's `saved_again`, a `BlockProfile.saved_earlier` record in recorder numbers."""
        if first is None or self.in_backward or self.forward_block is None or first[0] == self.forward_block:
            return
        add_saved_earlier(self.blocks[self.forward_block], *first)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        number, num_bytes, dtype, offset, shape, stride = packed
        alive = [tensor for tensor in (ref() for ref in self.brought_back.get(number, [])) if tensor is not None]
        self.bringing_back = True       # what it allocates is on the ledger, not read as "other" meanwhile
        try:
            if alive:
                storage = alive[0].untyped_storage()    # brought back once for all its saves, as the runtime does
            else:
                storage = torch.empty(num_bytes, dtype=torch.uint8, device="meta").untyped_storage()
            tensor = torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, shape, stride)
            if not alive:
                self.memory.on_ledger(tensor)
        finally:
            self.bringing_back = False
        self.brought_back.setdefault(number, []).append(weakref.ref(tensor))
        return tensor

    def _track(self, live: dict, tensors) -> None:
        for tensor in tensors:
            key = _storage_key(tensor)
            if key not in self.resident:
                live[key] = (StorageWeakRef(tensor.untyped_storage()), tensor.untyped_storage().nbytes())

    def pre_hook(self, index: int):
        def hook(module, args, kwargs=None):
            if index not in self.order:
                self.order.append(index)
            block = self.blocks[index]
            block.calls += 1
            inputs = tensors_in((args, kwargs))
            block.input_bytes += _distinct_bytes(inputs)
            block.input_held_earlier += self.sharing.block_started(index, inputs, self.resident)
            block.held_forward_bytes = max(block.held_forward_bytes, alive_bytes(self.live_outputs))
            self.forward_block = index
            self.input_versions[index] = versions(inputs)
            self.changed_after.look()
            self.phase = ("forward", index)
        return hook

    def post_hook(self, index: int):
        def hook(module, args, output):
            self.forward_block = None
            self.sharing.block_finished(index)
            block = self.blocks[index]
            block.changes_input |= self.changed_after.call_ended(index, self.input_versions.pop(index, []))
            outputs = tensors_in(output)
            block.output_bytes += _distinct_bytes(outputs)
            self._track(self.live_outputs, outputs)
            for tensor in outputs:
                if tensor.requires_grad:
                    tensor.register_hook(self._backward_mark(index))
                    break
        return hook

    def _backward_mark(self, index: int):
        def hook(grad):
            self.backward_block = index
            self.phase = ("backward", index)
            self._track(self.live_gradients, [grad])
            block = self.blocks[index]
            block.held_backward_bytes = max(block.held_backward_bytes, alive_bytes(self.live_gradients))
        return hook


def _distinct_bytes(tensors) -> int:
    return sum({_storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def _meta_like(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return torch.empty(tensor.shape, dtype=cast, device="meta")


def profile_for_target(model: nn.Module, example_inputs, target, loss_fn=None, optimizer=None, blocks=None,
                       dtype: torch.dtype | None = None, precision: str = "fp32") -> Profile:
    """One training step of ``model`` on meta tensors, timed by the roofline of ``target``.

    ``dtype`` casts floating-point parameters, buffers and inputs (e.g. torch.bfloat16 for pure
    bf16 training); by default each keeps its own dtype. ``precision`` "bf16" / "fp16" runs the
    forward under CUDA autocast's casting policy (`oomless.profile.fake_autocast`) with the
    outputs brought back to fp32 for the loss, as the runtime does (`oomless.runtime.precision`).
    """
    from oomless.runtime.precision import autocast_dtype

    precision_dtype = autocast_dtype(precision)
    device = find_device(target)
    started = time.perf_counter()
    found = find_blocks(model, blocks)
    notes = [f"profiled on meta tensors for {device.name}: times are a roofline from datasheet peaks "
             f"({device.source}); working memory is traced on meta tensors, without kernels' workspaces"]
    if precision_dtype is not None:
        notes.append(f"{precision}: CUDA autocast's casting policy applied on meta tensors (profile/fake_autocast.py)")
    # One stand-in per distinct parameter, so tied weights stay tied in the step.
    stand_ins: dict[int, torch.Tensor] = {}
    for parameter in model.parameters():
        stand_ins[id(parameter)] = _meta_like(parameter, dtype).requires_grad_(parameter.requires_grad)
    for buffer in model.buffers():
        stand_ins[id(buffer)] = _meta_like(buffer, dtype)
    inputs = tree_map(lambda value: _meta_like(value, dtype) if isinstance(value, torch.Tensor) else value,
                      example_inputs)
    parameters = [stand_ins[id(p)] for p in dict.fromkeys(model.parameters())]
    buffers = [stand_ins[id(b)] for b in dict.fromkeys(model.buffers())]
    resident = {_storage_key(t) for t in (*stand_ins.values(), *tensors_in(inputs))}

    # Parameters the loss reads itself (a head's weight read by oomless.linear_cross_entropy: an untied
    # one outside the model, a tied one as the model holds it, not its stand-in): the step runs on
    # them as they are, their gradients are static bytes once accumulated (counted by the caller,
    # `profile.loss_parameters`), and they are put back as found.
    own, others = parameters_read_by(loss_fn, model)
    loss_held = [*own.values(), *others]
    resident |= {_storage_key(parameter) for parameter in loss_held}     # static, never saved or working memory

    def step(found):
        recorder = _FakeRecorder([name for name, _ in found], resident)
        roofline = Roofline(device, recorder.charge, recorder.made)
        handles = [p.register_post_accumulate_grad_hook(recorder.accumulated)
                   for p in dict.fromkeys([*parameters, *loss_held]) if p.requires_grad]
        try:
            for index, (_, module) in enumerate(found):
                handles.append(module.register_forward_pre_hook(recorder.pre_hook(index), with_kwargs=True))
                handles.append(module.register_forward_hook(recorder.post_hook(index)))
            # Each step starts from the modules' attributes as found and leaves them so: a cache the
            # forward makes (a grid, a mask) on meta tensors would break the next real forward.
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack), roofline, \
                    attributes_kept(model):
                args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
                kwargs = inputs if isinstance(inputs, dict) else {}
                # Attention and dropout as the GPU's fused kernels (outside autocast's mode: they see
                # autocast's dtypes).
                autocast = FakeAutocast(precision_dtype, parameters) if precision_dtype else nullcontext()
                with FusedAttention(), FusedDropout(), autocast, \
                        stand_ins_swapped(model, lambda tensor: stand_ins[id(tensor)]):
                    output = model(*(() if kwargs else tuple(args)), **kwargs)
                recorder.phase = ("loss", _LOSS)
                if precision_dtype is not None:
                    output = tree_map(lambda value: value.float() if isinstance(value, torch.Tensor)
                                      and value.dtype == precision_dtype else value, output)
                loss = loss_of(output, loss_fn)
                del output      # as the real profiler's step (profiler._measure_step)
                for index in recorder.changed_after.changed_since():
                    recorder.blocks[index].changes_input |= bool(recorder.blocks[index].saved_sizes)
                recorder.in_backward = True
                loss.backward()
                del loss
        finally:
            for handle in handles:
                handle.remove()
        return recorder, roofline

    gradients_before = [(parameter, parameter.grad) for parameter in loss_held]
    try:
        recorder, roofline = step(found)
        # The real profiler's size-based policy: a block holding over a quarter of all saved bytes is
        # split into its children, so both profiles of a model have the same blocks.
        refined = _refined(found, recorder) if blocks is None else None
        if refined is not None:
            found = refined
            recorder, roofline = step(found)
    finally:
        for parameter, gradient in gradients_before:
            parameter.grad = gradient

    loss_other_bytes, loss_peak_bytes = recorder.peaks.write(recorder.blocks,
                                                             recorder.order[0] if recorder.order else None)
    block_profiles = []
    modules = dict(found)
    order = recorder.order + [i for i in range(len(found)) if i not in recorder.order]
    for index in order:
        block = recorder.blocks[index]
        block.parameter_bytes = _distinct_bytes([stand_ins[id(p)] for p in modules[block.name].parameters()])
        block.batchnorm_channels = batchnorm_channels(modules[block.name])
        if block.calls == 0:
            notes.append(f"block {block.name} did not run in the profiled step")
        block_profiles.append(block)
    holders_by_place(block_profiles, order)
    earlier_saves_by_place(block_profiles, order)
    trainable = [p for p in parameters if p.requires_grad]
    notes.append(f"{format_flops(roofline.flops)} per step (matmuls, convolutions, attention); "
                 f"profiled in {time.perf_counter() - started:.1f} s")
    return Profile(
        device=device.name,
        blocks=block_profiles,
        parameter_bytes=_distinct_bytes(parameters),
        gradient_bytes=_distinct_bytes(trainable),
        buffer_bytes=_distinct_bytes(buffers),
        optimizer_state_bytes=_optimizer_state_bytes(optimizer, trainable, notes),
        input_bytes=_distinct_bytes(tensors_in(inputs)),
        input_tensor_bytes=tensor_bytes(tensors_in(inputs)),
        unassigned_saved_bytes=recorder.unassigned_saved_bytes,
        loss_seconds=recorder.loss_seconds,
        flops=roofline.flops,
        peak_flops_per_second=roofline.flops / roofline.peak_seconds if roofline.peak_seconds else None,
        loss_other_bytes=loss_other_bytes,
        loss_peak_bytes=loss_peak_bytes,
        memory_traced=True,
        link=device.link_profile(),
        notes=notes,
        precision=precision,
    )


def _optimizer_state_bytes(optimizer, trainable: list[torch.Tensor], notes: list[str]) -> int:
    """State copies of the trainable parameters, by optimizer type (its state does not exist yet)."""
    if optimizer is None:
        notes.append("no optimizer given: its state is counted as 0 bytes (pass optimizer= to count it)")
        return 0
    name = type(optimizer).__name__
    copies = _OPTIMIZER_STATE_COPIES.get(name)
    if name == "SGD":
        copies = 1 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0
    if copies is None:
        notes.append(f"optimizer {name} is not one oomless knows: its state is estimated as one copy of the parameters")
        copies = 1
    return copies * _distinct_bytes(trainable)


def format_flops(flops: float) -> str:
    """"1.23 TFLOP", "4.56 GFLOP", "7.89 MFLOP": three digits of a small model's count as of a large one's."""
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f} FLOP"
