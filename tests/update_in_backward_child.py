"""Resident memory of training steps, plain or with static bytes moved by oomless, as JSON.

    python tests/update_in_backward_child.py plain|in_backward|offload|everything [LAYERS]

A deep MLP (LAYERS layers of 1024x1024, 16 by default: 64 MiB of parameters) with a small batch, so
that parameters, gradients and Adam's state are most of what a step holds. ``in_backward`` steps the
optimizer in backward, ``offload`` also keeps its state on disk, ``everything`` also the parameters.
Reported, each after a warm-up of the library code:
- ``peak_rise_bytes``: above the memory after a first step (Adam's state exists then) with its
  gradients freed, the peak of the next two steps (gradients, activations, the optimizer's temporaries);
- ``rise_from_start_bytes``: above the memory before the first step, the peak of all three (the state too);
- ``peak_above_empty_bytes``: above the memory before the model was built, the peak of the three
  steps (planning is not counted: it profiles the model whole).
"""

import gc
import json
import sys

import torch

import oomless
from oomless.models import MLP
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system


def main():
    mode = sys.argv[1]
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    torch.set_num_threads(2)
    return_freed_memory_to_the_system()
    warm = torch.nn.Linear(8, 8)                # loads the optimizer's library code (tens of MB)
    torch.optim.Adam(warm.parameters()).step()
    del warm
    gc.collect()
    empty = current_rss_bytes()
    torch.manual_seed(0)
    model = MLP((1024,) * (layers + 1))
    inputs = torch.randn(8, 1024)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    parameter_bytes = sum(param.nbytes for param in model.parameters())

    def loss_fn(output):
        return output.square().mean()

    if mode != "plain":
        oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True,
                    offload_optimizer_state=mode in ("offload", "everything"),
                    offload_parameters=mode == "everything")

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        optimizer.step()

    gc.collect()
    start = current_rss_bytes()                # no optimizer state yet
    reset_peak_rss()
    step()
    first_peak = peak_rss_bytes()
    optimizer.zero_grad(set_to_none=True)      # the plain loop's gradients would count in the baseline
    gc.collect()
    baseline = current_rss_bytes()
    reset_peak_rss()
    for _ in range(2):
        step()
    peak = peak_rss_bytes()
    print(json.dumps({"peak_rise_bytes": peak - baseline, "baseline_bytes": baseline,
                      "rise_from_start_bytes": max(first_peak, peak) - start,
                      "peak_above_empty_bytes": max(first_peak, peak) - empty,
                      "gradient_bytes": parameter_bytes, "parameter_bytes": parameter_bytes}))


if __name__ == "__main__":
    main()
