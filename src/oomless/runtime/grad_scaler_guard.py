"""fp16: refuse a training loop that keeps its own ``torch.amp.GradScaler`` on a model whose loss
oomless already scales (`oomless.runtime.precision`, ``precision="fp16"``).

A loop written for plain AMP, ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``,
multiplies the loss by the GradScaler's scale on top of oomless's (2**16 x 2**16 by default). The
fp16 backward overflows, the GradScaler skips ``optimizer.step()`` (so oomless's step hooks never run
and its own scale never backs off) and halves its scale; the weights stay put until the product fits
while ``oomless.stats`` counts no skipped step (a 32-64-4 MLP on CPU: the first 13 steps skipped, the
GradScaler's scale 65536 down to 8). The guard raises `InputError` at that loop's first step instead:

- A GradScaler that does call ``optimizer.step()`` is on the Python stack of the step pre-hook
  (`grad_scaler_stepping`): a walk over a few frames per step, no heap search.
- A step the GradScaler skips calls no hook of ours. Until the optimizer's first step, one parameter's
  gradient (the smallest trainable one the optimizer holds) is watched: a forward that finds the
  gradient of the previous backward dropped or zeroed (``zero_grad``) with no ``optimizer.step()``
  between is the next iteration of a loop whose step was skipped. If an enabled GradScaler that has
  scaled a loss exists (`grad_scaler_in_use`: one walk over the heap, 0.03 to 0.08 s with torch and
  transformers loaded, at most once per model) the forward is refused. Gradient accumulation keeps
  the gradients between micro-batches, so it never matches; a loop without a GradScaler (a saliency
  pass that drops the gradients, say) is left alone after the one search. What is seen is the
  ``zero_grad``, not the GradScaler's unscaling: ``torch._amp_foreach_non_finite_check_and_unscale_``
  writes the gradients in place without bumping their version counter (torch 2.13).
  Not told apart: such a pass before the first step while another model's GradScaler has scaled a
  loss in the same process is refused too.
After the first step the watch is removed: the stack check covers every step a GradScaler takes.
A GradScaler on a bf16 model is left alone (no loss scaling is installed; it only multiplies and
divides by powers of two, exactly).
"""

import gc
import sys
import weakref

import torch
from torch import nn

from oomless.errors import InputError

# GradScaler.step -> GradScaler._maybe_opt_step -> the optimizer's step wrapper -> its pre-hooks; a
# wrapper around the optimizer (accelerate's AcceleratedOptimizer) adds a frame or two above.
_FRAMES_TO_LOOK_AT = 16

REMEDY = ("oomless scales the fp16 loss itself (precision='fp16'): drop torch.amp.GradScaler from the loop, "
          "call loss.backward() and optimizer.step() directly (.grad holds the true gradient: clip it without "
          "unscale_; oomless skips overflowed steps and counts them in oomless.stats(model).skipped_steps). "
          "See 'Mixed precision and torch.compile' in the README.")


def grad_scaler_stepping(optimizer) -> bool:
    """Whether an enabled ``torch.amp.GradScaler`` (or subclass) is calling ``optimizer.step()``:
    its ``step`` or ``_maybe_opt_step`` frame is on the stack above the caller."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_TO_LOOK_AT):
        if frame is None:
            return False
        if frame.f_code.co_name in ("step", "_maybe_opt_step"):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.amp.GradScaler):
                return owner.is_enabled() and frame.f_locals.get("optimizer") is optimizer
        frame = frame.f_back
    return False


def _grad_scaler_classes() -> list[type]:
    classes, pending = [], [torch.amp.GradScaler]
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending.extend(cls.__subclasses__())
    return classes


def grad_scaler_in_use() -> bool:
    """Whether an enabled GradScaler that has scaled a loss is alive. Instances of a Python class
    refer to their class, so ``gc.get_referrers`` of the classes finds them in one walk of the heap."""
    return any(isinstance(found, torch.amp.GradScaler) and found.is_enabled()
               and getattr(found, "_scale", True) is not None      # None until its first scale()
               for found in gc.get_referrers(*_grad_scaler_classes()))


class GradScalerGuard:
    """The two checks of one fp16 model (module docstring)."""

    def __init__(self):
        self.watched: nn.Parameter | None = None
        self.watch_handle = None
        self._watched_grad = None           # weak reference to the watched gradient of the last backward
        self._watched_version = 0

    def install(self, parameters: list[nn.Parameter], optimizer) -> None:
        held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        candidates = [parameter for parameter in parameters if id(parameter) in held]
        if candidates:
            self.watched = min(candidates, key=lambda parameter: parameter.numel())
            self.watch_handle = self.watched.register_post_accumulate_grad_hook(self._after_accumulation)

    def end_watch(self) -> None:
        if self.watch_handle is not None:
            self.watch_handle.remove()
            self.watch_handle = None
        self.watched = self._watched_grad = None

    def _after_accumulation(self, parameter: nn.Parameter) -> None:
        self._watched_grad = weakref.ref(parameter.grad)
        self._watched_version = parameter.grad._version

    def before_step(self, optimizer, args, kwargs):
        """Step pre-hook, ahead of the loss scaler's: refuse a GradScaler's step; the first step ends the watch."""
        self.end_watch()
        if grad_scaler_stepping(optimizer):
            raise InputError("a torch.amp.GradScaler is stepping the optimizer of a model oomless runs in fp16: "
                             "the loss is scaled twice (oomless's scale times the GradScaler's), so the gradients "
                             "overflow fp16 and the GradScaler skips steps, leaving the weights unchanged, until its "
                             f"scale has fallen far enough. {REMEDY}")
        return None

    def skipped_by_grad_scaler(self) -> bool:
        """Before a forward with gradients: whether the previous backward's gradients were dropped or
        zeroed without a step while a GradScaler is in use (a step it skipped; `DROPPED_MESSAGE`)."""
        if self._watched_grad is None:
            return False
        grad = self._watched_grad()
        current = self.watched.grad
        if current is not None and current is grad and grad._version == self._watched_version:
            return False    # the gradients are still there: accumulation, or a forward before the step
        self.end_watch()       # one search per model: a loop without a GradScaler pays it once
        return grad_scaler_in_use()


DROPPED_MESSAGE = ("the gradients of the last backward were dropped without optimizer.step() while a "
                   "torch.amp.GradScaler is in use: it scales the fp16 loss a second time, the gradients "
                   f"overflow and it skips the step, leaving the weights unchanged. {REMEDY}")
