"""Mixed precision on pipeline stages: what `oomless.runtime.precision` does at a model's boundary,
done at the boundaries of a pipeline's stages so that the stages together compute what one process
computes with the whole forward under ``torch.autocast`` and the loss in fp32 on fp32 outputs.

    apply_precision(model, "fp16", optimizer)     # the model's loss scaler: unscaling, skipped steps
    pipeline = PipelineParallel(sequence, cuts, loss_fn, microbatches, precision="fp16",
                                scaler=precision_state(model).scaler, example=(inputs[:1],))

or ``oomless train --parallel pipeline|hybrid --precision bf16|fp16``. Each stage's module gets
`StagePrecision` hooks (`apply_stage_precision`):

- A forward pre-hook enters ``torch.autocast(device, dtype)``, a forward hook (always called) leaves
  it: every stage's forward runs under the autocast one process's forward runs under. Backward needs
  none (autograd runs each backward op in its forward op's dtypes), and a recomputed block replays
  under the autocast state torch's checkpoint stashed.
- The tensors crossing a cut keep their autocast dtype: a bf16 convolution output crosses as bf16.
  Bringing it to fp32 at the cut would change what the next stage's ops outside autocast's lists
  (add, ReLU, pooling, concatenation) compute and save. The shapes `PipelineStage` is given (its
  receive buffers) are therefore computed under autocast too (`oomless.parallel.pipeline.stage_shapes`).
- The last stage's floating outputs in the autocast dtype come back as fp32: the schedule computes
  the loss on them after the stage's forward returned, outside autocast, as one process does.
- fp16: the gradient arriving at the last stage's output is multiplied by the loss scale S (the
  model's `LossScaler`, a power of two, so exact: what scaling the fp32 loss gives), so every gradient
  crossing a cut backwards is the scaled one, as inside one process's backward (unscaled, fp16
  gradients below 2**-24 would flush to zero). No stage unscales the gradient it sends back. Each
  parameter's gradient is unscaled by 1/S as it accumulates, by the hooks of the model's own
  `Precision` (``apply_precision(model, "fp16", optimizer)``: every rank builds the whole model and
  its stages hold the same Parameter objects), so the micro-batch mean, the tied-weight sums, the
  replica average and clipping all see true gradients (exact in either order, S being a power of two).
- fp16: whether a step is skipped is decided by every pipeline rank together (the scaler's
  ``agreement_group``, MIN over the finite votes, a rank without gradients voting finite): each rank
  holds only its stages' gradients, and a step skipped on one rank but taken on another would leave
  the stages' weights from different steps. With replicas (hybrid) every rank of the (pipeline x
  data) mesh votes, the world: the replica average runs before the step, so an inf in one replica's
  gradient is in every replica's and each pipeline's vote would agree anyway, but one group spanning
  them all is one collective every rank joins at the same point.

A stage's own memory plan (`oomless.parallel.stage_fit`) is profiled and planned at the pipeline's
precision, and installed without the plan's precision hooks: those would bring a middle stage's
outputs to fp32 and scale at every stage's boundary; these hooks are the stage's precision.
"""

import contextlib

import torch
from torch import nn

from oomless.errors import InputError
from oomless.runtime.precision import LossScaler, autocast_dtype, fp32_outputs, scaled_gradients

STATE_ATTRIBUTE = "_oomless_stage_precision"


def stage_autocast(device_type: str, dtype: torch.dtype | None):
    """``torch.autocast(device_type, dtype)``, or no context for fp32 (``dtype`` None)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def check_stage_precision(precision: str, scaler: LossScaler | None) -> torch.dtype | None:
    """The autocast dtype of ``precision``; `InputError` for fp16 without the model's loss scaler."""
    dtype = autocast_dtype(precision)
    if precision == "fp16" and scaler is None:
        raise InputError("precision='fp16' on a pipeline needs the model's loss scaler: apply_precision(model, "
                         "'fp16', optimizer) first (it unscales the gradients and skips overflowed steps) and pass "
                         "scaler=precision_state(model).scaler; or use precision='bf16', which needs no scaling")
    return dtype


class StagePrecision:
    """The hooks of one stage module: autocast around its forward; on the last stage, fp32 outputs
    and (fp16) the loss scale on their gradient (module docstring)."""

    def __init__(self, precision: str, device_type: str, last: bool, scaler: LossScaler | None = None):
        self.precision, self.dtype = precision, check_stage_precision(precision, scaler)
        self.device_type, self.last, self.scaler = device_type, last, scaler
        self.handles: list = []
        self._entered: list = []        # per call: the autocast context entered

    def install(self, module: nn.Module) -> None:
        # First of the stage's pre-hooks when installed (a plan installed later prepends only its
        # check against a caller's autocast, which then runs before this one enters autocast).
        self.handles.append(module.register_forward_pre_hook(self._pre_hook, prepend=True))
        self.handles.append(module.register_forward_hook(self._post_hook, always_call=True))

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre_hook(self, module, args):
        context = torch.autocast(self.device_type, dtype=self.dtype)
        context.__enter__()
        self._entered.append(context)

    def _post_hook(self, module, args, output):
        self._entered.pop().__exit__(None, None, None)
        if not self.last or output is None:      # None: the forward raised
            return None
        output = fp32_outputs(output, self.dtype)
        return output if self.scaler is None else scaled_gradients(output, lambda: self.scaler.scale)


def apply_stage_precision(module: nn.Module, precision: str, device_type: str, last: bool,
                          scaler: LossScaler | None = None) -> StagePrecision | None:
    """Install `StagePrecision` on a stage ``module`` in place (nothing for fp32); returns it."""
    if autocast_dtype(precision) is None:
        return None
    if getattr(module, STATE_ATTRIBUTE, None) is not None:
        raise InputError("this stage already has a precision; remove_stage_precision(module) first")
    state = StagePrecision(precision, device_type, last, scaler)
    state.install(module)
    object.__setattr__(module, STATE_ATTRIBUTE, state)
    return state


def remove_stage_precision(module: nn.Module) -> None:
    state = getattr(module, STATE_ATTRIBUTE, None)
    if state is not None:
        state.uninstall()
        object.__delattr__(module, STATE_ATTRIBUTE)
