"""Regional torch.compile: each block of the plan compiled in place, keep / swap / recompute intact.

    model = oomless.fit(model, inputs, memory="8GiB", optimizer=optimizer, compile=True)
    model = oomless.fit(..., compile={"backend": "inductor", "mode": "max-autotune-no-cudagraphs"})

``compile=True`` compiles each block with ``nn.Module.compile()`` (the default inductor backend); a
dict passes ``torch.compile`` options. Compiling per block, not the whole model, is torchtitan's
``apply_compile`` (repeated blocks reuse one compiled graph); compiling in place keeps parameter
names, where ``torch.compile(block)`` would prefix them with ``_orig_mod``.

Why this composes with the plan, from torch 2.13's source and issue threads:
- ``Module.compile`` compiles ``_call_impl``, a frame dynamo does not trace (torch.nn internals,
  ``torch/_dynamo/trace_rules.py``): it compiles the block's ``forward`` frame instead, so the
  block's hooks (oomless's block boundaries, the recompute hooks) run eagerly around the compiled
  forward. The tests check it: every saved tensor is attributed to its block.
- A compiled forward is one autograd function (AOTAutograd's ``CompiledFunction``) that saves what
  its partitioner chose with ``ctx.save_for_backward``; ``saved_tensors_hooks`` entered outside the
  compiled region, oomless's and torch checkpoint's, apply to those tensors when the compiled
  forward returns, and all of a block's are unpacked when its backward starts (pytorch#113263,
  pytorch#148222). Swap therefore moves exactly what the compiled block saves, and a block's
  backward needs all its tensors back at once, as oomless prefetches them per block anyway.
- Recompute is torch's non-reentrant checkpoint around the compiled block (eager checkpointing of
  a compiled region): backward calls the compiled forward again, with the RNG state restored.
- Compiling changes what a block saves (inductor's partitioner recomputes cheap ops in its
  backward instead of saving their outputs), so the profile is taken of the compiled step.
- Chains computed in slabs (`runtime.split`, the streamed outer level of `runtime.stream`) run
  eagerly: their slab engine is custom autograd functions, a Python loop over slabs and saved-tensor
  hooks, which dynamo should not trace. A block that is a split chain is left uncompiled (compiled,
  it would run nothing but the disabled chain); a split chain inside a compiled block is a graph
  break (`SplitChain.forward` is ``torch.compiler.disable``d), the block's other ops compiled before
  and after it; the streamed outer level is the model's own forward, never a block, and calls the
  blocks below it compiled. Split before compiling: `apply_compile` sees which blocks are split.

Combinations refused, each with what works instead (`check_compile_composes`):
- compiled autograd (``torch._dynamo.config.compiled_autograd``) unpacks every saved tensor when
  backward starts (pytorch#143176): swap and recompute would free nothing;
- a model already compiled as a whole (``torch.compile(model)`` or ``model.compile()``): oomless's
  hooks inside it would be traced into its graph; pass the model uncompiled with compile=True;
- CUDA graphs (``mode="reduce-overhead"`` / ``"max-autotune"``) with swap or recompute on CUDA: a graph
  replays into static buffers that a swapped or recomputed tensor does not come back into.
"""

import collections
import functools
import types
from pathlib import Path

import torch
import torch.nn as nn

from oomless.errors import ApplyError, InputError
from oomless.runtime.split import is_split

