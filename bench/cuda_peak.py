"""Where a planned step's CUDA peak comes from: the memory live at the allocator's peak, grouped by
the line of oomless, the model or torch that allocated it.

    python bench/cuda_peak.py --model unet3d --decisions swap --out /tmp/peak.json

Builds tests/test_cuda.py's large model (``unet3d``: UNet3D(8, 3) on 2 x 96^3; ``transformer``: 6 x
256 over 8 x 1024 tokens), plans it with every block given ``--decisions`` (or planned, ``planned``)
at ``--memory`` (default: what that plan predicts for itself without a budget; ``--share``: a share
of plain's measured peak, as tests/test_cuda.py's 75 % case), trains one step,
then records the allocator's history (``torch.cuda.memory._record_memory_history``) over a second
step. Replaying that history finds the moment of the peak; the blocks live then are summed by the
first frame in oomless's, the bench's or the tests' files (else the innermost frame). Also written:
the plan's numbers and oomless's stats, so the peak can be read against the ledger.
"""

import argparse
import copy
import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import oomless  # noqa: I001  (before torch, as the `oomless` command)

import torch
import torch.nn.functional as F

from oomless.plan.planner import smallest_memory, smallest_memory_for

BENCH_DIRECTORY = Path(__file__).resolve().parent
if str(BENCH_DIRECTORY) not in sys.path:
    sys.path.insert(0, str(BENCH_DIRECTORY))
from common import provenance, write_result  # noqa: E402  (bench/common.py)

OWN_FILES = ("/oomless/", "/bench/", "/tests/")


def _model(name: str, device: torch.device):
    from oomless.models import TinyTransformer, UNet3D

    if name in ("unet3d", "unet3d-128"):
        # unet3d-128: bench_floors' U-Net, whose step at checkpointing's memory measured 6 % over
        # its plan on an H200 (2026-11-29) where the 96^3 one kept its budget.
        base_channels, side = (16, 128) if name == "unet3d-128" else (8, 96)
        model = UNet3D(base_channels=base_channels, depth=3).to(device)
        volume = torch.randn(2, 1, side, side, side, device=device)
        target = (volume[:, 0] > 0.5).long()
        return model, volume, lambda out: F.cross_entropy(out, target)
    model = TinyTransformer(vocab_size=512, dim=256, depth=6, heads=8, max_len=1024, dropout=0.1).to(device)
    tokens = torch.randint(0, 512, (8, 1024), device=device)
    return model, tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten())


def _where(frames: list[dict]) -> str:
    """The first frame (innermost first) in oomless's, the bench's or the tests' files, else the innermost."""
    for frame in frames:
        if any(part in frame["filename"] for part in OWN_FILES):
            return f"{frame['filename'].split('/src/')[-1]}:{frame['line']} {frame['name']}"
    if frames:
        return f"{frames[0]['filename'].split('site-packages/')[-1]}:{frames[0]['line']} {frames[0]['name']}"
    return "(no Python frame: autograd's engine or a C++ caller)"


def peak_from_history(trace: list[dict]) -> dict:
    """Replay one device's allocator events: the allocated total's maximum and what was live then."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        groups[where][0] += size
        groups[where][1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {"peak_above_history_start_bytes": peak,
            "live_at_peak": [{"where": where, "bytes": size, "blocks": count} for where, (size, count) in ranked[:40]]}


@contextmanager
def allocation_history():
    """The allocator's history recorded inside, with the Python stack of each allocation only
    (``context="alloc"``): `peak_from_history` reads no other event's stack.

    Stacks at frees too (torch's default, ``context="all"``) made every backward that recomputes a
    block fail on CUDA with "run_backward ... returned NULL without setting an exception" (H200,
    torch 2.11, Python 3.12: over `oomless.profile`'s timing step on 2026-11-27, over the recorded
    planned step on 2026-11-29; steps without recompute, and recomputed steps without the history,
    ran). torch's checkpoint ends each recomputation early by raising `_StopRecomputationError`
    from its pack hook, inside backward on autograd's device thread; the tensors freed while that
    exception unwinds are recorded, and gathering their stack there reads the running backward
    node's forward traceback (combined_traceback.cpp, `gatherForwardTraceback`), whose dict lookup
    on Python < 3.13 takes the pending exception for its own failure and clears it
    (the failure of pytorch/pytorch#179536, history with non-reentrant checkpoint, new in 2.11;
    later torch saves and restores the exception there). Nothing allocates while that exception
    unwinds (only frees), so stacks taken at allocations should never meet it; checked by reading
    torch's code, not yet on a GPU."""
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=500_000)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _sizing_step_history(model, inputs, loss_fn, profile, device) -> dict:
    """The profiler's sizing step once more (every block swapped, no budget), the allocator's history
    recorded over it alone: what is live at its peak, by line, beside what that step's recorder
    counted beyond the ledger per block."""
    from oomless.profile.profiler import _measure_step

    modules = dict(model.named_modules())
    found = [(block.name, modules[block.name]) for block in profile.blocks]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    try:
        with allocation_history():
            recorder, _ = _measure_step(model, inputs, loss_fn, found, device, base_bytes=base)
            torch.cuda.synchronize(device)
            history = torch.cuda.memory._snapshot()
    finally:
        for parameter in model.parameters():
            parameter.grad = None
    found_peak = peak_from_history(history["device_traces"][device.index])
    print(f"profiling's sizing step: peak {found_peak['peak_above_history_start_bytes'] / 2**20:.0f} MiB above "
          "its start; live then:")
    for row in found_peak["live_at_peak"][:15]:
        print(f"  {row['bytes'] / 2**20:8.1f} MiB {row['blocks']:5d}  {row['where']}")
    return {**found_peak, "blocks": [{"name": block.name, "forward_other_bytes": block.forward_other_bytes,
                                      "backward_other_bytes": block.backward_other_bytes,
                                      "forward_peak_bytes": block.forward_peak_bytes}
                                     for block in recorder.blocks.values()]}


