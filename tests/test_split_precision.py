"""Chains in slabs under mixed precision (runtime/slab_autocast.py, runtime/slabs.py): split + bf16
or fp16 against plain PyTorch under the same ``torch.autocast``.

Not bit-equal, and the bound is not fp32's 1e-5 (tests/test_split.py). The forward is (nearly)
bit-equal: each op runs in the dtype autocast gives it, the normalisations' outputs are rounded
once from float32 as torch's kernels round them, and the statistics differ from torch's in the last
float32 bit only (summed in another order), which moves a bf16 rounding almost never (measured on
the U-Net: no element of any chain's output differs; fp16, with 3 more bits, flips a few, whose
effect then grows through the decoder). The backward is not: the weights' gradients are sums over
the slabs of bf16 partial sums (each slab's convolution backward rounds its own, where unsplit one
rounding covers the volume), and a gradient reaching an input through the halos of two slabs is
added in its own dtype. Each such difference is one bf16 rounding of a partial sum, the size of the
rounding plain bf16 does itself, so the bound is a few bf16 roundings, and must be far below the
distance between plain bf16 and plain fp32 (every op rounded): split-bf16 must be much nearer plain
bf16 than plain bf16 is to fp32. Measured on this CPU (torch 2.13, the U-Net below, one step):
loss equal; gradients 2.7e-3 relative L2 (plain bf16 to fp32: 5.8e-2, 21x as far), largest
difference 1.6e-3 of the largest gradient (2.5e-2); BatchNorm running statistics 1.2e-7 (8.4e-3).
fp16: gradients 6.1e-3 (fp16 to fp32: 1.7e-2), running statistics 8.3e-6 (8.7e-4).
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import oomless
from oomless.errors import InputError
from oomless.models.unet3d import ConvStage, DecoderStage, UNet3D
from oomless.profile.tensors import call_model
from oomless.runtime import slab_autocast
from oomless.runtime import slabs as slabs_module
from oomless.runtime.precision import precision_state
from oomless.runtime.slabs import SlabGraph, run_in_slabs
from oomless.runtime.split import split_candidates

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Split against plain in the same precision, as shares of plain's own distance from fp32 (see above).
NEARER = {"bf16": 0.2, "fp16": 0.5}
# ... and in absolute terms: a few roundings of the dtype (bf16: 2**-8, fp16: 2**-11), relative L2.
GRADIENT_BOUND = {"bf16": 1e-2, "fp16": 1e-2}
# BatchNorm's running statistics are float32 sums in both (no bf16 rounding): fp32's bound, and for
# fp16 the statistics of the few flipped values.
BUFFER_BOUND = {"bf16": 1e-5, "fp16": 1e-4}


@pytest.fixture
def thin_slabs(monkeypatch):
    """Slabs as thin as asked (on CPU a slab is otherwise kept thick enough for oneDNN)."""
    monkeypatch.setattr(slabs_module, "ONEDNN_MIN_INPUT_ELEMENTS", 0)


def _unet():
    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(2, 1, 16, 16, 16)
    return model, volume, lambda out: F.cross_entropy(out, (volume[:, 0] > 0).long())


def _monai_unet(norm: str):
    from monai.networks.nets import UNet
    torch.manual_seed(0)
    # MONAI's own default norm, "instance" (no affine parameters: torch keeps its statistics in bf16).
    model = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                 num_res_units=2, norm=norm)
    volume = torch.randn(2, 1, 16, 16, 16)
    return model, volume, lambda out: F.cross_entropy(out, (volume[:, 0] > 0).long())


def _plain_step(model, inputs, loss_fn, precision: str):
    """(loss, gradients, buffers) of one step of ``model`` (a copy) under plain autocast (fp32: none);
    fp16 scales its loss by 2**16, as GradScaler does, and unscales the gradients."""
    model = copy.deepcopy(model)
    scale = 2.0**16 if precision == "fp16" else 1.0
    torch.manual_seed(100)
    with torch.autocast("cpu", dtype=DTYPES.get(precision, torch.float32), enabled=precision != "fp32"):
        output = call_model(model, inputs)
    loss = loss_fn(output.float())
    (loss * scale).backward()
    return (loss.item(), [parameter.grad / scale for parameter in model.parameters()],
            [buffer.clone() for buffer in model.buffers()])


def _split_step(model, inputs, loss_fn, precision: str, streamed: bool = False):
    """The same step under oomless: planned and applied with every chain in 4 slabs and ``precision``
    (``streamed``: split=True, the outer level streamed, runtime/stream.py, and the chains below it)."""
    model = copy.deepcopy(model)
    chains = split_candidates(model)
    assert chains
    plan = oomless.plan(copy.deepcopy(model), inputs, "1TiB", loss_fn=loss_fn, precision=precision,
                        split=True if streamed else {name: 4 for name in chains})
    assert plan.precision == precision and (("" in plan.split) if streamed else set(plan.split) == set(chains))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    oomless.apply(model, plan, optimizer=optimizer)
    torch.manual_seed(100)
    loss = loss_fn(call_model(model, inputs))
    loss.backward()                 # under fp16 the model's boundary scales, and .grad holds the true gradient
    if precision == "fp16":
        assert precision_state(model).scaler.scale > 1
    return (loss.item(), [parameter.grad for parameter in model.parameters()],
            [buffer.clone() for buffer in model.buffers()])


def _distances(one, other) -> dict:
    """Loss (relative), gradients (relative L2 over all, and largest difference over the largest
    gradient) and floating buffers (largest difference relative to each one's largest value)."""
    (loss, grads, buffers), (loss_other, grads_other, buffers_other) = one, other
    squares = sum(((a - b).double().square().sum() for a, b in zip(grads, grads_other)))
    norm = math.sqrt(sum(b.double().square().sum().item() for b in grads_other))
    largest = max(b.abs().max().item() for b in grads_other)
    floating = [(a.float(), b.float()) for a, b in zip(buffers, buffers_other) if b.is_floating_point()]
    return {"loss": abs(loss - loss_other) / abs(loss_other),
            "gradients": math.sqrt(squares.item()) / norm,
            "largest": max((a - b).abs().max().item() for a, b in zip(grads, grads_other)) / largest,
            "buffers": max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in floating)
            if floating else 0.0}


