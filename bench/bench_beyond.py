"""Memory beyond activations: the largest GPT-2-style model each method trains under the same memory,
and its step time (issue 12).

    python bench/bench_beyond.py --memory 128MiB                      # CPU: resident memory, child processes
    python bench/bench_beyond.py --model hf:gpt2 --memory 128MiB      # Hugging Face GPT-2 (transformers)
    python bench/bench_beyond.py --device cuda --dim 1024 --vocab-size 50257 --length 1024 --memory 16GiB
    python bench/bench_beyond.py --quick --out /tmp/beyond.json       # tiny ladder, seconds (CI runs it)
    python bench/bench_beyond.py --placements 16 --timing-rounds 9    # step time of each static placement

Methods, each on the same model (blocks of width ``--dim``, depth from a ladder), Adam, batch and
sequence fixed:
- ``plain``: PyTorch as is;
- ``checkpoint``: every block through ``torch.utils.checkpoint`` (non-reentrant; Hugging Face's
  ``gradient_checkpointing_enable`` for hf models);
- ``oomless-activations``: ``oomless.fit`` for the memory with every static byte kept on the device
  (update_in_backward, offload_optimizer_state and offload_parameters False): activations only;
- ``oomless``: ``oomless.fit`` for the memory, the planner deciding the update in backward and the
  optimizer state and parameters off the device as well;
- ``torchao-offload`` (CUDA, where torchao is installed: ``--methods ...,torchao-offload``): torchao's
  ``CPUOffloadOptimizer`` over ``torch.optim.Adam`` (fused, its recommended setting), gradients
  offloaded too; the state and the step on the host, activations as plain PyTorch keeps them.
Each (method, depth) runs in its own child process: the truth for memory on CPU is the process's peak
resident memory (DESIGN.md section 3), here above the process before the model was built (after one
warm-up step of the same model one block deep: start-up of kernels and threads is not the model's), over
``--steps`` training steps. A method trains a depth when that peak is within the memory (oomless:
and the planner accepted it); the ladder is searched by bisection from the smallest depth, then
climbed until two depths in a row do not fit (a planner's choices make fitting not monotonic in
depth). Planning itself profiles the model whole on the device (one step without the optimizer's state), so its own
peak is reported apart (``planning_peak_above_empty_bytes``): on a GPU, plan with ``target=`` on meta
tensors instead. Step time in each child: the median of the steps after the first; the ratios to
plain come from one more process where every method trains the deepest depth all of them fit, their
steps interleaved (``interleaved_timing``: load from other work falls on all alike). CUDA: the same
with ``torch.cuda.max_memory_allocated`` above the memory before the model (``--device cuda``).
"""

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Before torch: PyTorch's huge pages for large CPU tensors, as the `oomless` command has them
# (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

METHODS = ("plain", "checkpoint", "oomless-activations", "oomless")
EXTRA_METHODS = ("torchao-offload",)       # not run unless asked for (CUDA and torchao only)


def make_optimizer(method: str, model) -> torch.optim.Optimizer:
    """Adam over ``model``, as every method trains it; torchao's offload wraps it."""
    if method == "torchao-offload":
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(model.parameters(), torch.optim.Adam, offload_gradients=True, fused=True, lr=1e-4)
    return torch.optim.Adam(model.parameters(), lr=1e-4)


def why_not_available(method: str, device: torch.device) -> str | None:
    if method != "torchao-offload":
        return None
    if device.type != "cuda":
        return "torchao's CPUOffloadOptimizer offloads from a CUDA (or XPU) device only"
    import importlib.util

    return None if importlib.util.find_spec("torchao") else "torchao is not installed (pip install torchao)"
LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def build(model_name: str, depth: int, sizes: dict, device: torch.device):
    """(model, tokens, loss_fn, block container) of a GPT-2-style model ``depth`` blocks deep."""
    torch.manual_seed(0)
    tokens = torch.randint(0, sizes["vocab_size"], (sizes["batch"], sizes["length"]), device=device)
    targets = tokens.roll(-1, 1).flatten()
    if model_name == "transformer":
        from oomless.models import TinyTransformer

        model = TinyTransformer(vocab_size=sizes["vocab_size"], dim=sizes["dim"], depth=depth, heads=sizes["heads"],
                                max_len=sizes["length"], dropout=0.0).to(device)
        return model, tokens, (lambda out: F.cross_entropy(out.flatten(0, 1), targets)), model.blocks
    from oomless.models import build_transformers_model

    model = build_transformers_model(model_name.removeprefix("hf:"), n_layer=depth, n_embd=sizes["dim"],
                                     n_head=sizes["heads"], vocab_size=sizes["vocab_size"],
                                     n_positions=sizes["length"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0).to(device)
    return (model, tokens, (lambda out: F.cross_entropy(out.logits.flatten(0, 1), targets)),
            model.transformer.h)


def prepare(method: str, model_name: str, model, tokens, loss_fn, optimizer, blocks, memory_bytes: int) -> None:
    """Apply ``method`` to the built model; `oomless.PlanError` when the planner refuses the memory."""
    import oomless

    if method == "checkpoint":
        if model_name == "transformer":
            for index, block in enumerate(blocks):
                blocks[index] = common.CheckpointedBlock(block)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method.startswith("oomless"):
        moved = dict(update_in_backward=False, offload_optimizer_state=False, offload_parameters=False) \
            if method == "oomless-activations" else {}
        oomless.fit(model, tokens, memory_bytes, loss_fn=loss_fn, optimizer=optimizer, **moved)


class _Memory:
    """Peak bytes above a mark: the allocator's on CUDA, resident memory on CPU."""

    def __init__(self, device: torch.device):
        from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss

        self.device = device
        self._current, self._peak, self._reset = current_rss_bytes, peak_rss_bytes, reset_peak_rss

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else self._current()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._reset()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else self._peak()


def run_child(method: str, model_name: str, depth: int, sizes: dict, memory_bytes: int, steps: int,
              device: torch.device) -> dict:
    """One method at one depth, in this (fresh) process."""
    import oomless
    from oomless.profile.rss import return_freed_memory_to_the_system

    return_freed_memory_to_the_system()
    probe = _Memory(device)
    # Start-up of the process, not the model's: one step of the same model one block deep, at the same
    # sizes, warms the kernels' caches, autograd's threads and the optimizer's code (floor_child.py too).
    warm, warm_tokens, warm_loss, _ = build(model_name, 1, sizes, device)
    warm_optimizer = torch.optim.Adam(warm.parameters())
    warm_loss(warm(warm_tokens)).backward()
    warm_optimizer.step()
    del warm, warm_tokens, warm_loss, warm_optimizer
    gc.collect()
    empty = probe.current()
    model, tokens, loss_fn, blocks = build(model_name, depth, sizes, device)
    optimizer = make_optimizer(method, model)
    record = {"method": method, "depth": depth, "parameters": sum(p.numel() for p in model.parameters()),
              "parameter_bytes": sum(p.nbytes for p in model.parameters())}
    if method.startswith("oomless"):
        probe.reset()
    try:
        prepare(method, model_name, model, tokens, loss_fn, optimizer, blocks, memory_bytes)
    except oomless.PlanError as refused:
        record.update(refused=str(refused), minimum_bytes=refused.minimum_bytes,
                      planning_peak_above_empty_bytes=probe.peak() - empty)
        return record
    if method.startswith("oomless"):
        record["planning_peak_above_empty_bytes"] = probe.peak() - empty
        plan = oomless.installed_plan(model)
        record.update(decisions=sorted(set(plan.decisions.values())), update_in_backward=plan.update_in_backward,
                      offload_optimizer_state=plan.offload_optimizer_state, offload_parameters=plan.offload_parameters,
                      predicted_peak_bytes=plan.predicted_peak_bytes, predicted_step_seconds=plan.predicted_step_seconds)
    model.train()
    gc.collect()
    probe.reset()
    seconds = [_timed_step(model, tokens, loss_fn, optimizer, device) for _ in range(steps)]
    record.update(peak_above_empty_bytes=probe.peak() - empty, step_seconds=statistics.median(seconds[1:] or seconds),
                  step_seconds_all=seconds)
    return record


# The static placements timed side by side (``--placements``): every one forced, the memory generous
# so that the activations are kept alike; the target (issue 12) is the state off the device at
# <= 1.3x the step with everything on it.
PLACEMENTS = {
    "on device": dict(update_in_backward=False, offload_optimizer_state=False, offload_parameters=False),
    "update in backward": dict(update_in_backward=True, offload_optimizer_state=False, offload_parameters=False),
    "state off the device": dict(update_in_backward=True, offload_optimizer_state=True, offload_parameters=False),
    "state and parameters off": dict(update_in_backward=True, offload_optimizer_state=True, offload_parameters=True),
}


def _timed_step(model, tokens, loss_fn, optimizer, device: torch.device) -> float:
    """Seconds of one training step, as the loop runs it."""
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(tokens)).backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)      # the step's kernels belong to its time
    return time.perf_counter() - started


