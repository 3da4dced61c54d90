"""Where swapped activations live: pinned host memory (compute on CUDA) or a file store on local
disk (compute on CPU). A tier moves raw storage bytes (uint8 tensors) out and back without
blocking compute; each `put` returns a ticket that `prefetch` and `get` take.

CUDA tier synchronisation rules (each wait below names the hazard it prevents):
- device->host copies run on `copy_out_stream`, host->device copies on `copy_in_stream`, two streams
  of oomless's own (`dedicated_copy_streams`), never shared with compute or communication;
- the compute stream never waits on the host: every ordering is an event wait between streams.
"""

import ctypes
import functools
import itertools
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from oomless.profile.rss import glibc
from oomless.runtime.pinned_pool import PinnedPool

_CU_STREAM_NON_BLOCKING = 0x1
_copy_streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream, bool]] = {}


def dedicated_copy_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream, bool]:
    """(copy-out, copy-in, dedicated): two CUDA streams for the tier's copies, made once per device
    and process and kept for its life.

    Not ``torch.cuda.Stream()``: that hands out one of 32 pooled streams per priority, round robin,
    shared with everything else in the process (NCCL's communication streams, other libraries, an
    earlier tier): a copy queued behind an unrelated all-reduce would stall backward. So the streams
    are created with the driver API (``cuStreamCreate``, non-blocking: a blocking stream would
    serialise with work on the legacy default stream, which is PyTorch's compute stream) and wrapped
    in ``torch.cuda.ExternalStream``. Never destroyed: the caching allocator keeps blocks keyed by
    stream. Default priority: CUDA's stream priorities order kernels only and have no effect on
    host<->device memory operations (cudaStreamCreateWithPriority), which is all these streams carry.
    If the driver call is not possible, pooled streams are used and ``dedicated`` is False."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _copy_streams:
        try:
            streams = tuple(_driver_stream(index) for _ in range(2)) + (True,)
        except (OSError, RuntimeError) as error:
            import warnings

            warnings.warn(f"oomless: copy streams from PyTorch's shared pool ({error})", RuntimeWarning, stacklevel=2)
            streams = (torch.cuda.Stream(index), torch.cuda.Stream(index), False)
        _copy_streams[index] = streams
    return _copy_streams[index]


def _driver_stream(index: int) -> torch.cuda.Stream:
    driver = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):
        # Makes the device's primary context current on this thread, where cuStreamCreate puts the stream.
        torch.cuda.current_stream().query()
        result = driver.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(_CU_STREAM_NON_BLOCKING))
    if result != 0:
        raise RuntimeError(f"cuStreamCreate returned CUresult {result}")
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (storages have no ``record_stream``)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _CudaTicket:
    __slots__ = ("host", "host_ready", "source", "out_done", "device", "in_done", "whole")

    def __init__(self):
        self.host = self.host_ready = self.source = self.out_done = self.device = self.in_done = None
        self.whole = False      # the bytes put are their whole storage: `prefetch` may read them in place


class PinnedHostTier:
    """Swap to pinned host memory over dedicated copy streams (compute on CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_out_stream, self.copy_in_stream, self.dedicated_streams = dedicated_copy_streams(device)
        self.pool = PinnedPool()
        self._stall_marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Bytes whose copy out may still run, bounded where set (`put` then waits for the oldest):
        # without a bound and without a budget the forward outruns the copies, and every swapped
        # activation stays on the device until its copy has run. The profiler's sizing step, which
        # has no budget, so peaked at plain PyTorch's 880 MiB on the 3D U-Net (H200, 2026-11-27).
        # None: the plan's budget bounds them (`SavedTensorEngine.make_room`).
        self.max_pending_bytes: int | None = None
        self._pending: deque[tuple[_CudaTicket, int]] = deque()
        self._pending_bytes = 0
        self._waited_seconds = 0.0      # host time `put` waited for room, counted as stall

    def _wait_for_room(self, num_bytes: int) -> None:
        while self._pending:
            ticket, size = self._pending[0]
            if ticket.source is not None and not ticket.out_done.query():
                if self._pending_bytes + num_bytes <= self.max_pending_bytes:
                    return
                # A host synchronisation, only where a bound is set. The storage stays with the
                # ticket: the engine's next poll frees it and takes it off the ledger together.
                started = time.perf_counter()
                ticket.out_done.synchronize()
                self._waited_seconds += time.perf_counter() - started
            self._pending.popleft()
            self._pending_bytes -= size

    def put(self, data: torch.Tensor) -> _CudaTicket:
        if self.max_pending_bytes is not None:
            self._wait_for_room(data.numel())
        ticket = _CudaTicket()
        compute_stream = torch.cuda.current_stream(self.device)
        produced = torch.cuda.Event()
        produced.record(compute_stream)
        ticket.host, ticket.host_ready = self.pool.acquire(data.numel())
        with torch.cuda.stream(self.copy_out_stream):
            # Hazard: reading the activation before the compute stream has finished writing it.
            self.copy_out_stream.wait_event(produced)
            if ticket.host_ready is not None:
                # Hazard: overwriting a pooled buffer that a host->device copy still reads.
                self.copy_out_stream.wait_event(ticket.host_ready)
            ticket.host.copy_(data, non_blocking=True)
            ticket.out_done = torch.cuda.Event()
            ticket.out_done.record(self.copy_out_stream)
        # Hazard: the caching allocator handing this memory to a new tensor on the compute stream
        # while the copy still reads it. The ticket holds the storage until `is_out`/`wait_out`
        # see `out_done` complete, so it goes back to the allocator exactly when the ledger takes
        # it off. Not `record_stream`: that counts the bytes as freed in `max_memory_allocated`
        # at once, yet keeps the block unusable until this stream passes an event recorded at
        # free time, behind every copy queued since, so the ledger's "out" would not mean free.
        ticket.source = data.untyped_storage()   # the storage object alone: one reference (see DiskTier.put)
        ticket.whole = data.storage_offset() == 0 and data.numel() == ticket.source.nbytes()
        if self.max_pending_bytes is not None:
            self._queued(ticket, data.numel())
        return ticket

    def _queued(self, ticket: _CudaTicket, num_bytes: int) -> None:
        """``ticket``'s copy out is queued: its bytes count against ``max_pending_bytes`` until done."""
        self._pending.append((ticket, num_bytes))
        self._pending_bytes += num_bytes

    def is_out(self, ticket: _CudaTicket) -> bool:
        if ticket.out_done.query():
            ticket.source = None
            return True
        return False

    def wait_out(self, ticket: _CudaTicket) -> None:
        ticket.out_done.synchronize()
        ticket.source = None

    def prefetch(self, ticket: _CudaTicket) -> None:
        if ticket.device is not None:
            return
        if ticket.source is not None and ticket.whole:
            # The copy out has not been seen complete, so the bytes themselves are still on the
            # device (the last blocks' saves, when backward follows the forward at once): they are
            # read in place, with no copy back and no second device buffer. Safe where nothing
            # writes them while the host copy is still wanted: backward only reads saved tensors;
            # offloaded parameters put a clone; offloaded optimizer state is released at its `get`.
            ticket.device = _bytes_of(ticket.source)
            return
        with torch.cuda.stream(self.copy_in_stream):
            # Hazard: reading the host buffer before the device->host copy has filled it.
            self.copy_in_stream.wait_event(ticket.out_done)
            ticket.device = torch.empty(ticket.host.numel(), dtype=torch.uint8, device=self.device)
            ticket.device.copy_(ticket.host, non_blocking=True)
            ticket.in_done = torch.cuda.Event()
            ticket.in_done.record(self.copy_in_stream)

    def get(self, ticket: _CudaTicket) -> torch.Tensor:
        self.prefetch(ticket)
        if ticket.in_done is None:     # read in place (`prefetch`): made by the compute stream itself
            return ticket.device
        compute_stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute_stream)
        # Hazard: compute reading the activation before the host->device copy has landed.
        compute_stream.wait_event(ticket.in_done)
        after.record(compute_stream)
        self._stall_marks.append((before, after))
        # Hazard: the tensor was allocated on the copy-in stream; without this the allocator could
        # reuse it for the next prefetch while backward on the compute stream still reads it.
        ticket.device.record_stream(compute_stream)
        return ticket.device

    def drop_copy_in(self, ticket: _CudaTicket) -> None:
        """Forget the device copy `get` returned (the host copy stays for the next `get`): for bytes
        that are read again unchanged, such as parameters offloaded between uses. ``in_done`` stays,
        so `release` still waits for that copy before the pool reuses the host buffer."""
        ticket.device = None

    def release(self, ticket: _CudaTicket) -> None:
        if ticket.source is not None and not ticket.out_done.query():
            # Hazard: same as in `put`: never drop the storage while the copy may still read it.
            # Only when autograd drops a saved tensor before any poll saw its copy finish (a
            # graph freed during the forward); rare, and the storage then waits for the copy
            # stream like a record_stream'd block would. Also the common case at the end of the
            # forward: backward reads the last blocks' saves in place (`prefetch`) and drops them
            # while their copies out are still queued.
            _bytes_of(ticket.source).record_stream(self.copy_out_stream)
        last_use = ticket.in_done or ticket.out_done
        self.pool.release(ticket.host, last_use)
        ticket.device = ticket.host = ticket.source = None

    def collect_stall_seconds(self) -> float:
        """Seconds the compute stream spent waiting for copies, from events already complete, and
        the host's waits for room under ``max_pending_bytes``."""
        total, pending = self._waited_seconds, []
        self._waited_seconds = 0.0
        for before, after in self._stall_marks:
            if after.query():
                total += before.elapsed_time(after) / 1000.0
            else:
                pending.append((before, after))
        self._stall_marks = pending
        return total

    def close(self) -> None:
        self._stall_marks.clear()
        self.pool.clear()


