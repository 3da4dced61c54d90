"""Choose the blocks of a model: the units a plan decides keep / swap / recompute for.

Default policy: the repeated children of the model (the items of every `Sequential`, `ModuleList`
or `ModuleDict` child, the stages of a U-Net) plus its other children; a wrapper with a single child
is looked through, and a block holding more than half of all parameters is split into its own
children while it has any. A chain computed in slabs (`runtime.split`) is never looked into: its
children do not run. Users override with ``blocks=``: module types, or qualified names.
"""

from collections.abc import Iterable

import torch.nn as nn

from oomless.errors import InputError
from oomless.runtime.split import is_split
from oomless.runtime.stream import outer_modules

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def children_as_blocks(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks = []
    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _CONTAINERS) and len(child) > 0 and not is_split(child):
            blocks.extend(children_as_blocks(qualified, child))
        else:
            blocks.append((qualified, child))
    return blocks


def _default_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    prefix, root = "", model
    while len(list(root.children())) == 1:
        name, root = next(iter(root.named_children()))
        prefix = f"{prefix}.{name}" if prefix else name
    blocks = children_as_blocks(prefix, root)
    if not blocks:
        return [(prefix, root)] if prefix else []
    total = max(_parameter_count(model), 1)
    # Split a block that dominates the parameters: its activations likely dominate too, and one
    # giant block leaves the planner nothing to choose between.
    for _ in range(8):
        index, (name, module) = max(enumerate(blocks), key=lambda item: _parameter_count(item[1][1]))
        if (_parameter_count(module) * 2 <= total or len(blocks) >= 4 or not list(module.children())
                or is_split(module)):
            break
        blocks[index:index + 1] = children_as_blocks(name, module)
    return blocks


def batchnorm_channels(module: nn.Module) -> list[int]:
    """The channels of every BatchNorm layer in ``module`` (itself included), in module order."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [layer.num_features for layer in module.modules() if isinstance(layer, _BatchNorm)]


def _selected_blocks(model: nn.Module, spec: Iterable) -> list[tuple[str, nn.Module]]:
    types = tuple(item for item in spec if isinstance(item, type))
    names = {item for item in spec if isinstance(item, str)}
    modules = dict(model.named_modules())
    missing = sorted(names - modules.keys())
    if missing:
        raise InputError(f"blocks= names {missing} are not modules of the model; "
                         f"qualified names look like {list(modules)[1:4]}")
    chosen, covered = [], set()
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer in covered):
            continue  # nested inside a block already chosen: blocks never overlap
        if name in names or (types and isinstance(module, types) and module is not model):
            chosen.append((name, module))
            covered.add(name)
    if not chosen:
        raise InputError(f"blocks={list(spec)!r} matched no module of the model")
    return chosen


def _first_names(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """One entry per module: a module registered under several names (MONAI's SegResNet keeps its
    activation as ``act_mod`` and inside ``conv_final``) is one block, under its first name, the
    one ``model.named_modules()`` gives."""
    seen, unique = set(), []
    for name, module in found:
        if id(module) not in seen:
            seen.add(id(module))
            unique.append((name, module))
    return unique


def find_blocks(model: nn.Module, blocks: Iterable | None = None) -> list[tuple[str, nn.Module]]:
    """Return ``[(qualified name, module)]`` in registration order; blocks never nest."""
    found = _first_names(_default_blocks(model) if blocks is None else _selected_blocks(model, list(blocks)))
    # A streamed model's outer level runs its modules' ops itself, in slabs: they are no blocks.
    outer = outer_modules(model)
    found = [(name, module) for name, module in found
             if not any(name == other or name.startswith(other + ".") or other.startswith(name + ".") for other in outer)]
    if not found:
        raise InputError("the model has no child modules to use as blocks; pass blocks=[...] "
                         "naming the modules whose activations should be planned")
    split = [name for name, module in model.named_modules() if is_split(module)]
    inside = [(name, outer) for name, _ in found for outer in split if name.startswith(outer + ".")]
    if inside:
        raise InputError(f"block {inside[0][0]} lies inside {inside[0][1]}, which is computed in slabs "
                         f"(its children do not run); name {inside[0][1]} or a module around it as the block, "
                         "or plan with split=False")
    return found


def segment_modules(model: nn.Module, found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Modules around two or more of the blocks ``found`` and no part of any (each under its first
    name), the model itself and a module around every block left out: the units a plan may
    recompute as one (`profile.profile.SegmentProfile`). Outermost first, in registration order."""
    block_names = [name for name, _ in found]
    block_ids = {id(module) for _, module in found}
    chosen, seen = [], set()
    for name, module in model.named_modules():
        if not name or id(module) in seen or id(module) in block_ids:
            continue
        seen.add(id(module))
        inner = sum(block.startswith(name + ".") for block in block_names)
        if 2 <= inner < len(block_names):
            chosen.append((name, module))
    return chosen
