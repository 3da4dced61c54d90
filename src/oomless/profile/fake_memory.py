"""Working memory of a step on meta tensors: the storages alive after each op, as a device holds them.

Meta tensors allocate nothing, but their storages are created and freed as real ones are: an op's
outputs are new storages, and a storage goes when the last tensor (or autograd's saved reference)
to it goes. `MetaMemory` counts every storage an op makes, less the static ones (parameters,
buffers, the step's inputs, and each gradient once accumulated), and reads the total after each op,
while its inputs are still alive: the most at one time in each phase of the step is what the real
profiler measures there (`profile.recorder`), with the same split between the ledger
(`MetaMemory.ledger`) and the rest ("other" bytes). The ledger is the runtime's (`runtime/saved.py`):
a storage a block saves goes on it at its save and stays while it is alive, swapped out or not (its
entry leaves at the copy's end only once its storage is freed, `SavedTensorEngine._left`), and a
saved tensor brought back for backward is on it while alive. So in the forward, a saved storage the
forward still holds (an attention layer's q, k and v while it projects its output) is the ledger's,
not working memory; an op's outputs are working memory at the reading after it, as they are in the
real interval that ends at their save (autograd saves an op's inputs before it runs, its outputs
after).

What meta tensors cannot show: kernels' workspaces (cuDNN, cuBLAS, oneDNN) and the allocator's
rounding and caching. The planner carries its larger margin for such profiles (`plan.planner`).
"""

from torch.multiprocessing.reductions import StorageWeakRef

from oomless.profile.profile import BlockProfile


def storage_key(tensor) -> int:
    return tensor.untyped_storage()._cdata


class MetaMemory:
    """Storages alive beyond the static ones (``static``: keys never counted), and the peaks per phase."""

    def __init__(self, static: set[int]):
        self.static = static
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.ledger: set[int] = set()     # keys of the storages on the runtime's ledger

    def made(self, tensors) -> None:
        """Count the storages of ``tensors`` not counted yet (an op's outputs; views add nothing)."""
        for tensor in tensors:
            key = storage_key(tensor)
            if key in self.static:
                continue
            seen = self.live.get(key)
            if seen is None or seen[0].expired():   # a freed storage's key may come back for a new one
                storage = tensor.untyped_storage()
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.ledger.discard(key)            # (the freed one's place on the ledger is not the new one's)

    def on_ledger(self, tensor) -> None:
        """``tensor`` is saved in a block (its storage now on the ledger, as at the runtime's save) or
        brought back for backward: on the ledger while alive."""
        self.made([tensor])
        key = storage_key(tensor)
        if key not in self.static:
            self.ledger.add(key)

    def accumulated(self, gradient) -> None:
        """A parameter's gradient: static from now on (the profile counts every gradient as static)."""
        key = storage_key(gradient)
        self.live.pop(key, None)
        self.ledger.discard(key)
        self.static.add(key)

    def alive(self) -> tuple[int, int]:
        """(bytes alive beyond static, of those on the ledger), dropping the storages freed."""
        freed = [key for key, (weak, _) in self.live.items() if weak.expired()]
        for key in freed:
            del self.live[key]
            self.ledger.discard(key)
        total = sum(num_bytes for _, num_bytes in self.live.values())
        ledger = sum(self.live[key][1] for key in self.ledger)
        return total, ledger


class PhasePeaks:
    """The most bytes beyond static (``peak``) and beyond static and the ledger (``other``) in each
    phase: ("forward" | "backward", block index), ("loss", -1), or None before the first block
    (counted in the first block's forward, as the real recorder does)."""

    def __init__(self):
        self.peaks: dict[tuple | None, tuple[int, int]] = {}

    def read(self, phase: tuple | None, alive: tuple[int, int]) -> None:
        total, ledger = alive
        peak, other = self.peaks.get(phase, (0, 0))
        self.peaks[phase] = (max(peak, total), max(other, total - ledger))

    def write(self, blocks: dict[int, BlockProfile], first: int | None) -> tuple[int | None, int | None]:
        """Set each block's forward/backward other, peak and transient bytes; return the loss's
        (other, peak), None where the step had no loss phase."""
        before = self.peaks.pop(None, None)
        if before is not None and first is not None:
            self.read(("forward", first), (before[0], before[0] - before[1]))
        for (kind, index), (peak, other) in self.peaks.items():
            if kind == "loss":
                continue
            block = blocks[index]
            if kind == "forward":
                block.forward_other_bytes, block.forward_peak_bytes = other, peak
                block.forward_transient_bytes = max(other - block.held_forward_bytes, 0)
            else:
                block.backward_other_bytes, block.backward_peak_bytes = other, peak
                block.backward_transient_bytes = max(other - block.held_backward_bytes, 0)
        loss = self.peaks.get(("loss", -1))
        return (loss[1], loss[0]) if loss is not None else (None, None)
