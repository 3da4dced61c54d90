"""``oomless train``: flags onto ``TrainConfig``, then ``oomless.train.train``. No logic of its own."""

import argparse

from oomless.data.config import DataConfig
from oomless.errors import InputError
from oomless.parallel.config import OVERLAP_MODES, PARALLEL_MODES, ParallelConfig
from oomless.plan.partition import SCHEDULES as PIPELINE_SCHEDULES
from oomless.train.config import SEGMENTATION_MODELS, SPLIT_CHOICES, TrainConfig


def parse_size(text: str) -> int | tuple[int, int, int]:
    """"48" is a 48^3 cube; "32,48,64" is (D, H, W)."""
    try:
        sides = tuple(int(side) for side in text.split(","))
    except ValueError:
        raise InputError(f"--size {text!r} is not an integer or D,H,W integers") from None
    if len(sides) == 1:
        return sides[0]
    if len(sides) != 3:
        raise InputError(f"--size {text!r} must be one side or three (D,H,W)")
    return sides


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "train", help="train a 3D U-Net on whole volumes (synthetic, or NIfTI with --data) under a memory budget",
        description="Train a 3D segmentation network on whole volumes: synthetic MRI-like ones, or a NIfTI "
                    "dataset with --data. "
                    "With --memory, oomless plans swap/recompute to fit the budget; without it, plain PyTorch.",
    )
    defaults = TrainConfig()
    parser.add_argument("--size", default=None, help=f"volume side, or D,H,W (default {defaults.size}); with --data, "
                                                      "resample every case to it (default: pad to the largest case)")
    parser.add_argument("--memory", default=None, help="device memory budget, e.g. 1GiB; omit for plain PyTorch")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed for weights and data")
    parser.add_argument("--global-batch", type=int, default=defaults.global_batch, help="volumes per step")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate")
    parser.add_argument("--model", choices=SEGMENTATION_MODELS, default=defaults.model)
    parser.add_argument("--channels", type=int, default=defaults.channels,
                        help="input channels (MRI contrasts); with --data, the dataset's modalities")
    parser.add_argument("--base-channels", type=int, default=defaults.base_channels, help="width of the first stage")
    parser.add_argument("--depth", type=int, default=defaults.depth, help="down/up steps; size must divide by 2**depth")
    parser.add_argument("--device", default=defaults.device, help="auto (cuda if available), cpu, cuda, cuda:1")
    parser.add_argument("--save", default=None, metavar="PATH", help="write final weights here (safetensors)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="write checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every, metavar="STEPS")
    parser.add_argument("--keep-checkpoints", type=int, default=defaults.keep_checkpoints, metavar="N")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--log-every", type=int, default=defaults.log_every, metavar="STEPS")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress output")
    parser.add_argument("--deterministic", action="store_true", help="deterministic kernels (slower on CUDA)")
    parser.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this global norm")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=defaults.precision,
                        help="forward under torch.autocast in this dtype (fp16 with loss scaling); weights stay fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block of the model (regional)")
    parser.add_argument("--split", choices=SPLIT_CHOICES, default=defaults.split,
                        help="compute U-Net stages in slabs along depth: auto (where no plan fits without; default), "
                             "all, off")
    add_data_arguments(parser)
    parallel = ParallelConfig()
    parser.add_argument("--parallel", choices=PARALLEL_MODES, default=parallel.mode,
                        help="under torchrun: dp (synchronous, overlapped update), fsdp (sharded: FSDP2 per block), "
                             "local-sgd or async (relaxed), "
                             "pipeline (one stage per process) or hybrid (pipeline x data parallel)")
    parser.add_argument("--overlap", choices=OVERLAP_MODES, default=parallel.overlap,
                        help="dp: each bucket's update must be done before its modules' next forward (default), "
                             "before backward returns, or none (plain DDP, update after the whole backward)")
    parser.add_argument("--no-overlap", action="store_true", help="dp: plain DDP (the same as --overlap none)")
    parser.add_argument("--average-every", type=int, default=parallel.average_every, metavar="STEPS", help="local-sgd: H")
    parser.add_argument("--bucket-cap-mb", type=float, default=parallel.bucket_cap_mb, help="DDP gradient bucket size")
    parser.add_argument("--timeout", type=float, default=parallel.timeout_seconds, metavar="SECONDS",
                        help="a collective slower than this fails, naming rank and collective")
    parser.add_argument("--stages", type=int, default=parallel.stages,
                        help="pipeline/hybrid: pipeline ranks per replica (default %(default)s)")
    parser.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default=parallel.schedule,
                        help="pipeline/hybrid: torch's pipeline schedule (default %(default)s)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="pipeline/hybrid: micro-batches per replica and step (default: the planner chooses)")
    parser.add_argument("--stages-per-rank", type=int, default=None,
                        help="pipeline/hybrid: stages per rank (default 2 for interleaved-1f1b, zero-bubble, zbv; else 1)")
    parser.add_argument("--switch-at", action="append", default=[], metavar="STEP:LAYOUT", type=parse_switch,
                        help="from STEP on, train under LAYOUT: dp, local-sgd, async, pipeline[:STAGES] or "
                             "hybrid[:STAGES] (repeatable), e.g. --switch-at 10:dp")
    parser.add_argument("--switch-when", action="append", default=[], metavar="CONDITION:LAYOUT", type=parse_switch_when,
                        help="once a logged metric meets CONDITION (loss<VALUE, dice>VALUE, <=, >=), train under "
                             "LAYOUT from the next step (repeatable), e.g. --switch-when loss<0.5:dp")
    parser.set_defaults(run=run)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    data = DataConfig(path="")
    group = parser.add_argument_group("training on NIfTI files (pip install \"oomless[medical]\")")
    group.add_argument("--data", default=None, metavar="DIR",
                       help="a Medical Segmentation Decathlon task folder (dataset.json) or NAME_image/NAME_label.nii.gz pairs")
    group.add_argument("--stage", default=None, metavar="DIR",
                       help="copy the dataset here once (resumable, checksummed) and decode it to .npy for fast loading")
    group.add_argument("--workers", type=int, default=data.workers,
                       help="loader processes preparing the next batches (default %(default)s; 0: in the training process)")
    group.add_argument("--validate-every", type=int, default=data.validate_every, metavar="STEPS",
                       help="whole-volume validation every STEPS steps (default: after the last step only)")
    group.add_argument("--validation-fraction", type=float, default=data.validation_fraction,
                       help="share of the cases held out for validation, chosen by --seed (default %(default)s)")
    group.add_argument("--no-augment", action="store_true", help="no random flips and 90-degree rotations")
    group.add_argument("--run-dir", default=None, metavar="DIR",
                       help="where the split, validation scores and a predicted segmentation go (default runs/<data folder>)")


