# oomless before torch: it turns on PyTorch's huge pages for large CPU tensors, which libtorch reads
# once (`oomless.profile.rss.turn_on_huge_pages_unless_set`), as a user's script that imports it first gets.
import oomless  # noqa: I001

import contextlib

import pytest
import torch

import torch.nn.functional as F

from oomless.models import TinyTransformer, UNet3D, make_torchvision_importable
from oomless.plan.planner import make_plan, smallest_memory

# Before any test, or transformers, imports torchvision: PyPI's torchvision beside a CPU-only torch
# fails on import otherwise (src/oomless/models/vision.py).
make_torchvision_importable()

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def budget_for_share(profile, share: float, **plan_kwargs) -> int:
    """Memory that leaves ``share`` of the plain step's saved activations on the device."""
    full = make_plan(profile, 2**40, **plan_kwargs)
    return full.static_bytes + full.reserve_bytes + int(share * full.predicted_activation_peak_bytes)


def minimum_memory(profile) -> int:
    """The exact smallest budget for this profile, swaps of any size (the tests' min_swap_bytes=0;
    PlanError reports it with a margin)."""
    return smallest_memory(profile, min_swap_bytes=0)


def needs_selective() -> None:
    """Skip a test of selective recompute where this torch cannot run it: oomless counts a selective
    block's kept outputs as the policy is handed them (``SelectiveCheckpointContext.op_output``:
    torch 2.13 has it, 2.11 does not), and without it the planner offers no block selective."""
    from oomless.runtime.selective import AVAILABLE

    if not AVAILABLE:
        pytest.skip("this torch's SelectiveCheckpointContext has no op_output: no selective recompute offered")


def planner_forcing(cycle: list[str]):
    """A stand-in for `oomless.plan` (the training loop calls it) whose plan no measurement picks:
    the decisions are ``cycle`` repeated over the blocks in order (e.g. ["swap", "recompute",
    "keep"]), planned for the smallest memory those decisions fit (their predicted peak, margin
    included), whatever ``memory`` it is given; swaps of any size; parameters, gradients and the
    optimizer's state where plain PyTorch keeps them (the planner would place them by measured
    times). Under load the measured times change and the memory a phase takes a little; the blocks
    swapped and recomputed do not, and the budget is that plan's own. Each call records (plan,
    memory) in the stand-in's ``made`` list."""
    from oomless.api import plan as plan_for_memory

    def plan(model, example_inputs, memory, **kwargs):
        profile = oomless.profile(model, example_inputs, loss_fn=kwargs.get("loss_fn"),
                                  optimizer=kwargs.get("optimizer"), precision=kwargs.get("precision", "fp32"),
                                  compile=kwargs.get("compile", False))
        kwargs.update(split=False, update_in_backward=False, offload_optimizer_state=False, offload_parameters=False)
        decisions = {block.name: cycle[index % len(cycle)] for index, block in enumerate(profile.blocks)}
        roomy = plan_for_memory(model, example_inputs, 2**40, profile=profile, decisions=decisions, min_swap_bytes=0,
                                **kwargs)
        tight = roomy.predicted_peak_bytes
        made = plan_for_memory(model, example_inputs, tight, profile=profile, decisions=decisions, min_swap_bytes=0,
                               **kwargs)
        assert made.predicted_peak_bytes <= tight, made
        plan.made.append((made, tight))
        return made

    plan.made = []
    return plan


def plan_under(model, inputs, loss_fn, policy: str, **plan_kwargs):
    """A plan with every block under ``policy`` (keep|swap|recompute; selective: selective recompute
    where the profile offers it, recompute elsewhere), or for "planned" the
    planner's own at half the plain step's activations (at least the smallest that fits). Returns
    the plan and, for "planned", the memory it was made for. ``plan_kwargs`` (precision=,
    optimizer=) go to the profile and the plan."""
    if policy == "planned":
        profile = oomless.profile(model, inputs, loss_fn=loss_fn, **plan_kwargs)
        # Below plain's peak even where half the activations are less than the phase with the most
        # working memory and no activations (a small MLP: a few MiB of measured heap against 32 KiB).
        plain_peak = make_plan(profile, 2**40).plain_peak_bytes
        memory = max(min(budget_for_share(profile, 0.5), plain_peak - 1), minimum_memory(profile))
        return oomless.plan(model, inputs, memory, min_swap_bytes=0, profile=profile,
                            precision=plan_kwargs.get("precision", "fp32")), memory
    if policy == "selective":
        # Selective recompute wherever the profile offers it (runtime/selective.py), else recompute.
        profile = oomless.profile(model, inputs, loss_fn=loss_fn, **plan_kwargs)
        decisions = {block.name: "selective" if block.selective_kept_bytes is not None else "recompute"
                     for block in profile.blocks}
        return oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, profile=profile,
                            decisions=decisions, precision=plan_kwargs.get("precision", "fp32")), None
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, **plan_kwargs)
    return plan.with_decisions({name: policy for name in plan.decisions}), None


