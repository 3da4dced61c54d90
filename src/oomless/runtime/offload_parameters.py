"""Parameters off the device: each block's parameters live in a tier (pinned host memory on CUDA; on a
CPU-only run a file of its own per parameter, `tiers.MappedFiles`: brought in by a copy from its
mapping, prefetched and populated for reading in the background, written out by rewriting the file in
place) and are on the device only while the block runs its forward, its backward and its
parameters' updates, so a model whose weights exceed the budget still trains.

Order of a step (block k of n, forward order; ``prefetch`` one block ahead, as activations are):
- model forward pre-hook: start bringing in block 0;
- block k's forward pre-hook: bring in block k (waits for its prefetch), start block k+1's;
- block k's forward hook: drop its device copy (the tier copy is unchanged), and hang a pre-hook on
  the autograd nodes of its outputs: they run before any other node of block k's backward;
- that node pre-hook: bring in block k again, start block k-1's; and whenever backward unpacks a
  saved parameter (or a view of one) whose memory is freed, its block is brought in first
  (`ensure_in`, called by the saved-tensor engine): an in-place op on an output that is a view makes
  autograd rebuild the view's history, and the node the pre-hook was on then never runs;
- each parameter's update in backward (`oomless.runtime.update_in_backward`, required: a gradient for
  every parameter of a model larger than the budget would not fit either): after the step the new
  values are written out, the old copy released, the device copy dropped.
How memory is given back and taken again: the parameter's storage is resized to 0 bytes
(``untyped_storage().resize_(0)``, as FSDP frees unsharded parameters) and resized back and filled
from the tier before its next use. Autograd saves views of a parameter (``weight.t()`` for a matmul)
that share that storage, so they are freed and restored with it: backward reads the values brought
back. The fill writes through ``param.data``, whose version counter is not the parameter's, so
autograd's check of saved tensors' versions still passes (the values are the ones saved). A
recomputed block re-runs its forward inside backward: its hooks then only bring in.

Which parameters: those registered only inside one block (a weight tied across blocks or used
outside them, such as a tied embedding and head, stays on the device), and only when the block's
forward and backward run the usual way (no ``torch.no_grad`` forward is followed by a backward).

Between steps an offloaded parameter holds an empty placeholder (``param.data``, shape ``(0,)``): read
``model.state_dict()`` instead (the storage freed under the real shape, as within a step, would let a
read touch memory that is not there). ``model.state_dict()`` brings every parameter in first and frees them after (state dict hooks),
``load_state_dict`` brings them in, copies the loaded values and writes them out; `oomless.remove`
puts every parameter back on the device as it was. Only contiguous parameters are offloaded.
"""

import torch
from torch import nn

from oomless.profile.tensors import tensors_in
from oomless.runtime.offload_state import static_tier
from oomless.runtime.tiers import MappedFiles


class _Block:
    def __init__(self, index: int, name: str, module: nn.Module, parameters: list[nn.Parameter]):
        self.index, self.name, self.module, self.parameters = index, name, module, parameters
        self.is_in = True


def parameters_owned_by_blocks(model: nn.Module, block_modules: list[tuple[str, nn.Module]]
                               ) -> list[list[nn.Parameter]]:
    """For each block, the trainable parameters registered only by modules inside it."""
    registered_by: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            registered_by.setdefault(id(param), set()).add(id(module))
    owned = []
    for _, block in block_modules:
        inside = {id(module) for module in block.modules()}
        owned.append([param for param in dict.fromkeys(block.parameters())
                      if param.requires_grad and param.is_contiguous() and registered_by[id(param)] <= inside])
    return owned


