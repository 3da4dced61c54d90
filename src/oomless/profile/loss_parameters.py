"""Parameters a loss function reads itself, counted in a profile for the layouts `oomless.simulate`
predicts.

    profile = with_loss_parameters(profile, body, loss_fn, dtype)

A language model's head fused with its loss (``oomless plan/simulate --loss fused-next-token``:
the Hugging Face model's ``base_model`` profiled, `oomless.linear_cross_entropy` reading the head's
weight in the loss) holds a weight that is the model's all the same: the optimizer steps it, dp
all-reduces its gradient, fsdp shards it, and a pipeline's last stage, which runs the loss, holds it.
A profile of the module alone misses it where it is not one of the module's own parameters (an
untied head, Llama's ``lm_head``), and places it nowhere near the loss where it is (GPT-2's head,
tied to the token embedding). Here:

- a parameter the loss reads that is not the module's: its bytes, its gradient's and its optimizer
  state (the profile's state bytes per gradient byte) are added to the static totals;
- every parameter the loss reads, the module's or not, is added to the last block's parameter
  bytes (unless that block holds it already): a pipeline's last stage runs the loss and holds what
  it reads (a tied weight then on the first stage too, as the trainer's pipelines keep a copy of a
  parameter two stages use, `parallel.pipeline`); dp's gradient buckets and fsdp's gathers split the
  totals over the blocks by their parameter bytes (`plan.layouts._block_shares`), so they count it
  at the end of the forward and the start of the backward, where the loss reads it.
"""

from dataclasses import replace

import torch.nn as nn

from oomless.profile.profile import Profile
from oomless.profile.repeated import cast_bytes
from oomless.profile.tensors import parameters_read_by


def with_loss_parameters(profile: Profile, model: nn.Module, loss_fn, dtype=None) -> Profile:
    """``profile`` of ``model`` with the parameters ``loss_fn`` reads itself counted (module
    docstring); ``dtype``: the dtype the profile cast parameters to (None: their own)."""
    own, others = parameters_read_by(loss_fn, model)
    if not (own or others) or not profile.blocks:
        return profile
    last = profile.blocks[-1]
    try:
        in_last = {id(parameter) for parameter in model.get_submodule(last.name).parameters()}
    except AttributeError:          # a block that is no submodule's name: it holds none of them
        in_last = set()
    to_last = [parameter for parameter in [*own.values(), *others] if id(parameter) not in in_last]
    gradient_bytes = cast_bytes([parameter for parameter in others if parameter.requires_grad], dtype)
    state_per_gradient_byte = profile.optimizer_state_bytes / profile.gradient_bytes if profile.gradient_bytes else 0.0
    described = [*(f"the model's {name}" for name in own),
                 *(f"a {tuple(parameter.shape)} one of its own" for parameter in others)]
    note = (f"parameters the loss reads itself ({', '.join(described)}) are counted with the model's"
            f"{' (bytes, gradients and optimizer state added)' if others else ''} and held with its last "
            f"block ({last.name}): a pipeline's last stage runs the loss")
    return replace(
        profile, blocks=[*profile.blocks[:-1], replace(last, parameter_bytes=last.parameter_bytes
                                                       + cast_bytes(to_last, dtype))],
        parameter_bytes=profile.parameter_bytes + cast_bytes(others, dtype),
        gradient_bytes=profile.gradient_bytes + gradient_bytes,
        optimizer_state_bytes=profile.optimizer_state_bytes + round(gradient_bytes * state_per_gradient_byte),
        notes=[*profile.notes, note])
