"""Training under any plan gives the same parameters, gradients and buffers as plain PyTorch.

Each case trains a deepcopy with plain PyTorch and the planned model with the same seeds for two
optimizer steps, then compares bit for bit (`torch.equal`).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import oomless
from oomless.models import MLP, DictOutputModel, SmallCNN, TinyTransformer, UNet3D
from tests.conftest import needs_selective, plan_under, train_steps


def _mlp():
    # A batch whose activations (10 MiB) outweigh the gradients (1.1 MiB) and the ~10 MiB of working
    # memory a CPU profile measures at the loss: with 512 rows (2.5 MiB) the smallest plan was within
    # 0.8 MiB of plain's peak here and above it on CI, leaving the planner nothing to choose.
    return MLP((64, 256, 256, 256, 256, 256, 10)), torch.randn(2048, 64), lambda out: out.square().mean()


def _cnn():
    return SmallCNN(in_channels=3, num_classes=10), torch.randn(16, 3, 32, 32), lambda out: out.logsumexp(1).mean()


def _unet():
    volume = torch.randn(4, 1, 16, 16, 16)
    return UNet3D(base_channels=4, depth=2), volume, lambda out: F.cross_entropy(out, (volume[:, 0] > 0).long())


def _transformer():
    tokens = torch.randint(0, 256, (8, 32))
    return (TinyTransformer(vocab_size=256, dim=64, depth=3, heads=4, max_len=32),
            tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.roll(-1, 1).flatten()))


def _dict_output():
    return DictOutputModel(in_features=64, hidden=256, out_features=8), torch.randn(32, 64), \
        lambda out: out["logits"].square().mean() + out["aux"].mean()


MODELS = {"mlp": _mlp, "cnn": _cnn, "unet3d": _unet, "transformer": _transformer, "dict": _dict_output}


def _train(model, inputs, loss_fn, steps=2):
    return train_steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), inputs, loss_fn, steps)


def _assert_same(reference, trained):
    for (name, expected), (_, actual) in zip(reference.named_parameters(), trained.named_parameters()):
        assert torch.equal(expected, actual), f"parameter {name} differs"
        assert torch.equal(expected.grad, actual.grad), f"gradient of {name} differs"
    for (name, expected), (_, actual) in zip(reference.named_buffers(), trained.named_buffers()):
        assert torch.equal(expected, actual), f"buffer {name} differs"


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("policy", ["keep", "swap", "recompute", "selective", "planned"])
def test_training_equals_plain_pytorch(model_name, policy):
    if policy == "selective":
        needs_selective()
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[model_name]()
    reference = copy.deepcopy(model)
    plan, memory = plan_under(model, inputs, loss_fn, policy)
    if policy == "planned":
        if memory < plan.plain_peak_bytes:
            assert set(plan.decisions.values()) != {"keep"}, "the budget should force swaps or recomputes"
        else:
            assert model_name == "dict", "only the two-block dict model has nothing to gain from a plan"
    oomless.apply(model, plan)

    _train(reference, inputs, loss_fn)
    _train(model, inputs, loss_fn)

    _assert_same(reference, model)
    stats = oomless.stats(model)
    if policy == "swap":
        assert stats.offloaded_bytes > 0
    if policy == "recompute":
        assert stats.recomputed_blocks >= 2 * len(plan.decisions) - 2
    if policy == "selective":
        assert any(block.selective for block in plan.blocks), "some block should be offered selective recompute"
        assert stats.recomputed_blocks >= 2 * len(plan.decisions) - 2


def test_remove_restores_the_model_exactly():
    torch.manual_seed(0)
    model, inputs, loss_fn = _cnn()
    before = copy.deepcopy(model.state_dict())
    hooks_before = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn)
    oomless.remove(model)
    assert not hasattr(model, "_oomless")
    for name, module in model.named_modules():
        assert (dict(module._forward_hooks), dict(module._forward_pre_hooks)) == hooks_before[name]
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


class _Scaled(torch.nn.Module):
    """A block called with a tensor, a number and a flag, positionally and by keyword."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x, scale, shift=None, square=False):
        y = torch.tanh(self.linear(x)) * scale
        y = y + shift if shift is not None else y
        return y.square() if square else y


