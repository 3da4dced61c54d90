"""Whole-volume tensors kept off the device and read and written by rows along one axis.

A graph computed in slabs (`runtime.slabs`) keeps each normalisation's input here in forward, and the
gradients reaching those inputs in backward, so that neither is computed again nor held whole where
compute runs: on the CPU in a file (the kernel's page cache, then the disk: not the process's resident
memory), on a GPU in pinned host memory.

    store = row_store(shape, dtype, device)     # zeros
    store.write(low, slab)                      # rows [low, low + slab.shape[axis]) along ``axis``
    slab = store.read(low, high)                # a new tensor on ``device``
    store.add(low, gradient)                    # read, add, write
"""

import math
import os
import tempfile

import torch

AXIS = 2    # the first spatial dimension of (N, C, D, ...)


class FileRows:
    """A tensor of ``shape`` in an unlinked file (compute on CPU), laid out as the tensor is: the rows
    of one (sample, channel) plane are contiguous, so a slab is one read or write per plane."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, directory: str | None = None):
        self.shape, self.dtype = tuple(shape), dtype
        self.planes = math.prod(shape[:AXIS])
        self.row_bytes = math.prod(shape[AXIS + 1:]) * torch.empty((), dtype=dtype).element_size()
        self.plane_bytes = shape[AXIS] * self.row_bytes
        self.file = tempfile.TemporaryFile(prefix="oomless-rows-", dir=directory)
        os.ftruncate(self.file.fileno(), self.planes * self.plane_bytes)      # a hole: reads as zeros

    def _planes(self, slab: torch.Tensor):
        # view(-1) first: a contiguous tensor may have any stride along a dim of size 1, view(uint8) not.
        return slab.view(-1).view(torch.uint8).numpy().reshape(self.planes, -1)

    def _each_plane(self, low: int, slab: torch.Tensor, move) -> None:
        """``move(buffer, file offset)`` (a pwrite or a preadv: the bytes moved, maybe fewer than asked,
        0 at the file's end) over rows [low, ...) of each plane of ``slab``, until all are moved."""
        for plane, data in enumerate(self._planes(slab)):
            view, offset = memoryview(data), plane * self.plane_bytes + low * self.row_bytes
            while view.nbytes:
                moved = move(view, offset)
                if moved == 0:
                    raise OSError(f"oomless: a row store's file ended at byte {offset}")
                view, offset = view[moved:], offset + moved

    def write(self, low: int, slab: torch.Tensor) -> None:
        slab = slab.detach().contiguous()
        try:
            self._each_plane(low, slab, lambda view, offset: os.pwrite(self.file.fileno(), view, offset))
        except OSError as error:
            raise OSError(error.errno, f"oomless keeps the whole-volume tensors of slabs in {tempfile.gettempdir()} "
                          f"({self.planes * self.plane_bytes / 2**20:.0f} MiB for this one) and could not write "
                          f"there: {error.strerror}. Set TMPDIR to a folder on a disk with room") from error

    def read(self, low: int, high: int) -> torch.Tensor:
        slab = torch.empty(self.shape[:AXIS] + (high - low,) + self.shape[AXIS + 1:], dtype=self.dtype)
        self._each_plane(low, slab, lambda view, offset: os.preadv(self.file.fileno(), [view], offset))
        return slab

    def add(self, low: int, slab: torch.Tensor) -> None:
        self.write(low, self.read(low, low + slab.shape[AXIS]).add_(slab))

    def close(self) -> None:
        self.file.close()

    @property
    def closed(self) -> bool:
        return self.file.closed


class HostRows:
    """A tensor of ``shape`` in pinned host memory (compute on a GPU), read and written by copies."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")

    def write(self, low: int, slab: torch.Tensor) -> None:
        self.host.narrow(AXIS, low, slab.shape[AXIS]).copy_(slab.detach())

    def read(self, low: int, high: int) -> torch.Tensor:
        return self.host.narrow(AXIS, low, high - low).to(self.device, copy=True).contiguous()

    def add(self, low: int, slab: torch.Tensor) -> None:
        self.host.narrow(AXIS, low, slab.shape[AXIS]).add_(slab.detach().to("cpu"))

    def close(self) -> None:
        self.host = None

    @property
    def closed(self) -> bool:
        return self.host is None


def row_store(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> FileRows | HostRows:
    """Zeros of ``shape`` kept where they take none of ``device``'s memory."""
    return FileRows(shape, dtype) if device.type == "cpu" else HostRows(shape, dtype, device)
