"""Process memory on CPU: resident set size and its peak, read from /proc (Linux).

On CPU the truth for the memory budget is the process's resident memory (DESIGN.md section 3);
`reset_peak_rss` lets a step be measured on its own, as `torch.cuda.reset_peak_memory_stats` does.
"""

import ctypes
import ctypes.util
import functools
import os
import resource
import sys


def status_field(field: str) -> str | None:
    """The first word of ``field``'s line in /proc/self/status (Linux); None where absent or unreadable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return line.split()[1]
    except OSError:
        return None
    return None


def _status_bytes(field: str) -> int | None:
    value = status_field(field)
    return None if value is None else int(value) * 1024


def current_rss_bytes() -> int:
    value = _status_bytes("VmRSS")
    return value if value is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    value = _status_bytes("VmHWM")
    if value is not None:
        return value
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


@functools.cache
def glibc():
    """The C library on Linux (glibc's malloc tunables), loaded once: ``find_library`` runs ldconfig.
    None elsewhere or where it cannot be loaded."""
    library = ctypes.util.find_library("c")
    if library is None or not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(library)
    except OSError:
        return None


@functools.cache
def return_freed_memory_to_the_system() -> bool:
    """Make glibc serve allocations of 64 KiB and more by mmap, so freeing them really lowers
    resident memory.

    glibc raises its mmap threshold to the size of the last freed block (up to 32 MiB): after that,
    freed activations stay in the heap and the resident set never drops, whatever swapping does.
    Fixing the threshold turns that off. It is 64 KiB, not glibc's first 128 KiB: a transformer of
    width 128 at 2 x 128 tokens saves 128 KiB activations, and in the heap the small objects the
    saved-tensor hooks allocate between them pinned freed ones (a 16-block model's step rose 150-170
    MiB with the hooks against 127 MiB without, at a 256 KiB threshold; 123 against 121 at 64 KiB,
    the step time unchanged within the noise, measured interleaved). No effect off glibc.
    """
    libc = glibc()
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3
        return libc is not None and bool(libc.mallopt(m_mmap_threshold, 64 * 1024)) and \
            bool(libc.mallopt(m_trim_threshold, 1024 * 1024))
    except AttributeError:
        return False


def memory_rule_on() -> bool:
    """Whether `return_freed_memory_to_the_system` has run in this process (it runs once)."""
    return return_freed_memory_to_the_system.cache_info().currsize > 0


# PyTorch's own switch (c10/core/impl/alloc_cpu.cpp): CPU tensors of 2 MiB or more are advised onto
# transparent huge pages (``madvise(MADV_HUGEPAGE)``). libtorch reads it once, at its first allocation.
HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"
HUGE_PAGE_BYTES = 2 * 2**20


def turn_on_huge_pages_unless_set() -> bool:
    """Turn on PyTorch's huge pages for large CPU tensors, unless the environment already says
    either way. libtorch reads the switch at its first CPU allocation; this acts only where torch is
    not imported yet (``import oomless`` calls it first), and the variable reaches child processes.

    Under `return_freed_memory_to_the_system` every tensor of 64 KiB or more is a fresh mapping whose
    pages the kernel faults in and zeroes on first touch, 4 KiB at a time: on a 2-core Xeon a 3D
    U-Net's step (64^3, batch 2) took 1.53-1.59 s against 1.11-1.16 s with glibc's reusing heap, and
    1.23-1.36 s with huge pages (one fault per 2 MiB), its peak the same (339 MiB; 421-475 MiB in the
    heap). True where it set the variable."""
    if HUGE_PAGES_VARIABLE in os.environ or "torch" in sys.modules or not sys.platform.startswith("linux"):
        return False
    os.environ[HUGE_PAGES_VARIABLE] = "1"
    return True


@functools.cache
def large_tensors_on_huge_pages() -> bool | None:
    """Whether this process's large CPU tensors may be on huge pages: the kernel says a fresh one's
    mapping is eligible (``THPeligible`` in /proc/self/smaps: the kernel's setting is ``always``, or
    ``madvise`` and PyTorch's switch advised it). None where that cannot be read (off Linux)."""
    import torch    # here, not at the top: `import oomless` imports this module before torch starts
    probe = torch.empty(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)     # over PyTorch's 2 MiB threshold
    address = probe.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):
                    low, high = (int(part, 16) for part in first.split("-"))
                    inside = low <= address < high
                elif inside and first == "THPeligible:":
                    return line.split()[1] == "1"
    except (OSError, ValueError, IndexError):
        return None
    return None


def huge_pages_note() -> str | None:
    """What a CPU plan says where its large tensors are not on huge pages, and how to change that."""
    if large_tensors_on_huge_pages() is not False:
        return None
    if os.environ.get(HUGE_PAGES_VARIABLE, "1") == "0":
        return None      # turned off on purpose
    return (f"large CPU tensors are not on huge pages: under oomless's memory rule each is faulted in 4 KiB at a "
            f"time (a 3D U-Net's step ~20 % slower); set {HUGE_PAGES_VARIABLE}=1 in the environment, or import "
            "oomless before torch, and check that /sys/kernel/mm/transparent_hugepage/enabled is not [never]")


def give_back_free_heap() -> bool:
    """Return the free pages inside glibc's heaps to the system (``malloc_trim``): planning frees its
    profiling steps' objects in the middle of the heap, which the 1 MiB trim threshold (top only)
    leaves resident (~7 MiB after planning a 128-block transformer). False off glibc."""
    libc = glibc()
    try:
        return libc is not None and bool(libc.malloc_trim(0))
    except AttributeError:
        return False


class MemoryProbe:
    """Peak memory between marks: the caching allocator's counters on CUDA, the kernel's peak
    resident mark on CPU (which `mark` resets: a process-wide side effect while profiling).

    `peak_and_mark` is the cheap form the profiler calls at every change of the ledger: on CPU one
    read of /proc/self/status through a descriptor kept open and one write to clear_refs (tens of
    microseconds, against hundreds for opening the files each time)."""

    def __init__(self, device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.start_bytes = 0
        self.highest_bytes = 0  # the highest absolute reading seen, across marks
        self._status = self._clear_refs = None
        if not self.is_cuda:
            try:
                self._status = os.open("/proc/self/status", os.O_RDONLY)
                self._clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
            except OSError:
                self.close()

    def close(self) -> None:
        for descriptor in (self._status, self._clear_refs):
            if descriptor is not None:
                os.close(descriptor)
        self._status = self._clear_refs = None

    def __del__(self):
        self.close()

    def current(self) -> int:
        if self.is_cuda:
            import torch
            return torch.cuda.memory_allocated(self.device)
        return current_rss_bytes()

    def _peak(self) -> int:
        if self.is_cuda:
            import torch
            return torch.cuda.max_memory_allocated(self.device)
        if self._status is not None:
            status = os.pread(self._status, 4096, 0)
            at = status.find(b"VmHWM:")
            if at >= 0:
                return int(status[at + 6:status.index(b"kB", at)]) * 1024
        return peak_rss_bytes()

    def _reset(self) -> None:
        if self.is_cuda:
            import torch
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._clear_refs is not None:
            try:
                os.write(self._clear_refs, b"5")
            except OSError:
                reset_peak_rss()
        else:
            reset_peak_rss()

    def mark(self) -> None:
        self._reset()
        self.start_bytes = self.current()

    def restart_peak(self) -> None:
        """Forget the highest point so far, keeping the mark's reading: `peak_since_mark` then
        reads the highest point from now on, above the same mark."""
        self._reset()

    def peak_since_mark(self) -> int:
        """Bytes above the reading at the last mark, at the highest point since."""
        peak = self._peak()
        self.highest_bytes = max(self.highest_bytes, peak)
        return max(peak - self.start_bytes, 0)

    def peak_and_mark(self) -> int:
        """The highest absolute reading since the last mark; then marks again (without reading the
        current value: after a reset the peak mark is the current value)."""
        peak = self._peak()
        self.highest_bytes = max(self.highest_bytes, peak)
        self._reset()
        return peak