class _CallsWithArguments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = _Scaled(), _Scaled()

    def forward(self, x):
        return self.second(self.first(x, 0.5, square=True), 2.0, shift=x)


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_blocks_called_with_numbers_flags_and_keywords_equal_plain_pytorch(policy):
    """The recompute calls each block again with its arguments as given: tensors (the recompute's
    own inputs), numbers, flags and None in their places, positional or by keyword."""
    torch.manual_seed(0)
    model, inputs = _CallsWithArguments(), torch.randn(8, 32)
    loss_fn = lambda out: out.square().mean()     # noqa: E731
    reference = copy.deepcopy(model)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0,
                        decisions={"first": policy, "second": policy})
    oomless.apply(model, plan)
    _train(reference, inputs, loss_fn)
    _train(model, inputs, loss_fn)
    _assert_same(reference, model)
    if policy == "recompute":
        assert oomless.stats(model).recomputed_blocks >= 2


def _spectral_normed(called_twice: bool):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Linear(32, 64)
            self.normed = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(64, 64))
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x):
            h = torch.tanh(self.normed(torch.tanh(self.stem(x))))
            return self.head(torch.tanh(self.normed(h)) if called_twice else h)
    return Model()


@pytest.mark.parametrize("called_twice", [False, True], ids=["once", "called-twice"])
def test_a_recomputed_block_that_changes_the_buffers_it_reads_equals_plain_pytorch(called_twice):
    """Spectral norm's power iteration reads its vectors (buffers) and writes them in every training
    forward: the recompute normalised the weight by the estimate the forward left (3e-2 off plain
    PyTorch after three steps, silently). Each call's recompute starts from the buffers its call
    started from; called twice, each call from its own."""
    torch.manual_seed(0)
    model, inputs = _spectral_normed(called_twice), torch.randn(128, 32)
    loss_fn = lambda out: out.square().mean()     # noqa: E731
    reference = copy.deepcopy(model)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, blocks=["stem", "normed", "head"],
                        decisions={"stem": "keep", "normed": "recompute", "head": "keep"})
    oomless.apply(model, plan)
    _train(reference, inputs, loss_fn, steps=3)
    _train(model, inputs, loss_fn, steps=3)
    _assert_same(reference, model)
    assert oomless.stats(model).recomputed_blocks >= 3


class _Smoothed(torch.nn.Module):
    """Shifts its output by an average of its inputs kept in a buffer (read by the add, which saves
    nothing, so plain PyTorch may change it after; tanh saves the result): updated in place
    (``"in-place"``), only from its second call on (``"delayed"``), or replaced (``"replaced"``:
    ``self.average = ...``)."""

    def __init__(self, how):
        super().__init__()
        self.linear, self.how = torch.nn.Linear(32, 32), how
        self.register_buffer("average", torch.ones(32))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = torch.tanh(self.linear(x) + self.average)
        if self.training:
            new = 0.9 * self.average + 0.1 * x.detach().abs().mean(0)
            if self.how == "replaced":
                self.average = new
            elif self.how == "in-place" or self.calls > 0:
                self.average.copy_(new)
            self.calls += 1
        return out


@pytest.mark.parametrize("how", ["in-place", "delayed", "replaced"])
def test_a_recomputed_block_whose_forward_reads_and_updates_a_buffer_equals_plain_pytorch(how):
    """The recompute reads the buffer as its call found it (each call's own copy, or the object it
    replaced), and after backward the buffer is as the forward left it: value and object."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), _Smoothed(how), torch.nn.Linear(32, 1))
    inputs, loss_fn = torch.randn(64, 16), (lambda out: out.square().mean())
    reference = copy.deepcopy(model)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, blocks=["0", "1", "2"],
                decisions={"0": "keep", "1": "recompute", "2": "keep"})
    _train(reference, inputs, loss_fn, steps=3)
    _train(model, inputs, loss_fn, steps=3)
    _assert_same(reference, model)


def test_a_spectral_norm_set_to_eval_then_train_inside_a_recomputed_block_equals_plain_pytorch():
    """Which buffers a forward changes depends on every submodule's mode, not the block's alone."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(32, 32)), torch.nn.Tanh())
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), block, torch.nn.Linear(32, 1))
    inputs, loss_fn = torch.randn(64, 16), (lambda out: out.square().mean())
    reference = copy.deepcopy(model)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, blocks=["0", "1", "2"],
                decisions={"0": "keep", "1": "recompute", "2": "keep"})
    for net in (reference, model):
        net[1][0].eval()
        _train(net, inputs, loss_fn, steps=1)
        net[1][0].train()
        _train(net, inputs, loss_fn, steps=2)
    _assert_same(reference, model)


