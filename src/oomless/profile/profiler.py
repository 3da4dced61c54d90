"""Profile one real training step, per block, within the memory budget.

The step runs under the most frugal plan (every block's saved tensors swapped out as they are
saved), so sizes are measured without holding every activation at once. Hooks record per block:
forward and backward seconds, saved-activation bytes by storage (first saver owns a storage;
parameters never count), output, input and parameter bytes. The model's parameters, buffers,
gradients and RNG are left exactly as they were.
"""

import time

import torch
import torch.nn as nn

from oomless.errors import InputError
from oomless.profile.blocks import find_blocks
from oomless.profile.links import measure_link
from oomless.profile.profile import BlockProfile, Profile

_OPTIMIZER_STATE_COPIES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                           "RMSprop": 1, "Adadelta": 2}


def tensors_in(value) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for tensor in tensors:
        if tensor.device.type == "meta":
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
        else:
            storage = tensor.untyped_storage()
            seen[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_inputs_device(model: nn.Module, example_inputs) -> torch.device:
    device = model_device(model)
    for tensor in tensors_in(example_inputs):
        if tensor.device != device and tensor.device.type != "meta" and device.type != "meta":
            raise InputError(f"example input is on {tensor.device} but the model is on {device}; "
                             f"move the inputs with .to('{device}') (or the model to the inputs' device)")
    return device


def optimizer_state_bytes(optimizer, model: nn.Module, notes: list[str]) -> int:
    if optimizer is None:
        notes.append("no optimizer given: its state is counted as 0 bytes (pass optimizer= to count it)")
        return 0
    existing = storage_bytes([value for state in optimizer.state.values() for value in state.values()
                              if isinstance(value, torch.Tensor) and value.dim() > 0])
    if existing:
        return existing
    name = type(optimizer).__name__
    trainable = storage_bytes([p for group in optimizer.param_groups for p in group["params"]])
    copies = _OPTIMIZER_STATE_COPIES.get(name)
    if name == "SGD":
        copies = 1 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0
    if copies is None:
        notes.append(f"optimizer {name} has no state yet and is not one oomless knows: its state is "
                     "estimated as one copy of the parameters; run one step first for an exact count")
        copies = 1
    return copies * trainable


def call_model(model: nn.Module, example_inputs):
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)


def loss_of(output, loss_fn):
    if loss_fn is not None:
        loss = loss_fn(output)
    else:
        loss = output
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        source = "loss_fn returned" if loss_fn is not None else "the model returned"
        raise InputError(f"{source} {shape}, not a scalar loss; pass loss_fn=callable(output) -> scalar "
                         "(for instance loss_fn=oomless.sum_of_outputs)")
    return loss


class _Recorder:
    """Receives the runtime's callbacks during the profiling step and keeps per-block numbers."""

    def __init__(self, names: list[str], device: torch.device, tier_stall):
        self.names = names
        self.device = device
        self.tier_stall = tier_stall
        self.blocks = {index: BlockProfile(name) for index, name in enumerate(names)}
        self.order: list[int] = []
        self.started: dict[int, float] = {}
        self.unassigned_saved_bytes = 0
        self.backward_marks: list[tuple[float, int]] = []

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # profiling only: exact per-block times
        return time.perf_counter()

    def forward_started(self):
        pass

    def forward_finished(self, output):
        pass

    def unassigned(self, num_bytes):
        self.unassigned_saved_bytes += num_bytes

    def saved(self, block_index, num_bytes):
        block = self.blocks[block_index]
        block.saved_bytes += num_bytes
        block.largest_saved_bytes = max(block.largest_saved_bytes, num_bytes)

    def block_started(self, index, args):
        if index not in self.order:
            self.order.append(index)
        block = self.blocks[index]
        block.calls += 1
        block.input_bytes += storage_bytes(tensors_in(args))
        self.started[index] = self.now()

    def block_finished(self, index, output):
        block = self.blocks[index]
        block.forward_seconds += self.now() - self.started.pop(index)
        outputs = tensors_in(output)
        block.output_bytes += storage_bytes(outputs)
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(self._backward_mark(index))
                break

    def _backward_mark(self, index):
        def hook(grad):
            self.backward_marks.append((self.now() - self.tier_stall(), index))
        return hook

    def assign_backward_seconds(self, backward_end: float) -> None:
        # A block's backward runs from the moment the gradient of its output is ready until the
        # next block's output gradient is (or backward ends): time minus waits on the swap tier.
        marks = sorted(self.backward_marks) + [(backward_end, None)]
        for (start, index), (end, _) in zip(marks, marks[1:]):
            self.blocks[index].backward_seconds += max(end - start, 0.0)


