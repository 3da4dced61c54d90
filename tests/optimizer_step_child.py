"""One training step of a model whose optimizer step sets its peak, in a fresh process: its peak
resident-memory rise and the plan's prediction, as one JSON line (tests/test_optimizer_step.py).

    python tests/optimizer_step_child.py ROWS MEMORY

The model: an embedding of ROWS x 128 and two small layers, 4 x 64 tokens, Adam. The baseline is
taken after a warm-up of the same ops at 1000 rows; planning and three steps count.
"""

import json, sys, torch, torch.nn as nn, torch.nn.functional as F
import oomless
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system

def build(rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(rows, 128), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 16))
    tokens = torch.randint(0, rows, (4, 64))
    labels = torch.randint(0, 16, (4, 64))
    return model, tokens, lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten())

torch.set_num_threads(2)
return_freed_memory_to_the_system()
m, x, l = build(1000); o = torch.optim.Adam(m.parameters()); l(m(x)).backward(); o.step(); del m, x, l, o
reset_peak_rss(); base = current_rss_bytes()
model, tokens, loss_fn = build(int(sys.argv[1]))
optimizer = torch.optim.Adam(model.parameters())
plan = oomless.plan(model, tokens, sys.argv[2], loss_fn=loss_fn, optimizer=optimizer)
oomless.apply(model, plan, optimizer=optimizer)
for _ in range(3):
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(tokens)).backward()
    optimizer.step()
print(json.dumps({"peak": peak_rss_bytes() - base, "predicted": plan.predicted_peak_bytes, "static": plan.static_bytes,
                  "memory": plan.memory_bytes, "placement": plan.notes[-1][:80]}))
