"""Chains computed in slabs (runtime/slabs.py, runtime/split.py, plan/splitting.py).

Splitting is not bit-equal to the unsplit ops: normalisation statistics and weight gradients are
sums over the whole volume taken in another order. The bound asserted is 1e-5 relative to the
largest value (float32 rounding of sums over ~1e5 terms; measured ~1e-6).
"""

import copy
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import oomless
from oomless.errors import ApplyError, InputError, PlanError
from oomless.models.unet3d import ConvStage, DecoderStage, UNet3D
from oomless.plan.splitting import (NEAR_FLOOR, WORKSPACE_SHARE, floor_is_a_workspace, plan_or_lowest_floor,
                                   plan_splitting_near_the_floor, plan_splitting_the_floor)
from oomless.profile.profile import BlockProfile
from oomless.runtime import slabs as slabs_module
from oomless.runtime.rows import HostRows
from oomless.runtime.slabs import SlabGraph, leaves, run_in_slabs
from oomless.runtime.split import DEFAULT_SLABS, apply_split, remove_split, split_candidates

from tests.conftest import FakeFloors, train_steps

TOLERANCE = 1e-5


@pytest.fixture
def thin_slabs(monkeypatch):
    """Slabs as thin as asked on these small volumes (on CPU a slab is otherwise kept thick enough for
    oneDNN's convolution, which at these sizes is the whole volume)."""
    monkeypatch.setattr(slabs_module, "ONEDNN_MIN_INPUT_ELEMENTS", 0)


# A convolution's bias followed by a normalisation on batch statistics has a gradient of exactly zero
# in exact arithmetic: both sides are rounding noise of sums over ~1e3 values of order 1.
NOISE = 1e-4


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() <= TOLERANCE * scale + NOISE


def _stage(norm: str, dilation: int = 1) -> nn.Sequential:
    stage = ConvStage(3, 6)
    if norm == "group":
        stage[1], stage[4] = nn.GroupNorm(2, 6), nn.GroupNorm(3, 6)
    elif norm == "instance":
        stage[1], stage[4] = nn.InstanceNorm3d(6, affine=True), nn.InstanceNorm3d(6)
    if dilation > 1:
        stage[3] = nn.Conv3d(6, 6, kernel_size=3, padding=dilation, dilation=dilation)
    return stage


def _store(monkeypatch, store: str) -> None:
    """Normalisation inputs kept in a file (as on CPU), in host memory (as beside a GPU, here with
    CPU tensors), or computed again ("none"); "autograd": in a file, each kept node computed again
    in backward and taken back through autograd (no direct convolution backward, no fused ReLU of a
    normalisation)."""
    monkeypatch.setattr(slabs_module, "STORE_NORMALISATION_INPUTS", store != "none")
    if store == "autograd":
        monkeypatch.setattr(slabs_module, "DIRECT_CONVOLUTION_BACKWARD", False)
        monkeypatch.setattr(slabs_module, "FUSED_NORMALISED_RELU", False)
    if store == "host":
        monkeypatch.setattr(slabs_module, "row_store", lambda shape, dtype, device: HostRows(shape, dtype, device))


@pytest.mark.parametrize("store", ["file", "host", "none", "autograd"])
@pytest.mark.parametrize("norm", ["batch", "group", "instance"])
@pytest.mark.parametrize("slabs", [1, 3, 5])
def test_a_chain_in_slabs_equals_the_unsplit_chain(thin_slabs, monkeypatch, norm, slabs, store):
    """With each normalisation's input kept off the device (``store``) or computed again."""
    _store(monkeypatch, store)
    torch.manual_seed(0)
    stage = _stage(norm, dilation=2 if slabs == 3 else 1)
    reference = copy.deepcopy(stage)
    x = torch.randn(2, 3, 13, 7, 6, requires_grad=True)          # 13 rows: slabs of unequal size
    x_reference = x.detach().clone().requires_grad_()
    weights = torch.randn(2, 6, 13, 7, 6)
    output = run_in_slabs(SlabGraph.chain(leaves(stage)), x, slabs)
    (output * weights).sum().backward()
    expected = reference(x_reference)
    (expected * weights).sum().backward()
    assert _close(output, expected)
    assert _close(x.grad, x_reference.grad)
    for (name, parameter), other in zip(stage.named_parameters(), reference.parameters()):
        assert _close(parameter.grad, other.grad), name
    for (name, buffer), other in zip(stage.named_buffers(), reference.buffers()):
        assert torch.equal(buffer, other) if not buffer.is_floating_point() else _close(buffer, other), name


def test_eval_mode_uses_the_running_statistics_and_leaves_them(thin_slabs):
    torch.manual_seed(0)
    stage = _stage("batch")
    stage(torch.randn(2, 3, 8, 5, 5))           # running statistics away from their initial values
    stage.eval()
    reference = copy.deepcopy(stage)
    x = torch.randn(1, 3, 11, 5, 5)
    with torch.no_grad():
        assert _close(run_in_slabs(SlabGraph.chain(leaves(stage)), x, 4), reference(x))
    for buffer, other in zip(stage.buffers(), reference.buffers()):
        assert torch.equal(buffer, other)


