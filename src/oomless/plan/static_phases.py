"""Static bytes phase by phase: which parameters, gradients and optimizer state a placement that moves
them during the step (`plan.static`) holds on the device while each block's forward or backward runs.

The placement's device bytes (`static._Candidates.device_bytes`: the largest module's gradients,
three modules' state, three blocks' parameters) are the most it holds at once, and the plan counts
them as static memory. They are not there at once in every phase: the update in backward steps each
module where its gradients are accumulated, the state it brings in is that module's, and the
parameters brought in are those of the block running and the one prefetched. Counted in every
phase, they were added to the working memory of phases that never hold them: a Hugging Face GPT-2
(6 layers of 3 MiB, a tied 2 MiB embedding whose 4 MiB of Adam state comes in only at the very end
of backward; batch 8 x 256 tokens) was named 98 MiB at its smallest, predicted 98 and measured 78.5:
of the 25.9 MiB of static bytes counted, about 10 are on the device where a layer's backward peaks.

Here each phase gets what the runtime holds then, by its own rules, from what the profiling step
measured: the phase in which each gradient was accumulated (`BlockProfile.backward_gradient_names`),
hence where each module's update runs and in which order, and a backward's working memory in the
stretches between those accumulations (`BlockProfile.backward_other_by_stretch`): a layer's
attention backward, its largest, runs after its MLP is stepped and written out. Each stretch holds
its own static bytes, and each update those of the stretches on either side (its module's gradients,
its state and the next one's). The difference from the counted static bytes is given to the
simulator as bytes absent in that phase (`BlockProfile.forward_static_absent_bytes`,
`plan.simulate.phases`); the static bytes the plan prints and counts stay the most at once.

What the runtime holds, per phase (runtime/update_in_backward.py, offload_state.py, offload_parameters.py):
- gradients, with the update in backward: each module's from the accumulation of its first gradient
  to its update, which frees them; a phase holds the modules still waiting for a gradient and, of
  those it steps, one at a time;
- optimizer state off the device: the state of the next module to be stepped, in the order of the
  updates (prefetched after each update, once the updated one's is out; the first one's after the
  previous step), which is the one stepped while its update runs; on CUDA also the previous one's,
  whose copy out may still run; states under `MIN_OFFLOAD_BYTES` stay on the device;
- parameters off the device: the running block's (brought in, on CPU copied from their mapped file
  while it is mapped) and the next block's in the direction of the pass (prefetched); in backward on
  CUDA also the block just updated, whose copies out may still run. Parameters no single block owns
  (a tied embedding and head) stay on the device.
"""

import dataclasses

from torch import nn

from oomless.profile.profile import Profile
from oomless.runtime.offload_parameters import parameters_owned_by_blocks
from oomless.runtime.offload_state import MIN_OFFLOAD_BYTES
from oomless.runtime.update_in_backward import update_units


class _Walk:
    """The update in backward as the profiling step's accumulations order it: ``events`` (one per
    accumulated gradient: the phase's position, the module completed there or None), position 0 the
    loss, then the blocks' backward in reverse order."""

    def __init__(self, model: nn.Module, profile: Profile):
        count = len(profile.blocks)
        self.count = count
        self.sequence = [profile.loss_gradient_names] + [profile.blocks[i].backward_gradient_names
                                                         for i in reversed(range(count))]
        named = dict(model.named_parameters())
        self.unit_of = update_units(model, [parameter for parameter in named.values() if parameter.requires_grad])
        self.events: list[tuple[int, tuple | None]] = []
        self.started: dict[tuple, int] = {}         # unit: the event of its first gradient
        self.completed: dict[tuple, int] = {}       # unit: the event of its last (its update)
        seen: dict[tuple, set[int]] = {}
        self.first_event = []                       # per position: its first event
        for position, names in enumerate(self.sequence):
            self.first_event.append(len(self.events))
            for name in names:
                parameter = named.get(name)
                unit = self.unit_of.get(parameter) if parameter is not None else None
                done = None
                if unit is not None:
                    self.started.setdefault(unit, len(self.events))
                    seen.setdefault(unit, set()).add(id(parameter))
                    if len(seen[unit]) == len(unit) and unit not in self.completed:
                        self.completed[unit] = len(self.events)
                        done = unit
                self.events.append((position, done))
        self.first_event.append(len(self.events))
        self.updates = [unit for _, unit in self.events if unit is not None]   # in order

    def position(self, block_index: int) -> int:
        return 1 + (self.count - 1 - block_index)

    def waiting(self, done_events: int) -> list[tuple]:
        """Units with a gradient accumulated and not stepped, once ``done_events`` events ran."""
        return [unit for unit, start in self.started.items()
                if start < done_events and self.completed.get(unit, len(self.events)) >= done_events]

    def stepped_before(self, done_events: int) -> int:
        """How many updates ran in the first ``done_events`` events."""
        return sum(1 for _, unit in self.events[:done_events] if unit is not None)


