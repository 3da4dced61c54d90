"""Static bytes (parameters, gradients, optimizer state, buffers, inputs): how many, where each
lives, and the decisions that move them: the optimizer step in backward (gradients freed as they
are used, `oomless.runtime.update_in_backward`). Each decision is forceable by the user and printed
with its reason.
"""

from oomless.errors import InputError
from oomless.runtime.optimizer_slices import NOT_SLICEABLE


def choose_update_in_backward(requested: bool | None, optimizer, max_grad_norm: float | None,
                              accumulation_steps: int) -> tuple[bool, str]:
    """Whether the plan steps the optimizer in backward, and why (a line for the plan's notes)."""
    if requested not in (None, True, False):
        raise InputError(f"update_in_backward must be True, False or None (the planner decides), got {requested!r}")
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise InputError(f"accumulation_steps must be a positive int (micro-batches per optimizer step), "
                         f"got {accumulation_steps!r}")
    if requested is False:
        return False, "update in backward: off (given by the user)"
    blocker = _why_not(optimizer, max_grad_norm)
    if requested is True:
        if blocker is not None:
            raise InputError(f"update_in_backward=True is not possible: {blocker}; use update_in_backward=None "
                             "(the planner then keeps the update after backward) or False")
        return True, "update in backward: on (given by the user)"
    if blocker is not None:
        return False, f"update in backward: off ({blocker})"
    return False, "update in backward: off (the planner does not choose it yet; force it with update_in_backward=True)"


def _why_not(optimizer, max_grad_norm: float | None) -> str | None:
    if optimizer is None:
        return "it steps the optimizer, and none was given (pass optimizer=)"
    if isinstance(optimizer, NOT_SLICEABLE):
        return f"{type(optimizer).__name__} steps every parameter at once"
    if max_grad_norm is not None:
        return ("clipping by global norm (max_grad_norm) needs every gradient before the first update, and in "
                "backward each parameter is updated as soon as its own gradient is ready")
    return None
