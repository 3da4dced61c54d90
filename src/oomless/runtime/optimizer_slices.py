"""A slice of the user's optimizer: one ``torch.optim`` optimizer of the user's own class over some of
its parameters, with the user's param-group settings and the user's state dict. The overlapped
data-parallel update steps one slice per gradient bucket (`oomless.parallel.overlap`); the update in
backward one module's parameters at a time (`oomless.runtime.update_in_backward`, `step_only`) through
one slice per param group: an optimizer object per parameter cost ~3 KiB of host memory each (its hook
dictionaries and group), which on a CPU run is the budget's memory too.

Why a slice steps bit for bit as the user's optimizer: every ``torch.optim`` optimizer whose state is
per parameter (SGD, Adam, AdamW, RMSprop, Adagrad, NAdam, ...) computes each parameter on its own, in
the implementation (single-tensor, foreach or fused) chosen from the tensors' device and dtype, which
a subset of the same tensors picks the same way. So a step over a subset is the full step restricted
to it. Optimizers that need every parameter at once (LBFGS's closure and flat direction) are refused.

How it is built: the user's class, called with the constructor arguments it accepts from the user's
``defaults``. Not ``cls(groups, **defaults)``: ``defaults`` may hold keys the constructor does not
take (torch's AdamW records ``decoupled_weight_decay=True`` but its ``__init__`` has no such argument),
and every group carries all its settings anyway. The slice's groups copy the user's groups' settings
(by group index: ``load_state_dict`` replaces the group dicts) before every step, so a learning-rate
scheduler or a hand-changed setting applies exactly as to the user's optimizer.
"""

import inspect

import torch
from torch import nn

from oomless.errors import InputError

# Optimizers whose step needs all parameters together: a slice would compute something else.
NOT_SLICEABLE = (torch.optim.LBFGS,)


def _constructor_arguments(optimizer_class: type, defaults: dict) -> dict:
    parameters = inspect.signature(optimizer_class.__init__).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key in parameters}


def group_index_of(optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, int]:
    """Each parameter the optimizer holds -> the index of its param group."""
    return {param: index for index, group in enumerate(optimizer.param_groups) for param in group["params"]}


def check_sliceable(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, NOT_SLICEABLE):
        raise InputError(f"{type(optimizer).__name__} needs every parameter in one step (a closure over the "
                         "whole model), so its update cannot be split per parameter or per bucket; use an "
                         "optimizer with per-parameter state (SGD, Adam, AdamW, RMSprop, ...)")


class OptimizerSlice:
    """The user's optimizer restricted to ``parameters`` (those it does not hold are left out)."""

    def __init__(self, user_optimizer: torch.optim.Optimizer, parameters, group_of: dict[nn.Parameter, int],
                 share_state: bool = True):
        check_sliceable(user_optimizer)
        self.user_optimizer = user_optimizer
        self.parameters = [param for param in parameters if param in group_of]
        by_group: dict[int, list[nn.Parameter]] = {}
        for param in self.parameters:
            by_group.setdefault(group_of[param], []).append(param)
        self.group_indices = sorted(by_group)
        self._by_group = by_group
        self._group_position = {param: position for position, index in enumerate(self.group_indices)
                                for param in by_group[index]}
        self.optimizer: torch.optim.Optimizer | None = None
        if not self.parameters:
            return
        optimizer_class = type(user_optimizer)
        groups = [{**self._settings(index), "params": by_group[index]} for index in self.group_indices]
        try:
            self.optimizer = optimizer_class(groups, **_constructor_arguments(optimizer_class, user_optimizer.defaults))
        except TypeError as error:
            raise InputError(f"could not build a {optimizer_class.__name__} over part of the parameters from its "
                             f"defaults {sorted(user_optimizer.defaults)}: {error}. oomless splits the update "
                             "with the optimizer's own class; its constructor must accept its defaults") from error
        # Groups the slice never adds would fill from these; sharing them also keeps checks that read
        # ``defaults`` (capturable, differentiable) answering as for the user's optimizer.
        self.optimizer.defaults = user_optimizer.defaults
        # ``share_state=False``: a step that must not touch the user's state keeps what the constructor
        # made (Adagrad fills each parameter's there; torch 2.11's steps need it), as
        # `plan.static.per_parameter_step_seconds` times one. Shared, that is dropped (not held twice).
        if share_state:
            self.optimizer.state = user_optimizer.state

    def _settings(self, group_index: int) -> dict:
        group = self.user_optimizer.param_groups[group_index]
        return {key: value for key, value in group.items() if key != "params"}

    def read_settings(self) -> None:
        """Copy the user's group settings and state dict, as they are now."""
        if self.optimizer is None:
            return
        for group, index in zip(self.optimizer.param_groups, self.group_indices):
            group.update(self._settings(index))
        # optimizer.load_state_dict gives the user's optimizer a new state dict: share that one.
        self.optimizer.state = self.user_optimizer.state

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def step_only(self, params: list[nn.Parameter]) -> None:
        """Step ``params`` alone, some of this slice's parameters: for the call the optimizer holds
        only their groups, each group's parameter list only its share of ``params``, which is the step
        of a slice over those parameters alone (the slice's other parameters may hold gradients still
        accumulating)."""
        share: dict[int, list[nn.Parameter]] = {}
        for param in params:
            position = self._group_position.get(param)
            if position is None:
                raise KeyError(f"not a parameter of this slice: {tuple(param.shape)}")
            share.setdefault(position, []).append(param)
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [groups[position] for position in sorted(share)]
        for position, chosen in share.items():
            groups[position]["params"] = chosen
        try:
            self.optimizer.step()
        finally:
            for position in share:
                groups[position]["params"] = self._by_group[self.group_indices[position]]
            self.optimizer.param_groups = groups
