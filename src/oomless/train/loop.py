"""The training loop behind ``oomless train``: 3D U-Net segmentation of synthetic MRI-like volumes.

    from oomless.train import TrainConfig, train
    result = train(TrainConfig(size=48, memory="1GiB", steps=20, seed=0))

or ``oomless train --size 48 --memory 1GiB --steps 20 --seed 0``. With ``memory=None`` it is plain
PyTorch; with a budget the model goes through ``oomless.fit`` once and the loop itself is unchanged,
which is the point: oomless is a transform on the model, not a different training loop.

Under ``torchrun`` with ``parallel=ParallelConfig(mode="dp"|"fsdp"|"local-sgd"|"async")`` every process runs
this same loop on its shard of the global batch; the strategy from `oomless.parallel` owns every
collective, rank 0 prints, writes checkpoints (with every rank's state) and ``--save``.
"""

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from oomless.data.loader import step_batches
from oomless.errors import CheckpointError
from oomless.models import build_model
from oomless.parallel import join_process_group, leave_process_group, make_strategy
from oomless.parallel.config import condition_holds
from oomless.parallel.block_sequence import has_hand_written_sequence
from oomless.parallel.traced import warm_up_tracing
from oomless.parallel.process_group import first_rank_outcome, refusal_or
from oomless.parallel.rank_state import gather_other_ranks
from oomless.profile.rss import MemoryProbe, return_freed_memory_to_the_system
from oomless.runtime.compile import compile_blocks, compile_options, warm_up_compile
from oomless.runtime.precision import apply_precision, load_loss_scale_state, loss_scale_state, skipped_steps
from oomless.sizes import format_bytes
from oomless.train.checkpoint import (check_settings, load_checkpoint, newest_intact_checkpoint, save_checkpoint,
                                      save_weights)
from oomless.train.config import SPLIT_REQUESTS, TrainConfig
from oomless.train.losses import segmentation_loss


@dataclass
class TrainResult:
    """What a run achieved. ``history`` holds one dict per logged step (step, loss, dice, data wait
    seconds per step since the previous record); ``validation`` one dict per whole-volume validation
    (``--data``); ``data_wait_seconds`` is the time steps waited for their batches, all steps together,
    and ``data_wait_seconds_per_step`` each step's (this process's steps, a resumed run's from its start)."""

    steps_done: int
    final_loss: float
    final_dice: float
    peak_memory_bytes: int
    volumes_per_second: float
    voxels_per_second: float
    oomless_applied: bool
    history: list[dict] = field(default_factory=list)
    layouts: list[tuple[int, str]] = field(default_factory=list)   # (first step, layout) of each stretch
    skipped_steps: int = 0          # fp16: optimizer steps skipped because gradients overflowed
    stats: object | None = None
    model: nn.Module | None = field(default=None, repr=False)
    data_wait_seconds: float = 0.0
    data_wait_seconds_per_step: list[float] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    # Seconds per step of the last layout's steps after its first (planning, start-up, validation and
    # checkpoints not in it), or that layout's only step where it ran one; None where no step was
    # trained. volumes_per_second counts all but validation.
    seconds_per_step: float | None = None
    # The training steps' peak, whole-volume validations left out (`peak_memory_bytes` has them).
    steps_peak_memory_bytes: int = 0


def seed_everything(seed: int, deterministic: bool = False, device: torch.device | None = None) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)          # seeds CUDA generators as well
    if deterministic:
        use_deterministic_kernels(device or torch.device("cpu"))


def use_deterministic_kernels(device: torch.device) -> None:
    """Deterministic kernels wherever torch has one (opt-in: on CUDA they cost speed). Strict on
    CPU. On CUDA torch has none for some ops this task runs, and strict mode raises in them:
    ``nll_loss2d``'s reduced forward (the cross-entropy of a 3D segmentation; atomic adds) and, in
    torch releases without its deterministic version (pytorch/pytorch#85425), ``max_pool3d``'s
    backward. There, ``warn_only``: those ops stay nondeterministic and torch warns naming each."""
    if device.type == "cuda":
        # cuBLAS is reproducible only with a fixed workspace; read when the first cuBLAS handle is made.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def build_segmentation_model(config: TrainConfig) -> nn.Module:
    return build_model(config.model, in_channels=config.channels, out_channels=config.classes,
                       base_channels=config.base_channels, depth=config.depth)


