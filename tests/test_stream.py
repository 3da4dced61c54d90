"""The outer level of a U-shaped model streamed in slabs (runtime/stream.py, split={"": slabs}).

Not bit-equal to the unstreamed step, for the reasons tests/test_split.py gives (normalisation
statistics and weight gradients are sums in another order): within 1e-5 relative.
"""

import copy
import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import oomless
from oomless.errors import ApplyError, InputError
from oomless.models.unet3d import UNet3D
from oomless.runtime import slabs as slabs_module
from oomless.runtime.rows import HostRows
from oomless.runtime.split import apply_split, remove_split, split_names, stream_candidate
from oomless.runtime.stream import STREAM, is_streamed, outer_level

from tests.conftest import FakeFloors, train_steps


@pytest.fixture
def thin_slabs(monkeypatch):
    monkeypatch.setattr(slabs_module, "ONEDNN_MIN_INPUT_ELEMENTS", 0)


def _loss(volume):
    target = (volume[:, 0] > 0).long()
    return lambda output: F.cross_entropy(output, target)


@pytest.mark.parametrize("fused", [True, False])
def test_a_streamed_unet_trains_like_plain_pytorch(thin_slabs, monkeypatch, fused):
    """Also with the ReLUs of normalisations taken back through autograd (``fused`` off)."""
    monkeypatch.setattr(slabs_module, "FUSED_NORMALISED_RELU", fused)
    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    reference = copy.deepcopy(model)
    volume = torch.randn(2, 1, 16, 16, 16)
    loss_fn = _loss(volume)
    plan = oomless.plan(model, volume, "4GiB", loss_fn=loss_fn, split=True)
    # Streamed, and the chains below the outer level split (those at it run inside the stream).
    assert plan.split == {STREAM: 16, "encoders.1": 16, "encoders.2": 16, "decoders.0": 16}
    # The outer level's modules run inside the stream, in slabs: they are no blocks of the plan.
    assert not any(name.startswith(("encoders.0", "decoders.1", "head")) for name in plan.decisions)
    oomless.apply(model, plan)
    assert is_streamed(model) and split_names(model) == plan.split
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, optimizer, volume, loss_fn, steps=3)
    train_steps(reference, reference_optimizer, volume, loss_fn, steps=3)
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        if value.is_floating_point():     # BatchNorm's running statistics too: they move once per step
            assert (value - expected).abs().max() <= 1e-5 * max(expected.abs().max().item(), 1.0), name
        else:
            assert torch.equal(value, expected), name
    with pytest.raises(InputError, match="divisible by 4"):     # the model's own input check still runs
        model(torch.randn(1, 1, 14, 16, 16))
    oomless.remove(model)
    assert type(model) is UNet3D and list(model.state_dict()) == list(reference.state_dict())


def test_each_gradient_path_of_the_outer_encoder_is_taken_once(thin_slabs):
    """The outer encoder's parameters get gradient through the skip (in the decoder's slabs) and
    through the downsampling (in the encoder's): one step's gradients equal plain PyTorch's."""
    torch.manual_seed(1)
    model = UNet3D(base_channels=4, depth=1)
    reference = copy.deepcopy(model)
    volume = torch.randn(1, 1, 12, 8, 6)
    apply_split(model, {STREAM: 5})
    weights = torch.randn(1, 2, 12, 8, 6)
    (model(volume) * weights).sum().backward()
    (reference(volume) * weights).sum().backward()
    for (name, parameter), other in zip(model.named_parameters(), reference.parameters()):
        assert (parameter.grad - other.grad).abs().max() <= 1e-5 * other.grad.abs().max() + 1e-5, name
    remove_split(model)


def test_streamed_models_of_one_class_share_one_streamed_class():
    """Streaming swaps the model's class for a subclass made once per model class: two streamed U-Nets,
    and one streamed again after removal, have the same type (torch.compile's guards and pickling by
    class name see one class; applying and removing in a loop creates no classes)."""
    first, second = UNet3D(base_channels=4, depth=1), UNet3D(base_channels=4, depth=1)
    apply_split(first, {STREAM: 5})
    apply_split(second, {STREAM: 5})
    streamed = type(first)
    assert streamed is type(second) and streamed is not UNet3D and isinstance(first, UNet3D)
    remove_split(first)
    assert type(first) is UNet3D
    apply_split(first, {STREAM: 5})
    assert type(first) is streamed
    remove_split(first)
    remove_split(second)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x, y):
        return self.conv(x) + y


