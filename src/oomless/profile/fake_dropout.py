"""The fused dropout kernel a GPU runs, for a step on meta tensors.

`torch.nn.functional.dropout` (and `torch.dropout`, which it calls) picks its kernel by the device
of its input (`at::dropout`, ATen's native/Dropout.cpp, `is_fused_kernel_acceptable`): on CUDA, in
training, with 0 < p < 1 and a non-empty input, `native_dropout`, which keeps a boolean mask for
backward, 1 byte per element; on meta tensors, which have no CUDA key, the composite path
(`_dropout_impl`), which draws its noise in the input's dtype and keeps that, 4 bytes per element
in fp32 and 2 in bf16, and a second pass over it to scale it. Profiled for an H100, the README's
70B transformer (8,192 dims, 64 heads, 4 x 2,048 tokens, bf16 autocast, attention written by hand)
saved 4 GiB a layer for the dropout of its fp32 attention probabilities, where the GPU's mask is 1.

This mode sends those calls to `torch.native_dropout`, which has a meta kernel and CUDA's autograd
formula (it saves only the mask), and leaves the rest as they are, as CUDA does: p = 0 or 1,
evaluation, empty or non-floating inputs, in-place dropout (`dropout_` always takes the composite
path), and the feature and alpha variants (`dropout1d/2d/3d`, `alpha_dropout`,
`feature_alpha_dropout`), which have no fused kernel. Dropout inside
`scaled_dot_product_attention` is its kernel's own (`profile.fake_attention`).
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _functional_arguments(input, p=0.5, training=True, inplace=False):
    return input, p, training, inplace


def _aten_arguments(input, p, train):
    return input, p, train, False


# F.dropout calls torch.dropout with this mode popped, so the two are seen apart: a call of either
# from the model is one dropout.
_ARGUMENTS = {F.dropout: _functional_arguments, torch.dropout: _aten_arguments}


def fused_dropout_applies(input: torch.Tensor, p: float, training: bool, inplace: bool = False) -> bool:
    """Whether CUDA's `at::dropout` would run `native_dropout` for this call."""
    return (training and not inplace and isinstance(input, torch.Tensor) and not input.is_nested
            and input.is_floating_point() and input.numel() > 0 and 0 < p < 1)


class FusedDropout(TorchFunctionMode):
    """dropout on meta tensors as the GPU's fused kernel (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        arguments = _ARGUMENTS.get(func)
        if arguments is None:
            return func(*args, **kwargs)
        input, p, training, inplace = arguments(*args, **kwargs)
        if not fused_dropout_applies(input, p, training, inplace):
            return func(*args, **kwargs)
        return torch.native_dropout(input, p, True)[0]