def _apply_oomless(model: nn.Module, optimizer: torch.optim.Optimizer, example: tuple[torch.Tensor, torch.Tensor],
                   config: TrainConfig, console: Console, strategy):
    """Plan for the budget on this rank's first batch ``example`` (volumes, labels) and install the
    plan; profiling leaves the model's weights, buffers and RNG as they were, so the run continues
    exactly as a plain one would.

    Under data parallel the model is planned as it will run: BatchNorm is converted to global-batch
    statistics first (`strategy.convert_modules`), and profiled on each rank's own shard without
    collectives (`statistics_of_each_rank`: the same saved tensors). Every rank plans, then all take
    rank 0's plan: recomputed blocks run collectives (global BatchNorm) in backward, so the ranks'
    plans must agree. Under fsdp the plan counts this rank's shard of the parameters, gradients and
    optimizer state (``shard_over``)."""
    import oomless
    from oomless.parallel.batchnorm import statistics_of_each_rank

    strategy.convert_modules(model)
    volumes, labels = example
    # One process: the planner may step the optimizer in backward (not when the loop clips) and keep its
    # state off the device; under a parallel strategy the strategy steps after the gradients are averaged.
    alone = None if config.parallel.mode == "none" else False
    def planned() -> oomless.Plan:
        with statistics_of_each_rank(model):
            return oomless.plan(model, volumes, memory=config.memory, optimizer=optimizer, precision=config.precision,
                                compile=config.compile,
                                # Not under a parallel layout: a chain in slabs computes BatchNorm's statistics
                                # itself, from this rank's shard only (no all-reduce of global BatchNorm).
                                split=SPLIT_REQUESTS[config.split] if config.parallel.mode == "none" else False,
                                loss_fn=lambda logits: segmentation_loss(logits, labels),
                                max_grad_norm=config.max_grad_norm, update_in_backward=alone,
                                offload_optimizer_state=alone, offload_parameters=alone,
                                shard_over=strategy.ranks.world_size if strategy.shards_parameters else 1)

    if strategy.ranks.world_size == 1:
        plan = planned()
    else:
        # Every rank plans its own shard; rank 0's plan, or its refusal, is every rank's.
        outcome = refusal_or(lambda: planned().to_json())
        with strategy.collective("plan broadcast from rank 0"):
            plan = oomless.Plan.from_json(first_rank_outcome(outcome))
    if config.progress and strategy.ranks.is_first:
        console.print(str(plan), soft_wrap=True)
    oomless.apply(model, plan, optimizer=optimizer)
    return plan


def _find_resumable(config: TrainConfig, console: Console) -> tuple[Path, int] | None:
    """(path, step) of the newest intact checkpoint in ``config.checkpoint_dir``, its settings checked
    against ``config`` before anything is built or loaded; None (start at step 0) if there is none."""
    found = newest_intact_checkpoint(config.checkpoint_dir, report=lambda line: console.print(line, soft_wrap=True))
    if found is None:
        console.print(f"no checkpoint in {config.checkpoint_dir}; starting from step 0")
        return None
    path, meta = found
    check_settings(path, meta, config.trajectory())
    if meta["data_position"] != meta["step"] * config.global_batch:
        raise CheckpointError(f"{path} is at data position {meta['data_position']}, not step x global batch", path)
    return path, meta["step"]


