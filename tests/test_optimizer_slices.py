"""The per-bucket optimizers of the overlapped data-parallel update are built for any torch.optim class
and its param-group options, and step bit for bit as the user's optimizer does (gloo, world size 1,
where DDP's average over one rank is the gradient itself)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from oomless.errors import InputError
from oomless.parallel import apply_overlapped_update
from tests.parallel_workers import free_port

# The overlapped run calls its own no-op step, not the user's optimizer's: torch's scheduler warns.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of")

# (class, options of group 0, options of group 1): every option that changes the math is used once.
OPTIMIZERS = {
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                     dict(lr=0.02, momentum=0.5, dampening=0.1)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True), dict(lr=1e-3)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-3, betas=(0.8, 0.9))),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True), dict(lr=1e-3, alpha=0.9)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=0.01), dict(lr=1e-3)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1), dict(lr=1e-3)),
}


@pytest.fixture(scope="module")
def gloo_world_of_one():
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if owns_group:
        dist.destroy_process_group()


def _run(optimizer_class, first_options, second_options, overlapped: bool, steps: int = 5, device="cpu",
         process_group=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    optimizer = optimizer_class([
        {"params": [*model[0].parameters(), *model[4].parameters()], **first_options},
        {"params": [*model[2].parameters()], **second_options},
    ])
    # Buckets of about 1 kB: the param groups are split across several buckets.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, gradient_as_bucket_view=True,
                                  process_group=process_group)
    update = apply_overlapped_update(ddp, optimizer) if overlapped else None
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)
    inputs = torch.randn(steps, 5, 8, generator=torch.Generator().manual_seed(1)).to(device)
    for step in range(steps):
        ddp(inputs[step]).square().mean().backward()
        optimizer.step() if update is None else update.step()
        optimizer.zero_grad(set_to_none=True) if update is None else update.zero_grad()
        scheduler.step()                    # the learning rate changes every step (after the update)
    if update is not None:
        update.remove()                     # waits for the last step's updates
    return model, optimizer, update


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_overlapped_update_equals_ddp_for_every_optimizer(name, gloo_world_of_one):
    _check_equal_to_ddp(*OPTIMIZERS[name])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_overlapped_update_equals_ddp_on_cuda(name, gloo_world_of_one):
    """NCCL: the update is chained on the all-reduce's future on a pool stream (overlap.py)."""
    nccl = dist.new_group(ranks=[0], backend="nccl")
    _check_equal_to_ddp(*OPTIMIZERS[name], device="cuda", process_group=nccl)


def _check_equal_to_ddp(optimizer_class, first_options, second_options, **where):
    plain_model, plain_optimizer, _ = _run(optimizer_class, first_options, second_options, overlapped=False, **where)
    model, optimizer, update = _run(optimizer_class, first_options, second_options, overlapped=True, **where)
    assert len(update.bucket_updates) >= 2
    for (key, value), plain_value in zip(model.state_dict().items(), plain_model.state_dict().values()):
        assert torch.equal(value, plain_value), key
    state, plain_state = optimizer.state_dict(), plain_optimizer.state_dict()
    assert state["param_groups"] == plain_state["param_groups"]
    assert state["state"].keys() == plain_state["state"].keys() == set(range(6))
    for index, entry in state["state"].items():
        assert entry.keys() == plain_state["state"][index].keys()
        assert all(torch.equal(torch.as_tensor(entry[key]), torch.as_tensor(plain_state["state"][index][key]))
                   for key in entry), (index, entry.keys())


def test_an_optimizer_that_needs_every_parameter_at_once_is_refused(gloo_world_of_one):
    model = nn.Linear(4, 4)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    with pytest.raises(InputError, match="LBFGS needs every parameter in one step"):
        apply_overlapped_update(ddp, torch.optim.LBFGS(model.parameters()))


def test_buckets_the_optimizer_holds_nothing_of_are_left_as_they_are(gloo_world_of_one):
    """Fine-tuning the head alone: the optimizer holds the last layer's parameters, so the buckets of
    the other layers have no optimizer slice; they stay as they were, and the run equals DDP's."""
    states = []
    for overlapped in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        optimizer = torch.optim.Adam(model[4].parameters(), lr=1e-2)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
        update = apply_overlapped_update(ddp, optimizer) if overlapped else None
        inputs = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
        for step in range(3):
            ddp(inputs[step]).square().mean().backward()
            optimizer.step() if update is None else update.step()
            optimizer.zero_grad(set_to_none=True) if update is None else update.zero_grad()
        if update is not None:
            update.remove()
        states.append(model.state_dict())
        assert all(torch.equal(before[name], states[-1][name]) for name in before if not name.startswith("4."))
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
