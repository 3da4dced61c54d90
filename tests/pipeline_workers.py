"""Helpers for the pipeline tests: the models and batches both sides train on, the single-process
reference, and the gloo worker that trains a job's pipeline stages (on a pipeline x data mesh when the
job has ``dp`` > 1) and leaves each rank's parameters and buffers (under the original model's names)
and what its stages' plans did in ``out_dir/<job>-rank<i>.pt``.

A job: name, kind ("transformer" | "unet", or "gpt2" | "monai-unet": Hugging Face's GPT-2 and
MONAI's UNet as their libraries build them, traced into a sequence by `oomless.parallel.traced`),
cuts (P x V stages), microbatches, schedule, and
optionally dp (replicas; the world is P x dp), policy (every stage planned by the fit engine with
that decision on every block), clip (gradients clipped to that global norm), volumes (the U-Net's
global batch; default `UNET_VOLUMES`) and global_batchnorm (BatchNorm statistics over every
replica's micro-batch, as `oomless.parallel.pipeline_training` sets up; otherwise each replica's
BatchNorm normalises and tracks its own shard, so replicas' buffers differ and are not saved),
precision ("bf16" | "fp16": the stages under autocast, as `oomless train --precision` runs them,
the whole model's `apply_precision` owning fp16's loss scaler), overflow ({"step", "parameter",
"rank"}: that rank sets one element of that parameter's gradient to inf after that step's backward,
an fp16 overflow only it sees) and compile (torch.compile options for every stage's blocks)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from oomless.models import TinyTransformer, UNet3D
from oomless.parallel.batchnorm import convert_batchnorm_for_data_parallel
from oomless.parallel.block_sequence import sequence_for, transformer_sequence, unet_sequence
from oomless.parallel.pipeline import PipelineParallel, pipeline_mesh
from oomless.parallel.stage_fit import compile_stages, fit_stages
from oomless.parallel.stage_precision import stage_autocast
from oomless.parallel.traced import TracedSequence
from oomless.runtime.precision import apply_precision, autocast_dtype
from tests.parallel_workers import join, rendezvous

STEPS = 5
GLOBAL_BATCH = 8
UNET_VOLUMES = GLOBAL_BATCH // 4


TRACED_KINDS = ("gpt2", "monai-unet")


def build(kind: str):
    """(model, its BlockSequence, loss_fn(output, target)), the same in every process."""
    torch.manual_seed(0)
    if kind in TRACED_KINDS:
        model = traced_model(kind)
        return model, sequence_for(model, batch(kind, 0)[0], output="logits" if kind == "gpt2" else None), \
            _loss_of(kind)
    if kind == "transformer":
        # No dropout: micro-batching draws dropout masks in another order than one whole batch.
        model = TinyTransformer(vocab_size=64, dim=32, depth=6, heads=2, max_len=16, dropout=0.0)
        return model, transformer_sequence(model), lambda logits, target: F.cross_entropy(logits.flatten(0, 1),
                                                                                          target.flatten())
    model = UNet3D(base_channels=2, depth=2)
    return model, unet_sequence(model), F.cross_entropy


def traced_model(kind: str):
    """GPT-2 (2 layers, 64 wide, a 64-token vocabulary; no dropout: micro-batching draws masks in
    another order) or MONAI's UNet (3 levels, BatchNorm) as the user's code would build them."""
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(2, 4, 8), strides=(2, 2), num_res_units=1,
                norm="batch")


def _loss_of(kind: str):
    if kind == "gpt2":
        return lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return F.cross_entropy


def model_output(kind: str, output):
    """The tensor the loss reads: a Hugging Face model returns a ModelOutput."""
    return output.logits if kind == "gpt2" else output


def make_optimizer(parameters):
    # SGD, not Adam: the key part of an attention's qkv bias has an identically zero gradient
    # (softmax ignores a shift shared by all keys), so its gradient is pure summation-order noise,
    # which Adam normalises into lr-sized steps: one process with and without micro-batches already
    # differs by 1.5e-5 there under Adam(lr=1e-3). SGD keeps noise at noise size.
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def batch(kind: str, step: int, volumes: int = UNET_VOLUMES) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    if kind in ("transformer", "gpt2"):
        tokens = torch.randint(0, 64, (GLOBAL_BATCH, 17), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    volumes = torch.randn(volumes, 1, 8, 8, 8, generator=generator)
    return volumes, (volumes[:, 0] > 0).long()


def reference(kind: str, chunks: int = 1, clip: float | None = None, volumes: int = UNET_VOLUMES,
              precision: str = "fp32", overflow: dict | None = None) -> tuple[dict[str, torch.Tensor],
                                                                               dict[str, torch.Tensor]]:
    """(parameters, buffers) after plain PyTorch on one process, the whole global batch per step;
    with ``chunks`` > 1 the batch is split into that many equal chunks whose mean-loss gradients are
    averaged (accumulation): the same gradient for a per-sample loss, but BatchNorm normalises each
    chunk by its own statistics and updates its running statistics once per chunk, in order, as a
    pipeline stage does each micro-batch of each replica. ``precision`` and ``overflow``: see
    `train_reference`."""
    model, _ = train_reference(kind, chunks, clip, volumes, precision, overflow)
    return ({name: parameter.detach().clone() for name, parameter in model.named_parameters()},
            {name: buffer.detach().clone() for name, buffer in model.named_buffers()})


def train_reference(kind: str, chunks: int = 1, clip: float | None = None, volumes: int = UNET_VOLUMES,
                    precision: str = "fp32", overflow: dict | None = None):
    """(model, GradScaler or None) trained as `reference` says. With ``precision`` the forward runs
    under ``torch.autocast`` and the loss on its output brought to fp32 (what oomless's precision does
    in one process, tests/test_precision.py), fp16 with ``torch.amp.GradScaler`` (unscale_ before
    clipping); ``overflow`` sets one element of ``overflow["parameter"]``'s gradient to inf after
    step ``overflow["step"]``'s backward, which GradScaler skips."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # the workers run one thread; CPU kernels' sums depend on the split
    try:
        if kind in TRACED_KINDS:        # the reference needs no sequence: not traced
            torch.manual_seed(0)
            model, loss_fn = traced_model(kind), _loss_of(kind)
        else:
            model, _, loss_fn = build(kind)
        optimizer = make_optimizer(model.parameters())
        dtype = autocast_dtype(precision)
        scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
        for step in range(STEPS):
            inputs, target = batch(kind, step, volumes)
            optimizer.zero_grad()
            for part, part_target in zip(inputs.chunk(chunks), target.chunk(chunks)):
                with stage_autocast("cpu", dtype):
                    output = model_output(kind, model(part))
                loss = loss_fn(output.float(), part_target) / chunks
                (loss if scaler is None else scaler.scale(loss)).backward()
            if overflow is not None and step == overflow["step"]:
                dict(model.named_parameters())[overflow["parameter"]].grad.view(-1)[0] = float("inf")
            if scaler is not None:
                scaler.unscale_(optimizer)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
    finally:
        torch.set_num_threads(threads)
    return model, scaler


