"""Planning for a target device on meta tensors: the same bytes as the real profiler, a device
table with sources, user-added devices, and big models planned in a small process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oomless
from oomless.models import MLP, SmallCNN, TinyTransformer, UNet3D
from oomless.plan.devices import KERNEL_OVERHEAD_SECONDS, devices, find_device, load_devices
from oomless.profile.fake import profile_for_target
from oomless.profile.profiler import profile_model
from tests.conftest import cpu_dropout_as_cuda_runs_it

GiB = 2**30
CHILD = Path(__file__).with_name("target_child.py")


def _models():
    torch.manual_seed(0)
    return {
        "transformer": (TinyTransformer(vocab_size=256, dim=64, depth=3, heads=4, max_len=64), torch.randint(0, 256, (2, 64))),
        "unet3d": (UNet3D(base_channels=4, depth=2), torch.randn(1, 1, 16, 16, 16)),
        "mlp": (MLP(), torch.randn(8, MLP().sizes[0])),
        "cnn": (SmallCNN(), torch.randn(4, 3, 32, 32)),
    }


@pytest.mark.parametrize("name", ["transformer", "unet3d", "mlp", "cnn"])
def test_meta_profile_counts_the_bytes_the_real_profiler_measures(name):
    model, example = _models()[name]
    before = {key: value.clone() for key, value in model.state_dict().items()}
    fake = profile_for_target(model, example, "h100", loss_fn=oomless.sum_of_outputs)
    # The meta profile is a CUDA device's: its dropout keeps a boolean mask, as the CPU's does here.
    with cpu_dropout_as_cuda_runs_it():
        real = profile_model(model, example, loss_fn=oomless.sum_of_outputs)
    assert [b.name for b in fake.blocks] == [b.name for b in real.blocks]
    for mine, theirs in zip(fake.blocks, real.blocks):
        assert (mine.saved_bytes, mine.input_bytes, mine.output_bytes, mine.largest_saved_bytes) == \
            (theirs.saved_bytes, theirs.input_bytes, theirs.output_bytes, theirs.largest_saved_bytes), mine.name
        assert mine.forward_seconds > 0 and mine.backward_seconds > 0
    assert fake.unassigned_saved_bytes == real.unassigned_saved_bytes
    assert (fake.parameter_bytes, fake.input_bytes) == (real.parameter_bytes, real.input_bytes)
    # The model is left as found: same values, no gradients, nothing on meta.
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_bringing_a_saved_tensor_back_takes_no_device_time():
    """Backward's use of a kept saved tensor runs no kernel: on meta tensors its unpack points a
    tensor at the storage again (`set_`), which the roofline once charged the storage's bytes, as
    much as the ReLU that saved it. A ReLU block's backward is threshold_backward's alone: it moves
    three tensors of the input's size (gradient in, the saved output, gradient out) where the
    forward moves two."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
    profile = profile_for_target(model, torch.empty(4096, 1024, device="meta"), "h100",
                                 loss_fn=oomless.sum_of_outputs, blocks=["0", "1"])
    relu = profile.blocks[1]
    assert relu.saved_bytes == 4096 * 1024 * 4
    assert relu.backward_seconds - KERNEL_OVERHEAD_SECONDS == \
        pytest.approx(1.5 * (relu.forward_seconds - KERNEL_OVERHEAD_SECONDS), rel=1e-9)


def test_meta_model_and_dtype():
    with torch.device("meta"):
        model = TinyTransformer(vocab_size=256, dim=64, depth=2, heads=4, max_len=32)
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    fp32 = oomless.profile(model, tokens, loss_fn=oomless.sum_of_outputs, target="a100")
    bf16 = oomless.profile(model, tokens, loss_fn=oomless.sum_of_outputs, target="a100", dtype=torch.bfloat16)
    assert bf16.parameter_bytes * 2 == fp32.parameter_bytes
    assert sum(b.saved_bytes for b in bf16.blocks) < sum(b.saved_bytes for b in fp32.blocks)
    assert bf16.link.kind == "pcie" and fp32.device == "a100-80gb"


