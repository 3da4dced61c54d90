"""Models as users have them train under every plan exactly as plain PyTorch does (issue 15, item 6).

Each case builds a small model (Hugging Face GPT-2, BERT and ViT from their configs, no download;
MONAI's UNet, SegResNet and SwinUNETR; torchvision's ResNet-50 and DeepLabv3, where torchvision is
installed; and small hand-written models, each with one thing real models do: a module registered
under two names, a module called twice in one forward, tied weights, functional code between blocks,
a block called with keyword arguments, a block taking and returning a tuple, a block taking and
returning a dict; and PyTorch's own nn.TransformerEncoder). Under each plan (every block kept,
swapped, recomputed; recomputed selectively where the profile offers it; a mix of the three; the planner's own plan at the smallest budget it names)
the model trains two optimizer steps next to a deepcopy trained with plain PyTorch, with the same
seeds, and every parameter, gradient and buffer must be equal bit for bit.

torchvision is not in the test extra (PyPI's build is for torch's CUDA build; beside a CPU-only torch
it imports only through oomless.models.vision, which tests/conftest.py applies): its two models run
where it is installed and imports, and are skipped elsewhere. SwinUNETR needs einops (the test extra).
"""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import oomless
from oomless.plan.planner import smallest_memory
from oomless.profile.tensors import call_model
from tests.conftest import needs_selective

# Hand-written models: each exercises one way real models are written.


class _Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class TwoNames(nn.Module):
    """One layer registered twice: as ``encoder`` and as ``alias`` (a model that keeps a shortcut to
    a submodule, as MONAI's SegResNet keeps its activation)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.encoder = _Layer(width)
        self.alias = self.encoder
        self.middle = _Layer(width)
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        return self.head(self.middle(self.alias(self.stem(x))))


class _NormLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        return x + torch.relu(self.norm(self.linear(x)))


class CalledTwice(nn.Module):
    """One layer applied twice in one forward (weight sharing across depth, as ALBERT does), with
    BatchNorm inside: its running statistics are updated by both calls."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.shared = _NormLayer(width)
        self.middle = _Layer(width)
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        x = self.shared(self.stem(x))
        x = self.middle(x)
        x = self.shared(x)
        return self.head(x)


class TiedWeights(nn.Module):
    """A language model whose output projection is its embedding's weight (GPT-2's tying)."""

    def __init__(self, vocab: int = 128, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_Layer(width) for _ in range(3))
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class FunctionalBetween(nn.Module):
    """Tensor code between the blocks: activations, dropout, reshapes, a skip concatenated, a
    residual added, a softmax over a view."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.third = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        a = F.gelu(self.first(x))
        b = F.dropout(a, 0.2, self.training).view(x.shape[0], 4, -1).softmax(-1).flatten(1)
        c = self.second(b) * a.sigmoid()
        d = self.third(torch.cat([c, a], dim=1)) + x
        return self.head(d.relu())


class _KeywordLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, *, scale, mask=None):
        h = self.dropout(torch.tanh(self.linear(x))) * scale
        return x + (h if mask is None else h * mask)


class KeywordInputs(nn.Module):
    """Blocks called with keyword arguments, tensors and a float among them."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(_KeywordLayer(width) for _ in range(3))
        self.head = nn.Linear(width, 8)

    def forward(self, x, mask):
        for index, layer in enumerate(self.layers):
            x = layer(x=x, scale=0.5 + index, mask=mask)
        return self.head(x)


class _TupleLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, pair: tuple):
        x, carry = pair
        h = torch.tanh(self.linear(x))
        return h + carry, torch.sigmoid(self.gate(h)) * carry


class TupleOutputs(nn.Module):
    """Blocks taking a tuple of two tensors and returning one (a recurrent-style carry)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(_TupleLayer(width) for _ in range(3))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        pair = (x, torch.ones_like(x))
        for layer in self.layers:
            pair = layer(pair)
        return self.head(pair[0] + pair[1])


class _DictLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, state: dict):
        h = torch.relu(self.norm(self.linear(state["hidden"])))
        return {"hidden": h + state["hidden"], "aux": state["aux"] + h.mean(1)}


class DictOutputs(nn.Module):
    """Blocks taking and returning a dict of tensors, with BatchNorm (running statistics) inside; the
    forward updates its dict in place after each block."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(_DictLayer(width) for _ in range(3))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        state = {"hidden": x, "aux": torch.zeros(x.shape[0])}
        for layer in self.layers:
            state.update(layer(state))      # the one dict each layer was given, updated in place
        return {"logits": self.head(state["hidden"]), "aux": state["aux"]}


