"""The Plan: plain data saying, per block, keep / swap / recompute and why, with the budget
arithmetic and the predictions behind it. It prints as a table, saves as JSON and loads back."""

import io
import json
from dataclasses import asdict, dataclass, field

from oomless.errors import InputError, one_line
from oomless.sizes import format_bytes


@dataclass
class BlockPlan:
    name: str
    decision: str
    reason: str
    saved_bytes: int
    forward_seconds: float
    backward_seconds: float
    # Saved-activation bytes the runtime lets onto the device while this block's forward / backward
    # runs (the budget less the phase's own working memory); None: the plan's activation_budget.
    forward_limit_bytes: int | None = None
    backward_limit_bytes: int | None = None
    # A recompute block that keeps its matmul/convolution/attention outputs and re-runs only the
    # rest of its forward (runtime/selective.py); its decision stays "recompute".
    selective: bool = False
    # What a recompute of it makes anew: its saved bytes but its own inputs, held already
    # (`plan.simulate.recomputed_bytes`); None: all its saved bytes.
    recomputed_bytes: int | None = None
    # Its forward changes one of its inputs in place (`BlockProfile.changes_input`): recomputed, it
    # holds a copy of its inputs as they were before its forward, in their place.
    changes_input: bool = False


@dataclass
class StaticPart:
    """One kind of static bytes (plan/static.py): all of it, what the device holds at once, and where."""

    name: str              # parameters | gradients | optimizer state | buffers | inputs | targets | allocator and objects
    total_bytes: int
    device_bytes: int      # what the budget counts
    where: str

    def describe(self) -> str:
        """"parameters 1.3 MiB"; with how much of it the device holds, and where, where that is not all
        of it on the device; with what it is, where the kind says so ("targets 0 B (device: ...)")."""
        text = f"{self.name} {format_bytes(self.device_bytes)}"
        if self.device_bytes != self.total_bytes:
            text += f" of {format_bytes(self.total_bytes)}"
        return text if self.where == "device" else f"{text} ({self.where})"


STREAMED = "the outer level, streamed"     # how split={"": slabs} (runtime/stream.py) reads
STREAM_KEY = ""                            # runtime.stream.STREAM, not imported: a plan is plain data


