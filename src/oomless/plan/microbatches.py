"""Choosing the number of micro-batches for a pipeline (issue 5: "micro-batch count chosen by the
planner"): each candidate M is partitioned on the profile of one micro-batch (the whole-batch
profile scaled to 1 / M, or one profiled at that batch where the caller can: `oomless.simulate`
traces each on meta tensors), and the fastest predicted step that fits memory wins
(`oomless.plan.partition`'s docstring gives the cost model, `oomless.plan.schedules` the step time
of each schedule).

    partition = choose_microbatches(whole_batch_profile, 4, 32, "20GiB", schedule="interleaved-1f1b",
                                    stages_per_rank=2)
    partition.microbatches, partition.notes      # the M chosen, and what every M predicted
"""

import math
from collections.abc import Callable
from dataclasses import replace

from oomless.errors import InputError, PlanError
from oomless.plan.partition import DEFAULT_OVERHEAD_SECONDS, Partition, partition_stages
from oomless.plan.schedules import check_schedule, microbatch_problem
from oomless.profile.profile import Profile, flops_of
from oomless.sizes import format_bytes


def scale_profile(profile: Profile, fraction: float) -> Profile:
    """The profile of a batch ``fraction`` the size of the profiled one: times and activation bytes
    scaled linearly (rounded up), parameters, buffers and optimizer state kept. Linear is an
    approximation: small batches run less efficiently (on GPUs most), which the per-micro-batch
    overhead of `choose_microbatches` only partly covers; parameter-sized transients do not shrink."""
    if fraction <= 0:
        raise InputError(f"fraction must be positive, got {fraction}")
    bytes_ = lambda value: None if value is None else math.ceil(value * fraction)
    flops = lambda value: None if value is None else value * fraction
    blocks = [replace(block, forward_seconds=block.forward_seconds * fraction, flops=flops(block.flops),
                      backward_seconds=block.backward_seconds * fraction,
                      saved_bytes=bytes_(block.saved_bytes), largest_saved_bytes=bytes_(block.largest_saved_bytes),
                      saved_sizes=[bytes_(size) for size in block.saved_sizes],
                      input_bytes=bytes_(block.input_bytes), output_bytes=bytes_(block.output_bytes),
                      held_forward_bytes=bytes_(block.held_forward_bytes),
                      held_backward_bytes=bytes_(block.held_backward_bytes),
                      forward_transient_bytes=bytes_(block.forward_transient_bytes),
                      backward_transient_bytes=bytes_(block.backward_transient_bytes),
                      input_saved_bytes=bytes_(block.input_saved_bytes),
                      input_held_earlier=[[bytes_(size), saver, users]
                                          for size, saver, users in block.input_held_earlier],
                      # Other bytes stay as measured; so may the most of them with the block's own
                      # saves, a bound for a smaller batch, not for a larger one.
                      **({} if fraction <= 1 else {"forward_own_peak_bytes": None, "backward_own_peak_bytes": None}))
              for block in profile.blocks]
    return replace(profile, blocks=blocks, input_bytes=bytes_(profile.input_bytes),
                   input_tensor_bytes=bytes_(profile.input_tensor_bytes),
                   target_bytes=bytes_(profile.target_bytes),
                   unassigned_saved_bytes=bytes_(profile.unassigned_saved_bytes),
                   loss_seconds=profile.loss_seconds * fraction, measured_peak_bytes=None, flops=flops(profile.flops),
                   notes=[*profile.notes, f"scaled to {fraction:.4g} of the profiled batch"])


def _largest(values):
    """The largest of measured values; None where any is unmeasured (the planner then estimates)."""
    return None if any(value is None for value in values) else max(values)


def _own_peak(parts, key: str):
    """A group's `BlockProfile.forward_own_peak_bytes` (or backward's): while one part runs, the
    parts before it hold all their saves, in its forward and in its backward alike."""
    peaks = [getattr(part, key) for part in parts]
    if any(peak is None for peak in peaks):
        return None
    before = [sum(part.saved_bytes for part in parts[:k]) for k in range(len(parts))]
    return max(held + peak for held, peak in zip(before, peaks))


