"""The optimizer's step after backward as a phase of the step: its temporaries, and the state it brings in.

After backward the user's ``optimizer.step()`` runs with every gradient on the device. Besides the
static bytes the plan counts, it makes temporaries of its parameters' size, from torch 2.13's
torch/optim/adam.py and sgd.py:
- Adam and AdamW, one tensor at a time (torch's default on CPU): ``(exp_avg_sq.sqrt() /
  bias_correction2_sqrt)`` holds two tensors of a parameter's size at once; Adam's L2 weight decay
  adds ``grad.add(param)``, a third;
- with ``foreach`` (torch's default on CUDA): ``torch._foreach_sqrt`` over a whole parameter group,
  one tensor per parameter at once (Adam's weight decay: one more per parameter); ``fused=True``: none;
- SGD: ``grad.add(param)`` for weight decay and ``grad.add(buf)`` for Nesterov momentum, one each.
Other optimizers: not counted (the plan's margin covers what it can).
With the optimizer state off the device and the update after backward (`runtime.offload_state`),
the step runs one parameter at a time: its temporaries are one parameter's, and the state on the
device is the stepped parameter's and the prefetched next one's, where the static bytes count three
modules' at once.

Measured on the CPU machine (Hugging Face GPT-2 without its head, vocabulary 50,257, Adam, its state
off the device): the step rose 178 MiB above the end of backward (the tied embedding's 98 MiB of
state mapped in, its temporaries) and set the step's peak, 78 MiB above backward's; unmodelled, the
plan predicted 279 MiB for 318 measured.
"""

from oomless.profile.profile import Profile

_ADAM = ("Adam", "AdamW")


def _temporary_copies(optimizer, group: dict, foreach: bool) -> tuple[int, int]:
    """(copies of the largest parameter, copies of every parameter of the call) one call of
    ``optimizer``'s step makes at once for ``group``'s settings."""
    name = type(optimizer).__name__
    if group.get("fused"):
        return 0, 0
    if name in _ADAM:
        decay = 1 if name == "Adam" and group.get("weight_decay", 0) else 0
        return (0, 1 + decay) if foreach else (2 + decay, 0)
    if name == "SGD":
        extra = (1 if group.get("weight_decay", 0) else 0) + (1 if group.get("nesterov") else 0)
        return (0, extra) if foreach else (extra, 0)
    return 0, 0


def _trainable(optimizer) -> list:
    return [parameter for group in optimizer.param_groups for parameter in group["params"] if parameter.requires_grad]


def step_temporary_bytes(optimizer, profile: Profile, one_parameter_at_a_time: bool, shard_over: int = 1) -> int:
    """The most bytes ``optimizer``'s step after backward makes beyond its state at once (module
    docstring), in the profile's bytes (a target's dtype applies); sharded over ``shard_over`` ranks
    (FSDP2 steps each rank's shards), a rank's."""
    if optimizer is None:
        return 0
    elements = sum(parameter.numel() for parameter in _trainable(optimizer))
    if not elements:
        return 0
    per_element = profile.gradient_bytes / elements / shard_over
    default_foreach = not profile.device.startswith("cpu")      # torch's default: foreach on accelerators
    most = 0
    for group in optimizer.param_groups:
        params = [parameter for parameter in group["params"] if parameter.requires_grad]
        if not params:
            continue
        foreach = group.get("foreach")
        foreach = default_foreach if foreach is None else bool(foreach)
        largest, every = _temporary_copies(optimizer, group, foreach)
        biggest = max(parameter.numel() for parameter in params)
        # Stepped one parameter at a time, a call's parameters are one.
        total = biggest if one_parameter_at_a_time else sum(parameter.numel() for parameter in params)
        most = max(most, largest * biggest + every * total)
    return int(most * per_element)


def optimizer_step_other_bytes(optimizer, profile: Profile, offload_state: bool, state_counted_bytes: int,
                               shard_over: int = 1) -> int:
    """What the step after backward holds beyond the static bytes counted: its temporaries and, with
    the state off the device, the state it brings in less ``state_counted_bytes`` (negative where
    the static bytes count more than the step holds). ``profile``: as measured (every static byte)."""
    other = step_temporary_bytes(optimizer, profile, offload_state, shard_over)
    if offload_state and optimizer is not None:
        trainable = _trainable(optimizer)
        elements = sum(parameter.numel() for parameter in trainable)
        if elements:
            largest_two = sorted((parameter.numel() for parameter in trainable), reverse=True)[:2]
            # The parameter stepped and the next one prefetched: at most the two largest's state.
            during = profile.optimizer_state_bytes * sum(largest_two) / elements
            other += int(during) - state_counted_bytes
    return other

