"""Whole-volume tensors kept off the device and read and written by rows along one axis.

A graph computed in slabs (`runtime.slabs`) keeps each normalisation's input here in forward, and the
gradients reaching those inputs in backward, so that neither is computed again nor held whole where
compute runs: on the CPU in a file (the kernel's page cache, then the disk: not the process's resident
memory), on a GPU in pinned host memory.

    store = row_store(shape, dtype, device)     # zeros
    store.write(low, slab)                      # rows [low, low + slab.shape[axis]) along ``axis``
    slab = store.read(low, high)                # a new tensor on ``device`` (or into ``out=``, a buffer)
    store.add(low, gradient)                    # read, add, write
"""

import contextlib
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
        """`_move` over rows [low, ...) of each plane of ``slab``."""
        for plane, data in enumerate(self._planes(slab)):
            self._move(data, plane * self.plane_bytes + low * self.row_bytes, move)

    @staticmethod
    def _move(data, offset: int, move) -> None:
        """``move(buffer, file offset)`` (a pwrite or a preadv: the bytes moved, maybe fewer than asked,
        0 at the file's end) over all of ``data`` (bytes), from ``offset`` on."""
        view = memoryview(data)
        while view.nbytes:
            moved = move(view, offset)
            if moved == 0:
                raise OSError(f"oomless: a row store's file ended at byte {offset}")
            view, offset = view[moved:], offset + moved

    @contextlib.contextmanager
    def _writing(self):
        try:
            yield
        except OSError as error:
            raise OSError(error.errno, f"oomless keeps the whole-volume tensors of slabs in {tempfile.gettempdir()} "
                          f"({self.planes * self.plane_bytes / 2**20:.0f} MiB for this one) and could not write "
                          f"there: {error.strerror}. Set TMPDIR to a folder on a disk with room") from error

    def write(self, low: int, slab: torch.Tensor) -> None:
        slab = slab.detach().contiguous()
        with self._writing():
            self._each_plane(low, slab, lambda view, offset: os.pwrite(self.file.fileno(), view, offset))

    def read(self, low: int, high: int, out: torch.Tensor | None = None) -> torch.Tensor:
        shape = self.shape[:AXIS] + (high - low,) + self.shape[AXIS + 1:]
        slab = torch.empty(shape, dtype=self.dtype) if out is None else _fitted(out, shape, self.dtype)
        self._each_plane(low, slab, lambda view, offset: os.preadv(self.file.fileno(), [view], offset))
        return slab

    def add(self, low: int, slab: torch.Tensor) -> None:
        """Rows [low, ...) += ``slab``, one plane at a time through one plane's buffer (not a whole slab
        read into new memory: under a low mmap threshold every new tensor is page-faulted in)."""
        planes = slab.detach().to(self.dtype).contiguous().view(-1).reshape(self.planes, -1)
        buffer = torch.empty(planes.shape[1], dtype=self.dtype)
        raw = buffer.view(torch.uint8).numpy()
        with self._writing():
            for plane, values in enumerate(planes):
                offset = plane * self.plane_bytes + low * self.row_bytes
                self._move(raw, offset, lambda view, at: os.preadv(self.file.fileno(), [view], at))
                buffer.add_(values)
                self._move(raw, offset, lambda view, at: os.pwrite(self.file.fileno(), view, at))

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

    def read(self, low: int, high: int, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.host.narrow(AXIS, low, high - low)
        if out is None:
            return rows.to(self.device, copy=True).contiguous()
        return _fitted(out, rows.shape, self.dtype).copy_(rows)

    def add(self, low: int, slab: torch.Tensor) -> None:
        self.host.narrow(AXIS, low, slab.shape[AXIS]).add_(slab.detach().to("cpu"))

    def close(self) -> None:
        self.host = None

    @property
    def closed(self) -> bool:
        return self.host is None


def _fitted(buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` over the start of ``buffer`` (reused for slabs of a few sizes)."""
    count = math.prod(shape)
    if buffer.dtype != dtype or buffer.numel() < count or not buffer.is_contiguous():
        raise ValueError(f"a buffer of {buffer.numel()} {buffer.dtype} cannot hold rows {tuple(shape)} of {dtype}")
    return buffer.view(-1)[:count].view(shape)


def row_store(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> FileRows | HostRows:
    """Zeros of ``shape`` kept where they take none of ``device``'s memory."""
    return FileRows(shape, dtype) if device.type == "cpu" else HostRows(shape, dtype, device)
