"""The CUDA path keeps the promises the CPU suite checks: pinned host tier and copy streams, backward
on autograd's device thread, recompute replaying CUDA RNG. Skipped without CUDA; on a GPU run

    python -m pytest -q -s -m gpu tests/test_cuda.py

(-s prints the memory margins). On CUDA the truth for memory is `torch.cuda.max_memory_allocated`
(DESIGN.md section 3), measured above what was allocated before the test built anything.
"""

import copy
import gc
import os

# Deterministic cuBLAS workspaces; must be set before the first cuBLAS call of the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import oomless  # noqa: E402
from oomless.models import MLP, DictOutputModel, SmallCNN, TinyTransformer, UNet3D  # noqa: E402
from oomless.plan.planner import smallest_memory_for  # noqa: E402
from oomless.runtime.install import installed_state  # noqa: E402
from tests.conftest import apply_plan_for_share, ledger_case, minimum_memory, plan_under  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = torch.device("cuda", 0)


@pytest.fixture
def deterministic_kernels():
    """Plain PyTorch must be reproducible for bitwise comparison: no cuDNN autotuning, deterministic
    algorithms where they exist (warn_only: MaxPool3d's backward has none, but with stride equal to
    its kernel each input gets at most one gradient, so its atomics add in a fixed order)."""
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[0], saved[1]
    torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])


def _fresh_memory() -> int:
    gc.collect()
    torch.cuda.synchronize(DEVICE)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(DEVICE)


# ---------------------------------------------------------------------------------------------
# (a) Equality with plain PyTorch: the models and plans of tests/test_fit_equality.py, on CUDA.

def _mlp():
    return MLP((64, 256, 256, 256, 256, 256, 10)), torch.randn(32, 64), lambda out: out.square().mean()


def _cnn():
    return SmallCNN(in_channels=3, num_classes=10), torch.randn(4, 3, 32, 32), lambda out: out.logsumexp(1).mean()


def _unet():
    return UNet3D(base_channels=4, depth=2), torch.randn(2, 1, 16, 16, 16), None


def _transformer():
    return TinyTransformer(vocab_size=256, dim=64, depth=3, heads=4, max_len=32), torch.randint(0, 256, (4, 32)), None


def _dict_output():
    return DictOutputModel(in_features=64, hidden=256, out_features=8), torch.randn(32, 64), \
        lambda out: out["logits"].square().mean() + out["aux"].mean()


def _on_device(build):
    """The model, inputs and loss of ``build`` on the GPU (losses that read the inputs read the
    device copy)."""
    model, inputs, loss_fn = build()
    model, inputs = model.to(DEVICE), inputs.to(DEVICE)
    if loss_fn is None and inputs.dtype == torch.long:
        def loss_fn(out):
            return F.cross_entropy(out.flatten(0, 1), inputs.roll(-1, 1).flatten())
    elif loss_fn is None:
        target = (inputs[:, 0] > 0).long()

        def loss_fn(out):
            return F.cross_entropy(out, target)
    return model, inputs, loss_fn


MODELS = {"mlp": _mlp, "cnn": _cnn, "unet3d": _unet, "transformer": _transformer, "dict": _dict_output}


def _train(model, inputs, loss_fn, steps=2):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)  # seeds CUDA too: dropout draws the same masks in both runs
        loss_fn(model(inputs)).backward()
        optimizer.step()
    return model


def _differences(reference, trained) -> list[str]:
    differing = []
    for (name, expected), (_, actual) in zip(reference.named_parameters(), trained.named_parameters()):
        if not torch.equal(expected, actual):
            differing.append(f"parameter {name}")
        if not torch.equal(expected.grad, actual.grad):
            differing.append(f"gradient of {name}")
    for (name, expected), (_, actual) in zip(reference.named_buffers(), trained.named_buffers()):
        if not torch.equal(expected, actual):
            differing.append(f"buffer {name}")
    return differing


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("policy", ["keep", "swap", "recompute", "planned"])
def test_training_on_cuda_equals_plain_pytorch(model_name, policy, deterministic_kernels):
    torch.manual_seed(0)
    model, inputs, loss_fn = _on_device(MODELS[model_name])
    reference, control = copy.deepcopy(model), copy.deepcopy(model)
    _train(reference, inputs, loss_fn)
    _train(control, inputs, loss_fn)
    if _differences(reference, control):
        pytest.skip(f"plain PyTorch itself is not bitwise reproducible for {model_name} on this GPU")

    plan, memory = plan_under(model, inputs, loss_fn, policy)
    if policy == "planned" and memory < plan.plain_peak_bytes:
        assert set(plan.decisions.values()) != {"keep"}, "the budget should force swaps or recomputes"
    oomless.apply(model, plan)
    _train(model, inputs, loss_fn)

    assert not _differences(reference, model), _differences(reference, model)
    stats = oomless.stats(model)
    if policy == "swap":
        assert stats.offloaded_bytes > 0
    if policy == "recompute":
        assert stats.recomputed_blocks >= 2 * len(plan.decisions) - 2
    assert stats.resident_activation_bytes == 0


