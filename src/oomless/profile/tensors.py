"""Small helpers on tensors and models shared by the profiler and the runtime."""

import contextlib
import functools
import types
import weakref

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from oomless.errors import InputError
from oomless.profile.profile import RESIDENT_INPUT


def tensors_in(value) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def parameters_read_by(function, model: nn.Module) -> tuple[dict[str, nn.Parameter], list[nn.Parameter]]:
    """({name: parameter} of ``model``'s that ``function`` holds (`tensors_held_by`), [the parameters
    it holds that are not ``model``'s]), each once: a loss that reads a parameter itself, such as a
    language model's head weight in `oomless.linear_cross_entropy` (tied: the model's; untied: not)."""
    if function is None:
        return {}, []
    held = list({id(tensor): tensor for tensor in tensors_held_by(function)
                 if isinstance(tensor, nn.Parameter)}.values())
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    own = {names[id(parameter)]: parameter for parameter in held if id(parameter) in names}
    return own, [parameter for parameter in held if id(parameter) not in names]


def parameters_held_by(function, model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters that ``function`` holds, in the model's order."""
    held = {id(parameter) for parameter in parameters_read_by(function, model)[0].values()}
    return [name for name, parameter in model.named_parameters() if id(parameter) in held]


def tensors_held_by(function, depth: int = 3) -> list[torch.Tensor]:
    """Tensors a callable holds, such as the targets a loss function closes over
    (``lambda out: F.cross_entropy(out, labels)``): its closure's cells and default arguments, a
    functools.partial's arguments, a bound method's object, a module's parameters and buffers, and
    the contents and attributes of what those hold, to ``depth`` levels."""
    found = []
    for value in _values_reached(function, depth):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, nn.Module):
            found.extend(value.parameters())
            found.extend(value.buffers())
    return found


def modules_reached_by(function, depth: int = 3) -> list[nn.Module]:
    """nn.Modules a callable (a loss function) can call: those it holds as `tensors_held_by` finds
    them, and the module-level names its code reads (a GAN's discriminator defined at the top of a
    script, read by ``lambda fake: bce(discriminator(fake), ones)``), to ``depth`` levels."""
    return [value for value in _values_reached(function, depth, names_read=True) if isinstance(value, nn.Module)]


