"""What the zero-bubble pipeline schedules' split backward costs on this device: the model's backward
as torch's pipeline stages run it under ZB-H1 and ZB-V (``stage_backward_input``: the gradients of
the stage's inputs, keeping the graph; then ``stage_backward_weight``: the parameters' gradients from
the intermediate gradients the first pass kept) against the same backward in one pass
(``stage_backward``), timed on the real model, medians of interleaved repeats.

The simulator otherwise takes splitting as free (Qi et al.'s working assumption, T_B + T_W = the
backward); measured on the 2-core CPU machine, the project's 3D U-Net at a micro-batch of 4 volumes of
16^3 took 1.20-1.21x the one-pass backward split (two graph traversals, kept intermediate gradients),
and a ZB-V pipeline step measured 1.23x 1F1B's where the simulator, splitting for free, had predicted
it 2 % faster (bench/bench_simulate.py). `plan.schedules.split_backward_terms` uses the ratio.
"""

import statistics
import time

import torch
from torch import nn

from oomless.profile.tensors import call_model, tensors_in, training_state_kept


def _loss(output, loss_fn):
    from oomless.profile.profiler import loss_of

    return loss_of(output, loss_fn)


def measure_split_backward_ratio(model: nn.Module, example_inputs, loss_fn=None, repeats: int = 5) -> float:
    """Seconds of the split backward over the one-pass backward of ``model`` at ``example_inputs``
    (gradients taken for the inputs that are floating point, as a middle stage's are); 1.0 where
    no input is floating point (nothing to split: a first stage runs its backward whole). The
    model's gradients, buffers (BatchNorm's running statistics) and the RNG are as they were before
    the call."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    inputs = [tensor for tensor in tensors_in(example_inputs)
              if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()]
    if not inputs:
        return 1.0
    parameters = [param for param in model.parameters() if param.requires_grad]

    def backward_seconds(split: bool) -> float:
        leaves = [tensor.detach().requires_grad_(True) for tensor in inputs]
        swap = dict(zip(map(id, inputs), leaves))
        given = torch.utils._pytree.tree_map(lambda value: swap.get(id(value), value), example_inputs)
        loss = _loss(call_model(model, given), loss_fn)
        started = time.perf_counter()
        if split:
            _, groups = stage_backward_input([loss], None, leaves, iter(parameters))
            stage_backward_weight(iter(parameters), groups)
        else:
            stage_backward(loss, None, leaves)
        seconds = time.perf_counter() - started
        for param in parameters:
            param.grad = None
        return seconds

    with training_state_kept(model):
        backward_seconds(False), backward_seconds(True)          # first calls: start-up, not the pass
        whole, split = [], []
        for _ in range(max(repeats, 1)):
            whole.append(backward_seconds(False))
            split.append(backward_seconds(True))
    return statistics.median(split) / statistics.median(whole)
