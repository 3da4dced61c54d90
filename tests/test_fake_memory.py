"""Working memory traced on meta tensors (`profile.fake_memory`), and `plan(split=None)` deciding to
split from it without measuring a step that does not fit (`plan.splitting.unsplit_floor_estimate`)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import oomless
from oomless.models import UNet3D
from oomless.profile import configured
from oomless.profile.fake import profile_for_target

MiB = 2**20


class _Chain(nn.Module):
    """Three blocks whose working memory is known by hand: each Linear's output is 4 x 1024 fp32
    (16 KiB), the middle block's tanh saves its output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1024, 1024)
        self.b = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh())
        self.c = nn.Linear(1024, 1024)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_a_blocks_traced_working_memory_is_what_its_ops_hold_at_once():
    """Block b's forward makes its Linear's output (16 KiB) and tanh's (16 KiB) while a's output
    (16 KiB, its input) is alive: 48 KiB beyond static bytes at its peak, 16 of them held. Its
    Linear saved a's output, so the runtime's ledger has it from then on (`runtime/saved.py`: an
    entry stays on it while its storage lives): its working memory is the other 32. Its backward
    holds the output gradient coming in, tanh's gradient and the Linear's input gradient, with
    tanh's saved output and the Linear's saved input brought back (the ledger's, not "other"), and
    the Linear's parameter gradients being made."""
    profile = profile_for_target(_Chain(), torch.randn(4, 1024), "h100", blocks=["a", "b", "c"],
                                 loss_fn=oomless.sum_of_outputs)
    b = {block.name: block for block in profile.blocks}["b"]
    kib = 4 * 1024 * 4
    assert b.held_forward_bytes == kib
    assert b.forward_peak_bytes == 3 * kib
    assert b.forward_other_bytes == 2 * kib
    assert b.forward_transient_bytes == kib     # less what it held at its start, as the real profiler counts it
    # At its peak, part of what the backward holds is its saved tensors brought back (tanh's output,
    # a's output): on the ledger, not "other".
    assert 0 < b.backward_peak_bytes - b.backward_other_bytes <= 2 * kib
    # Beyond those: the Linear's weight and bias gradients as they are made (static once accumulated).
    made_gradients = 1024 * 1024 * 4 + 1024 * 4
    assert 2 * kib <= b.backward_other_bytes - made_gradients <= 3 * kib
    assert profile.memory_traced


class _Square(nn.Module):
    def forward(self, x):
        return x * x        # saves x twice: one storage, brought back once


def test_a_storage_saved_twice_is_brought_back_once():
    """``x * x`` saves its input for both operands: the runtime swaps that storage once and brings
    it back once (`runtime/saved.py`); traced on meta tensors, the backward's ledger holds it once."""
    model = nn.Sequential(nn.Linear(256, 256), _Square())
    profile = profile_for_target(model, torch.randn(64, 256), "h100", blocks=["0", "1"],
                                 loss_fn=oomless.sum_of_outputs)
    square = {block.name: block for block in profile.blocks}["1"]
    assert square.saved_bytes == 64 * 256 * 4
    assert square.backward_peak_bytes - square.backward_other_bytes <= 64 * 256 * 4


def test_an_untied_heads_gradient_is_static_once_accumulated():
    """A head the loss reads from outside the planned body (Llama's untied lm_head through
    oomless.linear_cross_entropy): once accumulated, its gradient is static bytes (the caller counts
    them), not working memory in every later block's backward."""
    with torch.device("meta"):
        body = nn.Sequential(nn.Embedding(4000, 64), nn.Linear(64, 64), nn.Linear(64, 64))
        head = nn.Linear(64, 4000, bias=False)
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    loss_fn = lambda out: oomless.linear_cross_entropy(out[:, :-1], head.weight, tokens[:, 1:])  # noqa: E731
    profile = profile_for_target(body, tokens, "h100", blocks=["0", "1", "2"], loss_fn=loss_fn)
    head_gradient = 4000 * 64 * 4
    for block in profile.blocks[1:]:    # the Linear layers (the embedding's own gradient is as large)
        assert block.backward_other_bytes < head_gradient, block.name
    assert head.weight.grad is None


def test_meta_profile_holds_what_the_real_forward_holds():
    """The 3D U-Net at 32^3: what each block's forward holds when it starts (earlier outputs still
    referenced: the skips) against the real step's. A storage saved by two ops (an in-place ReLU's
    output, then the next convolution's input) is swapped once for both: on meta tensors too, it
    is not kept alive by its second save (it was, and the meta forward held 2x the real)."""
    torch.manual_seed(0)
    model, volume = UNet3D(base_channels=4, depth=2), torch.randn(1, 1, 32, 32, 32)
    real = oomless.profile(model, volume, loss_fn=oomless.sum_of_outputs, memory="1MiB")
    fake = profile_for_target(model, volume, "h100", loss_fn=oomless.sum_of_outputs)
    traced = {block.name: block for block in fake.blocks}
    for block in real.blocks:
        mine = traced[block.name]
        assert mine.held_forward_bytes <= 1.1 * block.held_forward_bytes + 64 * 1024, block.name


def _unet(side: int):
    torch.manual_seed(0)
    model = UNet3D(in_channels=1, base_channels=8, depth=3)
    volume = torch.randn(1, 1, side, side, side)
    labels = (volume[:, 0] > 0.5).long()
    return model, volume, (lambda out: F.cross_entropy(out, labels)), torch.optim.Adam(model.parameters())


def _record_profiles(monkeypatch) -> list[dict]:
    """The chains split ({} for none) of every step `oomless.plan` measures, in order."""
    measured = []
    real_profile = configured.profile_configured

    def recording(*args, **kwargs):
        measured.append(dict(args[10]) if len(args) > 10 and args[10] else {})
        return real_profile(*args, **kwargs)

    monkeypatch.setattr("oomless.api.profile_configured", recording)
    return measured


