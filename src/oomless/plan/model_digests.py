"""Which model a plan was made for: one short digest per block of its parameters' and buffers' names,
shapes and dtypes, and one for those outside every block (`Plan.model_digests`). A plan applied to
another model with the same block names (a wider layer, another vocabulary, a deeper stage) would run
with budgets, limits and predicted times measured on the first one: `check_same_model` refuses it
and names the first block that differs."""

import hashlib
from collections.abc import Iterable

from torch import nn

from oomless.errors import ApplyError

OUTSIDE_BLOCKS = ""     # the key of the digest of what no block holds (embeddings, a head outside the blocks)


def _digest(entries: list[tuple[str, tuple, str]]) -> str:
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:16]


def _tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def _entry(name: str, tensor) -> tuple[str, tuple, str]:
    return name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")


def model_digests(model: nn.Module, block_names: Iterable[str]) -> dict[str, str]:
    """{block name: digest of its tensors, OUTSIDE_BLOCKS: digest of the rest}; a name that is no
    module of ``model`` gets none."""
    modules = dict(model.named_modules())
    digests, in_blocks = {}, set()
    for name in block_names:
        module = modules.get(name)
        if module is None:
            continue
        entries = []
        for tensor_name, tensor in _tensors(module):
            entries.append(_entry(tensor_name, tensor))
            in_blocks.add(id(tensor))
        digests[name] = _digest(entries)
    digests[OUTSIDE_BLOCKS] = _digest([_entry(name, tensor) for name, tensor in _tensors(model)
                                       if id(tensor) not in in_blocks])
    return digests


def _shapes(module: nn.Module, in_blocks: set[int] | None = None, limit: int = 4) -> str:
    """A few of ``module``'s tensors as "name 128x64 float32", for the refusal."""
    entries = [_entry(name, tensor) for name, tensor in _tensors(module)
               if in_blocks is None or id(tensor) not in in_blocks]
    shown = ", ".join(f"{name} {'x'.join(map(str, shape)) or 'scalar'} {dtype}" for name, shape, dtype in entries[:limit])
    return (shown or "no parameters or buffers") + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def check_same_model(planned: dict[str, str] | None, model: nn.Module) -> None:
    """Raise ApplyError where ``model``'s tensors differ from those the plan was made with
    (``planned``: `Plan.model_digests`; None, a plan written before them: nothing to compare)."""
    if not planned:
        return
    blocks = [name for name in planned if name != OUTSIDE_BLOCKS]
    modules = dict(model.named_modules())
    if any(name not in modules for name in blocks):
        return      # installing says which blocks this model does not have, the plainer refusal
    now = model_digests(model, blocks)
    again = "make a plan for this model: oomless.plan(model, example_inputs, memory)"
    for name in blocks:
        if now[name] != planned[name]:
            module = modules[name]
            raise ApplyError(f"this plan was made for another model: block {name!r} ({type(module).__name__}) "
                             f"has other parameters or buffers than when it was planned (now {_shapes(module)}), so "
                             f"the plan's budgets and times are not this model's; {again}")
    if now[OUTSIDE_BLOCKS] != planned.get(OUTSIDE_BLOCKS, now[OUTSIDE_BLOCKS]):
        in_blocks = {id(tensor) for name in blocks for _, tensor in _tensors(modules[name])}
        raise ApplyError("this plan was made for another model: the parameters and buffers outside its blocks "
                         f"differ from those it was planned with (now {_shapes(model, in_blocks)}), so its "
                         f"static bytes are not this model's; {again}")