def _resume(config: TrainConfig, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, console: Console,
            strategy, run: "_Run", load_state=None) -> None:
    # A layout whose ranks hold one model starts a relaxed mode's file from the mean of its replicas.
    state = load_checkpoint(path, model, optimizer, rank=strategy.ranks.rank, expected_settings=config.trajectory(),
                            load_state=load_state, average_replicas=not strategy.relaxed)
    # An uninterrupted run logs at the end of each stretch (a mean never spans two layouts): at a
    # step switch its sums start afresh, and so do the resumed run's.
    switches_here = any(at == state.step for at, _ in config.parallel.switch)
    run.continue_log_window(None if switches_here else state.log_window, strategy.ranks.world_size)
    console.print(f"resumed from {path} at step {state.step}", soft_wrap=True)


def _stats_line(model: nn.Module) -> tuple[object | None, str]:
    import oomless

    stats = oomless.stats(model)
    return stats, (f"oomless: peak activations {format_bytes(stats.peak_activation_bytes)}, "
                   f"offloaded {format_bytes(stats.offloaded_bytes)}, "
                   f"recomputed blocks {stats.recomputed_blocks}, stall {stats.stall_seconds:.3f}s"
                   + (f", skipped steps {stats.skipped_steps} (loss scale {stats.loss_scale:g})"
                      if stats.loss_scale is not None else ""))


def train(config: TrainConfig, console: Console | None = None) -> TrainResult:
    """Run ``config.steps`` optimizer steps (continuing from the latest checkpoint if ``config.resume``).

    With ``config.parallel.mode`` other than "none" this joins the process group torchrun describes
    (or reuses one already initialised) and leaves it at the end if it joined it."""
    config.validate()
    device = config.resolve_device()
    ranks = join_process_group(config.parallel, device)
    try:
        if device.type == "cuda" and config.parallel.distributed:
            device = torch.device("cuda", torch.cuda.current_device())
        return _train(config, console, device, ranks)
    finally:
        leave_process_group(ranks)


