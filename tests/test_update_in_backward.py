"""Update in backward equals plain PyTorch bit for bit, and frees the gradients as it goes.

Each case trains a ``deepcopy`` with the plain loop (zero_grad, backward, step, scheduler step) and
the model under ``oomless.fit(..., update_in_backward=True)`` with the very same loop, for several
steps with a learning rate that changes every step, then compares parameters and the optimizer's
state (``torch.equal``). The memory promise is checked by counting: the gradient bytes alive at once
during backward (a probe hook registered before oomless's sees each gradient as it is accumulated),
and, in a child process, the step's peak resident memory (tests/update_in_backward_child.py).
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import oomless
from oomless.errors import InputError
from oomless.models import MLP, TinyTransformer
from oomless.runtime.update_in_backward import installed_update
from tests.conftest import RaisesInBackward

OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2),
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
}
STEPS = 4


def _transformer():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 32))
    # Tied embedding and head: one parameter, two uses, one AccumulateGrad.
    return (TinyTransformer(vocab_size=256, dim=64, depth=3, heads=4, max_len=32),
            tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.roll(-1, 1).flatten()))


def _groups(model):
    """Two param groups as training scripts make them: weight decay for matrices only."""
    matrices = [param for param in model.parameters() if param.dim() >= 2]
    others = [param for param in model.parameters() if param.dim() < 2]
    return [{"params": matrices}, {"params": others, "weight_decay": 0.0, "lr": 3e-3}]


def _train(model, optimizer, inputs, loss_fn, steps=STEPS, accumulation_steps=1):
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.6)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro_batch in range(accumulation_steps):
            torch.manual_seed(100 + step * accumulation_steps + micro_batch)    # dropout
            (loss_fn(model(inputs)) / accumulation_steps).backward()
        optimizer.step()
        scheduler.step()


def _assert_same_training(reference, reference_optimizer, model, optimizer):
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected, actual), f"parameter {name} differs"
        assert actual.grad is None, f"gradient of {name} was not freed"
    state, expected_state = optimizer.state_dict(), reference_optimizer.state_dict()
    assert state["param_groups"] == expected_state["param_groups"]
    assert state["state"].keys() == expected_state["state"].keys()
    for index, entry in state["state"].items():
        assert entry.keys() == expected_state["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(expected_state["state"][index][key])), (index, key)


@pytest.fixture(scope="module")
def transformer_profile():
    model, inputs, loss_fn = _transformer()
    return oomless.profile(model, inputs, loss_fn=loss_fn)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_update_in_backward_equals_plain_pytorch(name, transformer_profile):
    model, inputs, loss_fn = _transformer()
    reference = copy.deepcopy(model)
    reference_optimizer = OPTIMIZERS[name](_groups(reference))
    optimizer = OPTIMIZERS[name](_groups(model))
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                profile=transformer_profile)
    assert oomless.installed_plan(model).update_in_backward

    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)

    _assert_same_training(reference, reference_optimizer, model, optimizer)
    # One step per trainable parameter and step, all in backward (the tied weight once).
    assert installed_update(model).steps_in_backward == STEPS * len(list(model.parameters()))


class _HalfUsed(torch.nn.Module):
    """A module registering two parameters, one of which the forward uses only at even steps."""

    def __init__(self):
        super().__init__()
        self.body = MLP((32, 64, 32))
        self.scale = torch.nn.Parameter(torch.ones(32))
        self.shift = torch.nn.Parameter(torch.zeros(32))
        self.calls = 0

    def forward(self, inputs):
        self.calls += 1
        out = self.body(inputs) * self.scale
        return out + self.shift if self.calls % 2 else out


@pytest.mark.parametrize("offload_state", [False, True], ids=["state-on-device", "state-off"])
def test_a_module_whose_other_parameter_got_no_gradient_is_stepped_at_the_users_step(offload_state):
    """Parameters are stepped one module's at a time, as soon as all of that module's have their
    gradients; where one of them got none this step, the others are stepped at optimizer.step(),
    still bit-equal to plain PyTorch (whose step skips the one without a gradient)."""
    from oomless.runtime.update_in_backward import apply_update_in_backward

    torch.manual_seed(0)
    model, inputs = _HalfUsed(), torch.randn(8, 32)
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    update = apply_update_in_backward(model, optimizer, offload_state=offload_state, min_offload_bytes=0)
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    _assert_same_training(reference, reference_optimizer, model, optimizer)
    used = len(list(model.parameters()))
    assert update.steps_in_backward == STEPS * used - STEPS // 2


@pytest.mark.parametrize("policy", ["swap", "recompute"])
def test_update_in_backward_composes_with_swap_and_recompute(policy, transformer_profile):
    """Recomputed blocks recompute before their own parameters are updated: still bit-equal."""
    model, inputs, loss_fn = _transformer()
    reference = copy.deepcopy(model)
    reference_optimizer, optimizer = torch.optim.AdamW(reference.parameters()), torch.optim.AdamW(model.parameters())
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                        profile=transformer_profile, min_swap_bytes=0)
    oomless.apply(model, plan.with_decisions({name: policy for name in plan.decisions}), optimizer=optimizer)
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    _assert_same_training(reference, reference_optimizer, model, optimizer)
    stats = oomless.stats(model)
    assert (stats.recomputed_blocks if policy == "recompute" else stats.offloaded_bytes) > 0


def test_a_new_optimizer_after_fit_is_told_to_apply_the_plan_again(transformer_profile):
    """The plan steps the optimizer it was applied with in backward; a loop that made a new one (a
    second phase of training) stepped only that one, and was told to call optimizer.step()."""
    model, inputs, loss_fn = _transformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                profile=transformer_profile)
    new_optimizer = torch.optim.Adam(model.parameters())
    loss_fn(model(inputs)).backward()
    new_optimizer.step()
    with pytest.raises(InputError, match=r"\(SGD\).*oomless.remove\(model\), then oomless.apply\(model, plan, "
                                         r"optimizer=new_optimizer\)"):
        loss_fn(model(inputs)).backward()
    oomless.remove(model)


def test_gradient_accumulation_steps_at_the_last_micro_batch(transformer_profile):
    model, inputs, loss_fn = _transformer()
    reference = copy.deepcopy(model)
    reference_optimizer, optimizer = torch.optim.Adam(reference.parameters()), torch.optim.Adam(model.parameters())
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                accumulation_steps=2, profile=transformer_profile)
    _train(reference, reference_optimizer, inputs, loss_fn, steps=3, accumulation_steps=2)
    _train(model, optimizer, inputs, loss_fn, steps=3, accumulation_steps=2)
    _assert_same_training(reference, reference_optimizer, model, optimizer)


def test_accumulating_without_saying_so_raises(transformer_profile):
    model, inputs, loss_fn = _transformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                profile=transformer_profile)
    loss_fn(model(inputs)).backward()
    with pytest.raises(InputError, match="accumulation_steps=k"):
        loss_fn(model(inputs)).backward()           # a second micro-batch, no optimizer.step() between
    oomless.remove(model)

    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                accumulation_steps=2, profile=transformer_profile)
    loss_fn(model(inputs)).backward()
    with pytest.raises(InputError, match="after 1 of accumulation_steps=2"):
        optimizer.step()


def test_clipping_and_unsplittable_optimizers_are_refused_at_fit(transformer_profile):
    model, inputs, loss_fn = _transformer()
    common = dict(loss_fn=loss_fn, update_in_backward=True, profile=transformer_profile)
    with pytest.raises(InputError, match="clipping by global norm"):
        oomless.fit(model, inputs, "1TiB", optimizer=torch.optim.Adam(model.parameters()), max_grad_norm=1.0, **common)
    with pytest.raises(InputError, match="no optimizer was given"):
        oomless.fit(model, inputs, "1TiB", **common)
    with pytest.raises(InputError, match="LBFGS steps every parameter at once"):
        oomless.fit(model, inputs, "1TiB", optimizer=torch.optim.LBFGS(model.parameters()), **common)
    assert not hasattr(model, "_oomless")
    # The planner's own choice never steps in backward when the loop clips.
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters()),
                        max_grad_norm=1.0, profile=transformer_profile)
    assert not plan.update_in_backward and any("clipping by global norm" in note for note in plan.notes)


def test_remove_gives_the_gradients_back_to_the_loop(transformer_profile):
    """After oomless.remove the same optimizer steps after backward again, continuing bit-equal."""
    model, inputs, loss_fn = _transformer()
    reference = copy.deepcopy(model)
    reference_optimizer, optimizer = torch.optim.Adam(reference.parameters()), torch.optim.Adam(model.parameters())
    step_hooks_before = dict(optimizer._optimizer_step_pre_hooks)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                profile=transformer_profile)
    _train(reference, reference_optimizer, inputs, loss_fn, steps=2)
    _train(model, optimizer, inputs, loss_fn, steps=2)
    oomless.remove(model)
    assert dict(optimizer._optimizer_step_pre_hooks) == step_hooks_before
    assert all(not param._post_accumulate_grad_hooks for param in model.parameters())
    _train(reference, reference_optimizer, inputs, loss_fn, steps=2)
    _train(model, optimizer, inputs, loss_fn, steps=2)
    for expected, actual in zip(reference.parameters(), model.parameters()):
        assert torch.equal(expected, actual) and torch.equal(expected.grad, actual.grad)


def _largest_gradient_bytes_alive(update_in_backward: bool) -> tuple[int, int, int]:
    """(most gradient bytes alive at once in one backward, all gradient bytes, the largest module's
    own parameters': a Linear's weight and bias are made together and stepped together)."""
    torch.manual_seed(0)
    model = MLP((256,) * 12)
    inputs = torch.randn(8, 256)
    optimizer = torch.optim.Adam(model.parameters())
    alive = []
    # Registered before oomless's hooks, so each runs while the gradient just accumulated still exists.
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda _: alive.append(
            sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)))
    if update_in_backward:
        oomless.fit(model, inputs, "1TiB", loss_fn=lambda out: out.square().mean(), optimizer=optimizer,
                    update_in_backward=True)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        alive.clear()
        model(inputs).square().mean().backward()
        optimizer.step()
    all_bytes = sum(param.nbytes for param in model.parameters())
    return max(alive), all_bytes, max(sum(param.nbytes for param in module.parameters(recurse=False))
                                      for module in model.modules())


def test_gradients_alive_at_once_drop_by_at_least_80_percent():
    plain_alive, all_bytes, largest = _largest_gradient_bytes_alive(update_in_backward=False)
    in_backward_alive, _, _ = _largest_gradient_bytes_alive(update_in_backward=True)
    assert plain_alive == all_bytes
    assert in_backward_alive == largest
    assert plain_alive - in_backward_alive >= 0.8 * all_bytes


def _child_peak(mode: str) -> dict:
    script = Path(__file__).with_name("update_in_backward_child.py")
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_resident_memory_drops_by_at_least_80_percent_of_the_gradients():
    """In a child process each: the step's peak resident-memory rise above the memory before it."""
    plain, in_backward = _child_peak("plain"), _child_peak("in_backward")
    drop = plain["peak_rise_bytes"] - in_backward["peak_rise_bytes"]
    print(f"\npeak rise plain {plain['peak_rise_bytes'] / 2**20:.1f} MiB, in backward "
          f"{in_backward['peak_rise_bytes'] / 2**20:.1f} MiB; gradients {plain['gradient_bytes'] / 2**20:.1f} MiB")
    assert drop >= 0.8 * plain["gradient_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_equal_and_the_peak_drops_by_the_gradients():
    """CUDA: Adam's default foreach path per parameter equals it over all parameters; the truth for
    memory is the allocator's peak above what the step started with (gradients freed first)."""
    def run(update_in_backward: bool):
        torch.manual_seed(0)
        model = MLP((1024,) * 17).cuda()
        inputs = torch.randn(8, 1024, device="cuda")
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        if update_in_backward:
            oomless.fit(model, inputs, "1TiB", loss_fn=lambda out: out.square().mean(), optimizer=optimizer,
                        update_in_backward=True)
        rises = []
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(inputs).square().mean().backward()
            optimizer.step()
            rises.append(torch.cuda.max_memory_allocated() - start)
        return model, optimizer, max(rises[1:])         # the first step also allocates Adam's state

    reference, reference_optimizer, plain_rise = run(False)
    model, optimizer, in_backward_rise = run(True)
    gradient_bytes = sum(param.nbytes for param in model.parameters())
    _assert_same_training(reference, reference_optimizer, model, optimizer)
    assert plain_rise - in_backward_rise >= 0.8 * gradient_bytes


class _Gate(torch.nn.Module):
    """Gates by another module's weight without its gradient: detached by reference (the holder a
    plain list, or a ModuleList that registers the weight under the gate too), given detached as an
    argument, or a mask computed from it."""

    def __init__(self, width, head, read):
        super().__init__()
        self.linear, self.read = torch.nn.Linear(width, width), read
        self.holder = torch.nn.ModuleList([head]) if read == "registered" else [head]

    def forward(self, inputs, reference=None):
        weight = self.holder[0].weight
        if self.read == "mask":
            return self.linear(inputs) * (inputs @ (weight.abs() > 0.05).float().t())
        if reference is None:
            reference = weight.detach()
        return self.linear(inputs) * torch.sigmoid(inputs @ reference.t())


class _GatedByALaterWeight(torch.nn.Module):
    def __init__(self, width=32, read="by-reference"):
        super().__init__()
        self.stem, self.head, self.out = (torch.nn.Linear(width, width), torch.nn.Linear(width, width),
                                          torch.nn.Linear(width, 1))
        self.gate = _Gate(width, self.head, read)
        self.as_argument = read == "as-argument"

    def forward(self, inputs):
        hidden = self.stem(inputs)
        gated = self.gate(hidden, self.head.weight.detach()) if self.as_argument else self.gate(hidden)
        return self.out(self.head(gated))


@pytest.mark.parametrize("read", ["by-reference", "as-argument", "registered", "mask"])
@pytest.mark.parametrize("gate", ["keep", "swap", "recompute"])
def test_a_weight_read_outside_its_gradients_path_is_updated_after_that_read(gate, read):
    """The gate reads head's weight detached, and backward reaches the gate (its matmul's saved
    weight; its recompute) after head's weight has its whole gradient. Plain PyTorch updates after
    backward, so the gate's backward reads the old weight; so must the plan's (it updated head
    before: 3e-6 to 7e-6 off after three steps under swap and recompute, silently). head's update
    waits for the end of backward; the others' still run in backward."""
    torch.manual_seed(0)
    model, inputs = _GatedByALaterWeight(read=read), torch.randn(64, 32)
    reference = copy.deepcopy(model)
    reference.gate.holder[0] = reference.head
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, reference))
    oomless.fit(model, inputs, "1TiB", loss_fn=lambda out: out.square().mean(), optimizer=optimizer,
                update_in_backward=True, min_swap_bytes=0, blocks=["stem", "gate", "head", "out"],
                decisions={"stem": "keep", "gate": gate, "head": "keep", "out": "keep"})
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    _assert_same_training(reference, reference_optimizer, model, optimizer)
    update = installed_update(model)
    # A mask of the weight saves no alias of it: only its recompute reads the weight again.
    assert update.reads.deferred == (set() if read == "mask" and gate != "recompute" else {model.head.weight})
    assert update.steps_in_backward == STEPS * len(dict.fromkeys(model.parameters()))