class OffloadedParameters:
    """Installed with the update in backward; ``updated(param)`` is called after each parameter's step."""

    def __init__(self, model: nn.Module, block_modules: list[tuple[str, nn.Module]], device: torch.device,
                 tier=None, prefetch_blocks: int = 1):
        self.model = model
        self.device = device
        self.prefetch_blocks = prefetch_blocks
        owned = parameters_owned_by_blocks(model, block_modules)
        with_parameters = [(name, module, params) for (name, module), params in zip(block_modules, owned) if params]
        self.blocks = [_Block(index, *block) for index, block in enumerate(with_parameters)]
        # CPU: each parameter a file of its own, read from its mapping and rewritten in place after
        # its update (`tiers.MappedFiles`); CUDA: pinned host memory.
        self.tier = tier if tier is not None else static_tier(device)
        self.mapped = isinstance(self.tier, MappedFiles)
        self.block_of = {param: block for block in self.blocks for param in block.parameters}
        self.shapes = {param: param.shape for param in self.block_of}
        self.names = {param: name for name, param in model.named_parameters(remove_duplicate=False)
                      if param in self.block_of}
        self.tickets: dict[nn.Parameter, object] = {}
        self._copies_in_flight: list = []
        self.in_forward = False
        self.offloaded_bytes = sum(param.nbytes for param in self.block_of)
        self.brought_in_bytes = 0                   # counted for tests: bytes read back from the tier
        self.on_brought_in = None                   # called with the (device, data_ptr) keys brought in
        self.handles = [model.register_forward_pre_hook(self._model_forward_starts),
                        model.register_forward_hook(self._model_forward_ends, always_call=True),
                        model.register_state_dict_pre_hook(lambda *_: self.bring_all_in()),
                        # A function, not a bound method: torch marks the hook with an attribute.
                        model.register_state_dict_post_hook(lambda *args: self._after_state_dict(*args)),
                        model.register_load_state_dict_pre_hook(lambda *_: self.bring_all_in()),
                        model.register_load_state_dict_post_hook(lambda *_: self.write_all_out())]
        for block in self.blocks:
            self.handles.append(block.module.register_forward_pre_hook(self._block_forward_starts(block)))
            self.handles.append(block.module.register_forward_hook(self._block_forward_ends(block)))
        self.write_all_out()

    # --- moving one block ---

    @staticmethod
    def _bytes_of(param: nn.Parameter) -> torch.Tensor:
        """The parameter's bytes through ``.data``: writes there leave its version counter alone."""
        return param.data.reshape(-1).view(torch.uint8)

    def prefetch(self, block: _Block) -> None:
        if not block.is_in:
            for param in block.parameters:
                if self.mapped:
                    self.tier.prefetch(self.tickets[param], for_writing=False)
                else:
                    self.tier.prefetch(self.tickets[param])

    def bring_in(self, block: _Block) -> None:
        if block.is_in:
            return
        with torch.no_grad():
            for param in block.parameters:
                ticket = self.tickets[param]
                raw = self.tier.map(ticket) if self.mapped else self.tier.get(ticket)
                if param.shape == self.shapes[param]:
                    # Freed after its forward: autograd's saved views share this storage; refill it.
                    param.untyped_storage().resize_(raw.numel())
                else:
                    param.data = torch.empty(self.shapes[param], dtype=param.dtype, device=param.device)
                self._bytes_of(param).copy_(raw)
                if not self.mapped:
                    self.tier.drop_copy_in(ticket)  # the tier keeps its copy for the next use
                self.brought_in_bytes += raw.numel()
                del raw                             # (mapped: unmapped here)
        block.is_in = True
        if self.on_brought_in is not None:
            self.on_brought_in({(param.device, param.untyped_storage().data_ptr()) for param in block.parameters})

    def drop(self, block: _Block) -> None:
        """Free ``block``'s parameters' memory (their values are unchanged since they were brought in)."""
        if not block.is_in:
            return
        for param in block.parameters:
            # Hazard (CUDA): kernels already queued may still read the storage; the caching allocator
            # reuses the block only in stream order on this (the compute) stream, after them.
            param.untyped_storage().resize_(0)
        block.is_in = False

    def write_out(self, param: nn.Parameter) -> None:
        """``param`` changed on the device (its update): its new values replace the tier's copy, and
        its memory is freed. The tier gets a copy, so the storage can be freed at once (mapped files:
        the bytes are written into the parameter's file before this returns)."""
        old = self.tickets.get(param)
        if self.mapped:
            if old is None:
                self.tickets[param] = self.tier.create(self._bytes_of(param))
            else:
                self.tier.overwrite(old, self._bytes_of(param))
            self._to_placeholder(param)
            return
        ticket = self.tier.put(self._bytes_of(param).clone())
        self.tickets[param] = ticket
        if self.device.type == "cuda":
            self._copies_in_flight.append(ticket)
        if old is not None:
            self.tier.release(old)
        self._to_placeholder(param)
        # Hazard (CUDA): the copy's device memory goes back to the allocator only once its copy out is done.
        self._copies_in_flight = [pending for pending in self._copies_in_flight if not self.tier.is_out(pending)]

    def _to_placeholder(self, param: nn.Parameter) -> None:
        """Between steps a parameter holds an empty tensor: reading it gives nothing, never memory
        that is not there (a freed storage under the real shape would)."""
        param.untyped_storage().resize_(0)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def step_finished(self) -> None:
        """After the step's updates (the user's ``optimizer.step()``): parameters that got no gradient,
        freed after their forward under their real shape, become placeholders too."""
        for param in self.block_of:
            if param.shape != (0,) or param.untyped_storage().nbytes():
                self._to_placeholder(param)
        for block in self.blocks:
            block.is_in = False

    def updated(self, param: nn.Parameter) -> None:
        block = self.block_of.get(param)
        if block is None:
            return
        self.write_out(param)
        block.is_in = False                     # the rest of its parameters are written out by their updates

    def owner_of(self, tensor: torch.Tensor) -> nn.Parameter | None:
        """The offloaded parameter ``tensor`` is, or is a view of (autograd saves ``weight.t()``);
        None for any other tensor."""
        base = tensor if tensor._base is None else tensor._base
        return base if base in self.block_of else None     # tensors hash by identity

    def ensure_in(self, param: nn.Parameter) -> None:
        """Backward is about to read a saved ``param`` (or a view of it): its block back in if its
        memory was freed after the forward. The hook on the block's output nodes usually did it; an
        in-place op on an output that is a view replaces that node, and then only this comes first.
        A parameter already updated is never read again in the step (autograd's order)."""
        if param.shape == self.shapes[param] and not param.untyped_storage().nbytes():
            self.bring_in(self.block_of[param])

    # --- hooks ---

    def _model_forward_starts(self, model, args) -> None:
        self.in_forward = True
        if self.blocks:
            self.prefetch(self.blocks[0])

    def _model_forward_ends(self, model, args, output) -> None:
        self.in_forward = False
        if not torch.is_grad_enabled():
            self.step_finished()                # no backward follows: nothing to keep for it

    def _block_forward_starts(self, block: _Block):
        def hook(module, args):
            self.bring_in(block)
            if self.in_forward and block.index + 1 < len(self.blocks):
                self.prefetch(self.blocks[block.index + 1])
        return hook

    def _block_forward_ends(self, block: _Block):
        def hook(module, args, output):
            if not self.in_forward:
                return                          # a recompute inside backward: the backward needs them
            nodes = {tensor.grad_fn for tensor in tensors_in(output)
                     if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None}
            for node in nodes:
                node.register_prehook(self._before_block_backward(block))
            self.drop(block)
        return hook

    def _before_block_backward(self, block: _Block):
        def prehook(grad_outputs):
            self.bring_in(block)
            if block.index > 0:
                self.prefetch(self.blocks[block.index - 1])
        return prehook

    # --- all parameters (install, state dicts, remove) ---

    def write_all_out(self) -> None:
        with torch.no_grad():
            for param in self.block_of:
                if param.shape == self.shapes[param] and param.untyped_storage().nbytes():
                    self.write_out(param)       # in (or never out): its current values go out
        self.step_finished()

    def bring_all_in(self) -> None:
        for block in self.blocks:
            self.bring_in(block)

    def _after_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        # The state dict's tensors share the parameters' storages, which are about to be freed: the
        # caller gets copies.
        for param, name in self.names.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = state_dict[key].clone()
        self.step_finished()

    def remove(self) -> None:
        self.bring_all_in()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for ticket in self.tickets.values():
            if self.device.type == "cuda":
                self.tier.wait_out(ticket)
            if not self.mapped:
                self.tier.release(ticket)
        self.tickets.clear()
        self.tier.close()
