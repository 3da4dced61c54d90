"""Several models in one process, as GAN, distillation and encoder-decoder loops have them (found by
a user-style fuzzer): planning one model leaves every other model its loss calls as it was, and
decisions that name modules around several blocks give a plan or a refusal that says what to name.
Each test failed before its fix (D's BatchNorm statistics moved and its gradients were left filled;
a raw KeyError)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import oomless


def _generator_and_discriminator():
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    discriminator = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    return generator, discriminator


def test_planning_a_generator_leaves_the_discriminator_its_loss_calls_as_it_was():
    generator, discriminator = _generator_and_discriminator()
    noise, real = torch.randn(64, 16), torch.ones(64, 1)
    before = copy.deepcopy(discriminator)
    with torch.no_grad():           # a gradient the user's loop holds already is kept as it was
        discriminator[3].weight.grad = torch.full_like(discriminator[3].weight, 0.5)
    optimizer = torch.optim.Adam(generator.parameters())
    oomless.fit(generator, (noise,), memory="1GiB", optimizer=optimizer,
                loss_fn=lambda fake: F.binary_cross_entropy_with_logits(discriminator(fake), real))
    assert all(parameter.grad is None for parameter in generator.parameters())
    assert torch.equal(discriminator[3].weight.grad, torch.full_like(discriminator[3].weight, 0.5))
    assert all(parameter.grad is None for name, parameter in discriminator.named_parameters()
               if name != "3.weight")
    for (name, buffer), (_, reference) in zip(discriminator.named_buffers(), before.named_buffers()):
        assert torch.equal(buffer, reference), name


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.BatchNorm1d(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _TwoBlocks(nn.Module):
    """Two blocks, each over a quarter of the saved bytes: the profile measures their children."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(32, 128), nn.Linear(128, 10)
        self.blocks = nn.ModuleList([_Block(128), _Block(128)])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def test_decisions_naming_modules_around_blocks_plan_or_say_which_blocks_to_name():
    torch.manual_seed(0)
    model, x, labels = _TwoBlocks(), torch.randn(32, 32), torch.randint(0, 10, (32,))
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = lambda output: F.cross_entropy(output, labels)      # noqa: E731
    profile = oomless.profile(model, (x,), loss_fn=loss_fn, optimizer=optimizer)
    assert [segment.name for segment in profile.segments] == ["blocks.0", "blocks.1"]
    decisions = {"inp": "keep", "blocks.0": "swap", "blocks.1": "recompute", "out": "keep"}
    plan = oomless.plan(model, (x,), "1GiB", optimizer=optimizer, loss_fn=loss_fn, profile=profile,
                        decisions=decisions)
    assert plan.decisions == decisions
    with pytest.raises(oomless.PlanError, match=r"name their blocks \(blocks.0.norm, blocks.0.fc1"):
        oomless.plan(model, (x,), "1GiB", optimizer=optimizer, loss_fn=loss_fn, profile=profile,
                     decisions=decisions, update_in_backward=True, offload_parameters=True)


def test_a_block_holding_a_model_with_its_own_plan_is_not_recomputed():
    """Recomputed, its forward ran again under torch's checkpoint, which does not see the inner plan's
    saves: CheckpointError at the first backward, after a warning that blamed torch.compile."""
    torch.manual_seed(0)
    model = nn.Sequential(_TwoBlocks(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 2))
    x, labels = torch.randn(32, 32), torch.randint(0, 10, (32,))
    optimizer = torch.optim.Adam(model.parameters())
    oomless.fit(model[0], (x,), "1GiB", optimizer=optimizer, loss_fn=lambda output: F.cross_entropy(output, labels))
    plan = oomless.plan(model, (x,), "1GiB", loss_fn=lambda output: output.square().mean(), blocks=["0", "1", "3"],
                        decisions={"0": "recompute", "1": "keep", "3": "keep"})
    with pytest.raises(oomless.ApplyError, match=r"block 0 is recomputed by this plan and is a model oomless is "
                                                 r"applied to .*decisions=\{'0': 'swap'\}"):
        oomless.apply(model, plan)
    swapped = oomless.plan(model, (x,), "1GiB", loss_fn=lambda output: output.square().mean(), blocks=["0", "1", "3"],
                           decisions={"0": "swap", "1": "keep", "3": "keep"})
    oomless.apply(model, swapped)
    model(x).square().mean().backward()


def _plans_made_alone_then_run_on_ranks(rank: int, port: int, out_dir: str) -> None:
    """A plan made in one process (update in backward; or for fsdp's shards), then applied on a rank of
    a 2-process group: refused, where it ran and the replicas drifted 0.09 apart (or went 2x over its
    budget)."""
    import json
    from pathlib import Path

    from oomless.parallel import ParallelConfig, Ranks, make_strategy
    from tests.parallel_workers import join

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), torch.randn(4, 8)
    optimizer = torch.optim.Adam(model.parameters())
    in_backward = oomless.plan(model, (x,), "1GiB", optimizer=optimizer, loss_fn=oomless.sum_of_outputs,
                               update_in_backward=True)
    sharded = oomless.plan(model, (x,), "1GiB", optimizer=optimizer, loss_fn=oomless.sum_of_outputs, shard_over=2)
    join(rank, 2, port)
    said = {}
    try:
        try:
            oomless.apply(model, in_backward, optimizer=optimizer)
        except oomless.ApplyError as refusal:
            said["apply"] = str(refusal)
        oomless.apply(model, sharded)
        try:
            make_strategy(ParallelConfig(mode="dp"), Ranks(rank, 2), torch.device("cpu")).prepare(model, optimizer, None)
        except oomless.InputError as refusal:
            said["dp"] = str(refusal)
    finally:
        torch.distributed.destroy_process_group()
    Path(out_dir, f"said-{rank}.json").write_text(json.dumps(said))


def test_plans_made_for_one_process_or_for_shards_are_refused_on_replicas(tmp_path):
    import json

    import torch.multiprocessing as mp

    from tests.parallel_workers import rendezvous

    with rendezvous() as port:
        mp.start_processes(_plans_made_alone_then_run_on_ranks, args=(port, str(tmp_path)), nprocs=2,
                           start_method="spawn")
    for rank in (0, 1):
        said = json.loads((tmp_path / f"said-{rank}.json").read_text())
        assert "updates the parameters in backward, and this process is one of 2 ranks" in said["apply"]
        assert "made for parameters sharded over 2 ranks (fsdp)" in said["dp"]