class _NoDownsampling(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv3d(2, 1, 3, padding=1))


class _Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x):
        return self.conv(x) if x.sum() > 0 else x


@pytest.mark.parametrize("model, reason", [
    (_TwoInputs(), "more than one input"),
    (_NoDownsampling(), "leaves the input's resolution 0 times"),
    (_Branching(), "torch.fx cannot trace"),
])
def test_what_cannot_stream_says_why(model, reason):
    assert reason in stream_candidate(model)
    with pytest.raises(ApplyError, match="outer level"):
        apply_split(model, {STREAM: 4})
    assert not is_streamed(model)


def test_the_planner_streams_the_outer_level_where_the_floor_is():
    """plan/splitting.py, with profiling and planning replaced by fakes that say which floor each
    set of split chains has: a floor in an inner block splits its chains; one at the outer level
    streams it, in place of its chains split so far."""
    model = UNet3D(base_channels=4, depth=2)
    floors = {(): ("encoders.1.3", 100), ("encoders.1",): ("decoders.1.conv.0", 95),
              ("encoders.1", STREAM): ("encoders.2.0", 90), ("encoders.1", STREAM, "encoders.2"): ("pool", 70)}
    fakes = FakeFloors(floors, memory=75)
    asked, plan_profile, profile_split = fakes.asked, fakes.plan_profile, fakes.profile_split

    from oomless.plan.splitting import plan_splitting_the_floor
    first = oomless.PlanError("too small", minimum_bytes=100, floor_block="encoders.1.3")
    made = plan_splitting_the_floor(model, first, plan_profile, profile_split)
    assert asked == [("encoders.1",), ("encoders.1", STREAM), ("encoders.1", STREAM, "encoders.2")]
    assert set(made.split) == {STREAM, "encoders.1", "encoders.2"} and "outer level (streamed)" in made.notes[-1]


class _SmallU(nn.Module):
    """conv -> pool -> mid -> up -> cat(skip) -> head: the smallest U; subclasses change its forward."""

    def __init__(self, channels: int = 2):
        super().__init__()
        self.conv = nn.Conv3d(1, channels, 3, padding=1)
        self.pool = nn.MaxPool3d(2)
        self.mid = nn.Conv3d(channels, channels, 3, padding=1)
        self.up = nn.ConvTranspose3d(channels, channels, 2, stride=2)
        self.head = nn.Conv3d(2 * channels, 2, 1)


class _DropoutBelow(_SmallU):
    def forward(self, x):
        y = self.conv(x)
        hidden = F.dropout(self.mid(self.pool(y)), 0.5, self.training)      # reads self.training
        return self.head(torch.cat([self.up(hidden), y], 1))


class _SkipBranch(_SmallU):
    """The skip from its own branch (with a BatchNorm), not from the pooling's input."""

    def __init__(self):
        super().__init__()
        self.branch = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2), nn.ReLU())

    def forward(self, x):
        hidden = self.mid(self.pool(self.conv(x)))
        return self.head(torch.cat([self.up(hidden), self.branch(x)], 1))


def test_eval_mode_and_a_skip_from_its_own_branch_stream_like_plain_pytorch(thin_slabs):
    torch.manual_seed(0)
    x = torch.randn(2, 1, 8, 6, 6)
    model = _DropoutBelow()
    reference = copy.deepcopy(model)
    apply_split(model, {STREAM: 4})
    model.eval(), reference.eval()
    with torch.no_grad():        # traced in training mode, run in eval: traced again, no dropout
        assert torch.allclose(model(x), reference(x), atol=1e-6) and torch.equal(model(x), model(x))
    model = _SkipBranch()
    reference = copy.deepcopy(model)
    apply_split(model, {STREAM: 4})
    model(x), reference(x)
    assert model.branch[1].num_batches_tracked == reference.branch[1].num_batches_tracked == 1
    assert torch.allclose(model.branch[1].running_mean, reference.branch[1].running_mean, atol=1e-6)


