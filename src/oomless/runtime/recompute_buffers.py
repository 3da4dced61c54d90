"""A recompute block's buffers: each recompute starts from them as its call found them, and backward
leaves them as the forward did.

A recompute runs the block's forward again in backward. Its buffers must read as they did at the
call (spectral norm's power iteration reads its vectors and writes them, a module counts its calls
in a buffer, an EMA replaces ``self.ema``): a recompute from the values the forward left normalised
spectral norm's weight by the next estimate (3e-2 off plain PyTorch after three steps, silently).
And what the recompute writes must not stay: BatchNorm's running statistics would move twice a
step. So, per call:
- the buffers its forward changes in place, and every small one (``SMALL_BUFFER_BYTES``), are
  copied at the call's start and copied back in before its recompute (through ``.data``: a version
  raised there would trip autograd's check of a recomputed graph still holding one). Which larger
  buffers change is found by value at the block's first call in each mode of its modules
  (BatchNorm's kernel writes its running statistics without raising their version; compared once
  per mode, not at every call: on CUDA a comparison waits for the device); the other larger ones'
  versions are checked: one changed in a later call, or outside the block after its call (a queue
  another module appends to), refuses the recompute, which would read other values, as autograd
  refuses a changed saved tensor;
- a buffer the forward replaces (``self.ema = ...``) gets its call's object back for the recompute;
- at the end of backward each buffer is put back as the forward left it, value (the small and the
  changing ones) and object: taken at the block's first recompute in that backward (a block called
  twice is recomputed twice).
The copies are not on the plan's ledger: small, or a buffer the model changes anyway.
"""

import torch

SMALL_BUFFER_BYTES = 64 * 1024


def _copied_every_call(buffer: torch.Tensor) -> bool:
    return buffer.nbytes <= SMALL_BUFFER_BYTES


def _write(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` into ``buffer`` through ``.data`` (its version left alone), its shape too where the
    forward resized it (a per-channel observer of quantization-aware training starts empty)."""
    if buffer.shape == values.shape:
        buffer.data.copy_(values)
    else:
        buffer.data = values.clone()


def _named_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(submodule, name, buffer) of every buffer of ``module``, a submodule registered twice once."""
    return [(sub, name, buffer) for sub in module.modules() for name, buffer in sub._buffers.items()
            if buffer is not None]


class BlockBuffers:
    """One recompute block's buffers across its calls (the module docstring)."""

    def __init__(self, module: torch.nn.Module, block_name: str):
        self.module, self.block_name = module, block_name
        self.changing: set[tuple[torch.nn.Module, str]] = set()    # changed in place by its forward
        self.modes_seen: set[tuple[bool, ...]] = set()
        self.restore_queued = False

    def call_started(self) -> "CallBuffers":
        self.restore_queued = False     # a backward that raised before its end never ran its restore
        mode = tuple(sub.training for sub in self.module.modules())
        first = mode not in self.modes_seen
        self.modes_seen.add(mode)
        return CallBuffers(self, first)

    def before_recompute(self, call: "CallBuffers") -> None:
        if not self.restore_queued:
            self.restore_queued = self._queue_restore()
        call.put_back()

    def _queue_restore(self) -> bool:
        """Put the buffers back as the forward left them once this backward ends (not before: the
        recomputed graph may still read them). Values through ``.data``, which leaves versions as
        they are: a create_graph=True backward (a gradient penalty) keeps the recomputed graph,
        whose nodes saved buffers, for its second backward, and a raised version made it raise."""
        entries = _named_buffers(self.module)
        if not entries:
            return False
        values = [(buffer, buffer.detach().clone()) for sub, name, buffer in entries
                  if (sub, name) in self.changing or _copied_every_call(buffer)]

        def restore():
            with torch.no_grad():
                for sub, name, buffer in entries:
                    sub._buffers[name] = buffer
                for buffer, saved in values:
                    _write(buffer, saved)
            self.restore_queued = False
        torch.autograd.Variable._execution_engine.queue_callback(restore)
        return True


class CallBuffers:
    """One call's buffers as it found them, for its recomputes."""

    def __init__(self, block: BlockBuffers, first_in_mode: bool):
        self.block = block
        self.entries = _named_buffers(block.module)
        self.copies: dict[int, torch.Tensor] = {}       # entry index: its values at the call's start
        self.versions: dict[int, int] = {}              # entry index: its version at the start / end
        for index, (sub, name, buffer) in enumerate(self.entries):
            if first_in_mode or (sub, name) in block.changing or _copied_every_call(buffer):
                self.copies[index] = buffer.detach().clone()
            elif not buffer.is_inference():
                self.versions[index] = buffer._version
        self.first_in_mode = first_in_mode
        self.missed: list[str] = []

    def call_ended(self) -> None:
        """Keep what its recompute needs: the copies (at the first call in a mode, of the buffers it
        changed and the small ones); note the versions of the others as the call left them. A buffer
        the call replaced needs neither: `put_back` puts its object (``entries``) back."""
        block, copies = self.block, {}
        for index, (sub, name, buffer) in enumerate(self.entries):
            if sub._buffers.get(name) is not buffer:
                continue
            if index in self.copies:
                if not self.first_in_mode or _copied_every_call(buffer):
                    copies[index] = self.copies[index]
                elif not torch.equal(buffer, self.copies[index]):
                    copies[index] = self.copies[index]
                    block.changing.add((sub, name))     # its recompute changes it again: restored
                elif not buffer.is_inference():
                    self.versions[index] = buffer._version      # checked at the recompute
            elif index in self.versions:
                if buffer._version != self.versions[index]:
                    self.missed.append(name)
                    block.changing.add((sub, name))     # copied from the next call on
                self.versions[index] = buffer._version
        self.copies = copies

    def put_back(self) -> None:
        """Before a recompute: the buffers as the call found them, or refuse where that is lost."""
        name = self.block.block_name
        if self.missed:
            raise RuntimeError(
                f"block {name}'s forward changed its buffer(s) {self.missed} in place in this call, and not in its "
                "first call in this mode, so the oomless plan did not copy them at the call's start; its recompute "
                "would start from the changed values (plain PyTorch's backward does not rerun the forward). From "
                "the next call on they are copied; for this step give the block keep or swap "
                "(oomless.plan(..., decisions={...}))")
        changed = [self.entries[index][1] for index, version in self.versions.items()
                   if self.entries[index][2]._version != version]
        if changed:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"buffer(s) {changed} of block {name}, which the oomless plan recomputes, changed in place after "
                "the block's call (another module updating a buffer it shares), so its recompute would read "
                "the new values. Give that block keep or swap (oomless.plan(..., decisions={...})), or update the "
                "buffer out of place")
        with torch.no_grad():
            # Its objects: one the forward replaced, or one another holder put in for the forward only
            # (torch.func.functional_call's buffers).
            for sub, buffer_name, buffer in self.entries:
                if sub._buffers.get(buffer_name) is not buffer:
                    sub._buffers[buffer_name] = buffer
            for index, start in self.copies.items():
                _write(self.entries[index][2], start)
