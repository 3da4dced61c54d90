"""The fused attention kernel a GPU runs, for a step on meta tensors.

`torch.nn.functional.scaled_dot_product_attention` picks its kernel by the device of its inputs:
on CUDA (compute capability 8.0 and above, every device in `oomless.plan.devices`) a fused one,
FlashAttention or memory-efficient attention, which saves the inputs, the output and one
log-sum-exp per row, and makes no tensor of the scores; on meta tensors, which have no CUDA key,
the math fallback (`_scaled_dot_product_attention_math`), which makes the B x H x T x T scores,
their softmax and (in fp16 / bf16) fp32 copies of the inputs, and saves them for backward. Profiled
for a GPU, a Llama layer's attention (1,024 dims, 16 heads, 4,096 tokens, bf16) saved 1,114 MiB and
held 2,272 MiB of working memory in forward; as the fused kernel, 66 and 128 MiB.

This mode sends each call to the kernel CUDA's dispatcher would choose (`sdp_utils.cpp`, torch
2.5 and later), where that is a fused one:
- FlashAttention: fp16 / bf16, no mask, the same head dimension for queries, keys and values, at
  most 256 (padded to a multiple of 8 as `attention.cpp` pads it, the output sliced back); keys and
  values with fewer heads (``enable_gqa``) as they are, which the kernel reads natively;
- memory-efficient attention otherwise: fp32 too, and an additive or boolean mask (made additive
  as torch makes it, and kept for backward as the kernel keeps it), head dimensions aligned (8
  elements in fp16 / bf16, 4 in fp32), queries and keys of one head dimension, as many key as
  query heads (it has no grouped-query path);
- the math fallback wherever neither applies, and for anything else (nested or not 4-D tensors,
  head counts torch refuses), so that torch says what is wrong.
Both kernels have meta implementations and autograd formulas, and `torch.utils.flop_counter`
counts their FLOPs, so the roofline and the working memory read them as any other op. Enter it
outside `FakeAutocast`, so that the kernel sees the dtypes autocast gives it.
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def attention_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                     enable_gqa: bool = False) -> str:
    """"flash", "efficient" or "math": the kernel CUDA's scaled_dot_product_attention would run."""
    tensors = (query, key, value)
    if any(tensor.is_nested or tensor.dim() != 4 for tensor in tensors):
        return "math"
    grouped = key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]
    if grouped and not (enable_gqa and query.shape[1] % key.shape[1] == 0 and key.shape[1] == value.shape[1]):
        return "math"           # torch refuses these head counts: let it say so
    dims = [tensor.shape[-1] for tensor in tensors]
    if query.dtype in FLASH_DTYPES and attn_mask is None and len(set(dims)) == 1 and dims[0] <= FLASH_MAX_HEAD_DIM:
        return "flash"
    alignment = 8 if query.dtype in FLASH_DTYPES else 4
    if (grouped or dims[0] != dims[1] or query.dtype not in (*FLASH_DTYPES, torch.float32)
            or dims[0] % alignment or dims[2] % alignment):
        return "math"
    return "efficient"


def _arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class FusedAttention(TorchFunctionMode):
    """scaled_dot_product_attention on meta tensors as the GPU's fused kernel (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, mask, dropout, causal, scale, gqa = _arguments(*args, **kwargs)
        kernel = attention_kernel(query, key, value, mask, gqa)
        if kernel == "math":
            return func(*args, **kwargs)
        if kernel == "flash":
            head_dim = query.shape[-1]
            padding = -head_dim % 8
            if padding:
                scale = head_dim ** -0.5 if scale is None else scale
                query, key, value = (F.pad(tensor, (0, padding)) for tensor in (query, key, value))
            out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, causal, False,
                                                                     scale=scale)[0]
            return out[..., :head_dim] if padding else out
        if mask is not None and mask.dtype == torch.bool:
            # The efficient kernel takes an additive bias: torch converts a boolean mask so too.
            mask = torch.where(mask, torch.zeros((), dtype=query.dtype, device=mask.device),
                               torch.full((), float("-inf"), dtype=query.dtype, device=mask.device))
        if mask is not None:
            mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        gradients = any(tensor.requires_grad for tensor in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, mask, gradients, dropout,
                                                                      causal, scale=scale)[0]
