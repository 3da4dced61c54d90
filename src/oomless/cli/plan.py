"""``oomless plan MODEL``: build a model by name, make its example input, print ``oomless.plan(...)``.

    oomless plan unet3d --input-shape 1,1,64,64,64 --memory 2GiB
    oomless plan transformer --batch 8 --memory 512MiB --json --model-arg depth=12
    oomless plan my_package.nets:make_net --input-shape 4,3,224,224 --memory 20GiB --target h100
    oomless plan unet3d --input-shape 1,1,256,256,256 --memory 80GiB --target h100 --plot plan.png
    oomless plan hf:gpt2 --input-shape 8,512 --memory 2GiB --loss fused-next-token \
        --model-arg n_layer=4 --model-arg n_embd=256 --model-arg n_head=4
    oomless plan transformer --input-shape 8,2048 --memory 80GiB --target h100 --dtype bf16 \
        --model-arg vocab_size=50257 --model-arg dim=2048 --model-arg depth=18 --model-arg heads=16 \
        --model-arg max_len=2048

With --target nothing runs on this machine: the model is built on the meta device and profiled on
meta tensors (`oomless.profile.fake`), timed by the target's roofline (`oomless.plan.devices`).
"""

import argparse
import ast
import sys

from oomless.cli.planned_loss import add_loss_argument, check_loss, planned_step
from oomless.errors import InputError, one_line


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(side) for side in text.replace("x", ",").split(","))
    except ValueError:
        raise InputError(f"--input-shape {text!r} is not comma-separated integers like 1,1,64,64,64") from None
    if not shape or any(side <= 0 for side in shape):
        raise InputError(f"--input-shape {text!r} needs positive sides")
    return shape


def parse_model_args(pairs: list[str]) -> dict:
    """``key=value`` pairs; values are Python literals (8, 0.1, (16, 32)) or else plain strings."""
    kwargs = {}
    for pair in pairs:
        key, separator, value = pair.partition("=")
        if not separator or not key.isidentifier():
            raise InputError(f"--model-arg {pair!r} is not key=value")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "plan", help="print where each block's activations would live under a memory budget",
        description="Plan keep/swap/recompute per block of MODEL (a registered name such as unet3d, "
                    "transformer, mlp, cnn, monai-unet, or package.module:factory) for a memory budget.",
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("--memory", required=True, help="device memory budget for the whole step, e.g. 2GiB")
    parser.add_argument("--input-shape", default=None, metavar="N,C,...",
                        help="example input shape (default: the model's own, with --batch and --size)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (overrides the shape's first entry)")
    parser.add_argument("--size", type=int, default=32, help="spatial side or sequence length for default shapes")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the model factory; repeat for several")
    parser.add_argument("--blocks", nargs="+", default=None, metavar="NAME",
                        help="module names or class names to plan as blocks (default: repeated children)")
    parser.add_argument("--optimizer", choices=("adam", "sgd", "none"), default="adam",
                        help="optimizer whose state is counted (default %(default)s)")
    parser.add_argument("--target", default=None, help="plan for this device (e.g. h100) on fake tensors")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                        help="with --target: cast parameters and inputs to this dtype (default: the model's own)")
    parser.add_argument("--precision", choices=tuple(_DTYPES), default="fp32",
                        help="the step under torch.autocast in this dtype (weights stay fp32; default %(default)s)")
    parser.add_argument("--split", choices=("auto", "all", "off"), default="auto",
                        help="compute chains (U-Net stages) in slabs along depth: auto (where no plan fits without; "
                             "default), all, off")
    add_loss_argument(parser)
    parser.add_argument("--solver", choices=("auto", "greedy", "exact"), default="auto",
                        help="plan search (default %(default)s: exact up to 300 blocks, and greedy)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write memory over one step, plain PyTorch vs the plan, with the budget line")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def check_model_runs(model, example, model_name: str) -> None:
    """One forward without autograd before profiling: an input the model cannot take (a wrong
    --input-shape) is the user's mistake and reads as one line; a failure after this point is
    oomless's own and keeps its traceback. Evaluation mode and a forked RNG leave BatchNorm
    statistics and the random stream as they were."""
    import torch

    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            if not _runs_on_meta(model, example):
                model(example)          # the real forward, for its own error (or an op meta tensors lack)
    except Exception as error:          # whatever the user's model raises on this input
        raise InputError(f"model {model_name!r} fails on its example input of shape {tuple(example.shape)}: "
                         f"{one_line(error)}; give the shape it takes with --input-shape N,C,...") from None
    finally:
        for module, training in modes.items():
            module.training = training