def test_chains_in_two_dimensions_and_an_input_without_gradient(thin_slabs):
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Conv2d(2, 4, 5, padding=2), nn.BatchNorm2d(4), nn.LeakyReLU(0.1), nn.Conv2d(4, 4, 1))
    reference = copy.deepcopy(chain)
    x = torch.randn(3, 2, 17, 9)
    output = run_in_slabs(SlabGraph.chain(leaves(chain)), x, 6)
    output.square().sum().backward()
    reference(x).square().sum().backward()
    for parameter, other in zip(chain.parameters(), reference.parameters()):
        assert _close(parameter.grad, other.grad)


def _assert_same_step(module, reference, inputs, slabs):
    """``module`` split into ``slabs`` and ``reference`` unsplit: same output, input, parameter gradients and buffers."""
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    reference_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    output = run_in_slabs(SlabGraph.of(module), tuple(inputs), slabs)
    expected = reference(*reference_inputs)
    weights = torch.randn_like(expected)
    (output * weights).sum().backward()
    (expected * weights).sum().backward()
    assert _close(output, expected)
    for x, other in zip(inputs, reference_inputs):
        assert x.grad is None if other.grad is None else _close(x.grad, other.grad)
        assert torch.equal(x, other)                            # no op wrote into an input
    for (name, parameter), other in zip(module.named_parameters(), reference.parameters()):
        assert _close(parameter.grad, other.grad), name
    for (name, buffer), other in zip(module.named_buffers(), reference.buffers()):
        assert torch.equal(buffer, other) if not buffer.is_floating_point() else _close(buffer, other), name


@pytest.mark.parametrize("store", ["file", "host", "none", "autograd"])
@pytest.mark.parametrize("norm", ["batch", "group"])
@pytest.mark.parametrize("slabs", [1, 3, 7])
def test_a_decoder_stage_in_slabs_equals_the_unsplit_stage(thin_slabs, monkeypatch, norm, slabs, store):
    """Upsample (transposed convolution, kernel = stride), concatenate the skip, a stage: a graph
    torch.fx traces; slab bounds at odd rows of the output fall inside an upsampled input row."""
    _store(monkeypatch, store)
    torch.manual_seed(0)
    stage = DecoderStage(6, 3, 3)
    if norm == "group":
        stage.conv[1], stage.conv[4] = nn.GroupNorm(3, 3), nn.GroupNorm(1, 3)
    graph = SlabGraph.of(stage)
    assert [node.kind for node in graph.nodes][:4] == ["input", "input", "up", "cat"]
    x, skip = torch.randn(2, 6, 5, 4, 3, requires_grad=True), torch.randn(2, 3, 10, 8, 6, requires_grad=True)
    _assert_same_step(stage, copy.deepcopy(stage), [x, skip], slabs)



@pytest.mark.parametrize("dimensions", [1, 2])
def test_upsampling_chains_in_one_and_two_dimensions_equal_the_unsplit_ones(thin_slabs, dimensions):
    """A transposed convolution's stride has one entry per spatial dimension: in one and two
    dimensions too the upsampled rows (and, in two, columns) are what the slabs are cut from."""
    torch.manual_seed(0)
    transposed, convolution = {1: (nn.ConvTranspose1d, nn.Conv1d), 2: (nn.ConvTranspose2d, nn.Conv2d)}[dimensions]
    chain = nn.Sequential(transposed(4, 4, 2, stride=2), nn.ReLU(), convolution(4, 3, 3, padding=1))
    x = torch.randn(2, 4, 9, 5)[(..., 0) if dimensions == 1 else ...].requires_grad_()
    assert [node.kind for node in SlabGraph.of(chain).nodes][:2] == ["input", "up"]
    _assert_same_step(chain, copy.deepcopy(chain), [x], 4)



