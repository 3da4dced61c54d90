"""Optimizer state off the device (runtime/offload_state.py): bit-equal to plain PyTorch, the state
dict and checkpoints unchanged, and on a CPU-only run the state really leaves resident memory (the
disk tier), measured in a child process. The planner moves it when only that fits."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oomless
from oomless.errors import InputError
from oomless.models import MLP
from oomless.runtime.update_in_backward import apply_update_in_backward, installed_update, remove_update_in_backward

OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True),
}


def _case():
    torch.manual_seed(0)
    return MLP((64, 128, 128, 128, 8)), torch.randn(16, 64)


def _train(model, optimizer, inputs, steps, clip=False):
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(inputs + step).square().mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        scheduler.step()


def _assert_same(reference, reference_optimizer, model, optimizer):
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name
    state, expected_state = optimizer.state_dict(), reference_optimizer.state_dict()   # brings the state in
    assert state["param_groups"] == expected_state["param_groups"]
    assert state["state"].keys() == expected_state["state"].keys() and state["state"]
    for index, entry in expected_state["state"].items():
        assert entry.keys() == state["state"][index].keys()
        assert all(torch.equal(torch.as_tensor(value), torch.as_tensor(state["state"][index][key]))
                   for key, value in entry.items()), index


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("in_backward", [True, False], ids=["in-backward", "at-step-with-clipping"])
def test_offloaded_state_equals_plain_pytorch(name, in_backward):
    model, inputs = _case()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](reference.parameters())
    update = apply_update_in_backward(model, optimizer, in_backward=in_backward, offload_state=True,
                                      min_offload_bytes=0)
    clip = not in_backward                      # after backward, clipping by global norm works
    _train(reference, reference_optimizer, inputs, steps=4, clip=clip)
    _train(model, optimizer, inputs, steps=4, clip=clip)
    # Between steps every state tensor with a dimension is out: the dict holds scalars at most.
    assert update.state.offloaded_bytes > 0
    assert all(value.dim() == 0 for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))
    _assert_same(reference, reference_optimizer, model, optimizer)
    assert update.state.offloaded_bytes > 0     # state_dict() sent it back out
    remove_update_in_backward(model)            # everything back in the dict, on the device
    assert update.state is None and optimizer.state_dict()["state"][0].keys() == reference_optimizer.state[
        reference[0].weight].keys()



def test_after_a_step_in_backward_the_first_state_of_the_next_step_is_on_its_way_in():
    """The user's optimizer.step() ends a step whose updates ran in backward: the state remembers
    that step's update order (each parameter once) and starts bringing in the state the next
    backward updates first."""
    model, inputs = _case()
    optimizer = torch.optim.Adam(model.parameters())
    update = apply_update_in_backward(model, optimizer, in_backward=True, offload_state=True, min_offload_bytes=0)
    prefetched = []
    tier_prefetch = update.state.tier.prefetch
    update.state.tier.prefetch = lambda ticket: (prefetched.append(ticket), tier_prefetch(ticket))
    for steps in (1, 2):
        prefetched.clear()
        _train(model, optimizer, inputs, steps=1)
        order = update.state.order
        assert len(order) == len(list(model.parameters())) and set(order) == set(model.parameters())
        first = [entry.ticket for entry in update.state.out[order[0]].values()]
        assert first and prefetched[-len(first):] == first


def test_loading_a_checkpoint_into_an_offloaded_optimizer_continues_bit_equal():
    model, inputs = _case()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(reference.parameters())
    apply_update_in_backward(model, optimizer, offload_state=True, min_offload_bytes=0)
    _train(reference, reference_optimizer, inputs, steps=2)
    _train(model, optimizer, inputs, steps=2)
    saved = copy.deepcopy(optimizer.state_dict())
    _train(model, optimizer, inputs, steps=2)   # moves on; then back to the checkpoint
    model.load_state_dict(reference.state_dict())
    optimizer.load_state_dict(saved)
    assert installed_update(model).state.offloaded_bytes > 0
    _train(reference, reference_optimizer, inputs, steps=2)
    _train(model, optimizer, inputs, steps=2)
    _assert_same(reference, reference_optimizer, model, optimizer)


def _mapped_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:        # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize("offloaded", [True, False], ids=["state-off-the-device", "state-on-the-device"])
def test_a_loaded_checkpoint_holds_no_memory_once_loaded(offloaded, tmp_path):
    """A checkpoint's tensors are slices of one mapping of its file, each keeping all of it: the loaded
    state must not keep one (Adam's step counters, and on CPU every state tensor on the device, are
    kept by ``load_state_dict`` as they are). Kept, a resumed `oomless train --size 32 --memory 52MiB`
    with the state off the device held the whole file (4.06 MiB) beyond a fresh run and measured
    54.6-55.1 MiB. Training continues bit-equal."""
    from oomless.train import load_checkpoint, save_checkpoint

    model, inputs = _case()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    if offloaded:
        apply_update_in_backward(model, optimizer, in_backward=False, offload_state=True, min_offload_bytes=0)
    _train(reference, reference_optimizer, inputs, steps=2)
    path = save_checkpoint(tmp_path, reference, reference_optimizer, step=2, data_position=0)
    load_checkpoint(path, model, optimizer, restore_rng=False)
    assert _mapped_bytes(path) == 0, f"{_mapped_bytes(path)} bytes still mapped"
    _train(reference, reference_optimizer, inputs, steps=2)
    _train(model, optimizer, inputs, steps=2)
    _assert_same(reference, reference_optimizer, model, optimizer)


def test_with_the_update_after_backward_the_gradients_stay_after_step_as_in_plain_pytorch():
    """The user's ``optimizer.step()`` steps each parameter with its state brought in and leaves its
    gradient as the plain step does (logging gradient norms after the step), until ``zero_grad``; the
    plan counts every gradient on the device through the step. The user's own step, which runs after
    the per-parameter updates, does not step them again (bit-equal)."""
    model, inputs = _case()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(reference.parameters())
    update = apply_update_in_backward(model, optimizer, in_backward=False, offload_state=True, min_offload_bytes=0)
    for step in range(3):
        for network, network_optimizer in ((reference, reference_optimizer), (model, optimizer)):
            network_optimizer.zero_grad()
            network(inputs + step).square().mean().backward()
            network_optimizer.step()
        for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
            assert actual.grad is not None, f"{name}: gradient gone after step()"
            assert torch.equal(expected, actual) and torch.equal(expected.grad, actual.grad), name
    assert update.state.offloaded_bytes > 0
    optimizer.zero_grad()
    assert all(param.grad is None for param in model.parameters())
    _assert_same(reference, reference_optimizer, model, optimizer)


class _ReplacingSGD(torch.optim.Optimizer):
    """Momentum SGD that replaces its state tensor at every step instead of updating it in place."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                state["buffer"] = 0.9 * state["buffer"] + param.grad if "buffer" in state else param.grad.clone()
                param.add_(state["buffer"], alpha=-group["lr"])


