"""Recompute segments: modules around consecutive blocks, planned as one block.

A block holds its own inputs while it waits to be recomputed. Where the blocks are a U-Net stage's
convolution, normalisation and activation, each recomputed alone holds the one before's output, and
recomputing all of them saves nothing; ``torch.utils.checkpoint`` on the stage holds the stage's input
alone. The profile lists the modules around blocks (`profile.profile.SegmentProfile`); here a profile
is made coarser, each chosen module's blocks merged into one block of its name, and the planner plans
that profile like any other. Installed, such a block is its module, recomputed as one (`runtime.install`
hooks the module). `best_of_granularities` plans the profile as measured and at each depth of the
modules around blocks (those it would keep or swap put back as their blocks), and takes the plan
predicted fastest.
"""

import math
from dataclasses import replace

from oomless.errors import InputError, PlanError
from oomless.profile.profile import BlockProfile, Profile, SegmentProfile, flops_of


def depth_cuts(profile: Profile) -> list[list[SegmentProfile]]:
    """For each depth of nesting among the profile's segments, the segments at it, and those less
    deep with none inside them; never overlapping. Outermost first; none where there are none."""
    segments = profile.segments

    def inside(inner: SegmentProfile, outer: SegmentProfile) -> bool:
        return inner.name.startswith(outer.name + ".")
    depth = {segment.name: sum(inside(segment, other) for other in segments) for segment in segments}
    leaf = {segment.name: not any(inside(other, segment) for other in segments) for segment in segments}
    cuts = []
    for level in range(max(depth.values(), default=-1) + 1):
        cut = [segment for segment in segments
               if depth[segment.name] == level or (depth[segment.name] < level and leaf[segment.name])]
        cut.sort(key=lambda segment: segment.first)
        if all(a.last < b.first for a, b in zip(cut, cut[1:])) and cut not in cuts:
            cuts.append(cut)
    return cuts


def coarsened(profile: Profile, cut: list[SegmentProfile]) -> Profile:
    """``profile`` with the blocks of each segment in ``cut`` (not overlapping) merged into one block
    named after it; the other blocks as they were, their places renumbered."""
    blocks = profile.blocks
    starts = {segment.first: segment for segment in cut}
    groups: list[tuple[SegmentProfile | None, list[int]]] = []
    position = 0
    while position < len(blocks):
        segment = starts.get(position)
        members = list(range(position, segment.last + 1)) if segment else [position]
        groups.append((segment, members))
        position = members[-1] + 1
    coarse_of = {member: index for index, (_, members) in enumerate(groups) for member in members}
    merged_places = {index for index, (segment, _) in enumerate(groups) if segment is not None}

    def place(fine: float) -> float:
        """A place in the forward (`BlockProfile.saved_alive_blocks`' units: whole blocks, and how far
        into a block's forward by its saved storages) in the coarse profile."""
        whole = math.floor(fine)
        if whole >= len(blocks):
            return len(groups) + (fine - len(blocks))
        index = coarse_of[whole]
        members = groups[index][1]
        saves = [len(blocks[member].saved_sizes) for member in members]
        if sum(saves) == 0:
            return index + (members.index(whole) + fine - whole) / len(members)
        before = sum(saves[:members.index(whole)])
        return index + (before + (fine - whole) * len(blocks[whole].saved_sizes)) / sum(saves)

    def held(entries: list) -> list:
        # A user inside a merged block is left out: whether it held this storage as its own input or
        # as the segment's is not known here, and left out the storage counts (never too few bytes).
        return [[size, saver if saver < 0 else coarse_of[saver],
                 sorted({coarse_of[user] for user in users if coarse_of[user] not in merged_places})]
                for size, saver, users in entries]

    def alive(block: BlockProfile, fine_place: int, coarse_place: int) -> list[float]:
        return [value if value < 0 else place(fine_place + value) - coarse_place
                for value in block.saved_alive_blocks]

    def saved_earlier(members: list[int], coarse_place: int) -> list:
        """`BlockProfile.saved_earlier` of the members as one block: storages of a block outside it,
        by its coarse place and the storage's index among its members' saves."""
        def saves_before(member: int) -> int:      # its group's storages saved before its own
            group = groups[coarse_of[member]][1]
            return sum(len(blocks[m].saved_sizes) for m in group[:group.index(member)])

        found = []
        for member in members:
            for back, k, *place in blocks[member].saved_earlier:
                saver = member - back
                saver_place = coarse_of[saver]
                record = [coarse_place - saver_place, saves_before(saver) + k]
                if saver_place != coarse_place and not any(other[:2] == record for other in found):
                    found.append(record + [saves_before(member) + place[0]] if place else record)
        return found

    coarse = []
    for index, (segment, members) in enumerate(groups):
        if segment is None:
            block = blocks[members[0]]
            coarse.append(replace(block, saved_alive_blocks=alive(block, members[0], index),
                                  input_held_earlier=held(block.input_held_earlier),
                                  saved_earlier=saved_earlier(members, index)))
        else:
            coarse.append(_merged(segment, [blocks[m] for m in members], [alive(blocks[m], m, index) for m in members],
                                  held(segment.input_held_earlier), saved_earlier(members, index)))
    # The code between a merged block's members runs in its forward now (and again in its recompute):
    # out of the time the profile counts with the loss.
    between = sum(_between_seconds(segment, blocks) for segment in cut)
    return replace(profile, blocks=coarse, segments=[], loss_seconds=max(profile.loss_seconds - between, 0.0))


