"""Child process for tests/test_target.py: plan a big model for a target on meta tensors and print
the plan's numbers with this process's own peak resident memory, as JSON."""

import json
import sys

import torch

import oomless
from oomless.models import build_model, example_input_for
from oomless.profile.rss import peak_rss_bytes


def main(name: str, memory: str, shape: str, model_args: str) -> None:
    kwargs = json.loads(model_args)
    with torch.device("meta"):
        model = build_model(name, **kwargs)
    example = example_input_for(name, shape=tuple(int(s) for s in shape.split(",")), **kwargs).to("meta")
    parameters = sum(p.numel() for p in model.parameters())
    plan = oomless.plan(model, example, memory=memory, target="h100", loss_fn=oomless.sum_of_outputs,
                        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
    print(json.dumps({"parameters": parameters, "parameter_bytes": plan.static_breakdown["parameters"],
                      "plain_peak_bytes": plan.plain_peak_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
                      "memory_bytes": plan.memory_bytes, "decisions": plan.decisions,
                      "predicted_step_seconds": plan.predicted_step_seconds, "peak_rss_bytes": peak_rss_bytes()}))


if __name__ == "__main__":
    main(*sys.argv[1:])