def _within(split: dict, rounding: dict, precision: str) -> list[str]:
    """What is out of bounds for split-vs-plain distances ``split``, given plain's own distance from
    fp32 ``rounding`` (empty: all within)."""
    wrong = []
    if split["loss"] > max(1e-5, NEARER[precision] * rounding["loss"]):
        wrong.append("loss")
    for key in ("gradients", "largest"):
        if split[key] > min(GRADIENT_BOUND[precision], NEARER[precision] * rounding[key]):
            wrong.append(key)
    if split["buffers"] > min(BUFFER_BOUND[precision], NEARER[precision] * rounding["buffers"]):
        wrong.append("buffers")
    return wrong


def _check(build, precision: str, monkeypatch=None, streamed: bool = False) -> None:
    model, inputs, loss_fn = build()
    fp32 = _plain_step(model, inputs, loss_fn, "fp32")
    plain = _plain_step(model, inputs, loss_fn, precision)
    split = _split_step(model, inputs, loss_fn, precision, streamed)
    rounding, distance = _distances(plain, fp32), _distances(split, plain)
    print(f"{precision}: split vs plain {distance}; plain vs fp32 {rounding}")
    assert not _within(distance, rounding, precision), (distance, rounding)
    if monkeypatch is not None:
        # The test can fail: the slab engine computing in its inputs' dtypes (autocast off inside it,
        # convolutions in fp32) is as far from plain bf16 as fp32 is.
        monkeypatch.setattr(slab_autocast.SlabAutocast, "current", classmethod(lambda cls, device: cls(device.type)))
        wrong = _distances(_split_step(model, inputs, loss_fn, precision), plain)
        assert _within(wrong, rounding, precision), wrong


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_split_unet_under_autocast_equals_plain_autocast(thin_slabs, monkeypatch, precision):
    _check(_unet, precision, monkeypatch if precision == "bf16" else None)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_streamed_unet_under_autocast_equals_plain_autocast(thin_slabs, precision):
    """split=True: the outer level streamed (its max-pool in slabs runs in fp32, as CPU autocast runs
    it) and the chains below it split. Measured: bf16 gradients 3.0e-3, fp16 6.1e-3."""
    _check(_unet, precision, streamed=True)


@pytest.mark.parametrize("norm", ["instance", "batch"])
def test_a_split_monai_unet_under_bf16_equals_plain_bf16(thin_slabs, norm):
    pytest.importorskip("monai")
    _check(lambda: _monai_unet(norm), "bf16")


