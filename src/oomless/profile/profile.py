"""The Profile: what one measured training step says about a model, per block (plain data)."""

import json
from dataclasses import asdict, dataclass, field


RESIDENT_INPUT = -2   # `BlockProfile.input_held_earlier`'s saver for a parameter or model input


@dataclass
class BlockProfile:
    name: str
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    saved_bytes: int = 0            # storages this block saved first (views / repeats counted once)
    largest_saved_bytes: int = 0    # its largest single storage
    saved_sizes: list[int] = field(default_factory=list)  # each of those storages, in the order saved
    # Indices in saved_sizes of storages a swap of this block leaves on the device: those the runtime
    # cannot move (recorded while profiling: runtime/saved.py `_movable`), and, in the profile a plan
    # is made from, those under its ``min_swap_bytes`` (`plan.simulate.with_swap_threshold`).
    kept_when_swapped: list[int] = field(default_factory=list)
    # For each of those storages, when the forward freed it, in blocks after this one in the order
    # they ran: the whole part counts blocks, the fraction how far into that block's forward (by its
    # saved storages). Below 1: freed within this block, as its intermediates are; about 1: this
    # block's output, freed once the next block has used it; more: a U-Net skip; -1: it outlived the
    # loss. A swapped storage stays resident until its copy is out and it is freed (runtime/saved.py
    # `poll`), so the simulator keeps it that long. Empty where not measured: it leaves when its copy
    # is out.
    saved_alive_blocks: list[float] = field(default_factory=list)
    input_bytes: int = 0
    output_bytes: int = 0
    # Of the block's input storages, those an earlier block of the same forward already had, one
    # [bytes, the earlier block that saved it first (-1: none), [earlier blocks it was an input of]]
    # each, blocks by their position in this profile's list: a recompute of this block holds only
    # the rest, since the runtime's entries are per storage and that block holds it where it is kept
    # (it saved it) or recomputed (its input). Chains of in-place ops (ReLU(inplace=True) after a
    # norm) pass one storage on this way. A parameter or model input (never on the ledger) is
    # [bytes, RESIDENT_INPUT, []]. Empty where not measured: every input counts.
    input_held_earlier: list = field(default_factory=list)
    # Bytes of the storages this block saved first that are its own inputs: its recompute makes
    # none of them anew (they are held as its inputs).
    input_saved_bytes: int = 0
    # Storages this block saves that an earlier block of the forward saved first: [how many blocks
    # before this one that saver is in the profile's list, the storage's index in its saved_sizes, how
    # many storages of its own this block had saved before it] each, once per storage. The runtime
    # moves a storage once, as its first saver's plan says, and backward brings a swapped one back at
    # its first use, which is this block's backward, before its saver's (a 1x1 convolution head saves
    # the last block's output as its input): on the device from there, when the op that saved it here
    # runs. Empty where not measured (meta-tensor profiles).
    saved_earlier: list = field(default_factory=list)
    parameter_bytes: int = 0
    calls: int = 0
    # Floating-point operations of the block's forward and backward as the roofline counts them
    # (`profile.fake`: matmuls, convolutions, attention); None where not traced on meta tensors.
    flops: float | None = None
    # Bytes the forward itself holds when the block starts (earlier blocks' outputs still referenced,
    # e.g. U-Net skips) and gradients of block outputs alive when its backward starts: memory that
    # no swap or recompute of saved tensors can free.
    held_forward_bytes: int = 0
    held_backward_bytes: int = 0
    # Its forward changed one of its own inputs in place (a LeakyReLU(inplace=True) as its first op,
    # ``x.mul_(...)``), or the model did after its call, before backward (`tensors.ChangedAfterCalls`):
    # a recompute of it starts from a copy of its inputs taken before its forward
    # (`BlockPlan.changes_input`), as the changed values would give other saved tensors.
    changes_input: bool = False
    # Measured memory beyond static bytes and saved activations while the block's forward / backward
    # ran (see `profile.recorder`): held tensors, gradients flowing, op workspaces, saves outside
    # every block. None where not measured (fake tensors): the planner then estimates it.
    forward_other_bytes: int | None = None
    backward_other_bytes: int | None = None
    # The most memory beyond static bytes (saved activations on the ledger plus the above) at one
    # time while the block's forward / backward ran with every saved tensor swapped and brought
    # back only when used: a swapped block's own tensors in use are inside it. None: not measured.
    forward_peak_bytes: int | None = None
    backward_peak_bytes: int | None = None
    # The most at one time, in the same step, of the other bytes and the block's own saved storages as
    # a plan keeping it holds them then: those saved so far in its forward; those not yet released in
    # its backward (swapped out or not). Its other bytes peak where part of its own tensors is not
    # made yet (forward) or already freed (backward): the phase's other bytes on top of all of them
    # counted both at once (a transformer layer's attention scores: 22 % over a keep plan's step on
    # CPU). None where not measured: the planner then adds the two.
    forward_own_peak_bytes: int | None = None
    backward_own_peak_bytes: int | None = None
    # The part of those beyond the held bytes (the block's own workspaces); None where not measured.
    forward_transient_bytes: int | None = None
    backward_transient_bytes: int | None = None
    # Gradient bytes accumulated by the end of this block's backward in the profiling step, which
    # starts with none (parameters' gradients are made in backward, the later blocks' first); None
    # where not measured.
    backward_gradient_bytes: int | None = None
    # The trainable parameters (names in the model) whose gradients were accumulated while this
    # block's backward ran in the profiling step, in that order: where the update in backward steps
    # them, and so which gradients, optimizer state and parameters a placement that moves them holds
    # in this phase (`plan.static_phases.phase_static_absent`). Empty where not measured.
    backward_gradient_names: list[str] = field(default_factory=list)
    # The backward's other / peak bytes (as above) in stretches: before the first of those gradients
    # was accumulated, between each and the next, after the last (one more than the names). Where
    # the update in backward steps a module, what is on the device changes: the stretches let the
    # planner add each its own (`plan.static_phases`). Empty where not measured.
    backward_other_by_stretch: list[int] = field(default_factory=list)
    backward_peak_by_stretch: list[int] = field(default_factory=list)
    # Static bytes counted in the profile's parameter, gradient and optimizer-state bytes that are not
    # on the device while this block's forward / backward runs (negative: more are), beyond the
    # gradients not made yet (`plan.simulate.gradients_absent_bytes`): set on the profile as the
    # device sees it under a placement that moves static bytes during the step (`plan.static`); 0
    # in a measured profile.
    forward_static_absent_bytes: int = 0
    backward_static_absent_bytes: int = 0
    # The same for a recompute of the block's forward at the start of its backward.
    recompute_static_absent_bytes: int = 0
    # Selective recompute (runtime/selective.py), measured in the sizing step; None where not measured
    # (the planner then does not offer it): bytes of the outputs of its costly ops (kept from forward
    # to backward), the part of those its backward does not save anyway (freed after the recompute),
    # and the share of its forward's op time those ops take (a recompute runs the rest).
    selective_kept_bytes: int | None = None
    selective_unsaved_bytes: int | None = None
    selective_time_share: float | None = None
    # Channels of each BatchNorm layer in the block: a data-parallel layout synchronises their batch
    # statistics across replicas, with collectives inside forward and backward (`plan.layouts`).
    batchnorm_channels: list[int] = field(default_factory=list)