@pytest.mark.parametrize("rows", [8, 1024], ids=["small", "large"])
def test_a_buffer_another_module_changes_after_a_recomputed_blocks_call(rows):
    """A queue registered in the block and in its parent, which appends to it after the block's call
    (MoCo): the recompute read the new queue (wrong gradients, silently, before). A small one is
    copied at every call, so the recompute reads it as the call did: as plain PyTorch; a large one
    (128 KiB) is not, and the recompute is refused."""
    class Head(torch.nn.Module):
        def __init__(self, queue):
            super().__init__()
            self.linear = torch.nn.Linear(32, 32)
            self.register_buffer("queue", queue)

        def forward(self, x):
            return torch.tanh(self.linear(x) + self.queue.mean(0))    # the mean saves no queue

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("queue", torch.randn(rows, 32))    # appended to after the head's call
            self.stem, self.head = torch.nn.Linear(16, 32), Head(self.queue)

        def forward(self, x):
            hidden = self.stem(x)
            out = self.head(hidden)
            with torch.no_grad():
                self.queue.copy_(torch.roll(self.queue, 1, 0))
                self.queue[0] = hidden[0]
            return out

    torch.manual_seed(0)
    model, inputs, loss_fn = Model(), torch.randn(64, 16), (lambda out: out.square().mean())
    reference = copy.deepcopy(model)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, blocks=["stem", "head"],
                decisions={"stem": "keep", "head": "recompute"})
    if rows == 8:
        _train(reference, inputs, loss_fn, steps=3)
        _train(model, inputs, loss_fn, steps=3)
        _assert_same(reference, model)
        return
    loss_fn(reference(inputs)).backward()      # plain PyTorch trains it
    with pytest.raises(RuntimeError, match=r"buffer\(s\) \['queue'\] of block head.*changed in place after"):
        loss_fn(model(inputs)).backward()


def _with_hook_before_the_plan(kind: str) -> torch.nn.Module:
    """A block whose module had a forward pre-hook before the plan was applied: an input transform
    (returns new arguments), or the deprecated hook-based weight_norm / spectral_norm (each computes
    the module's weight from its parameters in its pre-hook; Hugging Face's wav2vec2 falls back to
    the first, HiFi-GAN and GAN code use both)."""
    torch.manual_seed(0)
    hooked = torch.nn.Linear(64, 64)
    if kind == "input-transform":
        hooked.register_forward_pre_hook(lambda module, args: (args[0] * 2 + 1,))
    elif kind == "global-input-transform":
        hooked.transformed = True
    elif kind == "weight_norm":
        hooked = torch.nn.utils.weight_norm(hooked)
    else:
        hooked = torch.nn.utils.spectral_norm(hooked)
    nn = torch.nn
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), hooked, nn.Tanh(), nn.Linear(64, 1))


def _transform_marked(module, args):
    return (args[0] * 2 + 1,) if getattr(module, "transformed", False) else None


@pytest.mark.parametrize("kind", ["input-transform", "global-input-transform", "weight_norm", "spectral_norm"])
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_a_forward_pre_hook_registered_before_the_plan_runs_once_per_call(kind, policy):
    """Such a hook runs before the plan's own pre-hook, so outside the recompute's checkpoint: its
    result (the new arguments, the module's weight) is the call's, from the graph outside the block.
    The recompute ran it again: the input transformed twice (wrong gradients, silently), the weight
    computed again inside the checkpoint (torch's CheckpointError: other saved tensors). The
    recompute runs only what the call ran inside the checkpoint."""
    # Made twice: a module under the hook-based weight_norm cannot be deep-copied (its weight is no leaf).
    model, reference, inputs = _with_hook_before_the_plan(kind), _with_hook_before_the_plan(kind), torch.randn(128, 32)
    loss_fn = lambda out: out.square().mean()     # noqa: E731
    names = [name for name, _ in model.named_children()]
    # A global pre-hook (register_module_forward_pre_hook) runs before every module's own.
    handle = torch.nn.modules.module.register_module_forward_pre_hook(_transform_marked)
    try:
        oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, blocks=names,
                    decisions={name: policy if name == "2" else "keep" for name in names})
        _train(reference, inputs, loss_fn, steps=3)
        _train(model, inputs, loss_fn, steps=3)
    finally:
        handle.remove()
    _assert_same(reference, model)
    if policy == "recompute":
        assert oomless.stats(model).recomputed_blocks >= 3


