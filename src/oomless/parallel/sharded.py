"""Sharded data parallel on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): ``--parallel fsdp``.

    torchrun --standalone --nproc-per-node 2 -m oomless train --parallel fsdp --global-batch 4 --size 16

Every rank holds 1/N of each parameter, its gradient and its optimizer state (ZeRO-3). Each block
(the blocks oomless plans: `plan.decisions`, or `profile.blocks.find_blocks` without a plan) is one
FSDP unit, then the root, as torchtitan's ``apply_fsdp`` does: a block's parameters are all-gathered
just before its forward and again before its backward, freed after each, and its gradients
reduce-scattered (averaged) as soon as its backward is done. The root's own parameters (those no
block holds, e.g. a U-Net's head) stay unsharded through the step (FSDP does not reshard the root
after forward, its backward comes next). The optimizer steps each rank's shards alone.

How the oomless runtime composes with it (read in torch 2.13, ``fsdp/_fully_shard/_fsdp_state.py``):
fully_shard *prepends* its forward pre-hook and *appends* its forward hook, so on every block the
all-gather runs before oomless's hooks see the block and the reshard after they have finished it, in
whichever order the two were applied. A recomputed block is re-run inside backward through the
module's call: FSDP's pre-hook, in its pre-backward state, only makes sure the parameters are
unsharded, and oomless's recompute hooks skip while recomputing (`runtime/recompute.py`). The
parameters a block computes with are FSDP's unsharded ones, created at its all-gather; the
runtime's block hook counts their storages as resident (never swapped, not activations) while the
block runs (`runtime/install.py`).

Equal to one process with the same global batch, as `dp` is: equal shards of the batch, BatchNorm
on global-batch statistics (`batchnorm.py`), the Dice sums across ranks, and FSDP's reduce-scatter
averaging the gradients (``ReduceOp.AVG``, DDP's mean).

Precision and compile compose as torchtitan orders them: autocast hooks and each block compiled in
place come first (`oomless.apply`), ``fully_shard`` after. Autocast casts the all-gathered fp32
parameters per op, as in one process; fp16's loss scale is taken out by FSDP's own reduce-scatter
division and the skip is voted over the ranks (`runtime/precision.py`). FSDP's hooks run eagerly
around the compiled forwards (torch 2.13 marks them ``_dynamo_disable``, fsdp/_fully_shard/_fsdp_state.py).

What does not compose, refused before any step (`check_sharded_plan`, `TrainConfig.validate`):
the optimizer step in backward and the optimizer state or parameters off the device (FSDP owns
where parameters and gradients live and when they exist); switching layout to or from fsdp mid-run.

Checkpoints and ``--save`` hold full tensors in the file format of every other layout:
`full_state` gathers them to rank 0 with ``torch.distributed.checkpoint.state_dict``
(``full_state_dict=True, cpu_offload=True``), `load_full_state` shards a full state on every rank.
So a dp checkpoint resumes under fsdp and an fsdp checkpoint under dp.
"""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard

from oomless.errors import InputError
from oomless.parallel.data_parallel import Collectives, SynchronousDataParallel
from oomless.runtime.precision import precision_state

FULL_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_ON_EVERY_RANK = StateDictOptions(full_state_dict=True)


def apply_fsdp(model: nn.Module, block_names: list[str]) -> list[str]:
    """Shard ``model`` in place with FSDP2: each named block that holds parameters, then the root.
    Returns the blocks sharded as their own unit. The parameters become DTensors (same names); an
    optimizer built before must be pointed at them (`rebind_optimizer`)."""
    modules = dict(model.named_modules())
    missing = [name for name in block_names if name not in modules]
    if missing:
        raise InputError(f"blocks {missing[:5]} are not modules of this model; name blocks by their qualified "
                         "names (model.named_modules())")
    sharded = []
    for name in block_names:
        block = modules[name]
        if block is model or not any(True for _ in block.parameters()):
            continue                     # nothing to shard (ReLU, pooling): no unit of its own
        fully_shard(block)
        sharded.append(name)
    fully_shard(model)
    precision = precision_state(model)
    if precision is not None:
        precision.follow_sharding(model)    # fp16: unscale in FSDP's reduce-scatter (runtime/precision.py)
    return sharded


