import pytest
import torch

import oomless
from oomless.plan.planner import make_plan, smallest_memory

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def budget_for_share(profile, share: float, **plan_kwargs) -> int:
    """Memory that leaves ``share`` of the plain step's saved activations on the device."""
    full = make_plan(profile, 2**40, **plan_kwargs)
    return full.static_bytes + full.reserve_bytes + int(share * full.predicted_activation_peak_bytes)


def minimum_memory(profile) -> int:
    """The exact smallest budget for this profile (PlanError reports it with a margin)."""
    return smallest_memory(profile)


def plan_under(model, inputs, loss_fn, policy: str):
    """A plan with every block under ``policy`` (keep|swap|recompute), or for "planned" the
    planner's own at half the plain step's activations (at least the smallest that fits). Returns
    the plan and, for "planned", the memory it was made for."""
    if policy == "planned":
        profile = oomless.profile(model, inputs, loss_fn=loss_fn)
        memory = max(budget_for_share(profile, 0.5), minimum_memory(profile))
        return oomless.plan(model, inputs, memory, min_swap_bytes=0, profile=profile), memory
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0)
    return plan.with_decisions({name: policy for name in plan.decisions}), None