class _ScaledPerCall(torch.nn.Linear):
    def forward(self, x):
        return torch.tanh(super().forward(x) * self.scale)


class _PerCall(torch.nn.Module):
    """Called twice in one forward. ``kind``: a pre-hook from before the plan sets a scale for each
    call that the forward reads (a plain attribute); or the hook-based spectral norm sets the weight
    for each call, its power iteration one step on at the second."""

    def __init__(self, kind):
        super().__init__()
        self.stem, self.head = torch.nn.Linear(32, 64), torch.nn.Linear(64, 1)
        if kind == "scale-per-call":
            self.shared = _ScaledPerCall(64, 64)
            self.shared.register_forward_pre_hook(
                lambda module, args: setattr(module, "scale", float(args[0].abs().mean())))
        else:
            self.shared = torch.nn.utils.spectral_norm(torch.nn.Linear(64, 64))
        self.kind = kind

    def forward(self, x):
        hidden = torch.tanh(self.stem(x))
        if self.kind == "scale-per-call":
            return self.head(torch.tanh(self.shared(hidden * 3) + self.shared(hidden)))
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(hidden)))))


@pytest.mark.parametrize("kind", ["scale-per-call", "spectral_norm"])
def test_a_recompute_reads_the_attributes_its_call_read(kind):
    """The recompute of the first call ran with what the second call's pre-hook left on the module:
    the second call's scale (2e-2 off plain PyTorch), spectral norm's next weight (7e-4)."""
    torch.manual_seed(0)
    model, inputs = _PerCall(kind), torch.randn(128, 32)
    torch.manual_seed(0)
    reference = _PerCall(kind)     # made twice: the hook-based spectral_norm cannot be deep-copied
    loss_fn = lambda out: out.square().mean()     # noqa: E731
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, blocks=["stem", "shared", "head"],
                decisions={"stem": "keep", "shared": "recompute", "head": "keep"})
    _train(reference, inputs, loss_fn, steps=3)
    _train(model, inputs, loss_fn, steps=3)
    _assert_same(reference, model)


def test_a_recompute_under_functional_call_reads_the_parameters_and_buffers_given():
    """torch.func.functional_call (MAML's fast weights) puts parameters and buffers in for the forward
    and the module's own back before backward: the recompute ran with the module's own (gradients
    2e-2 off plain PyTorch, silently)."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(),
                                                           nn.Linear(32, 32)), nn.Linear(32, 1))
    reference, inputs = copy.deepcopy(model), torch.randn(64, 16)
    oomless.fit(model, inputs, "1TiB", loss_fn=lambda out: out.square().mean(), blocks=["0", "1", "2"],
                decisions={"0": "keep", "1": "recompute", "2": "keep"}, min_swap_bytes=0)
    for trained in (reference, model):
        fast = {name: parameter * 1.5 for name, parameter in trained.named_parameters()}
        fast |= {name: buffer + 0.5 for name, buffer in trained.named_buffers() if buffer.is_floating_point()}
        torch.func.functional_call(trained, fast, (inputs,)).square().mean().backward()
    _assert_same(reference, model)


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_quantization_aware_training_from_fresh_observers_equals_plain_pytorch(policy):
    """``prepare_qat``'s per-channel observers start with empty buffers that take their shape at the
    first forward: planning's steps could not put them back (a bare RuntimeError on the sizes)."""
    quantization = pytest.importorskip("torch.ao.quantization")

    def prepared():
        torch.manual_seed(0)
        nn = torch.nn
        model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 1))
        model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
        return quantization.prepare_qat(model.train(), inplace=True)

    model, reference, inputs = prepared(), prepared(), torch.randn(64, 16)
    loss_fn = lambda out: out.square().mean()     # noqa: E731
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, blocks=["0", "1", "2"],
                decisions={"0": "keep", "1": policy, "2": "keep"})
    _train(reference, inputs, loss_fn, steps=3)
    _train(model, inputs, loss_fn, steps=3)
    _assert_same(reference, model)