def flops_of(blocks) -> float | None:
    """The floating-point operations of ``blocks`` together (`BlockProfile.flops`); None where any
    was not traced."""
    counts = [block.flops for block in blocks]
    return None if None in counts else sum(counts)


@dataclass
class SegmentProfile:
    """A module around consecutive blocks (a U-Net stage's ``nn.Sequential``, a transformer layer
    whose attention and MLP are blocks), which the planner may recompute as one, as
    ``torch.utils.checkpoint`` on it would: from its own inputs, holding none of its blocks' inputs
    (`plan.segments`). Called once in the step, around the blocks ``first`` to ``last`` (positions in
    the profile's list) and no other."""

    name: str
    first: int
    last: int
    input_bytes: int = 0
    # As `BlockProfile.input_held_earlier`, for the module's own inputs, by blocks' positions.
    input_held_earlier: list = field(default_factory=list)
    # Bytes of its inputs' storages its blocks saved: a recompute of the module makes them not anew.
    input_saved_bytes: int = 0
    # Its call's forward time in the timing step: its blocks' and the code between them (which the
    # profile counts with the loss, `Profile.loss_seconds`); 0: not measured.
    forward_seconds: float = 0.0


@dataclass
class LinkProfile:
    """Measured bandwidth of the swap tier, bytes per second, each direction."""

    kind: str                       # "pcie" (pinned host <-> CUDA) or "disk"
    out_bytes_per_second: float
    in_bytes_per_second: float


