"""What `oomless simulate` returns: every layout's prediction and the recommended one, as plain
data that prints as a table, saves as JSON and draws its step timeline.

    simulation = oomless.simulate(model, tokens, global_batch=512, target="h100", gpus=64, nodes=8)
    print(simulation)                       # one row per layout, the recommended one marked *
    simulation.recommended                  # its name, e.g. "fsdp x64"; None when no layout fits
    simulation.to_json()
    simulation.plot("timeline.png")         # compute and communication streams (or pipeline ranks)
"""

import io
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from oomless.errors import InputError
from oomless.plan.layouts import LayoutEstimate, Span
from oomless.plan.schedules import rank_actions, simulate_actions
from oomless.sizes import format_bytes


@dataclass
class Simulation:
    model: str
    cluster: dict
    cluster_summary: str
    global_batch: int
    profiled_batch: int
    layouts: list[LayoutEstimate]
    recommended: str | None
    tokens_per_sample: int | None = None
    notes: list[str] = field(default_factory=list)
    elapsed_seconds: float = 0.0
    loss: str | None = None          # the loss planned, where named (`oomless simulate --loss`)
    # A sample's forward and backward operations as traced on meta tensors (`Profile.flops`; no
    # recompute), and one GPU's peak FLOP/s over them, each op at its dtype's
    # (`Profile.peak_flops_per_second`): each layout's model FLOPs utilisation. None where the
    # profile was measured, not traced.
    flops_per_sample: float | None = None
    peak_flops_per_second: float | None = None
    # The `oomless train` command running the recommended layout, where that trainer trains the
    # model (`oomless simulate` sets it: `cli.train_command`).
    train_command: str | None = None

    def layout(self, name: str) -> LayoutEstimate:
        for estimate in self.layouts:
            if estimate.name == name:
                return estimate
        raise InputError(f"no layout {name!r}; the simulation has {', '.join(e.name for e in self.layouts)}")

    @property
    def best(self) -> LayoutEstimate | None:
        return None if self.recommended is None else self.layout(self.recommended)

    def throughput(self, estimate: LayoutEstimate) -> float:
        """Samples per second of ``estimate`` (0 where it does not fit)."""
        if not estimate.fits or not math.isfinite(estimate.step_seconds) or estimate.step_seconds <= 0:
            return 0.0
        return self.global_batch / estimate.step_seconds

    def model_flops_utilisation(self, estimate: LayoutEstimate) -> float | None:
        """The share of the GPUs' peak FLOP/s that ``estimate``'s step spends on the model's own
        operations (recomputed forwards not counted, as MFU is usually defined); None where the
        FLOPs are not known or the layout does not fit."""
        if self.flops_per_sample is None or not self.peak_flops_per_second or self.throughput(estimate) == 0:
            return None
        return self.flops_per_sample * self.throughput(estimate) / (self.cluster["gpus"] * self.peak_flops_per_second)

    def to_dict(self) -> dict:
        layouts = []
        for estimate in self.layouts:
            entry = {f.name: getattr(estimate, f.name) for f in fields(estimate)
                     if f.name not in ("timeline", "partition")}
            if not math.isfinite(entry["step_seconds"]):
                entry["step_seconds"] = None
            entry["name"] = estimate.name
            entry["samples_per_second"] = self.throughput(estimate)
            if self.tokens_per_sample:
                entry["tokens_per_second"] = entry["samples_per_second"] * self.tokens_per_sample
            entry["model_flops_utilisation"] = self.model_flops_utilisation(estimate)
            layouts.append(entry)
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["layouts"] = layouts
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        rate = "tokens/s" if self.tokens_per_sample else "samples/s"
        loss = f", loss {self.loss}" if self.loss else ""
        table = Table(title=f"oomless simulate: {self.model}{loss}, global batch {self.global_batch}")
        for column in ("", "layout", "micro-batches", "memory plan", "memory / rank", "fits", "step",
                       "comm. exposed", rate, "MFU", "note"):
            table.add_column(column, justify="left" if column in ("layout", "memory plan", "note") else "right",
                             no_wrap=column != "note")
        for estimate in self.layouts:
            throughput = self.throughput(estimate) * (self.tokens_per_sample or 1)
            step = _seconds(estimate.step_seconds) if estimate.fits else "-"
            note = estimate.notes[0] if estimate.notes else ""
            table.add_row("*" if estimate.name == self.recommended else "", estimate.name,
                          str(estimate.microbatches) if estimate.microbatches else "-", estimate.memory_plan,
                          format_bytes(estimate.memory_per_rank_bytes), "yes" if estimate.fits else "no", step,
                          _seconds(estimate.exposed_communication_seconds) if estimate.fits else "-",
                          f"{throughput:,.0f}" if estimate.fits else "-", _share(self.model_flops_utilisation(estimate)),
                          note)
        buffer = io.StringIO()
        Console(file=buffer, width=180, force_terminal=False, color_system=None).print(table)
        best = self.best
        if best is None:
            least = min(self.layouts, key=lambda estimate: estimate.memory_per_rank_bytes)
            verdict = (f"no layout fits {format_bytes(self.cluster['device_memory_bytes'])} per GPU; the least memory "
                       f"per rank is {least.name}'s {format_bytes(least.memory_per_rank_bytes)}: more GPUs, a smaller "
                       "batch or a larger device")
        else:
            verdict = (f"recommended: {best.name} (*), step {_seconds(best.step_seconds)}, "
                       f"{self.throughput(best) * (self.tokens_per_sample or 1):,.0f} {rate}, "
                       f"{format_bytes(best.memory_per_rank_bytes)} per rank, memory plan: {best.memory_plan}"
                       + ("" if (mfu := self.model_flops_utilisation(best)) is None
                          else f", model FLOPs utilisation {_share(mfu)}"))
        lines = [f"cluster: {self.cluster_summary}", verdict]
        if self.train_command:
            lines.append(f"run it: {self.train_command}")
        lines += [f"note: {note}" for note in self.notes]
        lines.append(f"simulated in {self.elapsed_seconds:.1f} s")
        return buffer.getvalue() + "\n".join(lines)

    def plot(self, path: str, name: str | None = None) -> str:
        """Draw the step timeline of layout ``name`` (default: the recommended one) into ``path``."""
        estimate = self.layout(name) if name else self.best
        if estimate is None:
            raise InputError("no layout fits, so there is no recommended step to draw; name one with name=...")
        return plot_timeline(estimate, path)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def pipeline_spans(estimate: LayoutEstimate) -> list[Span]:
    """Each pipeline rank's forward and backward actions in torch's order, as soon as their inputs
    exist (the partition's stage seconds, its forward fraction; `plan.schedules.simulate_actions`)."""
    partition = estimate.partition
    ranks, per_rank, microbatches = partition.ranks, partition.stages_per_rank, partition.microbatches
    orders = [rank_actions(partition.schedule, rank, ranks, per_rank, microbatches) for rank in range(ranks)]

    def seconds(stage: int, kind: str) -> float:
        total = partition.stage_seconds[stage] + partition.overhead_seconds
        forward = total * partition.forward_fraction
        split = (total - forward) * partition.split_backward_ratio      # the input and weight passes together
        return {"F": forward, "B": total - forward}.get(kind, split / 2)

    spans = []

    def record(rank: int, kind: str, start: float, end: float) -> None:
        spans.append(Span(f"rank {rank}", kind, start, end))

    simulate_actions(orders, seconds, record)
    return spans


