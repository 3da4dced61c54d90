"""Dropout profiled for a GPU on meta tensors runs as CUDA's fused kernel, `native_dropout`, which
saves a boolean mask, 1 byte per element (`oomless.profile.fake_dropout`), where meta tensors alone
take the composite path, as the CPU does, and save the noise in the input's dtype. Bytes are
counted, nothing is timed."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import oomless
from oomless.profile.fake import profile_for_target
from oomless.profile.fake_dropout import FusedDropout

ROWS, WIDTH = 64, 256
ELEMENTS = ROWS * WIDTH

# Each way a model calls dropout: nn.Dropout and F.dropout (torch.dropout inside, not seen apart),
# torch.dropout and torch._VF.dropout (one function) as Hugging Face models and the attention
# probabilities of hand-written attention call them.
CALLS = {
    "nn.Dropout": lambda x: nn.Dropout(0.1)(x),
    "F.dropout": lambda x: F.dropout(x, 0.1, training=True),
    "torch.dropout": lambda x: torch.dropout(x, 0.1, True),
    "torch._VF.dropout": lambda x: torch._VF.dropout(x, 0.1, True),
}


class _Call(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, x):
        return self.call(x)


def _model(call) -> nn.Module:
    """A Linear, then the dropout: the second block saves nothing but what the dropout keeps (the
    Linear's output is its input, which the dropout's backward does not read)."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), _Call(call))


def _saved_bytes(profile) -> int:
    return profile.blocks[1].saved_bytes


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("precision, element_size", [("fp32", 4), ("bf16", 2)])
def test_dropout_for_a_gpu_saves_a_boolean_mask_as_cuda_s_kernel_does(call, precision, element_size):
    """CUDA's `at::dropout` runs `native_dropout` in training for 0 < p < 1: its backward keeps
    the boolean mask alone, one byte an element, where the composite path the CPU (and meta tensors
    alone) take keeps its noise in the input's dtype: 4 bytes in fp32, 2 under bf16 autocast."""
    with torch.device("meta"):
        model = _model(CALLS[call])
    x = torch.empty(ROWS, WIDTH, device="meta")
    profile = profile_for_target(model, x, "h100", loss_fn=oomless.sum_of_outputs, precision=precision,
                                 blocks=["0", "1"])
    assert _saved_bytes(profile) == ELEMENTS * 1
    # The CPU, measured: the same dropout keeps its noise in the input's dtype.
    torch.manual_seed(0)
    cpu = oomless.profile(_model(CALLS[call]), torch.randn(ROWS, WIDTH), loss_fn=oomless.sum_of_outputs,
                          precision=precision, blocks=["0", "1"])
    assert _saved_bytes(cpu) == ELEMENTS * element_size


def test_a_dropout_for_a_gpu_holds_its_input_output_and_mask_at_most():
    """Its forward's highest point holds the input, the output and the boolean mask (4 + 4 + 1 bytes
    an element in fp32), not the noise in fp32 (4 + 4 + 4); backward, the mask brought back and the
    gradient it makes (1 + 4; the sum's gradient coming in is one scalar, expanded), where the noise
    made it 4 + 4."""
    with torch.device("meta"):
        model = _model(CALLS["nn.Dropout"])
    x = torch.empty(ROWS, WIDTH, device="meta")
    dropout = profile_for_target(model, x, "h100", loss_fn=oomless.sum_of_outputs, blocks=["0", "1"]).blocks[1]
    assert dropout.saved_bytes == ELEMENTS
    assert dropout.forward_peak_bytes == ELEMENTS * (4 + 4 + 1)
    assert ELEMENTS * (1 + 4) <= dropout.backward_peak_bytes <= ELEMENTS * (1 + 4) + 64


def _saved_under(mode, call, x):
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), mode:
        out = call(x)
    return saved, (out.shape, out.dtype)


@pytest.mark.parametrize("case", ["p=0", "p=1", "eval", "in place", "dropout1d", "dropout2d", "dropout3d",
                                  "alpha", "feature alpha", "attention"])
def test_dropout_cuda_runs_unfused_is_left_as_meta_tensors_run_it(case):
    """p = 0 or 1, evaluation, in-place dropout and the feature and alpha variants run the composite
    path on CUDA too, and attention's dropout is its kernel's own: the mode changes none of them."""
    from contextlib import nullcontext

    calls = {
        "p=0": lambda x: F.dropout(x, 0.0),
        "p=1": lambda x: F.dropout(x, 1.0),
        "eval": lambda x: F.dropout(x, 0.1, training=False),
        "in place": lambda x: F.dropout(x * 1, 0.1, inplace=True),
        "dropout1d": lambda x: F.dropout1d(x[0], 0.1),
        "dropout2d": lambda x: F.dropout2d(x, 0.1),
        "dropout3d": lambda x: F.dropout3d(x, 0.1),
        "alpha": lambda x: F.alpha_dropout(x, 0.1, training=True),
        "feature alpha": lambda x: F.feature_alpha_dropout(x, 0.1, training=True),
        "attention": lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1),
    }
    x = torch.empty(2, 4, 8, 8, device="meta", requires_grad=True)
    assert _saved_under(FusedDropout(), calls[case], x) == _saved_under(nullcontext(), calls[case], x)