class _FailsOnce(torch.nn.Module):
    """Between mid and head: its backward raises once, after head's and out's updates in backward."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, inputs):
        return RaisesInBackward.apply(inputs) if self.armed else inputs


class _Chain(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.stem, self.mid = torch.nn.Linear(width, width), torch.nn.Sequential(torch.nn.Linear(width, width),
                                                                                   torch.nn.GELU())
        self.fails, self.head, self.out = _FailsOnce(), torch.nn.Linear(width, width), torch.nn.Linear(width, 1)

    def forward(self, inputs):
        return self.out(torch.tanh(self.head(self.fails(self.mid(torch.relu(self.stem(inputs)))))))


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_a_backward_that_raised_and_was_skipped_lets_training_go_on(policy):
    """The loop that recovers from an out-of-memory error (fairseq's): a backward raises, the loop
    zeroes the gradients and goes on to the next batch without optimizer.step(). The update in backward
    had already stepped the modules whose gradients were complete before the error (head and out here):
    that cannot be undone, so a warning says so, and training goes on (the next backward raised
    InputError before: "got a gradient after its update in backward"). The reference is plain PyTorch
    stepping those same modules with that batch's gradients: equal bit for bit after three more steps."""
    torch.manual_seed(0)
    model, batches = _Chain(), [torch.randn(64, 32) for _ in range(5)]
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    oomless.fit(model, batches[0], "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                min_swap_bytes=0, blocks=["stem", "mid", "fails", "head", "out"],
                decisions={"stem": policy, "mid": policy, "fails": "keep", "head": policy, "out": "keep"})
    for step, batch in enumerate(batches):
        reference_optimizer.zero_grad()
        loss_fn(reference(batch)).backward()
        if step == 1:
            for param in [*reference.stem.parameters(), *reference.mid.parameters()]:
                param.grad = None       # the failed backward had not reached them
        reference_optimizer.step()

        optimizer.zero_grad()
        model.fails.armed = step == 1
        if step == 1:
            updated = r"a backward that raised had already updated 4 parameters \(head.weight, head.bias, out.weight, out.bias\)"
            with pytest.warns(UserWarning, match=updated):
                with pytest.raises(RuntimeError, match="simulated out of memory"):
                    loss_fn(model(batch)).backward()
                optimizer.zero_grad()
                model.fails.armed = False
                loss_fn(model(batches[2])).backward()     # the warning comes with the next backward
            optimizer.step()
            continue
        if step == 2:
            continue    # trained above, right after the failure
        loss_fn(model(batch)).backward()
        optimizer.step()
    _assert_same_training(reference, reference_optimizer, model, optimizer)


class _ReentrantChain(_Chain):
    def forward(self, inputs):
        hidden = torch.utils.checkpoint.checkpoint(self.mid, torch.relu(self.stem(inputs)), use_reentrant=True)
        return self.out(torch.tanh(torch.utils.checkpoint.checkpoint(self.head, hidden, use_reentrant=True)))


def test_a_models_own_reentrant_checkpoint_is_one_backward_not_a_failed_one(recwarn):
    """A reentrant checkpoint (Hugging Face's gradient checkpointing before transformers 4.35) runs a
    backward inside backward, with its own graph task: the outer one has not ended, and is not taken
    for one that raised (its counts would start again in the middle of the step)."""
    torch.manual_seed(0)
    model, inputs = _ReentrantChain(), torch.randn(64, 32)
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True)
    _train(reference, reference_optimizer, inputs, loss_fn)
    _train(model, optimizer, inputs, loss_fn)
    _assert_same_training(reference, reference_optimizer, model, optimizer)
    assert installed_update(model).steps_in_backward == STEPS * 8
    assert not [warning for warning in recwarn if "backward that raised" in str(warning.message)]