STATE_ATTRIBUTE = "_oomless_compiled"
# Graphs allowed per shared forward beyond one per block (dynamo's default limit, for other variants:
# grad mode, a dynamic-shape graph after a size changes).
RECOMPILE_MARGIN = 8
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_options(compile) -> dict | None:
    """``torch.compile`` keyword arguments for ``compile`` (False/None: no compile)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        return dict(compile)
    raise InputError(f"compile must be True, False or a dict of torch.compile options, got {compile!r}")


@functools.cache
def _probe(backend) -> str | None:
    """Why torch.compile with ``backend`` cannot run here (None when it can): compiles one tiny function."""
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
        compiled = torch.compile(lambda x: (x * 2).sin(), backend=backend)
        compiled(torch.randn(4))
    except Exception as error:  # noqa: BLE001 - any failure means unavailable; its message is reported
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def check_compile_available(options: dict) -> None:
    """`InputError` before any step if torch.compile cannot run on this Python / platform / build."""
    # A backend is a registered name or, as torch.compile takes it, a callable (probed as itself).
    backend = options.get("backend", "inductor")
    reason = _probe(backend if callable(backend) else str(backend))
    if reason is not None:
        raise InputError(f"compile=True: torch.compile is not available here ({reason}); train without it "
                         "(compile=False, no --compile): plans and results are the same, only slower")


class _Warm(nn.Module):
    """A tiny block of the ops the trainer's models compile: convolution, normalisation, activation."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)
        self.norm = nn.BatchNorm3d(2)

    def forward(self, volume):
        return torch.relu(self.norm(self.conv(volume)))


def warm_up_compile(options: dict, device: torch.device) -> None:
    """Compile and train a tiny block once with ``options`` on ``device``. A process's first compiled
    step starts inductor up (its lazy imports, AOTAutograd's backward compiler, the C++ toolchain's
    caches): on the CPU machine ~20 MiB of the ~60 MiB a 16^3 3D U-Net's first compiled step left
    resident. A run counting its memory from after start-up (the trainer's) calls this first, so that
    its budget counts the model's compiled code, not the compiler's. Leaves the random streams as it
    found them, and a graph of its own (its own ``forward``) in dynamo's caches."""
    check_compile_available(options)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        warm = _Warm().to(device)
        warm.compile(**options)
        warm(torch.randn(2, 1, 4, 4, 4, device=device)).sum().backward()


def check_compile_composes(model: nn.Module, block_names, options: dict, decisions: dict[str, str] | None,
                           device: torch.device) -> None:
    """`ApplyError` naming a combination that does not compose (see the module docstring)."""
    if torch._dynamo.config.compiled_autograd:
        raise ApplyError("compiled autograd (torch._dynamo.config.compiled_autograd) unpacks every saved tensor "
                         "when backward starts, so swap and recompute would free nothing (pytorch#143176); turn it "
                         "off: oomless's compile=True compiles each block's forward and backward without it")
    blocks = set(block_names)
    for name, module in model.named_modules():
        compiled = (isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
                    or getattr(module, "_compiled_call_impl", None) is not None)
        if compiled and name not in blocks and (not name or any(block.startswith(f"{name}.") for block in blocks)):
            label = f"module {name!r}" if name else "the model"
            raise ApplyError(f"{label} is already compiled as a whole (torch.compile / .compile()): oomless's block "
                             "hooks would be traced into its graph. Pass it uncompiled and use compile=True, which "
                             "compiles each block itself")
    moving = decisions is not None and any(decision != "keep" for decision in decisions.values())
    if device.type == "cuda" and options.get("mode") in _CUDA_GRAPH_MODES and moving:
        raise ApplyError(f"compile mode {options['mode']!r} replays CUDA graphs into static buffers, which swapped "
                         "or recomputed tensors do not come back into; use mode='default' or "
                         "'max-autotune-no-cudagraphs' with this plan (or a budget where every block is kept)")


def _traced_forward_marker(module, args):
    """A no-op forward pre-hook; see `apply_compile`."""


_TORCHS_FILES = Path(torch.__file__).resolve().parent