class TorchEncoder(nn.Module):
    """PyTorch's own nn.TransformerEncoder: its layers call nn.MultiheadAttention with the same
    tensor as query, key and value (its fused self-attention path) and a padding mask by keyword."""

    def __init__(self, width: int = 64):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 8)

    def forward(self, x, padding):
        return self.head(self.encoder(x, src_key_padding_mask=padding))


def _small(model_class, **kwargs):
    def make():
        inputs = torch.randn(16, 64)
        model = model_class(**kwargs)
        return model, inputs, lambda out: out.square().mean()
    return make


def _tied():
    tokens = torch.randint(0, 128, (4, 16))
    return TiedWeights(), tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.roll(-1, 1).flatten())


def _keywords():
    inputs = {"x": torch.randn(16, 64), "mask": (torch.rand(16, 64) > 0.3).float()}
    return KeywordInputs(), inputs, lambda out: out.square().mean()


def _torch_encoder():
    padding = torch.zeros(4, 10, dtype=torch.bool)
    padding[1, 7:] = True
    return TorchEncoder(), {"x": torch.randn(4, 10, 64), "padding": padding}, lambda out: out.square().mean()


def _dicts():
    return DictOutputs(), torch.randn(16, 64), lambda out: out["logits"].square().mean() + out["aux"].mean()


# Hugging Face transformers, from configs (randomly initialised, nothing downloaded).


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    tokens = torch.randint(0, 256, (2, 32))
    return model, tokens, lambda out: F.cross_entropy(out.logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    model = BertForMaskedLM(config)      # its decoder's weight is tied to the word embeddings
    tokens = torch.randint(0, 256, (2, 32))
    mask = torch.ones_like(tokens)
    mask[1, 24:] = 0
    labels = torch.where(torch.rand(tokens.shape) < 0.3, tokens, torch.full_like(tokens, -100))
    inputs = {"input_ids": tokens, "attention_mask": mask, "labels": labels}
    return model, inputs, lambda out: out.loss


def _vit():
    from transformers import ViTConfig, ViTForImageClassification
    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, num_labels=5,
                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = ViTForImageClassification(config)
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    return model, images, lambda out: F.cross_entropy(out.logits, labels)


# MONAI.


def _monai_unet():
    from monai.networks.nets import UNet
    model = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                 num_res_units=2, norm="batch", dropout=0.1)
    volume = torch.randn(2, 1, 16, 16, 16)
    return model, volume, lambda out: F.cross_entropy(out, (volume[:, 0] > 0).long())


def _segresnet():
    from monai.networks.nets import SegResNet
    model = SegResNet(spatial_dims=3, init_filters=8, in_channels=1, out_channels=2, blocks_down=(1, 2, 2),
                      blocks_up=(1, 1), dropout_prob=0.1)
    volume = torch.randn(2, 1, 16, 16, 16)
    return model, volume, lambda out: F.cross_entropy(out, (volume[:, 0] > 0).long())


def _swin_unetr():
    # 32^3, the smallest volume it takes (it halves its input five times); BatchNorm, as instance
    # norm has one value per channel at 1^3. Windows of 4: each window's attention bias is looked up
    # from a table, and the table's gradient is an index_put_ with accumulation, which PyTorch runs
    # with atomic adds from several threads once it has 32768 elements or more (7^3 windows: 117649
    # per head), in an order that varies from run to run: plain PyTorch then differs from itself
    # (torch.use_deterministic_algorithms(True) makes it serial). At 4^3, 4096 per head.
    from monai.networks.nets import SwinUNETR
    model = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1), num_heads=(1, 2, 3, 6),
                      window_size=4, mlp_ratio=2.0, drop_rate=0.1, attn_drop_rate=0.1, dropout_path_rate=0.1,
                      norm_name="batch")
    volume = torch.randn(2, 1, 32, 32, 32)
    return model, volume, lambda out: F.cross_entropy(out, (volume[:, 0] > 0).long())


