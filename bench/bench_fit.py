"""Step time and peak memory of oomless against plain PyTorch and PyTorch's own memory savers.

    python bench/bench_fit.py                         # CPU here, or CUDA where available
    oomless bench --device cuda --model all --steps 10
    oomless bench --quick --out /tmp/bench.json       # tiny models, seconds (what tests/test_bench.py runs)

For each model, in one process and one run, these variants train side by side, round-robin (the
starting variant rotates each round, so drift and the order of variants cancel out):

    plain              plain PyTorch
    keep               oomless.apply with every block kept (the cost of the hooks alone)
    plan_50, plan_25   oomless planned for a budget leaving 50 % / 25 % of the plain step's saved
                       activations (clamped up to the smallest feasible memory, and the clamp recorded)
    plan_ckpt_memory   oomless planned for the memory checkpointing every block needs (predicted)
    checkpoint         torch.utils.checkpoint.checkpoint(block, use_reentrant=False) on every block
    save_on_cpu        torch.autograd.graph.save_on_cpu(pin_memory=<on CUDA>) around the forward

With --precision bf16|fp16 and --compile, the variants of bench/fit_precision.py join them.

A step is forward + loss + backward + optimizer step (zero_grad, set_to_none, just before the timer). Its median over the measured
steps (warm-up excluded) is compared with plain's; the peak memory of each variant is measured in
its own window (the allocator's peak on CUDA; on CPU the kernel's peak resident mark, reset before
each step, as the rise above the reading at the step's start plus the variant's own resident state).
The result is JSON with provenance, default runs/bench/fit-<device>-<date>.json (--out FOLDER or FILE.json;
--out bench/results for results to commit); see bench/README.md.
"""

import argparse
import copy
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch
from torch import nn

from oomless.errors import InputError
from oomless.plan.planner import make_plan, smallest_memory
from oomless.profile.links import measure_link
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:    # loaded from its path by `oomless bench`, not run as a script
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import (SIZES, build_model, checkpoint_every_block, provenance, result_path,  # noqa: E402  (bench/common.py)
                    write_result)
from fit_precision import compiled_variants, extra_targets, plan_or_minimum, precision_variants  # noqa: E402

VARIANTS = ("plain", "keep", "plan_50", "plan_25", "plan_ckpt_memory", "checkpoint", "save_on_cpu")
PLAN_SHARES = {"plan_50": 0.5, "plan_25": 0.25}


@dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    plan: "oomless.Plan | None" = None        # the plan applied, or the one whose predictions apply
    applied: bool = False
    save_on_cpu: bool = False
    autocast: torch.dtype | None = None         # plain variants of bench/fit_precision.py
    scaler: "torch.amp.GradScaler | None" = None
    reference: str = "plain"                    # the variant ratio_vs_reference divides by
    notes: list[str] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_rise_bytes: list[int] = field(default_factory=list)


class PeakWindow:
    """Peak memory of one step, alone: the allocator's counters on CUDA, the kernel's resident mark on CPU.
    All variants share the process, so each step is its own window, opened after a reset."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start_bytes = 0

    def open(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak_rss()
            self.start_bytes = current_rss_bytes()

    def rise_bytes(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else peak_rss_bytes()
        return max(peak - self.start_bytes, 0)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages among ``tensors`` (tied weights count once)."""
    seen = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def resident_state_bytes(variant: Variant, inputs) -> int:
    """What a step starts with on the device: parameters, buffers, optimizer state, the inputs
    (gradients are None after zero_grad(set_to_none=True)). Added to the measured rise it gives a
    peak comparable with the plan's predicted_peak_bytes, which counts the same things."""
    state = [value for per_parameter in variant.optimizer.state.values() for value in per_parameter.values()]
    return _storage_bytes([*variant.model.parameters(), *variant.model.buffers(), *state, inputs])


