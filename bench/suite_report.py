"""The numbers to read first from each piece of bench/gpu_suite.py, and its Markdown summary.

Each extractor reads the JSON its piece wrote and returns a small dict; one that cannot read a
file says so in the dict instead of failing the suite (a piece's format may change before this does).
"""

import json
from pathlib import Path

# What each result is held against (issue 10's targets; bench/README.md's for the step-time benchmark).
TARGETS = {
    "cuda_tests": "every test passes: equality with plain PyTorch, torch.cuda.max_memory_allocated <= budget, "
                  "the ledger's peak <= the activation budget, no host synchronisation in a planned step",
    "swap_trace": "host_copy_overlap_fraction near 1 (copies hidden behind kernels), copies on streams of their "
                  "own (copies_share_a_stream_with_kernels false), pageable_copy_count 0, stall_seconds near 0",
    "fit_bench": "keep within 3 % of plain (paired ratio <= 1.03); swap plans within 10 % of max(compute, bytes / "
                 "bandwidth) and at least 2x faster than save_on_cpu; peak_over_budget <= 1",
    "predict": "predicted against measured within 10 % for step time and peak activations (|error| <= 0.10)",
    "max_size": "oomless trains a model larger than plain PyTorch can within the same memory",
    "cuda_peak": "what is live at the allocator's peak of the U-Net planned at 75 % of plain's peak: max "
                 "allocated within the plan's memory; its rows say which line holds the bytes where it is not",
    "cuda_peak_large": "the same for bench_floors' U-Net (128^3, base 16) at checkpointing's share of plain: max "
                       "allocated within the plan's memory; per phase, the allocator's peak beyond the ledger",
    "cuda_peak_transformer": "the transformer, every block recomputed at the smallest budget that fits: max "
                             "allocated within the plan's memory; per phase, the allocator's peak beyond the ledger "
                             "against the plan's working memory; what is live at the profiler's sizing step's peak",
    "dp_world_1": "overlapped within noise of plain_ddp at world size 1 (nothing to hide)",
    "dp_world_2": "overlapped faster than plain_ddp; exposed communication after backward near 0",
    "simulate_world_1": "dp x1 and fsdp x1: predicted / measured step within 0.85-1.15 and peak within 0.90-1.10, "
                        "from the datasheet (nothing measured) and calibrated (this GPU's profile) (issue 14, item 4)",
    "linear_loss": "the fused head and loss's peak a small share of plain's (no logits whole); step time against "
                   "plain's at each chunk size, the default's within 10 % on the CPU machine (issue 15, item 2)",
    "floors": "oomless accepts checkpointing's and save_on_cpu's peak memory and trains within each, no slower "
              "than they are (step ratios <= 1), and names a smallest budget below both (issue 15, item 5)",
    "fit_precision": "keep_bf16 and keep_compiled within 3 % of their references (plain_bf16, plain_compiled); "
                     "plan_50_bf16's activation peak about half the fp32 plan_50's (issue 11)",
}


def _read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def _cuda_tests(out: Path) -> dict:
    result = _read(out, "cuda-tests.json")
    printed = [line.strip() for test in result["tests"] for line in test.get("output", "").splitlines() if line.strip()]
    return {"counts": result["counts"],
            "not_passed": [f"{test['nodeid'].split('::')[-1]}: {test['outcome']}" for test in result["tests"]
                           if test["outcome"] in ("failed", "error")],
            "printed": printed[:20]}