def test_on_cpu_a_slab_after_an_upsampling_is_as_thick_as_onednn_needs_in_the_upsampled_shape():
    """A convolution's input slab needs ONEDNN_MIN_INPUT_ELEMENTS // (batch * channels * rows of the
    other axis) + 1 rows: counted in the shape the transposed convolution makes (its stride along
    the other axis, 1 in one dimension), so 10000 rows (1D) allow 1 slab and 1300 x 8 (2D, stride
    (2, 1)) allow 2."""
    cases = [(nn.ConvTranspose1d(4, 4, 2, stride=2), nn.Conv1d(4, 4, 3, padding=1), torch.randn(1, 4, 5000),
              10000 // (slabs_module.ONEDNN_MIN_INPUT_ELEMENTS // (4 * 1) + 1)),
             (nn.ConvTranspose2d(4, 4, (2, 1), stride=(2, 1)), nn.Conv2d(4, 4, 3, padding=1), torch.randn(1, 4, 650, 8),
              1300 // (slabs_module.ONEDNN_MIN_INPUT_ELEMENTS // (4 * 8) + 1))]
    assert [expected for *_, expected in cases] == [1, 2]
    for up, convolution, x, expected in cases:
        graph = SlabGraph.of(nn.Sequential(up, convolution))
        assert slabs_module._most_slabs(graph, 1, graph.shapes((x,)), torch.device("cpu")) == expected


def test_on_cpu_a_convolution_too_thin_for_onednn_even_whole_sets_no_limit_on_slabs():
    """Batch 1, 8 channels, 48 x 48 rows: 1 x 8 x 48 x 48 = 18432 elements, under oneDNN's threshold
    whole, so PyTorch runs its im2col convolution (a buffer of 27 x the input) whatever the slabs:
    thin slabs shrink that buffer, and the chain takes as many as it has rows. At batch 2 the slabs
    keep today's thickness for oneDNN (PyTorch keeps any batch over 1 on oneDNN whatever the
    thickness, so that limit is needless there; lifting it changes every batch-2 split plan and waits
    for a measurement of its own)."""
    chain = nn.Sequential(nn.Conv3d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.Conv3d(8, 8, 3, padding=1))
    graph = SlabGraph.of(chain)
    thin = torch.randn(1, 8, 48, 48, 48)
    assert 1 * 8 * 48 * 48 <= slabs_module.ONEDNN_MIN_INPUT_ELEMENTS < 2 * 8 * 48 * 48
    assert slabs_module._most_slabs(graph, 1, graph.shapes((thin,)), torch.device("cpu")) == 48
    thick = torch.randn(2, 8, 48, 48, 48)
    assert slabs_module._most_slabs(graph, 2, graph.shapes((thick,)), torch.device("cpu")) == \
        48 // (slabs_module.ONEDNN_MIN_INPUT_ELEMENTS // (2 * 8 * 48) + 1)


class _ThinVolumeNet(nn.Module):
    """Two stages of 8 channels at batch 1: every convolution too thin for oneDNN, so unsplit each
    holds an im2col buffer of 27 x its input (the SegResNet case at 48^3 on CPU)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(1, 8, 3, padding=1)
        self.stages = nn.ModuleList(nn.Sequential(nn.Conv3d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
                                                  nn.Conv3d(8, 8, 3, padding=1)) for _ in range(2))
        self.head = nn.Conv3d(8, 2, 1)

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = x + stage(x)
        return self.head(x)


def test_the_budget_a_plan_at_one_byte_names_is_the_lower_of_unsplit_and_every_chain_split():
    """Asked for 1 byte (a user's way to ask for the floor), `plan` names the split floor where it is
    below the smallest budget without splitting (the rounds split the chains that set each floor:
    here both stages), and says what that was; given back, that budget plans the chains split."""
    torch.manual_seed(0)
    model, volume = _ThinVolumeNet(), torch.randn(1, 1, 32, 32, 32)
    target = torch.randint(0, 2, (1, 32, 32, 32))
    loss_fn = lambda out: F.cross_entropy(out, target)      # noqa: E731
    with pytest.raises(PlanError) as unsplit:
        oomless.plan(model, volume, 1, loss_fn=loss_fn, split=False)
    with pytest.raises(PlanError) as chosen:
        oomless.plan(model, volume, 1, loss_fn=loss_fn)
    assert chosen.value.minimum_bytes < unsplit.value.minimum_bytes
    said = re.search(r"\(with (.*) computed in slabs; without: smallest budget", str(chosen.value))
    assert said and sorted(said.group(1).split(", ")) == ["stages.0", "stages.1"], str(chosen.value)
    plan = oomless.plan(model, volume, chosen.value.minimum_bytes, loss_fn=loss_fn)
    assert plan.split and plan.memory_bytes == chosen.value.minimum_bytes


def test_every_chain_is_split_at_the_floor_only_where_that_floor_is_a_kernels_workspace():
    """`floor_is_a_workspace`: the block setting the floor holds, in a phase, more than WORKSPACE_SHARE
    times its input and output bytes as working memory (an im2col buffer), not a chain's whole tensors."""
    mib = 2**20
    profile = SimpleNamespace(blocks=[BlockProfile(name="stage", input_bytes=mib, output_bytes=mib,
                                                   forward_other_bytes=3 * mib, backward_other_bytes=17 * mib)])
    assert WORKSPACE_SHARE == 8 and floor_is_a_workspace(profile, "stage")
    profile.blocks[0].backward_other_bytes = 15 * mib
    assert not floor_is_a_workspace(profile, "stage")
    assert not floor_is_a_workspace(profile, "another") and not floor_is_a_workspace(profile, None)


def test_every_chain_split_plans_where_it_fits_else_the_lower_refusal_is_raised():
    """plan/splitting.py's `plan_or_lowest_floor` with fakes: one measurement with every chain split;
    a plan where it fits, else its refusal where it names less, else the refusal of the step measured
    once more as it was."""
    floors = {(): ("encoders.1.3", 100), ("encoders.0", "encoders.1"): ("pool", 60)}
    fakes = FakeFloors(floors, memory=1)
    first = PlanError("too small", minimum_bytes=100, floor_block="encoders.1.3")
    everything = {"encoders.0": DEFAULT_SLABS, "encoders.1": DEFAULT_SLABS}
    with pytest.raises(PlanError) as lower:
        plan_or_lowest_floor(first, {}, everything, fakes.plan_profile, fakes.profile_split)
    assert lower.value.minimum_bytes == 60 and lower.value.profile == ("encoders.0", "encoders.1")
    assert "every chain (2) computed in slabs" in str(lower.value) and fakes.asked == [("encoders.0", "encoders.1")]
    fakes.memory = 70
    made = plan_or_lowest_floor(first, {}, everything, fakes.plan_profile, fakes.profile_split)
    assert made.split == everything and "every chain" in made.notes[-1]
    fakes.memory = 1
    floors[("encoders.0", "encoders.1")] = ("pool", 100)
    # Not lower: the step without splitting is measured again (after the split step, which left its
    # caches held), and its refusal raised.
    fakes.asked.clear()
    with pytest.raises(PlanError) as again:
        plan_or_lowest_floor(first, {}, everything, fakes.plan_profile, fakes.profile_split)
    assert again.value.minimum_bytes == 100 and again.value.profile == ()
    assert fakes.asked == [("encoders.0", "encoders.1"), ()]
    # Measured again as it was, a refusal of split chains still says which, and the floor without them.
    floors[("encoders.1",)] = ("encoders.1.3", 100)
    split = PlanError("too small", minimum_bytes=100, floor_block="encoders.1.3")
    split.note_split("with encoders.1 computed in slabs; without: smallest budget 1.00 KiB")
    with pytest.raises(PlanError) as noted:
        plan_or_lowest_floor(split, {"encoders.1": DEFAULT_SLABS}, everything, fakes.plan_profile, fakes.profile_split)
    assert noted.value.split_note == split.split_note and str(noted.value).endswith(f"({split.split_note})")

    def out_of_memory(chains):
        raise torch.OutOfMemoryError("the split step did not fit")
    with pytest.raises(PlanError) as same:
        plan_or_lowest_floor(first, {}, everything, fakes.plan_profile, out_of_memory)
    assert same.value is first


class _CountClones(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.clones = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.clones += func is torch.ops.aten.clone.default
        return func(*args, **(kwargs or {}))


class _CountConvolutions(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forward += func is torch.ops.aten.convolution.default
        self.backward += func is torch.ops.aten.convolution_backward.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("norm", ["batch", "group"])
def test_each_convolution_runs_once_per_slab_in_forward_and_once_more_in_backward(thin_slabs, monkeypatch, norm,
                                                                                  direct):
    """Each normalisation's input is kept off the device once computed, and the gradient reaching it
    beside it: a stage of two convolutions, each followed by a normalisation, runs each convolution
    once per slab in forward and once backward per slab in backward, not forward again (``direct``:
    `aten.convolution_backward` from its input's rows), or, computing each again first as
    checkpointing would, once forward and once backward per slab. (Computed again from the stage's
    input for each normalisation's statistics, the first convolution ran 3 times per slab in forward
    and 5 in backward.) The gradients equal plain PyTorch's either way."""
    monkeypatch.setattr(slabs_module, "DIRECT_CONVOLUTION_BACKWARD", direct)
    stage = _stage(norm)
    reference = copy.deepcopy(stage)
    x = torch.randn(2, 3, 13, 7, 6, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    weights = torch.randn(2, 6, 13, 7, 6)
    slabs = 4
    with _CountConvolutions() as forward:
        output = run_in_slabs(SlabGraph.chain(leaves(stage)), x, slabs)
    with _CountConvolutions() as backward:
        (output * weights).sum().backward()
    assert (forward.forward, forward.backward) == (2 * slabs, 0)
    assert (backward.forward, backward.backward) == (0 if direct else 2 * slabs, 2 * slabs)
    (reference(x_reference) * weights).sum().backward()
    assert _close(x.grad, x_reference.grad)
    for (name, parameter), other in zip(stage.named_parameters(), reference.parameters()):
        assert _close(parameter.grad, other.grad), name


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [True, False])
def test_a_relu_of_a_normalisation_is_taken_back_in_place_into_reused_buffers(thin_slabs, monkeypatch, fused):
    """conv-norm-ReLU-conv-norm-ReLU in slabs: in backward the second convolution's input,
    ReLU(norm(first convolution's kept output)), is written into a reused buffer (addcmul.out) and
    its gradient taken back in place (threshold_backward into the convolution's input gradient);
    the output's ReLU needs one new tensor per slab (the gradient handed in is not its to write).
    Through autograd (``fused`` off) each is a new slab-sized tensor. The gradients equal plain
    PyTorch's either way."""
    monkeypatch.setattr(slabs_module, "FUSED_NORMALISED_RELU", fused)
    torch.manual_seed(0)
    stage = _stage("batch")
    reference = copy.deepcopy(stage)
    x = torch.randn(2, 3, 13, 7, 6, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    weights = torch.randn(2, 6, 13, 7, 6)
    slabs = 4
    output = run_in_slabs(SlabGraph.chain(leaves(stage)), x, slabs)
    with _CountOps() as counted:
        (output * weights).sum().backward()
    calls = counted.calls
    if fused:
        assert (calls["aten.addcmul.out"], calls["aten.addcmul.default"]) == (2 * slabs, 0)
        assert (calls["aten.threshold_backward.grad_input"], calls["aten.threshold_backward.default"]) == (slabs, slabs)
    else:
        assert (calls["aten.addcmul.out"], calls["aten.addcmul.default"]) == (0, 2 * slabs)
        assert (calls["aten.threshold_backward.grad_input"], calls["aten.threshold_backward.default"]) == (0, 2 * slabs)
    (reference(x_reference) * weights).sum().backward()
    assert _close(x.grad, x_reference.grad)
    for (name, parameter), other in zip(stage.named_parameters(), reference.parameters()):
        assert _close(parameter.grad, other.grad), name


class _SkipTwice(nn.Module):
    """A convolution with a bias reading one node twice, concatenated; its output kept and also added."""

    def __init__(self):
        super().__init__()
        self.c1, self.n1, self.c2, self.n2 = (nn.Conv3d(2, 3, 3, padding=1), nn.BatchNorm3d(3),
                                              nn.Conv3d(6, 3, 3, padding=1), nn.BatchNorm3d(3))

    def forward(self, x):
        h = F.relu(self.n1(self.c1(x)))
        c = self.c2(torch.cat([h, h], 1))
        return F.relu(self.n2(c)) + c


class _Positive(nn.Module):
    def forward(self, weight):
        return F.softplus(weight)


def _unusual(case: str) -> nn.Module:
    if case == "one node concatenated twice":
        return _SkipTwice()
    if case == "grouped convolution":
        return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
                             nn.Conv3d(4, 4, 3, padding=1, groups=2), nn.BatchNorm3d(4), nn.ReLU())
    if case == "frozen weight, trained bias":
        chain = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
                              nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU())
        chain[3].weight.requires_grad_(False)
        return chain
    chain = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.Conv3d(4, 3, 3, padding=1))
    torch.nn.utils.parametrize.register_parametrization(chain[1], "weight", _Positive())
    return chain


@pytest.mark.parametrize("paths", ["direct and fused", "direct", "autograd"])
@pytest.mark.parametrize("case", ["one node concatenated twice", "grouped convolution", "frozen weight, trained bias",
                                  "parametrized normalisation weight"])
def test_unusual_graphs_in_slabs_equal_plain_pytorch_on_every_backward_path(thin_slabs, monkeypatch, case, paths):
    """Found by reading the direct convolution backward and the fused ReLU of a normalisation
    (each failed there, not through autograd): a bias counted once when a concatenation reads one
    node twice; a grouped convolution's weight gradient; a frozen weight with a trained bias (on
    CPU convolution_backward returns the weight's gradient with the bias's, asked for or not); a
    parametrized normalisation weight's original."""
    monkeypatch.setattr(slabs_module, "DIRECT_CONVOLUTION_BACKWARD", paths != "autograd")
    monkeypatch.setattr(slabs_module, "FUSED_NORMALISED_RELU", paths == "direct and fused")
    torch.manual_seed(0)
    model = _unusual(case)
    reference = copy.deepcopy(model)
    graph = SlabGraph.of(model)
    assert graph is not None
    x = torch.randn(2, 2, 6, 4, 4, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    output = run_in_slabs(graph, x, 3)
    weights = torch.randn(output.shape)
    (output * weights).sum().backward()
    (reference(x_reference) * weights).sum().backward()
    assert _close(x.grad, x_reference.grad)
    for (name, parameter), other in zip(model.named_parameters(), reference.parameters()):
        assert (parameter.grad is None) == (other.grad is None), name
        if other.grad is not None:
            assert _close(parameter.grad, other.grad), name


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_frozen_first_convolution_or_a_normalised_input_without_gradient(thin_slabs, norm_first):
    """Nothing before a kept node needs a gradient (the first convolution frozen, or a normalisation
    of the graph's input, which needs none): that node is not taken back further, and the rest equals
    plain PyTorch."""
    torch.manual_seed(0)
    ops = [nn.Conv3d(4, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1),
           nn.BatchNorm3d(4), nn.ReLU()]
    chain = nn.Sequential(*([nn.BatchNorm3d(4)] + ops[3:] if norm_first else ops))
    chain[0].requires_grad_(norm_first)
    reference = copy.deepcopy(chain)
    x, weights = torch.randn(2, 4, 8, 6, 6), torch.randn(2, 4, 8, 6, 6)
    (run_in_slabs(SlabGraph.chain(leaves(chain)), x, 4) * weights).sum().backward()
    (reference(x) * weights).sum().backward()
    for (name, parameter), other in zip(chain.named_parameters(), reference.parameters()):
        assert (parameter.grad is None) == (other.grad is None), name
        if other.grad is not None:
            assert _close(parameter.grad, other.grad), name


def test_an_in_place_op_in_slabs_writes_into_the_slabs_it_made_without_a_copy(thin_slabs):
    """An in-place activation writes into a slab the chain made itself: no copy (a copy per slab of
    every in-place op would cost a slab's bytes and a pass over them)."""
    x = torch.randn(2, 3, 13, 7, 6, requires_grad=True)
    stage = ConvStage(3, 6)            # Conv3d, BatchNorm3d, ReLU(inplace=True), twice
    with _CountClones() as counted:
        run_in_slabs(SlabGraph.chain(leaves(stage)), x, 4)
    assert counted.clones == 0


class _WriteSeenOutside(nn.Module):
    """An in-place op whose write a reader after it sees: the graph's caller (``returned``: the value
    returned, written into after the op that made it) or an op reached through an alias (an Identity)."""

    def __init__(self, returned: bool):
        super().__init__()
        self.returned = returned
        self.conv1, self.norm, self.alias = nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.Identity()
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.norm(self.conv1(x))
        if self.returned:
            F.relu(y, inplace=True)     # its result unused: y itself is changed
            return y
        F.relu(self.alias(y), inplace=True)
        return self.conv2(y)


class _HeadOnStem(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.head = nn.Sequential(nn.ReLU(inplace=True), nn.Conv3d(2, 2, 3, padding=1))

    def forward(self, x):
        hidden = self.stem(x)
        return self.head(hidden) + hidden       # plain PyTorch adds ReLU(hidden): the head changed it


def test_an_in_place_write_seen_after_the_op_is_no_chain(thin_slabs):
    """In slabs each op writes a new slab, so a write another reader would see in plain PyTorch is
    lost: into the chain's input (the caller's tensor: a head's leading ReLU(inplace=True) changes
    the stem output its caller adds; in slabs it did not, and the sum differed by 1.4), into the
    value the chain returns, or into a value read through an alias. Those are refused."""
    assert SlabGraph.of(nn.Sequential(nn.ReLU(inplace=True), nn.Conv3d(3, 6, 3, padding=1))) is None
    assert SlabGraph.of(nn.Sequential(nn.Identity(), nn.ReLU(inplace=True), nn.Conv3d(3, 6, 3, padding=1))) is None
    assert SlabGraph.of(_WriteSeenOutside(returned=True)) is None
    assert SlabGraph.of(_WriteSeenOutside(returned=False)) is None
    assert split_candidates(_HeadOnStem()) == ["stem", "head.1"]
    # An in-place op on what the chain made and nothing else reads stays a chain.
    assert SlabGraph.of(nn.Sequential(nn.Conv3d(3, 6, 3, padding=1), nn.Identity(), nn.ReLU(inplace=True),
                                      nn.Dropout(0.0, inplace=True))) is not None
    torch.manual_seed(0)
    model, x = _HeadOnStem(), torch.randn(1, 1, 8, 5, 5)
    reference = copy.deepcopy(model)
    oomless.apply(model, oomless.plan(model, x, "4GiB", loss_fn=lambda out: out.square().sum(), split=True))
    assert _close(model(x), reference(x))


class _Residual(nn.Module):
    """A residual unit: its input feeds a convolution path (with an in-place activation) and the
    addition, with halos of 1 and 2 rows on the way; a function applied after the addition."""

    def __init__(self, channels: int, shared_inplace: bool = False):
        super().__init__()
        self.shared_inplace = shared_inplace
        self.act = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv3d(channels, channels, 3, padding=1)
        self.norm = nn.InstanceNorm3d(channels, affine=True)
        self.conv2 = nn.Conv3d(channels, channels, 5, padding=2)

    def forward(self, x):
        hidden = self.conv1(x)
        if self.shared_inplace:     # the addition reads hidden after the activation changed it
            return self.conv2(self.act(hidden)) + hidden
        return F.relu(self.conv2(self.act(self.norm(hidden))) + x)


def test_a_residual_unit_and_a_single_convolution_in_slabs_equal_the_unsplit_ones(thin_slabs):
    torch.manual_seed(0)
    unit = _Residual(3)
    _assert_same_step(unit, copy.deepcopy(unit), [torch.randn(2, 3, 11, 5, 4, requires_grad=True)], 4)
    head = nn.Conv3d(4, 2, 3, padding=1)
    _assert_same_step(head, copy.deepcopy(head), [torch.randn(1, 4, 9, 6, 6, requires_grad=True)], 5)
    # An input that needs no gradient gets none.
    head = nn.Conv3d(4, 2, 1)
    _assert_same_step(head, copy.deepcopy(head), [torch.randn(1, 4, 9, 6, 6)], 3)


class _Conditioned(nn.Module):
    """A residual unit conditioned on an embedding of shape (N, C, 1, 1, 1), added to its volume (broadcast)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.norm = nn.Conv3d(channels, channels, 3, padding=1), nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv3d(channels, channels, 3, padding=1)

    def forward(self, x, embedding):
        return self.conv2(F.relu(self.norm(self.conv1(x))) + embedding) + x


class _ConditionedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.embed = nn.Conv3d(1, 4, 3, padding=1), nn.Linear(3, 4)
        self.unit, self.head = _Conditioned(4), nn.Conv3d(4, 2, 1)

    def forward(self, x):
        embedding = self.embed(torch.ones(x.shape[0], 3)).reshape(x.shape[0], 4, 1, 1, 1)
        return self.head(self.unit(self.stem(x), embedding))


def test_an_addition_that_broadcasts_one_row_along_the_axis_runs_in_slabs(thin_slabs):
    """A chain adding an input of one row along the axis (a conditioning embedding) to its volume:
    ``split=True`` picked it and the step raised ("adds tensors of different spatial sizes ...
    remove the split"); that input is read whole by every slab, and its gradient summed over them."""
    torch.manual_seed(0)
    unit = _Conditioned(4)
    _assert_same_step(unit, copy.deepcopy(unit), [torch.randn(2, 4, 9, 5, 5, requires_grad=True),
                                                  torch.randn(2, 4, 1, 1, 1, requires_grad=True)], 4)
    model, x = _ConditionedModel(), torch.randn(2, 1, 8, 6, 6)
    reference = copy.deepcopy(model)
    plan = oomless.plan(model, x, "4GiB", loss_fn=lambda out: out.square().mean(), split=True)
    assert "unit" in plan.split
    oomless.apply(model, plan)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, lambda out: out.square().mean())
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), x,
                lambda out: out.square().mean())
    for (name, parameter), other in zip(model.named_parameters(), reference.parameters()):
        assert _close(parameter, other), name


class _SkipIfTensor(nn.Module):
    """A decoder stage as MONAI's BasicUNet writes it (UpCat): the skip concatenated only where it is a
    tensor, which the tracer's proxy is not."""

    def __init__(self):
        super().__init__()
        self.upsample = nn.ConvTranspose3d(4, 2, kernel_size=2, stride=2)
        self.convs = nn.Sequential(nn.Conv3d(4, 2, 3, padding=1), nn.BatchNorm3d(2), nn.ReLU())

    def forward(self, x, skip):
        x = self.upsample(x)
        if isinstance(skip, torch.Tensor):
            x = torch.cat([skip, x], dim=1)
        return self.convs(x)


def test_a_trace_that_never_reads_an_input_is_no_chain(thin_slabs):
    """Traced, the stage above never read its skip: split, it raised "expected input ... to have 32
    channels, but got 16" (or, where the channels matched, would have dropped the skip). The stage
    inside it is still a chain."""
    assert SlabGraph.of(_SkipIfTensor()) is None
    assert split_candidates(nn.ModuleDict({"up": _SkipIfTensor()})) == ["up.upsample", "up.convs"]


class _Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x) if x.sum() > 0 else x       # data-dependent: torch.fx cannot trace it


class _Mean(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x) - x.mean()                  # a whole-volume reduction


class _CatAlongDepth(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x, y):
        return self.conv(torch.cat([x, y], dim=2))


def test_graphs_that_cannot_run_in_slabs_are_refused():
    assert SlabGraph.of(_Residual(2)) is not None
    assert SlabGraph.of(_Residual(2, shared_inplace=True)) is None      # order matters: not a graph
    assert SlabGraph.of(_Branching()) is None
    assert SlabGraph.of(_Mean()) is None
    assert SlabGraph.of(_CatAlongDepth()) is None
    assert SlabGraph.of(nn.ConvTranspose3d(2, 2, kernel_size=3, stride=2)) is None     # overlapping rows
    assert SlabGraph.of(nn.ConvTranspose3d(2, 2, kernel_size=2, stride=2)) is not None
    assert SlabGraph.of(nn.ModuleList([nn.Conv3d(2, 2, 3, padding=1)])) is None
    model = UNet3D(base_channels=4, depth=1)
    apply_split(model, {"decoders.0": 2})
    with pytest.raises(InputError, match="positional inputs"):
        model.decoders[0](torch.randn(1, 8, 2, 4, 4), skip=torch.randn(1, 4, 4, 8, 8))
    remove_split(model)


def test_what_cannot_run_in_slabs_is_no_chain():
    assert SlabGraph.chain(leaves(nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Dropout(0.2)))) is None
    assert SlabGraph.chain(leaves(nn.Sequential(nn.Conv3d(1, 2, 3, stride=2, padding=1), nn.ReLU()))) is None
    assert SlabGraph.chain(leaves(nn.Sequential(nn.Conv3d(1, 2, 3, padding=0), nn.ReLU()))) is None
    assert SlabGraph.chain(leaves(nn.Sequential(nn.ReLU(), nn.Tanh()))) is None        # no convolution: nothing to gain
    # Stages, whole decoder stages (upsample, concatenate, stage: traced with torch.fx) and the head.
    assert split_candidates(UNet3D(depth=2)) == ["encoders.0", "encoders.1", "encoders.2", "decoders.0",
                                                  "decoders.1", "head"]


def test_padding_same_runs_in_slabs_where_it_is_symmetric(thin_slabs):
    """padding="same" (MONAI's and Keras-style models) is int padding where dilation x (kernel - 1) is
    even on every axis; "valid" with a kernel of one row along D keeps the size too. Equal to the
    unsplit chain; an even kernel's "same" (padded on the right alone) is no chain."""
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Conv3d(2, 4, 3, padding="same"), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.Conv3d(4, 4, (5, 3, 1), padding="same", dilation=(2, 1, 1)), nn.ReLU(),
                          nn.Conv3d(4, 3, (1, 3, 3), padding="valid"))
    reference = copy.deepcopy(chain)
    x = torch.randn(2, 2, 19, 7, 6, requires_grad=True)
    _assert_same_step(chain, reference, (x,), 4)
    assert SlabGraph.chain(leaves(nn.Sequential(nn.Conv3d(2, 2, 2, padding="same"), nn.ReLU()))) is None
    assert SlabGraph.chain(leaves(nn.Sequential(nn.Conv3d(2, 2, 3, padding="valid"), nn.ReLU()))) is None


class _ProbabilitiesInEval(nn.Module):
    """A segmentation head whose forward reads ``self.training``: logits to train on, probabilities in eval."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 2, 3, padding=1)

    def forward(self, x):
        logits = self.conv(x)
        return logits if self.training else torch.sigmoid(logits)


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_a_chain_whose_forward_reads_its_mode_runs_as_that_mode_traces_it(thin_slabs, traced_in):
    """Traced once, when split, the forward's Python ran in that mode: in the other the chain
    returned the logits in eval mode (off by 34 in this case); it is traced again when the mode changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(1, 3, 1), _ProbabilitiesInEval())
    model.train(traced_in == "train")
    reference = copy.deepcopy(model)
    apply_split(model, {"1": 3})
    x = torch.randn(2, 1, 9, 5, 5)
    for mode in (traced_in != "train", traced_in == "train", traced_in != "train"):
        model.train(mode), reference.train(mode)
        with torch.no_grad():
            assert _close(model(x), reference(x)), f"training={mode}"
    remove_split(model)