def run_step(variant: Variant, inputs, loss_fn, device: torch.device, window: PeakWindow) -> None:
    if device.type == "cuda":
        # Kernels run asynchronously: without this, work queued by the previous variant would be
        # billed to this one, and the peak counters reset below would race with it.
        torch.cuda.synchronize(device)
    # Gradients are freed before the window opens, so the step's rise counts their allocation in
    # backward and its start matches `resident_state_bytes`.
    variant.optimizer.zero_grad(set_to_none=True)
    window.open()
    start = time.perf_counter()
    if variant.save_on_cpu:
        with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
            loss = loss_fn(variant.model(inputs))
    elif variant.autocast is not None:
        with torch.autocast(device.type, dtype=variant.autocast):
            output = variant.model(inputs)
        loss = loss_fn(output.float())      # as oomless's precision hooks hand outputs to the loss
        del output                          # the step as the others: no reference but the loss's
    else:
        loss = loss_fn(variant.model(inputs))
    if variant.scaler is not None:
        variant.scaler.scale(loss).backward()
        variant.scaler.step(variant.optimizer)
        variant.scaler.update()
    else:
        loss.backward()
        variant.optimizer.step()
    if device.type == "cuda":
        # The timer must stop when the step's kernels and copies have finished, not when they were queued.
        torch.cuda.synchronize(device)
    variant.step_seconds.append(time.perf_counter() - start)
    variant.step_rise_bytes.append(window.rise_bytes())


def build_variants(model_name: str, sizes: dict, device: torch.device, precision: str | None = None,
                   compile: bool = False):
    base, inputs, loss_fn = build_model(model_name, sizes, device)

    def fresh(name, **kwargs):
        model = copy.deepcopy(base)
        return Variant(name, model, torch.optim.Adam(model.parameters(), lr=1e-4), **kwargs)

    plain = fresh("plain")
    profile = oomless.profile(plain.model, inputs, loss_fn=loss_fn, optimizer=plain.optimizer)
    blocks = [block.name for block in profile.blocks]
    everything = 2**40

    def forced(decision):
        return oomless.plan(base, inputs, everything, loss_fn=loss_fn, profile=profile,
                            decisions={name: decision for name in blocks})

    plain.plan = make_plan(profile, everything)
    all_recompute = forced("recompute")
    minimum = smallest_memory(profile)
    variants = [plain, fresh("keep", plan=forced("keep"), applied=True)]
    for name, share in PLAN_SHARES.items():
        requested = plain.plan.static_bytes + plain.plan.reserve_bytes + \
            int(share * plain.plan.predicted_activation_peak_bytes)
        notes = [f"activation share {share}: {requested} bytes"]
        if requested < minimum:
            notes.append(f"clamped up to smallest_memory(profile) = {minimum} bytes")
        variants.append(fresh(name, notes=notes))
        variants[-1].plan = plan_or_minimum(base, inputs, loss_fn, profile, max(requested, minimum), notes)
        variants[-1].applied = True
    same_memory = max(all_recompute.predicted_peak_bytes, minimum)
    notes = [f"memory = checkpointing every block's predicted peak, {same_memory} bytes"]
    variants.append(fresh("plan_ckpt_memory", notes=notes, applied=True))
    variants[-1].plan = plan_or_minimum(base, inputs, loss_fn, profile, same_memory, notes)
    checkpointed = fresh("checkpoint", plan=all_recompute,
                         notes=["predictions are oomless's for recomputing every block"])
    left_plain = checkpoint_every_block(checkpointed.model, blocks)
    if left_plain:
        checkpointed.notes.append(f"in-place blocks not wrapped (checkpoint cannot take them): {', '.join(left_plain)}")
    variants += [checkpointed, fresh("save_on_cpu", save_on_cpu=True)]
    plan_50_memory = next(variant.plan.memory_bytes for variant in variants if variant.name == "plan_50")
    if precision is not None:
        variants += precision_variants(fresh, base, inputs, loss_fn, plan_50_memory, precision, device)
    if compile:
        variants += compiled_variants(fresh, base, inputs, loss_fn, plan_50_memory)
    for variant in variants:
        if variant.applied:
            oomless.apply(variant.model, variant.plan, optimizer=variant.optimizer)
    return variants, inputs, loss_fn, profile, minimum