class _Dtypes(TorchDispatchMode):
    """The dtypes of (input, weight) of every convolution and convolution backward, and the
    parameter-shaped float32 -> low-precision casts."""

    def __init__(self, weight_shapes):
        super().__init__()
        self.convolutions, self.casts, self.weight_shapes = [], 0, weight_shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
            input_index = 0 if func is torch.ops.aten.convolution.default else 1
            self.convolutions.append((args[input_index].dtype, args[input_index + 1].dtype))
        if (func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32
                and kwargs.get("dtype") in (torch.bfloat16, torch.float16)
                and tuple(args[0].shape) in self.weight_shapes):
            self.casts += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("norm", ["batch", "group", "instance"])
@pytest.mark.parametrize("decoder", [False, True])
def test_each_op_runs_in_the_dtype_autocast_gives_it(thin_slabs, norm, decoder):
    """A stage and a decoder stage in slabs under bf16: the output's dtype and values are plain
    autocast's (a few elements one bf16 rounding apart where the float32 statistics differ in their
    last bit: measured none, except 0.19 % with GroupNorm over all of a decoder's channels);
    every convolution and convolution backward runs on bf16 input and weight; each weight is cast
    once in forward and once in backward, whatever the number of slabs."""
    torch.manual_seed(0)
    stage = DecoderStage(8, 4, 4) if decoder else ConvStage(4, 8)
    sequence = stage.conv if decoder else stage
    channels = sequence[1].num_features
    if norm == "group":
        sequence[1], sequence[4] = nn.GroupNorm(2, channels), nn.GroupNorm(1, channels)
    if norm == "instance":     # with and without affine parameters (torch rounds the latter's statistics)
        sequence[1], sequence[4] = nn.InstanceNorm3d(channels, affine=True), nn.InstanceNorm3d(channels)
    inputs = ([torch.randn(2, 8, 6, 8, 8), torch.randn(2, 4, 12, 16, 16)] if decoder
              else [torch.randn(2, 4, 13, 8, 8)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = stage(*inputs)
    shapes = {tuple(module.weight.shape) for module in stage.modules()
              if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d))}
    counted = _Dtypes(shapes)
    leaves = [x.clone().requires_grad_() for x in inputs]
    with counted:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = run_in_slabs(SlabGraph.of(stage), tuple(leaves), 5)
        output.float().square().sum().backward()
    assert output.dtype == expected.dtype == torch.bfloat16
    assert (output != expected).float().mean().item() <= 1e-2
    assert counted.convolutions and set(counted.convolutions) == {(torch.bfloat16, torch.bfloat16)}
    assert counted.casts == 2 * len(shapes)
    assert all(parameter.grad.dtype == torch.float32 for parameter in stage.parameters())
    assert all(leaf.grad.dtype == torch.float32 for leaf in leaves)


