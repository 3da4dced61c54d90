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
- seconds from a roofline per aten op: max(FLOPs / peak FLOP/s for the op's dtype, bytes read and
  written / memory bandwidth) plus a per-kernel overhead. FLOPs come from PyTorch's own formulas
  (`torch.utils.flop_counter`), counted for matmuls, convolutions and attention, the ops that use
  tensor cores; every other op is bandwidth-bound. Roofline: Williams, Waterman, Patterson,
  "Roofline: an insightful visual performance model", CACM 52(4), 2009.
- working memory ("other" and peak bytes per phase, as the real profiler's all-swap step measures
  them): the meta storages alive after each op (`profile.fake_memory`), without kernels' workspaces
  or the allocator's rounding, for which the planner keeps its larger margin.
- attention (`torch.nn.functional.scaled_dot_product_attention`) as the GPU's fused kernel, not the
  math fallback meta tensors would take (`profile.fake_attention`).
"""

import itertools
import time
import weakref
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from oomless.errors import InputError
from oomless.plan.devices import (CHANNEL_BLOCK_SHARE, GEMM_TILE, KERNEL_OVERHEAD_SECONDS, MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, Device,
                                  find_device)
from oomless.profile.blocks import batchnorm_channels, find_blocks
from oomless.profile.fake_attention import FusedAttention
from oomless.profile.fake_autocast import FakeAutocast
from oomless.profile.fake_memory import MetaMemory, PhasePeaks
from oomless.profile.profile import BlockProfile, Profile
from oomless.profile.profiler import _OPTIMIZER_STATE_COPIES, _refined, loss_of
from oomless.profile.tensors import (InputSharing, add_saved_earlier, alive_bytes, attributes_kept,
                                     earlier_saves_by_place, holders_by_place, parameters_read_by, tensor_bytes,
                                     tensors_in)

_CONVOLUTIONS = {"convolution", "convolution_backward", "_convolution"}
# Ops that only describe tensors or alias them: no kernel runs on the device. `set_` points a tensor
# at a storage: the unpack of every saved tensor makes one (`_FakeRecorder.unpack`), and was charged
# as reading and writing its storage, as much as the ReLU that saved it (10 % of an 8192-wide
# transformer layer's time).
_FREE = {"detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
         "split", "split_with_sizes", "chunk", "select", "slice", "as_strided", "alias", "unbind",
         "lift_fresh", "_reshape_alias", "reshape", "empty", "empty_like", "empty_strided", "new_empty",
         "unflatten", "flatten", "view_as", "expand_as", "narrow", "diagonal", "set_"}

# The fused attention kernels (`profile.fake_attention`): with ``is_causal`` they skip the blocks of
# scores above the diagonal, half of them, which torch's FLOP formulas count; a mask broadcast over
# batch and heads is read once, not once per head.
_FUSED_ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"}

_LOSS = -1


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _argument(func, args, kwargs, name: str):
    """The value of argument ``name`` of an aten op's call (None where its schema has none)."""
    names = [argument.name for argument in func._schema.arguments]
    if name in kwargs:
        return kwargs[name]
    if name in names and names.index(name) < len(args):
        return args[names.index(name)]
    return None