def summarise(variant: Variant, plain: Variant, reference: Variant, inputs, device, link, warmup_steps: int) -> dict:
    measured, plain_measured = variant.step_seconds[warmup_steps:], plain.step_seconds[warmup_steps:]
    median, plain_median = statistics.median(measured), statistics.median(plain_measured)
    reference_measured = reference.step_seconds[warmup_steps:]
    resident = resident_state_bytes(variant, inputs)
    rise = max(variant.step_rise_bytes[warmup_steps:])
    result = {
        "median_step_seconds": median, "min_step_seconds": min(measured), "step_seconds": measured,
        "ratio_vs_plain": median / plain_median,
        # Step i of every variant ran in round i, minutes apart at most: the median of per-round
        # ratios cancels what slows a whole round (other processes on the machine).
        "paired_ratio_vs_plain": statistics.median(mine / theirs for mine, theirs in zip(measured, plain_measured)),
        "reference": reference.name, "ratio_vs_reference": median / statistics.median(reference_measured),
        "paired_ratio_vs_reference": statistics.median(mine / theirs for mine, theirs in zip(measured, reference_measured)),
        "measured_peak_bytes": resident + rise, "measured_step_rise_bytes": rise, "resident_state_bytes": resident,
        "notes": variant.notes,
    }
    if variant.plan is not None:
        plan = variant.plan
        counts = {decision: list(plan.decisions.values()).count(decision) for decision in ("keep", "swap", "recompute")}
        result.update(memory_bytes=plan.memory_bytes if variant.name.startswith("plan_") else None,
                      predicted_step_seconds=plan.predicted_step_seconds,
                      predicted_peak_bytes=plan.predicted_peak_bytes,
                      predicted_activation_peak_bytes=plan.predicted_activation_peak_bytes,
                      decision_counts=counts, decisions=plan.decisions, prefetch_bytes=plan.prefetch_bytes,
                      # The prediction's parts: where a predicted peak is off, which one is.
                      static_bytes=plan.static_bytes, reserve_bytes=plan.reserve_bytes,
                      static_breakdown=plan.static_breakdown, activation_budget=plan.activation_budget)
    if variant.applied:
        stats = asdict(oomless.stats(variant.model))
        steps = max(stats["steps"], 1)
        result["oomless_stats"] = stats
        result["offloaded_bytes_per_step"] = stats["offloaded_bytes"] // steps
        result["recomputed_blocks_per_step"] = stats["recomputed_blocks"] / steps
        result["stall_seconds_per_step"] = stats["stall_seconds"] / steps
        if link is not None and result["offloaded_bytes_per_step"] > 0:
            # A roofline-style lower bound (Williams, Waterman & Patterson, "Roofline", CACM 2009):
            # a swap step cannot beat its compute (plain's step) nor moving its bytes once each way
            # over the slower direction of the measured link.
            bandwidth = min(link.out_bytes_per_second, link.in_bytes_per_second)
            bound = max(plain_median, result["offloaded_bytes_per_step"] / bandwidth)
            result["transfer_bound_seconds"] = bound
            result["ratio_vs_transfer_bound"] = median / bound
    return result


def check_targets(results: dict, device: torch.device) -> dict:
    """The issue's targets, checked on this run's numbers (a record, not a test: timing is never asserted)."""
    targets = {"keep_within_3_percent_of_plain": results["keep"]["ratio_vs_plain"] <= 1.03,
               "planned_not_slower_than_checkpoint_at_same_memory":
                   results["plan_ckpt_memory"]["median_step_seconds"] <= results["checkpoint"]["median_step_seconds"]}
    if device.type == "cuda":
        swapping = [name for name in results if name.startswith("plan_") and "transfer_bound_seconds" in results[name]]
        targets["swap_plans_within_10_percent_of_transfer_bound"] = \
            {name: results[name]["ratio_vs_transfer_bound"] <= 1.10 for name in swapping}
        targets["swap_plans_at_least_2x_faster_than_save_on_cpu"] = \
            {name: results["save_on_cpu"]["median_step_seconds"] >= 2 * results[name]["median_step_seconds"]
             for name in swapping}
    return {**targets, **extra_targets(results)}


