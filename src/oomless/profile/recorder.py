"""The recorder: the runtime's callbacks during the profiling step, turned into per-block numbers.

Times come from the clock at block boundaries (waiting for the compute stream on CUDA: profiling
only); sizes from the storages the runtime reports as saved, in the order it saves them.

Memory beyond saved activations ("other" bytes) is measured exactly where the runtime's ledger
changes: between two changes the ledger is constant, so the peak of device memory in that interval
(the allocator's peak on CUDA, the kernel's peak resident mark on CPU, reset at each reading), less
the ledger, less what the step started with, less the gradients accumulated so far, is what the
step held beyond saved activations then: outputs the forward still references (U-Net skips),
gradients flowing in backward, op workspaces, saves outside every block, and the loss's own tensors.
Each interval's reading goes to the phase that ran: a block's forward (what runs before the first
block, such as a streamed outer level's encoder, counts in the first block's), the loss (from the end
of the forward to the first block's backward), or a block's backward. A rehearsal step (the plan's
own decisions) reads only at phase changes: its highest reading is what the plan's step really holds.
"""

import time
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from oomless.profile.profile import BlockProfile
from oomless.profile.rss import MemoryProbe
from oomless.profile.tensors import (ChangedAfterCalls, InputSharing, add_saved_earlier, alive_bytes,
                                     has_storage, storage_bytes, storage_key, tensors_in, versions, weak_storages)


_LOSS = -1  # the phase between the end of the forward and the first block's backward
_BEFORE_BLOCKS = -2  # the forward before its first block
ALIVE_INTO_BACKWARD = -1  # `BlockProfile.saved_alive_blocks` of a storage the forward still holds at backward


@dataclass
class SegmentCalls:
    """What the calls of one module around blocks (`SegmentProfile`) showed in a profiling step."""

    calls: int = 0
    input_bytes: int = 0
    input_held_earlier: list = field(default_factory=list)   # as `BlockProfile.input_held_earlier`
    ran: list[int] = field(default_factory=list)             # the blocks its calls ran (recorder numbers)
    input_saved_bytes: int = 0                               # bytes its blocks saved of its inputs
    changes_input: bool = False                              # as `BlockProfile.changes_input`


