"""Parameters that backward reads outside their gradient's path: their update in backward waits for
the end of backward.

The update in backward (`update_in_backward`) steps a parameter as soon as its gradient is complete.
Autograd's order protects every read on the gradient's path: a node that reads the parameter to make
its gradient runs before the parameter's AccumulateGrad node. A read outside that path is not: a
block that gates by another module's weight taken ``.detach()``ed (the matmul saves it for its other
input's gradient), a recompute block that reads such a weight again when it recomputes, a weight
passed detached as a block's argument. Backward can reach that read after the update; plain
PyTorch, which updates after backward, reads the old values. Autograd's version check refuses it
(``torch.distributed.optim._apply_optimizer_in_backward`` raises there), but a tensor packed by
saved-tensor hooks gets no version check and a recompute's reads are no saved tensors at all: under
the plan such a model trained on the updated weight, silently (3e-6 to 7e-6 off plain PyTorch after
three steps in a probe with a swapped and a recomputed gate).

So such a parameter's update runs at the end of backward (``queue_callback``), after every read:
- seen by the plan's pack hook: a saved tensor that shares an updated parameter's storage and is
  not on its gradient's path (it does not require grad);
- seen at a recompute block's first call, through a ``TorchFunctionMode`` around its forward: an op's
  argument that is such a tensor, or an updated parameter read under ``torch.no_grad()``; the block's
  own parameters are left out (its recompute and backward come before their update anyway).
Once seen, a parameter stays in the set for the rest of training (a plan of kept blocks runs
without hooks after its first forwards; the set it saw then still applies). Its module's gradients
live until the end of backward, beyond what the plan counts: such reads are rare and the weights
they read small. Not covered: parameters kept off the device (``offload_parameters``), whose storage
moves between uses, and the reads of a compiled recompute block (its forward is not recorded).
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class ParameterReads:
    """The parameters updated in backward (``update``: its `UpdateInBackward`) that backward reads
    outside their gradient's path (``deferred``), and the storages they live in."""

    def __init__(self, update):
        self.update = update
        self.deferred: set[torch.nn.Parameter] = set()
        self._by_storage: dict[tuple, torch.nn.Parameter] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read where the parameters live now (they may have moved since: at each optimizer step)."""
        self._by_storage = {(param.device, param.untyped_storage().data_ptr()): param for param in self.update.names}

    def parameter_read(self, tensor, on_gradient_path: bool) -> torch.nn.Parameter | None:
        """The updated parameter ``tensor`` reads outside its gradient's path, if any
        (``on_gradient_path``: whether a use of it that requires grad is on that path)."""
        if not isinstance(tensor, torch.Tensor) or (tensor.requires_grad and on_gradient_path):
            return None
        if tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested:
            return None
        return self._by_storage.get((tensor.device, tensor.untyped_storage().data_ptr()))

    def saved(self, tensor: torch.Tensor) -> None:
        """The pack hook saw ``tensor`` saved for backward (autograd packs in no-grad mode: a saved
        tensor that requires grad is on its gradient's path)."""
        param = self.parameter_read(tensor, on_gradient_path=True)
        if param is not None:
            self.deferred.add(param)

    def defers(self, params) -> bool:
        return any(param in self.deferred for param in params)

    def recorder(self, own) -> "RecordReads":
        """A mode to enter around a recompute block's forward; ``own``: its parameters."""
        return RecordReads(self, set(own))


class RecordReads(TorchFunctionMode):
    """Adds to ``reads.deferred`` the updated parameters that the ops run under it read outside their
    gradient's path, other than ``own``."""

    def __init__(self, reads: ParameterReads, own: set):
        super().__init__()
        self.reads, self.own = reads, own

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_gradient_path = torch.is_grad_enabled()
        for leaf in tree_leaves((args, kwargs)):
            param = self.reads.parameter_read(leaf, on_gradient_path)
            if param is not None and param not in self.own:
                self.reads.deferred.add(param)
        return func(*args, **kwargs)
