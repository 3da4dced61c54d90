"""Where to compute chains in slabs: the planner's choice for `oomless.plan(..., split=None)`.

Slabs cost time (each op once more forward in backward, as checkpointing; halos twice; the kept
normalisation inputs read and written), so nothing is split while a plan without splitting fits with
room. When none does, the block that sets the smallest plan's floor
(`PlanError.floor_block`) is what splitting can lower: the chains in it (or around it) are split,
the step is measured again, and so on while each round names a block with a chain not yet split.
When a plan fits but the budget is within `NEAR_FLOOR` of the smallest budget without splitting,
the same is tried, and a split plan is taken where splitting lowers the floor.

Measuring the step unsplit holds that step's own floor (its largest op's working memory at full
size), which at a large volume is several times the budget: the 3D U-Net at 232^3 measured past
1.5 GiB for a 1 GiB budget. So the smallest budget without splitting is first estimated on meta
tensors (`unsplit_floor_estimate`, nothing allocated, under a second for a U-Net); where even that
estimate, which counts no kernel workspaces and no copy that lags, is over the budget, splitting
starts from the block the estimate names, and the step is measured unsplit only if no split plan
fits and the split floor is not below the estimate (`oomless.api.plan`). A budget below the static
bytes (plan at 1 byte: a request for the floor) goes the same way, and the lower of the split and
unsplit floors is named: given back in a fresh process, the same steps are measured in the same order.

Where none of that fits (or the budget is below the static bytes: a request for the floor), and the
block setting the floor holds a kernel's workspace that slabs shrink (`floor_is_a_workspace`), the
step is measured once more with every chain split (`plan_or_lowest_floor`): the rounds split only
the chains overlapping each floor's block and can stop above that.
"""

from collections.abc import Callable

import torch
import torch.nn as nn

from oomless.errors import OomlessError, PlanError
from oomless.plan.planner import MEASURED_MARGIN
from oomless.profile.profile import LinkProfile
from oomless.runtime.split import DEFAULT_SLABS, inside, split_candidates, stream_outer_modules
from oomless.runtime.stream import STREAM
from oomless.sizes import format_bytes


# Within this factor of the smallest budget a plan without splitting keeps next to nothing and swaps
# the rest, and an error of a few percent in its prediction overflows the budget (measured: the 3D
# U-Net at 160^3 on CPU, planned for 1 GiB at 1023 MiB, peaked at 1043 MiB); where splitting lowers the
# floor, a split plan has room there.
NEAR_FLOOR = 1.10


def _named(chains) -> str:
    return ", ".join(chain if chain != STREAM else "the outer level (streamed)" for chain in chains)


def _overlaps(chain: str, block: str) -> bool:
    return chain == block or chain.startswith(block + ".") or block.startswith(chain + ".")


# Bytes per second of the swap link in the estimate: a copy that takes no time.
_INSTANT = 1e18


def unsplit_floor_estimate(model: nn.Module, example_inputs, optimizer, blocks, dtype, budget: int,
                           plan_profile: Callable) -> PlanError | None:
    """The `PlanError` of ``budget`` for the step without splitting, profiled on meta tensors, where
    it names a block splitting can lower; None where a plan fits the estimate, where splitting cannot
    lower its floor, where the budget is below even the static bytes, or where the model cannot run
    on meta tensors (the step is then measured unsplit, as without the estimate).

    A lower bound of the measured floor: working memory traced without kernels' workspaces
    (`profile.fake_memory`), the loss as the sum of the outputs (the caller's loss may hold real
    tensors, which meta tensors cannot meet), copies to the swap tier taking no time so that none
    lags behind compute, and the measured profile's margin (the 3D U-Net at 64^3 and 96^3: 0.6-0.7
    of the measured floor)."""
    from oomless.api import sum_of_outputs
    from oomless.profile.fake import profile_for_target

    try:
        estimated = profile_for_target(model, example_inputs, "h100", loss_fn=sum_of_outputs, optimizer=optimizer,
                                       blocks=blocks, dtype=dtype)
    except (RuntimeError, NotImplementedError, OomlessError):
        return None     # an op without a meta kernel, a value read in Python: the step is measured instead
    estimated.link = LinkProfile(estimated.link.kind, _INSTANT, _INSTANT)
    estimated.margin_share = MEASURED_MARGIN     # a lower bound: the measured profile's margin, not a traced one's
    try:
        plan_profile(estimated, budget)
    except PlanError as error:
        # Below the static bytes (limiting_block None) a budget asks for the floor (plan at 1 byte,
        # read the PlanError): that too is estimated, and the step measured split first, as for a
        # budget between the static bytes and the estimate, so that the floor it names is one a
        # fresh process given it plans the same way (measured unsplit first, the split steps after
        # it counted what it left held: the 3D U-Net at 64^3 named 104-106 MiB so, and a fresh
        # process refused 106 naming 115).
        return error.kept() if can_split_at(model, error.floor_block) else None
    return None


