"""The public function simulate (DESIGN.md section 1): every parallel layout of a model predicted for
a cluster, on meta tensors."""

import torch
import torch.nn as nn

from oomless.api import sum_of_outputs
from oomless.arguments import check_fp16_loss_parameters, check_plan_arguments
from oomless.errors import InputError
from oomless.profile.profile import Profile
from oomless.profile.tensors import tensors_in
from oomless.runtime.precision import autocast_dtype


def simulate(model: nn.Module, example_inputs, global_batch: int, target="h100", gpus: int = 8, nodes: int = 1,
             cluster=None, loss_fn=None, optimizer=None, dtype: torch.dtype | None = None, precision: str = "fp32",
             profile: Profile | None = None, example_at=None):
    """Predict step time, memory per rank and throughput of every parallel layout (dp, fsdp,
    pipelines under each schedule, dp x pp hybrids, each with its memory plan) for ``gpus``
    ``target`` devices on ``nodes`` nodes, training ``model`` at ``global_batch`` samples per step,
    and recommend the fastest that fits (`oomless.plan.layouts`). Nothing runs for real: the step
    is profiled on meta tensors (a few of a deep model's identical layers,
    `oomless.profile.repeated`) at each batch a layout runs at once: dp's and fsdp's per-rank batch,
    each pipeline micro-batch. ``example_at(samples)`` returns the example inputs of that many
    samples and the loss function for them, as a pair; without it, an example that is one tensor
    with ``loss_fn`` None or `sum_of_outputs` is resized along its first dimension, and any other
    step is profiled at the batch of ``example_inputs`` only and scaled linearly to each layout's
    (a note says so: a small batch's time and a larger batch's working memory are then off), as a
    ``profile`` given is (it takes no ``example_at``). ``profile`` may also be a dict of profiles
    measured at several batches, ``{samples: Profile}``, one of them at the example's batch: each
    layout's batch is then scaled from the measured batch nearest to it (by ratio), so a pipeline's
    micro-batches take the per-sample time a small batch really runs at. Where the step does not run at a batch (a
    BatchNorm layer of one sample), that batch is scaled from the example's and a note says why.

    ``cluster``: a JSON file's path or a dict with the links within and between nodes
    (`oomless.plan.cluster`; default: the target's usual node, e.g. 8 H100 on NVLink 4, InfiniBand
    NDR between nodes). ``loss_fn``, ``optimizer``, ``dtype``, ``precision``: as for `plan`; a
    ``profile`` made for the target is reused. The loss runs on a pipeline's last stage, with its
    saved tensors and its time; parameters it reads itself (a head fused with the loss,
    `oomless.linear_cross_entropy`, reading the head's weight) count as the model's, held there too
    (`oomless.profile.loss_parameters`). Returns a `Simulation` (prints, ``to_json``, ``plot``)."""
    import time

    from oomless.plan.cluster import make_cluster
    from oomless.plan.layout_report import Simulation
    from oomless.plan.layouts import check_global_batch, estimate_layouts, recommend
    from oomless.profile.loss_parameters import with_loss_parameters
    from oomless.profile.repeated import profile_few_layers

    started = time.perf_counter()
    if target is None:
        raise InputError("simulate needs a target device, e.g. target='h100' (see oomless.plan.devices)")
    path, overrides = (None, cluster) if cluster is None or isinstance(cluster, dict) else (str(cluster), None)
    made = make_cluster(target, gpus, nodes, path, overrides)
    check_global_batch(global_batch, made.gpus)
    batch = _batch_of(example_inputs)
    measured = _measured_profiles(profile, batch) if isinstance(profile, dict) else None
    if measured is not None:
        profile = measured[batch]
    check_plan_arguments(model, example_inputs, loss_fn, optimizer, None, None, 0, profile, dtype, made.device,
                         function="simulate")
    autocast_dtype(precision)
    check_fp16_loss_parameters(precision, loss_fn, model)
    first = tensors_in(example_inputs)[0]
    if example_at is not None and not callable(example_at):
        raise InputError(f"example_at must be a function of a batch size returning (example_inputs, loss_fn), "
                         f"got {type(example_at).__name__}")
    if example_at is not None and profile is not None:
        raise InputError("simulate takes a profile or example_at, not both: a profile given is scaled to each "
                         "layout's batch, example_at traces the step at each")
    if example_at is None and profile is None and isinstance(example_inputs, torch.Tensor) \
            and example_inputs.dim() and loss_fn in (None, sum_of_outputs):
        def example_at(samples: int):
            shape = (samples, *example_inputs.shape[1:])
            return torch.empty(shape, dtype=example_inputs.dtype, device="meta"), loss_fn

    def profiled(inputs, loss, traced: Profile | None = None) -> tuple[Profile, Profile | None, list[str]]:
        """The step's profile (``traced`` where given), the same with the pipeline's blocks, notes."""
        if traced is None:
            traced = profile_few_layers(model, inputs, made.device, loss_fn=loss, optimizer=optimizer, dtype=dtype,
                                        precision=precision)
        # A head fused with the loss (oomless.linear_cross_entropy) reads its weight outside the model profiled.
        traced = with_loss_parameters(traced, model, loss, dtype)
        return (traced, *_pipeline_profile(model, traced))

    given = profile is not None
    profile, pipeline_profile, notes = profiled(example_inputs, loss_fn, profile)
    profile_at = None
    if measured is not None and len(measured) > 1:
        profile_at = _nearest_measured(measured, lambda traced: profiled(example_inputs, loss_fn, traced)[:2])
        notes.append(f"profiled at batches of {', '.join(map(str, sorted(measured)))}; each layout's batch scaled "
                     "linearly from the nearest")
    elif example_at is None:
        notes.append(f"profiled at a batch of {batch} and scaled linearly to each layout's batch"
                     + ("" if given else ": pass example_at to trace the step at each batch"))
    else:
        profile_at = _traced_at_each_batch(example_at, lambda inputs, loss: profiled(inputs, loss)[:2],
                                           profile, pipeline_profile, batch, notes)
    estimates = estimate_layouts(profile, batch, made, global_batch, pipeline_profile, profile_at)
    best = recommend(estimates)
    tokens = int(first.shape[1]) if first.dim() == 2 and not first.is_floating_point() else None
    return Simulation(type(model).__name__, made.describe(), made.summary(), global_batch, batch, estimates,
                      best.name if best else None, tokens, notes=list(profile.notes) + notes,
                      elapsed_seconds=time.perf_counter() - started,
                      flops_per_sample=None if profile.flops is None else profile.flops / batch,
                      peak_flops_per_second=profile.peak_flops_per_second)


