"""A recompute runs the block as its call ran it, not as the module stands in backward.

Three things a call read that may have changed, or run again, by the time backward recomputes it
(each silently wrong before, or torch's CheckpointError):
- the forward pre-hooks that ran before the plan's own, outside the checkpoint: the module's own
  from before the plan (an input transform; the hook-based ``nn.utils.weight_norm`` and
  ``spectral_norm``, which compute the weight in a pre-hook) and the global ones
  (``register_module_forward_pre_hook``). Their results are the call's (its arguments, the weight
  from the graph outside the block); run again, an input transform applied twice and the weight was
  computed again inside the checkpoint. The recompute runs without them (the global ones for the
  block's own call only: the modules inside it ran them inside the checkpoint, and do again);
- the block module's attributes (that weight, set by the hook; a scale or a length another pre-hook
  sets for the call): a later call (the module called twice, two forwards before one backward) sets
  its own, spectral norm's weight with its power iteration one step on: the recompute reads the
  call's (the public ones, but ``training``; by identity);
- its modules' parameters: ``torch.func.functional_call`` (MAML's fast weights) puts them in for
  the forward and the module's own back after it, before backward recomputes: the recompute reads
  the call's.
Buffers, whose values a forward changes, are `runtime.recompute_buffers`'.
"""

from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch.nn.modules import module as torch_module

_MISSING = object()
_RESTORE_ID = -1    # a hook id no handle takes (handles count from 0)


class CallState:
    """One call's attributes and parameters (the module docstring), taken where the plan's pre-hook
    runs, after the outer pre-hooks."""

    __slots__ = ("module", "pre_hook_id", "attributes", "parameters")

    def __init__(self, module: torch.nn.Module, pre_hook_id: int | None):
        self.module, self.pre_hook_id = module, pre_hook_id
        self.attributes = {name: value for name, value in module.__dict__.items()
                           if not name.startswith("_") and name != "training"}
        self.parameters = [(sub, name, parameter) for sub in module.modules()
                           for name, parameter in sub._parameters.items() if parameter is not None]

    @contextmanager
    def as_called(self):
        """For the recompute's call of the module: the call's attributes and parameters in place,
        the outer pre-hooks out; everything as it was after."""
        module = self.module
        attributes = {name: module.__dict__.get(name, _MISSING) for name, value in self.attributes.items()
                      if module.__dict__.get(name, _MISSING) is not value}
        parameters = [(sub, name, sub._parameters.get(name), parameter) for sub, name, parameter in self.parameters
                      if sub._parameters.get(name) is not parameter]
        hooks, global_hooks = module._forward_pre_hooks, torch_module._global_forward_pre_hooks
        inner = self._inner_pre_hooks(hooks, global_hooks)
        module.__dict__.update({name: self.attributes[name] for name in attributes})
        for sub, name, _, called in parameters:
            sub._parameters[name] = called
        if inner is not None:
            module._forward_pre_hooks = inner
        if global_hooks:
            torch_module._global_forward_pre_hooks = OrderedDict()
        try:
            yield
        finally:
            module._forward_pre_hooks = hooks
            torch_module._global_forward_pre_hooks = global_hooks
            for sub, name, now, _ in parameters:
                sub._parameters[name] = now
            for name, value in attributes.items():
                if value is _MISSING:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value

    def _inner_pre_hooks(self, hooks: OrderedDict, global_hooks: OrderedDict) -> OrderedDict | None:
        """The module's pre-hooks without those before the plan's (oomless's own kept), and, where
        there are global ones, first a hook that puts them back for the calls inside the block
        (torch read them for this call before running the module's own); None: as they are."""
        outer = []
        if self.pre_hook_id in hooks:
            for hook_id, hook in hooks.items():
                if hook_id == self.pre_hook_id:
                    break
                if not (getattr(hook, "__module__", None) or "").startswith("oomless."):
                    outer.append(hook_id)
        if not outer and not global_hooks:
            return None
        inner = OrderedDict((hook_id, hook) for hook_id, hook in hooks.items() if hook_id not in outer)
        if global_hooks:
            def put_back_global_hooks(module, args):
                torch_module._global_forward_pre_hooks = global_hooks
            inner = OrderedDict([(_RESTORE_ID, put_back_global_hooks), *inner.items()])
        return inner