def _floors(out: Path) -> dict:
    result = _read(out, "floors.json")
    found = {}
    for model, report in result["models"].items():
        if "skipped" in report or "failed" in report:
            found[model] = report.get("skipped") or "failed: " + report["failed"].strip().splitlines()[-1][:200]
            continue
        found[model] = {"peak_MiB": {mode: round(run["steps_peak_bytes"] / 2**20, 1) for mode, run in report["runs"].items()
                                     if "steps_peak_bytes" in run},
                        "smallest_budget_MiB": round((report["smallest_budget_bytes"] or 0) / 2**20, 1),
                        "guarantee": report["guarantee"],
                        "step_vs_checkpoint": {name: None if ratio is None else round(ratio, 3)
                                               for name, ratio in report["step_vs_checkpoint"].items()}}
        if "step_vs_save_on_cpu" in report:
            found[model]["step_vs_save_on_cpu"] = round(report["step_vs_save_on_cpu"], 3)
    return found


def _fit_bench(out: Path, file: str = "fit.json", ratio: str = "paired_ratio_vs_plain") -> dict:
    result = _read(out, file)
    found = {}
    for model, report in result["models"].items():
        variants = report["variants"]
        found[model] = {name: round(variant[ratio], 3) for name, variant in variants.items() if name != "plain"}
        found[model]["peak_over_budget"] = {name: round(variant["measured_peak_bytes"] / variant["memory_bytes"], 3)
                                            for name, variant in variants.items() if variant.get("memory_bytes")}
        found[model]["targets"] = report.get("targets")
    return found


def _predict(out: Path) -> dict:
    result = _read(out, "predict.json")
    rows = {f"{row['model']} {row['share']}": {key: round(value, 3) for key, value in row["error"].items()
                                               if value is not None}
            for row in result["rows"] if isinstance(row.get("error"), dict)}
    return {"max_abs_error": result.get("max_abs_error"), "error_by_row": rows}


def _dp(name: str):
    def extract(out: Path) -> dict:
        summary = _read(out, name)["summary"]
        return {variant: {"median_step_ms": round(1e3 * values["median_step_seconds_slowest_rank"], 3),
                          "paired_ratio_vs_plain_ddp": round(values["paired_ratio_vs_plain_ddp"], 3)}
                for variant, values in summary.items()}
    return extract


def _simulate(out: Path) -> dict:
    rows = _read(out, "simulate-world-1.json")["rows"]
    return {row["layout"]: {kind: {name: round(value, 3) for name, value in ratio.items()}
                            for kind, ratio in row["ratio"].items()} for row in rows}


def _swap_trace(out: Path) -> dict:
    result = _read(out, "swap-trace.json")
    trace = result["trace"]
    return {"host_copy_overlap_fraction": trace["host_copy_overlap_fraction"],
            "exposed_copy_seconds": {direction: round(entry["exposed_seconds"], 6)
                                     for direction, entry in trace["directions"].items()},
            "copies_share_a_stream_with_kernels": trace["copies_share_a_stream_with_kernels"],
            "pageable_copy_count": trace["pageable_copy_count"], "kernel_count": trace["kernel_count"],
            "stall_seconds": result["stall_seconds"], "offloaded_bytes": result["offloaded_bytes"],
            "dedicated_copy_streams": result["dedicated_copy_streams"]}


def _max_size(out: Path, files: list[str]) -> dict:
    found = {}
    for name in files:
        result = _read(out, name)
        found[name] = {"memory": result["memory"],
                       **{method: {"largest_side": outcome["largest_side"],
                                   "sides_tried": {trial["side"]: trial["fits"] for trial in outcome["trials"]},
                                   **({"crashed": [trial["error"] for trial in outcome["trials"] if trial.get("crashed")]}
                                      if any(trial.get("crashed") for trial in outcome["trials"]) else {})}
                          for method, outcome in result["methods"].items()}}
    return found


