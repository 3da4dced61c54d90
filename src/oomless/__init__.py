"""oomless: train PyTorch models larger than device memory, fast.

    model = oomless.fit(model, example_inputs, memory="20GiB")   # then train as usual
"""

# Before torch starts: PyTorch reads its huge-page switch for CPU tensors once (see the function).
from oomless.profile.rss import turn_on_huge_pages_unless_set  # noqa: I001  (must run before torch is imported)

turn_on_huge_pages_unless_set()

from oomless.api import apply, fit, installed_plan, plan, profile, remove, stats, sum_of_outputs
from oomless.simulation import simulate
from oomless.errors import ApplyError, InputError, OomlessError, PlanError, SizeError
from oomless.models.vision import make_torchvision_importable
from oomless.plan.devices import Device, register_device
from oomless.plan.plan import BlockPlan, Plan
from oomless.runtime.linear_loss import linear_cross_entropy
from oomless.runtime.loss_slabs import loss_in_slabs
from oomless.sizes import format_bytes, parse_bytes

# Before anything else imports torchvision (transformers does, for its image models): beside a
# CPU-only torch its C++ extension does not load, and `import torchvision` fails without this.
make_torchvision_importable()

__all__ = ["profile", "plan", "simulate", "apply", "remove", "fit", "stats", "sum_of_outputs", "loss_in_slabs", "linear_cross_entropy",
           "installed_plan",
           "Plan", "BlockPlan",
           "Device", "register_device",
           "OomlessError", "PlanError", "SizeError", "ApplyError", "InputError", "parse_bytes", "format_bytes"]
__version__ = "0.1.0"
