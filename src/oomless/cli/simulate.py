"""``oomless simulate MODEL``: every parallel layout's step time, memory per rank and throughput on
a cluster you may not have, and the fastest that fits (`oomless.simulate`).

    oomless simulate transformer --input-shape 1,2048 --global-batch 256 --target h100 --gpus 64 --nodes 8 \\
        --precision bf16 --model-arg vocab_size=32000 --model-arg dim=8192 --model-arg depth=86 \\
        --model-arg heads=64 --model-arg max_len=2048
    oomless simulate mlp --input-shape 8,256 --global-batch 64 --target h100 --gpus 8 --json
    oomless simulate unet3d --input-shape 1,1,128,128,128 --global-batch 16 --target a100 --gpus 16 --nodes 2 \\
        --cluster cluster.json --plot timeline.png
    oomless simulate hf:llama --input-shape 1,2048 --global-batch 64 --gpus 8 --loss fused-next-token \\
        --model-arg num_hidden_layers=8 --model-arg hidden_size=1024 --model-arg num_attention_heads=8

Nothing runs here: the model is built on the meta device and one step is profiled on meta tensors
(a few layers of a deep model's identical stack) at each batch a layout runs at once (dp's per-rank
batch, each pipeline micro-batch), with the input shape's other sides. The loss
is `oomless plan`'s (``--loss``, `oomless.cli.planned_loss`): a language model's next-token
cross-entropy by default, which a pipeline runs on its last stage. For the models `oomless train`
trains, the last lines give the command that runs the recommended layout (`cli.train_command`).
"""

import argparse
import sys

from oomless.cli.plan import _DTYPES, check_model_runs, parse_model_args, parse_shape
from oomless.cli.planned_loss import add_loss_argument, check_loss, planned_step, resolve_loss
from oomless.cli.train_command import train_command
from oomless.errors import InputError


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "simulate", help="predict every parallel layout on a cluster and recommend one",
        description="Predict step time, memory per rank and throughput of dp, fsdp, pipelines and dp x pp "
                    "hybrids of MODEL on GPUS target devices, each with its memory plan and --loss (as oomless "
                    "plan's: a language model's next-token cross-entropy by default, on a pipeline's last stage); "
                    "recommend the fastest that fits.")
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("--input-shape", required=True, metavar="B,...",
                        help="an example input's shape, batch first; each layout's step is profiled at its own batch "
                             "with the other sides")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step over all GPUs")
    parser.add_argument("--target", default="h100", help="device type (default %(default)s)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default %(default)s)")
    parser.add_argument("--cluster", default=None, metavar="FILE",
                        help="JSON with the links within and between nodes (see oomless.plan.cluster)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the model factory; repeat for several")
    parser.add_argument("--optimizer", choices=("adam", "sgd", "none"), default="adam",
                        help="optimizer whose state is counted (default %(default)s)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                        help="cast parameters and inputs to this dtype (default: the model's own)")
    parser.add_argument("--precision", choices=tuple(_DTYPES), default="fp32",
                        help="the step under torch.autocast in this dtype (default %(default)s)")
    add_loss_argument(parser)
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw the recommended layout's step timeline")
    parser.add_argument("--json", action="store_true", help="print the simulation as JSON")
    parser.set_defaults(run=run)


def check_arguments(args: argparse.Namespace) -> tuple:
    """Every flag checked before a model is built; returns the input shape."""
    from oomless.output_paths import check_output_path
    from oomless.plan.cluster import check_counts
    from oomless.plan.devices import find_device
    from oomless.plan.layouts import check_global_batch

    shape = parse_shape(args.input_shape)
    check_loss(args.loss, args.model)
    find_device(args.target)
    check_counts(args.gpus, args.nodes)
    check_global_batch(args.global_batch, args.gpus)
    if args.plot:
        check_output_path(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError('--plot needs matplotlib, which is not installed: pip install "oomless[plot]"') from None
    return shape


def run(args: argparse.Namespace) -> int:
    import torch

    import oomless
    from oomless.models import build_model, example_input_for

    shape = check_arguments(args)
    model_kwargs = parse_model_args(args.model_arg)
    with torch.device("meta"):
        model = build_model(args.model, **model_kwargs)
    example = example_input_for(args.model, shape=shape, **model_kwargs).to("meta")
    optimizer = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "none": None}[args.optimizer]
    optimizer = optimizer(model.parameters(), lr=1e-3) if optimizer else None   # the whole model's, a head too
    check_model_runs(model, example, args.model)
    whole = model
    model, loss_fn = planned_step(args.loss, args.model, model, example)

    def example_at(samples: int):
        """The example and its loss at another batch: each layout's step is traced at its own (on
        meta tensors, which hold no values: none is drawn)."""
        inputs = torch.empty((samples, *shape[1:]), dtype=example.dtype, device="meta")
        return inputs, planned_step(args.loss, args.model, whole, inputs)[1]

    simulation = oomless.simulate(
        model, example, args.global_batch, target=args.target, gpus=args.gpus, nodes=args.nodes,
        cluster=args.cluster, loss_fn=loss_fn, optimizer=optimizer,
        dtype=getattr(torch, _DTYPES[args.dtype]) if args.dtype else None, precision=args.precision,
        example_at=example_at)
    simulation.model, simulation.loss = args.model, resolve_loss(args.loss, args.model)
    simulation.train_command = train_command(
        args.model, model_kwargs, shape, args.global_batch, args.gpus, args.nodes,
        simulation.cluster["device_memory_bytes"], simulation.best, args.precision, args.optimizer, args.dtype)
    print(simulation.to_json() if args.json else simulation)
    if args.plot:
        if simulation.best is None:
            print("no layout fits: no timeline drawn", file=sys.stderr)
        else:
            print(f"step timeline of {simulation.recommended} written to {simulation.plot(args.plot)}",
                  file=sys.stderr if args.json else sys.stdout)
    return 0