@dataclass
class Plan:
    """The plan for one model and budget. Its promise: ``predicted_peak_bytes`` (static bytes, the
    measurement margin, and the most the step holds beyond static bytes at one time: saved
    activations on the device plus the running phase's working memory) is within ``memory_bytes``.
    ``reserve_bytes`` is the working memory of the step's worst phase (held tensors, gradients in
    flight, op workspaces) with the margin; ``activation_budget`` the most saved-activation bytes the
    runtime lets onto the device at any time (in the phase with the least working memory; each
    block's phases have their own limits). The worst phase and the activation peak are at different
    times: static + reserve + activation_budget may exceed ``memory_bytes``."""

    memory_bytes: int
    device: str
    static_bytes: int
    reserve_bytes: int
    activation_budget: int
    predicted_peak_bytes: int
    predicted_activation_peak_bytes: int
    predicted_step_seconds: float
    plain_peak_bytes: int
    plain_step_seconds: float
    blocks: list[BlockPlan]
    prefetch_bytes: int | None = None   # swapped bytes brought back ahead of use at most (None: budget allows)
    min_swap_bytes: int = 64 * 1024
    static_breakdown: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Each parameter's optimizer step in backward, its gradient freed at once (runtime/update_in_backward.py);
    # with gradient accumulation, at its accumulation_steps-th gradient.
    update_in_backward: bool = False
    accumulation_steps: int = 1
    # The optimizer state between updates in pinned host memory (CUDA) or on disk (CPU), brought in
    # around each parameter's update (runtime/offload_state.py).
    offload_optimizer_state: bool = False
    # Each block's own parameters in the same tier between uses (runtime/offload_parameters.py).
    offload_parameters: bool = False
    static_parts: list[StaticPart] = field(default_factory=list)
    precision: str = "fp32"          # "bf16" | "fp16": the step runs under torch.autocast (runtime/precision.py)
    compile: dict | None = None      # torch.compile options of each block ({} = defaults); None: eager (runtime/compile.py)
    split: dict[str, int] = field(default_factory=dict)   # chains computed in slabs: {name: slabs} (runtime/split.py)
    # Parameters, gradients and optimizer state sharded over this many ranks (FSDP2, --parallel fsdp;
    # plan.static.sharded_device_bytes): the static bytes counted are one rank's.
    shard_over: int = 1
    # The plan counts gradients from backward on (`Profile.gradients_from_backward`): each step must
    # start without them (the loop's ``optimizer.zero_grad()``); the runtime warns where one does not.
    gradients_from_backward: bool = False
    # Bytes of the model's output the loss does not save (`Profile.output_freed_bytes`): the plan
    # counts them freed before backward, as in ``loss_fn(model(x)).backward()``; a loop that keeps
    # the output into backward holds them too (the runtime warns).
    output_freed_bytes: int = 0
    # The example inputs' own bytes (`Profile.input_tensor_bytes`): a step on more warns (runtime/install.py).
    input_tensor_bytes: int = 0
    # Saved-activation bytes the runtime lets stay on the device once the forward has returned, while
    # the loss runs (the budget less the loss's own working memory); None (plans written before it,
    # or made without a loss phase): the activation budget, as for a block without limits of its own.
    loss_limit_bytes: int | None = None
    # The model's mode when the step was measured (``model.training``): dropout saves its masks and
    # BatchNorm its batch statistics only in training mode, so a plan made in eval mode undercounts a
    # training-mode step (a 4-layer transformer encoder: 24 MiB planned, 72 saved); a step in the other
    # mode warns (runtime/install.py). None: plans written before it, or made outside `oomless.plan`.
    training: bool | None = None
    # Digests of the model's parameters' and buffers' names, shapes and dtypes, per block and outside
    # them (plan/model_digests.py): `apply` refuses the plan on a model they do not match. None: plans
    # written before them, or made outside `oomless.plan`.
    model_digests: dict[str, str] | None = None

    @property
    def decisions(self) -> dict[str, str]:
        """{block name: "keep" | "swap" | "recompute"} in execution order."""
        return {block.name: block.decision for block in self.blocks}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
            data["blocks"] = [BlockPlan(**block) for block in data["blocks"]]
            data["static_parts"] = [StaticPart(**part) for part in data.get("static_parts", [])]
            return cls(**data)
        except (ValueError, KeyError, TypeError) as error:     # not JSON, or not a plan's fields
            raise InputError(f"the text is not a plan written by Plan.to_json ({one_line(error)})") from None

    def with_decisions(self, decisions: dict[str, str], reason: str = "given by the user") -> "Plan":
        """A copy of this plan with some decisions replaced (predictions are not recomputed)."""
        blocks = [BlockPlan(**{**asdict(block), "decision": decisions[block.name], "reason": reason, "selective": False})
                  if block.name in decisions else block for block in self.blocks]
        return Plan(**{**asdict(self), "blocks": blocks, "static_parts": list(self.static_parts)})

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"oomless plan: {format_bytes(self.memory_bytes)} on {self.device}")
        for column in ("block", "saved", "fwd ms", "bwd ms", "decision", "why"):
            table.add_column(column, justify="right" if column in ("saved", "fwd ms", "bwd ms") else "left")
        for block in self.blocks:
            table.add_row(block.name, format_bytes(block.saved_bytes), f"{block.forward_seconds * 1e3:.2f}",
                          f"{block.backward_seconds * 1e3:.2f}",
                          block.decision + (" (selective)" if block.selective else ""), block.reason)
        buffer = io.StringIO()
        console = Console(file=buffer, width=120, force_terminal=False, color_system=None)
        console.print(table)
        breakdown = ", ".join(f"{name} {format_bytes(value)}" for name, value in self.static_breakdown.items())
        if self.static_parts:
            breakdown = ", ".join(part.describe() for part in self.static_parts)
        lines = [
            f"precision {self.precision}{self._compiled_blocks()}; " +
            f"static {format_bytes(self.static_bytes)} ({breakdown}); reserve {format_bytes(self.reserve_bytes)}; "
            f"activation budget {format_bytes(self.activation_budget)}",
            f"predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(activations {format_bytes(self.predicted_activation_peak_bytes)}), "
            f"step {self.predicted_step_seconds * 1e3:.1f} ms; plain PyTorch: peak "
            f"{format_bytes(self.plain_peak_bytes)}, step {self.plain_step_seconds * 1e3:.1f} ms",
        ] + ([f"split into slabs along the first spatial axis: "
              f"{', '.join(f'{name or STREAMED} ({slabs})' for name, slabs in self.split.items())}"]
             if self.split else [])
        lines += [f"note: {note}" for note in self.notes]
        return buffer.getvalue() + "\n".join(lines)

    def _compiled_blocks(self) -> str:
        """What runs compiled: chains in slabs run eagerly (runtime/compile.py says why)."""
        if self.compile is None:
            return ""
        eager = [name for name in self.split if name in self.decisions]
        if STREAM_KEY in self.split:
            eager.append(f"{STREAMED} (the blocks below it compiled)")
        inside = [name for name in self.split if name != STREAM_KEY and name not in self.decisions]
        return (", blocks compiled" + (f"; in slabs, run eagerly: {', '.join(eager)}" if eager else "")
                + (f"; in slabs inside compiled blocks, run eagerly between their compiled parts: {', '.join(inside)}"
                   if inside else ""))
