"""Pipelines of unmodified models (issue 14): Hugging Face's GPT-2, MONAI's UNet and the project's
own models traced with torch.export into a `BlockSequence` (`oomless.parallel.traced`).

- The traced sequence computes the model's function bit for bit: forward, every parameter's
  gradient and BatchNorm's running statistics, at the traced batch size and others.
- A 2-stage pipeline of it on 2 gloo processes trains as one process does: 5 SGD-momentum steps,
  every parameter and buffer within 1e-6 (the tolerance and reasons of tests/test_pipeline.py),
  GPT-2's tied embedding and head on different ranks.
- The partitioner's automatic cut (from a profile of the traced sequence) is one the pipeline runs.
- What cannot be traced is an `InputError` that says why and what works instead.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oomless.errors import InputError
from oomless.models import SmallCNN, TinyTransformer
from oomless.parallel.block_sequence import BlockSequence, sequence_for
from oomless.parallel.traced import TRACED, candidate_blocks, traced_sequence
from tests.pipeline_workers import (STEPS, UNET_VOLUMES, batch, buffers_agree, reference, reference_chunks,
                                    run_pipeline_jobs, runnable_here)

TOLERANCE = 1e-6


def _gpt2(**config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=96,
                                                                n_positions=32, **config))


def _monai_unet(**options):
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    return nets.UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                     num_res_units=1, **options)


def _same_step(model: nn.Module, inputs, loss_of, output=None) -> BlockSequence:
    """Trace ``model``, then take one forward and backward through the sequence and, from the same
    RNG state, through a deepcopy of the model as it was: outputs, every gradient and every buffer
    after the step must be equal bit for bit. Returns the sequence."""
    import copy

    plain = copy.deepcopy(model)
    sequence = traced_sequence(model, inputs, output=output)
    assert len(sequence.blocks) >= 3 and sequence.origin == TRACED
    # The blocks hold the model's own tensors: nothing is copied.
    assert {id(tensor) for tensor in [*sequence.parameters(), *sequence.buffers()]} >= \
        {id(tensor) for tensor in [*model.parameters(), *model.buffers()]}
    assert {id(parameter) for parameter in sequence.parameters()} == {id(parameter) for parameter in model.parameters()}
    torch.manual_seed(7)
    expected = plain(*inputs)
    expected = expected if output is None else expected[output]
    loss_of(expected).backward()
    torch.manual_seed(7)
    produced = sequence(*inputs)
    loss_of(produced).backward()
    assert torch.equal(produced, expected)
    gradients = {name: parameter.grad for name, parameter in model.named_parameters()}
    for name, parameter in plain.named_parameters():
        assert parameter.grad is not None and torch.equal(gradients[name], parameter.grad), name
    buffers = dict(model.named_buffers())
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffers[name], buffer), name
    return sequence


def test_gpt2_traced_equals_the_model_with_dropout_and_tied_weights():
    model = _gpt2()          # dropout 0.1 everywhere: the same masks from the same RNG state
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    sequence = _same_step(model, (tokens,), lambda logits: F.cross_entropy(logits.flatten(0, 1), tokens.flatten()),
                          output="logits")
    names = [block.name for block in sequence.blocks]
    assert [name for name in names if name.startswith("transformer_h_")] == ["transformer_h_0", "transformer_h_1",
                                                                              "transformer_h_2"]
    # The tied embedding / head: one Parameter, in the first block and the last.
    tied = model.lm_head.weight
    assert tied is model.transformer.wte.weight
    holders = [block.name for block in sequence.blocks if any(p is tied for p in block.module.parameters())]
    assert holders == [names[0], names[-1]]
    # The batch dimension stays symbolic: other batch sizes (micro-batches) compute the model's function too.
    model.eval()
    eval_sequence = traced_sequence(model, (tokens,), output="logits")
    for size in (1, 3):
        other = torch.randint(0, 96, (size, 16), generator=torch.Generator().manual_seed(size))
        assert torch.equal(eval_sequence(other), model(other).logits)


def test_monai_unet_traced_equals_the_model_and_moves_its_batchnorm_statistics():
    model = _monai_unet(norm="batch")
    volume = torch.randn(2, 1, 16, 16, 16, generator=torch.Generator().manual_seed(2))
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    weights = torch.randn(2, 2, 16, 16, 16, generator=torch.Generator().manual_seed(3))
    sequence = _same_step(model, (volume,), lambda output: (output * weights).sum())
    # The statistics moved, in the user's buffers (equal to the plain step's, above).
    assert all(not torch.equal(buffer, before[name]) for name, buffer in model.named_buffers())
    # The skips cross a cut in the middle.
    middle = sequence.index("model_1_submodule_1")
    assert len(sequence.crossing(middle)) == 2


def test_project_models_with_code_between_modules_trace_exactly():
    # TinyTransformer: embedding sum and position indices between modules, a tied head, dropout, in-place adds.
    model = TinyTransformer(vocab_size=64, dim=32, depth=3, heads=2, max_len=16, dropout=0.1)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    sequence = _same_step(model, (tokens,), lambda logits: F.cross_entropy(logits.flatten(0, 1), tokens.flatten()))
    assert [block.name for block in sequence.blocks][3:6] == ["blocks_0", "blocks_1", "blocks_2"]
    # SmallCNN: BatchNorm, in-place ReLU, dropout, then a mean over space before the classifier.
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    _same_step(SmallCNN(channels=(8, 16, 16)), (images,), lambda logits: logits.pow(2).sum())


def test_a_sequence_refuses_the_mode_it_was_not_traced_in_and_eval_traces_work():
    model = _monai_unet(norm="batch")
    volume = torch.randn(2, 1, 16, 16, 16)
    sequence = traced_sequence(model, volume)
    model.eval()
    with pytest.raises(InputError, match="traced with the model in training mode"):
        sequence(volume)
    evaluated = traced_sequence(model, volume)      # BatchNorm on its running statistics now
    with torch.no_grad():
        assert torch.equal(evaluated(volume), model(volume))
    sequence.eval()         # the sequence's own modes too
    with pytest.raises(InputError, match="trace the model again"):
        sequence(volume)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.first(x) if x.sum() > 0 else self.second(x)


class _Outputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return {"logits": x, "aux": x.sum(-1)}


def test_what_cannot_be_traced_says_why_and_what_works():
    with pytest.raises(InputError, match="data-dependent control flow.*BlockSequence"):
        traced_sequence(_DataDependent(), torch.randn(2, 4))
    with pytest.raises(InputError, match=r"returns \['logits', 'aux'\], not one tensor; give output="):
        traced_sequence(_Outputs(), torch.randn(2, 4))
    with pytest.raises(InputError, match="no example input to trace"):
        sequence_for(_Outputs())
    model, inputs = _Outputs(), torch.randn(3, 4)
    sequence = sequence_for(model, inputs, output="logits")
    assert sequence.origin == TRACED and torch.equal(sequence(inputs), model(inputs)["logits"])
    # A tuple (no keys): output= is an index, negative ones included.
    tupled = _TupleOutputs()
    for index in (0, -2):
        assert torch.equal(traced_sequence(tupled, inputs, output=index)(inputs), tupled(inputs)[0])


class _RampInEveryBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        ramp = torch.arange(x.shape[-1], dtype=x.dtype)     # from a size alone
        for layer in self.layers:
            x = torch.tanh(layer(x) + ramp)
        return x


def test_what_is_computed_from_sizes_alone_is_computed_again_in_each_block_never_sent():
    model, inputs = _RampInEveryBlock(), torch.randn(2, 4)
    sequence = traced_sequence(model, inputs)
    assert [block.name for block in sequence.blocks] == ["layers_0", "layers_1", "layers_2"]
    assert [len(sequence.crossing(cut)) for cut in (1, 2)] == [1, 1]     # the activation only
    assert torch.equal(sequence(inputs), model(inputs))


class _WritesBack(nn.Module):
    """Functional code writes in place into a tensor an earlier layer made, after the next layer read it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        h = self.layers[0](x)
        y = self.layers[1](h)
        h.mul_(2)
        y = self.layers[2](y + h)
        return self.layers[3](y)


