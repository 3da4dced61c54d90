"""Optimizer state off the device: each parameter's state (Adam's two moments, SGD's momentum, ...)
lives in a tier between its updates and is on the device only around its own step.

Where it lives: the tier the activations swap to (`oomless.runtime.tiers.make_tier`): pinned host
memory when the compute device is CUDA, the file store on local disk on a CPU-only run, so the
resident memory really drops by the state's size.

How a step runs (`OffloadedState` is driven by `oomless.runtime.update_in_backward`, one parameter at
a time, in backward or at the user's ``optimizer.step()``): ``bring_in(param)`` puts the parameter's
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

from dataclasses import dataclass

import torch
from torch import nn

from oomless.runtime.tiers import DiskTier, PinnedHostTier


def static_tier(device: torch.device, max_pending_bytes: int):
    """The tier for static bytes: pinned host memory (CUDA), or the disk store (CPU) with at most
    ``max_pending_bytes`` waiting to be written: bytes waiting are resident, and the planner counts
    about one parameter's (or block's) worth in flight, not the activations' 256 MiB backlog."""
    if device.type == "cuda":
        return PinnedHostTier(device)
    return DiskTier(max_pending_bytes=max_pending_bytes)


@dataclass
class _OutEntry:
    ticket: object
    dtype: torch.dtype
    shape: torch.Size


class OffloadedState:
    """The state of ``parameters`` in ``optimizer.state``, kept in a tier between their steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter], device: torch.device,
                 min_offload_bytes: int = 64 * 1024, prefetch_parameters: int = 1, tier=None):
        self.optimizer = optimizer
        self.parameters = list(parameters)
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_parameters = prefetch_parameters
        # Up to one parameter's state (two copies of the largest, as Adam's) waits to be written.
        largest = max((param.nbytes for param in self.parameters), default=0)
        self.tier = tier if tier is not None else static_tier(device, 2 * largest)
        self.out: dict[nn.Parameter, dict[str, _OutEntry]] = {}
        self.order: list[nn.Parameter] = []         # the order of the last step's updates
        self._this_step: list[nn.Parameter] = []
        self._position = {}
        self._copies_in_flight: list = []           # CUDA: tickets whose device source is held until copied
        self.offloaded_bytes = 0                    # bytes out now (counted for stats and tests)
        self.handles = [
            optimizer.register_state_dict_pre_hook(lambda _: self.bring_all_in()),
            optimizer.register_state_dict_post_hook(self._after_state_dict),
            optimizer.register_load_state_dict_pre_hook(lambda *_: self.drop_all()),
            optimizer.register_load_state_dict_post_hook(lambda _: self.send_all_out()),
        ]
        self.send_all_out()

    # --- one parameter ---

    def bring_in(self, param: nn.Parameter) -> None:
        """Before ``param``'s step: its state back in ``optimizer.state[param]``, on the device."""
        entries = self.out.pop(param, None)
        if not entries:
            return
        state = self.optimizer.state[param]
        for key, entry in entries.items():
            raw = self.tier.get(entry.ticket)
            self.tier.release(entry.ticket)
            state[key] = raw.view(entry.dtype).view(entry.shape)
            self.offloaded_bytes -= raw.numel()

    def send_out(self, param: nn.Parameter) -> None:
        """After ``param``'s step: its state copied out and dropped from the dict."""
        self._this_step.append(param)
        self._send_out(param)

    def _send_out(self, param: nn.Parameter) -> None:
        state = self.optimizer.state.get(param)
        if not state:
            return
        entries = self.out.setdefault(param, {})
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.nbytes < self.min_offload_bytes:
                continue
            raw = value.detach().reshape(-1).view(torch.uint8)
            entries[key] = _OutEntry(self.tier.put(raw), value.dtype, value.shape)
            self.offloaded_bytes += raw.numel()
            if self.device.type == "cuda":
                self._copies_in_flight.append(entries[key].ticket)
            del state[key]
        self._free_finished_copies()

    def prefetch_after(self, param: nn.Parameter) -> None:
        """Start bringing in the states of the parameters updated after ``param`` last step."""
        index = self._position.get(param)
        if index is None:
            return
        for ahead in self.order[index + 1:index + 1 + self.prefetch_parameters]:
            for entry in self.out.get(ahead, {}).values():
                self.tier.prefetch(entry.ticket)

    def step_finished(self) -> None:
        """Every update of this step ran: remember their order and start bringing in the states the
        next step updates first."""
        if self._this_step:
            self.order, self._this_step = self._this_step, []
            self._position = {param: index for index, param in enumerate(self.order)}
        for param in self.order[:self.prefetch_parameters]:
            for entry in self.out.get(param, {}).values():
                self.tier.prefetch(entry.ticket)

    def _free_finished_copies(self) -> None:
        # Hazard: a state's device memory must not go back to the allocator while its copy out still
        # reads it; the tier holds it until `is_out` sees the copy's event complete.
        self._copies_in_flight = [ticket for ticket in self._copies_in_flight if not self.tier.is_out(ticket)]

    # --- all parameters (install, checkpoints) ---

    def send_all_out(self) -> None:
        for param in self.parameters:
            self._send_out(param)

    def bring_all_in(self) -> None:
        for param in self.parameters:
            self.bring_in(param)

    def drop_all(self) -> None:
        """``load_state_dict`` replaces the state: what is out is forgotten."""
        for entries in self.out.values():
            for entry in entries.values():
                self.tier.release(entry.ticket)
        self.out.clear()
        self.offloaded_bytes = 0

    def _after_state_dict(self, optimizer, state_dict):
        # The state dict's per-parameter dicts are the optimizer's own: sending out deletes from those,
        # so the caller gets copies (holding the same tensors).
        state_dict["state"] = {index: dict(entry) for index, entry in state_dict["state"].items()}
        self.send_all_out()
        return state_dict

    def remove(self) -> None:
        """Everything back in the optimizer's state dict, on the device; hooks and tier gone."""
        self.bring_all_in()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.device.type == "cuda":
            for ticket in self._copies_in_flight:
                self.tier.wait_out(ticket)
            self._copies_in_flight.clear()
        self.tier.close()
