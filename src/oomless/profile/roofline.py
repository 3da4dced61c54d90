"""The time of each aten op on a target device, from its datasheet: a roofline.

max(FLOPs / peak FLOP/s for the op's dtype, bytes read and written / memory bandwidth) plus a
per-kernel overhead. FLOPs come from PyTorch's own formulas (`torch.utils.flop_counter`), counted
for matmuls, convolutions and attention, the ops that use tensor cores; every other op is
bandwidth-bound. Narrow work is counted as the chip runs it: a convolution's GEMM tiles its channels
fill, and batch norm's per-channel reductions (`plan.devices`). Roofline: Williams, Waterman,
Patterson, "Roofline: an insightful visual performance model", CACM 52(4), 2009.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from oomless.errors import InputError
from oomless.plan.devices import (CHANNEL_BLOCK_SHARE, GEMM_TILE, KERNEL_OVERHEAD_SECONDS, MATMUL_EFFICIENCY,
                                  MEMORY_EFFICIENCY, Device)
from oomless.profile.tensors import tensors_in

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
    input channels) and the weight's (the weight's first dimension by the rest: output channels by
    input channels times kernel positions, or the other way round for a transposed convolution), each
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
    inputs, weight, mask = args[1], args[2], args[-1]
    shares = []
    if mask[0]:
        shares.append(filled(inputs.shape[1], inputs.numel() // max(inputs.shape[1], 1)))
    if mask[1]:
        shares.append(filled(weight.shape[0], weight.numel() // max(weight.shape[0], 1)))
    return len(shares) / sum(1 / share for share in shares) if shares else 1.0


def _narrow_reduction_seconds(func, args, kwargs, device: Device) -> float:
    """Seconds a training batch norm's per-channel reductions add to its streaming: a thread block per
    channel reads the whole input (and, in backward, the output's gradient), each at
    `devices.CHANNEL_BLOCK_SHARE` of one multiprocessor's share of the bandwidth, all of it from
    ``multiprocessors / CHANNEL_BLOCK_SHARE`` channels on. 0 for every other op (batch norm in eval
    mode reduces nothing), or where the device's multiprocessors are unknown."""
    # Every op of the meta step comes here: the name first, the schema's arguments only for batch norms.
    name = func._overloadpacket.__name__
    if "batch_norm" not in name or not device.multiprocessors or not args or not isinstance(args[0], torch.Tensor) \
            or args[0].dim() < 2:
        return 0.0
    if not (_argument(func, args, kwargs, "training") or _argument(func, args, kwargs, "train")):
        return 0.0
    reduced = args[:2] if "backward" in name else args[:1]
    share = min(args[0].shape[1] * CHANNEL_BLOCK_SHARE / device.multiprocessors, 1.0)
    rate = device.memory_bytes_per_second * MEMORY_EFFICIENCY * share
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


class Roofline(TorchDispatchMode):
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
                   + _narrow_reduction_seconds(func, args, kwargs, self.device) + KERNEL_OVERHEAD_SECONDS)
        self.flops += flops
        self.charge(seconds, flops)
        return out