def merge_blocks(profile: Profile, groups: list[tuple[str, list[int]]]) -> Profile:
    """``profile`` with each group of consecutive blocks (a name and the indices of its blocks, in
    order) as one block: the blocks a pipeline can cut between (`oomless.simulate`: a U-Net's
    pipeline blocks are whole encoder and decoder stages, its memory planner's blocks each layer).

    Times, saved, parameter bytes and BatchNorm layers add up; the group's input and held forward
    bytes are its first block's (what crosses a cut in front of it), its output and held backward
    bytes its last's (its backward starts there); a phase's other, peak and transient bytes are the
    largest of its blocks' (one block runs at a time, the earlier blocks' saved tensors are on the
    ledger, which the saved bytes count)."""
    blocks = profile.blocks
    if sorted(index for _, members in groups for index in members) != list(range(len(blocks))) or any(
            members != list(range(members[0], members[0] + len(members))) for _, members in groups if members):
        raise InputError("merge_blocks needs groups of consecutive blocks covering every block once")
    merged = []
    for name, members in groups:
        parts = [blocks[index] for index in members]
        first, last = parts[0], parts[-1]
        merged.append(replace(
            first, name=name, calls=first.calls, output_bytes=last.output_bytes,
            held_backward_bytes=last.held_backward_bytes,
            forward_seconds=sum(part.forward_seconds for part in parts),
            backward_seconds=sum(part.backward_seconds for part in parts),
            flops=flops_of(parts),
            saved_bytes=sum(part.saved_bytes for part in parts),
            # Which earlier block holds an input names blocks of the profile before the merge: left
            # out (every input of the group counts), the group's own inputs saved are its first's.
            input_held_earlier=[],
            saved_earlier=[],           # as that: places in the profile before the merge
            largest_saved_bytes=max(part.largest_saved_bytes for part in parts),
            saved_sizes=[size for part in parts for size in part.saved_sizes] if all(
                part.saved_sizes or not part.saved_bytes for part in parts) else [],
            parameter_bytes=sum(part.parameter_bytes for part in parts),
            batchnorm_channels=[channels for part in parts for channels in part.batchnorm_channels],
            **{key: _largest([getattr(part, key) for part in parts])
               for key in ("forward_other_bytes", "backward_other_bytes", "forward_peak_bytes", "backward_peak_bytes",
                           "forward_transient_bytes", "backward_transient_bytes")},
            **{key: _own_peak(parts, key) for key in ("forward_own_peak_bytes", "backward_own_peak_bytes")}))
    return replace(profile, blocks=merged)


def choose_microbatches(profile: Profile | None, stages: int, batch: int, memory, schedule: str = "1f1b",
                        stages_per_rank: int = 1, link_bytes_per_second: float | None = None,
                        overhead_seconds: float = DEFAULT_OVERHEAD_SECONDS, candidates=None,
                        microbatch_profile: Callable[[int], Profile] | None = None) -> Partition:
    """The partition, and number of micro-batches M, with the fastest predicted step that fits
    ``memory``. ``profile`` is of the whole per-replica batch of ``batch`` samples; each candidate M
    (default: every divisor of ``batch``, so micro-batches are equal; those torch's schedule refuses
    are skipped) is planned on the profile of one micro-batch, ``microbatch_profile(M)`` (default:
    ``profile`` scaled to 1 / M; ``profile`` may then be None), each stage paying ``overhead_seconds``
    per micro-batch (`DEFAULT_OVERHEAD_SECONDS` is an assumption: give your device's). Ties go to
    fewer micro-batches; the notes say what each M predicted. Raises `PlanError` when none fits."""
    check_schedule(schedule, stages, stages_per_rank)
    if profile is None and microbatch_profile is None:
        raise InputError("choose_microbatches needs the whole batch's profile or microbatch_profile(M)")
    if batch < 1:
        raise InputError(f"batch must be at least 1, got {batch}")
    if candidates is None:
        candidates = [m for m in range(1, batch + 1) if batch % m == 0]
    candidates = sorted(set(candidates))
    if not candidates or any(m < 1 or batch % m for m in candidates):
        raise InputError(f"candidate micro-batch counts must divide the batch of {batch}, got {candidates}")
    tried, fitted, refusals = [], [], []
    for m in candidates:
        problem = microbatch_problem(schedule, stages, m)
        if problem:
            tried.append(f"M={m}: skipped, {problem}")
            continue
        try:
            one = scale_profile(profile, 1 / m) if microbatch_profile is None else microbatch_profile(m)
            partition = partition_stages(one, stages, memory, m, schedule,
                                         link_bytes_per_second, stages_per_rank)
        except PlanError as error:
            refusals.append((m, error.kept()))
            tried.append(f"M={m}: does not fit ({format_bytes(error.minimum_bytes)} per rank would)")
            continue
        partition = replace(partition, overhead_seconds=overhead_seconds)
        fitted.append(partition)
        tried.append(f"M={m}: step {partition.predicted_step_seconds * 1e3:.1f} ms, "
                     f"bubble {partition.bubble_fraction:.0%}")
    if not fitted:
        if not refusals:
            raise InputError(f"no candidate micro-batch count suits schedule {schedule}: {'; '.join(tried)}")
        least = min((error for _, error in refusals), key=lambda error: error.minimum_bytes)
        raise PlanError(f"no micro-batch count of the batch of {batch} fits the memory limits: {'; '.join(tried)}",
                        minimum_bytes=least.minimum_bytes, limiting_block=least.limiting_block,
                        floor_block=least.floor_block)
    chosen = fitted[0]
    for partition in fitted[1:]:   # ascending M: a later one must be faster, not equal, to win
        if partition.predicted_step_seconds < chosen.predicted_step_seconds * (1 - 1e-9):
            chosen = partition
    more = [m for m, _ in refusals if m > chosen.microbatches]
    why = [f"M={', '.join(map(str, more))} would not fit"] if more else []
    if any(partition.microbatches > chosen.microbatches for partition in fitted):
        why.append("more micro-batches predict no faster step" + (
            f" (what they take off the bubble, their {overhead_seconds * 1e3:g} ms overhead per micro-batch and "
            "stage adds back: an assumption, see overhead_seconds)" if overhead_seconds else ""))
    chosen.notes += [f"micro-batches tried: {'; '.join(tried)}",
                     f"M={chosen.microbatches} chosen: the fastest predicted step of those that fit (fewer on ties)"
                     + "".join(f"; {reason}" for reason in why)]
    return chosen
