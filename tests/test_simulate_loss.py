"""`oomless simulate --loss`: the loss `oomless plan` plans (a language model's next-token
cross-entropy by default) predicted in every layout, on a pipeline's last stage only; a head fused
with its loss still counted as the model's parameter; the same errors as `oomless plan`. Bytes are
counted on meta tensors, nothing is timed."""

import json

import pytest
import torch
import torch.nn as nn

import oomless
from oomless.cli.main import main
from oomless.cli.planned_loss import planned_step
from oomless.models import build_model, example_input_for
from oomless.plan.planner import ESTIMATED_MARGIN
from oomless.profile.fake import profile_for_target
from oomless.profile.loss_parameters import with_loss_parameters

VOCAB, LENGTH, BATCH, GPUS, GLOBAL_BATCH = 4096, 64, 4, 4, 16
MODEL_ARGS = {"vocab_size": VOCAB, "dim": 64, "depth": 4, "heads": 4, "max_len": LENGTH}


def _simulate_transformer(loss: str):
    with torch.device("meta"):
        model = build_model("transformer", **MODEL_ARGS)
    tokens = example_input_for("transformer", shape=(BATCH, LENGTH), **MODEL_ARGS).to("meta")
    optimizer = torch.optim.Adam(model.parameters())
    planned, loss_fn = planned_step(loss, "transformer", model, tokens)

    def example_at(samples):
        """As the command line does: each layout's batch traced with the loss's own targets."""
        inputs = example_input_for("transformer", shape=(samples, LENGTH), **MODEL_ARGS).to("meta")
        return inputs, planned_step(loss, "transformer", model, inputs)[1]

    return oomless.simulate(planned, tokens, global_batch=GLOBAL_BATCH, target="h100", gpus=GPUS, loss_fn=loss_fn,
                            optimizer=optimizer, example_at=example_at)


@pytest.fixture(scope="module")
def simulations():
    return {loss: _simulate_transformer(loss) for loss in ("sum", "next-token")}