@dataclass
class Profile:
    device: str
    blocks: list[BlockProfile]
    parameter_bytes: int
    gradient_bytes: int
    buffer_bytes: int
    optimizer_state_bytes: int
    input_bytes: int
    unassigned_saved_bytes: int     # saved by ops outside every block: always kept
    loss_seconds: float             # the loss, and the step's time outside every block (glue between them)
    link: LinkProfile
    notes: list[str] = field(default_factory=list)
    measured_peak_bytes: int | None = None   # highest absolute reading while profiling (RSS on CPU)
    # Measured memory beyond static bytes and saved activations from the end of the forward to the
    # first block's backward: the model's output, the loss's own saved tensors and their gradients.
    loss_other_bytes: int | None = None
    loss_peak_bytes: int | None = None       # the most of those plus the ledger at one time; None: not measured
    precision: str = "fp32"         # the autocast the step ran under (runtime/precision.py)
    compiled: bool = False          # whether the blocks ran torch.compile'd (runtime/compile.py)
    split: dict[str, int] = field(default_factory=dict)   # chains computed in slabs: {name: slabs} (runtime/split.py)
    # What the profiler's timing step, run under a plan, held beyond static bytes over the simulator's
    # prediction for that plan (0: within it, or not rehearsed): the planner's margin covers it.
    rehearsal_excess_bytes: int = 0
    # Of the model output's bytes, those the loss does not save: freed before backward in the step as
    # profiled (``loss_fn(model(x)).backward()``), held through it by a loop that keeps a reference to
    # the output (the runtime warns where one does: `runtime.install`).
    output_freed_bytes: int = 0
    # The example inputs' own bytes (`tensors.tensor_bytes`; `input_bytes` counts their storages):
    # what the runtime compares a step's inputs with (`runtime.install`); 0 where not known.
    input_tensor_bytes: int = 0
    # The tensors on the device the loss function holds (its targets: ``lambda out: F.cross_entropy(out,
    # labels)``; `profiler.target_bytes`), resident through the step as the inputs are.
    target_bytes: int = 0
    # What the process holds for the static tensors beyond their bytes (`tensors.static_overhead_bytes`:
    # on CPU page rounding and each tensor's objects, measured ~16 KiB per trainable parameter with Adam;
    # on CUDA the caching allocator's rounding); 0 in profiles made on meta tensors for a target.
    static_overhead_bytes: int = 0
    # Whether the step starts with no gradients (the loop's ``optimizer.zero_grad()``, set_to_none by
    # default, before the forward): then the forward and the loss hold none, and a block's backward
    # those accumulated so far (``backward_gradient_bytes``). False (every gradient counted for the
    # whole step): profiles on meta tensors, gradient accumulation, data parallel (DDP's buckets hold
    # gradients through the step), FSDP, pipeline stages (gradients accumulate over micro-batches).
    gradients_from_backward: bool = False
    # Seconds of the backward split into an input-gradient and a weight-gradient pass, as the
    # zero-bubble pipeline schedules run it (torch's ``stage_backward_input`` then
    # ``stage_backward_weight``), over the backward in one pass (`profile.split_backward`); 1.0 where
    # not measured (Qi et al.'s working assumption: splitting costs nothing).
    split_backward_ratio: float = 1.0
    # What a process keeps once it has run this step, beyond the model's state and the step's own
    # tensors: kernel caches for its shapes (oneDNN's primitives and workspaces on CPU: ~8-25 MiB for
    # a small 3D U-Net), measured from a warm baseline as a rank starts (bench/bench_simulate.py).
    # Every rank holds its own; simulate adds it to each layout's peak per rank. 0: not measured.
    process_held_bytes: int = 0
    # Of every phase's working memory as measured ("other" bytes), what the process held from the
    # step's start: what earlier steps and profiles left (kernels' caches for the step's shapes,
    # compiled code, a fresh process's start-up; `profiler.profile_model`). Counted in each phase as
    # training holds it; named apart where a refusal blames a phase (`plan.planner`). 0: none measured.
    held_from_start_bytes: int = 0
    # The trainable parameters whose gradients were accumulated between the end of the forward and
    # the first block's backward (used by the loss only), and the static bytes absent then (see
    # `BlockProfile.backward_gradient_names` and `BlockProfile.forward_static_absent_bytes`).
    loss_gradient_names: list[str] = field(default_factory=list)
    loss_static_absent_bytes: int = 0
    # What the optimizer's step after backward holds beyond static bytes (its temporaries; with its
    # state off the device, the state it brings in less the state counted): set by the planner for a
    # placement (`plan.optimizer_step`), 0 as measured.
    optimizer_step_other_bytes: int = 0
    # Whether the working memory ("other" and peak bytes) was counted on meta tensors
    # (`profile.fake_memory`): no kernels' workspaces, no allocator; the planner's margin is then the
    # larger one for estimated bytes.
    memory_traced: bool = False
    # The planner's margin as a share of the worst working memory, where whoever made the profile
    # knows it better than the planner's rule (measured 5 %, estimated or traced 20 %): the unsplit
    # floor's estimate, a lower bound, carries the measured share (`plan.splitting`). None: the rule.
    margin_share: float | None = None
    # Modules around consecutive blocks that a plan may recompute as one (`SegmentProfile`), outermost
    # first; measured in the sizing step. Empty where not measured (meta-tensor profiles).
    segments: list[SegmentProfile] = field(default_factory=list)
    # The step's floating-point operations, blocks and loss (`BlockProfile.flops`), and the device's
    # peak FLOP/s over them, each op at its dtype's and kind's (fp32 convolutions at TF32's, as cuDNN
    # runs them; bf16 matmuls under autocast at bf16's): their total over the seconds they take at
    # those peaks. None where not traced on meta tensors.
    flops: float | None = None
    peak_flops_per_second: float | None = None

    @property
    def activation_bytes(self) -> int:
        return sum(block.saved_bytes for block in self.blocks) + self.unassigned_saved_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        data = json.loads(text)
        data["blocks"] = [BlockProfile(**block) for block in data["blocks"]]
        data["link"] = LinkProfile(**data["link"])
        data["segments"] = [SegmentProfile(**segment) for segment in data.get("segments", [])]
        return cls(**data)