def _plain_peak_bytes(model, inputs, loss_fn, device) -> int:
    """Two plain steps of a copy of ``model`` with Adam: their allocator peak above what was there."""
    plain = copy.deepcopy(model)
    optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(plain(inputs)).backward()
        optimizer.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del plain, optimizer
    torch.cuda.empty_cache()
    return peak


def _watch_the_ledger(model, device) -> tuple[dict, dict]:
    """Where the runtime's ledger is at its highest in the next step: the block and phase running,
    the limit the runtime held it to there, and what it could not take off (copies still running,
    storages copied out that the forward still references). And per phase (forward or backward, at
    a place: `SavedTensorEngine.position_of`), the ledger's highest, the allocator's peak (read and
    reset at each change of the ledger: the peak of the interval goes to the phase it ran in) and
    the limit: the plan's working memory of a phase is its activation budget less that limit. Filled
    in as the step runs."""
    from oomless.runtime.install import installed_state
    from oomless.runtime.saved_entries import ForwardRegistry

    engine = installed_state(model).engine
    highest = {"bytes": -1}
    phases: dict = {}

    def where() -> tuple[str, int | None]:
        registry = engine.registry
        backward = registry is not None and registry.backward_started
        if backward:
            return "backward", registry.backward_block
        if engine.block_index is None:      # between blocks: with the block that ran last
            return "forward", None if engine.forward_position < 0 else engine.forward_position
        return "forward", engine.position_of(engine.block_index)

    def limit_of(phase: str, block: int | None) -> int | None:
        if block is None:
            return engine.budget_bytes
        return engine.backward_limit(block, block) if phase == "backward" else engine.forward_limit(block)

    def read(resident_bytes: int) -> None:
        """The allocator's peak since the last reading goes to the phase running until now."""
        phase, block = where()
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        row = phases.setdefault((phase, block), {"phase": phase, "place": block, "ledger_max": 0,
                                                 "allocated_peak": 0, "limit": limit_of(phase, block)})
        row["ledger_max"] = max(row["ledger_max"], resident_bytes)
        row["allocated_peak"] = max(row["allocated_peak"], peak)

    # A phase also ends where backward or the forward moves to another block, with or without a
    # change of the ledger (a block whose saves are all entries already made, a convolution after
    # an in-place ReLU): read there too, or its peak goes to the next phase that changes the ledger.
    block_entered = engine.block_entered

    def entering(block_index: int) -> None:
        if engine.registry is not None and not engine.registry.backward_started:
            read(engine.ledger.resident_activation_bytes)
        block_entered(block_index)
    engine.block_entered = entering
    reached = ForwardRegistry.reached

    def reaching(registry, position: int) -> None:
        if registry.backward_started and position < registry.backward_block:
            read(engine.ledger.resident_activation_bytes)
        reached(registry, position)
    ForwardRegistry.reached = reaching

    def observe(resident_bytes: int, change: int) -> None:    # told before each change: the value until now
        read(resident_bytes)
        if resident_bytes <= highest["bytes"]:
            return
        phase, block = where()
        highest.update(bytes=resident_bytes, phase=phase, block=block, limit=limit_of(phase, block),
                       copies_running=len(engine.pending_out),
                       copied_alive_bytes=sum(entry.num_bytes for entry in engine.copied_alive))
    engine.ledger.observer = observe
    return highest, phases


