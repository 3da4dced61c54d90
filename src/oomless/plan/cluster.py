"""The cluster a simulation runs on: a target device, GPUs per node, nodes, and the two links
between GPUs (within a node, between nodes), each with a bandwidth and a latency.

    cluster = make_cluster("h100", gpus=64, nodes=8)               # 8 nodes of 8 H100 SXM, NVLink 4 + IB NDR
    cluster = make_cluster("h100", gpus=16, nodes=2, path="cluster.json")   # links from a file

A cluster file is a JSON object; every key is optional and overrides the default:

    {"intra_node": {"bytes_per_second": 450e9, "latency_seconds": 3e-6},
     "inter_node": {"bytes_per_second": 25e9, "latency_seconds": 8e-6, "name": "RoCE 200G"},
     "efficiency": 0.8}

Defaults (each from the datasheet cited next to it; latencies are assumptions, the order of NCCL's
per-step cost on such links, not measurements of ours):
- H100 SXM / H200 nodes (DGX H100 / HGX H100 8-GPU): NVLink 4, 900 GB/s per GPU in both directions
  together, so 450 GB/s each way; between nodes one ConnectX-7 InfiniBand NDR port of 400 Gb/s
  (50 GB/s each way) per GPU, rail-optimised (GPU i of every node on rail i).
- A100 SXM nodes (DGX A100): NVLink 3, 600 GB/s both ways (300 GB/s each way); HDR 200 Gb/s per GPU.
- PCIe cards (h100-pcie, a100-40gb, l4, rtx-4090): GPU to GPU through the device's PCIe link
  (the device table's host link), and the InfiniBand NDR port between nodes.

Real collectives do not reach the link's raw rate: every bandwidth is scaled by ``efficiency``
(default 0.8, an assumption: nccl-tests bus bandwidths on such systems are 70-90 % of the link rate).

``"backend"``: the collective library, ``"nccl"`` (default; GPUs) or ``"gloo"`` (CPU processes): the
trainer synchronises BatchNorm differently under each (`plan.layouts.batchnorm_sync_seconds`).

``"overlap"``: whether collectives run beside compute (true; the default under NCCL, whose kernels
and copy engines work while the GPU computes) or on the cores compute runs on, so that compute waits
for them (false; the default under gloo, whose threads reduce and copy on the CPU: measured on 2
cores filled by the ranks' compute, FSDP2's collectives lengthened the step by about their own time).

``"cores_per_node"`` and ``"threads_per_rank"``: CPU hosts whose ranks share the node's cores (default
none: each rank has its device to itself, as GPUs do). Ranks computing at the same time then share
the cores: with b of them busy, each runs ``contention(b) = max(1, b x threads_per_rank /
cores_per_node)`` times slower than alone (processor sharing; memory bandwidth and caches shared as
well are not modelled). The profile a simulation is given is one rank's step with the cores to itself
(bench/bench_simulate.py profiles rank 0 while the other ranks wait). Data-parallel ranks compute
together throughout the step; a pipeline's ranks idle in its bubble, so fewer share the cores
(`plan.layouts`).

``"contention"``: the same slowdown measured instead, ``{"2": 1.05, "4": 1.5}``: busy ranks to how many
times slower each computes than alone (bench/bench_simulate.py times a plain step of the model in k
of its ranks at once). Between the counts measured it is interpolated linearly (1 busy rank: 1);
past the last it grows in proportion to the busy ranks, as processor sharing would. On a 2-core
Intel Xeon VM with one thread a rank, 4 ranks at once ran 1.47x slower in one probe and 1.87-2.30x
in the benchmark's interleaved rounds, against the formula's 2x: the machine, not the formula, says.

``"fsdp_host_seconds"``: seconds of FSDP2's own work around each all-gather and reduce-scatter (its
hooks, the copies into and out of the flat buffers) on the cores compute runs on; default 0 (on a
GPU the host runs ahead of the kernels). bench/bench_simulate.py measures it for gloo on CPU.
"""

import json
import math
from dataclasses import asdict, dataclass, replace

from oomless.errors import InputError
from oomless.plan.devices import Device, find_device

# Achievable share of a link's datasheet rate for NCCL collectives (assumption; module docstring).
LINK_EFFICIENCY = 0.8
BACKENDS = ("nccl", "gloo")

_H100_SOURCE = ("NVIDIA H100 Tensor Core GPU datasheet (NVLink 900 GB/s per GPU, both directions), "
                "https://www.nvidia.com/en-us/data-center/h100/")
_A100_SOURCE = ("NVIDIA A100 Tensor Core GPU datasheet (NVLink 600 GB/s per GPU, both directions), "
                "https://www.nvidia.com/en-us/data-center/a100/")
_NDR_SOURCE = ("NVIDIA ConnectX-7 datasheet, InfiniBand NDR 400 Gb/s per port (one per GPU in a DGX H100), "
               "https://www.nvidia.com/en-us/networking/ethernet-adapters/")
