"""The dtypes a graph computed in slabs (`runtime.slabs`) runs its ops in: those torch.autocast gives them.

Under ``precision="bf16"`` or ``"fp16"`` the model's forward runs under ``torch.autocast``
(`runtime.precision`), and a chain split into slabs must compute each of its ops in the dtype
autocast would give that op unsplit, forward and backward alike. PyTorch's lists
(aten/src/ATen/autocast_mode.cpp, torch 2.13), for the ops a slab graph has:

- convolutions and transposed convolutions (conv1d/2d/3d, conv_transpose1d/2d/3d) and prelu are in
  the lower-precision list on CPU and CUDA: input, weight and bias are cast to the autocast dtype;
- batch_norm and instance_norm are in no list on CPU or CUDA (MPS: fp32): they run in their input's
  dtype, the fp32 weight and running statistics as they are, the statistics taken in float32 by the
  kernels (a bf16 input gives a bf16 output); group_norm likewise on CPU, but it is in the fp32 list
  on CUDA (input cast to float32, float32 output); layer_norm is not a slab op;
- pointwise activations are in no list (their input's dtype), except softplus, fp32 on CUDA;
- max_pool3d and avg_pool3d (the streamed outer level's downsampling) are fp32 on CPU;
- cat is "promote" on CPU (CUDA's cat promotes by itself), add follows type promotion.

The engine calls convolutions, transposed convolutions, poolings, activations, cat and add through
the dispatcher, inside `SlabAutocast.ops` (autocast as the forward had it, backward included), so
autocast's own lists apply to them. Its own arithmetic follows the lists here: a normalisation runs
in `normalised_dtype` (found by running torch's own op once on a tiny tensor under the same
autocast, so it stays right where the lists change), its statistics in `accumulation_dtype`
(float32 for a bf16/fp16 input, as the kernels accumulate); ``aten.convolution_backward`` gets its
input, weight and output gradient in the convolution's dtype. Weights are cast once per forward and
once per backward of a graph (`SlabAutocast.cast_weights`), not once per slab: autocast's own cache
is switched off inside (a cast made there under no_grad would be handed to a later op that needs its
gradient); a cast made in backward records its gradient, so a weight's gradient reaches its fp32
parameter as autocast's cast passes it back, converted to float32 and summed there over the slabs.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

REDUCED = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SlabAutocast:
    """Autocast as one graph's forward found it: the device type and its dtype (None: autocast off)."""

    device_type: str
    dtype: torch.dtype | None = None

    @classmethod
    def current(cls, device: torch.device) -> "SlabAutocast":
        enabled = torch.is_autocast_enabled(device.type)
        return cls(device.type, torch.get_autocast_dtype(device.type) if enabled else None)

    def ops(self) -> torch.autocast:
        """The context the graph's ops run in, forward and backward: autocast as the forward had it
        (off where it was off, even if the backward is called under another), its cache off."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None,
                              cache_enabled=False)

    def cast_weights(self, graph) -> dict[int, torch.Tensor]:
        """{id(parameter): its copy in the autocast dtype} for the weights and biases of ``graph``'s
        convolutions and transposed convolutions (those autocast casts); empty without autocast.
        Made under the caller's grad mode: in backward, the copies record their gradient."""
        casts = {}
        if self.dtype is None:
            return casts
        # The graph's own parameters (in backward, their aliases): not a weight a parametrization
        # computes at each access, which autocast casts at each use.
        parameters = {id(parameter) for parameter in graph.parameters()}
        for node in graph.nodes:
            if node.kind not in ("conv", "up"):
                continue
            for parameter in (node.module.weight, node.module.bias):
                if id(parameter) in parameters and id(parameter) not in casts and self._eligible(parameter):
                    casts[id(parameter)] = parameter.to(self.dtype)
        return casts

    def _eligible(self, tensor: torch.Tensor) -> bool:
        # autocast's is_eligible: floating point, not float64, on the autocast device.
        return (tensor.is_floating_point() and tensor.dtype not in (torch.float64, self.dtype)
                and tensor.device.type == self.device_type)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype normalisation statistics of values in ``dtype`` are taken and kept in: float32 for
    bf16/fp16 (the CPU and CUDA kernels' accumulation type), else the values' own."""
    return torch.promote_types(dtype, torch.float32)


def normalised_dtype(norm: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype torch runs normalisation ``norm`` in, and gives its output in, for an input like
    ``x`` under the autocast now on (autocast casts the input to it first where it differs)."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type) or not x.is_floating_point() or x.dtype == torch.float64:
        return x.dtype
    return _normalised_dtype(_norm_kind(norm), device_type, torch.get_autocast_dtype(device_type), x.dtype)


def _norm_kind(norm: nn.Module) -> str:
    if isinstance(norm, nn.GroupNorm):
        return "group"
    if isinstance(norm, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
        return "instance"
    return "batch"


@functools.cache
def _normalised_dtype(kind: str, device_type: str, autocast: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The output dtype of torch's own ``kind`` normalisation of a ``dtype`` input with fp32 affine
    parameters under autocast to ``autocast``, run once on a tiny tensor."""
    x = torch.ones(2, 2, 3, dtype=dtype, device=device_type)
    weight = torch.ones(2, device=device_type)
    with torch.no_grad(), torch.autocast(device_type, dtype=autocast, cache_enabled=False):
        if kind == "group":
            return F.group_norm(x, 1, weight, weight).dtype
        if kind == "instance":
            return F.instance_norm(x, weight=weight, bias=weight).dtype
        return F.batch_norm(x, None, None, weight, weight, training=True).dtype


def statistics_rounded_to(norm: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype torch keeps normalisation ``norm``'s statistics in, for an input like ``x``, where
    that is narrower than the float32 they are taken in; else None. On CPU, batch_norm (which
    instance_norm calls) takes a bf16/fp16 input's mean and sum of squared deviations in float32 but
    keeps them, and 1/std, in the input's dtype unless a weight, bias or running statistic is
    float32 ("mixed type": aten/src/ATen/native/Normalization.cpp and cpu/batch_norm_kernel.cpp,
    is_mixed_type): an InstanceNorm without affine parameters, MONAI's default, normalises with
    statistics rounded to bf16. group_norm, and CUDA's batch_norm, keep them in float32."""
    if x.device.type != "cpu" or isinstance(norm, nn.GroupNorm):
        return None
    dtype = normalised_dtype(norm, x)
    if dtype not in REDUCED:
        return None
    kept = [getattr(norm, name, None) for name in ("weight", "bias", "running_mean", "running_var")]
    return None if any(tensor is not None and tensor.dtype == torch.float32 for tensor in kept) else dtype


def rounded_statistics(mean: torch.Tensor, variance: torch.Tensor, count: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, biased variance) as torch's CPU batch_norm keeps them in ``dtype`` (where
    `statistics_rounded_to` says it does), from the exact ones over ``count`` values: the mean rounded
    to ``dtype``; for bf16 the sum of squared deviations rounded too and divided as c10's BFloat16
    divides by an integer (both rounded to bf16, and the quotient), for fp16 the variance as taken.
    (1/std is then rounded in `runtime.slabs._scale_and_shift`.) Measured against
    ``aten.native_batch_norm``'s saved statistics on torch 2.13's CPU kernels: equal for every channel."""
    mean = mean.to(dtype).to(mean.dtype)
    if dtype == torch.bfloat16:
        squares = (variance * count).to(dtype).float()
        variance = (squares / torch.tensor(float(count)).to(dtype).float()).to(dtype).to(variance.dtype)
    return mean, variance


class _ProbeStage(nn.Module):
    """A tiny decoder stage: each kind of op a slab graph runs (upsampling, concatenation, both
    convolutions' backward, BatchNorm and GroupNorm in slabs)."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose3d(2, 2, kernel_size=2, stride=2)
        self.conv = nn.Sequential(nn.Conv3d(4, 2, 3, padding=1), nn.BatchNorm3d(2), nn.ReLU(),
                                  nn.Conv3d(2, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.ReLU())

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


def _run_slab_probe(device: torch.device, dtype: torch.dtype) -> None:
    from oomless.runtime.slabs import SlabGraph, run_in_slabs      # here: runtime.slabs imports this module
    stage = _ProbeStage().to(device)
    x = torch.randn(1, 2, 2, 3, 3, device=device, requires_grad=True)
    skip = torch.randn(1, 2, 4, 6, 6, device=device)
    with torch.autocast(device.type, dtype=dtype):
        output = run_in_slabs(SlabGraph.of(stage), (x, skip), 2)
    output.float().sum().backward()


@functools.cache
def check_slabs_run_in(device_type: str, precision: str, dtype: torch.dtype) -> None:
    """`InputError` where this PyTorch build cannot run a slab graph's ops under autocast to ``dtype``
    on ``device_type`` (a kernel missing for fp16 on CPU, say), naming what failed and what works."""
    from oomless.errors import InputError
    try:
        _run_slab_probe(torch.device(device_type), dtype)
    except (RuntimeError, NotImplementedError) as error:
        other = "'bf16' or 'fp32'" if precision == "fp16" else "'fp32'"
        raise InputError(f"split= with precision={precision!r}: this PyTorch build cannot run the slabs' ops in "
                         f"{precision} on {device_type} ({str(error).splitlines()[0]}); use precision={other} with "
                         "split, or split=False") from error