class _DiskTicket:
    """A tensor's bytes in a file. ``written``: the write's future until it succeeded, then None (a
    future holds a condition and a lock, ~1 KiB of host memory: optimizer state and parameters keep
    their tickets for the whole run, thousands of them)."""

    __slots__ = ("path", "num_bytes", "written", "read")

    def __init__(self, path: str, num_bytes: int):
        self.path, self.num_bytes = path, num_bytes
        self.written: Future | None = None
        self.read: Future | None = None

    def wait_written(self) -> None:
        future = self.written
        if future is not None:
            future.result()

    def is_written(self) -> bool:
        future = self.written
        return future is None or future.done()

    def _forget_write(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.written = None


def _host_tag() -> str:
    """This machine's name as a directory name may carry it."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True     # another user's process, or not a pid this system has: left alone
    return True


DIRECTORY_KINDS = ("swap", "static")


@functools.cache
def _sweep_left_behind(parent: str) -> list[str]:
    """Remove the ``oomless-{kind}-{host}-{pid}-*`` directories in ``parent`` that processes of this
    host left when they died without cleaning up (killed, or out of memory): the files of a dead
    process's swap and state are never read again. Once per process and directory; what is
    removed, returned."""
    pattern = re.compile(rf"oomless-(?:{'|'.join(DIRECTORY_KINDS)})-{re.escape(_host_tag())}-([0-9]+)-[^-]+")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or int(match[1]) == os.getpid() or _process_alive(int(match[1])):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _remove_own_directory(path: str, owner_pid: int) -> None:
    # A forked child (a DataLoader worker) inherits the object but not the directory's ownership.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def private_directory(owner, kind: str, directory: str | None = None) -> tuple[str, weakref.finalize]:
    """A new directory for ``owner``'s files in ``directory`` (default: the system's temporary
    directory), named ``oomless-{kind}-{host}-{pid}-*``, and the finalizer that removes it: when
    ``owner`` is garbage collected, when the process exits (the owner still alive: a user who never
    calls `oomless.remove`), or when called (the owner's ``close``). A process killed outright leaves
    it; the next process of this host to make one in the same place removes it then."""
    if kind not in DIRECTORY_KINDS:
        raise ValueError(f"kind must be one of {DIRECTORY_KINDS}, got {kind!r}")
    parent = directory if directory is not None else tempfile.gettempdir()
    _sweep_left_behind(os.path.abspath(parent))
    path = tempfile.mkdtemp(prefix=f"oomless-{kind}-{_host_tag()}-{os.getpid()}-", dir=parent)
    return path, weakref.finalize(owner, _remove_own_directory, path, os.getpid())


DISK_MAX_PENDING_BYTES = 256 * 2**20
# The profiler's steps (no budget there): copies out in flight at most, on either tier.
# The sizing step's, 0: each save waits for the copies out before it, one in flight at a time. At
# 256 MiB it held that much more than the all-swap plan's own smallest budget: the 3D U-Net's sizing
# step peaked at 774 MiB, its smallest all-swap budget 479 and a plan at 660 (H200, 2026-11-29), and
# a run must not need more memory to be profiled than to train. On CPU, with the disk's 256 MiB, each
# phase's measured peak held whatever writes happened to lag behind at its reading: one of a
# transformer's four identical layers read 1.5-3 MiB above the others in 4 processes of 22, and the
# smallest budget those named (37-38 MiB) refused the 35 the others named when given back in a fresh
# process; waiting, 16 of 16 named 35. Its times are not used (`profiler._merge_timing_step`), nor its
# link where the timing step moved enough to tell (`profiler._link_minimum_bytes`; without a budget
# that step swaps nothing, and the sizing step's link stays). The timing step's copies run behind
# compute as a plan's do (the disk's writes share the cores with compute, as in training: ~1.3 GB/s
# there against ~2.6 waited for alone), and the host's waits count as stall.
SIZING_MAX_PENDING_BYTES = 0
TIMING_MAX_PENDING_BYTES = 256 * 2**20


class DiskTier:
    """Swap to files on local disk through background workers (compute on CPU).

    The worker holds the tensor only until its bytes are written, so the process's resident memory
    drops; reads are issued ahead of backward (read-ahead) by `prefetch`. ``max_pending_bytes``
    bounds bytes waiting to be written: past it `put` waits for the writer, keeping the promise of
    the memory budget when compute outruns the disk.
    """

    def __init__(self, directory: str | None = None, max_pending_bytes: int = DISK_MAX_PENDING_BYTES):
        self.directory, self._remove_directory = private_directory(self, "swap", directory)
        self.max_pending_bytes = max_pending_bytes
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oomless-disk-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oomless-disk-read")
        self._names = itertools.count()
        self._pending: list[_DiskTicket] = []
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self.stall_seconds = 0.0
        # Bytes and busy seconds of the workers, each direction: the bandwidth this tier really
        # reaches (many files of activation size, sharing the cores with compute), for the planner.
        self.moved = {"out": [0, 0.0], "in": [0, 0.0]}

    def measured_rates(self, minimum_bytes: int = 8 * 2**20) -> tuple[float, float] | None:
        """(out, in) bytes per second seen so far, once both directions moved enough to tell."""
        (out_bytes, out_seconds), (in_bytes, in_seconds) = self.moved["out"], self.moved["in"]
        if min(out_bytes, in_bytes) < minimum_bytes or min(out_seconds, in_seconds) <= 0:
            return None
        return out_bytes / out_seconds, in_bytes / in_seconds

    def put(self, data: torch.Tensor) -> _DiskTicket:
        ticket = _DiskTicket(os.path.join(self.directory, f"{next(self._names)}.bin"), data.numel())
        self._wait_for_room(ticket.num_bytes)
        with self._lock:
            self._pending.append(ticket)
            self._pending_bytes += ticket.num_bytes
        # The writer holds the storage object alone, not a tensor: exactly one reference while the
        # write runs, let go of before the write is seen done (the profiler's recorder reads past it
        # when the forward frees each saved storage: profile/recorder.py `_freed_by_forward`).
        ticket.written = self._writer.submit(self._write, ticket, [data.untyped_storage()])
        ticket.written.add_done_callback(ticket._forget_write)
        return ticket

    def _write(self, ticket: _DiskTicket, holding: list) -> None:
        started = time.perf_counter()
        storage = holding[0]
        view = (ctypes.c_uint8 * ticket.num_bytes).from_address(storage.data_ptr())
        np.frombuffer(view, dtype=np.uint8).tofile(ticket.path)
        del view, storage
        holding.clear()
        self._count("out", ticket.num_bytes, time.perf_counter() - started)
        with self._lock:
            self._pending.remove(ticket)
            self._pending_bytes -= ticket.num_bytes

    def _wait_for_room(self, num_bytes: int) -> None:
        started = time.perf_counter()
        while True:
            with self._lock:
                if not self._pending or self._pending_bytes + num_bytes <= self.max_pending_bytes:
                    break
                oldest = self._pending[0]
            oldest.wait_written()
        self.stall_seconds += time.perf_counter() - started

    def is_out(self, ticket: _DiskTicket) -> bool:
        return ticket.is_written()

    def wait_out(self, ticket: _DiskTicket) -> None:
        ticket.wait_written()

    def prefetch(self, ticket: _DiskTicket) -> None:
        if ticket.read is None:
            ticket.read = self._reader.submit(self._read, ticket)

    def _read(self, ticket: _DiskTicket) -> torch.Tensor:
        ticket.wait_written()
        started = time.perf_counter()
        data = torch.from_numpy(np.fromfile(ticket.path, dtype=np.uint8))
        self._count("in", ticket.num_bytes, time.perf_counter() - started)
        return data

    def _count(self, direction: str, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self.moved[direction][0] += num_bytes
            self.moved[direction][1] += seconds

    def get(self, ticket: _DiskTicket) -> torch.Tensor:
        self.prefetch(ticket)
        started = time.perf_counter()
        data = ticket.read.result()
        self.stall_seconds += time.perf_counter() - started
        return data

    def drop_copy_in(self, ticket: _DiskTicket) -> None:
        """Forget the bytes `get` returned (the file stays for the next `get`)."""
        ticket.read = None

    def release(self, ticket: _DiskTicket) -> None:
        ticket.read = None
        future = ticket.written
        if future is None or future.done():
            _remove_quietly(ticket.path)
        else:
            future.add_done_callback(lambda _: _remove_quietly(ticket.path))

    def collect_stall_seconds(self) -> float:
        stalled, self.stall_seconds = self.stall_seconds, 0.0
        return stalled

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self._remove_directory()


class MappedFile:
    """One tensor's bytes in a file of its own, kept for the life of the store."""

    __slots__ = ("path", "num_bytes", "mapping")

    def __init__(self, path: str, num_bytes: int):
        self.path, self.num_bytes = path, num_bytes
        self.mapping: Future | None = None          # a prefetched mapping, until `map` takes it


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14


class MappedFiles:
    """Static bytes on a CPU-only run (optimizer state, and parameters off the device, which are copied
    from their mapping since autograd holds their own storages): each tensor lives in a file of its
    own, and while optimizer state is in use the tensor *is* the file, mapped shared
    (``torch.from_file``): the optimizer's step updates it in place and its writes go to the file's page cache, so going out is only the
    mapping dropped (the pages leave the resident set) and coming in only the file mapped again, with
    no copy either way (the disk tier's write and read of every state tensor at every step cost ~10x
    more). A prefetch maps the file in a background thread and populates its page tables for writing
    (``MADV_POPULATE_WRITE``), so the step takes no page faults on it. Resident memory is the honest
    measure: mapped pages count in it (VmRSS includes file pages), unmapped ones do not, and the kernel
    writes them to disk and may evict them, as it does the disk tier's files.
    """

    def __init__(self, directory: str | None = None):
        self.directory, self._remove_directory = private_directory(self, "static", directory)
        self._names = itertools.count()
        self._mapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oomless-map")

    def create(self, data: torch.Tensor) -> MappedFile:
        """A new file holding ``data``'s bytes (a uint8 tensor)."""
        file = MappedFile(os.path.join(self.directory, f"{next(self._names)}.bin"), data.numel())
        self.overwrite(file, data)
        return file

    def overwrite(self, file: MappedFile, data: torch.Tensor) -> None:
        """``data`` (uint8, ``file.num_bytes`` of them) replaces the file's bytes."""
        self._forget_prefetch(file)
        data = data.contiguous()
        # Through a ctypes view, not ``Tensor.numpy()``: that marks the storage not resizable, and
        # offloaded parameters free theirs by resizing. In place, never truncated: a mapping of the
        # file still alive must not lose its pages.
        view = (ctypes.c_uint8 * file.num_bytes).from_address(data.data_ptr())
        with open(file.path, "r+b" if os.path.exists(file.path) else "wb") as stream:
            stream.write(view)

    def prefetch(self, file: MappedFile, for_writing: bool = True) -> None:
        """Map ``file`` in the background with its page tables populated, for writing (the step's
        state) or for reading only (populated for writing, every page would be marked dirty and
        written back to disk although unchanged)."""
        if file.mapping is None:
            file.mapping = self._mapper.submit(self._map_populated, file, for_writing)

    def _map_populated(self, file: MappedFile, for_writing: bool) -> torch.Tensor:
        mapping = torch.from_file(file.path, shared=True, size=file.num_bytes, dtype=torch.uint8)
        libc = glibc()
        if libc is not None:
            # Fails harmlessly (EINVAL) on kernels before 5.14: the first touch then takes the faults.
            libc.madvise(ctypes.c_void_p(mapping.data_ptr()), ctypes.c_size_t(file.num_bytes),
                         ctypes.c_int(_MADV_POPULATE_WRITE if for_writing else _MADV_POPULATE_READ))
        return mapping

    def map(self, file: MappedFile) -> torch.Tensor:
        """The file as a uint8 tensor: writes to it are writes to the file; dropping every reference
        unmaps it."""
        if file.mapping is None:
            return torch.from_file(file.path, shared=True, size=file.num_bytes, dtype=torch.uint8)
        mapping, file.mapping = file.mapping.result(), None
        return mapping

    def read(self, file: MappedFile) -> torch.Tensor:
        """A copy of the file's bytes in the process's own memory (not tied to the file)."""
        self._forget_prefetch(file)
        return torch.from_numpy(np.fromfile(file.path, dtype=np.uint8))

    def _forget_prefetch(self, file: MappedFile) -> None:
        if file.mapping is not None:
            file.mapping.result()                   # a mapping being made is dropped once made
            file.mapping = None

    def remove(self, file: MappedFile) -> None:
        self._forget_prefetch(file)
        _remove_quietly(file.path)

    def close(self) -> None:
        self._mapper.shutdown(wait=True)
        self._remove_directory()


@functools.cache
def mapped_files_rates(num_bytes: int = 8 * 2**20, repeats: int = 3) -> tuple[float, float]:
    """(bytes per second brought in by mapping a file, its pages populated for writing, touched once
    and unmapped; bytes per second written into a file in place): what optimizer state and
    parameters off the device cost on a CPU-only run (`MappedFiles`), measured once per process on a
    file of ``num_bytes``, medians of ``repeats``. On the 2-core CPU machine ~1.1 GB/s and ~11 GB/s:
    a step with 30 MB of Adam state off the device measured 21 ms slower, where the disk tier's
    link (0.4 GB/s out) predicted 78 ms."""
    files = MappedFiles()
    try:
        data = torch.zeros(num_bytes, dtype=torch.uint8)
        file = files.create(data)
        mapped, written = [], []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            files.prefetch(file)
            mapping = files.map(file)
            mapping.add_(1)
            del mapping
            mapped.append(time.perf_counter() - started)
            started = time.perf_counter()
            files.overwrite(file, data)
            written.append(time.perf_counter() - started)
        median = lambda seconds: sorted(seconds[1:])[len(seconds[1:]) // 2]     # noqa: E731  (first: start-up)
        return num_bytes / median(mapped), num_bytes / median(written)
    finally:
        files.close()


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def make_tier(device: torch.device, disk_directory: str | None = None):
    return PinnedHostTier(device) if device.type == "cuda" else DiskTier(disk_directory)