def test_an_in_place_write_stays_in_the_block_that_made_the_tensor():
    """A stage receives a copy of what crosses its cut: a write into a tensor made before the cut would
    change the copy, not the tensor the earlier stage read. The cuts between the maker (layers_0) and
    the writer are not offered: layers_0 to layers_2 are one block, and only one activation crosses."""
    model, inputs = _WritesBack(), torch.randn(2, 4)
    sequence = traced_sequence(model, inputs)
    assert [block.name for block in sequence.blocks] == ["layers_0", "layers_3"]
    assert len(sequence.crossing(1)) == 1
    assert torch.equal(sequence(inputs), model(inputs))


class _TupleOutputs(_Outputs):
    def forward(self, x):
        outputs = super().forward(x)
        return outputs["logits"], outputs["aux"]


def test_sequence_for_prefers_the_hand_written_cuts():
    from oomless.models import UNet3D

    assert sequence_for(UNet3D(base_channels=2, depth=2), torch.randn(1, 1, 8, 8, 8)).origin == "block sequence"
    assert sequence_for(TinyTransformer(depth=2)).origin == "block sequence"


def test_candidate_blocks_keep_repeated_layers_whole():
    assert candidate_blocks(_gpt2()) == ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0",
                                         "transformer.h.1", "transformer.h.2", "transformer.ln_f", "lm_head"]
    # MONAI: the outer SkipConnection is split (it nests the inner one), the ResidualUnits stay whole.
    names = candidate_blocks(_monai_unet())
    assert names[:3] == ["model.0", "model.1.submodule.0", "model.1.submodule.1"]


