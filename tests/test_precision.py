"""Mixed precision under every plan: oomless + autocast equals plain PyTorch + the same autocast.

The plain reference is what a user writes by hand: the forward under ``torch.autocast``, its
floating outputs brought back to fp32 for the loss (as oomless and accelerate do), and for fp16
``torch.amp.GradScaler``. Both train two (or more) Adam steps from the same deepcopy and seeds and
are compared bit for bit (`torch.equal`).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import oomless
from oomless.errors import ApplyError, InputError
from oomless.models import MLP, SmallCNN
from oomless.runtime import precision as precision_module
from oomless.runtime.precision import precision_state
from tests.conftest import cpu_dropout_as_cuda_runs_it, ledger_case, plan_under, train_steps
from tests.test_fit_equality import MODELS, _assert_same

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _to_fp32(output, dtype):
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == dtype else t, output)


def train_plain_autocast(model, inputs, loss_fn, precision, steps=2, scaler=None, lr=1e-2):
    """Plain PyTorch with autocast around the forward (and GradScaler when given), on the inputs'
    device (tests/test_cuda_precision.py runs it on CUDA)."""
    dtype = DTYPES[precision]
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        with torch.autocast(inputs.device.type, dtype=dtype):
            output = model(inputs)
        loss = loss_fn(_to_fp32(output, dtype))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return model


def train_bf16_beside_plain_autocast(model, inputs, loss_fn, policy):
    """Two Adam steps of ``model`` under oomless bf16 with every block under ``policy`` (or
    "planned" at half the activations), and of a deepcopy under plain bf16 autocast; returns
    (reference, plan). Checks the plan is a bf16 one that moves what the policy says."""
    reference = copy.deepcopy(model)
    plan, memory = plan_under(model, inputs, loss_fn, policy, precision="bf16")
    assert plan.precision == "bf16"
    if policy == "planned" and memory < plan.plain_peak_bytes:
        assert set(plan.decisions.values()) != {"keep"}, "the budget should force swaps or recomputes"
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    oomless.apply(model, plan, optimizer=optimizer)

    train_plain_autocast(reference, inputs, loss_fn, "bf16")
    train_steps(model, optimizer, inputs, loss_fn)

    stats = oomless.stats(model)
    assert (stats.offloaded_bytes > 0) == (policy == "swap" or "swap" in plan.decisions.values())
    return reference, plan


@pytest.mark.parametrize("model_name", ["mlp", "unet3d", "transformer"])
@pytest.mark.parametrize("policy", ["keep", "swap", "recompute", "planned"])
def test_bf16_equals_plain_autocast(model_name, policy):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[model_name]()
    reference, plan = train_bf16_beside_plain_autocast(model, inputs, loss_fn, policy)
    _assert_same(reference, model)
    if policy == "recompute":
        assert oomless.stats(model).recomputed_blocks >= 2 * len(plan.decisions) - 2


def test_a_loop_already_under_autocast_gets_the_same_plan_and_plain_results():
    """The user wraps forward and loss in autocast themselves: oomless steps aside (no second
    autocast, no fp32 cast of outputs) and the step equals plain PyTorch with that same wrapping."""
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["mlp"]()
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, precision="bf16")
    plan = plan.with_decisions({name: "swap" for name in plan.decisions})
    oomless.apply(model, plan)
    for trained in (reference, model):
        optimizer = torch.optim.Adam(trained.parameters(), lr=1e-2)
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(trained(inputs))
            loss.backward()
            optimizer.step()
    _assert_same(reference, model)
    assert oomless.stats(model).offloaded_bytes > 0


def test_autocast_of_another_dtype_than_planned_is_refused_before_the_forward():
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["mlp"]()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(InputError, match="precision='bf16'"):
        oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn)          # fp32 plan under bf16 autocast
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn)               # planned for fp32
    ledger = model._oomless.ledger
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ApplyError, match="planned it for fp32"):
        model(inputs)
    assert ledger.steps == 0, "the planned forward must not have started"
    assert not torch.is_autocast_enabled("cpu")
    loss_fn(model(inputs)).backward()                                  # the model still trains afterwards
    oomless.remove(model)

    optimizer = torch.optim.Adam(model.parameters())
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, precision="bf16", optimizer=optimizer)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ApplyError, match="bf16"):
        model(inputs)


def _fp16_case(model_name):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[model_name]()
    return model, copy.deepcopy(model), inputs, loss_fn


@pytest.mark.parametrize("policy, initial_scale, growth_interval",
                         [("keep", 2.0**22, 2000), ("swap", 2.0**16, 2000), ("recompute", 2.0**22, 2000),
                          ("keep", 2.0**10, 2)])
def test_fp16_equals_grad_scaler(policy, initial_scale, growth_interval):
    """Loss scaling at the model's boundary equals GradScaler on the loss, including the steps it
    skips (2**22 overflows fp16 at first: those steps are skipped and the scale halves) and the
    growth after ``growth_interval`` clean steps (2**10 overflows nothing: it doubles twice in 4 steps)."""
    model, reference, inputs, loss_fn = _fp16_case("transformer")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    plan, _ = plan_under(model, inputs, loss_fn, policy, precision="fp16", optimizer=optimizer)
    oomless.apply(model, plan, optimizer=optimizer)
    precision_state(model).scaler.scale = initial_scale
    precision_state(model).scaler.growth_interval = growth_interval
    scaler = torch.amp.GradScaler("cpu", init_scale=initial_scale, growth_interval=growth_interval)

    train_plain_autocast(reference, inputs, loss_fn, "fp16", steps=4, scaler=scaler)
    train_steps(model, optimizer, inputs, loss_fn, steps=4)

    stats = oomless.stats(model)
    assert stats.loss_scale == scaler.get_scale()
    if growth_interval == 2:
        assert (stats.loss_scale, stats.skipped_steps) == (initial_scale * 4, 0), "two growths in four clean steps"
    else:
        expected_skips = round(torch.log2(torch.tensor(initial_scale / scaler.get_scale())).item())
        assert stats.skipped_steps == expected_skips
    if initial_scale > 2.0**16:
        assert 0 < stats.skipped_steps < 4, "some steps overflow at 2**22 and some train"
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected, actual), f"parameter {name} differs"
        # A skipped step leaves inf/nan gradients behind in both: equal including those.
        assert torch.equal(expected.grad.nan_to_num(), actual.grad.nan_to_num()), f"gradient of {name} differs"


def test_fp16_gradients_are_true_for_clipping_and_accumulation():
    """``.grad`` holds unscaled gradients after every backward, so a loop that accumulates two
    micro-batches and clips equals GradScaler's recipe (unscale_ before clip_grad_norm_)."""
    model, reference, inputs, loss_fn = _fp16_case("mlp")
    halves = inputs.chunk(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, precision="fp16")
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)
        for half in halves:
            loss_fn(model(half)).backward()
            with torch.autocast("cpu", dtype=torch.float16):
                output = reference(half)
            scaler.scale(loss_fn(output.float())).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
        scaler.unscale_(reference_optimizer)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        scaler.step(reference_optimizer)
        scaler.update()
    _assert_same(reference, model)


