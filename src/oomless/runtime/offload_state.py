"""Optimizer state off the device: each parameter's state (Adam's two moments, SGD's momentum, ...)
lives in a tier between its updates and is on the device only around its own step.

Where it lives: pinned host memory when the compute device is CUDA (the tier the activations swap
to); on a CPU-only run, a file of its own per state tensor (`oomless.runtime.tiers.MappedFiles`), so
the resident memory really drops by the state's size. There the tensor the step updates *is* the
file, mapped: coming in maps it (prefetched: mapped and its pages populated in the background), going
out drops the mapping; no byte is copied either way (copying every state tensor out and back at every
step, as the activations' disk tier would, made the step 1.6-1.7x the all-on-device one).

How a step runs (`OffloadedState` is driven by `oomless.runtime.update_in_backward`, one module's
parameters at a time, in backward or at the user's ``optimizer.step()``): ``bring_in(param)`` puts the parameter's
state back into the user's ``optimizer.state[param]``, the step runs on the compute device as it
would without offload (the same kernels, so bit for bit the same result: the bytes make an exact
round trip), ``send_out(param)`` copies the updated state out and drops it from the dict, and
``prefetch`` starts reading the next parameters' state in the order the updates ran last step, so it
is back before its step asks for it. Why the step is not moved to the host instead (as ZeRO-Offload
and torchao's CPU offload do): a CPU kernel computes Adam with other instruction sequences than the
CUDA one, and oomless promises the plain step's bits; the device computes, the host only stores.

CUDA synchronisation (the tier's rules, `tiers.PinnedHostTier`): a state's copy out waits for the
compute stream's step (event), and its device memory goes back to the allocator once `is_out` saw the
copy done (polled at every step); the copy in runs on the copy-in stream and the compute stream waits
on its event before the step reads it. No host synchronisation on the hot path.

The state dict stays the user's: ``optimizer.state_dict()`` brings every state in first (a state dict
pre-hook; memory for the whole state while a checkpoint is written) and sends it out after (post-hook;
the returned dict keeps its tensors until the caller drops it); ``load_state_dict`` drops what is out
(pre-hook) and sends the loaded state out (post-hook). Small tensors (below ``min_offload_bytes``, such
as Adam's step counter) stay where they are.
"""

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from oomless.runtime.tiers import MappedFiles, PinnedHostTier


def static_tier(device: torch.device):
    """The tier for static bytes (optimizer state, parameters off the device): pinned host memory
    (CUDA), or a mapped file per tensor (CPU)."""
    if device.type == "cuda":
        return PinnedHostTier(device)
    return MappedFiles()


# State tensors under this many bytes (Adam's step counter, a LayerNorm's moments) stay on the device:
# moving them costs more than they free. The planner counts them there (`plan.static_phases`).
MIN_OFFLOAD_BYTES = 64 * 1024


@dataclass
class _OutEntry:
    ticket: object                  # the tier's ticket; with mapped files, the state tensor's file
    dtype: torch.dtype
    shape: torch.Size
    handed: weakref.ref | None = None   # mapped files: the tensor `bring_in` put in the state dict
    copy: bool = False                  # ... and whether it was a copy (not the mapping)


