"""Autograd's check that a saved tensor was not changed in place, for tensors the plan's hooks packed.

Autograd records a saved tensor's version counter and refuses a backward that finds it raised
("one of the variables needed for gradient computation has been modified by an inplace
operation"), but not for a tensor packed by `saved_tensors_hooks`: it holds only what the pack
hook returned. Without this check a model that changes a saved tensor in place after saving it
trains silently on the changed values where the plan keeps or recomputes (the recompute starts from
the changed input), and on the old ones where it swaps, where plain PyTorch raises.

oomless changes saved storages in place itself in one case: the recompute of a block whose forward
changes its input in place and gives the same values when run again (`nn.ReLU(inplace=True)`
alone, `recompute._IDEMPOTENT_IN_PLACE`) raises its input's version again. Those raises are counted
per storage (`OwnChanges`) and allowed; they leave the values as they were.
"""

import weakref

import torch


class OwnChanges:
    """Version raises oomless made itself, per storage (``(device, data_ptr)``), in one forward's
    graph: a handle expects its tensor at its version when packed plus the raises made since."""

    def __init__(self):
        self.by_storage: dict[tuple, int] = {}

    def count(self, key: tuple) -> int:
        return self.by_storage.get(key, 0)

    def add(self, tensor: torch.Tensor, raises: int) -> None:
        key = storage_key(tensor) if raises else None
        if key is not None:
            self.by_storage[key] = self.by_storage.get(key, 0) + raises

    def add_since(self, taken: list[tuple[torch.Tensor, int]]) -> None:
        """Count the raises of ``taken`` (`oomless.profile.tensors.versions`) since it was taken as
        oomless's own."""
        for tensor, version in taken:
            self.add(tensor, tensor._version - version)


class SavedVersion:
    """A packed tensor's version when saved, and how to find the tensor again at unpack: the tensor
    the handle holds, or a weak reference to the one saved where the handle holds bytes moved to
    another tier (where the model no longer references that tensor, it cannot change it either)."""

    __slots__ = ("version", "own_before", "key", "weak")

    def __init__(self, tensor: torch.Tensor, key: tuple, own: OwnChanges, watch: bool):
        self.version = tensor._version
        self.key = key
        self.own_before = own.count(key)
        self.weak = weakref.ref(tensor) if watch else None

    def check(self, tensor: torch.Tensor | None, own: OwnChanges, saved_by: str) -> None:
        """Raise as autograd does if ``tensor`` (the handle's, or None to read the weak reference)
        was changed in place since it was saved, other than by oomless's own recomputes."""
        if tensor is None:
            tensor = self.weak() if self.weak is not None else None
            if tensor is None:
                return
        expected = self.version + own.count(self.key) - self.own_before
        if tensor._version != expected:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected version "
                f"{expected} instead. It was saved by {saved_by} under the oomless plan, whose hooks take over "
                "autograd's check (plain PyTorch raises the same for this model). Change the tensor out of place "
                "(y = y * 2 instead of y.mul_(2); inplace=False), or clone it before changing it")


def storage_key(tensor: torch.Tensor) -> tuple | None:
    """``(device, data pointer)`` of ``tensor``'s storage; None where that names no storage of its
    own (empty, meta or sparse: every such storage has pointer 0) or the tensor has no version
    counter (an inference tensor)."""
    if tensor.is_inference() or tensor.is_sparse or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr()) if storage.nbytes() else None


def saved_version(tensor: torch.Tensor, own: OwnChanges, watch: bool = False) -> SavedVersion | None:
    """`SavedVersion` of ``tensor``, None where it has no storage key (`storage_key`)."""
    key = storage_key(tensor)
    return None if key is None else SavedVersion(tensor, key, own, watch)
