"""`oomless.profile.split_backward`: the backward as the zero-bubble pipeline stages split it, timed
against the backward in one pass. No timing is asserted (that is the benchmark's): what is checked is
that the two ways measured compute the same gradients, and that the model is left as it was."""

import copy

import torch

from oomless.models import UNet3D
from oomless.profile.split_backward import measure_split_backward_ratio


def test_the_split_passes_measured_give_the_one_pass_gradients_and_leave_the_model_as_it_was():
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    model, volumes = UNet3D(in_channels=1, out_channels=2, base_channels=4, depth=2), torch.randn(2, 1, 8, 8, 8)
    loss_fn = lambda out: out.square().mean()     # noqa: E731
    # The passes the measurement times, as it calls them: the same gradients, inputs' and parameters'.
    parameters = list(model.parameters())
    grads = []
    for split in (False, True):
        leaf = volumes.clone().requires_grad_(True)
        loss = loss_fn(model(leaf))
        if split:
            (input_grad,), groups = stage_backward_input([loss], None, [leaf], iter(parameters))
            stage_backward_weight(iter(parameters), groups)
        else:
            (input_grad,) = stage_backward(loss, None, [leaf])
        grads.append([input_grad] + [param.grad.clone() for param in parameters])
        for param in parameters:
            param.grad = None
    assert all(torch.allclose(one, other, rtol=1e-5, atol=1e-7) for one, other in zip(*grads))

    before = copy.deepcopy(model.state_dict())
    marker = [torch.full_like(param, 7.0) for param in parameters]
    for param, grad in zip(parameters, marker):
        param.grad = grad
    rng = torch.get_rng_state()
    ratio = measure_split_backward_ratio(model, volumes, loss_fn, repeats=2)
    assert ratio > 0 and ratio == ratio
    assert all(param.grad is grad for param, grad in zip(parameters, marker))
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_without_floating_point_inputs_there_is_nothing_to_split():
    embedding = torch.nn.Embedding(10, 4)
    assert measure_split_backward_ratio(embedding, torch.tensor([[1, 2, 3]]), lambda out: out.sum()) == 1.0
