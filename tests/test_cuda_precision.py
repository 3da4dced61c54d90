"""Mixed precision and regional compile on CUDA: oomless + autocast (or compiled blocks) equals plain
PyTorch + the same autocast (or ``torch.compile(block)``) bit for bit, under keep, swap, recompute and
planned decisions, and a bf16 plan's step stays within its memory on the allocator's count. The CPU
versions are tests/test_precision.py and tests/test_compile.py; these run where a GPU is at hand:

    python -m pytest -q -s -m gpu tests/test_cuda_precision.py

(part of ``make gpu``, bench/gpu_suite.py's cuda_tests piece). Skipped without CUDA.
"""

import copy

import pytest
import torch

import oomless
from oomless.runtime.precision import precision_state
from tests.conftest import budget_for_share, minimum_memory, plan_under, train_steps
from tests.test_compile import compiled_reference, fresh_dynamo  # noqa: F401  (a fixture)
from tests.test_cuda import (LARGE, MODELS, _differences, _on_device, _PeakTracker,  # noqa: F401
                              _planned_peak_bytes, deterministic_kernels)
from tests.test_precision import train_bf16_beside_plain_autocast, train_plain_autocast

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reproducible(model, inputs, loss_fn, precision, scaler_options=None) -> bool:
    """Whether plain PyTorch itself trains bitwise alike twice on this GPU under ``precision``."""
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for trained in (first, second):
        scaler = None if scaler_options is None else torch.amp.GradScaler(inputs.device.type, **scaler_options)
        train_plain_autocast(trained, inputs, loss_fn, precision, scaler=scaler)
    return not _differences(first, second)


@pytest.mark.parametrize("model_name", ["mlp", "transformer", "unet3d"])
@pytest.mark.parametrize("policy", ["keep", "swap", "recompute", "planned"])
def test_bf16_on_cuda_equals_plain_autocast(model_name, policy, deterministic_kernels):
    torch.manual_seed(0)
    model, inputs, loss_fn = _on_device(MODELS[model_name])
    if not _reproducible(model, inputs, loss_fn, "bf16"):
        pytest.skip(f"plain PyTorch under bf16 autocast is not bitwise reproducible for {model_name} on this GPU")
    reference, _ = train_bf16_beside_plain_autocast(model, inputs, loss_fn, policy)
    assert not _differences(reference, model), _differences(reference, model)
    assert oomless.stats(model).resident_activation_bytes == 0


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_fp16_on_cuda_equals_grad_scaler_with_its_skipped_steps(policy, deterministic_kernels):
    """At 2**22 fp16 gradients overflow at first: GradScaler skips those steps and halves its scale;
    oomless's scaling at the model's boundary skips the same ones (one host synchronisation per
    step, as GradScaler's)."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _on_device(MODELS["transformer"])
    options = dict(init_scale=2.0**22, growth_interval=2000)
    if not _reproducible(model, inputs, loss_fn, "fp16", options):
        pytest.skip("plain PyTorch under fp16 autocast is not bitwise reproducible on this GPU")
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    plan, _ = plan_under(model, inputs, loss_fn, policy, precision="fp16", optimizer=optimizer)
    oomless.apply(model, plan, optimizer=optimizer)
    precision_state(model).scaler.scale = options["init_scale"]
    scaler = torch.amp.GradScaler(inputs.device.type, **options)

    train_plain_autocast(reference, inputs, loss_fn, "fp16", steps=4, scaler=scaler)
    train_steps(model, optimizer, inputs, loss_fn, steps=4)

    stats = oomless.stats(model)
    assert stats.loss_scale == scaler.get_scale()
    assert 0 < stats.skipped_steps < 4, "some steps overflow at 2**22 and some train"
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected, actual), f"parameter {name} differs"


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_blocks_on_cuda_equal_plain_compiled(policy, precision, fresh_dynamo, deterministic_kernels):
    """aot_eager-compiled blocks (AOTAutograd as inductor runs it, no code generation: the same aten
    kernels on both sides) under each plan, against ``torch.compile(block)`` in place; the swap moves
    what the compiled blocks save, through the pinned tier and its copy streams."""
    options = {"backend": "aot_eager"}
    torch.manual_seed(0)
    model, inputs, loss_fn = _on_device(MODELS["transformer"])
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, compile=options,
                        precision=precision)
    plan = plan.with_decisions({name: policy for name in plan.decisions})
    reference = compiled_reference(model, plan.decisions, options)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    oomless.apply(model, plan, optimizer=optimizer)

    if precision == "bf16":
        train_plain_autocast(reference, inputs, loss_fn, "bf16")
    else:
        train_steps(reference, torch.optim.Adam(reference.parameters(), lr=1e-2), inputs, loss_fn)
    train_steps(model, optimizer, inputs, loss_fn)

    # By position: the reference's compiled blocks prefix their names with ``_orig_mod.``.
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected, actual), f"parameter {name} differs"
    stats = oomless.stats(model)
    if policy == "swap":
        assert stats.offloaded_bytes == 2 * sum(block.saved_bytes for block in plan.blocks)


def test_bf16_plan_on_cuda_peaks_within_its_memory_and_saves_less_than_fp32(monkeypatch):
    """The large transformer planned in bf16 at half its plain bf16 activations: the allocator's peak
    (planning and two steps, above what was allocated before the model was built) stays within the
    plan's memory; and bf16 saves fewer bytes than fp32 for the same model (measured, not assumed)."""
    tracker = _PeakTracker(monkeypatch)
    peak, plan, stats = _planned_peak_bytes(
        "transformer", tracker, precision="bf16",
        memory=lambda profile: max(budget_for_share(profile, 0.5), minimum_memory(profile)))
    mib = 2**20
    print(f"\nbf16 transformer: memory {plan.memory_bytes / mib:.0f} MiB, measured {peak / mib:.0f} MiB, predicted "
          f"{plan.predicted_peak_bytes / mib:.0f} MiB, offloaded {stats.offloaded_bytes / mib:.0f} MiB, "
          f"decisions {sorted(set(plan.decisions.values()))}")
    assert plan.precision == "bf16" and set(plan.decisions.values()) != {"keep"}
    assert peak <= plan.memory_bytes
    assert stats.peak_activation_bytes <= plan.activation_budget

    torch.manual_seed(0)
    model, inputs, loss_fn = LARGE["transformer"]()
    saved = {precision: sum(block.saved_bytes for block in oomless.profile(model, inputs, loss_fn=loss_fn,
                                                                           precision=precision).blocks)
             for precision in ("fp32", "bf16")}
    print(f"saved per step: fp32 {saved['fp32'] / mib:.0f} MiB, bf16 {saved['bf16'] / mib:.0f} MiB")
    assert saved["bf16"] < 0.75 * saved["fp32"], saved