def _max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max(((first[name].double() - second[name].double()).abs().max().item() for name in first), default=0.0)


def _partitioned_cuts(kind: str) -> list[int]:
    """The partitioner's 2-stage cut of ``kind``'s traced sequence, from a profile of one micro-batch."""
    import oomless
    from oomless.parallel.pipeline import cuts_from_stage_blocks
    from oomless.plan.partition import partition_stages
    from tests.pipeline_workers import build

    model, sequence, loss_fn = build(kind)
    inputs, target = batch(kind, 0)
    profile = oomless.profile(sequence, inputs, blocks=[f"steps.{block.name}" for block in sequence.blocks],
                              loss_fn=lambda output: loss_fn(output, target))
    for block in profile.blocks:
        block.name = block.name.removeprefix("steps.")
    partition = partition_stages(profile, stages=2, memory="64GiB")
    assert [name for names in partition.stage_blocks for name in names] == [block.name for block in sequence.blocks]
    return cuts_from_stage_blocks(sequence, partition.stage_blocks)


def test_two_stage_pipelines_of_gpt2_and_monai_unet_train_as_one_process(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("monai")
    from tests.pipeline_workers import build

    gpt2, unet = build("gpt2")[1], build("monai-unet")[1]
    after_first_layer, across_skips = gpt2.index("transformer_h_1"), unet.index("model_1_submodule_1")
    assert len(unet.crossing(across_skips)) == 2
    jobs = [
        # The tied embedding (stage 0) and head (stage 1) on different ranks: gradients summed.
        dict(name="gpt2-1f1b", kind="gpt2", cuts=[0, after_first_layer, len(gpt2.blocks)], microbatches=4,
             schedule="1f1b"),
        dict(name="gpt2-zbv", kind="gpt2", cuts=[0, 2, 4, 6, len(gpt2.blocks)], microbatches=4, schedule="zbv"),
        # Two tensors cross the cut; BatchNorm per micro-batch (the reference accumulates over the same chunks).
        dict(name="monai-gpipe", kind="monai-unet", cuts=[0, across_skips, len(unet.blocks)], microbatches=2,
             schedule="gpipe"),
        # The cut the partitioner chose from a profile of the traced sequence.
        dict(name="monai-partitioned", kind="monai-unet", cuts=_partitioned_cuts("monai-unet"), microbatches=1,
             schedule="gpipe"),
        # Each stage with its own fit-engine plan: the traced blocks recomputed (BatchNorm's statistics
        # must still move once per micro-batch) or their saved tensors swapped.
        dict(name="monai-recompute", kind="monai-unet", cuts=[0, across_skips, len(unet.blocks)], microbatches=2,
             schedule="1f1b", policy="recompute"),
        dict(name="gpt2-swap", kind="gpt2", cuts=[0, after_first_layer, len(gpt2.blocks)], microbatches=2,
             schedule="gpipe", policy="swap"),
    ]
    jobs = runnable_here(jobs)
    results = run_pipeline_jobs(2, jobs, tmp_path)
    for job in jobs:
        parameters, buffers = reference(job["kind"], reference_chunks(job), volumes=UNET_VOLUMES)
        result = results[job["name"]]
        assert _max_difference(result["parameters"], parameters) <= TOLERANCE, job["name"]
        assert buffers_agree(job)
        assert _max_difference(result["buffers"], buffers) <= TOLERANCE, (job["name"], "buffers")
        stages = [stage for by_rank in result["stages"] for stage in by_rank]
        if "policy" in job:
            assert len(stages) == 2 and all(stage["decisions"] == [job["policy"]] for stage in stages), stages
        if job.get("policy") == "recompute":      # every block that saves anything re-ran, each micro-batch and step
            assert all(stage["recomputed_blocks"] >= stage["saving_blocks"] * job["microbatches"] * STEPS > 0
                       for stage in stages), stages
        if job.get("policy") == "swap":
            assert all(stage["offloaded_bytes"] > 0 for stage in stages), stages
    # The references moved, BatchNorm statistics included: the comparisons are not of initial states.
    for kind in ("gpt2", "monai-unet"):
        model = build(kind)[0]
        initial = {name: tensor.detach() for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
        parameters, buffers = reference(kind)
        assert _max_difference({name: initial[name] for name in parameters}, parameters) > 1e-4
        assert all(not torch.equal(initial[name], buffer) for name, buffer in buffers.items() if "running" in name)


def test_a_two_by_two_hybrid_of_monai_unet_takes_batchnorm_over_replicas(tmp_path):
    """2 stages x 2 replicas, BatchNorm statistics over both replicas (as the training loop's hybrid
    layout runs it): the traced blocks must call the BatchNorms swapped in after tracing (`rebuilt`)."""
    pytest.importorskip("monai")
    from tests.pipeline_workers import build

    unet = build("monai-unet")[1]
    job = dict(name="monai-hybrid", kind="monai-unet", cuts=[0, unet.index("model_1_submodule_1"), len(unet.blocks)],
               microbatches=1, schedule="gpipe", dp=2, global_batchnorm=True)
    result = run_pipeline_jobs(4, [job], tmp_path)[job["name"]]
    parameters, buffers = reference(job["kind"], reference_chunks(job))
    assert _max_difference(result["parameters"], parameters) <= TOLERANCE
    assert _max_difference(result["buffers"], buffers) <= TOLERANCE


def test_rebuilt_blocks_call_the_modules_the_model_has_now():
    from oomless.parallel.batchnorm import GlobalBatchNorm, convert_batchnorm_for_data_parallel

    model = _monai_unet(norm="batch")
    volume = torch.randn(2, 1, 16, 16, 16)
    sequence = traced_sequence(model, volume)
    assert convert_batchnorm_for_data_parallel(model, torch.device("cpu")) == 6
    rebuilt = sequence.rebuilt()
    kinds = lambda sequence: {type(module) for module in sequence.modules() if "BatchNorm" in type(module).__name__}
    assert kinds(sequence) == {nn.BatchNorm3d} and kinds(rebuilt) == {GlobalBatchNorm}
    assert [block.name for block in rebuilt.blocks] == [block.name for block in sequence.blocks]
    torch.manual_seed(0)
    expected = model(volume)
    torch.manual_seed(0)
    assert torch.equal(rebuilt(volume), expected)


def test_the_training_loop_pipelines_monai_unet_as_data_parallel_trains_it(tmp_path):
    """``oomless train --model monai-unet --parallel pipeline``: MONAI's UNet has no hand-written cut,
    so the loop traces it; with one micro-batch the pipeline trains what dp trains: the losses to 1e-6
    relative and every weight within 1e-5 after 4 Adam steps (tests/test_pipeline_training.py's
    tolerance), except the biases of the convolutions right before an InstanceNorm. The norm
    subtracts their effect, so their exact gradient is zero and the float one is summation-order
    noise, which Adam scales into lr-sized steps (measured up to 1.6e-3 between dp and pipeline; the
    same effect as attention's key bias in tests/pipeline_workers.py)."""
    pytest.importorskip("monai")
    from safetensors.torch import load_file

    from oomless.models import build_model
    from tests.parallel_workers import run_jobs

    common = dict(model="monai-unet", depth=2, steps=4, global_batch=4)
    jobs = [("dp", dict(parallel=dict(mode="dp"), **common)),
            ("pipeline", dict(parallel=dict(mode="pipeline", stages=2, microbatches=1), **common))]
    results = run_jobs(2, jobs, tmp_path)
    expected, produced = (load_file(str(tmp_path / f"{name}.safetensors")) for name in ("dp", "pipeline"))
    model = build_model("monai-unet", in_channels=1, out_channels=2, base_channels=2, depth=2)
    modules = dict(model.named_modules())
    cancelled = {name for name in expected if name.endswith("conv.bias") and isinstance(
        modules.get(name.removesuffix("conv.bias") + "adn.N"), nn.InstanceNorm3d)}
    assert 0 < len(cancelled) < len(expected) // 3
    kept = lambda weights: {name: tensor for name, tensor in weights.items() if name not in cancelled}
    assert _max_difference(kept(produced), kept(expected)) <= 1e-5
    assert results["pipeline"]["losses"] == pytest.approx(results["dp"]["losses"], rel=1e-6)
    assert results["pipeline"]["losses"][0] != pytest.approx(results["pipeline"]["losses"][-1], rel=1e-3)