def _worker(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    torch.set_num_threads(1)
    join(rank, world_size, port)     # at exit gloo's threads may still be freeing work: join guards it
    try:
        for job in jobs:
            mesh = pipeline_mesh(world_size // job.get("dp", 1))
            replica, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
            model, sequence, loss_fn = build(job["kind"])
            if job.get("global_batchnorm"):
                convert_batchnorm_for_data_parallel(model, torch.device("cpu"), mesh["dp"].get_group())
                if isinstance(sequence, TracedSequence):    # its blocks call the BatchNorms swapped out
                    sequence = sequence.rebuilt()
            volumes = job.get("volumes", UNET_VOLUMES)
            inputs, _ = batch(job["kind"], 0, volumes)
            example = (inputs.chunk(replicas)[replica].chunk(job["microbatches"])[0],)
            # Over the whole model, as the training loop's: parameters of other ranks' stages get no
            # gradient and are skipped. Built first: fp16's loss scaler hooks its steps.
            optimizer = make_optimizer(model.parameters())
            precision = job.get("precision", "fp32")
            scaler = None
            if precision != "fp32":
                # As the training loop: the whole model's precision owns the loss scaler (its forward never runs).
                scaler = apply_precision(model, precision, optimizer).scaler
            pipeline = PipelineParallel(sequence, job["cuts"], loss_fn, job["microbatches"], job["schedule"],
                                        group=mesh["pp"].get_group(), dp_group=mesh["dp"].get_group(),
                                        example=example, precision=precision, scaler=scaler)
            plans = []
            if "policy" in job:
                _, target = batch(job["kind"], 0, volumes)
                target = target.chunk(replicas)[replica].chunk(job["microbatches"])[0]
                plans = fit_stages(pipeline, "64GiB", target=target, policy=job["policy"],
                                   min_swap_bytes=0,     # the tiny models' saved tensors are small
                                   compile=job.get("compile"))
            elif "compile" in job:
                compile_stages(pipeline, job["compile"])
            if "compile" in job:
                torch._dynamo.reset()       # graphs cached by an earlier job would not be counted again
            overflow = job.get("overflow")
            graphs_before = _compiled_graphs()
            for step in range(STEPS):
                inputs, target = batch(job["kind"], step, volumes)
                optimizer.zero_grad()
                pipeline.step(inputs.chunk(replicas)[replica], target=target.chunk(replicas)[replica])
                if overflow is not None and step == overflow["step"] and rank == overflow["rank"]:
                    dict(model.named_parameters())[overflow["parameter"]].grad.view(-1)[0] = float("inf")
                if "clip" in job:
                    pipeline.clip_grad_norm_(job["clip"])
                optimizer.step()
            held = {id(parameter) for parameter in pipeline.parameters()}
            held_buffers = {id(buffer) for module in pipeline.modules for buffer in module.buffers()}
            torch.save({
                "parameters": {name: parameter.detach().clone() for name, parameter in model.named_parameters()
                               if id(parameter) in held},
                "buffers": {name: buffer.detach().clone() for name, buffer in model.named_buffers()
                            if id(buffer) in held_buffers and buffers_agree(job)},
                # What each of this rank's stages was planned to do, and what its runtime did.
                "stages": [{"decisions": sorted(set(plan.decisions.values())),
                            "saving_blocks": sum(block.saved_bytes > 0 for block in plan.blocks),
                            "saved_bytes": sum(block.saved_bytes for block in plan.blocks),
                            "precision": plan.precision,
                            "output_freed_bytes": plan.output_freed_bytes,
                            **_runtime_counts(module)} for plan, module in zip(plans, pipeline.modules)],
                # fp16: this rank's loss scale and skipped steps.
                "scaler": None if scaler is None else {"scale": scaler.scale, "skipped_steps": scaler.skipped_steps},
                # Compiled: this rank's stage modules running compiled code, and the graphs dynamo made.
                "compiled": {"modules": sum(getattr(inner, "_compiled_call_impl", None) is not None
                                            for module in pipeline.modules for inner in module.modules()),
                             "graphs": _compiled_graphs() - graphs_before},
            }, Path(out_dir) / f"{job['name']}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def buffers_agree(job: dict) -> bool:
    """Whether every replica of a stage holds the same buffers (so they are saved and compared)."""
    return job.get("dp", 1) == 1 or job.get("global_batchnorm", False)


def reference_chunks(job: dict) -> int:
    """The chunks of the global batch the reference normalises separately, as the job's BatchNorms do:
    each micro-batch of each replica, or each micro-batch across the replicas."""
    if job["kind"] not in ("unet", "monai-unet"):        # the models with BatchNorm
        return 1
    if job.get("global_batchnorm"):
        assert job["microbatches"] == 1, "replicas' micro-batches m > 0 are not chunks of the global batch"
        return 1
    return job.get("dp", 1) * job["microbatches"]


def _runtime_counts(module) -> dict[str, int]:
    """A stage module's `oomless.stats` counts; zeros where no plan is installed on it."""
    import oomless
    from oomless.runtime.install import installed_state

    if installed_state(module) is None:
        return {"recomputed_blocks": 0, "offloaded_bytes": 0}
    stats = oomless.stats(module)
    return {"recomputed_blocks": stats.recomputed_blocks, "offloaded_bytes": stats.offloaded_bytes}


def runnable_here(jobs: list[dict]) -> list[dict]:
    """``jobs`` without those this torch refuses on gloo (ZB-V under torch 2.11: `zbv_starts_on_gloo`)."""
    from oomless.parallel.pipeline import zbv_starts_on_gloo

    return [job for job in jobs if job["schedule"] != "zbv" or zbv_starts_on_gloo()]


def run_pipeline_jobs(world_size: int, jobs: list[dict], out_dir: Path) -> dict[str, dict]:
    """Run ``jobs`` in ``world_size`` gloo processes; per job, {"parameters": every stage's parameters
    merged, "buffers": the same of buffers (jobs without replicas), "stages": per rank, what each of
    its stages' plans said and did (jobs with a policy), "scalers": per rank, fp16's loss scale and
    skipped steps (None without fp16), "compiled": per rank, stage modules compiled and graphs made}."""
    with rendezvous() as port:
        mp.start_processes(_worker, args=(world_size, port, jobs, str(out_dir)), nprocs=world_size,
                           start_method="spawn")
    merged = {}
    for job in jobs:
        result = merged[job["name"]] = {"parameters": {}, "buffers": {}, "stages": [], "scalers": [], "compiled": []}
        for rank in range(world_size):
            saved = torch.load(Path(out_dir) / f"{job['name']}-rank{rank}.pt", weights_only=True)
            result["stages"].append(saved["stages"])
            result["scalers"].append(saved["scaler"])
            result["compiled"].append(saved["compiled"])
            for kind in ("parameters", "buffers"):
                for name, tensor in saved[kind].items():
                    # A tied parameter lives on two stages, every parameter on each replica: all copies
                    # must have taken the same update.
                    if name in result[kind]:
                        assert torch.equal(result[kind][name], tensor), name
                    result[kind][name] = tensor
    return merged


def _refusal_worker(rank: int, world_size: int, port: int, refusing: list[list[int]], out_dir: str) -> None:
    """`fit_stages` on the transformer's 2-stage pipeline x world/2 replicas (1f1b, 2 micro-batches),
    once per entry of ``refusing``, with `oomless.plan` made to refuse every budget short of
    `stage_fit.UNLIMITED` on those ranks (a stand-in for a profile that read more memory there). Writes
    what this rank got, per entry, to ``out_dir/refusal-rank<i>.json``: the plans' decisions or the
    error, and whether a plan was left installed on its stage."""
    import json

    import oomless
    from oomless.errors import PlanError
    from oomless.parallel.stage_fit import UNLIMITED
    from oomless.runtime.install import installed_state

    torch.set_num_threads(1)
    join(rank, world_size, port)
    planning, outcomes = oomless.plan, []
    try:
        for refusing_ranks in refusing:
            def plan(model, example_inputs, memory, **kwargs):
                if rank in refusing_ranks and memory != UNLIMITED:
                    raise PlanError(f"rank {rank} refuses {memory} bytes", minimum_bytes=memory + 3 * 2**20,
                                    limiting_block="layers.0")
                return planning(model, example_inputs, memory, **kwargs)

            oomless.plan = plan
            mesh = pipeline_mesh(2)
            replica, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
            model, sequence, loss_fn = build("transformer")
            inputs, target = batch("transformer", 0)
            pipeline = PipelineParallel(sequence, [0, 4, 8], loss_fn, 2, "1f1b", group=mesh["pp"].get_group(),
                                        dp_group=mesh["dp"].get_group(),
                                        example=(inputs.chunk(replicas)[replica].chunk(2)[0],))
            try:
                plans = fit_stages(pipeline, "64MiB", target=target.chunk(replicas)[replica].chunk(2)[0])
                outcome = {"decisions": [sorted(set(plan.decisions.values())) for plan in plans]}
            except PlanError as refusal:
                outcome = {"error": str(refusal), "minimum_bytes": refusal.minimum_bytes}
            outcome["installed"] = [installed_state(module) is not None for module in pipeline.modules]
            outcomes.append(outcome)
    finally:
        oomless.plan = planning
        dist.destroy_process_group()
    Path(out_dir, f"refusal-rank{rank}.json").write_text(json.dumps(outcomes))


def run_refusals(world_size: int, refusing: list[list[int]], out_dir: Path) -> list[list[dict]]:
    """Per rank, `_refusal_worker`'s outcomes, one per entry of ``refusing``."""
    import json

    with rendezvous() as port:
        mp.start_processes(_refusal_worker, args=(world_size, port, refusing, str(out_dir)), nprocs=world_size,
                           start_method="spawn")
    return [json.loads(Path(out_dir, f"refusal-rank{rank}.json").read_text()) for rank in range(world_size)]