def _interleaved_medians(runs: dict, rounds: int, device: torch.device) -> dict[str, float]:
    """{name: median step seconds after the first} of ``runs`` ({name: (model, tokens, loss_fn,
    optimizer)}), one step of each per round: load from other work falls on all of them alike."""
    seconds = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            seconds[name].append(_timed_step(*run, device))
    return {name: statistics.median(times[1:] or times) for name, times in seconds.items()}


def run_placements(model_name: str, depth: int, sizes: dict, rounds: int, device: torch.device) -> dict:
    """Step time of plain PyTorch and of oomless under each static placement, at one depth, in one
    process, their steps interleaved round by round (ratios are what count)."""
    import oomless

    runs = {}
    for name, moved in [("plain", None), *PLACEMENTS.items()]:
        model, tokens, loss_fn, _ = build(model_name, depth, sizes, device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        if moved is not None:
            # Memory to spare: every block is kept, so only the placement differs.
            oomless.fit(model, tokens, 64 * 2**30, loss_fn=loss_fn, optimizer=optimizer, **moved)
        runs[name] = (model, tokens, loss_fn, optimizer)
    medians = _interleaved_medians(runs, rounds, device)
    return {"depth": depth, "rounds": rounds, "step_seconds": medians,
            "relative_to_on_device": {name: value / medians["on device"] for name, value in medians.items()},
            "relative_to_plain": {name: value / medians["plain"] for name, value in medians.items()}}


def run_timing(methods: list[str], model_name: str, depth: int, sizes: dict, memory_bytes: int, rounds: int,
               device: torch.device) -> dict:
    """Step time of every method at one depth, in one process, their steps interleaved round by round,
    so that load from other work on the machine falls on all of them alike (ratios are what count)."""
    import oomless

    runs = {}
    for method in methods:
        model, tokens, loss_fn, blocks = build(model_name, depth, sizes, device)
        optimizer = make_optimizer(method, model)
        try:
            prepare(method, model_name, model, tokens, loss_fn, optimizer, blocks, memory_bytes)
        except oomless.PlanError:
            continue
        runs[method] = (model, tokens, loss_fn, optimizer)
    medians = _interleaved_medians(runs, rounds, device)
    base = medians.get("plain")
    return {"depth": depth, "rounds": rounds, "step_seconds": medians,
            "relative_to_plain": {method: value / base for method, value in medians.items()} if base else None}


def measure(method: str, depth: int, args, sizes: dict, memory_bytes: int) -> dict:
    command = [sys.executable, __file__, "--child", method, str(depth), "--memory", str(memory_bytes),
               "--model", args.model, "--steps", str(args.steps), "--device", args.device,
               "--sizes", json.dumps(sizes), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.child_timeout)
    if done.returncode != 0:
        return {"method": method, "depth": depth, "error": done.stderr.strip().splitlines()[-1:]}
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["fits"] = "refused" not in record and "error" not in record and \
        record["peak_above_empty_bytes"] <= memory_bytes
    print(f"  {method:20s} depth {depth:4d}: " + (
        f"refused by the planner (minimum {record['minimum_bytes'] / 2**20:.0f} MiB)" if "refused" in record else
        f"peak {record['peak_above_empty_bytes'] / 2**20:7.1f} MiB, step {record['step_seconds'] * 1e3:8.1f} ms"
        f" -> {'fits' if record['fits'] else 'over'}"), flush=True)
    return record


def largest_depth(method: str, args, sizes: dict, memory_bytes: int, ladder: tuple[int, ...]) -> tuple[int | None, list]:
    """The deepest ladder depth ``method`` trains within the memory.

    Bisection first (plain PyTorch's memory grows with depth). A planner's choice is not monotonic:
    near the memory a plan that keeps the static bytes may measure a few percent over, where a deeper
    model, for which the planner moves them, fits. So the ladder is then climbed from the depth found
    until two depths in a row do not fit."""
    runs: dict[int, dict] = {}

    def fits(index: int) -> bool:
        if ladder[index] not in runs:
            runs[ladder[index]] = measure(method, ladder[index], args, sizes, memory_bytes)
        return bool(runs[ladder[index]].get("fits"))

    low, high = -1, len(ladder)                 # ladder[low] fits, ladder[high] does not
    while high - low > 1:
        middle = (low + high) // 2 if low >= 0 else 0
        if fits(middle):
            low = middle
        else:
            high = middle
    misses, index = 0, low + 1
    while misses < 2 and index < len(ladder):
        if fits(index):
            low, misses = index, 0
        else:
            misses += 1
        index += 1
    return (ladder[low] if low >= 0 else None), list(runs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", default="128MiB", help="the memory every method must train within")
    parser.add_argument("--model", default="transformer", help="transformer (oomless's) or hf:gpt2")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dim", type=int, default=128, help="model width (heads of 32)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny ladder and model: seconds")
    parser.add_argument("--child-timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every child")
    parser.add_argument("--timing-rounds", type=int, default=5,
                        help="interleaved steps per method at the deepest depth every method trains (0: none)")
    parser.add_argument("--placements", type=int, metavar="DEPTH", default=None,
                        help="instead of the search: time plain PyTorch and each static placement (on the device, "
                             "update in backward, state off the device, state and parameters off) at this depth, "
                             "interleaved, --timing-rounds steps each (at least 3)")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "DEPTH"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from oomless.sizes import parse_bytes

    memory_bytes = parse_bytes(args.memory)
    device = torch.device(args.device)
    if args.child:
        torch.set_num_threads(args.threads)
        sizes = json.loads(args.sizes)
        method, depth = args.child[0], int(args.child[1])
        if method == "timing":
            print(json.dumps(run_timing(args.methods.split(","), args.model, depth, sizes, memory_bytes,
                                        args.timing_rounds, device)))
        else:
            print(json.dumps(run_child(method, args.model, depth, sizes, memory_bytes, args.steps, device)))
        return
    sizes = dict(dim=32, heads=2, vocab_size=128, batch=2, length=32) if args.quick else \
        dict(dim=args.dim, heads=max(1, args.dim // 32), vocab_size=args.vocab_size, batch=args.batch,
             length=args.length)
    if args.placements is not None:
        torch.set_num_threads(args.threads)
        timing = run_placements(args.model, args.placements, sizes, max(args.timing_rounds, 3), device)
        print("step time relative to everything on the device: " + ", ".join(
            f"{name} {ratio:.2f}x" for name, ratio in timing["relative_to_on_device"].items()), flush=True)
        record = {"provenance": common.provenance(device, threads=args.threads), "model": args.model, "sizes": sizes,
                  "placements": {name: moved for name, moved in PLACEMENTS.items()}, "timing": timing}
        out = args.out or common.BENCH_DIRECTORY / "results" / \
            f"placements-{args.device}-{args.model.replace(':', '-')}-{time.strftime('%Y-%m-%d')}.json"
        common.write_result(out, record)
        return
    ladder = (1, 2) if args.quick else LADDER
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS) - set(EXTRA_METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS + EXTRA_METHODS)}")
    not_run = {method: why_not_available(method, device) for method in methods if why_not_available(method, device)}
    for method, why in not_run.items():
        print(f"{method}: not run ({why})", flush=True)
    methods = [method for method in methods if method not in not_run]
    print(f"{args.model} (dim {sizes['dim']}, batch {sizes['batch']} x {sizes['length']} tokens, Adam) "
          f"under {args.memory} on {args.device}", flush=True)
    results = {}
    for method in methods:
        depth, runs = largest_depth(method, args, sizes, memory_bytes, ladder)
        best = next((run for run in runs if run.get("fits") and run["depth"] == depth), None)
        results[method] = {"largest_depth": depth, "largest_parameters": best and best["parameters"],
                           "step_seconds_at_largest": best and best["step_seconds"], "runs": runs}
        print(f"{method}: largest depth {depth}" + (f" ({best['parameters'] / 1e6:.1f} M parameters, step "
                                                   f"{best['step_seconds'] * 1e3:.0f} ms)" if best else ""), flush=True)
    timing = None
    common_depth = min((result["largest_depth"] for result in results.values()), default=None)
    if args.timing_rounds and common_depth:
        command = [sys.executable, __file__, "--child", "timing", str(common_depth), "--memory", str(memory_bytes),
                   "--model", args.model, "--device", args.device, "--sizes", json.dumps(sizes),
                   "--methods", ",".join(methods), "--timing-rounds", str(args.timing_rounds),
                   "--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.child_timeout)
        timing = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
            {"error": done.stderr.strip().splitlines()[-1:]}
        print(f"interleaved step time at depth {common_depth}: {timing.get('relative_to_plain') or timing}", flush=True)
    record = {"provenance": common.provenance(device, threads=args.threads), "model": args.model, "sizes": sizes,
              "memory_bytes": memory_bytes, "ladder": ladder, "steps": args.steps, "methods": results,
              "not_run": not_run,
              "interleaved_timing": timing,
              "measured": ("peak resident memory above the process before the model (CPU) over the training "
                           "steps; planning's own peak reported apart")}
    stamp = time.strftime("%Y-%m-%d")
    name = args.model.replace(":", "-")
    out = args.out or common.BENCH_DIRECTORY / "results" / f"beyond-{args.device}-{name}-{stamp}.json"
    common.write_result(out, record)


if __name__ == "__main__":
    main()