def test_split_is_a_transform_in_place_and_remove_undoes_it():
    model = UNet3D(base_channels=4, depth=2)
    names = list(model.state_dict())
    original = type(model.encoders[0])
    apply_split(model, {"encoders.0": 4})
    assert type(model.encoders[0]) is not original and isinstance(model.encoders[0], original)
    assert list(model.state_dict()) == names
    called = []
    model.encoders[0][0].register_forward_hook(lambda *args: called.append(1))
    model(torch.randn(1, 1, 8, 8, 8))
    assert not called                  # its children do not run: the chain computes their ops itself
    remove_split(model)
    assert type(model.encoders[0]) is original
    model(torch.randn(1, 1, 8, 8, 8))
    assert called


def test_a_split_unet_trains_like_plain_pytorch(thin_slabs):
    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    reference = copy.deepcopy(model)
    volume = torch.randn(2, 1, 16, 16, 16)
    target = (volume[:, 0] > 0).long()

    def loss_fn(output):
        return F.cross_entropy(output, target)

    plan = oomless.plan(model, volume, "4GiB", loss_fn=loss_fn, split={name: 4 for name in split_candidates(model)})
    assert set(plan.split) == set(split_candidates(model))
    oomless.apply(model, plan)
    assert all(type(model.get_submodule(name)).__name__.startswith("Split") for name in plan.split)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, optimizer, volume, loss_fn, steps=3)
    train_steps(reference, reference_optimizer, volume, loss_fn, steps=3)
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        if value.is_floating_point():
            assert (value - expected).abs().max() <= 1e-4 * max(expected.abs().max().item(), 1.0), name
        else:
            assert torch.equal(value, expected), name
    oomless.remove(model)
    assert not any(type(module).__name__.startswith("Split") for module in model.modules())
    assert oomless.Plan.from_json(plan.to_json()).split == plan.split


