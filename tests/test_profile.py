"""The profiler: blocks, per-block sizes by storage, and a model left exactly as it was found."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import oomless
from oomless.models import MLP, SmallCNN, TinyTransformer, UNet3D
from oomless.profile.blocks import find_blocks


def test_profiling_leaves_parameters_buffers_gradients_and_rng_as_found():
    torch.manual_seed(0)
    model = SmallCNN(in_channels=3, num_classes=10)
    inputs = torch.randn(4, 3, 16, 16)
    model(inputs).sum().backward()          # the user already has gradients and moved BN stats
    before = copy.deepcopy(model)
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    oomless.profile(model, inputs, loss_fn=oomless.sum_of_outputs)
    assert torch.equal(torch.get_rng_state(), rng)
    for (name, expected), (_, actual) in zip(before.state_dict().items(), model.state_dict().items()):
        assert torch.equal(expected, actual), name
    for grad, p in zip(grads, model.parameters()):
        assert torch.equal(grad, p.grad)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_saved_bytes_by_storage_parameters_not_counted():
    model = MLP((256, 512, 512, 10))
    inputs = torch.randn(64, 256)
    profile = oomless.profile(model, inputs, loss_fn=lambda out: out.square().mean())
    by_name = {block.name: block for block in profile.blocks}
    hidden_bytes = 64 * 512 * 4
    # Linear saves its input (the model input for block 0: resident, not an activation) and its
    # weight (a parameter: never counted); ReLU saves its output, which the next Linear saves too.
    assert by_name["0"].saved_bytes == 0
    assert by_name["1"].saved_bytes == hidden_bytes
    assert by_name["2"].saved_bytes == 0          # its input is block 1's output, counted there
    assert by_name["0"].parameter_bytes == (256 * 512 + 512) * 4
    assert profile.parameter_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert [block.name for block in profile.blocks] == [str(i) for i in range(len(model))]


def test_tied_parameters_counted_once():
    model = TinyTransformer(vocab_size=64, dim=32, depth=2, heads=2, max_len=16)
    profile = oomless.profile(model, torch.randint(0, 64, (2, 16)), loss_fn=oomless.sum_of_outputs)
    assert profile.parameter_bytes == sum(p.numel() * 4 for p in model.parameters())  # parameters() dedups


def test_default_blocks_are_the_repeated_children():
    names = [name for name, _ in find_blocks(TinyTransformer(depth=3))]
    assert [name for name in names if name.startswith("blocks.")] == ["blocks.0", "blocks.1", "blocks.2"]
    unet_names = [name for name, _ in find_blocks(UNet3D(depth=2))]
    assert "decoders.0" in unet_names and "head" in unet_names


def test_blocks_given_by_type_or_name():
    model = UNet3D(base_channels=4, depth=2)
    by_type = [name for name, _ in find_blocks(model, blocks=[nn.Conv3d])]
    assert by_type and all(isinstance(dict(model.named_modules())[name], nn.Conv3d) for name in by_type)
    assert [name for name, _ in find_blocks(model, blocks=["encoders.0", "decoders.1"])] == ["encoders.0", "decoders.1"]


def test_a_dominant_block_is_split_by_size():
    # One decoder stage holds most of the saved bytes at full resolution: it is split into its
    # children so that no single block's backward sets the minimum memory.
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(1, 1, 32, 32, 32)
    profile = oomless.profile(model, volume, loss_fn=lambda out: F.cross_entropy(out, (volume[:, 0] > 0).long()))
    names = [block.name for block in profile.blocks]
    assert "decoders.1" not in names
    assert "decoders.1.up" in names and "decoders.1.conv.0" in names


class _TimesConjugate(nn.Module):
    """Multiplies by a conjugate view: autograd saves that view, whose conj bit is not in its bytes."""

    def forward(self, x):
        z, w = torch.complex(x, x), torch.complex(x, -x)
        return (z * w.conj()).real


def test_a_storage_the_runtime_cannot_move_is_recorded_and_counted_kept_in_a_swap():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), _TimesConjugate(), nn.Linear(256, 256))
    inputs = torch.randn(64, 256)
    profile = oomless.profile(model, inputs, loss_fn=oomless.sum_of_outputs)
    block = profile.blocks[1]
    complex_bytes = 64 * 256 * 8
    assert [block.saved_sizes[index] for index in block.kept_when_swapped] == [complex_bytes]
    assert profile.blocks[0].kept_when_swapped == profile.blocks[2].kept_when_swapped == []
    # Everything else of block 1 swapped; its conjugate view and block 2's input (kept) stay.
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=oomless.sum_of_outputs, profile=profile, min_swap_bytes=0,
                        decisions={"0": "keep", "1": "swap", "2": "keep"})
    assert plan.predicted_activation_peak_bytes >= complex_bytes + profile.blocks[2].saved_bytes


def test_time_between_blocks_counts_in_the_step():
    """Work between blocks (functional code in the model's forward) is the step's time too: it is
    counted with the loss's seconds, which every step prediction adds, not lost between blocks."""
    import time

    class GlueBetween(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

        def forward(self, x):
            x = self.blocks[0](x)
            time.sleep(0.05)                # the glue: 50 ms outside every block
            return self.blocks[1](x)

    profile = oomless.profile(GlueBetween(), torch.randn(4, 16), loss_fn=oomless.sum_of_outputs,
                              blocks=["blocks.0", "blocks.1"])
    assert [block.name for block in profile.blocks] == ["blocks.0", "blocks.1"]
    assert all(block.forward_seconds < 0.05 for block in profile.blocks)
    assert profile.loss_seconds >= 0.05


def test_the_recorders_own_readings_are_not_the_steps_time(monkeypatch):
    """Each block boundary's readings (memory, inputs, held bytes) are the profiler's work, not the
    step's: on an H200 they ran with the device idle, and a 3D U-Net's loss read 17.6 ms of a 75 ms
    step. On a clock where each reading takes 50 ms and everything else 1 us a call, the loss's and
    the blocks' times hold none of the readings."""
    from types import SimpleNamespace

    from oomless.profile import recorder

    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-6
        return clock[0]

    enter = recorder.Recorder._enter

    def slow_enter(self, phase):
        clock[0] += 0.05
        enter(self, phase)

    monkeypatch.setattr(recorder, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(recorder.Recorder, "_enter", slow_enter)
    torch.manual_seed(0)
    profile = oomless.profile(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]), torch.randn(4, 32),
                              loss_fn=oomless.sum_of_outputs)
    # Counted as the step's, 14 readings of 50 ms: the loss read 0.15 s and the blocks' backward 0.3 s.
    assert 0 <= profile.loss_seconds < 0.001
    assert sum(block.forward_seconds + block.backward_seconds for block in profile.blocks) < 0.001