def can_split_at(model: nn.Module, block: str | None) -> bool:
    """Whether splitting can lower a floor ``block`` sets: it is in the streamable outer level or
    overlaps a chain."""
    if block is None:
        return False
    outer = stream_outer_modules(model)
    return (outer is not None and inside(block, outer)) or any(_overlaps(chain, block)
                                                               for chain in split_candidates(model))


def plan_splitting_the_floor(model: nn.Module, error: PlanError, plan_profile: Callable,
                             profile_split: Callable[[dict[str, int]], object], estimated: bool = False):
    """A plan with the chains that set the floor split; else the `PlanError` with the lowest floor
    (the first one where splitting did not lower it: slabs hold a slab's intermediates, but the
    chain's whole input, output gradient and input gradient stay). ``estimated``: ``error`` is
    `unsplit_floor_estimate`'s, the step never measured unsplit."""
    if estimated:
        error.args = (f"{error.args[0]} (estimated on meta tensors without splitting; the step was not measured "
                      "unsplit)",)
    candidates = split_candidates(model)
    outer = stream_outer_modules(model)
    chosen: dict[str, int] = {}
    first, first_minimum, best, best_chains = error, error.minimum_bytes, error, []
    if estimated:
        best = None     # a lower bound, not a budget that was measured to fit: refused by a measured floor
    while True:
        block = error.floor_block
        if outer is not None and STREAM not in chosen and block is not None and inside(block, outer):
            # The floor is at the outer level: stream it, in place of splitting its chains (a chain in
            # slabs keeps its inputs, output and their gradients whole; the streamed level none of them).
            chosen = {chain: slabs for chain, slabs in chosen.items() if not inside(chain, outer)}
            more = [STREAM]
        else:
            more = [chain for chain in candidates
                    if chain not in chosen and block is not None and _overlaps(chain, block)
                    and not (STREAM in chosen and inside(chain, outer))]
        if not more:
            if best is None:
                raise first
            if best is not first:
                best.note_split(f"with {_named(best_chains)} computed in slabs; without: "
                                f"{_without(first_minimum, estimated)}")
            raise best
        chosen.update({chain: DEFAULT_SLABS for chain in more})
        try:
            profile = profile_split(dict(chosen))
        except torch.OutOfMemoryError:
            # Measuring the split step needed more than the device had: splitting did not lower the
            # floor enough to be measured within it, and the refusal stands.
            raise (best or first) from None
        try:
            made = plan_profile(profile)
        except PlanError as again:
            error = again.kept()
            error.profile = profile
            if best is None or best.minimum_bytes is None or (again.minimum_bytes or 0) < best.minimum_bytes:
                best, best_chains = error, list(chosen)
            continue
        made.split = dict(chosen)
        made.notes.append(f"split into slabs: {_named(chosen)} "
                          f"(the block that set the floor; without splitting: {_without(first_minimum, estimated)})")
        return made


# Working memory of the block that sets the floor, against its input and output bytes, above which the
# floor is taken to be a kernel's workspace that slabs shrink (PyTorch's im2col convolution on CPU,
# 27 x its input for a 3x3x3 kernel: MONAI SegResNet at 48^3, batch 1, 37x), and the step with every
# chain split is measured. Below it the slabs save little (a chain's whole inputs, output and their
# gradients stay: the 3D U-Net's outer decoder stage, 3-4x, 58 MiB unsplit at 48^3 and not lower
# split), and measuring the split step would cost the training that follows the caches it leaves
# held (oneDNN's kernels for every slab's shape: 4-6 MiB there, which the budget named then counts).
WORKSPACE_SHARE = 8


def floor_is_a_workspace(profile, block_name: str | None) -> bool:
    """Whether the block ``block_name`` (that sets ``profile``'s floor) has a phase whose transient
    working memory (net of the tensors held then: skips, gradients alive) is over `WORKSPACE_SHARE`
    times its input and output bytes (per call)."""
    block = next((block for block in getattr(profile, "blocks", []) if block.name == block_name), None)
    if block is None:
        return False
    working = max(block.forward_other_bytes if block.forward_transient_bytes is None else block.forward_transient_bytes,
                  block.backward_other_bytes if block.backward_transient_bytes is None else block.backward_transient_bytes)
    per_call = (block.input_bytes + block.output_bytes) / max(block.calls, 1)
    return (working or 0) > WORKSPACE_SHARE * max(per_call, 1)