def _between_seconds(segment: SegmentProfile, blocks: list[BlockProfile]) -> float:
    members = blocks[segment.first:segment.last + 1]
    return max(segment.forward_seconds - sum(block.forward_seconds for block in members), 0.0)


def _merged(segment: SegmentProfile, members: list[BlockProfile], alive: list[list[float]],
            held_earlier: list, saved_earlier: list) -> BlockProfile:
    """One block for ``members`` (a segment's blocks, in order), as if profiled as its module."""
    first, last = members[0], members[-1]
    before = [sum(block.saved_bytes for block in members[:k]) for k in range(len(members))]

    def most(values):
        return None if any(value is None for value in values) else max(values)

    def own_peak(field: str, other: str):
        # A kept segment's own saves so far (forward), or not yet released (backward), on top of one
        # member's own peak: the members before it hold theirs either way.
        values = [getattr(block, field) if getattr(block, field) is not None
                  else (None if getattr(block, other) is None else getattr(block, other) + block.saved_bytes)
                  for block in members]
        return None if any(value is None for value in values) else max(v + b for v, b in zip(values, before))

    kept, offset = [], 0
    for block in members:
        kept += [offset + k for k in block.kept_when_swapped]
        offset += len(block.saved_sizes)
    # A member whose lifetimes were not measured: its storages stay until backward (never too few bytes).
    alive = [values if len(values) == len(block.saved_sizes) else [-1.0] * len(block.saved_sizes)
             for values, block in zip(alive, members)]
    names, other_stretches, peak_stretches = [], [], []
    stretched = all(len(block.backward_other_by_stretch) == len(block.backward_gradient_names) + 1
                    and len(block.backward_peak_by_stretch) == len(block.backward_gradient_names) + 1
                    for block in members)
    for block in reversed(members):     # backward runs the last member first
        names += block.backward_gradient_names
        if stretched:
            other_stretches = _joined(other_stretches, block.backward_other_by_stretch)
            peak_stretches = _joined(peak_stretches, block.backward_peak_by_stretch)
    return BlockProfile(
        name=segment.name,
        forward_seconds=max(sum(block.forward_seconds for block in members), segment.forward_seconds),
        backward_seconds=sum(block.backward_seconds for block in members),
        flops=flops_of(members),
        saved_bytes=sum(block.saved_bytes for block in members),
        largest_saved_bytes=max(block.largest_saved_bytes for block in members),
        saved_sizes=[size for block in members for size in block.saved_sizes],
        kept_when_swapped=kept,
        saved_alive_blocks=[value for values in alive for value in values],
        input_bytes=segment.input_bytes,
        output_bytes=last.output_bytes,
        input_held_earlier=held_earlier,
        saved_earlier=saved_earlier,
        input_saved_bytes=segment.input_saved_bytes,
        parameter_bytes=sum(block.parameter_bytes for block in members),
        calls=1,
        held_forward_bytes=first.held_forward_bytes,
        held_backward_bytes=last.held_backward_bytes,
        forward_other_bytes=most([block.forward_other_bytes for block in members]),
        backward_other_bytes=most([block.backward_other_bytes for block in members]),
        forward_peak_bytes=most([block.forward_peak_bytes for block in members]),
        backward_peak_bytes=most([block.backward_peak_bytes for block in members]),
        forward_own_peak_bytes=own_peak("forward_own_peak_bytes", "forward_other_bytes"),
        backward_own_peak_bytes=own_peak("backward_own_peak_bytes", "backward_other_bytes"),
        forward_transient_bytes=most([block.forward_transient_bytes for block in members]),
        backward_transient_bytes=most([block.backward_transient_bytes for block in members]),
        backward_gradient_bytes=first.backward_gradient_bytes,
        backward_gradient_names=names,
        backward_other_by_stretch=other_stretches if stretched else [],
        backward_peak_by_stretch=peak_stretches if stretched else [],
        # Static bytes off the device while it runs (the update in backward): its members' least.
        forward_static_absent_bytes=min(block.forward_static_absent_bytes for block in members),
        backward_static_absent_bytes=min(block.backward_static_absent_bytes for block in members),
        recompute_static_absent_bytes=min(block.recompute_static_absent_bytes for block in members),
        batchnorm_channels=[channels for block in members for channels in block.batchnorm_channels],
    )