def data_config_from_args(args: argparse.Namespace) -> DataConfig | None:
    if args.data is None:
        defaults = DataConfig(path="")
        given = [flag for flag, value, default in (
            ("--stage", args.stage, None), ("--workers", args.workers, defaults.workers),
            ("--validate-every", args.validate_every, defaults.validate_every),
            ("--validation-fraction", args.validation_fraction, defaults.validation_fraction),
            ("--no-augment", args.no_augment, False), ("--run-dir", args.run_dir, None)) if value != default]
        if given:
            raise InputError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} with --data DIR "
                             "(training on NIfTI files); the synthetic volumes need none")
        return None
    size = parse_size(args.size) if args.size is not None else None
    return DataConfig(path=args.data, stage=args.stage, shape=(size,) * 3 if isinstance(size, int) else size,
                      workers=args.workers, validation_fraction=args.validation_fraction,
                      validate_every=args.validate_every, augment=not args.no_augment, run_dir=args.run_dir)


def parse_switch_when(text: str) -> tuple[str, str]:
    """"loss<0.5:dp" -> ("loss<0.5", "dp"); "dice>0.8:hybrid:2" -> ("dice>0.8", "hybrid:2")."""
    condition, _, layout = text.partition(":")
    if not condition or not layout:
        raise argparse.ArgumentTypeError(f"{text!r} is not CONDITION:LAYOUT, e.g. loss<0.5:dp")
    return condition, layout