def plan_or_lowest_floor(refusal: PlanError, refused_chains: dict[str, int], everything: dict[str, int],
                         plan_profile: Callable, profile_split: Callable[[dict[str, int]], object]):
    """A plan of the step measured with ``everything`` split, where one fits; else the lower of its
    refusal and ``refusal`` (the step measured with ``refused_chains`` split: none, or those that set
    the floor), raised. One measurement more, after `plan_splitting_the_floor`'s rounds (or in their
    place, for a budget below the static bytes, which no split makes fit): those split only the
    chains overlapping the block that sets each floor, and can stop above what every chain split
    reaches (MONAI SegResNet, 48^3, batch 1, CPU: 141 MiB unsplit, the rounds 70, every chain split
    55). Where that is not lower, ``refused_chains``' step is measured once more: the split step left
    memory held in the process (kernels' caches for its shapes) that training holds too and that only
    a later profile counts (the 3D U-Net at 48^3 named 58 MiB and its step measured 58.1, 54.5 before).
    A split step that cannot be measured (out of memory, an op slabs refuse) leaves ``refusal``."""
    try:
        profile = profile_split(dict(everything))
    except (OomlessError, RuntimeError):     # torch.OutOfMemoryError among them
        raise refusal from None
    try:
        return _every_chain(plan_profile(profile), everything, refusal)
    except PlanError as split_refused:
        lower = split_refused.kept() if (split_refused.minimum_bytes or 0) < (refusal.minimum_bytes or 0) else None
    if lower is not None:
        lower.profile = profile
        chains = len([chain for chain in everything if chain != STREAM])
        every = f"every chain ({chains}) computed in slabs" + (", the outer level streamed" if STREAM in everything else "")
        before = "only the chains that set the floor split" if refused_chains else "without splitting"
        lower.args = (f"{lower.args[0]} (with {every}; {before}: smallest budget "
                      f"{format_bytes(refusal.minimum_bytes or 0)})",)
        raise lower.to_raise()
    try:
        again = profile_split(dict(refused_chains))
    except torch.OutOfMemoryError:
        raise refusal from None
    try:
        made = plan_profile(again)
    except PlanError as measured_again:
        measured = measured_again.kept()
    else:
        made.split = dict(refused_chains)
        return made
    measured.profile = again
    if refusal.split_note is not None:
        # Measured again as it was: the chains the refusal split, and the floor without them, still say.
        measured.note_split(refusal.split_note)
    raise measured.to_raise()


def _every_chain(made, everything: dict[str, int], refusal: PlanError):
    made.split = dict(everything)
    made.notes.append(f"split into slabs: every chain (splitting only those that set the floor did not fit: "
                      f"{format_bytes(refusal.minimum_bytes or 0)} at least)")
    return made


def _without(minimum: int | None, estimated: bool) -> str:
    if estimated:
        return (f"smallest budget at least {format_bytes(minimum or 0)}, estimated on meta tensors, so the step "
                "was not measured unsplit")
    return f"smallest budget {format_bytes(minimum or 0)}"


def _floor(profile, plan_profile: Callable) -> PlanError:
    """The `PlanError` of a budget of 0 B for ``profile``: its smallest budget and the block setting it."""
    try:
        plan_profile(profile, 0)
    except PlanError as error:
        return error.kept()
    raise AssertionError("a plan fitted 0 bytes")


def plan_splitting_near_the_floor(model: nn.Module, made, profile, plan_profile: Callable,
                                  profile_split: Callable[[dict[str, int]], object]):
    """``made``, or a split plan where ``made``'s budget is within `NEAR_FLOOR` of the smallest budget
    without splitting and splitting the chains that set that floor lowers it and fits."""
    unsplit = _floor(profile, plan_profile)
    if unsplit.minimum_bytes is None or unsplit.limiting_block is None or made.memory_bytes >= NEAR_FLOOR * unsplit.minimum_bytes:
        return made

    def plan_if_lower(split_profile):
        lower = _floor(split_profile, plan_profile)
        if (lower.minimum_bytes or 0) >= unsplit.minimum_bytes:
            raise lower             # no lower floor: try more chains, or keep the plan without splitting
        return plan_profile(split_profile)

    try:
        split_plan = plan_splitting_the_floor(model, unsplit, plan_if_lower, profile_split)
    except PlanError:
        return made
    split_plan.notes.append(f"the budget is within {NEAR_FLOOR - 1:.0%} of the smallest without splitting "
                            f"({format_bytes(unsplit.minimum_bytes)}), where a plan has no room for error")
    return split_plan
