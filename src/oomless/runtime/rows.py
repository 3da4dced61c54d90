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
import itertools
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
    """A tensor of ``shape`` in pinned host memory (compute on a GPU), kept rows first ((D, N, C, ...)
    for (N, C, D, ...)) so that any rows [low, high) are one contiguous block: each read, write or
    add is one DMA copy each way, queued on the current stream (``non_blocking``), and the
    transposition to and from (N, C, D, ...) is a copy on the device. Kept as (N, C, D, ...), rows
    [low, high) would be N x C strided blocks, which ``copy_`` between devices moves through a
    pageable temporary, a gather on the CPU and a synchronous copy (aten/src/ATen/native/cuda/Copy.cu,
    ``copy_requires_temporaries``), and an ``add`` would run on the CPU: on an H200 40x the step.
    Rows never written read as zeros without the whole volume being zeroed on the CPU first."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        rows_first = (shape[AXIS],) + tuple(shape[:AXIS]) + tuple(shape[AXIS + 1:])
        self.host = torch.empty(rows_first, dtype=dtype, pin_memory=device.type == "cuda")
        self.written = [False] * shape[AXIS]

    # No synchronisation: the host memory is only ever read and written by copies on the stream that
    # computes (the slab engine's backward is a custom Function's, which autograd runs on its
    # forward's stream), so each is ordered after the one before it; the caching host allocator keeps
    # a closed store's memory until the copies queued on it are done (it records an event with each).

    def _staged(self, low: int, high: int) -> torch.Tensor:
        """Rows [low, high) on the device, rows first (a new tensor), unwritten rows zeros."""
        staged = self.host.narrow(0, low, high - low).to(self.device, non_blocking=True, copy=True)
        row = 0
        for written, run in itertools.groupby(self.written[low:high]):
            count = len(list(run))
            if not written:
                staged.narrow(0, row, count).zero_()
            row += count
        return staged

    def write(self, low: int, slab: torch.Tensor) -> None:
        rows = slab.shape[AXIS]
        self.host.narrow(0, low, rows).copy_(slab.detach().movedim(AXIS, 0), non_blocking=True)
        self.written[low:low + rows] = [True] * rows

    def read(self, low: int, high: int, out: torch.Tensor | None = None) -> torch.Tensor:
        staged = self._staged(low, high).movedim(0, AXIS)
        if out is None:
            return staged.contiguous()
        return _fitted(out, staged.shape, self.dtype).copy_(staged)

    def add(self, low: int, slab: torch.Tensor) -> None:
        rows = slab.shape[AXIS]
        staged = self._staged(low, low + rows)
        staged.add_(slab.detach().movedim(AXIS, 0))
        self.host.narrow(0, low, rows).copy_(staged, non_blocking=True)
        self.written[low:low + rows] = [True] * rows

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