def test_the_dtypes_of_normalisations_are_torchs_own():
    """`normalised_dtype` runs torch's op: on CPU, bf16 in, bf16 out for all three; fp32 stays fp32."""
    x = torch.zeros(1, 4, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for norm in (nn.BatchNorm1d(4), nn.GroupNorm(2, 4), nn.InstanceNorm1d(4)):
            assert slab_autocast.normalised_dtype(norm, x) == torch.bfloat16
            assert slab_autocast.normalised_dtype(norm, x.float()) == torch.float32
    assert slab_autocast.normalised_dtype(nn.GroupNorm(2, 4), x) == torch.bfloat16       # autocast off
    # Where torch keeps the statistics in bf16: no float32 weight, bias or running statistics.
    assert slab_autocast.statistics_rounded_to(nn.InstanceNorm1d(4), x) == torch.bfloat16
    assert slab_autocast.statistics_rounded_to(nn.InstanceNorm1d(4, affine=True), x) is None
    assert slab_autocast.statistics_rounded_to(nn.BatchNorm1d(4), x) is None
    assert slab_autocast.statistics_rounded_to(nn.GroupNorm(2, 4, affine=False), x) is None


def test_split_bf16_plans_hold_about_half_the_fp32_bytes(thin_slabs, monkeypatch):
    """Counted, not assumed, at fp32 and at bf16, every chain split and every block kept. The bytes
    the slab engine keeps off the device for the normalisations' inputs (`runtime.rows`) in the
    U-Net's step: half (measured 0.50; the gradients kept beside them in backward are float32 sums
    in both). The plan's activation bytes of a model of chains alone (two stages and a head; the
    chains save their inputs, bf16 where autocast made them so): half (measured 0.50). The U-Net's
    whole plan holds about as much at bf16 as at fp32 at this size (measured 0.99): CPU autocast runs
    max-pool in fp32, which saves an fp32 copy of each bf16 skip while the decoder keeps the skip
    itself (plain autocast holds both as well)."""
    stored = {}
    original = slabs_module.row_store
    for precision in ("fp32", "bf16"):
        model, inputs, loss_fn = _unet()
        plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, precision=precision,
                            split={name: 4 for name in split_candidates(model)})
        oomless.apply(model, plan)
        made = []
        monkeypatch.setattr(slabs_module, "row_store",
                            lambda shape, dtype, device: made.append(math.prod(shape) * dtype.itemsize)
                            or original(shape, dtype, device))
        loss_fn(model(inputs)).backward()
        monkeypatch.setattr(slabs_module, "row_store", original)
        forward_stores = len(made) // 2        # each store made in forward has its gradient's in backward
        stored[precision] = sum(made[:forward_stores])
    held = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = nn.Sequential(ConvStage(1, 8), ConvStage(8, 8), nn.Conv3d(8, 2, 1))
        plan = oomless.plan(model, torch.randn(2, 1, 16, 16, 16), "1TiB", loss_fn=lambda out: out.square().mean(),
                            precision=precision, split={name: 4 for name in split_candidates(model)})
        held[precision] = plan.predicted_activation_peak_bytes
    print(f"activation bytes {held}, stored bytes {stored}")
    assert 0.45 < stored["bf16"] / stored["fp32"] < 0.55, stored
    assert 0.45 < held["bf16"] / held["fp32"] < 0.55, held


def test_a_failing_low_precision_kernel_is_refused_before_any_step(monkeypatch):
    """Where this PyTorch build lacks a kernel the slabs need in fp16 (or bf16), planning refuses
    with what failed and what works instead, before profiling anything."""
    model, inputs, loss_fn = _unet()

    def missing(device, dtype):
        raise RuntimeError('"slow_conv3d_cpu" not implemented for \'Half\'')

    monkeypatch.setattr(slab_autocast, "_run_slab_probe", missing)
    slab_autocast.check_slabs_run_in.cache_clear()
    steps = []
    model.register_forward_pre_hook(lambda *args: steps.append(1))
    with pytest.raises(InputError, match="slow_conv3d_cpu.*precision='bf16' or 'fp32'"):
        oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, precision="fp16", split=True)
    assert not steps
    slab_autocast.check_slabs_run_in.cache_clear()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_under_autocast_the_planner_splits_only_when_asked(monkeypatch, precision):
    """split=None under bf16/fp16 refuses a budget below the smallest unsplit plan instead of
    splitting by itself: at its smallest budget a bf16 split step measured ~3 % over it on CPU
    (tests/test_floor.py). At fp32 the planner still tries splitting (the control)."""
    import oomless.api

    tried = []

    def refuse(model, error, plan_profile, profile_split):
        tried.append(error.minimum_bytes)
        raise error

    model, inputs, loss_fn = _unet()
    with pytest.raises(oomless.PlanError) as unsplit:
        oomless.plan(model, inputs, "1KiB", loss_fn=loss_fn, precision=precision, split=False)
    below = unsplit.value.minimum_bytes // 3     # above the static bytes, well below the smallest plan
    monkeypatch.setattr(oomless.api, "plan_splitting_the_floor", refuse)
    if precision != "fp32":
        with pytest.raises(oomless.PlanError):
            oomless.plan(model, inputs, below, loss_fn=loss_fn, precision=precision)
        assert not tried
        return
    # At fp32 the rounds were tried (and refused here); after them the step with every chain split
    # may still fit where the floor is a kernel's workspace (`plan.splitting.floor_is_a_workspace`,
    # which reads the measured step): then the plan is a split one.
    try:
        made = oomless.plan(model, inputs, below, loss_fn=loss_fn, precision=precision)
    except oomless.PlanError:
        made = None
    assert tried
    assert made is None or made.split