class OffloadedState:
    """The state of ``parameters`` in ``optimizer.state``, kept in a tier between their steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter], device: torch.device,
                 min_offload_bytes: int = MIN_OFFLOAD_BYTES, units: dict[nn.Parameter, tuple] | None = None, tier=None):
        self.optimizer = optimizer
        self.parameters = list(parameters)
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        # Parameters stepped together (`update_in_backward`: one module's): a prefetch brings a unit in.
        self.units = units or {}
        self.tier = tier if tier is not None else static_tier(device)
        self.mapped = isinstance(self.tier, MappedFiles)
        self.out: dict[nn.Parameter, dict[str, _OutEntry]] = {}
        self.files: dict[nn.Parameter, dict[str, _OutEntry]] = {}     # mapped files: every state tensor's, kept
        self.order: list[nn.Parameter] = []         # the order of the last step's updates
        self._this_step: list[nn.Parameter] = []
        self._position = {}
        self._copies_in_flight: list = []           # CUDA: tickets whose device source is held until copied
        self.offloaded_bytes = 0                    # bytes out now (counted for stats and tests)
        self.handles = [
            optimizer.register_state_dict_pre_hook(lambda _: self.bring_all_in(copy=True)),
            optimizer.register_state_dict_post_hook(self._after_state_dict),
            optimizer.register_load_state_dict_pre_hook(lambda *_: self.drop_all()),
            optimizer.register_load_state_dict_post_hook(lambda _: self.send_all_out()),
        ]
        self.send_all_out()

    # --- one parameter ---

    def bring_in(self, param: nn.Parameter, copy: bool = False) -> None:
        """Before ``param``'s step: its state back in ``optimizer.state[param]``, on the device.
        ``copy``: with mapped files, a copy in the process's own memory rather than the file mapped
        (for state dicts and `remove`: tensors not tied to a file that later steps rewrite in place
        and that `remove` deletes)."""
        entries = self.out.pop(param, None)
        if not entries:
            return
        state = self.optimizer.state[param]
        for key, entry in entries.items():
            if self.mapped:
                raw = self.tier.read(entry.ticket) if copy else self.tier.map(entry.ticket)
            else:
                raw = self.tier.get(entry.ticket)
                self.tier.release(entry.ticket)
            state[key] = raw.view(entry.dtype).view(entry.shape)
            if self.mapped:
                entry.handed, entry.copy = weakref.ref(state[key]), copy
            self.offloaded_bytes -= raw.numel()

    def send_out(self, param: nn.Parameter) -> None:
        """After ``param``'s step: its state copied out and dropped from the dict."""
        self._this_step.append(param)
        self._send_out(param)

    def _send_out(self, param: nn.Parameter, unchanged: bool = False) -> None:
        """``unchanged``: the state was brought in as copies and not changed since (state dicts)."""
        state = self.optimizer.state.get(param)
        if not state:
            return
        entries = self.out.setdefault(param, {})
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.nbytes < self.min_offload_bytes:
                continue
            raw = value.detach().reshape(-1).view(torch.uint8)
            if self.mapped:
                entries[key] = self._to_file(param, key, value, raw, unchanged)
            else:
                entries[key] = _OutEntry(self.tier.put(raw), value.dtype, value.shape)
            self.offloaded_bytes += raw.numel()
            if self.device.type == "cuda":
                self._copies_in_flight.append(entries[key].ticket)
            del state[key]
        self._free_finished_copies()

    def _to_file(self, param: nn.Parameter, key: str, value: torch.Tensor, raw: torch.Tensor,
                 unchanged: bool) -> _OutEntry:
        """Mapped files: the file holds ``value``'s bytes once this returns. Nothing to write where
        ``value`` is the mapping handed out (the step wrote to the file) or an unchanged copy; the
        bytes are written where the optimizer replaced the tensor or the state is new (first step,
        a loaded state dict)."""
        files = self.files.setdefault(param, {})
        entry = files.get(key)
        if entry is None or entry.ticket.num_bytes != raw.numel():
            if entry is not None:
                self.tier.remove(entry.ticket)
            entry = files[key] = _OutEntry(self.tier.create(raw), value.dtype, value.shape)
            return entry
        handed = entry.handed() if entry.handed is not None else None
        if handed is not value or (entry.copy and not unchanged):
            self.tier.overwrite(entry.ticket, raw)
        entry.dtype, entry.shape, entry.handed, entry.copy = value.dtype, value.shape, None, False
        return entry

    def prefetch_after(self, param: nn.Parameter) -> None:
        """Start bringing in the states of the unit updated after ``param`` last step."""
        index = self._position.get(param)
        if index is not None and index + 1 < len(self.order):
            self._prefetch_unit(self.order[index + 1])

    def step_finished(self) -> None:
        """Every update of this step ran: remember their order and start bringing in the states the
        next step updates first."""
        if self._this_step:
            self.order, self._this_step = self._this_step, []
            self._position = {param: index for index, param in enumerate(self.order)}
        if self.order:
            self._prefetch_unit(self.order[0])

    def _prefetch_unit(self, param: nn.Parameter) -> None:
        for member in self.units.get(param, (param,)):
            for entry in self.out.get(member, {}).values():
                self.tier.prefetch(entry.ticket)

    def _free_finished_copies(self) -> None:
        # Hazard: a state's device memory must not go back to the allocator while its copy out still
        # reads it; the tier holds it until `is_out` sees the copy's event complete.
        self._copies_in_flight = [ticket for ticket in self._copies_in_flight if not self.tier.is_out(ticket)]

    # --- all parameters (install, checkpoints) ---

    def send_all_out(self, unchanged: bool = False) -> None:
        for param in self.parameters:
            self._send_out(param, unchanged)

    def bring_all_in(self, copy: bool = False) -> None:
        for param in self.parameters:
            self.bring_in(param, copy)

    def drop_all(self) -> None:
        """``load_state_dict`` replaces the state: what is out is forgotten (mapped files are kept,
        and the loaded state overwrites them)."""
        if not self.mapped:
            for entries in self.out.values():
                for entry in entries.values():
                    self.tier.release(entry.ticket)
        self.out.clear()
        self.offloaded_bytes = 0

    def _after_state_dict(self, optimizer, state_dict):
        # The state dict's per-parameter dicts are the optimizer's own: sending out deletes from those,
        # so the caller gets copies (holding the same tensors).
        state_dict["state"] = {index: dict(entry) for index, entry in state_dict["state"].items()}
        self.send_all_out(unchanged=True)
        return state_dict

    def remove(self) -> None:
        """Everything back in the optimizer's state dict, on the device; hooks and tier gone."""
        self.bring_all_in(copy=True)
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.device.type == "cuda":
            for ticket in self._copies_in_flight:
                self.tier.wait_out(ticket)
            self._copies_in_flight.clear()
        self.tier.close()