def test_bad_split_requests_are_refused():
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(1, 1, 8, 8, 8)
    with pytest.raises(ApplyError, match="not chains"):
        oomless.plan(model, volume, "1GiB", split={"pool": 4})
    with pytest.raises(InputError, match="cannot be planned for a target device"):
        oomless.plan(model, volume, "80GiB", split=True, target="h100")
    with pytest.raises(InputError, match="split must be"):
        oomless.plan(model, volume, "1GiB", split="yes")
    with pytest.raises(InputError, match="inside encoders.0"):
        oomless.plan(model, volume, "1GiB", split={"encoders.0": 2}, blocks=["encoders.0.0", "head"])
    assert type(model.encoders[0]) is ConvStage            # nothing left split after a refusal


def test_the_planner_splits_the_chains_of_the_block_that_sets_the_floor():
    """plan/splitting.py's choice, with profiling and planning replaced by fakes that say which
    floor each set of split chains has."""
    model = UNet3D(base_channels=4, depth=2)
    # Floors in blocks below the outer level (there, tests/test_stream.py: the planner streams it).
    floors = {(): ("encoders.1.3", 100), ("encoders.1",): ("encoders.2.0", 80),
              ("encoders.1", "encoders.2"): ("pool", 70)}
    fakes = FakeFloors(floors, memory=75)
    asked, plan_profile, profile_split = fakes.asked, fakes.plan_profile, fakes.profile_split

    first = PlanError("too small", minimum_bytes=100, floor_block="encoders.1.3")
    made = plan_splitting_the_floor(model, first, plan_profile, profile_split)
    assert asked == [("encoders.1",), ("encoders.1", "encoders.2")]
    assert made.split == {"encoders.1": DEFAULT_SLABS, "encoders.2": DEFAULT_SLABS}
    # Where splitting never fits and never lowers the floor below the first, the first error stands.
    floors[("encoders.1",)] = ("pool", 120)
    with pytest.raises(PlanError) as error:
        plan_splitting_the_floor(model, first, plan_profile, profile_split)
    assert error.value is first


