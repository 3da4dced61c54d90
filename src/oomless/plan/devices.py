"""Target devices for planning without the hardware: memory, bandwidths and peak throughput.

    oomless.plan(model, inputs, memory="80GiB", target="h100")     # a name or alias from the table
    oomless.register_device(oomless.Device("my-gpu", ...))          # add one in code
    OOMLESS_DEVICES=/path/devices.json oomless plan ...              # or from a JSON file: a list of
                                                                     # objects with Device's fields

Every figure is the vendor's datasheet number, dense (no structured-sparsity doubling), and every
entry names its source. Datasheet peaks are not reached by real kernels: the roofline in
`oomless.profile.fake` scales them by the achievable fractions below, which are assumptions
(typical of large cuBLAS GEMMs and streaming kernels), not measurements of ours.
"""

import json
import math
import os
from dataclasses import asdict, dataclass, fields

from oomless.errors import InputError
from oomless.profile.profile import LinkProfile

# Achievable fractions of the datasheet peaks (assumptions; see the module docstring).
MATMUL_EFFICIENCY = 0.7        # large GEMMs / convolutions on tensor cores
MEMORY_EFFICIENCY = 0.8        # streaming elementwise kernels against HBM/GDDR
HOST_LINK_EFFICIENCY = 0.8     # pinned-memory copies against the PCIe link's raw rate
KERNEL_OVERHEAD_SECONDS = 4e-6  # launch and tail of one kernel, from the host's side
# Narrow work leaves most of the chip idle; two shapes of it, from the 3D U-Net on an H200
# (128^3, batch 2, 16 channels, fp32; bench/results/gpu/2026-11-29-nvidia-h200/fit.json), whose
# step the roofline without them put at a tenth of the measured (blocks 9.5 ms against 89.6):
# - a convolution's implicit GEMM computes output tiles this wide (cuDNN's on Hopper: 64-256) in
#   each of its two output dimensions, so 16 output channels use 16/128 of every tile: the 16->16
#   convolution's forward measured 1.31 ms against 1.34 so counted (57.9 GFLOP of TF32);
# - batch norm's statistics and their gradients are reduced by one thread block per channel
#   (PyTorch's NCHW kernels), which reaches about a quarter of one multiprocessor's share of the
#   bandwidth (fitted to the same step): the 16-channel batch norm's forward measured 2.07 ms against
#   2.5 so counted, its backward 5.7-5.9 against 4.8 (0.2 ms each at the full bandwidth).
GEMM_TILE = 128
CHANNEL_BLOCK_SHARE = 0.25

_PCIE4_X16 = 32e9   # bytes/s each way: PCI-SIG, PCIe 4.0 x16 (16 GT/s x 16 lanes, 128b/130b)
_PCIE5_X16 = 64e9   # bytes/s each way: PCI-SIG, PCIe 5.0 x16 (32 GT/s x 16 lanes)


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    memory_bytes_per_second: float        # HBM / GDDR bandwidth
    bf16_flops: float                     # dense tensor-core throughput, FLOP/s
    fp16_flops: float
    fp32_flops: float                     # plain FP32 (matmul default: TF32 off)
    tf32_flops: float                     # TF32 tensor cores (cuDNN convolutions by default)
    host_to_device_bytes_per_second: float
    device_to_host_bytes_per_second: float
    source: str
    aliases: tuple[str, ...] = ()
    multiprocessors: int = 0              # streaming multiprocessors (0: unknown, no reduction's width counted)

    def __post_init__(self):
        # A datasheet typed by hand: a string, a zero or a NaN would surface as a ZeroDivisionError
        # or "no layout fits -1 B" deep in a prediction.
        if not isinstance(self.name, str) or not self.name:
            raise InputError(f"a device needs a name, got {self.name!r}")
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes <= 0:
            raise InputError(f"device {self.name}: memory_bytes must be a positive integer, got {self.memory_bytes!r}")
        # FLOP rates may be 0, "not known": a device whose compute times come from a measured profile
        # (bench/bench_simulate.py's CPU share) never reads them.
        for field_name, least in (("memory_bytes_per_second", "positive"),
                                  ("host_to_device_bytes_per_second", "positive"),
                                  ("device_to_host_bytes_per_second", "positive"), ("bf16_flops", "zero"),
                                  ("fp16_flops", "zero"), ("fp32_flops", "zero"), ("tf32_flops", "zero")):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf \
                    or (least == "positive" and value == 0):
                what = "a positive number" if least == "positive" else "a number >= 0 (0: not known)"
                raise InputError(f"device {self.name}: {field_name} must be {what}, got {value!r}")
        if not isinstance(self.aliases, tuple) or not all(isinstance(alias, str) and alias for alias in self.aliases):
            raise InputError(f"device {self.name}: aliases must be a list of names, got {self.aliases!r}")
        if not isinstance(self.multiprocessors, int) or isinstance(self.multiprocessors, bool) \
                or self.multiprocessors < 0:
            raise InputError(f"device {self.name}: multiprocessors must be an integer >= 0, got "
                             f"{self.multiprocessors!r}")

    def flops_for(self, dtype_name: str, op_kind: str = "matmul") -> float:
        """Peak FLOP/s for an op computing in ``dtype_name``; FP32 convolutions use TF32 as cuDNN
        does by default (torch.backends.cudnn.allow_tf32), FP32 matmuls do not (allow_tf32=False)."""
        if dtype_name == "bfloat16":
            return self.bf16_flops
        if dtype_name == "float16":
            return self.fp16_flops
        if dtype_name == "float32" and op_kind == "convolution":
            return self.tf32_flops
        return self.fp32_flops

    def link_profile(self) -> LinkProfile:
        """The swap tier for this device: pinned host memory over its host link."""
        return LinkProfile("pcie", self.device_to_host_bytes_per_second * HOST_LINK_EFFICIENCY,
                           self.host_to_device_bytes_per_second * HOST_LINK_EFFICIENCY)


