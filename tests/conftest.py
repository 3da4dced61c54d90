import copy

import pytest
import torch

import oomless

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def budget_for_share(model, inputs, share: float, **plan_kwargs) -> int:
    """Memory that leaves ``share`` of the plain step's saved activations on the device."""
    full = oomless.plan(copy.deepcopy(model), inputs, "1TiB", **plan_kwargs)
    return full.static_bytes + full.reserve_bytes + int(share * full.predicted_activation_peak_bytes)


def minimum_memory(model, inputs, **plan_kwargs) -> int:
    with pytest.raises(oomless.PlanError) as error:
        oomless.plan(copy.deepcopy(model), inputs, 1, **plan_kwargs)
    return error.value.minimum_bytes
