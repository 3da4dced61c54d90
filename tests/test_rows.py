"""Whole-volume tensors kept off the device, read and written by rows (runtime/rows.py)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oomless.runtime.rows import FileRows, HostRows, row_store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", ["file", "host"])
def test_rows_written_in_slabs_read_back_and_added_to(kind, dtype):
    """Slabs of unequal thickness, several planes (samples x channels): what is read is what was
    written, at any rows; a store starts as zeros; add sums into the rows it is given only."""
    torch.manual_seed(0)
    value = torch.randn(2, 3, 11, 5, 4).to(dtype)
    store = FileRows(value.shape, dtype) if kind == "file" else HostRows(value.shape, dtype, torch.device("cpu"))
    assert torch.equal(store.read(0, 11), torch.zeros_like(value))
    for low, high in [(0, 4), (4, 5), (5, 11)]:
        store.write(low, value[:, :, low:high])
    assert torch.equal(store.read(0, 11), value)
    assert torch.equal(store.read(3, 8), value[:, :, 3:8]) and store.read(3, 8).is_contiguous()
    extra = torch.randn(2, 3, 3, 5, 4).to(dtype)
    store.add(6, extra)
    expected = value.clone()
    expected[:, :, 6:9] += extra
    assert torch.equal(store.read(0, 11), expected)
    # A slab narrowed from a larger one (not contiguous) adds as its values do.
    wider = torch.randn(2, 3, 6, 5, 4).to(dtype)
    store.add(1, wider[:, :, 2:4])
    expected[:, :, 1:3] += wider[:, :, 2:4]
    assert torch.equal(store.read(0, 11), expected)
    # Read into a buffer larger than the rows: its start, as a contiguous tensor of their shape.
    buffer = torch.full((2 * 3 * 6 * 5 * 4,), 7.0).to(dtype)
    read = store.read(2, 7, out=buffer)
    assert torch.equal(read, expected[:, :, 2:7]) and read.is_contiguous()
    assert read.data_ptr() == buffer.data_ptr() and torch.equal(buffer[read.numel():], torch.full_like(buffer[read.numel():], 7.0))
    with pytest.raises(ValueError, match="cannot hold"):
        store.read(0, 11, out=buffer)
    store.close()


def test_a_contiguous_slab_with_any_stride_along_a_dim_of_size_one_is_written():
    """As a 1x1 convolution's output can be: contiguous, with stride 192 along its last dim of size 1."""
    value = torch.as_strided(torch.randn(192 * 6), (1, 192, 6, 1, 1), (1152, 6, 1, 1, 192))
    assert value.is_contiguous() and value.stride(-1) == 192
    store = FileRows(value.shape, value.dtype)
    store.write(0, value)
    assert torch.equal(store.read(0, 6), value)


def test_on_cpu_the_rows_are_in_a_file_not_in_the_process():
    """A CPU store is an unlinked temporary file (the page cache, not the process's memory)."""
    store = row_store((1, 2, 64, 32, 32), torch.float32, torch.device("cpu"))
    assert isinstance(store, FileRows)
    store.write(0, torch.ones(1, 2, 64, 32, 32))
    assert store.read(10, 12).sum().item() == 2 * 2 * 32 * 32
    store.close()
    with pytest.raises(ValueError):        # closed: its file is gone
        store.read(0, 1)


def test_a_store_that_cannot_be_written_says_where_and_what_would_work(monkeypatch):
    store = FileRows((1, 1, 4, 2, 2), torch.float32)

    def full(*arguments):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.pwrite", full)
    with pytest.raises(OSError, match="TMPDIR") as raised:
        store.write(0, torch.ones(1, 1, 4, 2, 2))
    assert raised.value.errno == 28 and "No space left" in str(raised.value)
    with pytest.raises(OSError, match="TMPDIR"):        # adding writes too
        store.add(0, torch.ones(1, 1, 2, 2, 2))


class _HostMemoryOps(TorchDispatchMode):
    """The ops run (``names``) and each that reads or writes the host memory whose storage pointer
    is ``host``, views aside (``ops``): (op, whether its tensors there are contiguous, whether it is
    queued non_blocking)."""

    def __init__(self):
        super().__init__()
        self.host, self.ops, self.names = None, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.names.append(func.overloadpacket.__name__)
        if self.host is not None and not func.is_view:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, result))
                       if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.host]
            if tensors:
                non_blocking = kwargs.get("non_blocking", args[2] if func is torch.ops.aten.copy_.default
                                          and len(args) > 2 else False)
                self.ops.append((func.overloadpacket.__name__, all(t.is_contiguous() for t in tensors), non_blocking))
        return result


def test_beside_a_gpu_rows_move_as_one_contiguous_block_per_copy_queued_on_the_stream():
    """What a GPU's store does to its host memory (here with CPU tensors): only copies of one
    contiguous block, queued (non_blocking), the adding done where the rows compute. Rows [low,
    high) of an (N, C, D, ...) layout are N x C strided blocks, which copy_ between devices moves
    through a pageable temporary, a gather on the CPU and a synchronous copy; with an add on the CPU
    and the volume zero-filled there, that made a U-Net step split into slabs 40x slower on an H200."""
    value = torch.randn(2, 3, 11, 5, 4)
    with _HostMemoryOps() as ops:
        store = HostRows(value.shape, value.dtype, torch.device("cpu"))
        # Not a volume of zeros written by the CPU: the rows never written read as zeros (tested above).
        assert ops.names == ["empty"], ops.names
        ops.host = store.host.untyped_storage().data_ptr()
        store.write(2, value[:, :, 2:7])
        store.read(1, 9)
        store.read(3, 8, out=torch.empty(value.numel()))
        extra = torch.randn(2, 3, 5, 5, 4)
        store.add(4, extra)       # rows 7 and 8 never written: added to zeros
    moved = [op for op, *_ in ops.ops]
    assert moved == ["copy_", "_to_copy", "_to_copy", "_to_copy", "copy_"], moved
    assert all(contiguous and non_blocking for _, contiguous, non_blocking in ops.ops), ops.ops
    expected = torch.zeros_like(value)
    expected[:, :, 2:7] = value[:, :, 2:7]
    expected[:, :, 4:9] += extra
    assert torch.equal(store.read(0, 11), expected)


def test_off_the_cpu_a_slabs_weight_gradient_is_one_product_and_one_sum_not_a_dot_per_plane():
    """Batch norm's weight gradient in a slab sums grad x normalised input per sample and channel. On
    the CPU one BLAS dot per plane is fastest; beside a GPU each dot is a kernel launch (2560 to 6656
    a step for a 3D U-Net split in 16 slabs), so there it is one product and one sum (meta tensors
    stand in for the GPU's here)."""
    from oomless.runtime.slabs import _products_summed

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for device, dots in (("cpu", 2 * 16), ("meta", 0)):
        a, b = torch.randn(2, 16, 4, 8, 8, device=device), torch.randn(2, 16, 4, 8, 8, device=device)
        with Ops() as ops:
            summed = _products_summed(a, b)
        assert summed.shape == (2, 16, 1, 1, 1)
        assert ops.names.count("dot") == dots
        assert device == "cpu" or len(ops.names) < 8, ops.names
        if device == "cpu":
            torch.testing.assert_close(summed, (a * b).sum((2, 3, 4), keepdim=True))