_H100_SOURCE = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_A100_SOURCE = ("NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
                "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")

_BUILT_IN = [
    Device("h100-sxm", 80 * 10**9, 3.35e12, 989e12, 989e12, 67e12, 494e12, _PCIE5_X16, _PCIE5_X16,
           _H100_SOURCE + " (H100 SXM column)", aliases=("h100",), multiprocessors=132),
    Device("h100-pcie", 80 * 10**9, 2.0e12, 756e12, 756e12, 51e12, 378e12, _PCIE5_X16, _PCIE5_X16,
           _H100_SOURCE + " (H100 PCIe column)", multiprocessors=114),
    Device("h200", 141 * 10**9, 4.8e12, 989e12, 989e12, 67e12, 494e12, _PCIE5_X16, _PCIE5_X16,
           "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM)",
           aliases=("h200-sxm",), multiprocessors=132),
    Device("a100-80gb", 80 * 10**9, 2.039e12, 312e12, 312e12, 19.5e12, 156e12, _PCIE4_X16, _PCIE4_X16,
           _A100_SOURCE + " (A100 80GB SXM column)", aliases=("a100",), multiprocessors=108),
    Device("a100-40gb", 40 * 10**9, 1.555e12, 312e12, 312e12, 19.5e12, 156e12, _PCIE4_X16, _PCIE4_X16,
           _A100_SOURCE + " (A100 40GB PCIe column)", multiprocessors=108),
    Device("l4", 24 * 10**9, 300e9, 121e12, 121e12, 30.3e12, 60e12, _PCIE4_X16, _PCIE4_X16,
           "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/", multiprocessors=58),
    Device("rtx-4090", 24 * 10**9, 1008e9, 165.2e12, 165.2e12, 82.6e12, 82.6e12, _PCIE4_X16, _PCIE4_X16,
           "NVIDIA Ada GPU architecture whitepaper, Table 2 (GeForce RTX 4090; FP16/BF16 tensor with FP32 "
           "accumulate), https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
           aliases=("4090",), multiprocessors=128),
]

_REGISTRY: dict[str, Device] = {}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def register_device(device: Device) -> Device:
    """Add (or replace) a target device; its name and aliases become valid ``target=`` values."""
    if not isinstance(device, Device):
        raise InputError(f"register_device expects an oomless.Device, got {type(device).__name__}")
    for name in (device.name, *device.aliases):
        _REGISTRY[_key(name)] = device
    return device


def load_devices(path: str) -> list[Device]:
    """Register the devices of a JSON file: a list of objects with `Device`'s fields."""
    try:
        with open(path) as file:
            entries = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise InputError(f"cannot read devices from {path}: {error}") from error
    known = {field.name for field in fields(Device)}
    devices = []
    for entry in entries if isinstance(entries, list) else [entries]:
        unknown = sorted(set(entry) - known)
        if unknown:
            raise InputError(f"device entry in {path} has unknown fields {unknown}; known: {sorted(known)}")
        if not isinstance(entry, dict):
            raise InputError(f"device entry in {path} must be an object with Device's fields, got {entry!r:.100}")
        aliases = entry.get("aliases", ())
        entry = {**entry, "aliases": (aliases,) if isinstance(aliases, str) else tuple(aliases)}
        try:
            devices.append(register_device(Device(**entry)))
        except TypeError as error:
            raise InputError(f"device entry in {path} is incomplete: {error}") from error
    return devices


def devices() -> list[Device]:
    """Every registered device, once each."""
    return list({device.name: device for device in _REGISTRY.values()}.values())


def find_device(target: "str | Device") -> Device:
    if isinstance(target, Device):
        return target
    if _LOAD_ERROR is not None:
        raise _LOAD_ERROR
    device = _REGISTRY.get(_key(str(target)))
    if device is None:
        names = ", ".join(sorted(_REGISTRY))
        raise InputError(f"unknown target device {target!r}; known: {names}. Add one with "
                         "oomless.register_device(oomless.Device(...)) or OOMLESS_DEVICES=devices.json")
    return device


def describe(device: Device) -> dict:
    return asdict(device)


for _device in _BUILT_IN:
    register_device(_device)
# A bad OOMLESS_DEVICES file is said where a target is first looked up, as a one-line error: raised
# here, at import, it was a traceback before any command could report it.
_LOAD_ERROR: InputError | None = None
if os.environ.get("OOMLESS_DEVICES"):
    try:
        load_devices(os.environ["OOMLESS_DEVICES"])
    except InputError as error:
        _LOAD_ERROR = InputError(f"OOMLESS_DEVICES: {error}")