def test_a_recompute_blocks_reads_are_recorded_by_a_call_that_completes():
    """A recompute block's reads of other modules' weights are recorded at its first call; a first call
    that raised (out of memory on the first batch, skipped by the loop) recorded none, head was
    updated in backward before the gate's recompute read its weight: 1.3e-5 off plain after four
    steps, silently. The first call that completes records them."""
    torch.manual_seed(0)
    model, batches = _GatedByALaterWeight(), [torch.randn(64, 32) for _ in range(5)]
    reference = copy.deepcopy(model)
    reference.gate.holder[0] = reference.head
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, reference))
    loss_fn = lambda out: out.square().mean()   # noqa: E731
    oomless.fit(model, batches[0], "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                blocks=["stem", "gate", "head", "out"],
                decisions={"stem": "keep", "gate": "recompute", "head": "keep", "out": "keep"})
    failing = model.gate.linear.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        model(batches[0])
    failing.remove()
    optimizer.zero_grad()
    for batch in batches[1:]:
        for trained, trained_optimizer in ((reference, reference_optimizer), (model, optimizer)):
            trained_optimizer.zero_grad()
            loss_fn(trained(batch)).backward()
            trained_optimizer.step()
    _assert_same_training(reference, reference_optimizer, model, optimizer)
    assert installed_update(model).reads.deferred == {model.head.weight}


