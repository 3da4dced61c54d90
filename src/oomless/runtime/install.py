"""`apply` / `remove`: install a Plan on a model in place, through hooks only.

- A forward pre-hook on the model opens `saved_tensors_hooks` for the whole forward; its forward
  hook (always called, even on an exception) closes it. On a KeyboardInterrupt torch calls no
  forward hook: the next forward closes what the interrupted one left open (`runtime.open_calls`).
- Each block's pre/post hooks tell the pack hook which block (and so which decision) is running.
- Recompute blocks get the non-reentrant checkpoint hooks of `recompute.py`.
The state lives on the model as ``model._oomless`` and `remove` restores the model exactly.
"""

import copy
import inspect
import os
import sys
import warnings

import torch
import torch.nn as nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:          # a build without torch.distributed: no sharded parameters either
    DTensor = ()

from oomless.errors import ApplyError
from oomless.profile.tensors import alive_bytes, has_storage, tensor_bytes, tensors_in, weak_storages
from oomless.runtime.ledger import Ledger
from oomless.runtime.open_calls import is_running, module_call_frame
from oomless.runtime.recompute import RecomputeBlock
from oomless.runtime.saved import SavedTensorEngine
from oomless.runtime.saved_entries import KEEP, RECOMPUTE, SWAP
from oomless.runtime.tiers import make_tier
from oomless.sizes import format_bytes

STATE_ATTRIBUTE = "_oomless"
# A plan that keeps every block moves nothing: its pack hooks only count (`oomless.stats`). Once
# forwards with the same inputs' shapes have been counted this many times, later ones run without
# the hooks (their count would repeat; ~12 us per saved tensor, 5.5 % of a small transformer's step).
COUNTED_FORWARDS = 2


def _storage_keys(tensors) -> set[tuple]:
    # Sparse and nested tensors have no single storage to name (untyped_storage() raises); the pack
    # hook hands them back unswapped anyway.
    return {(t.device, t.untyped_storage().data_ptr()) for t in map(_local, tensors)
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and has_storage(t)}


def _local(tensor):
    """The tensor that owns the bytes: a DTensor's (an FSDP-sharded parameter's) local shard; a
    DTensor has no storage of its own."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# Frames of these folders are not the user's: a warning raised inside backward names the first frame
# outside them (the loop's ``loss.backward()``).
_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _callers_level() -> int:
    """The ``stacklevel`` for a warning raised by the function calling this one, that names the
    first frame outside torch and oomless (2, the caller's caller, where there is none: a backward
    on a device thread)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


# An output whose unsaved bytes are at least 1/this of the plan's memory is watched (`_watch_output`);
# a smaller one kept by the loop costs under 1 % of the plan: not worth a warning on every run.
WATCHED_OUTPUT_SHARE = 100


