"""Peak resident-memory rise of training steps, plain or with the update in backward, as JSON.

    python tests/update_in_backward_child.py plain|in_backward

A deep MLP with a small batch, so that gradients (64 MiB) are most of what a step allocates. The
baseline is taken after a first step (Adam's state exists then) and everything in the next two
steps counts: gradients, activations, the optimizer's temporaries.
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
    torch.set_num_threads(2)
    return_freed_memory_to_the_system()
    torch.manual_seed(0)
    model = MLP((1024,) * 17)                  # 16 layers of 4 MiB
    inputs = torch.randn(8, 1024)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn(output):
        return output.square().mean()

    if mode == "in_backward":
        oomless.fit(model, inputs, "1TiB", loss_fn=loss_fn, optimizer=optimizer, update_in_backward=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        optimizer.step()

    step()
    optimizer.zero_grad(set_to_none=True)      # the plain loop's gradients would count in the baseline
    gc.collect()
    baseline = current_rss_bytes()
    reset_peak_rss()
    for _ in range(2):
        step()
    print(json.dumps({"peak_rise_bytes": peak_rss_bytes() - baseline, "baseline_bytes": baseline,
                      "gradient_bytes": sum(param.nbytes for param in model.parameters())}))


if __name__ == "__main__":
    main()