def parse_switch(text: str) -> tuple[int, str]:
    """"10:dp" -> (10, "dp"); "20:hybrid:2" -> (20, "hybrid:2")."""
    step, _, layout = text.partition(":")
    if not step.isdigit() or not layout:
        raise argparse.ArgumentTypeError(f"{text!r} is not STEP:LAYOUT, e.g. 10:dp or 20:hybrid:2")
    return int(step), layout


def check_parallel_flags(args: argparse.Namespace) -> None:
    """A layout's flag given for a run that never trains under that layout (``--schedule zbv`` under
    dp, ``--average-every 3`` without local-sgd) is refused: silently ignored, it reads as in effect."""
    defaults = ParallelConfig()
    layouts = {args.parallel, *(layout.partition(":")[0] for _, layout in [*args.switch_at, *args.switch_when])}
    if args.no_overlap and args.overlap not in (defaults.overlap, "none"):
        raise InputError(f"--no-overlap and --overlap {args.overlap} contradict each other; give one")
    needs = [("--average-every", args.average_every != defaults.average_every, {"local-sgd"}),
             ("--overlap", args.overlap != defaults.overlap, {"dp"}),
             ("--no-overlap", args.no_overlap, {"dp"}),
             ("--stages", args.stages != defaults.stages, {"pipeline", "hybrid"}),
             ("--schedule", args.schedule != defaults.schedule, {"pipeline", "hybrid"}),
             ("--microbatches", args.microbatches is not None, {"pipeline", "hybrid"}),
             ("--stages-per-rank", args.stages_per_rank is not None, {"pipeline", "hybrid"})]
    for flag, given, applies in needs:
        if given and not layouts & applies:
            raise InputError(f"{flag} applies under --parallel {' or '.join(sorted(applies))} (or a --switch-at / "
                             f"--switch-when to it); this run trains under {', '.join(sorted(layouts))}")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        size=parse_size(args.size) if args.size is not None and args.data is None else TrainConfig.size,
        data=data_config_from_args(args), memory=args.memory, steps=args.steps, seed=args.seed,
        global_batch=args.global_batch, lr=args.lr, model=args.model, channels=args.channels,
        base_channels=args.base_channels, depth=args.depth, device=args.device, save=args.save,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume, log_every=args.log_every,
        progress=not args.quiet, deterministic=args.deterministic, max_grad_norm=args.max_grad_norm,
        precision=args.precision, compile=args.compile, split=args.split,
        parallel=ParallelConfig(mode=args.parallel, overlap="none" if args.no_overlap else args.overlap, average_every=args.average_every,
                                bucket_cap_mb=args.bucket_cap_mb, timeout_seconds=args.timeout, stages=args.stages,
                                schedule=args.schedule, microbatches=args.microbatches,
                                stages_per_rank=args.stages_per_rank, switch=sorted(args.switch_at),
                                switch_when=args.switch_when),
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so `oomless --help` and flag errors stay fast.
    from oomless.sizes import format_bytes
    from oomless.train.loop import train

    config = config_from_args(args).validate()
    check_parallel_flags(args)              # after the values' own checks (--stages 0 says that first)
    result = train(config)
    import os

    if os.environ.get("RANK", "0") != "0":      # under torchrun, rank 0 reports for all
        return 0
    if result.seconds_per_step is None:     # no step trained: no loss, speed or step peak to report
        print(f"done: no step to train, the run is at step {result.steps_done} of --steps {config.steps}"
              + ("; give more --steps to train on from its checkpoint" if config.resume and config.steps else ""))
    else:
        print(f"done: {result.steps_done} steps, loss {result.final_loss:.4f}, dice {result.final_dice:.3f}, "
              f"{result.volumes_per_second:.2f} volumes/s, peak memory {format_bytes(result.peak_memory_bytes)}, "
              f"data wait {result.data_wait_seconds:.2f} s")
    if result.validation:
        print(f"validation: mean dice {result.validation[-1]['mean_dice']:.3f} at step {result.validation[-1]['step']}")
    return 0