def test_fp16_a_parameter_unfrozen_after_fit_gets_its_true_gradient():
    """Transfer learning: the first layer frozen when the model is fitted, unfrozen (and added to
    the optimizer) after a step. Its gradient is unscaled as the others are (it held 65536x its
    gradient before), so training equals GradScaler's recipe on the same loop."""
    model, reference, inputs, loss_fn = _fp16_case("mlp")
    first = lambda m: next(m.children())
    first(model).requires_grad_(False)
    first(reference).requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, precision="fp16")
    scaler = torch.amp.GradScaler("cpu")
    for step in range(3):
        if step == 1:
            for network, its_optimizer in ((model, optimizer), (reference, reference_optimizer)):
                first(network).requires_grad_(True)
                its_optimizer.add_param_group({"params": list(first(network).parameters()), "lr": 0.01})
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        optimizer.step()
        with torch.autocast("cpu", dtype=torch.float16):
            output = reference(inputs)
        scaler.scale(loss_fn(output.float())).backward()
        scaler.step(reference_optimizer)
        scaler.update()
    assert oomless.stats(model).skipped_steps == 0
    _assert_same(reference, model)      # parameters and gradients, the unfrozen layer's included


def _fitted_fp16_mlp(accumulation_steps=1):
    """An MLP fitted for fp16 with its SGD optimizer, and an untouched copy of it."""
    model, other, inputs, loss_fn = _fp16_case("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, precision="fp16",
                accumulation_steps=accumulation_steps)
    return model, other, inputs, loss_fn, optimizer


@pytest.mark.parametrize("initial_scale, micro_batches, set_to_none, refused_at_step",
                         [(2.0**16, 1, True, 1), (2.0**16, 2, False, 1), (1.0, 1, True, 0)])