def rebind_optimizer(optimizer: torch.optim.Optimizer, before: dict[str, nn.Parameter], model: nn.Module) -> None:
    """Point ``optimizer`` at ``model``'s parameters by name: ``before`` is {name: parameter} from
    before `apply_fsdp` replaced them. Refuses an optimizer that already holds state (it would be
    for the unsharded tensors): a resumed run loads its state after sharding (`load_full_state`)."""
    if optimizer.state:
        raise InputError("the optimizer already holds state; shard the model first, then load the state with "
                         "oomless.parallel.sharded.load_full_state")
    now = dict(model.named_parameters())
    name_of = {id(param): name for name, param in before.items()}
    for group in optimizer.param_groups:
        unknown = [param for param in group["params"] if id(param) not in name_of]
        if unknown:
            raise InputError(f"the optimizer holds {len(unknown)} parameter(s) that are not the model's; build it "
                             "from model.parameters()")
        group["params"] = [now[name_of[id(param)]] for param in group["params"]]


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of every parameter the optimizer holds, in its state_dict's index order."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    return [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """On rank 0: (model state, optimizer state) as one process holds them: full CPU tensors, the
    optimizer's state indexed as ``optimizer.state_dict()`` indexes it. Elsewhere: ({}, {} or None).
    A collective: every rank calls it."""
    model_state = get_model_state_dict(model, options=FULL_ON_RANK_0)
    if optimizer is None:
        return model_state, None
    by_name = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK_0)
    if not by_name:
        return model_state, {}
    indexed = optimizer.state_dict()        # param_groups as the optimizer itself writes them
    names = _parameter_names(model, optimizer)
    state = {index: by_name["state"][name] for index, name in enumerate(names) if name in by_name["state"]}
    return model_state, {"state": state, "param_groups": indexed["param_groups"]}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
                    optimizer_state: dict | None) -> None:
    """Load a full (unsharded) state, as `full_state` returns it and a checkpoint of any layout holds
    it, into the sharded ``model`` and ``optimizer``: every rank passes the same full state and keeps
    its shard."""
    set_model_state_dict(model, model_state, options=FULL_ON_EVERY_RANK)
    if optimizer is None or optimizer_state is None:
        return
    names = _parameter_names(model, optimizer)
    state = {names[int(index)]: value for index, value in optimizer_state["state"].items()}
    groups = [{**group, "params": [names[int(index)] for index in group["params"]]}
              for group in optimizer_state["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=FULL_ON_EVERY_RANK)


def check_sharded_plan(plan, world_size: int) -> None:
    """Refuse a plan whose static placements move what FSDP owns, or made for another number of shards."""
    moved = [name for name in ("update_in_backward", "offload_optimizer_state", "offload_parameters")
             if getattr(plan, name, False)]
    if moved:
        raise InputError(f"--parallel fsdp cannot run a plan with {', '.join(moved)}: FSDP decides where parameters "
                         "and gradients live and steps the optimizer on each rank's shard after the reduce-scatter; "
                         "plan with shard_over=<world size> (those are then off), or use --parallel dp")
    if plan.shard_over != world_size:
        # Its static bytes count 1/shard_over of the parameters, gradients and state: another world
        # size holds more or less than it counted (shard_over=4 on 2 ranks: 86 MiB for 56 predicted).
        raise InputError(f"this plan was made for parameters sharded over {plan.shard_over} rank(s) and fsdp shards "
                         f"them over {world_size}: plan with shard_over={world_size} (oomless.plan(..., "
                         f"shard_over={world_size}))")


class ShardedDataParallel(Collectives):
    """FSDP2 per block, then the root; global-batch BatchNorm and loss sums as under dp."""

    shards_parameters = True

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None,
                example=None, memory=None) -> nn.Module:
        from oomless.profile.blocks import find_blocks
        from oomless.runtime.install import installed_state

        self.max_grad_norm = max_grad_norm
        if isinstance(model, FSDPModule):
            raise InputError("the model is already sharded (fully_shard); build a fresh one for --parallel fsdp")
        installed = installed_state(model)
        plan = installed.plan if installed is not None else None
        if plan is not None:
            check_sharded_plan(plan, self.ranks.world_size)
        self.convert_modules(model)
        blocks = list(plan.decisions) if plan is not None else [name for name, _ in find_blocks(model)]
        before = dict(model.named_parameters())
        with self.collective("FSDP sharding (fully_shard)"):
            self.sharded_blocks = apply_fsdp(model, blocks)
        rebind_optimizer(optimizer, before, model)
        return model

    # Global-batch statistics (BatchNorm, Dice) are summed across ranks as under dp.
    convert_modules = SynchronousDataParallel.convert_modules
    sum_across_ranks = SynchronousDataParallel.sum_across_ranks

    def backward(self, loss: torch.Tensor) -> None:
        with self.collective("FSDP all-gather / reduce-scatter during backward"):
            loss.backward()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step_index: int) -> None:
        with self.collective("FSDP optimizer step (gradient norm across shards)"):
            super().step(model, optimizer, step_index)

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
        with self.collective("FSDP state gather to rank 0"):
            return full_state(model, optimizer)

    def load_full_state(self, model: nn.Module, optimizer, model_state: dict, optimizer_state: dict | None) -> None:
        with self.collective("FSDP state load (sharding a full state)"):
            load_full_state(model, optimizer, model_state, optimizer_state)