def test_on_cpu_the_state_is_its_file_mapped_and_steady_steps_copy_no_byte():
    """On a CPU-only run each state tensor is a file of its own; the step updates the file mapped, so
    once the files exist a step writes and reads none of their bytes (it copied them all out and back
    before). An optimizer that replaces its state tensors still trains bit-equal (the new ones are
    written)."""
    for make in (lambda params: torch.optim.Adam(params), _ReplacingSGD):
        model, inputs = _case()
        reference = copy.deepcopy(model)
        optimizer, reference_optimizer = make(model.parameters()), make(reference.parameters())
        update = apply_update_in_backward(model, optimizer, offload_state=True, min_offload_bytes=0)
        files = update.state.tier
        written, read = [], []
        overwrite, read_file = files.overwrite, files.read
        files.overwrite = lambda file, data: (written.append(data.numel()), overwrite(file, data))
        files.read = lambda file: (read.append(file.num_bytes), read_file(file))[1]
        _train(reference, reference_optimizer, inputs, steps=2)
        _train(model, optimizer, inputs, steps=2)
        written.clear(), read.clear()
        _train(reference, reference_optimizer, inputs, steps=2)
        _train(model, optimizer, inputs, steps=2)
        replaces = make is _ReplacingSGD
        assert (sum(written) == 2 * update.state.offloaded_bytes) if replaces else written == [], written
        assert read == []
        _assert_same(reference, reference_optimizer, model, optimizer)
        remove_update_in_backward(model)