def _tile_use(name: str, args, out) -> float:
    """The share of a convolution's GEMM tiles its output fills (`devices.GEMM_TILE`): 1 for every
    other op. Backward computes the input's gradient (its output dimensions: the input's positions by
    input channels) and the weight's (output channels by input channels times kernel positions), each
    as many FLOPs as the forward: their times add."""
    if name not in _CONVOLUTIONS:
        return 1.0

    def filled(*widths: int) -> float:
        share = 1.0
        for width in widths:
            share *= min(width / GEMM_TILE, 1.0)
        return max(share, 1e-3)

    if name != "convolution_backward":
        return filled(out.shape[1], out.numel() // max(out.shape[1], 1))
    grad_output, inputs, weight, mask = args[0], args[1], args[2], args[-1]
    shares = []
    if mask[0]:
        shares.append(filled(inputs.shape[1], inputs.numel() // max(inputs.shape[1], 1)))
    if mask[1]:
        shares.append(filled(grad_output.shape[1], weight.numel() // max(weight.shape[0], 1)))
    return len(shares) / sum(1 / share for share in shares) if shares else 1.0


def _narrow_reduction_seconds(name: str, args, device: Device) -> float:
    """Seconds batch norm's per-channel reductions add to its streaming: one thread block per channel
    reads the whole input (and, in backward, the output's gradient), reaching
    `devices.CHANNEL_BLOCK_SHARE` of one multiprocessor's share of the bandwidth. 0 for every other
    op, or where the device's multiprocessors are unknown."""
    if "batch_norm" not in name or not device.multiprocessors or not args or args[0].dim() < 2:
        return 0.0
    reduced = args[:2] if "backward" in name else args[:1]
    channels = min(args[0].shape[1], device.multiprocessors)
    rate = device.memory_bytes_per_second * MEMORY_EFFICIENCY * CHANNEL_BLOCK_SHARE * channels / device.multiprocessors
    return sum(_tensor_bytes(tensor) for tensor in reduced if isinstance(tensor, torch.Tensor)) / rate


def _keys_as_query_heads(func, args, kwargs):
    """A fused attention kernel's arguments as torch's FLOP formulas read them (their shapes): keys
    and values of fewer heads than the queries (grouped-query attention, which FlashAttention and
    cuDNN read as they are) as many heads as the queries, since each query head attends over its
    group's keys and values: the work of the same attention with them repeated. torch 2.11's
    `sdpa_flop_count` refuses fewer key heads ("query/key/value shapes are incompatible"); later
    ones count them so."""
    query = _argument(func, args, kwargs, "query")
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        return args, kwargs
    names = [argument.name for argument in func._schema.arguments]
    args, kwargs = list(args), dict(kwargs)
    for name in ("key", "value"):
        tensor = _argument(func, args, kwargs, name)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.shape[1] != query.shape[1]:
            # A shape without bytes: an expanded scalar (no storage of that size, nothing counted).
            heads = tensor.new_empty(()).expand(tensor.shape[0], query.shape[1], *tensor.shape[2:])
            if name in kwargs:
                kwargs[name] = heads
            else:
                args[names.index(name)] = heads
    return tuple(args), kwargs


class _Roofline(TorchDispatchMode):
    """Adds each aten op's roofline seconds to the phase that is running (a block's forward or
    backward, the loss, or nothing)."""

    def __init__(self, device: Device, charge, made):
        super().__init__()
        self.device = device
        self.charge = charge
        self.made = made    # told every op's outputs, for the working memory
        self.flops = 0
        self.peak_seconds = 0.0     # the operations at the device's peak for each op's dtype and kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            # A value read on the host (.item(), bool(), a Python branch on a tensor): meta tensors
            # hold none, and torch's own message does not say why they are here.
            raise InputError("planning for a target runs the step on meta tensors, which hold no values, and the "
                             "model (or loss) reads a tensor's value in Python (.item(), bool(), `if tensor...`; "
                             "Hugging Face transformers' mask code checks its inputs so); plan on a real device "
                             "instead (no target=), or make that code path read no values")
        out = func(*args, **kwargs)
        self.made(out)
        name = func._overloadpacket.__name__
        if name in _FREE or getattr(func, "is_view", False):
            return out
        tensors = [t for t in tensors_in((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        fused_attention = name in _FUSED_ATTENTION
        moved = sum(min(_tensor_bytes(t), t.untyped_storage().nbytes()) if fused_attention else _tensor_bytes(t)
                    for t in tensors)
        flops = 0
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flop_args, flop_kwargs = _keys_as_query_heads(func, args, kwargs) if fused_attention else (args, kwargs)
            flops = formula(*flop_args, **flop_kwargs, out_val=out)
        if fused_attention and _argument(func, args, kwargs, "is_causal"):
            flops /= 2
        floats = [t for t in tensors if t.is_floating_point()]
        dtype = str(floats[0].dtype).removeprefix("torch.") if floats else "float32"
        kind = "convolution" if name in _CONVOLUTIONS else "matmul"
        peak = self.device.flops_for(dtype, kind)
        self.peak_seconds += flops / peak
        seconds = (max(flops / (peak * MATMUL_EFFICIENCY * _tile_use(name, args, out)),
                       moved / (self.device.memory_bytes_per_second * MEMORY_EFFICIENCY))
                   + _narrow_reduction_seconds(name, args, self.device) + KERNEL_OVERHEAD_SECONDS)
        self.flops += flops
        self.charge(seconds, flops)
        return out


class _FakeRecorder:
    """Block boundaries, saved storages and held bytes during the meta step."""

    def __init__(self, names: list[str], resident: set[int]):
        self.blocks = {index: BlockProfile(name, flops=0.0) for index, name in enumerate(names)}
        self.order: list[int] = []
        self.resident = resident
        self.sharing = InputSharing(_storage_key)   # blocks' inputs an earlier block had
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
            block.input_bytes += _distinct_bytes(tensors_in((args, kwargs)))
            block.input_held_earlier += self.sharing.block_started(index, tensors_in((args, kwargs)), self.resident)
            block.held_forward_bytes = max(block.held_forward_bytes, alive_bytes(self.live_outputs))
            self.forward_block = index
            self.phase = ("forward", index)
        return hook

    def post_hook(self, index: int):
        def hook(module, args, output):
            self.forward_block = None
            self.sharing.block_finished(index)
            block = self.blocks[index]
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
    state: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) not in stand_ins:
            stand_ins[id(parameter)] = _meta_like(parameter, dtype).requires_grad_(parameter.requires_grad)
        state[name] = stand_ins[id(parameter)]
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if id(buffer) not in stand_ins:
            stand_ins[id(buffer)] = _meta_like(buffer, dtype)
        state[name] = stand_ins[id(buffer)]
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
        roofline = _Roofline(device, recorder.charge, recorder.made)
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
                # Attention as the GPU's fused kernel (outside autocast's mode: it sees autocast's dtypes).
                with FusedAttention(), FakeAutocast(precision_dtype, parameters) if precision_dtype else nullcontext():
                    output = torch.func.functional_call(model, state, () if kwargs else tuple(args), kwargs,
                                                        strict=False)
                recorder.phase = ("loss", _LOSS)
                if precision_dtype is not None:
                    output = tree_map(lambda value: value.float() if isinstance(value, torch.Tensor)
                                      and value.dtype == precision_dtype else value, output)
                loss = loss_of(output, loss_fn)
                del output      # as the real profiler's step (profiler._measure_step)
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