def profile_model(model: nn.Module, example_inputs, loss_fn=None, optimizer=None, blocks=None) -> Profile:
    """Measure one training step of ``model`` (no optimizer step) under an all-swap plan."""
    from oomless.plan.plan import BlockPlan, Plan
    from oomless.runtime.install import install_plan, uninstall_plan, installed_state

    device = check_inputs_device(model, example_inputs)
    if installed_state(model) is not None:
        from oomless.errors import ApplyError
        raise ApplyError("oomless is already applied to this model; call oomless.remove(model) first")
    found = find_blocks(model, blocks)
    names = [name for name, _ in found]
    frugal = Plan(memory_bytes=0, device=str(device), static_bytes=0, reserve_bytes=0, activation_budget=0,
                  predicted_peak_bytes=0, predicted_activation_peak_bytes=0, predicted_step_seconds=0.0,
                  plain_peak_bytes=0, plain_step_seconds=0.0, prefetch_blocks=1, min_swap_bytes=0,
                  blocks=[BlockPlan(name, "swap", "profiling", 0, 0.0, 0.0) for name in names])
    notes: list[str] = []
    parameters = list(dict.fromkeys(model.parameters()))
    saved_grads = [p.grad for p in parameters]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    recorder = _Recorder(names, device, lambda: 0.0)
    install_plan(model, frugal, device, recorder=recorder)
    state = installed_state(model)
    stall_total = [0.0]

    def tier_stall():
        stall_total[0] += state.tier.collect_stall_seconds() if state.tier is not None else 0.0
        return stall_total[0]

    recorder.tier_stall = tier_stall
    try:
        for p in parameters:
            p.grad = None
        output = call_model(model, example_inputs)
        loss_started = recorder.now()
        loss = loss_of(output, loss_fn)
        loss_seconds = recorder.now() - loss_started
        loss.backward()
        backward_end = recorder.now() - tier_stall()
        del output, loss
    finally:
        uninstall_plan(model)
        with torch.no_grad():
            for p, grad in zip(parameters, saved_grads):
                p.grad = grad
            for buffer, saved in zip(model.buffers(), saved_buffers):
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    recorder.assign_backward_seconds(backward_end)

    modules = dict(found)
    block_profiles = []
    for index in recorder.order + [i for i in range(len(names)) if i not in recorder.order]:
        block = recorder.blocks[index]
        block.parameter_bytes = storage_bytes(list(modules[block.name].parameters()))
        if block.calls == 0:
            notes.append(f"block {block.name} did not run in the profiled step")
        block_profiles.append(block)
    trainable = [p for p in parameters if p.requires_grad]
    return Profile(
        device=str(device),
        blocks=block_profiles,
        parameter_bytes=storage_bytes(parameters),
        gradient_bytes=storage_bytes(trainable),
        buffer_bytes=storage_bytes(list(model.buffers())),
        optimizer_state_bytes=optimizer_state_bytes(optimizer, model, notes),
        input_bytes=storage_bytes(tensors_in(example_inputs)),
        unassigned_saved_bytes=recorder.unassigned_saved_bytes,
        loss_seconds=loss_seconds,
        link=measure_link(str(device)),
        notes=notes,
    )
