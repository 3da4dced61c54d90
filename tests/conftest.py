import copy

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
