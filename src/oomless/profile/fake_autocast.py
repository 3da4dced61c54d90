"""CUDA autocast's casting policy for a step on meta tensors, where torch.autocast does not apply.

torch.autocast dispatches per backend (AutocastCUDA, AutocastCPU, ...); meta tensors have none, so
a step profiled for a target GPU on meta tensors would ignore ``torch.autocast("cuda")``, and a CPU
build cannot make fake CUDA tensors that would carry the key. This mode applies the same policy one
level up, on torch functions: the float arguments of each op autocast runs in low precision are cast
to the autocast dtype, those of each op it runs in fp32 are cast to fp32, and those of the ops it
promotes are cast to the widest dtype among them. Parameters are cast once per forward and reused,
as autocast's weight cache does, so their low-precision copies are saved (and counted) once; the
cache goes when the mode exits, as autocast's does, and a copy lives on only where autograd saved it.

The op lists follow PyTorch's CUDA policy (aten/src/ATen/autocast_mode.cpp, "lower_precision_fp",
"fp32", "fp32_set_opt_dtype" and "promote" sets; torch.amp documentation, "CUDA Ops that can
autocast"), by the Python-level names through which modules reach them; an op outside the lists
runs in the dtypes it is given, as under autocast.
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

LOWER_PRECISION = {
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__",
    "einsum", "mm", "mv", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot", "vecdot",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
    # torch.nn.MultiheadAttention's whole forward is one torch function here: its projections and
    # attention are autocast ops, so its inputs and weights are cast as theirs would be.
    "multi_head_attention_forward",
}
FP32 = {
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_trilinear3d", "upsample_bicubic2d", "interpolate", "prod", "softmax", "log_softmax", "cumprod",
    "cumsum", "vector_norm", "matrix_norm", "sum", "cross_entropy", "rms_norm",
}
PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put", "scatter_add",
           "tensordot", "cat", "stack"}


def _name(func) -> str:
    return getattr(func, "__name__", "") or ""


class FakeAutocast(TorchFunctionMode):
    """The autocast policy above for ``dtype`` on the ops of a meta-tensor step."""

    def __init__(self, dtype: torch.dtype, parameters):
        super().__init__()
        self.dtype = dtype
        self.parameter_ids = {id(p) for p in parameters}
        self.cast_cache: dict[int, torch.Tensor] = {}

    def _cast(self, value, dtype: torch.dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()) or value.dtype == dtype:
            return value
        if id(value) in self.parameter_ids:     # autocast's cache: one cast copy per weight and forward
            cached = self.cast_cache.get(id(value))
            if cached is None or cached.dtype != dtype:
                cached = self.cast_cache[id(value)] = value.to(dtype)
            return cached
        return value.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        target = None
        if name in LOWER_PRECISION:
            target = self.dtype
        elif name in FP32:
            target = torch.float32
        elif name in PROMOTE:
            floats = [t.dtype for t in _tensors(args, kwargs) if t.is_floating_point()]
            target = max(floats, key=lambda d: torch.finfo(d).bits) if floats else None
        if target is not None:
            args, kwargs = tree_map(lambda v: self._cast(v, target), (args, kwargs))
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc_value, traceback):
        # torch.autocast drops its cache when the outermost autocast exits (amp/autocast_mode.py,
        # clear_autocast_cache), and the runtime's exits at the model's output: from then on a
        # weight's copy lives only where autograd saved it, until its block's backward. Kept for as
        # long as this mode is referenced, every copy was counted in the loss and in every block's
        # backward (Llama, 2048 dims, bf16: 98 MiB a layer).
        self.cast_cache.clear()
        return super().__exit__(exc_type, exc_value, traceback)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    tree_map(lambda v: found.append(v) if isinstance(v, torch.Tensor) else None, (args, kwargs))
    return found
