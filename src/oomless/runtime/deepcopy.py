"""``copy.deepcopy`` of a model oomless is applied to: the copy is the model as it was before
`oomless.apply`, so that an exponential moving average of the weights (torch's
``swa_utils.AveragedModel``, timm's ``ModelEmaV2``), a mean teacher or a snapshot for evaluation
copy the model as they would without oomless.

    model = oomless.fit(model, volumes, "8GiB", loss_fn=loss_fn, optimizer=optimizer)
    ema = torch.optim.swa_utils.AveragedModel(model)      # a deepcopy: plain, its own weights
    oomless.apply(copy.deepcopy(model), oomless.installed_plan(model))   # a copy trained under the plan

Without this, the copy's hooks were the original's closures (copy leaves functions shared), which
would run the original's saved-tensor engine for the copy's forward; and deepcopy failed before
that, on the transfer tier's queue ("cannot pickle '_queue.SimpleQueue' object"). The plan's
hooks and state are copied only as far as `oomless.remove` needs to take them off the copy
(`InstalledPlan.__deepcopy__`). A plan that steps the optimizer itself (update in backward,
optimizer state or parameters off the device, fp16 loss scaling) is tied to that optimizer's
parameters: its model refuses to be copied, saying how to copy it.
"""

import copy

import torch.nn as nn

from oomless.errors import ApplyError

_COPIER = "__deepcopy__"     # looked up on the instance by copy.deepcopy


def allow_deepcopy(model: nn.Module, remove, optimizer_bound: bool) -> None:
    """Make ``copy.deepcopy(model)`` return the copy with ``remove`` (`oomless.remove`) applied to it;
    ``optimizer_bound``: refuse instead (module docstring)."""

    def deepcopy_without_oomless(memo: dict) -> nn.Module:
        if optimizer_bound:
            raise ApplyError(
                "copy.deepcopy of a model whose oomless plan steps its optimizer (update in backward, optimizer "
                "state or parameters off the device, or fp16 loss scaling): the copy's parameters are not the "
                "optimizer's. Copy the model before oomless.apply, or oomless.remove(model), copy it, and apply "
                "the plan again (oomless.apply(model, plan, optimizer=...))")
        # The plan's hooks are copied into the copy's hook tables only to be taken off it: left as
        # they are, not deep-copied (a recompute block's hook is a method of an object holding the
        # engine and its transfer tier, which do not copy).
        for hook in _plan_hooks(model):
            memo[id(hook)] = hook
        copier = model.__dict__.pop(_COPIER)
        try:
            copied = copy.deepcopy(model, memo)
        finally:
            object.__setattr__(model, _COPIER, copier)
        return remove(copied)

    object.__setattr__(model, _COPIER, deepcopy_without_oomless)


def _plan_hooks(model: nn.Module) -> list:
    """The hook functions oomless registered on ``model``'s modules: its plan's and its precision's."""
    from oomless.runtime.install import installed_state
    from oomless.runtime.precision import precision_state

    hooks = []
    for state in (installed_state(model), precision_state(model)):
        for handle in getattr(state, "handles", None) or []:
            table = handle.hooks_dict_ref()
            if table is not None and handle.id in table:
                hooks.append(table[handle.id])
    return hooks


def forget_deepcopy(model: nn.Module) -> None:
    """Undo `allow_deepcopy`: the model copies as plain PyTorch does."""
    model.__dict__.pop(_COPIER, None)