_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green", "loss": "tab:purple",
            "optimizer step": "tab:gray", "all-gather": "tab:cyan", "reduce-scatter": "tab:red",
            "all-reduce": "tab:red"}


def _colour(label: str) -> str:
    for key in ("all-gather", "reduce-scatter", "all-reduce", "optimizer step", "loss"):
        if label.startswith(key):
            return _COLOURS[key]
    return _COLOURS.get(label.split(" ")[0], "tab:blue")


def plot_timeline(estimate: LayoutEstimate, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")   # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError('--plot needs matplotlib, which is not installed: pip install "oomless[plot]"') from None
    spans = pipeline_spans(estimate) if estimate.partition is not None else estimate.timeline
    streams = list(dict.fromkeys(span.stream for span in spans))
    if len(streams) > 64:
        raise InputError(f"{estimate.name} has {len(streams)} ranks: too many rows to draw")
    figure, axes = plt.subplots(figsize=(10, 1.2 + 0.35 * len(streams)))
    for row, stream in enumerate(streams):
        mine = [span for span in spans if span.stream == stream]
        axes.broken_barh([(span.start_seconds, span.end_seconds - span.start_seconds) for span in mine],
                         (row - 0.4, 0.8), facecolors=[_colour(span.label) for span in mine], linewidth=0)
    axes.set_yticks(range(len(streams)), streams, fontsize=7 if len(streams) > 16 else 9)
    axes.invert_yaxis()
    axes.set_xlabel("seconds in one step")
    kinds = "F forward, B backward, I input gradients, W weight gradients" if estimate.partition is not None \
        else "blue forward, orange backward, cyan all-gather, red all-reduce / reduce-scatter"
    axes.set_title(f"{estimate.name}: predicted step {_seconds(estimate.step_seconds)} "
                   f"({estimate.memory_plan}; {kinds})", fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)     # as `output_paths.check_output_path` promises
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