# torchvision (not installable beside every torch build: these run where it is installed).


def _resnet50():
    from torchvision import models
    model = models.resnet50(weights=None, num_classes=10)
    images, labels = torch.randn(2, 3, 64, 64), torch.tensor([1, 7])
    return model, images, lambda out: F.cross_entropy(out, labels)


def _deeplabv3():
    from torchvision.models import segmentation
    model = segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=3, aux_loss=True)
    # A batch of 2, the least its image-pooling branch trains at (it normalises a 1x1 map over the
    # batch): the equality asserted is the same at any batch, and 4 took twice as long.
    images = torch.randn(2, 3, 64, 64)
    target = (images[:, 0] > 0).long() + (images[:, 1] > 1).long()
    return model, images, lambda out: F.cross_entropy(out["out"], target) + 0.4 * F.cross_entropy(out["aux"], target)


def _torchvision_vit():
    # The class token a parameter concatenated in the encoder's forward, outside any block; the
    # encoder's layers an nn.Sequential; dropout in the MLPs and attention.
    from torchvision.models import VisionTransformer
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                              dropout=0.1, attention_dropout=0.1, num_classes=5)
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    return model, images, lambda out: F.cross_entropy(out, labels)


CASES = {
    "two-names": _small(TwoNames), "called-twice": _small(CalledTwice), "tied-weights": _tied,
    "functional-between": _small(FunctionalBetween), "keyword-inputs": _keywords,
    "tuple-outputs": _small(TupleOutputs), "dict-outputs": _dicts, "torch-encoder": _torch_encoder,
    "hf-gpt2": _gpt2, "hf-bert": _bert, "hf-vit": _vit,
    "monai-unet": _monai_unet, "monai-segresnet": _segresnet, "monai-swin-unetr": _swin_unetr,
    "torchvision-resnet50": _resnet50, "torchvision-deeplabv3": _deeplabv3, "torchvision-vit": _torchvision_vit,
}
NEEDS = {"hf-": ("transformers",), "monai-swin": ("monai", "einops"), "monai-": ("monai",),
         "torchvision-": ("torchvision",)}


def _skip_without_packages(case: str) -> None:
    """Skip ``case`` where a package it needs is not installed, or does not import (a build for
    another torch raises RuntimeError or OSError, not ImportError, from its C++ extension)."""
    for prefix, packages in NEEDS.items():
        if case.startswith(prefix):
            for package in packages:
                try:
                    importlib.import_module(package)
                except Exception as error:
                    pytest.skip(f"{case} needs {package}, which does not import here: {type(error).__name__}: "
                                f"{str(error)[:200]}")
            return


PLANS = ["keep", "swap", "recompute", "selective", "mixed", "minimum", "floor"]


def _train(model, inputs, loss_fn, steps: int = 2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)       # the same dropout masks on both sides
        loss_fn(call_model(model, inputs)).backward()
        optimizer.step()


