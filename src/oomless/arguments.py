"""Checks of the public functions' arguments (`oomless.plan`, `fit`, `profile`, `apply`, `remove`,
`stats`), made before anything runs: a wrong type or value reads as one `InputError` saying what
works, instead of an AttributeError from deep inside profiling, and the model is left untouched."""

import torch
from torch import nn

from oomless.errors import InputError
from oomless.profile.tensors import parameters_read_by, tensors_in

DECISIONS = ("keep", "swap", "recompute")
SOLVERS = ("auto", "greedy", "exact")      # plan/planner.py's choices, checked here before profiling


def check_model(model, function: str) -> None:
    if not isinstance(model, nn.Module):
        raise InputError(f"oomless.{function} takes a torch.nn.Module as its model, got {type(model).__name__}")


def check_example_inputs(example_inputs) -> None:
    if not tensors_in(example_inputs):
        raise InputError(f"example_inputs holds no tensor (got {type(example_inputs).__name__}); pass what the "
                         "model's forward takes: a tensor, a tuple or list of positional inputs, or a dict of "
                         "keyword inputs")


def check_loss_fn(loss_fn) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be a callable(output) -> scalar tensor, got {type(loss_fn).__name__}; "
                         "e.g. loss_fn=oomless.sum_of_outputs")


def check_optimizer(optimizer, model: nn.Module) -> None:
    if optimizer is None:
        return
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        raise InputError(f"optimizer must be an instance, e.g. optimizer={optimizer.__name__}(model.parameters()), "
                         f"not the class {optimizer.__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(f"optimizer must be a torch.optim.Optimizer (e.g. torch.optim.Adam(model.parameters())), "
                         f"got {type(optimizer).__name__}")
    parameters = {id(parameter) for parameter in model.parameters()}
    if parameters and not any(id(parameter) in parameters for group in optimizer.param_groups
                              for parameter in group["params"]):
        raise InputError("optimizer holds none of the model's parameters: build it on this model's "
                         "model.parameters()")


def normalize_blocks(blocks):
    """``blocks`` as a list: one name or module type alone is accepted as a list of one."""
    if blocks is None:
        return None
    if isinstance(blocks, (str, type)):
        return [blocks]
    try:
        listed = list(blocks)
    except TypeError:
        raise InputError(f"blocks must be a list of module names or types (e.g. blocks=['encoder.0', nn.Conv3d]), "
                         f"got {type(blocks).__name__}") from None
    wrong = [item for item in listed if not isinstance(item, (str, type))]
    if wrong:
        raise InputError(f"blocks must name modules by qualified name or by type, got {wrong[:3]!r}")
    return listed


def check_decisions(decisions) -> None:
    if decisions is None:
        return
    if not isinstance(decisions, dict):
        raise InputError(f"decisions must be a dict {{block name: {' | '.join(DECISIONS)}}}, "
                         f"got {type(decisions).__name__}")


def check_min_swap_bytes(min_swap_bytes) -> int:
    if isinstance(min_swap_bytes, bool) or not isinstance(min_swap_bytes, int) or min_swap_bytes < 0:
        raise InputError(f"min_swap_bytes must be a non-negative int (bytes), got {min_swap_bytes!r}")
    return min_swap_bytes


def check_dtype(dtype, target) -> None:
    if dtype is None:
        return
    if target is None:
        raise InputError("dtype applies with target= (planning on meta tensors for another device); without a "
                         "target, cast the model and inputs yourself")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")


def check_solver(solver) -> None:
    if solver not in SOLVERS:
        raise InputError(f"solver must be one of {', '.join(map(repr, SOLVERS))}, got {solver!r}")


def check_profile(profile) -> None:
    from oomless.profile.profile import Profile

    if profile is not None and not isinstance(profile, Profile):
        raise InputError(f"profile must be an oomless Profile from oomless.profile(...), got {type(profile).__name__}")


def check_plan_arguments(model, example_inputs, loss_fn, optimizer, blocks, decisions, min_swap_bytes, profile,
                         dtype, target, solver="auto", function: str = "plan"):
    """Every check `oomless.plan` needs; returns ``blocks`` as a list (or None)."""
    check_model(model, function)
    check_solver(solver)
    check_example_inputs(example_inputs)
    check_loss_fn(loss_fn)
    check_optimizer(optimizer, model)
    check_decisions(decisions)
    check_min_swap_bytes(min_swap_bytes)
    check_dtype(dtype, target)
    check_profile(profile)
    return normalize_blocks(blocks)


def check_fp16_loss_parameters(precision: str, loss_fn, model: nn.Module) -> None:
    """fp16 refused where the loss reads a trainable parameter itself (the model's, or one outside
    it such as an untied head's weight)."""
    if precision != "fp16":
        return
    own, others = parameters_read_by(loss_fn, model)
    trainable_read = [*(name for name, parameter in own.items() if parameter.requires_grad),
                      *(f"a {tuple(parameter.shape)} parameter outside the model" for parameter in others
                        if parameter.requires_grad)]
    if trainable_read:
        # The loss scale is applied where the model's outputs leave it (`runtime.precision`): a
        # parameter the loss reads itself gets its share of the gradient unscaled, then divided by it.
        raise InputError(f"precision='fp16': the loss function reads the model's {', '.join(trainable_read[:3])} "
                         "itself (a head's weight in oomless.linear_cross_entropy?), whose gradient the loss "
                         "scale would not reach; use precision='bf16' (no loss scale), or read it inside the model")