def _train(config: TrainConfig, console: Console | None, device: torch.device, ranks) -> TrainResult:
    # Only rank 0 talks; the others would print the same lines N times.
    console = console or Console(stderr=True, quiet=not ranks.is_first)
    # Imported here, not at the top: the data modules write files with oomless.train.checkpoint's
    # atomic_write, and importing them while oomless.train initialises would be circular.
    from oomless.data.open import open_training_data

    # Files are found, staged, checked and split before anything is counted or timed.
    data, config = open_training_data(config, console, ranks)
    # Before anything is built or measured: a damaged or mismatched checkpoint fails here, in a line.
    resumable = _find_resumable(config, console) if config.resume else None
    seed_everything(config.seed, config.deterministic, device)
    if config.memory is not None and device.type == "cpu":
        # The rule planning sets (freed memory leaves the resident set) holds from before the model is
        # built, not from planning on: what was built and freed in glibc's heap before it stayed
        # there, and `make demo`'s steps measured 254-265 MiB for plans predicted at 255.7 within
        # 256 MiB; with the rule from here, 252.8-253.1 (3 runs each, alternating).
        return_freed_memory_to_the_system()
    # The data path's start-up (the code its first batch runs: ~7 MiB for the synthetic volumes,
    # 6 MiB for a second batch of the same size), as the optimizer's below, with a budget or not.
    data.train.batch(0, 1)
    if data.validation is not None:
        from oomless.train.validate import warm_up_validation   # imported here, as open_training_data above

        warm_up_validation(data.validation, data.prepared.class_names, device)
    # Memory is counted from here: the model, optimizer state and the steps, not the interpreter.
    # The first optimizer built imports ~800 modules (~70 MB resident): library start-up, done now.
    torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    # So does the model's own library, imported as it is built (MONAI: ~99 MB resident, which made
    # `--model monai-unet --memory 64MiB` measure 134 MiB for a plan predicted at 34): built once on
    # the meta device, which allocates nothing.
    with torch.device("meta"):
        meta_model = build_segmentation_model(config)
    if config.parallel.ever_pipelined and not has_hand_written_sequence(meta_model):
        warm_up_tracing()       # and torch.export's, where a pipeline traces the model (~30 MB)
    del meta_model
    if config.compile:
        warm_up_compile(compile_options(config.compile), device)     # and inductor's (~20 MiB)
    if config.parallel.ever_pipelined:
        # Imported here: oomless.parallel.pipeline_training imports oomless.train (its losses).
        from oomless.parallel.pipeline_training import warm_up_rank_reports

        warm_up_rank_reports()  # and the per-rank reports' (~0.7 MiB a rank)
    memory = MemoryProbe(device)
    memory.mark()

    model = build_segmentation_model(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    dataset = data.train
    oomless_applied = config.memory is not None
    start_step = resumable[1] if resumable else 0
    run = _Run(config, console, device, data, start_step, memory)
    conditions = list(config.parallel.switch_when)         # each fires once; removed when it does
    step, layout = start_step, config.parallel.layout_at(start_step)
    plan = None
    with run.progress:
        while True:
            if step != start_step:
                loss_scale = loss_scale_state(model)
                model, optimizer = _rebuilt(config, model, optimizer, device)
                console.print(f"step {step}: switching layout to {_describe(layout)}")
            strategy = make_strategy(layout, ranks, device)
            run.layouts.append((step, _describe(layout)))
            example = dataset.batch(*strategy.shard(step, config.global_batch))
            example = tuple(tensor.to(device) for tensor in example)
            plan = None
            # A run with no step left (resumed at its last step, or --steps 0) plans nothing: planning
            # profiles steps, minutes for a large model, for no step to run under the plan.
            if oomless_applied and not layout.pipelined and step < config.steps:
                plan = _apply_oomless(model, optimizer, example, config, console, strategy)
            else:       # no plan: autocast (and loss scaling) and compiled blocks alone
                if config.precision != "fp32":
                    apply_precision(model, config.precision, optimizer)
                if config.compile and not layout.pipelined:     # a pipeline compiles its stages' blocks
                    compile_blocks(model, compile_options(config.compile), device)
            if step != start_step:
                load_loss_scale_state(model, loss_scale)
            resume_now = step == start_step and resumable
            if resume_now and not strategy.shards_parameters:
                # After fit: the checkpoint overwrites whatever fit's profiling touched, RNG included.
                _resume(config, resumable[0], model, optimizer, console, strategy, run)
            model.train()
            # `model` keeps its parameter names for checkpoints and --save; the strategy calls
            # `train_model` (DDP under dp, the model itself otherwise).
            # A pipeline's stages plan within what each rank does not hold already above the mark;
            # with no step left, not at all (as the model above: each stage's plan profiles it).
            stage_options = dict(memory=config.memory_bytes, compile=compile_options(config.compile),
                                 counted_from=memory.start_bytes) if layout.pipelined and step < config.steps else {}
            train_model = strategy.prepare(model, optimizer, config.max_grad_norm, example=example, **stage_options)
            # The plan counts one batch (its inputs and the loss's targets): the steps' own. Kept
            # here, the first batch would be a second one through every step (6 MiB at the demo's
            # 2 x 64^3, 256 MiB budget: measured peaks 256-274 MiB with it).
            del example
            if resume_now and strategy.shards_parameters:
                # Sharded: the file's full tensors go into each rank's shards, which exist only now.
                _resume(config, resumable[0], model, optimizer, console, strategy, run, strategy.load_full_state)
            if layout.pipelined and config.progress and ranks.is_first:
                console.print(str(strategy.partition), soft_wrap=True)
                for stage, stage_plan in zip(strategy.pipeline.stage_indices, strategy.plans):
                    console.print(f"stage {stage} (rank 0):\n{stage_plan}", soft_wrap=True)
            if layout.pipelined and strategy.plans:
                console.print(strategy.describe_rank_plans(), soft_wrap=True)   # every rank gathers
            end = config.parallel.next_switch(step, config.steps)
            step, fired = run.steps(strategy, model, train_model, optimizer, step, end, conditions)
            strategy.finish(model, optimizer)       # every rank now holds the same weights and optimizer state
            if step >= config.steps:
                break
            layout = config.parallel.with_layout(fired) if fired else config.parallel.layout_at(step)
    return _result(config, console, device, ranks, run, strategy, model, plan, memory, oomless_applied)


def _fire(conditions: list[tuple[str, str]], record: dict) -> tuple[str, str] | None:
    """The first (condition, layout) that holds for ``record``, removed from ``conditions``."""
    for index, (condition, layout) in enumerate(conditions):
        if condition_holds(condition, record):
            return conditions.pop(index)
    return None


def _describe(layout) -> str:
    if layout.pipelined:
        return f"{layout.mode} with {layout.stages} stages ({layout.schedule})"
    return layout.mode


def _rebuilt(config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
    """A fresh model and optimizer holding ``model``'s and ``optimizer``'s state, for the next layout
    (which wraps, converts and hooks the model its own way). The RNG is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        fresh = build_segmentation_model(config).to(device)
    fresh.load_state_dict(model.state_dict())
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=config.lr)
    fresh_optimizer.load_state_dict(optimizer.state_dict())
    return fresh, fresh_optimizer


class _Run:
    """The steps of a run across layouts: progress bar, history, checkpoints, the last loss and Dice."""

    def __init__(self, config: TrainConfig, console: Console, device: torch.device, data, start_step: int,
                 memory: MemoryProbe):
        from oomless.train.validate import Validation      # imported here, as in _train

        self.config, self.console, self.device, self.dataset = config, console, device, data.train
        self.data = data
        self.waits: list[float] = []            # seconds each step waited for its batch
        self.validation = (Validation(data.validation, data.prepared.class_names, data.run_dir,
                                      config.data.validate_every, config.steps, start_step)
                           if data.validation is not None else None)
        self.memory = memory
        # The steps' peak and the whole-volume validations' (above the memory mark), each read as a
        # validation begins and ends, the probe's peak restarted after each: validation is not a
        # planned step (an eval forward at batch 1 on another shape, reading labels and writing a
        # NIfTI), and its code's start-up alone made a 24^3 run's peak 79 MiB against its steps' 54.
        self.steps_peak_bytes = 0
        self.validation_peak_bytes = 0
        self.stepped_since_validation = True      # else the probe's reading is validation's leftovers
        self.start_step = start_step
        self.history: list[dict] = []
        self.layouts: list[tuple[int, str]] = []
        self.loss = self.dice = None
        # Sums since the last log, kept on the device: reading them (.item()) waits for the device,
        # so only `_log` does, every `log_every` steps, and it logs the mean of every step since.
        self.loss_sum = self.dice_sum = None
        self.steps_since_log = 0
        self.voxels_per_volume = int(np.prod(config.shape))
        self.started = time.perf_counter()
        # The step time a plan predicted is compared with the steps of the last stretch after its
        # first (planning, and the first step's start-up: kernel caches, the swap files' first pages):
        # the clock from the end of that first step (None until it ends), and the steps done then.
        self.stretch_started = self.started
        self.timed_since: float | None = None
        self.timed_after_step = 0
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[metrics]}"))
        # A bar only redraws on a terminal; elsewhere (logs, CI) each logged step is printed as a line.
        self.show_bar = config.progress and console.is_terminal and not console.quiet
        self.progress = Progress(*columns, console=console, disable=not self.show_bar)
        self.task = self.progress.add_task("train", total=config.steps, completed=start_step, metrics="")
        # With files, a second bar: how far the current epoch (one pass over the training cases) is.
        self.epoch_task = (self.progress.add_task("epoch", total=data.items_per_epoch, metrics="")
                           if data.items_per_epoch else None)

    def steps(self, strategy, model: nn.Module, train_model: nn.Module, optimizer, first: int, end: int,
              conditions: list[tuple[str, str]]) -> tuple[int, str | None]:
        """Train steps ``first`` .. ``end`` - 1; stop early after a logged step where one of
        ``conditions`` holds (removing it). Returns (steps done, the fired condition's layout or None)."""
        config = self.config
        steps_done, fired = first, None
        self._wait_for_device()     # the clock must not start while the last stretch's kernels still run
        self.stretch_started, self.timed_since = time.perf_counter(), None
        # On CUDA the loader pins each batch, so the copies below are asynchronous (a non_blocking
        # copy from pageable memory would first wait for the stream to drain).
        batches = step_batches(self.dataset, [strategy.shard(step, config.global_batch) for step in range(first, end)],
                               self.data.workers, pin_memory=self.device.type == "cuda", waits=self.waits)
        for step, (volumes, labels) in zip(range(first, end), batches):
            volumes = volumes.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            self.loss, self.dice = strategy.train_step(train_model, volumes, labels)
            self.stepped_since_validation = True
            self._accumulate()
            strategy.step(model, optimizer, step)          # clip, step, zero grads; averages if relaxed
            steps_done = step + 1
            if steps_done == first + 1:
                self._wait_for_device()     # else the first step's queued kernels land in the later steps' time
                self.timed_since, self.timed_after_step = time.perf_counter(), steps_done
            # Also at the end of a stretch: the mean logged never spans two layouts.
            if steps_done % config.log_every == 0 or steps_done in (end, config.steps):
                self._log(strategy, model, steps_done)
                fired = _fire(conditions, self.history[-1])
            if self.validation is not None and self.validation.due(steps_done):
                self._wait_for_device()     # queued kernels are this step's time, not validation's
                validating = time.perf_counter()
                self._validate(strategy, model, steps_done)     # every rank waits for rank 0's
                self._leave_out_of_step_time(time.perf_counter() - validating)
            if config.checkpoint_dir is not None and (steps_done % config.checkpoint_every == 0 or fired
                                                      or steps_done in (end, config.steps)):
                self._wait_for_device()     # queued kernels are this step's time, not the checkpoint's
                saving = time.perf_counter()
                self._checkpoint(strategy, model, optimizer, steps_done)
                self._leave_out_of_step_time(time.perf_counter() - saving)
            self.progress.update(self.task, completed=steps_done)
            if self.epoch_task is not None:
                epoch, position = divmod(steps_done * config.global_batch, self.data.items_per_epoch)
                self.progress.update(self.epoch_task, completed=position, description=f"epoch {epoch + 1}")
            if fired:
                self.console.print(f"step {steps_done}: {fired[0]} holds", soft_wrap=True)
                return steps_done, fired[1]
        return steps_done, None

    def _wait_for_device(self) -> None:
        """Wait for queued kernels: on CUDA host clocks otherwise time the launches, not the work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _leave_out_of_step_time(self, seconds: float) -> None:
        """Validation and checkpoints are not a step's time: the stretch's clocks move past them."""
        self.stretch_started += seconds
        if self.timed_since is not None:
            self.timed_since += seconds

    def measured_step_seconds(self, steps_done: int) -> tuple[float, str]:
        """(seconds per step, which steps) of the last stretch: after its first step where it ran
        more than one; call with the device synchronized."""
        now = time.perf_counter()
        if self.timed_since is not None and steps_done > self.timed_after_step:
            return ((now - self.timed_since) / (steps_done - self.timed_after_step),
                    f"steps {self.timed_after_step + 1}-{steps_done}")
        return now - self.stretch_started, f"step {steps_done}, the first of its layout"

    def log_window(self, world_size: int) -> dict | None:
        """The sums since the last log, for a checkpoint (`CheckpointState.log_window`)."""
        if not self.steps_since_log:
            return None
        return {"loss_sum": self.loss_sum, "dice_sum": self.dice_sum, "steps": self.steps_since_log,
                "log_every": self.config.log_every, "world_size": world_size}

    def continue_log_window(self, window: dict | None, world_size: int) -> None:
        """Resumed: go on summing where the checkpointed run was (its next log line is the mean of the
        same steps an uninterrupted run's is, and --switch-when fires at the same step). With another
        --log-every or number of ranks (each rank's sums are of its own shard), the new period starts
        at the resumed step."""
        if window is not None and (window.get("log_every"), window.get("world_size")) == (self.config.log_every,
                                                                                         world_size):
            self.loss_sum, self.dice_sum = window["loss_sum"].to(self.device), window["dice_sum"].to(self.device)
            self.steps_since_log = window["steps"]

    def _accumulate(self) -> None:
        loss = self.loss.detach()
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.dice_sum = self.dice if self.dice_sum is None else self.dice_sum + self.dice
        self.steps_since_log += 1

    def _log(self, strategy, model: nn.Module, steps_done: int) -> None:
        # The loss and Dice of the steps since the last log, averaged: .item() waits for the device,
        # so it runs only here. Under data parallel: the mean over ranks (for dp, the global batch's).
        config = self.config
        loss, dice = self.loss_sum / self.steps_since_log, self.dice_sum / self.steps_since_log
        # The run's last step, off the log's period: logged, but the sums go on into its checkpoint,
        # so that a run resumed from it (with more --steps) logs what one run to those steps does.
        carried_into_checkpoint = steps_done == config.steps and steps_done % config.log_every != 0
        if not carried_into_checkpoint:
            self.loss_sum = self.dice_sum = None
            self.steps_since_log = 0
        record = {"step": steps_done, "loss": strategy.mean_across_ranks(loss).item(),
                  "dice": strategy.mean_across_ranks(dice).item()}
        logged_before = self.history[-1]["step"] if self.history else self.start_step
        record["data_wait_seconds"] = sum(self.waits[logged_before - self.start_step:]) / max(steps_done - logged_before, 1)
        self.history.append(record)
        skipped = skipped_steps(model)
        elapsed = time.perf_counter() - self.started
        rate = (steps_done - self.start_step) * config.global_batch / max(elapsed, 1e-9)
        metrics = (f"loss {record['loss']:.4f}  dice {record['dice']:.3f}  {rate:.2f} vol/s  "
                   f"{rate * self.voxels_per_volume / 1e6:.2f} Mvox/s  "
                   f"peak {format_bytes(self.peak_bytes())}  "
                   f"data wait {record['data_wait_seconds'] * 1e3:.0f} ms/step")
        if skipped is not None:
            record["skipped_steps"] = skipped
            metrics += f"  skipped steps {skipped} (fp16 overflow)"
        self.progress.update(self.task, metrics=metrics)
        if config.progress and not self.show_bar:
            self.console.print(f"step {steps_done}/{config.steps}  {metrics}", soft_wrap=True)

    def peak_bytes(self) -> int:
        """The training steps' peak above the memory mark so far, whole-volume validations left out
        (after a validation the probe's peak restarts at what validation left resident: read only
        once a step has run since)."""
        if not self.stepped_since_validation:
            return self.steps_peak_bytes
        return max(self.steps_peak_bytes, self.memory.peak_since_mark())

    def _validate(self, strategy, model: nn.Module, steps_done: int) -> None:
        if strategy.config.pipelined:
            # Each rank holds only its own stages on the device: no rank can run the whole model.
            self.console.print(f"step {steps_done}: validation skipped under a pipelined layout", soft_wrap=True)
            return
        strategy.synchronize(model)            # no update in flight: the weights validated are the step's
        # Before the full copy a sharded model is gathered into: that is validation's memory.
        self.steps_peak_bytes = self.peak_bytes()
        self.stepped_since_validation = False
        evaluated = model
        if strategy.shards_parameters:
            # Rank 0 validates alone, and a sharded model's forward needs every rank: a full copy.
            model_state, _ = strategy.full_state(model, None)
            if strategy.ranks.is_first:
                with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                    evaluated = build_segmentation_model(self.config).to(self.device)
                evaluated.load_state_dict(model_state)
        if strategy.ranks.is_first:
            record = self.validation.run(evaluated, self.device, steps_done)
            self.console.print(self.validation.describe(record), soft_wrap=True)
            self.started += record["seconds"]      # throughput counts training, not validation
        del evaluated
        self.validation_peak_bytes = max(self.validation_peak_bytes, self.memory.peak_since_mark())
        self.memory.restart_peak()
        strategy.barrier()                     # the other ranks wait rather than run ahead of the collectives

    def _checkpoint(self, strategy, model: nn.Module, optimizer, steps_done: int) -> None:
        config = self.config
        strategy.synchronize(model)            # no update or average in flight; every rank holds all state
        window = self.log_window(strategy.ranks.world_size)
        other_ranks = gather_other_ranks(strategy, model, optimizer, window)
        full_state = strategy.full_state(model, optimizer) if strategy.shards_parameters else None
        if strategy.ranks.is_first:
            save_checkpoint(config.checkpoint_dir, model, optimizer, steps_done,
                            data_position=steps_done * config.global_batch,
                            trajectory=config.trajectory(), keep=config.keep_checkpoints,
                            other_ranks=other_ranks, full_state=full_state, log_window=window)


def _result(config: TrainConfig, console: Console, device: torch.device, ranks, run: _Run, strategy, model,
            plan, memory: MemoryProbe, oomless_applied: bool) -> TrainResult:
    loss, dice = run.loss, run.dice
    final_loss = strategy.mean_across_ranks(loss.detach()).item() if loss is not None else float("nan")
    final_dice = strategy.mean_across_ranks(dice).item() if dice is not None else float("nan")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - run.started
    trained = config.steps - run.start_step if config.steps > run.start_step else 0
    volumes_per_second = trained * config.global_batch / elapsed if trained and elapsed > 0 else 0.0
    voxels_per_volume = int(np.prod(config.shape))
    stats = None
    steps_peak = run.peak_bytes()
    peak = max(steps_peak, run.validation_peak_bytes)
    steps_done = max(config.steps, run.start_step)
    seconds_per_step, timed_steps = run.measured_step_seconds(steps_done) if trained else (None, "")
    if plan is not None:
        stats, line = _stats_line(model)
        console.print(line, soft_wrap=True)
        measured = f"{seconds_per_step:.3f} s ({timed_steps})" if seconds_per_step is not None else "none trained"
        validation = "" if steps_peak == peak else \
            f"; with whole-volume validation, not a planned step, {format_bytes(peak)}"
        console.print(f"predicted vs measured: peak {format_bytes(plan.predicted_peak_bytes)} vs "
                      f"{format_bytes(steps_peak)} (budget {format_bytes(plan.memory_bytes)}{validation}), step "
                      f"{plan.predicted_step_seconds:.3f} s vs {measured}", soft_wrap=True)
    elif strategy.config.pipelined and strategy.plans:
        console.print(strategy.describe_predicted_vs_measured(steps_peak), soft_wrap=True)   # every rank gathers
    model_state = strategy.full_state(model, None)[0] if config.save is not None and strategy.shards_parameters \
        else None
    if config.save is not None and ranks.is_first:
        console.print(f"saved weights to {save_weights(config.save, model, model_state)}")
    strategy.barrier()                          # the file exists before any rank returns
    return TrainResult(
        steps_done=steps_done,
        final_loss=final_loss, final_dice=final_dice,
        peak_memory_bytes=peak, steps_peak_memory_bytes=steps_peak,
        volumes_per_second=volumes_per_second,
        seconds_per_step=seconds_per_step,
        voxels_per_second=volumes_per_second * voxels_per_volume,
        oomless_applied=oomless_applied,
        history=run.history, layouts=run.layouts, stats=stats, model=model,
        data_wait_seconds=sum(run.waits), data_wait_seconds_per_step=run.waits, validation=run.validation.records if run.validation else [],
        skipped_steps=skipped_steps(model) or 0,
    )