def _values_reached(function, depth: int, names_read: bool = False) -> list:
    """Each value ``function`` holds, once, to ``depth`` levels: closure cells, defaults, a partial's
    arguments, a bound method's object, containers' items and objects' attributes; with
    ``names_read``, the module-level values its code names too. Tensors and modules are listed,
    not looked into."""
    reached, seen = [], set()

    def visit(value, level: int) -> None:
        if level > depth or id(value) in seen or isinstance(value, (type, types.ModuleType, str, bytes)):
            return
        seen.add(id(value))
        if isinstance(value, (torch.Tensor, nn.Module)):
            reached.append(value)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                visit(item, level + 1)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, level + 1)
        elif isinstance(value, functools.partial):
            for item in (value.func, *value.args, *value.keywords.values()):
                visit(item, level + 1)
        elif isinstance(value, types.FunctionType):
            cells = []
            for cell in value.__closure__ or ():
                with contextlib.suppress(ValueError):      # a cell not filled yet
                    cells.append(cell.cell_contents)
            named = [value.__globals__[name] for name in value.__code__.co_names
                     if names_read and name in value.__globals__]
            for item in (*cells, *named, *(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()):
                visit(item, level + 1)
        elif isinstance(value, types.MethodType):
            visit(value.__self__, level + 1)
        elif hasattr(value, "__dict__") and not callable(getattr(value, "__get__", None)):
            for item in vars(value).values():
                visit(item, level + 1)

    visit(function, 0)
    return reached


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.untyped_storage()`` exists: not for sparse or nested tensors."""
    return not (tensor.is_sparse or tensor.is_nested)


def storage_key(tensor: torch.Tensor) -> tuple:
    """A storage's name while it lives, as the runtime's entries key it (runtime/saved_entries.py)."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def weak_storages(tensors, resident=frozenset()) -> dict[tuple, tuple[StorageWeakRef, int]]:
    """{(device, data pointer): (a weak reference to the storage, its bytes)} of ``tensors`` with a
    storage on a real device, but those in ``resident``: read later (`alive_bytes`) without keeping
    them alive."""
    storages = {}
    for tensor in tensors:
        if has_storage(tensor) and tensor.device.type != "meta":
            key = storage_key(tensor)
            if key not in resident:
                storage = tensor.untyped_storage()
                storages[key] = (StorageWeakRef(storage), storage.nbytes())
    return storages


def alive_bytes(storages: dict) -> int:
    """Bytes of the storages in ``storages`` (`weak_storages`) still alive; the freed are dropped from it."""
    for key in [key for key, (weak, _) in storages.items() if weak.expired()]:
        del storages[key]
    return sum(num_bytes for _, num_bytes in storages.values())


def tensor_bytes(tensors) -> int:
    """Bytes of ``tensors`` themselves, each distinct tensor once (a batch sliced from a larger
    tensor counts its own elements, not its storage's)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in {id(t): t for t in tensors}.values())


def versions(tensors) -> list[tuple[torch.Tensor, int]]:
    """Each of ``tensors`` with its version counter (raised by every in-place change of it or of a
    view of its storage); inference tensors, which have none, left out."""
    return [(tensor, tensor._version) for tensor in tensors if not tensor.is_inference()]


def changed(taken: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether any tensor of ``taken`` (`versions`) was changed in place since."""
    return any(tensor._version != version for tensor, version in taken)


class ChangedAfterCalls:
    """The inputs of calls that have ended (weakly) with their versions then: which calls' inputs the
    model changes in place afterwards, before backward (``h = block(x); x.mul_(2)``). A recompute of
    such a call would start from the changed values: it starts from a copy taken at the call, as for a
    block that changes its own input (`BlockProfile.changes_input`). Plain PyTorch trains such a
    model wherever nothing saved reads the input (the block saves its output: tanh, exp, sigmoid).
    Looked at each block start and at the forward's end and the loss's: a tensor the model no longer
    holds cannot be changed, and under a plan the recompute holds it, so the weak references die."""

    def __init__(self):
        self.calls: list[tuple[object, list]] = []
        self.changed: set = set()

    def call_ended(self, key, taken: list[tuple[torch.Tensor, int]]) -> bool:
        """``taken``: the call's inputs (`versions` at its start), read again now, at its end.
        Whether the call changed one itself."""
        self.calls.append((key, [(weakref.ref(tensor), tensor._version) for tensor, _ in taken]))
        return changed(taken)

    def look(self) -> None:
        """Note the calls whose inputs changed since their end; drop those no longer held."""
        calls = []
        for key, inputs in self.calls:
            alive = [(ref, version, tensor) for ref, version in inputs if (tensor := ref()) is not None]
            if any(tensor._version != version for _, version, tensor in alive):
                self.changed.add(key)
            elif alive:
                calls.append((key, [(ref, version) for ref, version, _ in alive]))
        self.calls = calls

    def changed_since(self) -> set:
        """The keys of the calls with an input changed after the call; forgets them all. A block
        that saved nothing is never recomputed: leave it out (an ``nn.Identity`` or a view whose
        output, its own input, an in-place ReLU after it changes)."""
        self.look()
        changed, self.changed, self.calls = self.changed, set(), []
        return changed


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for tensor in tensors:
        if tensor.is_sparse:            # COO: no storage of its own (untyped_storage() raises)
            seen[id(tensor)] = storage_bytes([tensor._indices(), tensor._values()])
        elif tensor.device.type == "meta":
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
        else:
            storage = tensor.untyped_storage()
            seen[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


# What the process holds beyond a static tensor's bytes, per tensor. CPU (glibc, with oomless's 64 KiB
# mmap threshold, `profile.rss.return_freed_memory_to_the_system`): a tensor of 64 KiB or more is its
# own mapping, its bytes plus a header rounded up to pages (~4 KiB more), a smaller one a heap chunk
# plus its TensorImpl, storage and Python objects (~0.9 KiB more). Measured on the step of a
# 128-wide transformer with Adam (`bench/bench_beyond.py` sizes, depths 8 to 64): plain PyTorch holds
# 16-17 KiB per trainable parameter beyond its bytes, its gradient's and its two moments' between
# steps; with the update in backward and the state and parameters on disk (tickets, hooks, the
# optimizer's per-parameter step tensor) 10 KiB. CUDA: the caching allocator rounds each block up to
# 512 bytes, 256 on average, for the parameter, its gradient and two states.
CPU_BYTES_PER_TRAINABLE_PARAMETER = 16 * 1024
CPU_BYTES_PER_OTHER_TENSOR = 4 * 1024
CUDA_BYTES_PER_TRAINABLE_PARAMETER = 4 * 256
CUDA_BYTES_PER_OTHER_TENSOR = 256


def static_overhead_bytes(device: torch.device, trainable_parameters: int, other_tensors: int) -> int:
    """Bytes the process holds for ``trainable_parameters`` (each with its gradient and optimizer
    state) and ``other_tensors`` (frozen parameters, buffers, inputs) beyond their bytes: the static
    bytes as the allocator holds them. On CPU the budget is the whole process's resident memory, so
    this is what a step of plain PyTorch holds too; 0 on other devices than CPU and CUDA."""
    if device.type == "cpu":
        return trainable_parameters * CPU_BYTES_PER_TRAINABLE_PARAMETER + other_tensors * CPU_BYTES_PER_OTHER_TENSOR
    if device.type == "cuda":
        return trainable_parameters * CUDA_BYTES_PER_TRAINABLE_PARAMETER + other_tensors * CUDA_BYTES_PER_OTHER_TENSOR
    return 0


def model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_inputs_device(model: nn.Module, example_inputs, allow_meta: bool = False) -> torch.device:
    """The device the model computes on; inputs must be there too (meta only when planning for a
    target device on fake tensors)."""
    device = model_device(model)
    for tensor in tensors_in(example_inputs):
        if allow_meta and "meta" in (tensor.device.type, device.type):
            continue
        if tensor.device != device:
            raise InputError(f"example input is on {tensor.device} but the model is on {device}; "
                             f"move the inputs with .to('{device}') (or the model to the inputs' device)")
    if device.type == "meta" and not allow_meta:
        raise InputError("the model is on the meta device: a real step cannot run there; move it to a "
                         "real device, or plan for a target device with target=...")
    return device


def call_model(model: nn.Module, example_inputs):
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)


@contextlib.contextmanager
def stand_ins_swapped(model: nn.Module, stand_in_for):
    """Run ``model`` on stand-ins of its parameters and buffers (meta or fake tensors), as
    ``torch.func.functional_call`` does, and put every one back after, whatever the forward did.
    ``stand_in_for(tensor)`` is called once per distinct tensor, so tied weights stay tied; yields
    {id of each original: its stand-in}. Not functional_call itself: it puts a module reached under
    two names (one layer called twice, registered as ``a`` and ``c``) back to the stand-in, and the
    model was left with meta parameters."""
    stand_ins: dict[int, torch.Tensor] = {}
    places = []
    for module in model.modules():          # each module once: each (table, name) place once
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    if id(tensor) not in stand_ins:
                        stand_ins[id(tensor)] = stand_in_for(tensor)
                    places.append((table, name, tensor))
    try:
        for table, name, tensor in places:
            table[name] = stand_ins[id(tensor)]
        yield stand_ins
    finally:
        for table, name, tensor in places:
            table[name] = tensor


@contextlib.contextmanager
def attributes_kept(model: nn.Module):
    """Run ``model`` on stand-ins (meta tensors) and leave each module's own attributes as they were:
    what its forward set (a cache of a grid or a mask made for the input's shape, a call counter) is
    taken back after, so no meta tensor is left where the next real forward would read it. Its
    parameters, buffers, submodules and hooks are the same objects after as before."""
    saved = [(module, dict(module.__dict__)) for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            for name in [name for name in module.__dict__ if name not in attributes]:
                del module.__dict__[name]
            module.__dict__.update(attributes)


@contextlib.contextmanager
def training_state_kept(model: nn.Module, also=()):
    """Run steps that measure ``model`` and leave it as it was: its gradients, its buffers (BatchNorm's
    running statistics) and the RNG (CPU, and CUDA where initialised) restored after, whatever the
    steps did; those of the modules ``also`` (others the steps call: `modules_reached_by` a loss)
    too. Yields (CPU RNG state, CUDA RNG states or None): steps that must draw the same random
    numbers start from them."""
    parameters = list(dict.fromkeys(model.parameters()))
    grads = [param.grad for param in parameters]
    # Each buffer's object and values: a step may replace one (``self.ema = ...``) or resize it (a
    # per-channel observer of quantization-aware training starts empty and takes its shape at its
    # first forward; copying its values back failed on the shapes).
    buffers = [(module, name, buffer, buffer.detach().clone()) for module in model.modules()
               for name, buffer in module._buffers.items() if buffer is not None]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    # Other models the steps call (a GAN's discriminator in the generator's loss, a teacher): their
    # gradients (copied: accumulation adds into one in place) and buffers, put back too.
    own = {id(module) for module in model.modules()}
    others = {id(inner): inner for module in also for inner in module.modules() if id(inner) not in own}
    other_grads = [(param, None if param.grad is None else param.grad.clone())
                   for param in dict.fromkeys(param for inner in others.values() for param in inner._parameters.values()
                                              if param is not None)]
    buffers += [(inner, name, buffer, buffer.detach().clone()) for inner in others.values()
                for name, buffer in inner._buffers.items() if buffer is not None]
    try:
        yield cpu_rng, cuda_rng
    finally:
        with torch.no_grad():
            for param, grad in [*zip(parameters, grads), *other_grads]:
                param.grad = grad
            for module, name, buffer, saved in buffers:
                module._buffers[name] = buffer
                if buffer.shape == saved.shape:
                    buffer.copy_(saved)
                else:
                    buffer.data = saved
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def holders_by_place(blocks: list, order: list[int]) -> None:
    """Rewrite each of ``blocks``' `BlockProfile.input_held_earlier` from the recorder's numbers (the
    order blocks were found) to positions in the profile, whose blocks are the recorder's ``order``."""
    position = {index: place for place, index in enumerate(order)}
    for block in blocks:
        block.input_held_earlier = [[size, saver if saver < 0 else position[saver],
                                     sorted(position[user] for user in users)]
                                    for size, saver, users in block.input_held_earlier]


def add_saved_earlier(block, saver: int, index: int) -> None:
    """Record in ``block`` (a `BlockProfile`, its forward running) that it saves storage ``index`` of
    block ``saver``'s saved_sizes, once per storage, at its place among the block's own saves so far
    (`BlockProfile.saved_earlier`, in recorder numbers until `earlier_saves_by_place`)."""
    if not any(record[:2] == [saver, index] for record in block.saved_earlier):
        block.saved_earlier.append([saver, index, len(block.saved_sizes)])


def earlier_saves_by_place(blocks: list, order: list[int]) -> None:
    """Rewrite each of ``blocks``' `BlockProfile.saved_earlier` from the recorder's numbers to how
    many places back in the profile (its blocks are the recorder's ``order``) the saver is. A block
    called again after its first call (placed there) may save what a block placed after it saved
    first: left out."""
    position = {index: place for place, index in enumerate(order)}
    for place, block in enumerate(blocks):
        block.saved_earlier = [[place - position[saver], *rest] for saver, *rest in block.saved_earlier
                               if position[saver] < place]


class InputSharing:
    """Which of a block's input storages an earlier block of the forward already had
    (`BlockProfile.input_held_earlier`), and which of its saves are its own inputs
    (`BlockProfile.input_saved_bytes`). ``key_of(tensor)`` names a tensor's storage; storages are
    remembered weakly, so an address reused by a new storage is not mistaken for the old one."""

    def __init__(self, key_of):
        self.key_of = key_of
        self.saved_by: dict = {}        # key: (weak storage, block that saved it first)
        self.input_of: dict = {}        # key: (weak storage, [blocks it was an input of])
        self.running_inputs: dict = {}  # block index: keys of its inputs, while its forward runs

    def _alive(self, table: dict, key):
        found = table.get(key)
        if found is None or found[0].expired():
            return None
        return found[1]

    def block_started(self, index: int, tensors, resident=frozenset()) -> list:
        """The block's inputs that an earlier block had: [[bytes, saver or -1, [users]], ...]; a
        storage in ``resident`` (parameters, the model's inputs: never on the ledger) as
        [bytes, RESIDENT_INPUT, []]."""
        shared, keys = self._held(tensors, resident, index)
        self.running_inputs[index] = keys
        return shared

    def held_before(self, tensors, resident=frozenset()) -> list:
        """As `block_started`'s answer, for a module that is no block (a segment around blocks,
        `profile.profile.SegmentProfile`): its inputs are recorded nowhere, so the blocks after it
        do not count it among their users."""
        return self._held(tensors, resident, None)[0]

    def _held(self, tensors, resident, index: int | None) -> tuple[list, set]:
        """(the inputs an earlier block had, their storages); ``index``: the block whose inputs these
        are, recorded as a user of each (None: nothing recorded)."""
        shared, keys = [], set()
        for tensor in tensors:
            if not has_storage(tensor):
                continue
            key = self.key_of(tensor)
            if key in keys:
                continue
            keys.add(key)
            if key in resident:
                shared.append([tensor.untyped_storage().nbytes(), RESIDENT_INPUT, []])
                continue
            saver = self._alive(self.saved_by, key)
            blocks_in = self._alive(self.input_of, key)
            users = [user for user in blocks_in or [] if user != index]
            if saver not in (None, index) or users:
                shared.append([tensor.untyped_storage().nbytes(), -1 if saver in (None, index) else saver, users])
            if index is None:
                continue
            if blocks_in is None:
                blocks_in = []
                self.input_of[key] = (StorageWeakRef(tensor.untyped_storage()), blocks_in)
            if index not in blocks_in:
                blocks_in.append(index)
        return shared, keys

    def block_finished(self, index: int) -> None:
        self.running_inputs.pop(index, None)

    def saved(self, index: int, tensor) -> bool:
        """A storage ``index`` saved first: remembered; whether it is one of that block's inputs."""
        key = self.key_of(tensor)
        if self._alive(self.saved_by, key) is None:
            self.saved_by[key] = (StorageWeakRef(tensor.untyped_storage()), index)
        return key in self.running_inputs.get(index, ())