def test_fp16_with_the_users_own_grad_scaler_is_refused_at_its_first_step(initial_scale, micro_batches,
                                                                           set_to_none, refused_at_step):
    """A plain-AMP loop kept as it was (``scaler.scale(loss).backward(); scaler.step(optimizer)``)
    scales the loss twice: at 2**16 x 2**16 the gradients overflow and the GradScaler skips
    ``optimizer.step()``, which no hook of oomless sees (it went on for 13 steps, weights unchanged,
    skipped_steps 0). Refused at the next forward; a GradScaler whose steps go through (scale 1, no
    overflow) is refused in its first ``step()``. Nothing is updated, and the plain loop then trains."""
    model, _, inputs, loss_fn, optimizer = _fitted_fp16_mlp(micro_batches)
    before = copy.deepcopy(model.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=initial_scale)
    with pytest.raises(InputError, match="drop torch.amp.GradScaler from the loop") as refused:
        for step in range(3):
            optimizer.zero_grad(set_to_none=set_to_none)
            for micro_batch in inputs.chunk(micro_batches):
                scaler.scale(loss_fn(model(micro_batch)) / micro_batches).backward()
            scaler.step(optimizer)
            scaler.update()
    assert step == refused_at_step, str(refused.value)
    if refused_at_step == 1:
        assert scaler.get_scale() == initial_scale / 2, "the GradScaler skipped the first step"
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert not torch.is_autocast_enabled("cpu"), "the refused forward left autocast on"

    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(inputs)).backward()
    optimizer.step()
    assert not torch.equal(before["0.weight"], model.state_dict()["0.weight"])
    assert oomless.stats(model).skipped_steps == 0


def test_fp16_loops_without_their_own_grad_scaler_are_not_refused():
    """A pass that drops its gradients without a step (saliency), and gradient accumulation
    (gradients zeroed in place) beside another model trained with its own GradScaler: neither is
    taken for a GradScaler on this model. After the first step nothing is watched any more."""
    model, _, inputs, loss_fn, optimizer = _fitted_fp16_mlp()
    loss_fn(model(inputs)).backward()
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(inputs)).backward()
    optimizer.step()

    model, other, inputs, loss_fn, optimizer = _fitted_fp16_mlp(accumulation_steps=2)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            optimizer.zero_grad(set_to_none=False)
            other_optimizer.zero_grad(set_to_none=True)
            for micro_batch in inputs.chunk(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    output = other(micro_batch)
                scaler.scale(loss_fn(output.float())).backward()
                loss_fn(model(micro_batch)).backward()
            optimizer.step()
            scaler.step(other_optimizer)
            scaler.update()
    assert precision_state(model).guard.watch_handle is None


def test_bf16_with_the_users_own_grad_scaler_equals_plain_autocast_with_it():
    """bf16 scales nothing itself: a loop that keeps its GradScaler trains as plain bf16 autocast
    with that GradScaler does, bit for bit, and is not refused."""
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["mlp"]()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, precision="bf16")
    train_plain_autocast(reference, inputs, loss_fn, "bf16", steps=3, scaler=torch.amp.GradScaler("cpu"))
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            scaler.scale(loss_fn(model(inputs))).backward()
            scaler.step(optimizer)
            scaler.update()
    _assert_same(reference, model)


def test_bf16_plans_hold_about_half_the_fp32_saved_bytes():
    """Counted, not assumed: the same model planned (all kept) and trained (all swapped) at fp32 and
    bf16. Measured on this CPU (torch 2.13): transformer 0.56, U-Net 0.62 (CPU autocast runs max-pool
    in fp32, so the U-Net's pooled inputs stay 4 bytes an element); the bf16 weight copies autocast
    makes are saved activations too. A swap moves each tensor in its own dtype, so the bytes
    offloaded shrink in the same proportion."""
    for model_name in ("transformer", "unet3d"):
        held, offloaded = {}, {}
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            model, inputs, loss_fn = ledger_case(model_name)
            plan, _ = plan_under(model, inputs, loss_fn, "keep", precision=precision)
            held[precision] = plan.predicted_activation_peak_bytes
            plan = plan.with_decisions({name: "swap" for name in plan.decisions})
            oomless.apply(model, plan)
            loss_fn(model(inputs)).backward()
            offloaded[precision] = oomless.stats(model).offloaded_bytes
        held_ratio = held["bf16"] / held["fp32"]
        offloaded_ratio = offloaded["bf16"] / offloaded["fp32"]
        assert 0.45 < held_ratio < 0.65, (model_name, held)
        assert 0.45 < offloaded_ratio < 0.65, (model_name, offloaded)