def test_device_table_has_the_promised_devices_with_sources():
    names = {device.name for device in devices()}
    assert {"h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "l4", "rtx-4090"} <= names
    for device in devices():
        assert device.source and device.memory_bytes > 0 and device.memory_bytes_per_second > 0
        assert device.bf16_flops >= device.fp32_flops > 0
        assert device.host_to_device_bytes_per_second > 0 and device.device_to_host_bytes_per_second > 0
    assert find_device("H100").name == "h100-sxm"


def test_users_add_devices_in_code_and_from_json(tmp_path):
    oomless.register_device(oomless.Device("test-gpu", 16 * 10**9, 1e12, 100e12, 100e12, 10e12, 50e12,
                                           25e9, 20e9, source="made up for a test", aliases=("tg",)))
    assert find_device("tg").device_to_host_bytes_per_second == 20e9
    entry = {"name": "json-gpu", "memory_bytes": 8 * 10**9, "memory_bytes_per_second": 5e11, "bf16_flops": 5e13,
             "fp16_flops": 5e13, "fp32_flops": 5e12, "tf32_flops": 2.5e13, "host_to_device_bytes_per_second": 1e10,
             "device_to_host_bytes_per_second": 1e10, "source": "a test"}
    path = tmp_path / "devices.json"
    path.write_text(json.dumps([entry]))
    load_devices(str(path))
    model, example = _models()["mlp"]
    plan = oomless.plan(model, example, memory="1GiB", target="json-gpu", loss_fn=oomless.sum_of_outputs)
    assert plan.device == "json-gpu"
    with pytest.raises(oomless.InputError, match="unknown target device"):
        oomless.plan(model, example, memory="1GiB", target="tpu-v9", loss_fn=oomless.sum_of_outputs)


BIG = {
    # ~1.0e9 parameters: 18 blocks of 12 * 2048^2 plus a 50257 x 2048 tied embedding.
    "transformer": ("80GiB", "8,2048", dict(vocab_size=50257, dim=2048, depth=18, heads=16, max_len=2048)),
    # At 256^3 an H100's link (~51 GB/s) cannot hide swaps behind a 0.2 s step: the plan keeps all.
    "unet3d": ("80GiB", "2,1,256,256,256", dict(base_channels=24, depth=4)),
}


@pytest.mark.parametrize("name", sorted(BIG))
def test_big_models_are_planned_for_an_h100_in_a_small_process(name):
    memory, shape, kwargs = BIG[name]
    result = subprocess.run([sys.executable, str(CHILD), name, memory, shape, json.dumps(kwargs)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    if name == "transformer":
        assert 0.95e9 < numbers["parameters"] < 1.1e9
        # Plain PyTorch would not fit: the plan moves blocks.
        assert numbers["plain_peak_bytes"] > numbers["memory_bytes"]
        assert set(numbers["decisions"].values()) != {"keep"}
    assert numbers["predicted_peak_bytes"] <= numbers["memory_bytes"]
    # The plan is for a step far bigger than this process ever was.
    assert numbers["peak_rss_bytes"] < 1.5 * GiB < numbers["plain_peak_bytes"] / 20


def test_a_model_reading_a_value_on_meta_tensors_is_told_why_and_what_works():
    """Meta tensors hold no values: a forward that reads one on the host (as Hugging Face GPT-2's
    mask code checks its position ids) cannot be planned for a target; the error says so and what
    works, instead of torch's "Tensor.item() cannot be called on meta tensors"."""

    class ReadsAValue(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
                if (x > 0).all():       # a Python branch on a tensor's values
                    x = x - 1
            return x

    with torch.device("meta"):
        model = ReadsAValue()
    with pytest.raises(oomless.InputError, match="meta tensors, which hold no values.*no target="):
        oomless.plan(model, torch.zeros(4, 8, device="meta"), "1GiB", target="h100")


H200_RUN = Path(__file__).resolve().parent.parent / "bench" / "results" / "gpu" / "2026-11-29-nvidia-h200" / "fit.json"


@pytest.mark.parametrize("name", ["unet3d", "transformer"])
def test_the_h200_roofline_times_blocks_as_an_h200_measured_them(name, monkeypatch):
    """The datasheet's roofline against one H200's profile of the same step (`oomless bench --device
    cuda`, torch 2.11, committed with its provenance): the 3D U-Net's 16-channel convolutions fill an
    eighth of a GEMM tile and its batch norms reduce 16 channels on 16 of 132 multiprocessors, which
    the roofline once left out and so timed its blocks' forward at 3.5 ms against 22.4 measured. The
    transformer's wide GEMMs stay as they were (31.7 ms against 30.9)."""
    monkeypatch.syspath_prepend(str(H200_RUN.parents[3]))
    from bench.common import build_model

    measured = json.loads(H200_RUN.read_text())["models"][name]
    sizes = {key: int(value) if str(value).isdigit() else value for key, value in measured["sizes"].items()}
    model, example, loss_fn = build_model(name, sizes, torch.device("meta"))
    fake = profile_for_target(model, example, "h200", loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters()))
    real = {block["name"]: block for block in measured["profile"]["blocks"]}
    predicted = sum(block.forward_seconds for block in fake.blocks)
    assert predicted == pytest.approx(sum(real[block.name]["forward_seconds"] for block in fake.blocks), rel=0.2)
    # Backward: the profile's measured backward carries its hooks and the swaps' waits: a floor.
    backward = sum(block.backward_seconds for block in fake.blocks)
    assert 0.5 < backward / sum(real[block.name]["backward_seconds"] for block in fake.blocks) <= 1.0
    if name == "unet3d":    # the widest-volume convolution and batch norm, each on its own
        for block, kind in (("encoders.0.3", "convolution"), ("encoders.0.1", "batch norm")):
            mine = next(b for b in fake.blocks if b.name == block).forward_seconds
            assert mine == pytest.approx(real[block]["forward_seconds"], rel=0.25), kind


def test_a_transposed_convolutions_weight_gradient_fills_tiles_as_wide_as_its_weight():
    """The weight gradient's GEMM makes the weight: its widths are the weight's first dimension and
    the rest, input channels first for a transposed convolution (a U-Net's upsampling, 32 -> 16
    channels: a quarter of each 128-wide tile, not an eighth)."""
    from oomless.profile.roofline import _tile_use

    grad_output, inputs = torch.empty(2, 16, 8, 8, 8, device="meta"), torch.empty(2, 32, 4, 4, 4, device="meta")
    weight = torch.empty(32, 16, 2, 2, 2, device="meta")     # ConvTranspose3d(32, 16, 2, stride=2)
    only_weight = (grad_output, inputs, weight, None, [2] * 3, [0] * 3, [1] * 3, True, [0] * 3, 1, [False, True, False])
    assert _tile_use("convolution_backward", only_weight, None) == pytest.approx(0.25)   # 32 by 16 x 8 wide
