"""Run one training step in this process and print its peak resident memory as JSON.

    python tests/rss_child.py MODEL MEMORY|plain [keep|swap|recompute]
MODEL is "transformer" or "unet3d"; a third argument forces that decision on every block. The baseline is taken after imports and a warm-up of the ops
(library start-up is not the step's memory); everything after it counts: the model, optimizer
state, planning, and the steps.
"""

import json
import sys

import torch
import torch.nn.functional as F

import oomless
from oomless.models import TinyTransformer, UNet3D
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system


def build(name):
    torch.manual_seed(0)
    if name == "transformer":
        model = TinyTransformer(vocab_size=512, dim=256, depth=6, heads=8, max_len=512, dropout=0.1)
        tokens = torch.randint(0, 512, (4, 512))
        return model, tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten())
    model = UNet3D(base_channels=8, depth=3)
    volume = torch.randn(2, 1, 64, 64, 64)
    target = (volume[:, 0] > 0.5).long()
    return model, volume, lambda out: F.cross_entropy(out, target)


def main():
    name, memory = sys.argv[1], sys.argv[2]
    torch.set_num_threads(2)
    return_freed_memory_to_the_system()
    # Warm-up: the first optimizer loads ~70 MB of library code (torch._dynamo) and kernels
    # initialise their caches; that is start-up, not the step's memory.
    warm_model, warm_inputs, warm_loss = build(name)
    warm_optimizer = torch.optim.Adam(warm_model.parameters())
    warm_loss(warm_model(warm_inputs)).backward()
    warm_optimizer.step()
    del warm_model, warm_inputs, warm_loss, warm_optimizer
    baseline = current_rss_bytes()
    reset_peak_rss()
    model, inputs, loss_fn = build(name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    plan = None
    if memory != "plain":
        plan_profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer, memory=memory)
        forced = None
        if len(sys.argv) > 3:
            forced = {block.name: sys.argv[3] for block in plan_profile.blocks}
        plan = oomless.plan(model, inputs, memory, profile=plan_profile, decisions=forced)
        oomless.apply(model, plan)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        optimizer.step()
    # Profiling resets the kernel's peak mark per block; it reports the highest reading it saw.
    planning_peak = plan_profile.measured_peak_bytes if plan is not None else 0
    result = {"peak_bytes": max(peak_rss_bytes(), planning_peak) - baseline, "baseline_bytes": baseline}
    if plan is not None:
        stats = oomless.stats(model)
        result.update(memory_bytes=plan.memory_bytes, decisions=plan.decisions,
                      predicted_peak_bytes=plan.predicted_peak_bytes, activation_budget=plan.activation_budget,
                      ledger_peak_bytes=stats.peak_activation_bytes, static_bytes=plan.static_bytes,
                      reserve_bytes=plan.reserve_bytes, plain_predicted_peak_bytes=plan.plain_peak_bytes)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