class _NormedU(_SmallU):
    """Two convolutions with BatchNorm at the outer level, the skip from the second; with
    ``detached`` the inner level's output is detached, so the outer encoder gets its gradient through
    the skip alone (the encoder's graph in slabs then never runs backward)."""

    def __init__(self, detached: bool = False):
        super().__init__()
        self.norm1, self.conv2, self.norm2 = nn.BatchNorm3d(2), nn.Conv3d(2, 2, 3, padding=1), nn.BatchNorm3d(2)
        self.detached = detached

    def forward(self, x):
        y = F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv(x))))))
        hidden = self.mid(self.pool(y))
        if self.detached:
            hidden = hidden.detach()
        return self.head(torch.cat([self.up(hidden), y], 1))


class _CountConvolutions(TorchDispatchMode):
    """Convolution calls by weight: forward ones, and backward ones."""

    def __init__(self, weights: dict):
        super().__init__()
        self.names = {weight.data_ptr(): name for name, weight in weights.items()}
        self.forward, self.backward = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.forward[self.names.get(args[1].data_ptr())] += 1
        elif func is torch.ops.aten.convolution_backward.default:
            self.backward[self.names.get(args[2].data_ptr())] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("detached", [False, True])
def test_the_decoder_reads_the_encoder_ops_the_encoder_kept_and_each_runs_once_backward(thin_slabs, monkeypatch,
                                                                                       detached, host, direct):
    """The outer encoder's convolutions run once per slab in forward (the decoder reads the
    normalisation inputs the encoder kept) and once forward and once backward per slab in backward:
    the gradients the decoder gives them through the skip are taken back with the encoder's own, by
    the encoder's graph; not forward again in backward where ``direct`` (`aten.convolution_backward`
    from each one's input rows). Where that graph's backward does not run (the inner level
    detached), the decoder takes them back itself. The gradients equal plain PyTorch's either way,
    with the kept nodes in files (as on CPU) or in host memory (``host``, as beside a GPU, here CPU
    tensors)."""
    monkeypatch.setattr(slabs_module, "DIRECT_CONVOLUTION_BACKWARD", direct)
    if host:
        monkeypatch.setattr(slabs_module, "row_store", lambda shape, dtype, device: HostRows(shape, dtype, device))
    torch.manual_seed(0)
    model = _NormedU(detached)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 1, 16, 6, 6)
    apply_split(model, {STREAM: 4})
    counted = _CountConvolutions({"conv": model.conv.weight, "conv2": model.conv2.weight})
    weights = torch.randn(2, 2, 16, 6, 6)
    with counted:
        output = model(x)
    forward = dict(counted.forward)
    with counted:
        (output * weights).sum().backward()
    (reference(x) * weights).sum().backward()
    assert forward["conv"] == forward["conv2"] == 4
    recomputed = {name: counted.forward[name] - forward[name] for name in ("conv", "conv2")}
    assert recomputed == ({"conv": 0, "conv2": 0} if direct else {"conv": 4, "conv2": 4})
    assert {name: counted.backward[name] for name in ("conv", "conv2")} == {"conv": 4, "conv2": 4}
    for (name, parameter), other in zip(model.named_parameters(), reference.parameters()):
        if other.grad is None:          # below the detached output
            assert parameter.grad is None and detached, name
            continue
        # 1e-4: a bias before a BatchNorm has a gradient of exactly zero, both sides rounding noise.
        assert (parameter.grad - other.grad).abs().max() <= 1e-5 * other.grad.abs().max() + 1e-4, name


class _TwoNormsOnOneConv(_SmallU):
    """The outer convolution's output normalised twice: for the pooling, and on its own for the skip
    (a normalisation of the decoder's own of a node the encoder keeps)."""

    def __init__(self):
        super().__init__()
        self.norm, self.skip_norm = nn.BatchNorm3d(2), nn.BatchNorm3d(2)

    def forward(self, x):
        h = self.conv(x)
        hidden = self.mid(self.pool(F.relu(self.norm(h))))
        return self.head(torch.cat([self.up(hidden), F.relu(self.skip_norm(h))], 1))