class _Prepared:
    """One model's untouched copy, its profile, the plans made from it and the model trained with
    plain PyTorch: made once per model (its five plans' cases run one after another)."""

    def __init__(self, case: str):
        _skip_without_packages(case)
        torch.manual_seed(0)
        self.model, self.inputs, self.loss_fn = CASES[case]()
        self.reference = copy.deepcopy(self.model)
        _train(self.reference, self.inputs, self.loss_fn)
        planned = copy.deepcopy(self.model)
        self.profile = oomless.profile(planned, self.inputs, loss_fn=self.loss_fn)
        self.roomy = oomless.plan(planned, self.inputs, "1TiB", loss_fn=self.loss_fn, profile=self.profile,
                                  min_swap_bytes=0)

    def plan(self, kind: str):
        """The plan named ``kind``: one decision for every block (selective: where the profile offers
        it, else recompute), a mix cycling keep/swap/recompute
        over the blocks, the planner's own at the smallest budget it names (with the margin a
        `PlanError` adds: at least 1 MiB, more than these small models' activations), or at the
        exact smallest budget ("floor"), where it must move activations whatever their size."""
        planned = copy.deepcopy(self.model)
        if kind == "minimum":
            with pytest.raises(oomless.PlanError) as refused:
                oomless.plan(planned, self.inputs, 1, loss_fn=self.loss_fn, profile=self.profile, min_swap_bytes=0,
                             split=False)
            return oomless.plan(planned, self.inputs, refused.value.minimum_bytes, loss_fn=self.loss_fn,
                                profile=self.profile, min_swap_bytes=0)
        if kind == "floor":
            return oomless.plan(planned, self.inputs, smallest_memory(self.profile, min_swap_bytes=0),
                                loss_fn=self.loss_fn, profile=self.profile, min_swap_bytes=0)
        if kind == "selective":
            decisions = {block.name: "selective" if block.selective_kept_bytes is not None else "recompute"
                         for block in self.profile.blocks}
            return oomless.plan(planned, self.inputs, "1TiB", loss_fn=self.loss_fn, profile=self.profile,
                                decisions=decisions, min_swap_bytes=0)
        cycle = ("keep", "swap", "recompute")
        return self.roomy.with_decisions({name: kind if kind in cycle else cycle[index % len(cycle)]
                                          for index, name in enumerate(self.roomy.decisions)})


_prepared: dict[str, _Prepared] = {}


def _prepare(case: str) -> _Prepared:
    if case not in _prepared:
        _prepared.clear()                   # one model at a time: ResNet-50's copies are not small
        _prepared[case] = _Prepared(case)
    return _prepared[case]


def _differences(reference, trained) -> dict[str, float]:
    """The largest absolute difference of each parameter, gradient and buffer that differs."""
    found = {}
    pairs = [(f"parameter {name}", expected, actual) for (name, expected), (_, actual)
             in zip(reference.named_parameters(), trained.named_parameters())]
    pairs += [(f"gradient of {name}", expected.grad, actual.grad) for (name, expected), (_, actual)
              in zip(reference.named_parameters(), trained.named_parameters())]
    pairs += [(f"buffer {name}", expected, actual) for (name, expected), (_, actual)
              in zip(reference.named_buffers(), trained.named_buffers())]
    for what, expected, actual in pairs:
        if expected is None or actual is None:
            if expected is not actual:
                found[what] = float("inf")
        elif not torch.equal(expected, actual):
            found[what] = (expected.double() - actual.double()).abs().max().item()
    return found


@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("case", CASES)
def test_trains_like_plain_pytorch(case, kind):
    if kind == "selective":
        needs_selective()
    prepared = _prepare(case)
    model = copy.deepcopy(prepared.model)
    plan = prepared.plan(kind)
    oomless.apply(model, plan)
    _train(model, prepared.inputs, prepared.loss_fn)
    differences = _differences(prepared.reference, model)
    assert not differences, f"{len(differences)} differ, e.g. {list(differences.items())[:3]}"
    stats = oomless.stats(model)
    if "swap" in plan.decisions.values():
        assert stats.offloaded_bytes > 0
    if "recompute" in plan.decisions.values():
        assert stats.recomputed_blocks > 0
    if kind == "selective":
        assert any(block.selective for block in plan.blocks), "no block of the model was offered selective recompute"
    if kind == "minimum" and plan.memory_bytes < plan.plain_peak_bytes:
        assert set(plan.decisions.values()) != {"keep"}, "the smallest budget should force swaps or recomputes"