def ledger_case(model_name: str, device="cpu"):
    """(model, inputs, loss_fn) of the ledger tests (tests/test_ledger.py, on CUDA in test_cuda.py)."""
    if model_name == "unet3d":
        volume = torch.randn(2, 1, 32, 32, 32, device=device)
        target = (volume[:, 0] > 0).long()
        return UNet3D(base_channels=4, depth=2).to(device), volume, lambda out: F.cross_entropy(out, target)
    tokens = torch.randint(0, 256, (4, 64), device=device)
    return (TinyTransformer(vocab_size=256, dim=64, depth=4, heads=4, max_len=64).to(device),
            tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten()))


def apply_plan_for_share(model, inputs, loss_fn, optimizer, share):
    """Plan ``model`` for ``share`` of its plain activations ("minimum": the smallest budget that
    fits; a share below it is raised to it), apply it; returns (plan, memory planned for)."""
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer)
    smallest = minimum_memory(profile)
    memory = smallest if share == "minimum" else max(budget_for_share(profile, share), smallest)
    plan = oomless.plan(model, inputs, memory, profile=profile, min_swap_bytes=0)
    oomless.apply(model, plan)
    return plan, memory


class RaisesInBackward(torch.autograd.Function):
    """The identity, whose backward raises as an out-of-memory error would (a loop that recovers from one)."""

    @staticmethod
    def forward(ctx, inputs):
        return inputs.view_as(inputs)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated out of memory in backward")


def train_steps(model, optimizer, inputs, loss_fn, steps=2):
    """The plain training loop the equality tests run on both sides, dropout seeded per step."""
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        loss_fn(model(inputs)).backward()
        optimizer.step()
    return model


@contextlib.contextmanager
def cpu_dropout_as_cuda_runs_it():
    """F.dropout (nn.Dropout's) on the CPU as CUDA runs it: a profile for a GPU on meta tensors
    counts `native_dropout`'s boolean mask (`profile.fake_dropout`), where the CPU's `at::dropout`
    takes the composite path and keeps its noise in the input's dtype; the CPU has the same kernel.
    Patched, not a TorchFunctionMode: the real profiler's recompute in backward would not see a mode."""
    from oomless.profile.fake_dropout import fused_dropout_applies

    composite_dropout = F.dropout

    def cuda_s_dropout(input, p=0.5, training=True, inplace=False):
        if fused_dropout_applies(input, p, training, inplace):
            return torch.native_dropout(input, p, True)[0]
        return composite_dropout(input, p, training, inplace)

    F.dropout = cuda_s_dropout
    try:
        yield
    finally:
        F.dropout = composite_dropout


class FakeFloors:
    """Profiling and planning replaced for plan/splitting.py's tests: ``floors`` maps each tuple of
    split chains (in the order chosen) to (the block that sets the floor, the floor); a plan for a
    budget below the floor raises `PlanError` naming them. ``asked`` records each split measured."""

    def __init__(self, floors: dict, memory: int):
        self.floors, self.memory, self.asked = floors, memory, []

    def profile_split(self, chains) -> tuple:
        self.asked.append(tuple(chains))
        return tuple(chains)

    def plan_profile(self, profile: tuple, memory: int | None = None):
        memory = self.memory if memory is None else memory
        block, floor = self.floors[profile]
        if floor > memory:
            raise oomless.PlanError("too small", minimum_bytes=floor, floor_block=block, limiting_block=block)
        return oomless.Plan(memory_bytes=memory, device="cpu", static_bytes=0, reserve_bytes=0, activation_budget=0,
                            predicted_peak_bytes=floor, predicted_activation_peak_bytes=0, predicted_step_seconds=0,
                            plain_peak_bytes=0, plain_step_seconds=0, blocks=[])