def _runs_on_meta(model, example) -> bool:
    """Whether the forward runs on meta stand-ins of the parameters, buffers and input: the shapes
    checked without the memory of a real forward (a 3D U-Net's at 232^3 is over a GiB)."""
    from oomless.profile.tensors import attributes_kept, stand_ins_swapped

    if example.device.type == "meta":
        return False            # the model is on meta already: the real forward allocates nothing
    try:
        with attributes_kept(model), stand_ins_swapped(model, lambda tensor: tensor.detach().to("meta")):
            model(example.to("meta"))
    except Exception:           # an op without a meta kernel, a value read in Python, or a wrong shape
        return False
    return True


def check_arguments(args: argparse.Namespace) -> None:
    """Every flag checked before a model is built (a mistake costs no minutes of model building)."""
    from oomless.output_paths import check_output_path
    from oomless.plan.devices import find_device
    from oomless.sizes import parse_bytes

    parse_bytes(args.memory)
    check_loss(args.loss, args.model)
    for flag, value in (("--batch", args.batch), ("--size", args.size)):
        if value is not None and value <= 0:
            raise InputError(f"{flag} must be positive, got {value}")
    if args.dtype is not None and not args.target:
        raise InputError("--dtype applies with --target (planning on meta tensors); without it the "
                         "model runs here as built")
    if args.target:
        find_device(args.target)
    if args.plot:
        check_output_path(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError('--plot needs matplotlib, which is not installed: pip install "oomless[plot]"') from None


def run(args: argparse.Namespace) -> int:
    import torch

    import oomless
    from oomless.models import build_model, example_input_for

    check_arguments(args)
    model_kwargs = parse_model_args(args.model_arg)
    # Parsed here, not as an argparse type: argparse would swap this message for "invalid value".
    shape = parse_shape(args.input_shape) if args.input_shape is not None else None
    if shape is not None and args.batch is not None:
        shape = (args.batch, *shape[1:])
    # For a target device nothing runs here: build on the meta device so a model bigger than this
    # machine's memory can still be planned.
    device = torch.device("meta") if args.target else torch.device("cpu")
    if device.type == "cpu":
        # The memory rule the profile measures under, from before the model is built, as `oomless
        # train` sets it (`profile.profiler`'s note says why).
        from oomless.profile.rss import return_freed_memory_to_the_system
        return_freed_memory_to_the_system()
    with device:
        model = build_model(args.model, **model_kwargs)
    example = example_input_for(args.model, batch=args.batch or 1, size=args.size, shape=shape,
                                **model_kwargs).to(device)
    check_model_runs(model, example, args.model)
    optimizer = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "none": None}[args.optimizer]
    optimizer = optimizer(model.parameters(), lr=1e-3) if optimizer else None   # the whole model's, a head too
    model, loss_fn = planned_step(args.loss, args.model, model, example)
    plan_kwargs = {"memory": args.memory, "target": args.target, "loss_fn": loss_fn,
                   "precision": args.precision, "split": {"auto": None, "all": True, "off": False}[args.split],
                   "optimizer": optimizer}
    if args.blocks:
        plan_kwargs["blocks"] = args.blocks
    if args.dtype is not None:
        plan_kwargs["dtype"] = getattr(torch, _DTYPES[args.dtype])
    # With --split auto on this machine the planner measures the step itself: it first estimates
    # whether the step unsplit can fit at all, and never measures one that cannot (oomless.plan.splitting).
    # Elsewhere, a plot's profile is measured first and planned from.
    def measured(split):
        return oomless.profile(model, example, loss_fn=plan_kwargs["loss_fn"], optimizer=plan_kwargs["optimizer"],
                               blocks=args.blocks, target=args.target, dtype=plan_kwargs.get("dtype"),
                               precision=args.precision, split=split)

    measure_first = args.plot is not None and (args.target is not None or plan_kwargs["split"] is not None)
    profile = measured(plan_kwargs["split"]) if measure_first else None
    plan = oomless.plan(model, example, profile=profile, solver=args.solver, **plan_kwargs)
    print(plan.to_json() if args.json else plan)
    if args.plot:
        if profile is None or (plan.split or {}) != (profile.split or {}):
            # The step the plan was made for, measured for the plot (chains split as the plan has them).
            profile = measured(plan.split or False)
        from oomless.plan.plot import plot_plan
        print(f"memory over one step written to {plot_plan(profile, plan, args.plot)}",
              file=sys.stderr if args.json else sys.stdout)
    return 0