def test_a_profile_measured_split_plans_split(thin_slabs):
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(1, 1, 16, 16, 16)
    measured = oomless.profile(model, volume, loss_fn=oomless.sum_of_outputs, split={"encoders.0": 4})
    assert measured.split == {"encoders.0": 4}
    assert "encoders.0" in [block.name for block in measured.blocks]     # one block: its ops do not run alone
    assert type(model.encoders[0]) is ConvStage                           # profiling left the model unsplit
    plan = oomless.plan(model, volume, "4GiB", loss_fn=oomless.sum_of_outputs, profile=measured)
    assert plan.split == {"encoders.0": 4}


def test_near_the_floor_the_planner_splits_where_that_lowers_the_floor():
    """plan/splitting.py: a budget within NEAR_FLOOR of the smallest budget without splitting is planned
    split where splitting lowers the floor; far from it, or where splitting does not lower it, the
    plan without splitting stands (fakes say the floor of each set of split chains)."""
    model = UNet3D(base_channels=4, depth=2)
    floors = {(): ("encoders.1.3", 100), ("encoders.1",): ("encoders.2.0", 80)}
    fakes = FakeFloors(floors, memory=105)
    asked, plan_profile, profile_split = fakes.asked, fakes.plan_profile, fakes.profile_split

    unsplit = plan_profile(())
    made = plan_splitting_near_the_floor(model, unsplit, (), plan_profile, profile_split)
    assert made.split == {"encoders.1": DEFAULT_SLABS} and asked == [("encoders.1",)]
    assert "within 10%" in made.notes[-1]
    # Far from the floor: nothing measured again.
    asked.clear()
    roomy = plan_profile((), memory=NEAR_FLOOR * 100 + 1)
    assert plan_splitting_near_the_floor(model, roomy, (), plan_profile, profile_split) is roomy and not asked
    # Splitting raises the floor (thin slabs): the plan without splitting stands.
    floors[("encoders.1",)] = ("pool", 101)
    assert plan_splitting_near_the_floor(model, unsplit, (), plan_profile, profile_split) is unsplit
