"""Pipeline parallel on ``torch.distributed.pipelining``: one stage per process, built by hand from a
cut of a `BlockSequence` (no whole-graph export), run by torch's GPipe or 1F1B schedule (issue 5).

Every process builds the same whole model (same seed), keeps the blocks of its own stage and trains
only their parameters; the tensors live at a cut (several for a U-Net's skips) cross it as a tuple.
A parameter used by two stages (a tied embedding and output head) lives on both; its gradients are
summed across them after backward, so both copies take the same update (Megatron-LM does this for
its word embeddings).

    sequence = transformer_sequence(model)
    pipeline = PipelineParallel(sequence, cuts=[0, 3, 6], loss_fn=cross_entropy, microbatches=4)
    losses = pipeline.step(tokens, target=next_tokens)   # stage 0 gives inputs, the last stage targets
    optimizer.step()                                       # over pipeline.parameters()

The micro-batch loss is averaged by ``loss_fn`` and torch's schedule divides gradients by the number
of micro-batches, so with equal micro-batches the gradient is the global batch's mean loss's.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from oomless.errors import InputError
from oomless.parallel.block_sequence import BlockSequence

PIPELINE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def cuts_from_stage_blocks(sequence: BlockSequence, stage_blocks: list[list[str]]) -> list[int]:
    """The cut positions [0, ..., len(blocks)] of a partition's stage -> block names; the names must
    be the sequence's, each stage contiguous and in order (as `plan.partition` returns them)."""
    cuts = [0]
    for names in stage_blocks:
        expected = [block.name for block in sequence.blocks[cuts[-1]:cuts[-1] + len(names)]]
        if not names or names != expected:
            raise InputError(f"stage {len(cuts) - 1} lists blocks {names}, but the sequence continues with {expected}")
        cuts.append(cuts[-1] + len(names))
    if cuts[-1] != len(sequence.blocks):
        raise InputError(f"the stages cover {cuts[-1]} of {len(sequence.blocks)} blocks")
    return cuts


class PipelineParallel:
    """This process's stage of ``sequence`` cut at ``cuts`` (stage i holds blocks cuts[i]..cuts[i+1]),
    its `PipelineStage` and schedule. ``group`` is the pipeline's process group (default: the world);
    the stage index is this process's rank in it."""

    def __init__(self, sequence: BlockSequence, cuts: list[int], loss_fn, microbatches: int,
                 schedule: str = "1f1b", device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None):
        stages = len(cuts) - 1
        if stages < 1 or cuts[0] != 0 or cuts[-1] != len(sequence.blocks) or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise InputError(f"cuts must rise strictly from 0 to {len(sequence.blocks)} (the blocks), got {cuts}")
        if schedule not in PIPELINE_SCHEDULES:
            raise InputError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
        if dist.get_world_size(group) != stages:
            raise InputError(f"{stages} stages need a process group of {stages}, got {dist.get_world_size(group)}")
        self.group, self.stage_index, self.stages = group, dist.get_rank(group), stages
        self.module = sequence.stage(cuts[self.stage_index], cuts[self.stage_index + 1]).to(device)
        self.tied = _parameters_in_several_stages(sequence, cuts)
        self.stage = PipelineStage(self.module, self.stage_index, stages, torch.device(device), group=group)
        self.schedule = PIPELINE_SCHEDULES[schedule](self.stage, microbatches, loss_fn=loss_fn)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stages - 1

    def parameters(self):
        return self.module.parameters()

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """Forward and backward of one global batch (split into micro-batches along dim 0): the first
        stage passes ``inputs``, the last ``target``, the others nothing. Gradients accumulate on this
        stage's parameters (zero them before); returns the micro-batch losses on the last stage."""
        losses = [] if self.is_last else None
        arguments = inputs if self.is_first else ()
        self.schedule.step(*arguments, target=target if self.is_last else None, losses=losses)
        self._sum_tied_gradients()
        return losses

    def _sum_tied_gradients(self) -> None:
        # Every stage joins every all-reduce, in the same order (collectives must match across
        # ranks); a stage without the parameter contributes zeros.
        own = {id(parameter) for parameter in self.module.parameters()}
        for _, parameter in self.tied:
            if id(parameter) not in own:
                dist.all_reduce(torch.zeros_like(parameter), group=self.group)
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, group=self.group)


def _parameters_in_several_stages(sequence: BlockSequence, cuts: list[int]) -> list[tuple[str, nn.Parameter]]:
    """(name in the whole sequence, parameter) of every parameter that two stages share, by name.
    Every process builds the whole sequence, so each knows these even where it holds none."""
    holders: dict[int, set[int]] = {}
    for stage, (start, stop) in enumerate(zip(cuts, cuts[1:])):
        for parameter in sequence.stage(start, stop).parameters():
            holders.setdefault(id(parameter), set()).add(stage)
    return [(name, parameter) for name, parameter in sequence.named_parameters()
            if len(holders.get(id(parameter), ())) > 1]
