"""Traced sequences of models written as users write them (issue 14, part 2; found by a user-style
fuzzer): each either computes the model's function bit for bit, cut anywhere, or is refused with an
`InputError` that says what to change. Every case here gave a silently different result, a raw error
at a cut, or left the model holding stand-in tensors before its fix.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oomless.errors import InputError
from oomless.parallel.block_sequence import Block, BlockSequence, sequence_for
from oomless.parallel.pipeline import stage_shapes
from oomless.parallel.traced import traced_sequence
from tests.test_traced_pipeline import _same_step


def _sum(output: torch.Tensor) -> torch.Tensor:
    return (output * torch.linspace(0.5, 1.5, output.numel()).reshape(output.shape)).sum()


def _every_cut_as_stages(model: nn.Module, inputs: tuple) -> None:
    """At every cut, the second stage run on a detached copy of what crosses (as a pipeline's receive
    gives it) and the first stage backpropagated from the gradients it sends back: the output and
    every parameter's gradient equal the model's, and no stage writes the tensor it received."""
    plain = copy.deepcopy(model)
    torch.manual_seed(3)
    expected = plain(*inputs)
    _sum(expected).backward()
    sequence = traced_sequence(model, inputs)
    for cut in range(1, len(sequence.blocks)):
        model.zero_grad(set_to_none=True)
        first, second = sequence.stage(0, cut), sequence.stage(cut, len(sequence.blocks))
        torch.manual_seed(3)
        sent = first(*inputs)
        sent = sent if isinstance(sent, tuple) else (sent,)
        received = tuple(tensor.detach().requires_grad_(tensor.requires_grad) for tensor in sent)
        produced = second(*received)
        _sum(produced).backward()
        torch.autograd.backward([t for t in sent if t.requires_grad],
                                [r.grad for r, t in zip(received, sent) if t.requires_grad])
        assert torch.equal(produced, expected), cut
        for (name, parameter), reference in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(parameter.grad, reference.grad), (cut, name)


class _FillsASlice(nn.Module):
    """A tensor made from sizes alone, then written through a slice: not a constant to make again."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        buffer = torch.zeros(x.shape[0], 4)
        buffer[:, :2] = self.a(x)[:, :2]
        return self.d(torch.tanh(self.c(buffer + self.b(x))))


def test_a_tensor_made_from_sizes_and_written_through_a_slice_keeps_the_write():
    torch.manual_seed(0)
    _same_step(_FillsASlice(), (torch.randn(3, 4),), _sum)
    torch.manual_seed(0)
    _every_cut_as_stages(_FillsASlice(), (torch.randn(3, 4),))