def _joined(stretches: list[int], following: list[int]) -> list[int]:
    """Backward stretches of one block, then of the block whose backward runs next: the last of the
    first and the first of the next are one stretch (no gradient accumulated between them)."""
    if not stretches:
        return list(following)
    return stretches[:-1] + [max(stretches[-1], following[0])] + following[1:]


def best_of_granularities(profile: Profile, make):
    """``make(profile)`` (a Plan, or PlanError) for the profile as measured and coarsened at each depth
    of its segments (`depth_cuts`): the plan that fits predicted fastest; where none fits, the
    measured profile's refusal (its floor and the block that sets it are named by its own blocks).
    A coarse plan is taken only where it recomputes a segment: what it does otherwise, keep or swap
    every block of one, a plan of the measured blocks can do too."""
    try:
        best, refusal = make(profile), None
    except PlanError as error:
        best, refusal = None, error
    if best is not None and set(best.decisions.values()) <= {"keep"}:
        return best     # nothing is faster than keeping every block
    tried: dict[tuple, object] = {}     # the merged modules' names: their plan (a cut reached twice)
    for cut in depth_cuts(profile):
        candidate = _recomputing_segments(profile, cut, make, tried)
        if candidate is not None and (best is None or candidate.predicted_step_seconds < best.predicted_step_seconds):
            best = candidate
    if best is None:
        raise refusal
    return best


def _recomputing_segments(profile: Profile, cut: list[SegmentProfile], make, tried: dict):
    """The plan of ``profile`` with ``cut`` merged where every merged block it names is recomputed,
    or None. A merged block kept or swapped goes back to its blocks and the rest is planned again,
    until every merged block left is recomputed (each round drops at least one, so at most one plan
    per segment of the cut): as one block, the saves its module makes between its blocks (a residual
    add, a concatenation) would join its ledger, which the profile counted outside every block. Giving
    up after one round lost plans 70,000 times faster: with three stages merged, the last was kept at
    the same peak, and with it back as blocks, the second; recomputing the first alone fit."""
    while cut:
        names = {segment.name for segment in cut}
        key = tuple(sorted(names))
        if key not in tried:
            try:
                tried[key] = make(coarsened(profile, cut))
            except PlanError:
                tried[key] = None
        candidate = tried[key]
        if candidate is None:
            return None
        not_recomputed = {block.name for block in candidate.blocks if block.name in names and block.decision != "recompute"}
        if not not_recomputed:
            return candidate
        cut = [segment for segment in cut if segment.name not in not_recomputed]
    return None


def check_decisions(decisions: dict[str, str], profile: Profile) -> None:
    """Every block of ``profile`` has a decision, its own or a segment's around it (a plan recomputing
    a module around blocks names it: `plan.segments`), and no block has two."""
    unknown = sorted(set(decisions.values()) - {"keep", "swap", "recompute", "selective"})
    # A name that is no block or module around blocks would be dropped without a word (a typo, or
    # another model's plan): its block would get some other decision than the one meant.
    known = {block.name for block in profile.blocks} | {segment.name for segment in profile.segments}
    strangers = sorted(name for name in decisions if name not in known)
    if strangers:
        # A name inside a block (blocks= named both "b0" and "b0.0": blocks never overlap, the outer kept).
        inside = {name: block.name for name in strangers for block in profile.blocks
                  if name.startswith(block.name + ".")}
        within = (f" ({', '.join(f'{name} lies inside block {outer}' for name, outer in list(inside.items())[:3])}: "
                  "blocks never overlap, and of nested names the outer one is the block)") if inside else ""
        raise InputError(f"decisions name {strangers[:5]}, which are not blocks of this model's step (nor modules "
                         f"around blocks){within}; its blocks are {[block.name for block in profile.blocks][:8]}"
                         f"{' ...' if len(profile.blocks) > 8 else ''}: give a decision for each of those")
    named = [segment for segment in profile.segments if segment.name in decisions]
    covered: dict[int, str] = {}
    for segment in named:
        for position in range(segment.first, segment.last + 1):
            other = covered.setdefault(position, segment.name)
            if other != segment.name:
                raise InputError(f"decisions name {other} and {segment.name}, which share blocks; name one of them")
    for position, block in enumerate(profile.blocks):
        if position in covered and block.name in decisions:
            raise InputError(f"decisions name block {block.name} and {covered[position]}, the module around it; "
                             "name one of them")
    missing = [block.name for position, block in enumerate(profile.blocks)
               if block.name not in decisions and position not in covered]
    if unknown or missing:
        raise InputError(f"decisions must give keep|swap|recompute|selective for every block; "
                         f"unknown values {unknown}, blocks without one {missing[:5]}")