def test_split_none_never_measures_a_step_its_estimate_says_cannot_fit(monkeypatch):
    """96^3 at 160 MiB: the unsplit step's floor estimated on meta tensors is over the budget, so
    `plan(split=None)` measures the step with the outer level streamed from the start, and never
    unsplit (estimated at least 169 MiB; measured 294 MiB on the 2-core Xeon; split, 145)."""
    measured = _record_profiles(monkeypatch)
    model, volume, loss_fn, optimizer = _unet(96)
    plan = oomless.plan(model, volume, "160MiB", loss_fn=loss_fn, optimizer=optimizer)
    assert {} not in measured, measured
    assert plan.split and "" in plan.split
    assert plan.predicted_peak_bytes <= plan.memory_bytes
    assert any("estimated on meta tensors, so the step was not measured unsplit" in note for note in plan.notes)


def test_split_none_measures_the_step_unsplit_where_its_estimate_fits(monkeypatch):
    """At a budget the estimate fits, the step is measured unsplit first, as before."""
    measured = _record_profiles(monkeypatch)
    model, volume, loss_fn, optimizer = _unet(32)
    plan = oomless.plan(model, volume, "1GiB", loss_fn=loss_fn, optimizer=optimizer)
    assert measured[0] == {}
    assert not plan.split


def test_a_refusal_named_by_a_split_step_plans_from_it_when_given_back(monkeypatch):
    """The budget a PlanError names from a step measured split (the U-Net at 96^3: the outer level
    streamed, 145 MiB against 294 unsplit) is accepted when given back, planned from that same
    profile with the same chains split, nothing measured again."""
    model, volume, loss_fn, optimizer = _unet(96)
    with pytest.raises(oomless.PlanError) as refused:
        oomless.plan(model, volume, "100MiB", loss_fn=loss_fn, optimizer=optimizer)
    named, named_by = refused.value.minimum_bytes, refused.value.profile
    assert named_by is not None and "" in named_by.split
    measured = _record_profiles(monkeypatch)
    plan = oomless.plan(model, volume, named, loss_fn=loss_fn, optimizer=optimizer)
    assert measured == []
    assert plan.predicted_peak_bytes <= named
    assert plan.split == named_by.split


def test_the_flop_note_reads_in_the_unit_of_its_size():
    """A small model's step read "0.00 TFLOP per step" in `oomless simulate`'s notes."""
    from oomless.profile.fake import format_flops

    assert format_flops(163.58e6) == "163.58 MFLOP"
    assert format_flops(2.5e12) == "2.50 TFLOP"
    assert format_flops(3.1e15) == "3.10 PFLOP"


class _CachesAGrid(torch.nn.Module):
    """A conv chain (the planner may split it) whose forward caches a grid made for the input's shape
    on the module, as models cache masks, grids and rotary tables."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Conv3d(4, 2, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if getattr(self, "grid", None) is None or self.grid.shape != x.shape[2:]:
            self.grid = torch.linspace(0, 1, x.shape[-1], device=x.device).expand(x.shape[2:]).contiguous()
        return self.head(self.stem(x) + self.grid)


def test_a_step_on_meta_tensors_leaves_what_the_forward_caches_as_it_was():
    """The meta step (a target's profile, the unsplit floor's estimate, the CLI's shape check) ran the
    model's own forward, which left a meta grid on it: the real profile then failed ("Tensor on
    device meta is not on the expected device cpu"). Each module's attributes are taken back after."""
    import oomless

    torch.manual_seed(0)
    model, volume = _CachesAGrid(), torch.randn(1, 1, 16, 16, 16)
    loss_fn = lambda out: out.square().mean()       # noqa: E731
    oomless.profile(model, volume, loss_fn=loss_fn, target="h100")
    assert not hasattr(model, "grid") and model.calls == 0
    model(volume)
    grid = model.grid
    with pytest.raises(oomless.PlanError) as error:
        oomless.plan(model, volume, 1, loss_fn=loss_fn)      # split=None: the estimate on meta tensors first
    assert model.grid is grid and model.grid.device.type == "cpu"
    oomless.plan(model, volume, error.value.minimum_bytes, loss_fn=loss_fn)


class _SmallThenWide(nn.Module):
    """A small block, then one whose weights (2 x 64 x 4,096) dwarf everything the first one's
    backward holds."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(64, 64)
        self.wide = nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 64))

    def forward(self, x):
        return self.wide(self.small(x))


def test_autocasts_weight_copies_outlive_the_forward_only_where_saved():
    """Under bf16, the forward casts each weight once (autocast's cache) and each Linear saves its
    bf16 copy for backward. torch.autocast drops that cache when the forward leaves it (the runtime
    leaves it at the model's output, `runtime/precision.py`), so from then on a copy lives only
    while its block's backward has not run. The wide block's copies (1 MiB) were held to the end of
    the step, in the loss and every block's backward, while the mode that made them was alive
    (Llama 2048 dims: 98 MiB a layer, counted in every block's backward peak)."""
    with torch.device("meta"):
        model = _SmallThenWide()
    profile = profile_for_target(model, torch.empty(4, 64, device="meta"), "h100", blocks=["small", "wide"],
                                 loss_fn=oomless.sum_of_outputs, precision="bf16")
    small = {block.name: block for block in profile.blocks}["small"]
    wide_copy_bytes = 2 * 64 * 4096 * 2
    # small's backward, the step's last: its own saved input and weight copy (8 KiB and a little),
    # its gradients and the gradient coming in; the wide block's copies are gone.
    assert small.backward_peak_bytes < 64 * 1024
    assert profile.loss_peak_bytes < wide_copy_bytes / 4