class _MovingAverage(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("average", torch.zeros(4))

    def forward(self, x):
        h = self.a(x)
        if self.in_place:
            with torch.no_grad():
                self.average.mul_(0.9).add_(0.1 * h.mean(0))
        else:
            self.average = 0.9 * self.average + 0.1 * h.detach().mean(0)
        return self.c(self.b(h - self.average))


def test_a_buffer_assigned_in_forward_is_refused_and_one_updated_in_place_is_replayed():
    torch.manual_seed(0)
    with pytest.raises(InputError, match=r"assigns a new tensor to average .*copy_"):
        traced_sequence(_MovingAverage(in_place=False), (torch.randn(3, 4),))
    torch.manual_seed(0)
    model, x = _MovingAverage(in_place=True), torch.randn(3, 4)
    plain = copy.deepcopy(model)
    sequence = traced_sequence(model, (x,))
    for _ in range(3):
        assert torch.equal(sequence(x), plain(x))
        assert torch.equal(model.average, plain.average) and model.average.abs().sum() > 0


class _LeafCalls(nn.Module):
    """torch.nn leaf modules called with more than one tensor, or giving more than one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(3, 3, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.bilinear = nn.Bilinear(18, 18, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = self.up(self.conv(x), output_size=x.shape[-2:])       # output_padding from the size asked for
        pooled, _ = self.pool(h + x)
        flat = pooled.flatten(1)
        return self.head(self.bilinear(flat, flat))


def test_leaf_modules_called_with_other_arguments_run_as_called():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 1, 4, 6),)
    _same_step(_LeafCalls(), inputs, _sum)
    torch.manual_seed(0)
    _every_cut_as_stages(_LeafCalls(), inputs)


class _DropsNothing(nn.Module):
    """MONAI's ADN order with its default dropout 0.0: the dropout returns its input itself, which the
    in-place activation after it then writes."""

    def __init__(self, dropout: float):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.drop, self.act, self.out = nn.Dropout(dropout), nn.LeakyReLU(inplace=True), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.out(self.act(self.drop(self.norm(self.conv(x)))))


@pytest.mark.parametrize("dropout,mode", [(0.0, "train"), (0.5, "eval")])
def test_a_dropout_that_drops_nothing_is_not_cut_from_the_in_place_op_after_it(dropout, mode):
    torch.manual_seed(0)
    model = _DropsNothing(dropout)
    model.train(mode == "train")
    inputs = (torch.randn(2, 1, 6, 6),)
    names = [block.name for block in traced_sequence(copy.deepcopy(model), inputs).blocks]
    assert "drop" not in names and "act" not in names, names
    _every_cut_as_stages(model, inputs)


class _Flattens(nn.Module):
    def __init__(self, fixed_batch: int | None = None):
        super().__init__()
        self.fixed_batch = fixed_batch
        self.conv, self.head = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(32, 3)

    def forward(self, x):
        h = self.conv(x)
        return self.head(h.view(self.fixed_batch or h.shape[0], -1))


def test_an_example_of_batch_one_traces_for_every_batch_size_and_a_fixed_batch_is_refused():
    torch.manual_seed(0)
    model = _Flattens()
    sequence = traced_sequence(model, (torch.randn(1, 1, 4, 4),))
    for batch in (1, 3):
        x = torch.randn(batch, 1, 4, 4)
        assert torch.equal(sequence(x), model(x))
    with pytest.raises(InputError, match=r"fixes the batch size .* at 2.*x.view\(x.shape\[0\], -1\)"):
        traced_sequence(_Flattens(fixed_batch=2), (torch.randn(2, 1, 4, 4),))


class _Shared(nn.Module):
    """One layer called twice (weight sharing), registered under two names."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.a, self.b, self.c = shared, nn.Linear(4, 4), shared

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


def _real(model: nn.Module) -> bool:
    return all(type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type == "cpu"
               for tensor in [*model.parameters(), *model.buffers()])


def test_stage_shapes_leave_a_module_used_in_several_blocks_as_it_was():
    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(4, 4)
    plain = copy.deepcopy(model)
    sequence = sequence_for(model, x)
    count = len(sequence.blocks)
    stage_shapes(sequence, [0, count - 1, count], (x,))
    assert _real(model)
    assert torch.equal(sequence(x), plain(x))
    # A hand-written sequence with the module in two blocks of one stage.
    hand = BlockSequence([Block("first", model.a, ("x",), ("h",)), Block("middle", model.b, ("h",), ("g",)),
                          Block("last", model.c, ("g",), ("y",))], ("x",), "y")
    stage_shapes(hand, [0, 3], (x,))
    assert _real(model)


def test_a_profile_for_a_target_leaves_a_shared_module_on_its_device():
    from oomless.profile.fake import profile_for_target

    torch.manual_seed(0)
    model = _Shared()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    profile = profile_for_target(model, torch.randn(4, 4), "h100", loss_fn=lambda output: output.sum())
    assert profile.blocks and _real(model)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert model.a is model.c and model.a.weight is model.c.weight


def test_the_cli_shape_check_leaves_a_shared_module_on_its_device():
    from oomless.cli.plan import _runs_on_meta

    model = _Shared()
    assert _runs_on_meta(model, torch.randn(4, 4))
    assert _real(model)
    assert F.linear(torch.ones(1, 4), model.a.weight).shape == (1, 4)