def _forward_in_torchs_files(module: nn.Module) -> bool:
    code = getattr(type(module).forward, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(_TORCHS_FILES)


def _torch_forward(self, *args, **kwargs):
    """A block's own ``forward``, called from a frame in oomless's files, which dynamo traces where it
    skips the frame of a ``forward`` in torch's files (`apply_compile`); it inlines the call."""
    return type(self).forward(self, *args, **kwargs)


def apply_compile(model: nn.Module, block_names, options: dict) -> None:
    """Compile each named block of ``model`` in place (`nn.Module.compile`), but for the blocks split
    into slabs, which run eagerly (module docstring); `remove_compile` undoes it.

    A block whose ``forward`` is in torch's own files (Linear, Conv3d, Sequential, and subclasses of
    them that keep it, such as the 3D U-Net's ``ConvStage``) gets `_torch_forward` as its ``forward``,
    an instance attribute that `remove_compile` deletes: dynamo skips a frame in torch's files, and
    torch 2.13 makes an exception only for a module of a torch.nn class with hooks
    (torch/_dynamo/trace_rules.py, ``check_verbose``; torch 2.11 none). Without it such blocks ran
    eagerly with only a log line: every ConvStage of the U-Net under torch 2.13, every torch.nn
    block under 2.11. Hooks still run eagerly in ``_call_impl`` around the compiled frame. The one
    place oomless sets ``forward`` (STYLE.md's hook points have no way to choose dynamo's first frame);
    a copy.copy of such a block calls the original's forward, and it does not pickle (deepcopy does).
    Each compiled block also gets a no-op forward pre-hook (torch 2.13's exception needs hooks)."""
    if getattr(model, STATE_ATTRIBUTE, None) is not None:
        raise ApplyError("the blocks of this model are already compiled by oomless; oomless.remove(model) first")
    modules = dict(model.named_modules())
    compiled = []
    for name in block_names:
        module = modules[name]
        if module._compiled_call_impl is None and not is_split(module):
            if "forward" not in vars(module) and _forward_in_torchs_files(module):
                module.forward = types.MethodType(_torch_forward, module)
            module.compile(**options)
            compiled.append((module, module.register_forward_pre_hook(_traced_forward_marker)))
    object.__setattr__(model, STATE_ATTRIBUTE, compiled)
    allow_a_graph_per_block([module for module, _ in compiled])


def allow_a_graph_per_block(modules: list[nn.Module]) -> None:
    """Raise dynamo's recompile limits so that every block can have a graph of its own.

    Dynamo keeps its compiled graphs per code object, and blocks of one class share their
    ``forward``'s: where their shapes or constants differ (a 3D U-Net's convolutions, one per
    channel count), each needs its own graph, and past ``recompile_limit`` (8 in torch 2.13) the
    rest run eagerly with only a logged warning. The limits are process-wide: raised, never lowered."""
    sharing = collections.Counter(getattr(module.forward, "__code__", None) for module in modules)
    needed = max(sharing.values(), default=0) + RECOMPILE_MARGIN
    config = torch._dynamo.config
    if needed > config.recompile_limit:
        config.recompile_limit = needed
    if needed > config.accumulated_recompile_limit:
        config.accumulated_recompile_limit = needed


def compile_blocks(model: nn.Module, options: dict, device: torch.device, blocks=None) -> list[str]:
    """Compile ``model``'s blocks (the block policy's, or ``blocks=``) in place, after checking that
    torch.compile runs here and composes with the model; the blocks' names (those split into slabs
    among them run eagerly). Without a plan: a profiling step's, a pipeline stage's, or the
    trainer's when nothing is planned."""
    from oomless.profile.blocks import find_blocks      # profile imports this module's checks

    check_compile_available(options)
    names = [name for name, _ in find_blocks(model, blocks)]
    check_compile_composes(model, names, options, None, device)
    apply_compile(model, names, options)
    return names


def remove_compile(model: nn.Module) -> None:
    """Back to eager: each block oomless compiled calls its own ``_call_impl`` again."""
    for module, marker in getattr(model, STATE_ATTRIBUTE, None) or []:
        # The attribute `nn.Module.compile` sets; unset, `_wrapped_call_impl` calls `_call_impl`.
        module._compiled_call_impl = None
        marker.remove()
        if getattr(vars(module).get("forward"), "__func__", None) is _torch_forward:
            del module.forward
    if hasattr(model, STATE_ATTRIBUTE):
        object.__delattr__(model, STATE_ATTRIBUTE)