class Recorder:
    """Receives the runtime's callbacks during the profiling step and keeps per-block numbers.

    ``base_bytes``: device memory before the profiling steps (parameters, buffers, inputs, optimizer
    state if any); ``parameters``: the model's, to count gradients as they are accumulated;
    ``every_ledger_change`` False reads only at phase changes (a few readings a step: the step's
    times are not paid for them)."""

    def __init__(self, names: list[str], device: torch.device, base_bytes: int, parameters=(),
                 every_ledger_change: bool = True, parameter_names: dict | None = None):
        self.names = names
        self.device = device
        self.tier_stall_source = lambda: 0.0
        self.stall_seconds = 0.0
        self.blocks = {index: BlockProfile(name) for index, name in enumerate(names)}
        self.order: list[int] = []
        self.started: dict[int, float] = {}
        # Each running block's and module's inputs with their versions when it started, to tell
        # whether its forward changes them in place (`BlockProfile.changes_input`).
        self.input_versions: dict = {}
        self.changed_after = ChangedAfterCalls()    # and whether the model changes them after the call
        self.unassigned_saved_bytes = 0
        self.backward_marks: list[tuple[float, int]] = []
        self.live_outputs: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self.live_gradients: dict[tuple, tuple[StorageWeakRef, int]] = {}
        # The model's output storages (not its inputs or parameters), and of their bytes those the
        # loss freed: alive into backward only where the caller keeps a reference (`Profile.output_freed_bytes`).
        self.live_output: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self.output_freed_bytes = 0
        # When the forward frees each saved storage (`BlockProfile.saved_alive_blocks`), read in the
        # sizing step, whose ``tier_is_out`` is the swap tier's: the runtime's entries not yet seen
        # freed, as (entry, block index, index in its saved_sizes, position of that block in the
        # forward's order), and those seen freed, with the position and the saves so far there.
        self.saved_alive: list[tuple[object, int, int, int]] = []
        self.saved_freed: list[tuple[int, int, int, int, int]] = []
        self.tier_is_out = None
        self.resident: set[tuple] = set()
        self.sharing = InputSharing(storage_key)   # blocks' inputs an earlier block had (per forward)
        # Modules around blocks (`SegmentProfile`), by name; and those whose call runs: name -> (blocks
        # started before it, its input storages, its start).
        self.segments: dict[str, SegmentCalls] = {}
        self.open_segments: dict[str, tuple[int, set, float]] = {}
        self.segment_seconds: dict[str, float] = {}   # their calls' forward time, stalls left out
        # Spent in the forward's hooks (block_started, block_finished, forward_started and _finished:
        # readings), not the step's; on CUDA without the waits in `now`, which are the step's own
        # kernels finishing.
        self.hook_seconds = 0.0
        self.backward_hook_seconds: dict[int, float] = {}   # per block: its backward mark's readings
        self.block_starts: list[int] = []     # the blocks' forward calls, in order
        self.probe = MemoryProbe(device)
        self.in_backward = False
        self.in_backward_marked = False
        self.link = None  # the swap tier's bandwidth as seen in this step, where it could tell
        self.every_ledger_change = every_ledger_change
        self.selective_meter = None     # profile.selective.SelectiveMeter, in the sizing step
        self._before_blocks: BlockProfile | None = None   # readings before the first block, merged into it
        self.phase: tuple[str, int] | None = None   # ("forward" | "backward", block index) or ("loss", -1)
        self.ledger_bytes = 0
        # Each block's saved bytes autograd has released so far: the rest of its saves is what a plan
        # keeping it holds (`BlockProfile.forward_own_peak_bytes`; in a later call's forward its earlier
        # calls' saves too).
        self.released_bytes: dict[int, int] = {}
        # Each entry the runtime made in this step, by identity: (the entry, its block, its index in
        # that block's saved_sizes), to name it where a later block saves its storage again.
        self.first_saves: dict[int, tuple[object, int, int]] = {}
        self.base_bytes = base_bytes
        self.gradient_bytes = 0
        # Which phase each gradient was accumulated in (`BlockProfile.backward_gradient_names`):
        # {id(parameter): its name in the model}; the gradients of unnamed parameters are not placed.
        self.parameter_names = parameter_names or {}
        self.loss_gradient_names: list[str] = []
        self.loss_other_bytes = 0
        self.loss_peak_bytes = 0
        self.highest_above_static_bytes = 0
        # The most above static memory counting every gradient from the start, as a plan whose
        # phases have room for the gradients not made yet counts it (`Profile.gradients_from_backward`).
        parameters = list(dict.fromkeys(parameters))
        self.total_gradient_bytes = sum(p.nbytes for p in parameters if p.requires_grad)
        self.highest_above_all_gradients_bytes = -self.total_gradient_bytes
        self._gradient_hooks = []
        self._counted_gradients: set[int] = set()
        for parameter in dict.fromkeys(parameters):
            if parameter.requires_grad:
                self._gradient_hooks.append(parameter.register_post_accumulate_grad_hook(self._gradient_done))

    def close(self) -> None:
        self.probe.close()
        for handle in self._gradient_hooks:
            handle.remove()
        self._gradient_hooks.clear()

    def _gradient_done(self, parameter: torch.Tensor) -> None:
        if id(parameter) not in self._counted_gradients and parameter.grad is not None:
            name = self.parameter_names.get(id(parameter))
            if name is not None and self.every_ledger_change:
                # A stretch of the phase ends at each accumulation: the update in backward would step
                # here, and what the placements hold differs on either side (`plan.static_phases`).
                self._read_interval()
            self._counted_gradients.add(id(parameter))
            self.gradient_bytes += parameter.grad.untyped_storage().nbytes()
            if name is not None and self.phase is not None:
                kind, index = self.phase
                if kind == "backward":
                    block = self.blocks[index]
                    block.backward_gradient_names.append(name)
                    for stretches in (block.backward_other_by_stretch, block.backward_peak_by_stretch):
                        stretches.extend([0] * (len(block.backward_gradient_names) + 1 - len(stretches)))
                elif kind == "loss":
                    self.loss_gradient_names.append(name)

    def tier_stall(self) -> float:
        """Seconds waited on the swap tier so far: taken out of measured backward times."""
        self.stall_seconds += self.tier_stall_source()
        return self.stall_seconds

    def now(self) -> float:
        if self.device.type == "cuda":
            # Profiling only: exact per-block times. The compute stream, not the device: a device
            # synchronisation would also wait for the swap tier's copy streams and bill their
            # transfers to the block that happens to be running.
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    # Memory beyond saved activations, per phase.

    def _read_interval(self) -> None:
        """Attribute the peak since the last reading to the running phase, then start a new interval."""
        if self.phase is None:
            return
        reading = self.probe.peak_and_mark() - self.base_bytes
        above_static = max(reading - self.gradient_bytes, 0)
        self.highest_above_static_bytes = max(self.highest_above_static_bytes, above_static)
        self.highest_above_all_gradients_bytes = max(self.highest_above_all_gradients_bytes,
                                                     reading - self.total_gradient_bytes)
        other = max(above_static - self.ledger_bytes, 0)
        kind, index = self.phase
        own = 0 if index < 0 else self.blocks[index].saved_bytes - self.released_bytes.get(index, 0)
        if kind == "loss":
            self.loss_other_bytes = max(self.loss_other_bytes, other)
            self.loss_peak_bytes = max(self.loss_peak_bytes, above_static)
        elif kind == "forward":
            block = self._before_blocks if index == _BEFORE_BLOCKS else self.blocks[index]
            block.forward_other_bytes = max(block.forward_other_bytes or 0, other)
            block.forward_peak_bytes = max(block.forward_peak_bytes or 0, above_static)
            block.forward_own_peak_bytes = max(block.forward_own_peak_bytes or 0, other + own)
        else:
            block = self.blocks[index]
            block.backward_other_bytes = max(block.backward_other_bytes or 0, other)
            block.backward_peak_bytes = max(block.backward_peak_bytes or 0, above_static)
            block.backward_own_peak_bytes = max(block.backward_own_peak_bytes or 0, other + own)
            if not block.backward_other_by_stretch:
                block.backward_other_by_stretch.append(0)
                block.backward_peak_by_stretch.append(0)
            block.backward_other_by_stretch[-1] = max(block.backward_other_by_stretch[-1], other)
            block.backward_peak_by_stretch[-1] = max(block.backward_peak_by_stretch[-1], above_static)
            block.backward_gradient_bytes = max(block.backward_gradient_bytes or 0, self.gradient_bytes)

    def _enter(self, phase: tuple[str, int] | None) -> None:
        self._read_interval()
        if self.phase is None:
            self.probe.mark()
        self.phase = phase

    def ledger_changing(self, resident_bytes: int, change: int) -> None:
        """Called by the ledger before each change: the interval that ends here ran with
        ``resident_bytes`` on the ledger, the next runs with ``change`` more. (Read with the value
        before the previous change, every interval after a tensor was brought back counted it as
        working memory as well as on the ledger: a BERT layer's backward measured 10 MiB over what a
        plan keeping it holds, a full-resolution SwinUNETR block's 40 MiB.)"""
        self.ledger_bytes = resident_bytes
        if self.every_ledger_change:
            self._read_interval()
        self.ledger_bytes = resident_bytes + change

    # The runtime's callbacks.

    def forward_started(self, resident_storages):
        entered = time.perf_counter()
        self.resident = resident_storages
        self.sharing = InputSharing(storage_key)
        self.changed_after = ChangedAfterCalls()
        self._before_blocks = BlockProfile("")
        self._enter(("forward", _BEFORE_BLOCKS))
        self.hook_seconds += time.perf_counter() - entered
        if self.selective_meter is not None:
            self.selective_meter.__enter__()

    def _track(self, live: dict, tensors) -> None:
        live.update(weak_storages(tensors, self.resident))

    def _look_for_freed(self, position: int, saves: int) -> None:
        """Note the saved storages the forward has freed by now: the phase at ``position`` (in the
        order the blocks ran; one past the last block: the loss), ``saves`` storages into it."""
        still = []
        for record in self.saved_alive:
            entry, index, k, saved_at = record
            if self._freed_by_forward(entry):
                self.saved_freed.append((index, k, saved_at, position, saves))
            else:
                still.append(record)
        self.saved_alive = still

    def _freed_by_forward(self, entry) -> bool:
        """Whether nothing but the swap tier still references ``entry``'s storage. A copy still
        running holds exactly one reference, its storage object (runtime/tiers.py), which must not
        count: when the forward freed it is then read alike however fast the copies run."""
        if entry.weak.expired():
            return True
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if entry.ticket is None or use_count is None or self.tier_is_out(entry.ticket):
            return False    # (a torch without the count: alive until seen expired, the longer reading)
        return use_count(entry.weak.cdata) <= 1

    def _fill_lifetimes(self) -> None:
        for index, k, saved_at, position, saves in self.saved_freed:
            lifetime = float(position - saved_at)
            if position < len(self.order):
                # Freed after the ``saves``-th storage that block saved: that share into its forward.
                count = len(self.blocks[self.order[position]].saved_sizes)
                lifetime += min(saves / count, 1.0) if count else 0.0
            self.blocks[index].saved_alive_blocks[k] = max(lifetime, 0.0)
        self.saved_freed = []

    def forward_finished(self, output):
        entered = self.now()     # the work after the last block done: the readings' time follows
        self._forward_finished(output)
        self.hook_seconds += time.perf_counter() - entered

    def _forward_finished(self, output) -> None:
        self.first_saves.clear()        # the forward's saves are all made
        self.changed_after.look()
        self._track(self.live_output, tensors_in(output))
        if self.selective_meter is not None:
            self.selective_meter.__exit__(None, None, None)
        if self.saved_alive:
            self._look_for_freed(len(self.order), 0)
        self._enter(("loss", _LOSS))

    def loss_done(self) -> None:
        """The loss is computed and the caller dropped its reference to the output: what of it is
        freed now, the loss did not save."""
        output_bytes = sum(num_bytes for _, num_bytes in self.live_output.values())
        self.output_freed_bytes = output_bytes - alive_bytes(self.live_output)
        # Block indices are ints, segments' names str.
        for key in self.changed_after.changed_since():
            if not isinstance(key, int):
                self.segments[key].changes_input = True
            elif self.blocks[key].saved_sizes:
                self.blocks[key].changes_input = True

    def unassigned(self, num_bytes):
        self.unassigned_saved_bytes += num_bytes

    def fetched(self, num_bytes):
        pass

    def released(self, block_index: int, num_bytes: int) -> None:
        """Autograd dropped the last saved tensor of one of ``block_index``'s storages (after the ledger
        took it off, where it was on)."""
        self.released_bytes[block_index] = self.released_bytes.get(block_index, 0) + num_bytes

    def saved(self, block_index, num_bytes, movable: bool = True, tensor=None, entry=None):
        if self.selective_meter is not None and tensor is not None:
            self.selective_meter.saved(tensor)
        block = self.blocks[block_index]
        if not movable:
            block.kept_when_swapped.append(len(block.saved_sizes))
        if self.tier_is_out is not None and entry is not None and block_index in self.order:
            position = self.order.index(block_index)
            if self.saved_alive:
                self._look_for_freed(position, len(block.saved_sizes) + 1)
            block.saved_alive_blocks.append(ALIVE_INTO_BACKWARD)   # until seen freed
            self.saved_alive.append((entry, block_index, len(block.saved_sizes), position))
        if entry is not None and not self.in_backward:
            self.first_saves[id(entry)] = (entry, block_index, len(block.saved_sizes))
        if tensor is not None and self.sharing.saved(block_index, tensor):
            block.input_saved_bytes += num_bytes
        if tensor is not None and self.open_segments:
            key = storage_key(tensor)
            for name, (_, inputs, _) in self.open_segments.items():
                if key in inputs:
                    self.segments[name].input_saved_bytes += num_bytes
        block.saved_bytes += num_bytes
        block.saved_sizes.append(num_bytes)
        block.largest_saved_bytes = max(block.largest_saved_bytes, num_bytes)

    def saved_again(self, block_index: int, entry) -> None:
        """Block ``block_index`` saved in its forward a storage whose entry another block made
        (`BlockProfile.saved_earlier`; recorder numbers here, `earlier_saves_by_place` makes them places)."""
        first = self.first_saves.get(id(entry))
        if first is None or first[0] is not entry or first[1] == block_index or self.in_backward:
            return
        add_saved_earlier(self.blocks[block_index], first[1], first[2])

    def segment_started(self, name: str, args) -> None:
        """A module around blocks starts its forward (its pre-hook runs before its first block's)."""
        if self.in_backward:
            return
        tensors = tensors_in(args)
        calls = self.segments.setdefault(name, SegmentCalls())
        calls.calls += 1
        calls.input_bytes += storage_bytes(tensors)
        calls.input_held_earlier += self.sharing.held_before(tensors, self.resident)
        self.open_segments[name] = (len(self.block_starts), {storage_key(t) for t in tensors if has_storage(t)},
                                    self.now() - self.tier_stall() - self.hook_seconds)
        self.input_versions[name] = versions(tensors)

    def segment_finished(self, name: str) -> None:
        """Its call has returned (or raised): the blocks that ran inside it are known, and its time."""
        opened = self.open_segments.pop(name, None)
        if opened is not None and not self.in_backward:
            self.segments[name].ran += self.block_starts[opened[0]:]
            self.segments[name].changes_input |= self.changed_after.call_ended(name, self.input_versions.pop(name, []))
            seconds = self.now() - self.tier_stall() - self.hook_seconds - opened[2]
            self.segment_seconds[name] = self.segment_seconds.get(name, 0.0) + seconds

    def block_started(self, index, args):
        if self.in_backward:
            return
        # The work between blocks done (on CUDA `now` waits for it): what follows is readings, the
        # device idle through them, then the block's own time starts.
        entered = self.now()
        if index not in self.order:
            self.order.append(index)
            if self.saved_alive:
                self._look_for_freed(len(self.order) - 1, 0)
        block = self.blocks[index]
        block.calls += 1
        self.block_starts.append(index)
        inputs = tensors_in(args)
        block.input_bytes += storage_bytes(inputs)
        block.input_held_earlier += self.sharing.block_started(index, inputs, self.resident)
        block.held_forward_bytes = max(block.held_forward_bytes, alive_bytes(self.live_outputs))
        self.input_versions[index] = versions(inputs)
        self.changed_after.look()
        self._enter(("forward", index))
        before, self._before_blocks = self._before_blocks, None
        if before is not None and before.forward_other_bytes is not None:
            # The first block's forward phase starts where the model's forward does: the simulator
            # has no phase before it, and the ledger is no fuller then.
            block.forward_other_bytes = max(block.forward_other_bytes or 0, before.forward_other_bytes)
            block.forward_peak_bytes = max(block.forward_peak_bytes or 0, before.forward_peak_bytes)
            block.forward_own_peak_bytes = max(block.forward_own_peak_bytes or 0, before.forward_own_peak_bytes)
        self.started[index] = time.perf_counter()
        self.hook_seconds += self.started[index] - entered

    def block_finished(self, index, output):
        if self.in_backward:
            return
        self.sharing.block_finished(index)
        block = self.blocks[index]
        ended = self.now()
        block.forward_seconds += ended - self.started.pop(index)
        block.changes_input |= self.changed_after.call_ended(index, self.input_versions.pop(index, []))
        outputs = tensors_in(output)
        block.output_bytes += storage_bytes(outputs)
        self._track(self.live_outputs, outputs)
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(self._backward_mark(index))
                break
        self.hook_seconds += time.perf_counter() - ended

    def _backward_mark(self, index):
        def hook(grad):
            marked = self.now()
            if not self.in_backward_marked:
                # Saved storages freed during the loss were alive until it; the rest into backward.
                self.in_backward_marked = True
                if self.saved_alive:
                    self._look_for_freed(len(self.order), 0)
                self.saved_alive = []
            self._enter(("backward", index))
            self.backward_marks.append((marked - self.tier_stall(), index))
            self._track(self.live_gradients, [grad])
            block = self.blocks[index]
            block.held_backward_bytes = max(block.held_backward_bytes, alive_bytes(self.live_gradients))
            # Readings, the device idle through them after `now`'s wait on CUDA: not the block's backward.
            read = time.perf_counter() - marked
            self.backward_hook_seconds[index] = self.backward_hook_seconds.get(index, 0.0) + read
        return hook

    def backward_finished(self) -> None:
        """Backward has ended: close the last interval and fill the derived transient fields."""
        self._enter(None)
        self._fill_lifetimes()
        for block in self.blocks.values():
            if block.forward_other_bytes is not None:
                block.forward_transient_bytes = max(block.forward_other_bytes - block.held_forward_bytes, 0)
            if block.backward_other_bytes is not None:
                block.backward_transient_bytes = max(block.backward_other_bytes - block.held_backward_bytes, 0)

    def assign_backward_seconds(self, backward_end: float) -> None:
        # A block's backward runs from the moment the gradient of its output is ready until the
        # next block's output gradient is (or backward ends): time minus waits on the swap tier.
        marks = sorted(self.backward_marks) + [(backward_end, None)]
        for (start, index), (end, _) in zip(marks, marks[1:]):
            self.blocks[index].backward_seconds += max(end - start, 0.0)
        for index, seconds in self.backward_hook_seconds.items():
            self.blocks[index].backward_seconds = max(self.blocks[index].backward_seconds - seconds, 0.0)