def _accumulating_loop(model, optimizer, batches, fail, set_to_none=True):
    """Two micro-batches per step; ``fail(step, micro_batch)``: "forward" raises in the forward (the
    loop zeroes the gradients and skips the step), "backward" arms ``model.fails`` (the loop steps
    with what it has, as after a last micro-batch lost)."""
    loss_fn = lambda out: out.square().mean() / 2     # noqa: E731
    for step in range(len(batches) // 2):
        optimizer.zero_grad(set_to_none=set_to_none)
        for micro_batch in range(2):
            how = fail(step, micro_batch)
            model.fails.armed = how == "backward"
            try:
                if how == "forward":
                    raise RuntimeError("simulated out of memory in forward")
                loss_fn(model(batches[2 * step + micro_batch])).backward()
            except RuntimeError:
                if how == "forward":
                    optimizer.zero_grad(set_to_none=set_to_none)
                    break
            if how == "backward" or micro_batch == 1:
                optimizer.step()
        model.fails.armed = False


@pytest.mark.parametrize("how, set_to_none", [("forward", True), ("forward", False), ("backward", True)],
                         ids=["forward", "forward-zeroed-in-place", "backward"])
def test_accumulation_after_a_lost_micro_batch_equals_plain_pytorch(how, set_to_none):
    """accumulation_steps=2. A step's second micro-batch fails in its forward and the loop skips the
    step (zero_grad): the count of micro-batches went on from the first one, and the next step's
    first micro-batch was taken for the second (every parameter stepped with half a step's gradient,
    silently), its second refused. Or it fails in backward and the loop steps with what it has, as
    plain PyTorch does: refused ("optimizer.step() after 1 of accumulation_steps=2"). zero_grad with
    set_to_none=False zeroes the gradients in place: seen by their version and values."""
    torch.manual_seed(0)
    model, batches = _Chain(), [torch.randn(64, 32) for _ in range(8)]
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    oomless.fit(model, batches[0], "1TiB", loss_fn=lambda out: out.square().mean(), optimizer=optimizer,
                update_in_backward=True, accumulation_steps=2)
    fail = lambda step, micro_batch: how if (step, micro_batch) == (1, 1) else None     # noqa: E731
    _accumulating_loop(reference, reference_optimizer, batches, fail, set_to_none)
    _accumulating_loop(model, optimizer, batches, fail, set_to_none)
    if not set_to_none:     # the plain loop's zeroed gradients stay; the plan's were consumed
        reference_optimizer.zero_grad()
    _assert_same_training(reference, reference_optimizer, model, optimizer)