@pytest.mark.parametrize("build, shape", [(lambda: MLP((64, 256, 256, 256, 10)), (32, 64)),
                                          (lambda: SmallCNN(in_channels=3, num_classes=10), (4, 3, 32, 32))])
def test_target_profile_under_emulated_autocast_saves_what_real_autocast_saves(build, shape):
    """Planning for a GPU on meta tensors applies CUDA autocast's casting policy by hand; for
    linear, convolution, BatchNorm, ReLU and max-pool CPU and CUDA autocast agree, so each block's
    saved bytes must equal those of a real bf16 step here (its dropout as CUDA runs it)."""
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    torch.manual_seed(0)
    with cpu_dropout_as_cuda_runs_it():
        real = oomless.profile(build(), torch.randn(*shape), loss_fn=loss_fn, precision="bf16")
    with torch.device("meta"):
        meta_model = build()
    fake = oomless.profile(meta_model, torch.empty(*shape, device="meta"), loss_fn=loss_fn, target="h100",
                           precision="bf16")
    assert fake.precision == "bf16"
    assert [(b.name, b.saved_bytes) for b in fake.blocks] == [(b.name, b.saved_bytes) for b in real.blocks]
    fp32 = oomless.profile(meta_model, torch.empty(*shape, device="meta"), loss_fn=loss_fn, target="h100")
    assert [b.saved_bytes for b in fake.blocks] != [b.saved_bytes for b in fp32.blocks]


def test_remove_takes_every_precision_hook_away():
    model, _, inputs, loss_fn = _fp16_case("mlp")
    optimizer = torch.optim.Adam(model.parameters())
    before = copy.deepcopy(model.state_dict())
    oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, precision="fp16")
    assert all(p._backward_hooks for p in model.parameters())
    oomless.remove(model)
    assert precision_state(model) is None and not hasattr(model, "_oomless")
    assert not any(p._backward_hooks for p in model.parameters())
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert model(inputs).dtype == torch.float32
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def _assert_untouched(model, before):
    assert not hasattr(model, "_oomless") and precision_state(model) is None
    assert not model._forward_hooks and not model._forward_pre_hooks
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_bad_precision_input_is_refused_before_any_step(monkeypatch):
    model, _, inputs, loss_fn = _fp16_case("mlp")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(InputError, match="precision must be one of fp32, bf16, fp16"):
        oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, precision="float8")
    with pytest.raises(InputError, match="needs the optimizer"):
        oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, precision="fp16")
    with pytest.raises(InputError, match="cannot be combined with update_in_backward=True"):
        oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, precision="fp16", update_in_backward=True,
                     optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(InputError, match="cannot be combined with offload_optimizer_state=True, offload_parameters"):
        oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, precision="fp16", offload_optimizer_state=True,
                     offload_parameters=True, optimizer=torch.optim.Adam(model.parameters()))
    _assert_untouched(model, before)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, precision="bf16")
    with pytest.raises(InputError, match="measured at precision 'bf16', not 'fp32'"):
        oomless.plan(model, inputs, "1TiB", profile=oomless.profile(model, inputs, loss_fn=loss_fn, precision="bf16"))

    # A CPU build without fp16 kernels: the probe's failure becomes one clear error.
    def no_half_kernels(device, dtype):
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
    monkeypatch.setattr(precision_module, "_run_probe", no_half_kernels)
    steps = []
    model.register_forward_pre_hook(lambda *args: steps.append(1))
    with pytest.raises(InputError, match=r"no fp16 kernels on cpu .*use precision='bf16' or 'fp32'"):
        oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, precision="fp16", optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(InputError, match="precision='fp16'"):
        oomless.apply(model, plan.__class__(**{**plan.__dict__, "precision": "fp16"}),
                      optimizer=torch.optim.Adam(model.parameters()))
    assert not steps, "no step may run before the error"
    assert not hasattr(model, "_oomless") and precision_state(model) is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_bf16_on_a_gpu_without_bf16_names_the_alternatives(monkeypatch):
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(InputError, match=r"Tesla T4 has no bf16 support .*precision='fp16' .* or 'fp32'"):
        precision_module.check_precision("bf16", torch.device("cuda"))