# Not bit-equal: a chain computed in slabs (split=True) takes its normalisation statistics and its
# weight gradients as sums over the whole volume in another order (runtime/slabs.py). Bounded as
# tests/test_split.py bounds it, relative to the largest gradient of the model: some gradients are
# zero in exact arithmetic and rounding noise on both sides (a convolution's bias before a
# normalisation on batch statistics; SwinUNETR's 1x1 residual convolution of its one input channel,
# whose instance norm undoes the weight's scale), so a tolerance relative to each one's own size would
# compare noise with noise. Measured on the MONAI models: at most 1e-6 of the largest gradient.
SPLIT_TOLERANCE = 1e-5
# A deep network with BatchNorm at initialisation amplifies rounding on its way back (gradients
# grow with depth: Yang et al., "A Mean Field Theory of Batch Normalization", ICLR 2019): moving
# DeepLabv3's input by one rounding step moves its gradients by 2 % of the largest, in plain PyTorch.
# Where the model itself is that sensitive, the split step must be within a few times what one
# rounding step does (measured: DeepLabv3 split 1.3 %, nudged 2.4 %).
ROUNDING_STEPS = 10


def _gradients(model, inputs, loss_fn) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(100)
    loss = loss_fn(call_model(model, inputs))
    loss.backward()
    return loss.item(), [parameter.grad for parameter in model.parameters()]


def _nudged(inputs):
    """``inputs`` with every float element moved by one rounding step, up and down alternately."""
    def nudge(tensor):
        if not tensor.is_floating_point():
            return tensor
        signs = torch.arange(tensor.numel()).reshape(tensor.shape) % 2 * 2 - 1
        return tensor * (1 + torch.finfo(tensor.dtype).eps * signs)
    return torch.utils._pytree.tree_map(lambda leaf: nudge(leaf) if isinstance(leaf, torch.Tensor) else leaf, inputs)


@pytest.mark.parametrize("case", ["monai-unet", "monai-segresnet", "monai-swin-unetr", "torchvision-deeplabv3"])
def test_chains_in_slabs_stay_within_rounding_of_plain_pytorch(case, monkeypatch):
    from oomless.runtime import slabs
    from oomless.runtime.split import split_candidates

    # Slabs as thin as asked: on CPU a slab is otherwise kept thick enough for oneDNN's convolution,
    # which at these sizes is the whole volume.
    monkeypatch.setattr(slabs, "ONEDNN_MIN_INPUT_ELEMENTS", 0)
    _skip_without_packages(case)
    torch.manual_seed(0)
    model, inputs, loss_fn = CASES[case]()
    reference, nudged = copy.deepcopy(model), copy.deepcopy(model)
    chains = split_candidates(model)
    assert chains
    # Three slabs each: as exact as sixteen (every slab boundary is a halo), and quicker to profile.
    plan = oomless.plan(copy.deepcopy(model), inputs, "1TiB", loss_fn=loss_fn, split={name: 3 for name in chains},
                        min_swap_bytes=0)
    cycle = ("keep", "swap", "recompute")
    oomless.apply(model, plan.with_decisions({name: cycle[index % 3] for index, name in enumerate(plan.decisions)}))
    expected_loss, expected = _gradients(reference, inputs, loss_fn)
    loss, actual = _gradients(model, inputs, loss_fn)
    _, moved = _gradients(nudged, _nudged(inputs), loss_fn)
    largest = max(gradient.abs().max().item() for gradient in expected)
    rounding = max((a - b).abs().max().item() for a, b in zip(expected, moved))
    bound = max(SPLIT_TOLERANCE * largest, ROUNDING_STEPS * rounding)
    assert loss == pytest.approx(expected_loss, rel=SPLIT_TOLERANCE)
    for (name, _), want, got in zip(reference.named_parameters(), expected, actual):
        assert (want - got).abs().max().item() <= bound, name
    # Normalisation statistics deep in the network see inputs moved by the same amplified rounding
    # (DeepLabv3's ASPP batch norm: 1.2e-5 of its largest running mean on an AMD EPYC, 2026-11-27,
    # where one rounding step of the input moves it more): bounded alike.
    for (name, want), got, nudged_buffer in zip(reference.named_buffers(), model.buffers(), nudged.buffers()):
        if want.is_floating_point():
            buffer_bound = max(SPLIT_TOLERANCE * want.abs().max().item(),
                               ROUNDING_STEPS * (want - nudged_buffer).abs().max().item())
            assert (want - got).abs().max().item() <= buffer_bound, name
        else:
            assert torch.equal(want, got), name
    stats = oomless.stats(model)
    assert stats.offloaded_bytes > 0 and stats.recomputed_blocks > 0
