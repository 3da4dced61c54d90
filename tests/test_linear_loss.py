"""oomless.linear_cross_entropy: a language model's head and loss in chunks of rows, the logits never
whole (src/oomless/runtime/linear_loss.py).

Against ``F.cross_entropy(F.linear(hidden, weight, bias), target)``: not bit-equal, the weight's
gradient sums its rows chunk by chunk and the logits' gradient is formed as softmax minus the target
instead of through log_softmax's backward: within 2e-6 relative in fp32 (measured 2e-7 to 6e-7).
Under bf16 autocast against plain autocast, each is compared with fp32: the fused loss may not be
further from it. Planned by oomless (Hugging Face GPT-2, the head tied to the embedding), it trains
bit for bit as the same loss does in plain PyTorch, under every plan.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import oomless
from oomless.errors import InputError
from oomless.plan.planner import smallest_memory
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system

FP32_TOLERANCE = 2e-6


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def _tensors(bias: bool, shape=(3, 40), width=24, classes=300, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, width, generator=generator, requires_grad=True)
    weight = (torch.randn(classes, width, generator=generator) * 0.2).requires_grad_()
    bias_ = (torch.randn(classes, generator=generator) * 0.1).requires_grad_() if bias else None
    target = torch.randint(0, classes, shape, generator=generator)
    return hidden, weight, bias_, target


def _gradients(loss: torch.Tensor, tensors) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [t for t in tensors if t is not None]))


CASES = [dict(reduction="mean"), dict(reduction="sum"), dict(reduction="mean", label_smoothing=0.1),
         dict(reduction="sum", label_smoothing=0.25), dict(reduction="mean", ignored=True),
         dict(reduction="mean", label_smoothing=0.1, ignored=True, ignore_index=7)]


@pytest.mark.parametrize("chunk_rows", [None, 7, 64, 10_000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(f"{k}={v}" for k, v in case.items()))
def test_equals_the_cross_entropy_of_the_logits(case, bias, chunk_rows):
    case = dict(case)
    ignored = case.pop("ignored", False)
    hidden, weight, bias_, target = _tensors(bias)
    if ignored:
        target[0, :15] = case.get("ignore_index", -100)   # padding: rows without a loss
        target[2, -3:] = case.get("ignore_index", -100)
    # Next-token prediction reads a slice of the states: not contiguous.
    states, labels = hidden[:, :-1], target[:, 1:]
    expected = F.cross_entropy(F.linear(states, weight, bias_).flatten(0, 1), labels.flatten(), **case)
    fused = oomless.linear_cross_entropy(states, weight, labels.to(torch.int32), bias_, chunk_rows=chunk_rows, **case)
    assert fused.dtype == expected.dtype and fused.shape == ()
    assert abs(fused.item() - expected.item()) <= FP32_TOLERANCE * abs(expected.item())
    for actual, wanted in zip(_gradients(fused, (hidden, weight, bias_)), _gradients(expected, (hidden, weight, bias_))):
        assert _relative(actual, wanted) < FP32_TOLERANCE


def test_under_bf16_autocast_it_is_no_further_from_fp32_than_plain_autocast():
    hidden, weight, bias_, target = _tensors(True, shape=(4, 64), width=64, classes=2000)
    tensors = (hidden, weight, bias_)
    reference = F.cross_entropy(F.linear(hidden, weight, bias_).flatten(0, 1), target.flatten())
    reference_gradients = _gradients(reference, tensors)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(F.linear(hidden, weight, bias_).flatten(0, 1), target.flatten())
        fused = oomless.linear_cross_entropy(hidden, weight, target, bias_, chunk_rows=50)
    assert fused.dtype == plain.dtype == torch.float32       # autocast runs cross_entropy in fp32
    plain_gradients, fused_gradients = _gradients(plain, tensors), _gradients(fused, tensors)
    assert [g.dtype for g in fused_gradients] == [g.dtype for g in plain_gradients] == [torch.float32] * 3
    assert abs(fused.item() - reference.item()) <= 2 * abs(plain.item() - reference.item()) + 1e-6
    for name, ours, theirs, exact in zip(("hidden", "weight", "bias"), fused_gradients, plain_gradients,
                                         reference_gradients):
        assert _relative(ours, exact) <= 1.1 * _relative(theirs, exact) + 1e-6, name
        assert _relative(ours, exact) > 1e-5, f"{name}: the products did not run in bf16"


def test_the_loss_gradient_scales_what_forward_made():
    """Backward multiplies the gradients made in forward by the loss's own gradient (a GradScaler's
    scale, a weighting of the loss): exactly what scaling them by hand gives."""
    hidden, weight, _, target = _tensors(False)
    once = _gradients(oomless.linear_cross_entropy(hidden, weight, target), (hidden, weight))
    scaled = _gradients(oomless.linear_cross_entropy(hidden, weight, target) * 1024.0, (hidden, weight))
    for plain, times in zip(once, scaled):
        assert torch.equal(plain * 1024.0, times)


def test_fp16_gradients_under_a_loss_scale_keep_their_digits():
    """fp16 loss scaling (GradScaler, oomless's precision="fp16" at the model's boundary) multiplies
    the loss's gradient so that small gradients survive fp16. The fused loss makes its fp16 products
    in forward, before that scale is known: were a mean's 1 / rows folded into them, p / rows
    (p ~ 1 / classes) would fall below fp16's smallest subnormal and the scale could not lift it back
    (measured 7.8e-2 relative error against 3.2e-4 for plain autocast at 4096 rows, 8000 classes)."""
    generator = torch.Generator().manual_seed(0)
    rows, width, classes, scale = 4096, 64, 8000, 65536.0
    hidden = torch.randn(rows, width, generator=generator)
    weight = torch.randn(classes, width, generator=generator) * 0.02
    target = torch.randint(0, classes, (rows,), generator=generator)
    exact = [t.double().requires_grad_() for t in (hidden, weight)]
    exact_gradients = _gradients(F.cross_entropy(F.linear(*exact), target), exact)
    tensors = [t.clone().requires_grad_() for t in (hidden, weight)]
    errors = {}
    for name, loss_of in (("plain", lambda: F.cross_entropy(F.linear(*tensors), target)),
                          ("fused", lambda: oomless.linear_cross_entropy(*tensors, target))):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of()
        errors[name] = [_relative(g / scale, e) for g, e in zip(_gradients(loss * scale, tensors), exact_gradients)]
    for name, fused, plain in zip(("hidden", "weight"), errors["fused"], errors["plain"]):
        assert fused <= 1.5 * plain, (name, errors)


def test_only_what_needs_a_gradient_gets_one_and_no_grad_makes_none():
    hidden, weight, _, target = _tensors(False)
    frozen_states = hidden.detach()
    loss = oomless.linear_cross_entropy(frozen_states, weight, target)
    (gradient,) = torch.autograd.grad(loss, [weight])
    expected = F.cross_entropy(F.linear(frozen_states, weight).flatten(0, 1), target.flatten())
    assert _relative(gradient, torch.autograd.grad(expected, [weight])[0]) < FP32_TOLERANCE
    with torch.no_grad():
        evaluated = oomless.linear_cross_entropy(hidden, weight, target)
    assert evaluated.grad_fn is None and abs(evaluated.item() - expected.item()) < 1e-5


def test_every_target_ignored_gives_pytorchs_nan_loss_and_zero_gradients():
    hidden, weight, _, target = _tensors(False)
    ignored = torch.full_like(target, -100)
    expected = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), ignored.flatten())
    fused = oomless.linear_cross_entropy(hidden, weight, ignored)
    assert torch.isnan(expected) and torch.isnan(fused)
    for actual, wanted in zip(_gradients(fused, (hidden, weight)), _gradients(expected, (hidden, weight))):
        assert torch.equal(actual, wanted) and not actual.any()


def test_a_second_backward_is_refused_with_what_to_do():
    hidden, weight, _, target = _tensors(False)
    loss = oomless.linear_cross_entropy(hidden, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="used once"):
        loss.backward()


def test_bad_input_is_refused_with_what_would_work():
    hidden, weight, bias_, target = _tensors(True)
    with pytest.raises(InputError, match="reduction 'mean' or 'sum'"):
        oomless.linear_cross_entropy(hidden, weight, target, reduction="none")
    with pytest.raises(InputError, match="class indices"):
        oomless.linear_cross_entropy(hidden, weight, target.float())
    with pytest.raises(InputError, match="one class index per row"):
        oomless.linear_cross_entropy(hidden, weight, target[:, 1:])
    with pytest.raises(InputError, match="get_output_embeddings"):
        oomless.linear_cross_entropy(hidden, weight.t(), target)
    with pytest.raises(InputError, match="bias of shape"):
        oomless.linear_cross_entropy(hidden, weight, target, bias_[:-1])
    with pytest.raises(InputError, match="chunk_rows"):
        oomless.linear_cross_entropy(hidden, weight, target, chunk_rows=0)
    outside = target.clone()
    outside[1, 3] = weight.shape[0]
    with pytest.raises(InputError, match=f"class index {weight.shape[0]}, outside"):
        oomless.linear_cross_entropy(hidden, weight, outside)
    assert hidden.grad is None and weight.grad is None


def _loss_peak_bytes(fused: bool, rows: int, width: int, classes: int) -> int:
    """Resident-memory rise of one loss forward and backward over existing hidden states."""
    torch.manual_seed(0)
    hidden = torch.randn(rows, width, requires_grad=True)
    weight = (torch.randn(classes, width) * 0.05).requires_grad_()
    target = torch.randint(0, classes, (rows,))

    def step(count: int) -> None:
        states, labels = hidden[:count], target[:count]
        loss = oomless.linear_cross_entropy(states, weight, labels) if fused \
            else F.cross_entropy(F.linear(states, weight), labels)
        loss.backward()

    step(8)                                   # kernels' first-use allocations
    hidden.grad = weight.grad = None
    return_freed_memory_to_the_system()
    reset_peak_rss()
    before = current_rss_bytes()
    step(rows)
    return peak_rss_bytes() - before


def test_the_logits_are_never_whole():
    """Plain: the logits, their log-probabilities and in backward two gradients of their size (4 x
    128 MiB here, 2048 rows x 16,384 classes); fused: one chunk of 512 rows at a time (32 MiB of fp32
    logits by default) and the two gradients it makes, the states' and the weight's (2 MiB here)."""
    rows, width, classes = 2048, 32, 16384
    logits_bytes = rows * classes * 4
    plain, fused = _loss_peak_bytes(False, rows, width, classes), _loss_peak_bytes(True, rows, width, classes)
    assert plain > 2.5 * logits_bytes, plain
    assert fused < 0.5 * logits_bytes, (fused, plain)


# Hugging Face causal LMs planned without their head (`base_model`): the loss reads the states and
# the head's weight, GPT-2's tied to its embedding (a parameter of the body), Llama's its own.


def _causal_lm(name: str):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=3000, n_positions=64,
                                           use_cache=False))
        assert model.get_output_embeddings().weight is model.transformer.wte.weight
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=3000,
                                             max_position_embeddings=64, use_cache=False))
        assert not any(p is model.lm_head.weight for p in model.base_model.parameters())   # untied
    return model, torch.randint(0, 3000, (2, 48))


def _loss_of(model, tokens):
    head = model.get_output_embeddings()
    return lambda out: oomless.linear_cross_entropy(out.last_hidden_state[:, :-1], head.weight, tokens[:, 1:])


def _train(model, tokens, steps: int = 2) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)       # the same dropout masks on both sides
        loss = _loss_of(model, tokens)(model.base_model(tokens))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["keep", "swap", "recompute", "floor"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_causal_lm_without_its_head_trains_under_a_plan_as_in_plain_pytorch(name, kind):
    model, tokens = _causal_lm(name)
    reference = copy.deepcopy(model)
    reference_losses = _train(reference, tokens)
    body, loss_fn = model.base_model, _loss_of(model, tokens)
    profile = oomless.profile(body, tokens, loss_fn=loss_fn)
    if kind == "floor":
        plan = oomless.plan(body, tokens, smallest_memory(profile, min_swap_bytes=0), loss_fn=loss_fn,
                            profile=profile, min_swap_bytes=0)
    else:
        roomy = oomless.plan(body, tokens, "1TiB", loss_fn=loss_fn, profile=profile, min_swap_bytes=0)
        plan = roomy.with_decisions(dict.fromkeys(roomy.decisions, kind))
    oomless.apply(body, plan)
    assert _train(model, tokens) == reference_losses
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected, actual), name
        assert torch.equal(expected.grad, actual.grad), name


def test_gpt2_without_its_head_trains_as_with_its_logits():
    """The fused loss against the model's own logits and F.cross_entropy: the first step's gradients
    within 1e-5, the losses of two AdamW steps within 1e-6. Not the weights after Adam: it divides
    each gradient by its own size, and the keys' bias has a gradient of zero in exact arithmetic
    (softmax ignores a shift shared by every key), so rounding noise moves it by lr-sized steps on
    either side (3.7e-4 relative after two steps)."""
    model, tokens = _causal_lm("gpt2")
    whole = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-3)
    losses, first_gradients = [], None
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        logits = whole(tokens).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        first_gradients = first_gradients or [p.grad.clone() for p in whole.parameters()]
        optimizer.step()
        losses.append(loss.item())
    fused = copy.deepcopy(model)
    torch.manual_seed(100)
    _loss_of(fused, tokens)(fused.base_model(tokens)).backward()
    for (name, _), expected, actual in zip(whole.named_parameters(), first_gradients, fused.parameters()):
        assert _relative(actual.grad, expected) < 1e-5, name
    assert _train(model, tokens) == pytest.approx(losses, rel=1e-6)


class _Body(torch.nn.Module):
    """An embedding and two transformer layers: a language model without its head."""

    def __init__(self, classes: int = 8000, width: int = 64):
        super().__init__()
        self.embedding = torch.nn.Embedding(classes, width)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True)
                                          for _ in range(2))

    def forward(self, tokens):
        states = self.embedding(tokens)
        for layer in self.layers:
            states = layer(states)
        return states


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_profiled_for_a_target_on_meta_tensors_without_the_logits(precision):
    """Planning for a GPU on meta tensors runs the fused loss too: the logits' cross-entropy saves
    its log-probabilities (fp32 under bf16 autocast as well) outside every block, the fused loss
    nothing logits-sized, and the plain step's predicted peak drops by more than the logits' bytes."""
    with torch.device("meta"):
        body = _Body()
    tokens = torch.zeros(4, 256, dtype=torch.long, device="meta")
    fused = lambda out: oomless.linear_cross_entropy(out[:, :-1], body.embedding.weight, tokens[:, 1:])  # noqa: E731
    whole = lambda out: F.cross_entropy(F.linear(out[:, :-1], body.embedding.weight).flatten(0, 1),    # noqa: E731
                                        tokens[:, 1:].flatten())
    logits_bytes = 4 * 255 * 8000 * 4
    saved, peaks = {}, {}
    for name, loss_fn in (("fused", fused), ("whole", whole)):
        saved[name] = oomless.profile(body, tokens, loss_fn=loss_fn, target="h100",
                                      precision=precision).unassigned_saved_bytes
        peaks[name] = oomless.plan(body, tokens, "64GiB", loss_fn=loss_fn, target="h100",
                                   precision=precision).plain_peak_bytes
    assert saved["whole"] >= logits_bytes and saved["fused"] < logits_bytes / 8, saved
    assert peaks["whole"] - peaks["fused"] > logits_bytes, peaks


def test_planning_for_a_target_leaves_an_untied_heads_gradient_as_found():
    """An untied head (Llama's lm_head) is not the planned body's: the loss reads its weight as it
    is, so the meta step made its gradient on it, left there after planning (a meta tensor on the
    user's model). The gradient is put back as found."""
    with torch.device("meta"):
        body, head = _Body(), torch.nn.Linear(64, 8000, bias=False)
    tokens = torch.zeros(2, 64, dtype=torch.long, device="meta")
    loss_fn = lambda out: oomless.linear_cross_entropy(out[:, :-1], head.weight, tokens[:, 1:])  # noqa: E731
    oomless.plan(body, tokens, "64GiB", loss_fn=loss_fn, target="h100")
    assert head.weight.grad is None


def test_a_head_weight_the_loss_reads_stays_on_the_device_and_refuses_fp16():
    """GPT-2's tied head weight is read by the loss, outside every block: offloaded with the blocks'
    parameters it would be gone when the loss reads it (the step failed), and under fp16 the loss
    scale, applied at the model's outputs, would not reach its share of the gradient. The planner
    keeps parameters on the device (forcing it off is refused, saying why); fp16 is refused."""
    model, tokens = _causal_lm("gpt2")
    body, loss_fn = model.base_model, _loss_of(model, tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(InputError, match="the loss function reads wte.weight itself"):
        oomless.plan(body, tokens, "1GiB", loss_fn=loss_fn, optimizer=optimizer, offload_parameters=True)
    with pytest.raises(InputError, match="precision='fp16'.*wte.weight"):
        oomless.plan(body, tokens, "1GiB", loss_fn=loss_fn, optimizer=optimizer, precision="fp16")
    reference = copy.deepcopy(model)
    reference_losses = _train(reference, tokens)
    plan = oomless.plan(body, tokens, "1GiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                        offload_optimizer_state=True)
    assert plan.update_in_backward and plan.offload_optimizer_state and not plan.offload_parameters
    oomless.apply(body, plan, optimizer=optimizer)
    losses = []
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        loss = loss_fn(body(tokens))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses == reference_losses
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected, actual), name


def test_compute_dtype_outside_autocast_runs_as_autocast_does():
    """Under oomless's precision="bf16" the loss runs outside autocast (the model's outputs in fp32):
    compute_dtype=torch.bfloat16 runs the head's products in bf16 there, bit for bit as autocast."""
    hidden, weight, bias_, target = _tensors(True, shape=(4, 64), width=64, classes=2000)
    tensors = (hidden, weight, bias_)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = oomless.linear_cross_entropy(hidden, weight, target, bias_, chunk_rows=50)
    outside = oomless.linear_cross_entropy(hidden, weight, target, bias_, chunk_rows=50, compute_dtype=torch.bfloat16)
    assert outside.dtype == torch.float32 and torch.equal(inside, outside)
    for first, second in zip(_gradients(inside, tensors), _gradients(outside, tensors)):
        assert torch.equal(first, second)
    with pytest.raises(InputError, match="compute_dtype"):
        oomless.linear_cross_entropy(hidden, weight, target, compute_dtype=torch.int8)


def test_the_plan_command_plans_a_language_models_next_token_loss_and_its_head_fused(capsys):
    """``oomless plan`` plans a language model's real loss by default (cross-entropy of each token's
    logits against the next token: it keeps the log-probabilities, two logits-sized tensors more than
    the sum of the logits planned before), and ``--loss fused-next-token`` the Hugging Face model
    without its head, the logits never whole."""
    from oomless.cli.main import main

    pytest.importorskip("transformers")
    common = ["plan", "hf:gpt2", "--input-shape", "4,128", "--memory", "8GiB", "--json", "--model-arg", "n_layer=2",
              "--model-arg", "n_embd=64", "--model-arg", "n_head=4", "--model-arg", "vocab_size=8000"]
    peaks = {}
    for loss in ("sum", "next-token", "fused-next-token"):
        assert main([*common, "--loss", loss]) == 0
        peaks[loss] = oomless.Plan.from_json(capsys.readouterr().out).plain_peak_bytes
    # The default is that loss: the same step, compared where it is traced on meta tensors (for a
    # target), which reads the same each time; two real profiles differ by the kernel caches the first
    # one left (4.9 MiB once in CI).
    traced = {}
    for loss in ("auto", "next-token"):
        assert main([*common, "--loss", loss, "--target", "h100"]) == 0
        traced[loss] = oomless.Plan.from_json(capsys.readouterr().out).plain_peak_bytes
    assert traced["auto"] == traced["next-token"], traced
    logits_bytes = 4 * 128 * 8000 * 4
    assert peaks["next-token"] - peaks["sum"] > logits_bytes, peaks
    assert peaks["next-token"] - peaks["fused-next-token"] > 1.5 * logits_bytes, peaks
    assert main(["plan", "unet3d", "--memory", "1GiB", "--loss", "next-token"]) == 2
    assert "--loss next-token is for language models" in capsys.readouterr().err
    assert main(["plan", "transformer", "--memory", "1GiB", "--loss", "fused-next-token"]) == 2
    assert "hf:" in capsys.readouterr().err