_HDR_SOURCE = ("NVIDIA ConnectX-6 datasheet, InfiniBand HDR 200 Gb/s per port (one per GPU in a DGX A100), "
               "https://www.nvidia.com/en-us/networking/ethernet-adapters/")
# Latencies: assumptions (module docstring).
_NVLINK_LATENCY_SECONDS = 3e-6
_PCIE_LATENCY_SECONDS = 5e-6
_INFINIBAND_LATENCY_SECONDS = 8e-6


@dataclass(frozen=True)
class Link:
    """One direction of a link from one GPU: datasheet bytes per second and a per-message latency."""

    name: str
    bytes_per_second: float
    latency_seconds: float
    source: str = ""


_NVLINK4 = Link("NVLink 4", 450e9, _NVLINK_LATENCY_SECONDS, _H100_SOURCE)
_NVLINK3 = Link("NVLink 3", 300e9, _NVLINK_LATENCY_SECONDS, _A100_SOURCE)
_NDR = Link("InfiniBand NDR 400 Gb/s", 400e9 / 8, _INFINIBAND_LATENCY_SECONDS, _NDR_SOURCE)
_HDR = Link("InfiniBand HDR 200 Gb/s", 200e9 / 8, _INFINIBAND_LATENCY_SECONDS, _HDR_SOURCE)
# Device name -> (within a node, between nodes); devices not listed use their PCIe link and NDR.
_DEFAULT_LINKS = {"h100-sxm": (_NVLINK4, _NDR), "h200": (_NVLINK4, _NDR), "a100-80gb": (_NVLINK3, _HDR)}