class InstalledPlan:
    """Everything `apply` added to a model; `oomless.stats` and `remove` read it."""

    def __init__(self, model: nn.Module, plan, device: torch.device, recorder=None):
        self.plan = plan
        self.device = device
        self.ledger = Ledger()
        if recorder is not None:
            self.ledger.observer = recorder.ledger_changing
        self.tier = make_tier(device) if SWAP in plan.decisions.values() or recorder else None
        budget = plan.activation_budget if plan.activation_budget > 0 else None
        self.engine = SavedTensorEngine(self.ledger, self.tier, plan.prefetch_bytes, plan.min_swap_bytes, budget,
                                        device, [block.forward_limit_bytes for block in plan.blocks],
                                        [block.backward_limit_bytes for block in plan.blocks], plan.loss_limit_bytes)
        self.engine.recorder = recorder
        self.engine.block_names = [block.name for block in plan.blocks]
        if recorder is None and any(block.saved_bytes and block.decision != RECOMPUTE for block in plan.blocks):
            self.engine.blocks_unseen = self._warn_blocks_unseen
        self.engine.recompute_bytes = {
            index: block.saved_bytes if block.recomputed_bytes is None else block.recomputed_bytes
            for index, block in enumerate(plan.blocks) if block.decision == RECOMPUTE}
        self.recorder = recorder
        self.handles: list = []
        self._hooks_context = None
        self._forward_frame = None  # torch's call of the model the hooks are open for (`runtime.open_calls`)
        self._calls_inside = 0      # calls of the model inside its own forward, still running
        self.recompute_blocks: list[RecomputeBlock] = []
        self._parameters_move = True
        self._warned_gradients = False
        self._warned_output = False
        self._warned_inputs = False
        self._warned_mode = False
        self._gathered_keys: dict[int, set[tuple]] = {}     # block index: its gathered parameters' storages
        # Whether the hooks only count here (every block kept, nothing moved or measured), and how
        # many forwards of each inputs' signature they have counted.
        self._counts_only = (all(decision == KEEP for decision in plan.decisions.values()) and recorder is None
                             and not plan.offload_parameters and not getattr(plan, "split", None))
        self._counted: dict[tuple, int] = {}
        modules = dict(model.named_modules())
        missing = [name for name in plan.decisions if name not in modules]
        if missing:
            raise ApplyError(f"the plan names blocks {missing[:5]} that this model does not have; "
                             "make the plan for this model (oomless.plan(model, ...))")
        self.block_modules = [(index, name, modules[name]) for index, name in enumerate(plan.decisions)]
        self.recomputes = RECOMPUTE in plan.decisions.values()
        compiled = any(_is_compiled(module) for _, _, module in self.block_modules)
        self._pack, self._unpack = _eager(self.engine.pack, compiled), _eager(self.engine.unpack, compiled)

    def __deepcopy__(self, memo: dict) -> "InstalledPlan":
        """What a copy of the model needs of this to have the plan taken off it (`remove`, as
        `runtime.deepcopy` does right after copying): the hooks' handles, on the copy's modules.
        The engine, tier and ledger are this model's, and are not copied."""
        copied = object.__new__(type(self))
        copied.plan, copied.tier, copied.handles = self.plan, None, copy.deepcopy(self.handles, memo)
        return copied

    def install(self, model: nn.Module) -> None:
        self.handles.append(model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
        self.handles.append(model.register_forward_hook(self._model_post_hook, always_call=True))
        for index, name, module in self.block_modules:
            decision = self.plan.decisions[name]
            compiled = _is_compiled(module)
            if decision == RECOMPUTE:
                block = RecomputeBlock(module, index, self.engine, selective=self._selective(index, module),
                                       name=name, changes_input=self.plan.blocks[index].changes_input,
                                       compiled=compiled)
                self.recompute_blocks.append(block)
                self.handles.append(module.register_forward_pre_hook(_eager(block.pre_hook, compiled), with_kwargs=True))
                block.pre_hook_id = self.handles[-1].id
                self.handles.append(module.register_forward_hook(_eager(block.post_hook, compiled), always_call=True))
            self.handles.append(module.register_forward_pre_hook(_eager(self._block_enter(index, decision), compiled)))
            self.handles.append(module.register_forward_hook(_eager(self._block_exit(index), compiled), always_call=True))

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.tier is not None:
            self.tier.close()

    def _model_pre_hook(self, model, args, kwargs):
        if self._hooks_context is None:
            # A new step (or an evaluation) between backwards: one that raised left its last
            # recompute's bytes on the ledger (the callback that takes them off at its end was
            # dropped with it).
            self.engine.backward_moved()
        elif is_running(self._forward_frame):
            # A call of the model inside its own forward: part of the outer step, under its hooks,
            # which its end must not take off (`_model_post_hook`).
            self._calls_inside += 1
            return
        else:
            self._close_interrupted_forward()
        if not torch.is_grad_enabled():
            return
        kwargs = self._without_cache(model, kwargs)
        parameters = list(model.parameters())
        if self.plan.gradients_from_backward and not self._warned_gradients:
            held = sum(p.grad.nbytes for p in parameters if p.grad is not None)
            # Said where they could take the step past the plan's memory (10 KiB of a 1 TiB plan: not).
            if held and self.plan.predicted_peak_bytes + held > self.plan.memory_bytes:
                self._warned_gradients = True
                warnings.warn(
                    f"this step starts with {format_bytes(held)} of gradients, which the plan counts from backward on "
                    "only (each step starting from optimizer.zero_grad(), set_to_none=True by default): the step may "
                    f"exceed the plan's {format_bytes(self.plan.memory_bytes)}. Call optimizer.zero_grad() before "
                    "the forward, or for gradient accumulation plan with accumulation_steps=k", UserWarning,
                    stacklevel=_callers_level())
        planned_training = getattr(self.plan, "training", None)
        if planned_training is not None and model.training != planned_training and not self._warned_mode:
            self._warned_mode = True
            planned, now = ("training", "eval") if planned_training else ("eval", "training")
            warnings.warn(
                f"this step runs the model with gradients in {now} mode, but the plan was made with it in {planned} mode: "
                "dropout and BatchNorm save other tensors in each mode, so the step may exceed the plan's "
                f"{format_bytes(self.plan.memory_bytes)}. Put the model in the mode you train in before planning "
                f"(model.{'train' if now == 'training' else 'eval'}(), then oomless.plan or oomless.fit)"
                + ("; an evaluation pass runs under torch.no_grad() (not checked)" if now == "eval" else ""), UserWarning,
                stacklevel=_callers_level())
        inputs = tensors_in((args, kwargs))
        if not self._warned_inputs:
            self._check_inputs(inputs)
        if self._counts_only and self._counted_enough(inputs):
            self.ledger.steps += 1
            return args, kwargs
        # Whether a block's parameters may sit in storages made after this point (FSDP all-gathers
        # sharded ones in its pre-hook; offloaded ones come back from the tier): then each block
        # adds its own when it starts. Otherwise they never move, and the set below holds them.
        self._parameters_move = self.plan.offload_parameters or any(isinstance(p, DTensor) for p in parameters)
        resident = _storage_keys(parameters) | _storage_keys(model.buffers())
        resident |= _storage_keys(inputs)
        self.engine.begin_forward(resident)
        self.ledger.steps += 1
        if self.tier is not None:
            self.ledger.stall_seconds += self.tier.collect_stall_seconds()
        self._hooks_context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_context.__enter__()
        self._forward_frame = module_call_frame()
        if self.recorder is not None:
            self.recorder.forward_started(resident)
        return args, kwargs

    def _close_interrupted_forward(self) -> None:
        """The last forward was interrupted where torch calls no forward hook (a KeyboardInterrupt):
        close what its hooks opened, innermost first: the recomputes' checkpoints, then the plan's
        saved-tensor hooks (both on autograd's one stack of them). Its graph, if the loop kept it,
        trains no further: the loop went on to the next batch."""
        for block in sorted((block for block in self.recompute_blocks if block.generator is not None),
                            key=lambda block: block.opened, reverse=True):
            block.abandon()
        context, self._hooks_context, self._forward_frame = self._hooks_context, None, None
        context.__exit__(None, None, None)
        self._calls_inside = 0
        self.engine.block_index, self.engine.decision = None, KEEP
        self._gathered_keys.clear()

    def _check_inputs(self, inputs: list[torch.Tensor]) -> None:
        """Warn once where a step's input tensors hold more bytes than the example the plan was made for
        (`Plan.input_tensor_bytes`): saved activations grow with them (a larger batch, a longer
        sequence, a larger volume), so the plan's memory may not hold. Both counted the same way, by
        the tensors' own bytes (`tensors.tensor_bytes`): a batch sliced from a larger tensor counts its
        own size, two views of one tensor each theirs."""
        planned = self.plan.input_tensor_bytes
        if not planned:
            return      # a plan without the figure (made from a hand-written profile, or an older file)
        now = tensor_bytes(inputs)
        if now > planned:
            self._warned_inputs = True
            warnings.warn(
                f"this step's inputs hold {format_bytes(now)}, more than the {format_bytes(planned)} of the example "
                "the plan was made for: saved activations grow with the inputs, so the step may exceed the plan's "
                f"{format_bytes(self.plan.memory_bytes)}. Plan with the largest inputs you train on, passed as the "
                "loop passes them (oomless.plan(model, largest_example, ...)); smaller ones stay within it",
                UserWarning, stacklevel=_callers_level())

    def _counted_enough(self, inputs: list[torch.Tensor]) -> bool:
        """An all-keep plan: whether forwards of these input tensors' shapes were counted
        `COUNTED_FORWARDS` times already (then this one runs without hooks); else it counts one more."""
        signature = tuple((tuple(tensor.shape), tensor.dtype, tensor.device) for tensor in inputs)
        seen = self._counted.get(signature, 0)
        if seen >= COUNTED_FORWARDS:
            return True
        self._counted[signature] = seen + 1
        return False

    def _without_cache(self, model, kwargs):
        """A recomputed block must compute what it computed in the forward. A Hugging Face model that
        fills a key/value cache (``config.use_cache``, on by default) appends to it each time a layer
        runs, so the recomputed layer would attend to its keys twice: wrong gradients, silently. As
        Hugging Face's own gradient checkpointing does, training with recompute runs without the
        cache: this call gets ``use_cache=False`` (the model and its config are left as they are)."""
        if not self.recomputes or not getattr(getattr(model, "config", None), "use_cache", False):
            return kwargs
        if "use_cache" not in inspect.signature(model.forward).parameters:
            return kwargs
        if kwargs.get("use_cache"):
            raise ApplyError("use_cache=True was passed to a model with recomputed blocks: a recomputed layer "
                             "would append its keys to the cache a second time; train with use_cache=False, or "
                             "plan without recompute (decisions= keep or swap)")
        return {**kwargs, "use_cache": False}

    def _model_post_hook(self, model, args, output):
        if self._hooks_context is None:
            return
        if self._calls_inside:
            # The inner call ended: the outer forward goes on, its saves still the plan's (ending the
            # hooks here let every save after it escape the plan: kept, on no ledger).
            self._calls_inside -= 1
            return
        context, self._hooks_context, self._forward_frame = self._hooks_context, None, None
        context.__exit__(None, None, None)
        self.engine.block_index = None
        # The forward's locals are gone (a U-Net's skips): swapped storages they held leave the ledger
        # now (`make_room` polls first), not at the next swapped unpack, which a plan keeping its
        # last blocks reaches late in backward (`make demo`: a 16 MiB skip on the ledger through the
        # loss and the first blocks' backward, and the profiling step read the loss's working memory
        # 16 MiB short under it). And the loss runs next with its own working memory: copies out that
        # fell behind the plan's (a disk slower than profiled) finish first, or the ledger they hold
        # passes the loss's share of the budget, which no block's limit guards (a transformer's
        # rehearsal at its floor on CPU, every write 50 ms late: 8.4 MiB over its prediction, all of
        # it in the loss).
        self.engine.make_room(0, self.engine.loss_limit)
        if self.plan.output_freed_bytes * WATCHED_OUTPUT_SHARE >= self.plan.memory_bytes and not self._warned_output:
            self._watch_output(output)
        if self.recorder is not None:
            self.recorder.forward_finished(output)

    def _watch_output(self, output) -> None:
        """The plan counts the bytes of the output the loss does not save as freed before backward
        (`Plan.output_freed_bytes`): check, as backward begins, that the loop did not keep them."""
        storages = weak_storages(tensors_in(output), self.engine.resident_storages)
        total = sum(num_bytes for _, num_bytes in storages.values())
        freed = self.plan.output_freed_bytes

        def check():
            alive = alive_bytes(storages)
            # Dropped, the output keeps only what the loss saved (total - freed); kept, all of it.
            if alive - (total - freed) > freed // 2 and not self._warned_output:
                self._warned_output = True
                warnings.warn(
                    f"the training loop keeps the model's output ({format_bytes(total)}) into backward; the plan counts "
                    f"the {format_bytes(freed)} of it the loss does not save as freed before backward, as in "
                    "loss_fn(model(x)).backward(), so this step may exceed the plan's "
                    f"{format_bytes(self.plan.memory_bytes)} by that much. Drop the reference before backward (take "
                    "metrics from output.detach() first, then del output), or plan for that much less memory",
                    UserWarning, stacklevel=_callers_level())

        self.engine.backward_check = check

    def _warn_blocks_unseen(self) -> None:
        """Backward reads saved tensors of a forward in which no block saved one through the plan's
        hooks: the blocks ran where the hooks could not see them, most likely inside a graph
        compiled from the whole model, which saves its tensors once the graph is done."""
        warnings.warn(
            "oomless saw none of the plan's blocks save a tensor in this forward, yet backward reads saved tensors: "
            "the model is most likely compiled as a whole (torch.compile(model)), whose graph saves its tensors after "
            "the blocks ran, so the plan's swaps and recomputes do not happen and the step holds plain PyTorch's "
            "memory. Compile with the plan instead: oomless.plan(..., compile=True) compiles each block with the "
            "plan around it (or leave the model uncompiled)", UserWarning, stacklevel=_callers_level())

    def _block_enter(self, index: int, decision: str):
        def hook(module, args):
            self.engine.block_entered(index)
            self.engine.decision = decision
            if self._hooks_context is not None and self._parameters_move:
                self._mark_gathered_parameters(index, module)
            self.engine.poll()
            if self.recorder is not None and torch.is_grad_enabled():
                self.recorder.block_started(index, args)
        return hook

    def _block_exit(self, index: int):
        def hook(module, args, output):
            self.engine.block_index, self.engine.decision = None, KEEP
            gathered = self._gathered_keys.pop(index, None)
            if gathered:
                self.engine.resident_storages -= gathered
            if self.recorder is not None and torch.is_grad_enabled():
                self.recorder.block_finished(index, output)
        return hook


    def _mark_gathered_parameters(self, index: int, module: nn.Module) -> None:
        """Count the block's parameters as resident while it runs, also those that did not exist when
        the model's forward began: FSDP all-gathers a sharded block's parameters into fresh storages
        in its own pre-hook, which runs before this one (fully_shard prepends it), and frees them
        after the block. Kept out of the set once the block is done: a later activation may be
        allocated where those storages were."""
        keys = _storage_keys(module.parameters()) - self.engine.resident_storages
        if keys:
            self._gathered_keys[index] = keys
            self.engine.resident_storages |= keys


    def _selective(self, index: int, module: nn.Module) -> bool:
        """Whether recompute block ``index`` runs selective (runtime/selective.py): where the plan says
        so and nothing but the block's own ops runs inside it. Parameters brought in by hooks
        (offloaded ones, FSDP's all-gather) and compiled code would run ops in torch's replay that its
        cache of kept outputs does not know: there the block recomputes all of its forward, which
        holds less than the plan counted."""
        if not self.plan.blocks[index].selective:
            return False
        return not (self.plan.offload_parameters or _is_compiled(module)
                    or any(isinstance(p, DTensor) for p in module.parameters()))


def _is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None    # set by nn.Module.compile


def _eager(hook, compiled: bool):
    """Every Python frame run inside a torch.compile'd call is itself compiled by dynamo, hooks called
    around a compiled block's forward and the pack hook its compiled function calls included;
    disabled, they run eagerly as written (runtime/compile.py)."""
    return torch.compiler.disable(hook) if compiled else hook


def install_plan(model: nn.Module, plan, device: torch.device, recorder=None) -> nn.Module:
    if getattr(model, STATE_ATTRIBUTE, None) is not None:
        raise ApplyError("oomless is already applied to this model; call oomless.remove(model) "
                         "before applying another plan")
    state = InstalledPlan(model, plan, device, recorder)
    state.install(model)
    object.__setattr__(model, STATE_ATTRIBUTE, state)
    return model


def uninstall_plan(model: nn.Module) -> nn.Module:
    state = getattr(model, STATE_ATTRIBUTE, None)
    if state is None:
        raise ApplyError("oomless is not applied to this model; nothing to remove")
    state.uninstall()
    object.__delattr__(model, STATE_ATTRIBUTE)
    return model


def installed_state(model: nn.Module) -> InstalledPlan | None:
    return getattr(model, STATE_ATTRIBUTE, None)
