"""Measure the bandwidth of the swap tier once per process: pinned host <-> CUDA, or local disk."""

import functools
import os
import tempfile
import time

import numpy as np
import torch

from oomless.profile.profile import LinkProfile

_PROBE_BYTES = 64 * 2**20


@functools.cache
def measure_link(device_text: str) -> LinkProfile:
    device = torch.device(device_text)
    if device.type == "cuda":
        return _measure_pcie(device)
    return _measure_disk()


def _measure_pcie(device: torch.device) -> LinkProfile:
    host = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    # The copies run on `device`'s current stream; the events must be recorded there too, not on
    # the current device's (another GPU's) stream, or they would time nothing.
    stream = torch.cuda.current_stream(device)
    seconds = {}
    for direction, (destination, source) in {"out": (host, on_device), "in": (on_device, host)}.items():
        destination.copy_(source, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(4):
            destination.copy_(source, non_blocking=True)
        end.record(stream)
        end.synchronize()  # profiling only: once per process
        seconds[direction] = start.elapsed_time(end) / 1000.0 / 4
    return LinkProfile("pcie", _PROBE_BYTES / seconds["out"], _PROBE_BYTES / seconds["in"])


_DISK_CHUNK_BYTES = 4 * 2**20


def _measure_disk() -> LinkProfile:
    """64 MiB written and read back through one 4 MiB buffer: the probe itself must not add more
    resident memory than a small step (it runs inside the budget it measures for)."""
    chunk = np.random.default_rng(0).integers(0, 255, _DISK_CHUNK_BYTES, dtype=np.uint8)
    chunks = _PROBE_BYTES // _DISK_CHUNK_BYTES
    with tempfile.TemporaryDirectory(prefix="oomless-probe-") as directory:
        path = os.path.join(directory, "probe.bin")
        start = time.perf_counter()
        with open(path, "wb") as file:
            for _ in range(chunks):
                file.write(chunk.data)
        written = time.perf_counter()
        with open(path, "rb", buffering=0) as file:
            while file.readinto(chunk.data):
                pass
        read = time.perf_counter()
    return LinkProfile("disk", _PROBE_BYTES / (written - start), _PROBE_BYTES / (read - written))