@dataclass(frozen=True)
class Cluster:
    device: Device
    gpus_per_node: int
    nodes: int
    intra_node: Link
    inter_node: Link
    efficiency: float = LINK_EFFICIENCY
    backend: str = "nccl"
    overlap: bool = True        # collectives run beside compute (module docstring)
    cores_per_node: int | None = None   # CPU hosts: the cores a node's ranks share (module docstring)
    threads_per_rank: int = 1
    fsdp_host_seconds: float = 0.0      # per FSDP2 all-gather or reduce-scatter (module docstring)
    # (busy ranks, slowdown) measured, in order of busy ranks; empty: the formula (module docstring)
    measured_contention: tuple[tuple[int, float], ...] = ()

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def contention(self, busy_ranks: float) -> float:
        """How many times slower a rank computes while ``busy_ranks`` ranks of its node compute at
        once than with the node to itself (1 unless the ranks share cores: module docstring)."""
        if self.measured_contention:
            points = [(1, 1.0)] + [point for point in self.measured_contention if point[0] > 1]
            if busy_ranks <= 1:
                return 1.0
            for (low, low_value), (high, high_value) in zip(points, points[1:]):
                if busy_ranks <= high:
                    return low_value + (high_value - low_value) * (busy_ranks - low) / (high - low)
            last, last_value = points[-1]
            return last_value * busy_ranks / last
        if self.cores_per_node is None:
            return 1.0
        return max(1.0, busy_ranks * self.threads_per_rank / self.cores_per_node)

    def effective(self, link: Link) -> tuple[float, float]:
        """(bytes per second a collective reaches on ``link``, its latency)."""
        return link.bytes_per_second * self.efficiency, link.latency_seconds

    def describe(self) -> dict:
        return {"device": self.device.name, "device_memory_bytes": self.device.memory_bytes, "gpus": self.gpus,
                "gpus_per_node": self.gpus_per_node,
                "nodes": self.nodes, "intra_node": asdict(self.intra_node), "inter_node": asdict(self.inter_node),
                "efficiency": self.efficiency, "backend": self.backend, "overlap": self.overlap,
                "cores_per_node": self.cores_per_node, "threads_per_rank": self.threads_per_rank,
                "fsdp_host_seconds": self.fsdp_host_seconds,
                "contention": {str(busy): value for busy, value in self.measured_contention} or None}

    def summary(self) -> str:
        inter = (f", {self.inter_node.name} {self.inter_node.bytes_per_second / 1e9:g} GB/s per GPU between nodes"
                 if self.nodes > 1 else "")
        return (f"{self.nodes} x {self.gpus_per_node} {self.device.name}: {self.intra_node.name} "
                f"{self.intra_node.bytes_per_second / 1e9:g} GB/s each way within a node{inter}; "
                f"collectives at {self.efficiency:.0%} of link rate"
                + ("" if self.overlap else ", on the cores compute runs on (no overlap)")
                + (f"; {self.gpus_per_node} ranks of {self.threads_per_rank} thread(s) share {self.cores_per_node} "
                   "cores per node" if self.cores_per_node is not None else ""))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_counts(gpus: int, nodes: int) -> None:
    """Raise `InputError` unless ``gpus`` GPUs spread evenly over ``nodes`` nodes."""
    for flag, value in (("gpus", gpus), ("nodes", nodes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{flag} must be a positive integer, got {value!r}")
    if gpus % nodes:
        raise InputError(f"{gpus} GPUs do not spread evenly over {nodes} nodes: give a number of nodes dividing "
                         f"{gpus} ({', '.join(map(str, _divisors(gpus)))}) or a multiple of {nodes} GPUs "
                         f"({', '.join(str(nodes * k) for k in range(1, 5))}, ...)")


def _link_from(entry, default: Link, where: str) -> Link:
    if not isinstance(entry, dict):
        raise InputError(f"{where} must be an object with bytes_per_second and latency_seconds, got {entry!r}")
    unknown = sorted(set(entry) - {"name", "bytes_per_second", "latency_seconds", "source"})
    if unknown:
        raise InputError(f"{where} has unknown fields {unknown}; known: bytes_per_second, latency_seconds, "
                         "name, source")
    link = replace(default, **entry)
    if not (_is_number(link.bytes_per_second) and 0 < link.bytes_per_second < math.inf
            and _is_number(link.latency_seconds) and 0 <= link.latency_seconds < math.inf):
        raise InputError(f"{where} needs bytes_per_second > 0 and latency_seconds >= 0, as numbers (3e-6, not "
                         f"\"3us\"), got {entry}")
    return link


def _is_number(value) -> bool:
    """A JSON number: not a string, null or true (which Python would take for 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_cluster(target, gpus: int, nodes: int = 1, path: str | None = None, overrides: dict | None = None) -> Cluster:
    """The cluster of ``gpus`` ``target`` devices on ``nodes`` nodes, links by default from the
    table above, overridden by the JSON file at ``path`` and then by ``overrides`` (same keys)."""
    device = find_device(target)
    check_counts(gpus, nodes)
    pcie = Link("PCIe", device.host_to_device_bytes_per_second, _PCIE_LATENCY_SECONDS, device.source)
    intra, inter = _DEFAULT_LINKS.get(device.name, (pcie, _NDR))
    settings = {}
    if path is not None:
        try:
            with open(path) as file:
                settings = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise InputError(f"cannot read the cluster file {path}: {error}") from None
        if not isinstance(settings, dict):
            raise InputError(f"the cluster file {path} must hold a JSON object, got {type(settings).__name__}")
    settings = {**settings, **(overrides or {})}
    unknown = sorted(set(settings) - {"intra_node", "inter_node", "efficiency", "backend", "overlap",
                                      "cores_per_node", "threads_per_rank", "fsdp_host_seconds", "contention"})
    if unknown:
        raise InputError(f"cluster settings have unknown keys {unknown}; known: intra_node, inter_node, efficiency, "
                         "backend, overlap, cores_per_node, threads_per_rank, fsdp_host_seconds, contention")
    backend = settings.get("backend", "nccl")
    if backend not in BACKENDS:
        raise InputError(f"cluster backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    overlap = settings.get("overlap", backend != "gloo")
    if not isinstance(overlap, bool):
        raise InputError(f"cluster overlap must be true or false (whether collectives run beside compute), "
                         f"got {overlap!r}")
    efficiency = settings.get("efficiency", LINK_EFFICIENCY)
    if not _is_number(efficiency) or not 0 < efficiency <= 1:
        raise InputError(f"cluster efficiency must be in (0, 1], got {efficiency!r}")
    cores = settings.get("cores_per_node")
    threads = settings.get("threads_per_rank", 1)
    for key, value in (("cores_per_node", cores), ("threads_per_rank", threads)):
        if (value is not None or key == "threads_per_rank") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"cluster {key} must be a positive integer, got {value!r} (cores_per_node: the cores a "
                             "CPU node's ranks share; leave it out for GPUs)")
    fsdp_host = settings.get("fsdp_host_seconds", 0.0)
    if not _is_number(fsdp_host) or not 0 <= fsdp_host < math.inf:
        raise InputError(f"cluster fsdp_host_seconds must be a number of seconds >= 0, got {fsdp_host!r}")
    contention = _contention_from(settings.get("contention"))
    if "intra_node" in settings:
        intra = _link_from(settings["intra_node"], intra, "intra_node")
    if "inter_node" in settings:
        inter = _link_from(settings["inter_node"], inter, "inter_node")
    return Cluster(device, gpus // nodes, nodes, intra, inter, float(efficiency), backend, overlap, cores, threads,
                   float(fsdp_host), contention)


def _contention_from(table) -> tuple[tuple[int, float], ...]:
    """The ``"contention"`` setting checked: {busy ranks: slowdown}, JSON's string keys taken as ints."""
    if table is None:
        return ()
    problem = "" if isinstance(table, dict) and table else "a non-empty object"
    points = []
    for busy, value in (table.items() if not problem else ()):
        try:
            count = int(busy)
        except (TypeError, ValueError):
            count = 0
        if count < 1 or not _is_number(value) or not 0 < value < math.inf:
            problem = f"busy-rank counts (positive integers) mapped to positive slowdowns, got {busy!r}: {value!r}"
            break
        points.append((count, float(value)))
    if problem:
        raise InputError(f"cluster contention must be {problem}, e.g. {{\"2\": 1.05, \"4\": 1.5}} (how many "
                         f"times slower a rank computes while that many ranks of its node compute); got {table!r:.200}")
    return tuple(sorted(points))