def test_forcing_it_where_the_update_cannot_be_split_is_refused():
    model, inputs = _case()
    with pytest.raises(InputError, match="offload_optimizer_state=True is not possible: LBFGS"):
        oomless.plan(model, inputs, "1TiB", loss_fn=lambda out: out.sum(), optimizer=torch.optim.LBFGS(model.parameters()),
                     offload_optimizer_state=True)


def test_the_planner_offloads_the_state_when_only_that_fits():
    torch.manual_seed(0)
    model, inputs = MLP((256,) * 17), torch.randn(4, 256)
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer)
    # At the smallest memory, which counts both moved: nothing else fits.
    with pytest.raises(oomless.PlanError) as refused:
        oomless.plan(model, inputs, 1, loss_fn=loss_fn, optimizer=optimizer, profile=profile)
    plan = oomless.plan(model, inputs, refused.value.minimum_bytes, loss_fn=loss_fn, optimizer=optimizer,
                        profile=profile)
    assert plan.update_in_backward and plan.offload_optimizer_state and plan.offload_parameters
    state = {part.name: part for part in plan.static_parts}["optimizer state"]
    assert state.total_bytes == profile.optimizer_state_bytes and state.device_bytes < state.total_bytes / 2
    assert "disk" in state.where and "optimizer state off the device" in " ".join(plan.notes)
    # The predicted step counts the state's trip: on CPU its files mapped in (and out for free: the
    # mapping dropped), at the rate measured mapping one; the activations' disk link is not it.
    from oomless.runtime.tiers import mapped_files_rates

    mapped_in, _ = mapped_files_rates()
    assert plan.predicted_step_seconds >= profile.optimizer_state_bytes / mapped_in
    assert any("state mapped in" in note for note in plan.notes), plan.notes
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.Adam(reference.parameters())
    oomless.apply(model, plan, optimizer=optimizer)
    _train(reference, reference_optimizer, inputs, steps=3)
    _train(model, optimizer, inputs, steps=3)
    _assert_same(reference, reference_optimizer, model, optimizer)


def test_resident_memory_drops_by_the_state_on_a_cpu_only_run():
    """Child processes: a 16-layer MLP with 64 MiB of parameters and 128 MiB of Adam state; the rise of
    peak resident memory over three steps from before the first one."""
    def run(mode):
        script = Path(__file__).with_name("update_in_backward_child.py")
        done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=600,
                              cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    in_backward, offloaded = run("in_backward"), run("offload")
    state_bytes = 2 * in_backward["gradient_bytes"]
    print(f"\nrise from start: in backward {in_backward['rise_from_start_bytes'] / 2**20:.1f} MiB, with the state "
          f"on disk {offloaded['rise_from_start_bytes'] / 2**20:.1f} MiB; state {state_bytes / 2**20:.1f} MiB")
    assert in_backward["rise_from_start_bytes"] - offloaded["rise_from_start_bytes"] >= 0.8 * state_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_state_lives_in_pinned_host_memory_and_training_is_bit_equal():
    """Pinned host tier over the copy streams; between steps the device holds no state tensor."""
    torch.manual_seed(0)
    model, inputs = MLP((1024,) * 9).cuda(), torch.randn(8, 1024, device="cuda")
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    _train(reference, reference_optimizer, inputs, steps=3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    update = apply_update_in_backward(model, optimizer, offload_state=True, min_offload_bytes=0)
    _train(model, optimizer, inputs, steps=3)
    torch.cuda.synchronize()
    update.state._free_finished_copies()
    state_bytes = update.state.offloaded_bytes
    assert state_bytes == 2 * sum(param.nbytes for param in model.parameters())
    # The reference's state and gradients are on the device; of the model's state only what the next
    # step's first update prefetches (at most one layer's of eight, and copies not yet seen done).
    assert torch.cuda.memory_allocated() - before <= state_bytes // 4 + 2**20
    _assert_same(reference, reference_optimizer, model, optimizer)
