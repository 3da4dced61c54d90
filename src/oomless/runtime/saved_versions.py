"""Autograd's check that a saved tensor was not changed in place, for tensors the plan's hooks packed.

Autograd records a saved tensor's version counter and refuses a backward that finds it raised
("one of the variables needed for gradient computation has been modified by an inplace
operation"), but not for a tensor packed by `saved_tensors_hooks`: it holds only what the pack
hook returned. Without this check a model that changes a saved tensor in place after saving it
trains silently on the changed values where the plan keeps or recomputes (the recompute starts from
the changed input), and on the old ones where it swaps, where plain PyTorch raises.

oomless changes saved storages in place itself in one case: the recompute of a block whose forward
changes its input in place and gives the same values when run again (`nn.ReLU(inplace=True)`
alone). The recompute hides that raise of the input's version (`recompute.RecomputeBlock`), so this
check, and autograd's own for tensors saved outside the plan's hooks, see none.
"""

import weakref

import torch


class SavedVersion:
    """A tensor's version when saved, and, where the handle holds no tensor (its bytes were moved to
    another tier), a weak reference to check it through while the model still references it."""

    __slots__ = ("version", "weak", "changed_to")

    def __init__(self, tensor: torch.Tensor, watch: bool = False):
        self.version = tensor._version
        # A view shares its base's version counter, and autograd may save a view made for the op
        # alone (linear's input of 3 dimensions, as 2): watched through the base the model holds.
        self.weak = weakref.ref(tensor if tensor._base is None else tensor._base) if watch else None
        self.changed_to: int | None = None   # a raised version seen in the forward (`note_change`)

    def note_change(self) -> bool:
        """In the forward: remember a change of the watched tensor in place (reported where backward
        reads it: a saved tensor no backward reads may change, as in plain PyTorch). False once the
        tensor is gone or a change is noted: nothing left to watch."""
        tensor = self.weak() if self.weak is not None and self.changed_to is None else None
        if tensor is None:
            return False
        if tensor._version != self.version:
            self.changed_to = tensor._version
            return False
        return True

    def found(self, tensor: torch.Tensor | None) -> int | None:
        """The version ``tensor`` (the handle's, or None to read the weak reference) was changed to
        since it was saved, None where it was not (or cannot be read)."""
        if self.changed_to is not None:
            return self.changed_to
        if tensor is None and self.weak is not None:
            tensor = self.weak()
        if tensor is None or tensor._version == self.version:
            return None
        return tensor._version


class UnmovedSave:
    """A saved tensor the plan hands back as it is: a parameter, buffer or input of the step (resident
    anyway), or a tensor saved by the model's own forward outside every block; with its version at the
    save, which autograd would have checked (an ``optimizer.step()`` between a forward and its
    backward changes the parameters that forward saved: the GAN loop's classic mistake, which plain
    PyTorch refuses and the plan trained through silently)."""

    __slots__ = ("tensor", "version", "block_index")

    def __init__(self, tensor: torch.Tensor, block_index: int | None):
        self.tensor, self.block_index = tensor, block_index
        self.version = None if tensor.is_inference() else tensor._version

    def unpacked(self, block_name, updated_in_backward) -> torch.Tensor:
        """The tensor, after autograd's check (``block_name``: a block's index -> its name;
        ``updated_in_backward``: whether a tensor is a parameter the plan updates in backward)."""
        if self.version is not None and self.tensor._version != self.version:
            saved_by = ("the model's forward outside every block" if self.block_index is None
                        else block_name(self.block_index))
            raise changed_error(self.tensor._version, self.version, saved_by, unmoved=True,
                                updated_in_backward=updated_in_backward(self.tensor))
        return self.tensor


def changed_error(found: int, expected: int, saved_by: str, recompute_input: bool = False,
                  unmoved: bool = False, updated_in_backward: bool = False) -> RuntimeError:
    """Autograd's error for a saved tensor changed in place, saying which block saved it and what to do."""
    message = ("one of the variables needed for gradient computation has been modified by an inplace operation: "
               f"it is at version {found}; expected version {expected} instead. ")
    if updated_in_backward:
        return RuntimeError(
            message + f"It is a parameter saved by {saved_by}, which the oomless plan's update in backward had "
            "already stepped (its gradient was complete). Either this is a second backward in one optimizer step "
            "(loss.backward(retain_graph=True) twice, or two losses each with its own backward): plan with "
            "accumulation_steps=k for k backwards per step; or a node reads the parameter outside its gradient's "
            "path in a way the plan did not see (a custom autograd.Function that saves a weight it does not take "
            "as an input): pass the weight to that Function as an input, or plan with update_in_backward=False")
    if getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False):
        # Its pack hook, which marks what its mode clones before a change, is outside the plan's.
        message += ("torch.autograd.graph.allow_mutation_on_saved_tensors() clones only the saved tensors its own "
                    "hooks see, and the oomless plan's hooks take every save inside the model's forward. ")
    if recompute_input:
        return RuntimeError(
            message + f"It is an input of {saved_by}, which the oomless plan recomputes from its inputs as the call "
            "left them; the model changed it in place after the call (torch.utils.checkpoint refuses the same), "
            "which the profile the plan was made from did not see (a profile that sees it recomputes the block "
            "from a copy taken at the call; it looks where a later block starts and where the forward ends, so "
            "a change after the last block to a tensor the forward then drops is not seen). Plan again on the "
            "model as it trains (with a block after that change in blocks=), give that block keep or swap "
            "(oomless.plan(..., decisions={...})), or change the tensor out of place")
    message += (f"It was saved by {saved_by} under the oomless plan, whose hooks take over autograd's check "
                "(plain PyTorch raises the same for this model). ")
    if unmoved:
        message += ("It is a parameter, a buffer or an input of the step, or a tensor the model computed outside "
                    "its blocks: an optimizer.step() between a forward and its backward changes the parameters that "
                    "forward saved (step after the backward); otherwise ")
    return RuntimeError(message + ("c" if unmoved else "C") + "hange the tensor out of place (y = y * 2 instead of "
                        "y.mul_(2); inplace=False), or clone it before changing it")
