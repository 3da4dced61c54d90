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
- seen at a recompute block's first call: a ``TorchFunctionMode`` around its forward records every
  updated parameter an op reads (an argument sharing its storage, with or without grad), and the
  block's graph, walked back from its outputs to its inputs, gives those whose gradient it makes
  (their AccumulateGrad nodes): the others are read outside it (another module's weight, a weight
  the block registers too but reads ``.detach()``ed, a mask computed from a weight), and the
  recompute would read them after their update.
Once seen, a parameter stays in the set for the rest of training (a plan of kept blocks runs
without hooks after its first forwards; the set it saw then still applies). Its module's gradients
live until the end of backward, beyond what the plan counts: such reads are rare and the weights
they read small. Not covered: parameters kept off the device (``offload_parameters``), whose storage
moves between uses (an empty one has no address to know it by), and the reads of a compiled recompute
block (its forward is not recorded; dynamo passes the weights it reads to the compiled graph as inputs).
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from oomless.profile.tensors import has_storage


class ParameterReads:
    """The parameters updated in backward (``update``: its `UpdateInBackward`) that backward reads
    outside their gradient's path (``deferred``), and the storages they live in."""

    def __init__(self, update):
        self.update = update
        self.deferred: set[torch.nn.Parameter] = set()
        # A parameter by its storage's address, made at the first read after each optimizer step
        # (they may have moved since); the device is compared at the lookup.
        self._by_address: dict[int, torch.nn.Parameter] | None = None

    def refresh(self) -> None:
        """Forget where the parameters live: read again at the next lookup (at each optimizer step)."""
        self._by_address = None

    def _parameter_at(self, tensor: torch.Tensor) -> torch.nn.Parameter | None:
        if self._by_address is None:
            self._by_address = {param.untyped_storage().data_ptr(): param for param in self.update.names
                                if param.untyped_storage().nbytes()}
        param = self._by_address.get(tensor.untyped_storage().data_ptr())
        return param if param is not None and param.device == tensor.device else None

    def parameter_read(self, tensor, on_gradient_path: bool) -> torch.nn.Parameter | None:
        """The updated parameter ``tensor`` reads outside its gradient's path, if any
        (``on_gradient_path``: whether a use of it that requires grad is on that path)."""
        if not isinstance(tensor, torch.Tensor) or (tensor.requires_grad and on_gradient_path):
            return None
        if tensor.device.type == "meta" or not has_storage(tensor):
            return None
        # Empty storages share address 0 (CUDA's batch norm saves an empty reserve in every call).
        return self._parameter_at(tensor) if tensor.untyped_storage().nbytes() else None

    def saved(self, tensor: torch.Tensor) -> None:
        """The pack hook saw ``tensor`` saved for backward (autograd packs in no-grad mode: a saved
        tensor that requires grad is on its gradient's path)."""
        param = self.parameter_read(tensor, on_gradient_path=True)
        if param is not None:
            self.deferred.add(param)

    def defers(self, params) -> bool:
        return any(param in self.deferred for param in params)

    def recorder(self, inputs) -> "RecordReads":
        """A mode to enter around a recompute block's forward on ``inputs``; `defer_unreached` after it."""
        return RecordReads(self, inputs)

    def defer_unreached(self, recorder: "RecordReads", outputs) -> None:
        """After a recompute block's call: defer the parameters its ops read (``recorder.found``)
        whose gradients its graph, from ``outputs`` back to its inputs, does not make."""
        if recorder.found:
            self.deferred.update(set(recorder.found) - gradients_made(outputs, recorder.inputs))


def gradients_made(outputs, inputs) -> set:
    """The leaves whose AccumulateGrad nodes the graph reaches from ``outputs``' nodes without going
    past ``inputs``' nodes."""
    boundary = {tensor.grad_fn for tensor in inputs if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None}
    stack = [tensor.grad_fn for tensor in outputs if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None]
    seen, leaves = set(), set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in boundary:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)      # an AccumulateGrad node's leaf
        if variable is not None:
            leaves.add(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class RecordReads(TorchFunctionMode):
    """Collects (``found``) the updated parameters the ops run under it read, with or without grad."""

    def __init__(self, reads: ParameterReads, inputs):
        super().__init__()
        self.reads, self.inputs = reads, inputs
        self.found: dict[torch.nn.Parameter, None] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            param = self.reads.parameter_read(leaf, on_gradient_path=False)
            if param is not None:
                self.found[param] = None
        return func(*args, **kwargs)