def test_a_node_the_decoder_normalises_itself_and_a_second_backward_equal_plain_pytorch(thin_slabs):
    """The decoder takes back the node it normalises itself with that normalisation's terms (the
    encoder takes back the rest); each graph's stores are closed after its backward (none left open
    while the output lives on), and a second backward (retain_graph) computes those nodes again."""
    torch.manual_seed(0)
    model = _TwoNormsOnOneConv()
    reference = copy.deepcopy(model)
    apply_split(model, {STREAM: 4})
    x = torch.randn(2, 1, 16, 6, 6, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    weights = torch.randn(2, 2, 16, 6, 6)
    descriptors = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    output, expected = model(x), reference(x_reference)
    for _ in range(2):
        (output * weights).sum().backward(retain_graph=True)
        (expected * weights).sum().backward(retain_graph=True)
        for (name, parameter), other in zip(model.named_parameters(), reference.parameters()):
            assert (parameter.grad - other.grad).abs().max() <= 1e-5 * other.grad.abs().max() + 1e-4, name
        assert (x.grad - x_reference.grad).abs().max() <= 1e-5 * x_reference.grad.abs().max()
        if descriptors is not None:
            assert len(os.listdir("/proc/self/fd")) == descriptors
    with pytest.raises(RuntimeError, match="differentiate twice"):     # no silent wrong double backward
        gradient, = torch.autograd.grad((model(x) * weights).sum(), x, create_graph=True)
        gradient.square().sum().backward()


class _StoresFeatures(_SmallU):
    def __init__(self):
        super().__init__()
        self.features = []

    def forward(self, x):
        y = self.conv(x)
        hidden = self.mid(self.pool(y))
        self.features.append(hidden)
        return self.head(torch.cat([self.up(hidden), y], 1))


class _InPlaceOnTheSkip(_SmallU):
    def forward(self, x):
        y = self.conv(x)
        z = F.relu(y, inplace=True)             # the concatenation reads y after this wrote into it
        return self.head(torch.cat([self.up(self.mid(self.pool(z))), y], 1))


class _AboveTheInput(_SmallU):
    def __init__(self):
        super().__init__()
        self.larger = nn.ConvTranspose3d(2, 1, 2, stride=2)

    def forward(self, x):
        y = self.conv(x)
        return self.larger(self.head(torch.cat([self.up(self.mid(self.pool(y))), y], 1)))


def test_models_streaming_would_change_are_refused_and_left_as_they_were():
    stores = _StoresFeatures()
    assert "stores values on the model" in stream_candidate(stores) and stores.features == []
    assert "in-place op" in stream_candidate(_InPlaceOnTheSkip())
    assert "goes above the input's" in stream_candidate(_AboveTheInput())
    model = _SkipBranch()
    model.head.register_forward_hook(lambda module, inputs, output: output * 2)
    assert "hooks are registered on head" in stream_candidate(model)


class _PoolOnlyBranch(nn.Module):
    """``to_pool`` feeds only the pooling; the skip ``skip`` feeds the pooling's branch and the decoder."""

    def __init__(self):
        super().__init__()
        self.skip = nn.Conv3d(1, 2, 3, padding=1)
        self.to_pool = nn.Conv3d(2, 2, 3, padding=1)
        self.pool = nn.MaxPool3d(2)
        self.inner = nn.Conv3d(2, 2, 3, padding=1)
        self.up = nn.ConvTranspose3d(2, 2, 2, stride=2)
        self.out = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x):
        h = self.skip(x)
        below = self.up(self.inner(self.pool(self.to_pool(h))))
        return self.out(torch.cat([h, below], dim=1))


def test_the_decoder_computes_again_only_the_encoder_ops_it_reads():
    """The decoder's slabs recompute the skip's convolution (it reads it), never ``to_pool``, which
    only the pooling reads (through the level below, not through the decoder)."""
    found = outer_level(_PoolOnlyBranch(), set())
    assert [node.kind for node in found.encode.nodes] == ["input", "conv", "conv", "down"]
    assert [node.kind for node in found.decode.nodes] == ["input", "input", "conv", "up", "cat", "conv"]
