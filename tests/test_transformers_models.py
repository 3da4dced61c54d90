"""A Hugging Face model (built from its config, no download) trains under oomless exactly as plain
PyTorch does, and plans for a target device by name (`hf:gpt2`)."""

import copy

import pytest
import torch

import oomless
from oomless.models import build_model, example_input_for
from oomless.profile.tensors import call_model

pytest.importorskip("transformers")


def _assert_two_steps_bitwise_equal(reference, model, inputs, loss_fn):
    """Two AdamW steps of each from the same state (dropout seeded per step, a dict of inputs passed
    as keywords), then every parameter and gradient of ``model`` equal to ``reference``'s."""
    for trained in (reference, model):
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(10 + step)
            loss_fn(call_model(trained, inputs)).backward()
            optimizer.step()
    for (name, expected), (_, actual) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(expected, actual), name
        assert torch.equal(expected.grad, actual.grad), name


@pytest.mark.parametrize("policy", ["swap", "recompute"])
def test_hf_gpt2_trains_bitwise_like_plain_pytorch(policy):
    torch.manual_seed(0)
    model = build_model("hf:gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    tokens = example_input_for("hf:gpt2", batch=2, size=32)

    def loss_fn(output):
        return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), tokens.roll(-1, 1).flatten())

    reference = copy.deepcopy(model)
    plan = oomless.plan(model, tokens, "1GiB", loss_fn=loss_fn, min_swap_bytes=0)
    assert any(name.startswith("transformer.h.") for name in plan.decisions)
    oomless.apply(model, plan.with_decisions({name: policy for name in plan.decisions}))
    _assert_two_steps_bitwise_equal(reference, model, tokens, loss_fn)
    stats = oomless.stats(model)
    assert stats.offloaded_bytes > 0 or stats.recomputed_blocks > 0


def test_hf_model_plans_for_a_target_on_meta():
    with torch.device("meta"):
        model = build_model("hf:gpt2", n_layer=4, n_embd=256, n_head=4)
    tokens = example_input_for("hf:gpt2", batch=2, size=128).to("meta")
    plan = oomless.plan(model, tokens, "2GiB", target="h100", loss_fn=oomless.sum_of_outputs)
    assert plan.predicted_peak_bytes <= 2 * 2**30
    assert plan.predicted_step_seconds > 0


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="sdpa"))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                               pad_token_id=0))


@pytest.mark.parametrize("policy", ["swap", "recompute"])
@pytest.mark.parametrize("build, layers", [(_llama, "model.layers."), (_mixtral, "model.layers."),
                                           (_qwen2, "model.layers."), (_t5, "decoder.block.")],
                         ids=["llama", "mixtral", "qwen2-sdpa", "t5"])
def test_hf_models_as_users_build_them_train_bitwise_like_plain_pytorch(build, layers, policy):
    """Grouped-query attention, rotary embeddings, tied input and output embeddings (Llama); routed
    experts, each token through 2 of 4 (Mixtral); PyTorch's scaled-dot-product attention (Qwen2);
    an encoder and a decoder, the decoder's blocks attending to the encoder's output, the relative
    position bias the first block computes passed on to the others as a tensor between blocks, one
    embedding registered under three names (T5): bit-equal to plain PyTorch with every block swapped
    or recomputed."""
    torch.manual_seed(0)
    model = build()
    tokens = torch.randint(1, 256, (2, 32))
    inputs = {"input_ids": tokens, "labels": tokens.roll(-1, 1)}
    reference = copy.deepcopy(model)
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=lambda output: output.loss, min_swap_bytes=0)
    assert any(name.startswith(layers) for name in plan.decisions), list(plan.decisions)
    oomless.apply(model, plan.with_decisions({name: policy for name in plan.decisions}))
    _assert_two_steps_bitwise_equal(reference, model, inputs, lambda output: output.loss)
    stats = oomless.stats(model)
    assert stats.offloaded_bytes > 0 if policy == "swap" else stats.recomputed_blocks > 0