def test_train_with_a_budget_equals_autocast_alone():
    """``oomless train --precision bf16`` with a memory budget (plan + precision) trains exactly as
    with precision alone (no plan), and fp16 logs its skipped steps."""
    from oomless.train import TrainConfig, train

    config = dict(size=16, base_channels=4, depth=2, steps=2, global_batch=2, device="cpu", progress=False)
    planned = train(TrainConfig(memory="64MiB", precision="bf16", **config))
    alone = train(TrainConfig(precision="bf16", **config))
    assert planned.oomless_applied and not alone.oomless_applied
    for (name, expected), (_, actual) in zip(alone.model.state_dict().items(), planned.model.state_dict().items()):
        assert torch.equal(expected, actual), name
    fp16 = train(TrainConfig(memory="64MiB", precision="fp16", **config))
    assert all("skipped_steps" in record for record in fp16.history)
    assert fp16.stats.loss_scale is not None and fp16.skipped_steps == fp16.stats.skipped_steps


def test_train_takes_precision_and_compile_with_pipeline_layouts():
    """``--precision bf16|fp16`` and ``--compile`` under pipeline and hybrid, and switches to them,
    validate (they were refused before each stage ran under autocast); what they train is checked in
    tests/test_pipeline_precision.py. A pipeline built by hand at fp16 without the model's loss
    scaler is refused there."""
    from oomless.parallel.config import ParallelConfig
    from oomless.train import TrainConfig

    for precision in ("bf16", "fp16"):
        TrainConfig(precision=precision, parallel=ParallelConfig(mode="pipeline")).validate()
        TrainConfig(precision=precision, compile={"backend": "aot_eager"}, memory="1GiB",
                    parallel=ParallelConfig(mode="dp", switch=[(2, "hybrid:2")])).validate()


def test_segmentation_loss_runs_in_fp32_on_fp32_outputs():
    """The fp32 cast of outputs: cross-entropy on them is what autocast would run (it lists
    cross-entropy among its fp32 ops), bit for bit."""
    torch.manual_seed(0)
    logits = torch.randn(2, 2, 4, 4, 4, dtype=torch.bfloat16)
    labels = torch.randint(0, 2, (2, 4, 4, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = F.cross_entropy(logits, labels)
    assert torch.equal(inside, F.cross_entropy(logits.float(), labels))


def test_bench_adds_the_precision_variants_against_their_own_reference(tmp_path):
    """``oomless bench --precision bf16``: plain_bf16, keep_bf16 and plan_50_bf16 run beside the fp32
    variants, plan_50_bf16 at plan_50's memory, each timed against plain_bf16 (never asserted)."""
    import json

    from oomless.cli.main import main

    out = tmp_path / "fit.json"
    assert main(["bench", "--quick", "--device", "cpu", "--threads", "1", "--precision", "bf16",
                 "--model", "transformer", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["precision"] == "bf16" and report["compile"] is False
    variants = report["models"]["transformer"]["variants"]
    for name in ("plain_bf16", "keep_bf16", "plan_50_bf16"):
        assert variants[name]["reference"] == "plain_bf16" and variants[name]["ratio_vs_reference"] > 0
        assert len(variants[name]["step_seconds"]) == report["steps"]
    # At fp32 plan_50's memory, or (the quick model's bytes are a few pages, within the measuring noise
    # of a loaded machine) refused there and planned at the minimum PlanError named, as its notes say.
    bf16, fp32 = variants["plan_50_bf16"], variants["plan_50"]
    assert bf16["memory_bytes"] == fp32["memory_bytes"] or (
        bf16["memory_bytes"] > fp32["memory_bytes"]
        and any(f"{fp32['memory_bytes']} bytes did not plan" in note for note in bf16["notes"])), bf16
    assert variants["plain"]["reference"] == "plain" and variants["plain"]["ratio_vs_reference"] == 1.0
    assert "plan_50_bf16_activation_peak_vs_fp32" in report["models"]["transformer"]["targets"]


def test_plan_cli_plans_a_target_in_bf16_and_the_plan_says_so(capsys):
    """``oomless plan --target h100 --precision bf16`` on meta tensors: the JSON plan carries its
    precision through a save and load, and plain bf16 holds fewer bytes than plain fp32."""
    import json

    from oomless.cli.main import main

    arguments = ["plan", "transformer", "--input-shape", "2,256", "--memory", "1GiB", "--target", "h100", "--json",
                 "--model-arg", "dim=128", "--model-arg", "depth=2", "--model-arg", "heads=4",
                 "--model-arg", "max_len=256"]
    plans = {}
    for precision in ("fp32", "bf16"):
        assert main([*arguments, "--precision", precision]) == 0
        plans[precision] = oomless.Plan.from_json(capsys.readouterr().out)
    assert plans["bf16"].precision == "bf16" and plans["fp32"].precision == "fp32"
    assert json.loads(plans["bf16"].to_json())["precision"] == "bf16"
    assert plans["bf16"].plain_peak_bytes < plans["fp32"].plain_peak_bytes