def bench_model(model_name: str, sizes: dict, device: torch.device, steps: int, warmup_steps: int,
                precision: str | None = None, compile: bool = False) -> dict:
    variants, inputs, loss_fn, profile, minimum = build_variants(model_name, sizes, device, precision, compile)
    for round_index in range(warmup_steps + steps):
        start = round_index % len(variants)
        for variant in variants[start:] + variants[:start]:
            run_step(variant, inputs, loss_fn, device, PeakWindow(device))
    link = measure_link(str(device)) if device.type == "cuda" else None
    by_name = {variant.name: variant for variant in variants}
    results = {variant.name: summarise(variant, variants[0], by_name[variant.reference], inputs, device, link,
                                       warmup_steps) for variant in variants}
    for variant in variants:
        if variant.applied:
            oomless.remove(variant.model)
    # The profile itself (per block: saved bytes, working memory, times): predictions on a machine
    # can then be checked against what was measured there, after the run, without it.
    return {"sizes": sizes, "blocks": len(profile.blocks), "smallest_memory_bytes": minimum,
            "profile": json.loads(profile.to_json()),
            "link": asdict(link) if link is not None else asdict(profile.link),
            "variants": results, "targets": check_targets(results, device)}


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from oomless.sizes import format_bytes

    def maybe(value, render):
        return "-" if value is None else render(value)

    source = report["provenance"]
    table = Table(title=f"oomless bench fit: {source['device_name']}, torch {source['torch_version']}, "
                        f"{source['threads']} threads, commit {source['git_commit'][:10]}")
    for column in ("model", "variant", "memory", "median ms", "vs plain", "paired", "vs ref", "pred ms", "peak", "pred peak",
                   "k/s/r", "offloaded/step", "recomputed/step", "vs bound"):
        table.add_column(column, justify="left" if column in ("model", "variant", "k/s/r") else "right")
    for model_name, model_report in report["models"].items():
        for name, result in model_report["variants"].items():
            counts = result.get("decision_counts")
            table.add_row(
                model_name, name, maybe(result.get("memory_bytes"), format_bytes),
                f"{result['median_step_seconds'] * 1e3:.1f}", f"{result['ratio_vs_plain']:.3f}", f"{result['paired_ratio_vs_plain']:.3f}",
                f"{result['paired_ratio_vs_reference']:.3f}",
                maybe(result.get("predicted_step_seconds"), lambda v: f"{v * 1e3:.1f}"),
                format_bytes(result["measured_peak_bytes"]), maybe(result.get("predicted_peak_bytes"), format_bytes),
                maybe(counts, lambda c: f"{c['keep']}/{c['swap']}/{c['recompute']}"),
                maybe(result.get("offloaded_bytes_per_step"), format_bytes),
                maybe(result.get("recomputed_blocks_per_step"), lambda v: f"{v:.1f}"),
                maybe(result.get("ratio_vs_transfer_bound"), lambda v: f"{v:.2f}"))
        table.add_section()
    console = Console()
    if not console.is_terminal:
        console.width = 160     # redirected to a file: rich would fold the table to 80 columns
    console.print(table)
    for model_name, model_report in report["models"].items():
        console.print(f"{model_name} targets: {json.dumps(model_report['targets'])}")
        for name, result in model_report["variants"].items():
            for note in result["notes"]:
                console.print(f"  {model_name} {name}: {note}")


def resolve_device(text: str) -> torch.device:
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise InputError(f"--device {text!r}: the benchmark runs on cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: CUDA is not available in this PyTorch build or machine")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device {text!r}: the benchmark runs on cpu or cuda")
    return device


def run(args: argparse.Namespace, command: str) -> dict:
    device = resolve_device(args.device)
    out = result_path(args.out, f"fit-{device.type}")
    threads_before = torch.get_num_threads()
    if args.threads is not None:
        if args.threads < 1:
            raise InputError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        return _run(args, command, device, out)
    finally:
        torch.set_num_threads(threads_before)   # called in-process (tests), leave the process as it was


def _run(args: argparse.Namespace, command: str, device: torch.device, out: Path) -> dict:
    if device.type == "cpu":
        # Otherwise glibc keeps freed activations in its heap and resident memory never falls.
        return_freed_memory_to_the_system()
    sizes = SIZES["quick" if args.quick else device.type]
    steps = args.steps if args.steps is not None else (2 if args.quick else 7 if device.type == "cpu" else 10)
    warmup_steps = args.warmup if args.warmup is not None else (1 if args.quick else 2 if device.type == "cpu" else 3)
    if steps < 1 or warmup_steps < 0:
        raise InputError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup_steps}")
    names = ("transformer", "unet3d") if args.model == "all" else (args.model,)
    report = {"provenance": provenance(device, command), "steps": steps, "warmup_steps": warmup_steps,
              "quick": args.quick, "precision": getattr(args, "precision", None),
              "compile": getattr(args, "compile", False), "models": {}}
    for name in names:
        report["models"][name] = bench_model(name, sizes[name], device, steps, warmup_steps,
                                             getattr(args, "precision", None), getattr(args, "compile", False))
    write_result(out, report)
    print_table(report)
    report["path"] = str(out)
    return report


def main(argv: list[str] | None = None) -> int:
    from oomless.cli.bench import add_arguments   # the flags `oomless bench` takes, in one place

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv])
    run(args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