class _KeywordBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, hidden, scale=1.0):
        return self.dropout(self.linear(hidden).relu()) * scale


class _KeywordNet(torch.nn.Module):
    """Blocks called with keyword arguments only, as many HF layers are."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_KeywordBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(hidden=x, scale=2.0)
        return x


def test_recompute_of_blocks_called_with_keywords_replays_cuda_dropout(deterministic_kernels):
    torch.manual_seed(0)
    model, inputs = _KeywordNet().to(DEVICE), torch.randn(64, 256, device=DEVICE)

    def loss_fn(out):
        return out.square().mean()
    reference = copy.deepcopy(model)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, blocks=[_KeywordBlock])
    oomless.apply(model, plan.with_decisions({name: "recompute" for name in plan.decisions}))
    _train(reference, inputs, loss_fn)
    reference_rng = torch.cuda.get_rng_state(DEVICE)
    _train(model, inputs, loss_fn)
    assert not _differences(reference, model), _differences(reference, model)
    assert oomless.stats(model).recomputed_blocks == 6
    # The recompute forked the CUDA RNG and put it back: it is where plain PyTorch left it.
    assert torch.equal(torch.cuda.get_rng_state(DEVICE), reference_rng)


# ---------------------------------------------------------------------------------------------
# (b, c, d) Memory: the promise, the ledger, and swapped bytes really leaving the GPU.

def _large_transformer():
    model = TinyTransformer(vocab_size=512, dim=256, depth=6, heads=8, max_len=1024, dropout=0.1).to(DEVICE)
    tokens = torch.randint(0, 512, (8, 1024), device=DEVICE)
    return model, tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten())


def _large_unet():
    model = UNet3D(base_channels=8, depth=3).to(DEVICE)
    volume = torch.randn(2, 1, 96, 96, 96, device=DEVICE)
    target = (volume[:, 0] > 0.5).long()
    return model, volume, lambda out: F.cross_entropy(out, target)


LARGE = {"transformer": _large_transformer, "unet3d": _large_unet}


class _PeakTracker:
    """`max_memory_allocated` since `start`, across the resets the profiler's MemoryProbe makes at
    every block boundary (each reset first folds the peak so far in)."""

    def __init__(self, monkeypatch):
        self.peak_bytes = 0
        self._reset = torch.cuda.reset_peak_memory_stats

        def folding_reset(device=None):
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(DEVICE))
            self._reset(device)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", folding_reset)

    def start(self):
        self.peak_bytes = 0
        self._reset(DEVICE)

    def peak(self) -> int:
        return max(self.peak_bytes, torch.cuda.max_memory_allocated(DEVICE))


def _steps(model, inputs, loss_fn, optimizer, steps=2):
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        optimizer.step()


def _plain_peak_bytes(name, tracker) -> int:
    """Peak of two plain steps (Adam state included) above the memory allocated before building."""
    baseline = _fresh_memory()
    torch.manual_seed(0)
    model, inputs, loss_fn = LARGE[name]()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tracker.start()
    _steps(model, inputs, loss_fn, optimizer)
    peak = tracker.peak() - baseline
    del model, inputs, loss_fn, optimizer
    _fresh_memory()
    return peak


def _planned_peak_bytes(name, tracker, memory=None, everything=None, at_smallest_memory=False,
                        precision="fp32"):
    """Peak of planning (profiling included) plus two steps under the plan, above the baseline;
    ``memory`` may be a function of the profile; ``everything`` forces that decision on every block."""
    baseline = _fresh_memory()
    torch.manual_seed(0)
    model, inputs, loss_fn = LARGE[name]()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tracker.start()
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer, precision=precision)
    decisions = {block.name: everything for block in profile.blocks} if everything else None
    if callable(memory):
        memory = memory(profile)
    if at_smallest_memory:
        memory = smallest_memory_for(profile, decisions, min_swap_bytes=0)
    plan = oomless.plan(model, inputs, memory, decisions=decisions, profile=profile, min_swap_bytes=0,
                        precision=precision)
    oomless.apply(model, plan)
    _steps(model, inputs, loss_fn, optimizer)
    peak = tracker.peak() - baseline
    stats = oomless.stats(model)
    oomless.remove(model)
    del model, inputs, loss_fn, optimizer
    _fresh_memory()
    return peak, plan, stats


# The U-Net holds its encoder outputs for the decoder's skips whatever the plan: it cannot go as
# low as the transformer. Asked for `share` of plain, planned at no less than the planner's exact
# minimum, which must itself stay under `ceiling` of plain.
@pytest.mark.parametrize("name, share, ceiling", [("transformer", 0.5, 0.6), ("unet3d", 0.75, 0.85)])
def test_step_on_cuda_peaks_within_memory_well_below_plain(name, share, ceiling, monkeypatch):
    tracker = _PeakTracker(monkeypatch)
    plain = _plain_peak_bytes(name, tracker)
    peak, plan, stats = _planned_peak_bytes(
        name, tracker, memory=lambda profile: max(int(share * plain), minimum_memory(profile)))
    memory = plan.memory_bytes
    mib = 2**20
    print(f"\n{name}: plain {plain / mib:.0f} MiB, memory {memory / mib:.0f} MiB ({memory / plain:.0%}), measured "
          f"{peak / mib:.0f} MiB, margin {(memory - peak) / mib:.0f} MiB, predicted "
          f"{plan.predicted_peak_bytes / mib:.0f} MiB, ledger peak {stats.peak_activation_bytes / mib:.0f} "
          f"of {plan.activation_budget / mib:.0f} MiB, offloaded {stats.offloaded_bytes / mib:.0f} MiB, "
          f"recomputed {stats.recomputed_blocks}, decisions {sorted(set(plan.decisions.values()))}")
    assert memory <= ceiling * plain, f"the planner's minimum is {memory / plain:.0%} of plain"
    assert peak <= memory
    assert set(plan.decisions.values()) != {"keep"}
    # (c) the ledger kept its own promise, and emptied after backward
    assert stats.peak_activation_bytes <= plan.activation_budget
    assert stats.resident_activation_bytes == 0


@pytest.mark.parametrize("name", LARGE)
def test_all_swap_really_moves_bytes_off_the_gpu(name, monkeypatch):
    """A swapped storage is freed only once its copy is seen complete, so a lower allocated peak
    means bytes really left. Budgeted at the smallest memory the all-swap plan fits, where nothing
    comes back before backward reaches it. (At its own prediction without a budget the plan brings
    everything back at once, near plain's peak on the U-Net: 879 of 880 MiB, H200, 2026-11-27.)
    Without a budget, compute outruns the copies and in-flight bytes pile up (printed, not asserted)."""
    tracker = _PeakTracker(monkeypatch)
    plain = _plain_peak_bytes(name, tracker)
    unbudgeted, _, _ = _planned_peak_bytes(name, tracker, memory=2**40, everything="swap")
    peak, plan, stats = _planned_peak_bytes(name, tracker, everything="swap", at_smallest_memory=True)
    mib = 2**20
    print(f"\n{name} all-swap: plain {plain / mib:.0f} MiB, swapped {peak / mib:.0f} MiB within "
          f"{plan.memory_bytes / mib:.0f} MiB, unbudgeted {unbudgeted / mib:.0f} MiB, offloaded "
          f"{stats.offloaded_bytes / mib:.0f} MiB, stalled {stats.stall_seconds * 1e3:.1f} ms")
    assert stats.offloaded_bytes > 0
    assert peak <= plan.memory_bytes
    assert peak < 0.8 * plain


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25, "minimum"])
@pytest.mark.parametrize("model_name", ["unet3d", "transformer"])
def test_ledger_on_cuda_stays_within_the_activation_budget(model_name, share):
    """tests/test_ledger.py on the GPU."""
    torch.manual_seed(0)
    model, inputs, loss_fn = ledger_case(model_name, DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plan, _ = apply_plan_for_share(model, inputs, loss_fn, optimizer, share)
    _steps(model, inputs, loss_fn, optimizer)
    stats = oomless.stats(model)
    assert stats.peak_activation_bytes <= plan.activation_budget
    assert stats.resident_activation_bytes == 0


# ---------------------------------------------------------------------------------------------
# (e) No host synchronisation in the hot path.

class _HostSyncError(RuntimeError):
    pass


def _forbid_python_level_syncs(monkeypatch):
    """Sync debug mode sees syncs inside ATen (.item(), pageable copies) but not cudaEventSynchronize,
    cudaStreamSynchronize or cudaDeviceSynchronize called from Python: forbid those directly."""
    def refuse(*args, **kwargs):
        raise _HostSyncError("host synchronisation in the hot path")
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)


def _forward_backward_without_sync(model, inputs, loss_fn, monkeypatch):
    with monkeypatch.context() as patch:
        _forbid_python_level_syncs(patch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss_fn(model(inputs)).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("policy", ["swap", "recompute"])
@pytest.mark.parametrize("model_name", ["unet3d", "transformer"])
def test_a_planned_step_makes_no_host_synchronisation(model_name, policy, monkeypatch):
    torch.manual_seed(0)
    if model_name == "unet3d":
        model, inputs = UNet3D(base_channels=8, depth=2).to(DEVICE), torch.randn(2, 1, 32, 32, 32, device=DEVICE)
        target = (inputs[:, 0] > 0).long()

        def loss_fn(out):
            return F.cross_entropy(out, target)
    else:
        # At most 3072 token indices: embedding's backward past that sorts, with an .item() of its own.
        model = TinyTransformer(vocab_size=256, dim=128, depth=4, heads=4, max_len=512).to(DEVICE)
        inputs = torch.randint(0, 256, (2, 512), device=DEVICE)

        def loss_fn(out):
            return F.cross_entropy(out.flatten(0, 1), inputs.flatten())
    plain = copy.deepcopy(model)
    loss_fn(plain(inputs)).backward()  # warm-up: kernels load, cuBLAS handles are created
    try:
        _forward_backward_without_sync(plain, inputs, loss_fn, monkeypatch)
    except RuntimeError as error:
        pytest.skip(f"plain PyTorch already synchronises in this step: {error}")

    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0)
    oomless.apply(model, plan.with_decisions({name: policy for name in plan.decisions}))
    loss_fn(model(inputs)).backward()  # the first step fills the pinned pool (allocation is not a hot path)
    model.zero_grad(set_to_none=True)
    _forward_backward_without_sync(model, inputs, loss_fn, monkeypatch)
    stats = oomless.stats(model)
    assert stats.offloaded_bytes > 0 if policy == "swap" else stats.recomputed_blocks > 0
    assert stats.resident_activation_bytes == 0
    tier = installed_state(model).tier
    if tier is not None:
        buffers = tier.pool.buffers()
        assert buffers and all(buffer.is_pinned() for buffer in buffers), "non_blocking copies need pinned memory"


# ---------------------------------------------------------------------------------------------
# (f) The swap tier's own resources: copy streams of its own, pinned buffers of every size.

def test_the_tier_copies_on_streams_of_its_own_not_torchs_pool():
    """torch.cuda.Stream() hands out 32 pooled streams per priority, round robin: asking for 64 of
    each priority returns every one of them, and none may be the tier's."""
    from oomless.runtime.tiers import PinnedHostTier

    tier = PinnedHostTier(DEVICE)
    assert tier.dedicated_streams
    pooled = {torch.cuda.Stream(DEVICE, priority=priority).cuda_stream for priority in (0, -1) for _ in range(64)}
    own = {tier.copy_out_stream.cuda_stream, tier.copy_in_stream.cuda_stream}
    assert len(own) == 2 and not own & pooled and torch.cuda.current_stream(DEVICE).cuda_stream not in own
    # A round trip through the tier lands the same bytes.
    data = torch.arange(1 << 20, device=DEVICE, dtype=torch.int32).view(torch.uint8)
    ticket = tier.put(data)
    back = tier.get(ticket).clone()
    assert torch.equal(back, data)
    tier.release(ticket)
    tier.close()


def test_a_zero_byte_storage_swaps_through_pinned_memory():
    from oomless.runtime.tiers import PinnedHostTier

    tier = PinnedHostTier(DEVICE)
    ticket = tier.put(torch.empty(0, dtype=torch.uint8, device=DEVICE))
    assert ticket.host.numel() == 0 and all(buffer.is_pinned() for buffer in tier.pool.buffers())
    assert tier.get(ticket).numel() == 0
    tier.release(ticket)
    tier.close()


# ---------------------------------------------------------------------------------------------
# (g) The training loop on CUDA: --deterministic runs (torch has no deterministic nll_loss2d
# reduction, so strict mode would raise), batches go through pinned memory.

def test_deterministic_training_on_cuda_runs_and_copies_batches_from_pinned_memory(monkeypatch):
    from oomless.train import TrainConfig, train

    pinned = []
    pin_memory = torch.Tensor.pin_memory

    def counted(tensor, *args, **kwargs):
        pinned.append(tensor.shape)
        return pin_memory(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", counted)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        result = train(TrainConfig(size=16, steps=2, base_channels=4, depth=2, device="cuda", deterministic=True,
                                   progress=False, log_every=1))
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
    assert [record["step"] for record in result.history] == [1, 2]
    assert all(torch.isfinite(torch.tensor(record["loss"])) for record in result.history)
    assert len(pinned) >= 2 * 2          # volumes and labels, each step (pinned by the data loader)