def _scaled(total_bytes: int, elements: int, of: int) -> int:
    return -(-total_bytes * elements // of) if of else 0    # the profile's bytes: a target's dtype applies


def phase_static_absent(model: nn.Module, profile: Profile, device_profile: Profile, update_in_backward: bool,
                        offload_state: bool, offload_parameters: bool
                        ) -> tuple[list[int], int, list[int], list[int]] | None:
    """(per block forward, the loss, per block backward, per block a recompute of its forward at the
    start of its backward): static bytes the device profile counts that
    are not on the device in that phase under the placement (module docstring), beyond the gradients
    `plan.simulate.gradients_absent_bytes` already takes out. ``profile``: as measured (every static
    byte counted); ``device_profile``: as the device sees it (static bytes the most at once). None
    where the profile did not measure where gradients accumulate (profiles on meta tensors, made by
    hand), or the model does not match it."""
    from oomless.plan.simulate import backward_other_bytes, gradients_absent_bytes

    count = len(profile.blocks)
    if count == 0 or not any([profile.loss_gradient_names] + [block.backward_gradient_names for block in profile.blocks]):
        return None
    modules = dict(model.named_modules())
    if any(block.name not in modules for block in profile.blocks):
        return None
    walk = _Walk(model, profile)
    cuda = profile.device.startswith("cuda")
    parameters = list(dict.fromkeys(model.parameters()))
    total_elements = sum(parameter.numel() for parameter in parameters)
    trainable_elements = sum(parameter.numel() for parameter in parameters if parameter.requires_grad)
    if not total_elements or not trainable_elements:
        return None
    moving_gradients = update_in_backward and device_profile.gradients_from_backward

    def elements(params) -> int:
        return sum(parameter.numel() for parameter in params)

    def gradient_bytes(unit) -> int:
        return _scaled(profile.gradient_bytes, elements(unit), trainable_elements)

    def state_bytes(unit) -> int:
        moved = [parameter for parameter in unit if parameter.nbytes >= MIN_OFFLOAD_BYTES]
        return _scaled(profile.optimizer_state_bytes, elements(moved), trainable_elements)

    small = [parameter for parameter in parameters if parameter.requires_grad and parameter.nbytes < MIN_OFFLOAD_BYTES]
    state_resident = _scaled(profile.optimizer_state_bytes, elements(small), trainable_elements)
    steps = [state_bytes(unit) for unit in walk.updates]
    owned_lists = parameters_owned_by_blocks(model, [(block.name, modules[block.name]) for block in profile.blocks])
    owned = [_scaled(profile.parameter_bytes, elements(params), total_elements) for params in owned_lists]
    owner = {id(parameter): i for i, params in enumerate(owned_lists) for parameter in params}
    parameters_resident = profile.parameter_bytes - sum(owned)
    later = [next((owned[j] for j in range(i + 1, count) if owned[j]), 0) for i in range(count)]
    earlier = [next((owned[j] for j in range(i - 1, -1, -1) if owned[j]), 0) for i in range(count)]

    def in_stretch(done_events: int, block: int | None) -> int:
        """What the moved parts hold between updates, ``done_events`` into backward, in ``block``'s
        backward (None: the loss)."""
        held = 0
        # Without the update in backward, every update runs in the user's optimizer.step(), after it.
        stepped = walk.stepped_before(done_events) if update_in_backward else 0
        if moving_gradients:
            held += sum(gradient_bytes(unit) for unit in walk.waiting(done_events))
        if offload_state:
            # The next update's state, prefetched; on CUDA the last one's, its copy out maybe running.
            held += state_resident + (steps[stepped] if stepped < len(steps) else 0)
            held += steps[stepped - 1] if cuda and stepped > 0 else 0
        if offload_parameters:
            held += parameters_resident
            if block is not None:
                # Its parameters not yet stepped and written out: while they are copied in from their
                # mapping (CPU) or arriving (CUDA), twice; then with the earlier block's prefetched.
                written = [parameter for unit in walk.updates[:stepped] for parameter in unit
                           if owner.get(id(parameter)) == block]
                remaining = max(owned[block] - _scaled(profile.parameter_bytes, elements(written), total_elements), 0)
                held += remaining + max(remaining, earlier[block]) + (later[block] if cuda else 0)
        return held

    def at_update(event: int, block: int | None) -> int:
        """What they hold while the update at ``event`` runs: as before it (its state is the one
        prefetched; the next one's is asked for once it is out), with its module's gradients where
        this event made them all."""
        held = in_stretch(event, block)
        unit = walk.events[event][1]
        if moving_gradients and walk.started[unit] == event:
            held += gradient_bytes(unit)
        return held

    def at_once(moved_gradients: bool) -> int:
        total = 0
        if moved_gradients:
            total += device_profile.gradient_bytes
        if offload_state:
            total += device_profile.optimizer_state_bytes
        if offload_parameters:
            total += device_profile.parameter_bytes
        return total

    def effective(by_stretch: list[int], position: int, block: int | None) -> int:
        """The most, at one time, of the phase's working memory and what the moved parts hold."""
        first = walk.first_event[position]
        most = max(value + in_stretch(first + s, block) for s, value in enumerate(by_stretch))
        for s in range(len(by_stretch) - 1):
            if update_in_backward and walk.events[first + s][1] is not None:
                most = max(most, max(by_stretch[s], by_stretch[s + 1]) + at_update(first + s, block))
        return most

    forward = []
    first_state = steps[0] if steps else 0
    for i in range(count):
        held = 0
        if offload_state:
            held += state_resident + first_state         # the first update's, prefetched after the last step
        if offload_parameters:
            held += parameters_resident + owned[i] + max(owned[i], later[i])
        forward.append(at_once(False) - held)
    backward, recompute = [], []
    for i, block in enumerate(profile.blocks):
        names = block.backward_gradient_names
        other = backward_other_bytes(profile, block)
        by_other, by_peak = block.backward_other_by_stretch, block.backward_peak_by_stretch
        if len(by_other) != len(names) + 1 or len(by_peak) != len(names) + 1 or block.backward_peak_bytes is None:
            # Not measured in stretches: the phase's most with the most the moved parts hold in it.
            by_other = by_peak = [other] * (len(names) + 1)
            peak = other
        else:
            peak = block.backward_peak_bytes
        position = walk.position(i)
        already = gradients_absent_bytes(device_profile, block.backward_gradient_bytes) if moving_gradients else 0
        absent_other = other + at_once(moving_gradients) - effective(by_other, position, i) - already
        absent_peak = peak + at_once(moving_gradients) - effective(by_peak, position, i) - already
        backward.append(min(absent_other, absent_peak))
        # A recompute re-runs the forward where the backward starts, before any of its updates.
        recompute.append(at_once(moving_gradients) - in_stretch(walk.first_event[position], i) - already)
    loss_other = profile.loss_other_bytes if profile.loss_other_bytes is not None else 0
    loss_stretches = [loss_other] * (len(profile.loss_gradient_names) + 1)
    loss = at_once(moving_gradients) + loss_other - effective(loss_stretches, 0, None)
    if moving_gradients:
        loss -= device_profile.gradient_bytes      # the simulator takes them all out before backward
    return forward, loss, backward, recompute


def with_phase_static(device_profile: Profile, measured: Profile, model: nn.Module, update_in_backward: bool,
                      offload_state: bool, offload_parameters: bool) -> Profile:
    """``device_profile`` (the profile as the device sees it under the placement) with each phase's
    static bytes absent then (`phase_static_absent`); unchanged where those are not known.
    ``measured``: the profile as measured (every static byte counted)."""
    if not (update_in_backward or offload_state or offload_parameters):
        return device_profile
    found = phase_static_absent(model, measured, device_profile, update_in_backward, offload_state, offload_parameters)
    if found is None:
        return device_profile
    forward, loss, backward, recompute = found
    blocks = [dataclasses.replace(block, forward_static_absent_bytes=block.forward_static_absent_bytes + forward[i],
                                  backward_static_absent_bytes=block.backward_static_absent_bytes + backward[i],
                                  recompute_static_absent_bytes=block.recompute_static_absent_bytes + recompute[i])
              for i, block in enumerate(device_profile.blocks)]
    return dataclasses.replace(device_profile, blocks=blocks,
                               loss_static_absent_bytes=device_profile.loss_static_absent_bytes + loss)