def _batch_of(example_inputs) -> int:
    found = tensors_in(example_inputs)
    return int(found[0].shape[0]) if found and found[0].dim() else 1


def _measured_profiles(profiles: dict, batch: int) -> dict[int, Profile]:
    """``profiles`` checked: {samples: Profile}, one at the example's ``batch``."""
    if not profiles or not all(isinstance(samples, int) and not isinstance(samples, bool) and samples > 0
                               and isinstance(each, Profile) for samples, each in profiles.items()):
        raise InputError("profile, given as a dict, must map batch sizes (positive ints) to profiles from "
                         f"oomless.profile(...), got {profiles!r:.200}")
    if batch not in profiles:
        raise InputError(f"profile, given as a dict, must hold a profile at the example's batch of {batch} "
                         f"samples; it has {', '.join(map(str, sorted(profiles)))}")
    return dict(profiles)


def _nearest_measured(measured: dict[int, Profile], prepare):
    """A function of a batch size: the profile measured at the batch nearest to it by ratio, scaled
    linearly to it, through ``prepare`` (which gives (profile, pipeline profile)); once a batch."""
    import math

    from oomless.plan.microbatches import scale_profile

    made: dict[int, tuple] = {}

    def at(samples: int):
        if samples not in made:
            nearest = min(measured, key=lambda each: (abs(math.log(samples / each)), each))
            chosen = measured[nearest]
            made[samples] = prepare(chosen if nearest == samples else scale_profile(chosen, samples / nearest))
        return made[samples]

    return at


def _example_of(example_at, samples: int):
    """``example_at(samples)``, checked: (inputs of ``samples`` samples, their loss function)."""
    example = example_at(samples)
    if not isinstance(example, (tuple, list)) or len(example) != 2:
        raise InputError(f"example_at({samples}) must return (example_inputs, loss_fn), got "
                         f"{type(example).__name__}")
    found = tensors_in(example[0])
    got = (int(found[0].shape[0]) if found[0].dim() else 1) if found else None
    if got != samples:
        raise InputError(f"example_at({samples}) returned inputs of {got} samples (their first tensor's first "
                         f"dimension); it must return inputs of the batch it is given")
    return example


def _traced_at_each_batch(example_at, trace, profile: Profile, pipeline_profile: Profile | None, batch: int,
                          notes: list[str]):
    """A function of a batch size: ``trace(*example_at(samples))``, once a batch; where the step
    does not run at a batch (a BatchNorm layer of one sample), the example's profile scaled to it,
    and a note saying so."""
    from oomless.errors import one_line
    from oomless.plan.microbatches import scale_profile

    traced: dict[int, tuple[Profile, Profile | None]] = {}

    def at(samples: int) -> tuple[Profile, Profile | None]:
        if samples not in traced:
            inputs, loss = _example_of(example_at, samples)
            try:
                traced[samples] = trace(inputs, loss)
            except Exception as error:      # whatever the model raises at that batch
                notes.append(f"the step could not be traced at a batch of {samples} ({one_line(error)}): "
                             f"scaled from the example's {batch}")
                fraction = samples / batch
                traced[samples] = (scale_profile(profile, fraction),
                                   None if pipeline_profile is None else scale_profile(pipeline_profile, fraction))
        return traced[samples]
    return at


def _pipeline_profile(model: nn.Module, profile: Profile) -> tuple[Profile | None, list[str]]:
    """``profile`` with its blocks merged into those the pipeline layouts cut between (the trainer
    cuts only between the blocks of the model's `BlockSequence`), and a note where it cannot be."""
    from oomless.parallel.block_sequence import pipeline_block_groups
    from oomless.plan.microbatches import merge_blocks

    names = [block.name for block in profile.blocks]
    try:
        groups = pipeline_block_groups(model, names)
    except (AttributeError, InputError):     # a profile of other blocks than the model's
        groups = None
    if groups is None:
        return None, ["pipelines cut between the profile's blocks: the trainer cuts a model without a "
                      "hand-written BlockSequence between the blocks torch.export traces, which may differ"]
    if len(groups) == len(names):
        return None, []
    return merge_blocks(profile, groups), [f"pipelines cut between the model's {len(groups)} pipeline blocks "
                                           f"({', '.join(name for name, _ in groups)})"]