def _cuda_peak(out: Path, name: str = "cuda-peak.json") -> dict:
    result = _read(out, name)
    mib = 2**20
    sizing = result.get("profiling", {}).get("sizing_step")
    return {**({"sizing_step_live_at_peak_MiB": {row["where"]: round(row["bytes"] / mib, 1)
                                                 for row in sizing["live_at_peak"][:6]}} if sizing else {}),"memory_MiB": round(result["plan"]["memory_bytes"] / mib, 1),
            "max_allocated_MiB": round(result["max_allocated_in_step_bytes"] / mib, 1),
            "ledger_peak_MiB": round(result["stats"]["peak_activation_bytes"] / mib, 1),
            "activation_budget_MiB": round(result["plan"]["activation_budget"] / mib, 1),
            "ledger_peak_context": result.get("ledger_peak_context"),
            "live_at_peak_MiB": {row["where"]: round(row["bytes"] / mib, 1) for row in result["live_at_peak"][:6]}}


def _linear_loss(out: Path) -> dict:
    result = _read(out, "linear-loss.json")
    return {row["method"] if row["method"] == "plain" else f"fused, chunk rows {row['chunk_rows'] or 'default'}":
            {"peak_MiB": round(row["peak_rise_bytes"] / 2**20, 1), "median_step_ms": round(1e3 * row["median_step_seconds"], 2),
             **({"peak_vs_plain": round(row["peak_vs_plain"], 3), "time_vs_plain": round(row["time_vs_plain"], 3)}
                if "peak_vs_plain" in row else {})}
            for row in result["results"] if "error" not in row}


def highlights(record: dict, out: Path) -> dict:
    """The numbers to read first from ``record``'s piece (empty when it wrote nothing)."""
    if not record["files"]:
        return {}
    extractors = {"cuda_tests": _cuda_tests, "fit_bench": _fit_bench, "predict": _predict,
                  "dp_world_1": _dp("dp-world-1.json"), "dp_world_2": _dp("dp-world-2.json"),
                  "swap_trace": _swap_trace, "simulate_world_1": _simulate, "linear_loss": _linear_loss, "cuda_peak": _cuda_peak,
                  "cuda_peak_large": lambda out: _cuda_peak(out, "cuda-peak-large.json"),
                  "cuda_peak_transformer": lambda out: _cuda_peak(out, "cuda-peak-transformer.json"), "floors": _floors,
                  # Each precision or compiled variant against its own reference (plain_bf16, plain_compiled).
                  "fit_precision": lambda out: _fit_bench(out, "fit-precision.json", "paired_ratio_vs_reference")}
    try:
        if record["name"] == "max_size":
            return _max_size(out, record["files"])
        return extractors[record["name"]](out)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OSError) as error:
        return {"unreadable": f"{type(error).__name__}: {error}"}


def _compact(value) -> str:
    text = json.dumps(value, separators=(", ", ": "))
    return text.replace("|", "\\|")


def write_summary(path: Path, suite: dict) -> None:
    provenance = suite["provenance"]
    dirty = " (uncommitted changes)" if provenance.get("git_dirty") else ""
    lines = [f"# oomless GPU suite: {provenance['device_name']}", ""]
    if suite["dry_run"]:
        lines += ["**Dry run**: every piece on CPU at tiny sizes. It checks that the suite works, not the GPU.", ""]
    lines += [f"{provenance['date_utc']} · torch {provenance['torch_version']} · CUDA {provenance['cuda_version']} · "
              f"commit {str(provenance['git_commit'])[:12]}{dirty} · {suite['seconds']} s of "
              f"{suite['time_budget_seconds']:.0f} s", "", f"Command: `{provenance['command']}`", "",
              "| piece | status | seconds | highlights |", "|---|---|---|---|"]
    for record in suite["pieces"]:
        status = record["status"] + (f": {record['reason']}" if record.get("reason") else "")
        lines.append(f"| {record['name']} | {status.replace('|', '/')} | {record['seconds']} | "
                     f"{_compact(record['highlights']) if record['highlights'] else ''} |")
    lines += ["", "## Compare with", ""]
    lines += [f"- **{name}**: {target}" for name, target in TARGETS.items()]
    lines += ["", "Each piece's JSON (with provenance) and log are in this folder; suite.json lists them.", ""]
    path.write_text("\n".join(lines))