def _phase_rows(phases: dict, plan, before: int) -> list[dict]:
    """Per phase, in the step's order: measured against the plan's working memory for it."""
    names = list(plan.decisions)
    rows = []
    for row in phases.values():
        place = row["place"]
        limit = row["limit"]
        measured_beyond = row["allocated_peak"] - before - row["ledger_max"]
        rows.append({**row, "block": names[place] if place is not None and place < len(names) else None,
                     "allocated_peak_above_before": row["allocated_peak"] - before,
                     "measured_beyond_ledger": measured_beyond,
                     "planned_working": None if limit is None else plan.activation_budget - limit})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("unet3d", "unet3d-128", "transformer"), default="unet3d")
    parser.add_argument("--decisions", choices=("swap", "recompute", "keep", "planned"), default="swap")
    parser.add_argument("--memory", default=None,
                        help="the budget (default: the plan's own prediction; smallest: the smallest that "
                             "--decisions fit)")
    parser.add_argument("--share", type=float, default=None,
                        help="the budget as this share of plain PyTorch's measured peak, or the smallest budget "
                             "if that is more (tests/test_cuda.py's test_step_on_cuda_peaks_within_memory...)")
    parser.add_argument("--profile-history", action="store_true",
                        help="also run the profiler's sizing step once more with the allocator's history: what is "
                             "live at its peak")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the allocator's history is CUDA's")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model, inputs, loss_fn = _model(args.model, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    plain_peak = _plain_peak_bytes(model, inputs, loss_fn, device) if args.share is not None else None
    torch.cuda.synchronize(device)
    profiling_before = torch.cuda.memory_allocated(device)
    profile = oomless.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer)
    torch.cuda.synchronize(device)
    profiling = {"allocated_before_bytes": profiling_before, "measured_peak_bytes": profile.measured_peak_bytes,
                 "blocks": [{"name": block.name, "saved_bytes": block.saved_bytes,
                             "forward_other_bytes": block.forward_other_bytes,
                             "backward_other_bytes": block.backward_other_bytes,
                             "forward_peak_bytes": block.forward_peak_bytes,
                             "backward_peak_bytes": block.backward_peak_bytes} for block in profile.blocks]}
    if args.profile_history:
        profiling["sizing_step"] = _sizing_step_history(model, inputs, loss_fn, profile, device)
    decisions = None if args.decisions == "planned" else {block.name: args.decisions for block in profile.blocks}
    if args.memory == "smallest":
        args.memory = smallest_memory_for(profile, decisions, min_swap_bytes=0)
    if args.share is not None:
        args.memory = max(int(args.share * plain_peak), smallest_memory(profile, min_swap_bytes=0))
    memory = args.memory or oomless.plan(model, inputs, 2**40, decisions=decisions, profile=profile,
                                         min_swap_bytes=0).predicted_peak_bytes
    plan = oomless.plan(model, inputs, memory, decisions=decisions, profile=profile, min_swap_bytes=0)
    oomless.apply(model, plan)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        optimizer.step()

    step()
    torch.cuda.synchronize(device)
    ledger_peak, phases = _watch_the_ledger(model, device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with allocation_history():
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    phase_rows = _phase_rows(phases, plan, before)
    stats = oomless.stats(model)
    found = peak_from_history(snapshot["device_traces"][device.index])
    mib = 2**20
    result = {"model": args.model, "decisions": args.decisions, "share": args.share, "plain_peak_bytes": plain_peak,
              "plan": {"memory_bytes": plan.memory_bytes, "static_bytes": plan.static_bytes,
                       "reserve_bytes": plan.reserve_bytes, "activation_budget": plan.activation_budget,
                       "predicted_peak_bytes": plan.predicted_peak_bytes, "prefetch_bytes": plan.prefetch_bytes,
                       "decisions": dict(plan.decisions)},
              "allocated_before_step_bytes": before,
              # The phases' readings reset the allocator's peak: the step's is the highest of them.
              "max_allocated_in_step_bytes": max([torch.cuda.max_memory_allocated(device)]
                                                 + [row["allocated_peak"] for row in phase_rows]),
              "stats": {"peak_activation_bytes": stats.peak_activation_bytes,
                        "offloaded_bytes": stats.offloaded_bytes, "stall_seconds": stats.stall_seconds},
              "ledger_peak_context": ledger_peak, "phases": phase_rows, "profiling": profiling,
              **found, "provenance": provenance(device)}
    print(f"{args.model} {args.decisions}: memory {plan.memory_bytes / mib:.0f} MiB, max allocated "
          f"{result['max_allocated_in_step_bytes'] / mib:.0f} MiB (before the step {before / mib:.0f}), ledger peak "
          f"{stats.peak_activation_bytes / mib:.0f} of {plan.activation_budget / mib:.0f} MiB")
    print(f"  ledger at its highest: {ledger_peak}")
    for row in found["live_at_peak"][:15]:
        print(f"  {row['bytes'] / mib:8.1f} MiB {row['blocks']:5d}  {row['where']}")
    print("  phase     place block                     ledger  limit  allocated  beyond  planned working (MiB)")
    for row in phase_rows:
        limit = "-" if row["limit"] is None else f"{row['limit'] / mib:6.0f}"
        working = "-" if row["planned_working"] is None else f"{row['planned_working'] / mib:6.0f}"
        print(f"  {row['phase']:9} {str(row['place']):5} {str(row['block']):25} {row['ledger_max'] / mib:6.0f} {limit:>6} "
              f"{row['allocated_peak_above_before'] / mib:9.0f} {row['measured_beyond_ledger'] / mib:7.0f} {working:>8}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