def test_next_token_adds_the_log_probabilities_and_the_logits_gradient_to_every_data_parallel_rank(simulations):
    """dp and fsdp ranks each step GLOBAL_BATCH / GPUS = BATCH samples, the profiled batch. The
    cross-entropy keeps its log-probabilities (B x (T - 1) x V fp32) for backward, and its backward
    makes the logits' gradient whole (B x T x V; a sum's gradient is one expanded scalar): at the
    head's backward, the peak, both are counted, and the planner's margin on estimated profiles
    (ESTIMATED_MARGIN of the worst phase's bytes) grows with them. Within 3 %: the sum's worst phase
    is another phase of the head (its forward), 128 KiB apart."""
    log_probabilities = BATCH * (LENGTH - 1) * VOCAB * 4
    logits = BATCH * LENGTH * VOCAB * 4
    plain, cross_entropy = simulations["sum"], simulations["next-token"]
    added = {}
    for name in (f"dp x{GPUS}", f"fsdp x{GPUS}"):
        with_loss, without = cross_entropy.layout(name), plain.layout(name)
        assert with_loss.fits and without.fits, name
        assert with_loss.static_bytes == without.static_bytes, name      # the loss holds no parameter
        added[name] = with_loss.memory_per_rank_bytes - without.memory_per_rank_bytes
        assert added[name] > log_probabilities, name
        assert added[name] == pytest.approx((1 + ESTIMATED_MARGIN) * (log_probabilities + logits), rel=0.03), name
    # The loss is not sharded: fsdp's ranks hold it as dp's do.
    assert added[f"fsdp x{GPUS}"] == added[f"dp x{GPUS}"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_pipelines_last_stage_holds_the_loss_and_runs_it_the_others_do_not(simulations, schedule):
    """pp4 steps GLOBAL_BATCH samples in M micro-batches, each traced at its own batch. The loss
    runs on the last stage: its log-probabilities (samples x (T - 1) x V fp32 a micro-batch) are held
    there, by 1F1B for one micro-batch at a time, by GPipe for all of them (every forward before any
    backward), and its time is the last stage's; the first three stages hold and take what they did
    with the sum."""
    name = f"pipeline pp{GPUS} {schedule}"
    plain, cross_entropy = simulations["sum"].layout(name).partition, simulations["next-token"].layout(name).partition
    assert cross_entropy.microbatches == plain.microbatches
    microbatches = plain.microbatches
    per_microbatch = GLOBAL_BATCH // microbatches * (LENGTH - 1) * VOCAB * 4
    held_microbatches = 1 if schedule == "1f1b" else microbatches
    # The same cut (deterministic: meta tensors, the roofline), so that stage by stage compares.
    assert cross_entropy.stage_blocks == plain.stage_blocks and cross_entropy.stage_blocks[-1][-1] == "head"
    # Within 4 KiB: the working memory is traced on meta tensors (profile.fake_memory), and in the one
    # process profiled the loss's few small tensors (its targets' copy, the loss) are alive during
    # every block's backward; a pipeline's first stages do not hold them (513 bytes here).
    assert cross_entropy.rank_bytes[:-1] == pytest.approx(plain.rank_bytes[:-1], abs=4096)
    added = cross_entropy.rank_bytes[-1] - plain.rank_bytes[-1]
    # The targets' copy (8 bytes a token) too: within 1 %.
    assert added == pytest.approx(held_microbatches * per_microbatch, rel=0.01)
    assert cross_entropy.stage_seconds[:-1] == plain.stage_seconds[:-1]
    assert cross_entropy.stage_seconds[-1] > plain.stage_seconds[-1]


class _Body(nn.Module):
    """A language model without its head: token embedding, one layer."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 64)
        self.layer = nn.Linear(64, 64)

    def forward(self, tokens):
        return self.layer(self.embedding(tokens))


def _fused(tied: bool):
    """(body, loss fn reading the head's weight, the same model with its head inside, its next-token
    loss, tokens), on the meta device."""
    with torch.device("meta"):
        body, head = _Body(), nn.Linear(64, VOCAB, bias=False)
    if tied:
        head.weight = body.embedding.weight
    tokens = torch.zeros(BATCH, LENGTH, dtype=torch.long, device="meta")
    whole = nn.Sequential(body, head)

    def fused(states):
        return oomless.linear_cross_entropy(states[:, :-1], head.weight, tokens[:, 1:])

    def next_token(logits):
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    return body, fused, whole, next_token, tokens


@pytest.mark.parametrize("tied", [False, True])
def test_a_head_fused_with_the_loss_is_counted_as_a_parameter_held_by_the_last_block(tied):
    body, fused, whole, _, tokens = _fused(tied)
    optimizer = torch.optim.Adam(whole.parameters())
    profile = profile_for_target(body, tokens, "h100", loss_fn=fused, optimizer=optimizer)
    counted = with_loss_parameters(profile, body, fused)
    head_bytes = VOCAB * 64 * 4
    untied = 0 if tied else head_bytes          # a tied head is the embedding: counted once already
    assert counted.parameter_bytes == profile.parameter_bytes + untied
    assert counted.gradient_bytes == profile.gradient_bytes + untied
    assert counted.optimizer_state_bytes == profile.optimizer_state_bytes + 2 * untied      # Adam: two moments
    assert [block.name for block in counted.blocks] == [block.name for block in profile.blocks]
    assert counted.blocks[-1].name == "layer"
    assert counted.blocks[-1].parameter_bytes == profile.blocks[-1].parameter_bytes + head_bytes
    assert counted.blocks[:-1] == profile.blocks[:-1]
    assert any("parameters the loss reads itself" in note for note in counted.notes)
    # bf16 weights: the head's bytes as the profile cast them.
    halved = with_loss_parameters(profile, body, fused, dtype=torch.bfloat16)
    assert halved.blocks[-1].parameter_bytes == profile.blocks[-1].parameter_bytes + head_bytes // 2
    # A loss that reads no parameter (the next-token loss over logits) leaves the profile as it was.
    assert with_loss_parameters(profile, body, oomless.sum_of_outputs) is profile


def test_dp_and_fsdp_count_a_fused_untied_head_as_the_model_with_its_head_inside_does():
    """The static bytes per rank (parameters, gradients, Adam's state, inputs) of the model without
    its head and the fused loss equal those of the model with its head and the next-token loss:
    without the head's weight counted they were 4 x its bytes less under dp."""
    body, fused, whole, next_token, tokens = _fused(tied=False)
    optimizer = torch.optim.Adam(whole.parameters())
    split = oomless.simulate(body, tokens, global_batch=8, target="h100", gpus=2, loss_fn=fused, optimizer=optimizer)
    inside = oomless.simulate(whole, tokens, global_batch=8, target="h100", gpus=2, loss_fn=next_token,
                              optimizer=optimizer)
    assert split.layout("dp x2").static_bytes == inside.layout("dp x2").static_bytes
    # fsdp: the same shards, and two of the largest block unsharded (parameters and gradients): the
    # embedding's size with the head inside, the head's and the layer's where the last block holds it.
    layer_bytes = (64 * 64 + 64) * 4
    assert split.layout("fsdp x2").static_bytes == inside.layout("fsdp x2").static_bytes + 2 * 2 * layer_bytes
    # The fused loss never makes the logits whole: less memory per rank than the head and cross-entropy.
    assert split.layout("dp x2").memory_per_rank_bytes < inside.layout("dp x2").memory_per_rank_bytes


SMALL = ["--input-shape", f"{BATCH},{LENGTH}", "--global-batch", str(GLOBAL_BATCH), "--gpus", str(GPUS), "--json",
         *(item for key, value in MODEL_ARGS.items() for item in ("--model-arg", f"{key}={value}"))]


def test_the_command_plans_a_language_models_next_token_loss_by_default_and_says_so(capsys):
    results = {}
    for loss in ("auto", "next-token", "sum"):
        assert main(["simulate", "transformer", *SMALL, "--loss", loss]) == 0
        results[loss] = json.loads(capsys.readouterr().out)
    assert [results[loss]["loss"] for loss in ("auto", "next-token", "sum")] == ["next-token", "next-token", "sum"]

    def peaks(result):
        return {layout["name"]: layout["memory_per_rank_bytes"] for layout in result["layouts"]}
    assert peaks(results["auto"]) == peaks(results["next-token"])      # meta tensors: the same numbers
    log_probabilities = BATCH * (LENGTH - 1) * VOCAB * 4
    assert peaks(results["next-token"])[f"dp x{GPUS}"] - peaks(results["sum"])[f"dp x{GPUS}"] > log_probabilities
    assert main(["simulate", "mlp", "--input-shape", "4,16", "--global-batch", "16", "--gpus", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == "sum"


@pytest.mark.parametrize("model, loss, alternative", [
    ("mlp", "next-token", "use --loss sum"),
    ("unet3d", "next-token", "use --loss sum"),
    ("transformer", "fused-next-token", "use --loss next-token"),
])
def test_a_loss_the_model_cannot_take_is_one_line_naming_what_works(capsys, model, loss, alternative):
    shape = "4,16" if model == "mlp" else "1,1,32,32,32" if model == "unet3d" else "4,64"
    assert main(["simulate", model, "--input-shape", shape, "--global-batch", "16", "--gpus", "4",
                 "--loss", loss]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--loss {loss}" in lines[0] and alternative in lines[0], lines


def test_a_hugging_face_models_head_fused_with_the_loss_is_simulated_with_its_weight(capsys):
    """hf:llama with an untied head: ``--loss fused-next-token`` profiles the model without it and
    counts its weight all the same: dp's static bytes per rank equal the next-token loss's."""
    pytest.importorskip("transformers")
    arguments = ["simulate", "hf:llama", "--input-shape", "2,64", "--global-batch", "8", "--gpus", "2", "--json",
                 *(item for pair in ("num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4",
                                     "intermediate_size=128", "vocab_size=2000", "tie_word_embeddings=False")
                   for item in ("--model-arg", pair))]
    results = {}
    for loss in ("next-token", "fused-next-token"):
        assert main([*arguments, "--loss", loss]) == 0
        results[loss] = json.loads(capsys.readouterr().out)
    static = {loss: {layout["name"]: layout["static_bytes"] for layout in result["layouts"]}
              for loss, result in results.items()}
    assert static["fused-next-token"]["dp x2"] == static["next-token"]["dp x2"]
    assert results["fused-next-token"]["loss"] == "fused-next-token"
    assert any("(2000, 64)" in note for note in results["fused-next-token"]["notes"])


@pytest.mark.parametrize("tied", [True, False])
def test_fp16_with_a_head_the_loss_reads_is_refused_as_plan_refuses_it(tied):
    """Under fp16 the loss scale is applied at the model's outputs: a head weight the loss reads
    itself (tied, the body's; untied, outside it) would get its gradient unscaled. `plan` refused the
    tied one only, `simulate` neither; both now refuse both, naming bf16."""
    body, fused, _, _, tokens = _fused(tied)
    with pytest.raises(oomless.InputError, match="precision='fp16'.*use precision='bf16'"):
        oomless.simulate(body, tokens, global_batch=GLOBAL_BATCH, target="h100", gpus=GPUS, loss_fn=fused,
                         precision="fp16")
    with pytest.raises(oomless.InputError, match="precision='fp16'.*use precision='bf16'"):
        oomless.plan(body, tokens, "64GiB", loss_fn=fused, target="h100", precision="fp16")
