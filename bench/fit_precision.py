"""The precision and compile variants of bench_fit.py (``oomless bench --precision bf16 --compile``).

Each comparison has its own plain reference, run side by side with the fp32 variants:

    plain_bf16         plain PyTorch, forward under torch.autocast(bf16) (fp16: and GradScaler)
    keep_bf16          oomless precision="bf16", every block kept (the cost of the hooks alone)
    plan_50_bf16       oomless precision="bf16" at the fp32 plan_50's memory: the same budget,
                       half the activation bytes, so fewer blocks swapped or recomputed
    plain_compiled     plain PyTorch with torch.compile(block) in each block's place (torchtitan's way)
    keep_compiled      oomless compile=True, every block kept: its overhead over plain_compiled
    plan_50_compiled   oomless compile=True at the fp32 plan_50's memory

``ratio_vs_reference`` is each variant's median step over its reference's (plain_<precision> or
plain_compiled); ``ratio_vs_plain`` stays the ratio to fp32 eager plain.
"""

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch

from oomless.errors import PlanError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def plan_or_minimum(model, inputs, loss_fn, profile, memory_bytes: int, notes: list[str], **options):
    """The plan for ``memory_bytes``, or, where none fits, for the smallest memory that does (noted)."""
    try:
        return oomless.plan(model, inputs, memory_bytes, loss_fn=loss_fn, profile=profile, **options)
    except PlanError as error:
        # The exact minimum is met by the most frugal plan; PlanError's minimum carries a margin.
        notes.append(f"{memory_bytes} bytes did not plan ({error}); planned at {error.minimum_bytes} instead")
        return oomless.plan(model, inputs, error.minimum_bytes, loss_fn=loss_fn, profile=profile, **options)


def precision_variants(fresh, base, inputs, loss_fn, memory_bytes: int, precision: str, device) -> list:
    """plain_<p>, keep_<p>, plan_50_<p> (see the module docstring); ``fresh(name, **fields)`` makes a Variant."""
    plain = fresh(f"plain_{precision}", autocast=DTYPES[precision], reference=f"plain_{precision}")
    if precision == "fp16":
        plain.scaler = torch.amp.GradScaler(device.type)
    keep = fresh(f"keep_{precision}", applied=True, reference=f"plain_{precision}")
    profile = oomless.profile(keep.model, inputs, loss_fn=loss_fn, optimizer=keep.optimizer, precision=precision)
    keep.plan = oomless.plan(base, inputs, 2**40, profile=profile, precision=precision,
                             decisions={block.name: "keep" for block in profile.blocks})
    notes = [f"memory of the fp32 plan_50, {memory_bytes} bytes"]
    planned = fresh(f"plan_50_{precision}", applied=True, notes=notes, reference=f"plain_{precision}")
    planned.plan = plan_or_minimum(base, inputs, loss_fn, profile, memory_bytes, notes, precision=precision)
    return [plain, keep, planned]


def compiled_variants(fresh, base, inputs, loss_fn, memory_bytes: int) -> list:
    """plain_compiled, keep_compiled, plan_50_compiled (see the module docstring)."""
    keep = fresh("keep_compiled", applied=True, reference="plain_compiled")
    profile = oomless.profile(keep.model, inputs, loss_fn=loss_fn, optimizer=keep.optimizer, compile=True)
    keep.plan = oomless.plan(base, inputs, 2**40, profile=profile, compile=True,
                             decisions={block.name: "keep" for block in profile.blocks})
    plain = fresh("plain_compiled", reference="plain_compiled",
                  notes=[f"torch.compile(block) in place of each of keep_compiled's {len(profile.blocks)} blocks"])
    for block in profile.blocks:       # torchtitan's apply_compile
        parent_name, _, child = block.name.rpartition(".")
        parent = plain.model.get_submodule(parent_name)
        parent.register_module(child, torch.compile(parent.get_submodule(child)))
    notes = [f"memory of the fp32 plan_50, {memory_bytes} bytes"]
    planned = fresh("plan_50_compiled", applied=True, notes=notes, reference="plain_compiled")
    planned.plan = plan_or_minimum(base, inputs, loss_fn, profile, memory_bytes, notes, compile=True)
    return [plain, keep, planned]


def extra_targets(results: dict) -> dict:
    """The issue's targets for these variants, on this run's numbers (a record, never asserted)."""
    targets = {}
    if "keep_compiled" in results:
        targets["keep_compiled_within_3_percent_of_plain_compiled"] = \
            results["keep_compiled"]["ratio_vs_reference"] <= 1.03
    for precision in DTYPES:
        if f"plan_50_{precision}" in results:
            fp32, low = results["plan_50"], results[f"plan_50_{precision}"]
            targets[f"plan_50_{precision}_activation_peak_vs_fp32"] = \
                low["predicted_activation_peak_bytes"] / max(fp32["predicted_activation_peak_bytes"], 1)
    return targets

