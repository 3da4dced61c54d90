"""One training configuration in a fresh process: its peak memory and step time, as one JSON line.

    python bench/floor_child.py '{"model": "unet3d", "side": 64, "batch": 2, "mode": "plain"}'
    python bench/floor_child.py '{"model": "deeplabv3", "backbone": "resnet50", "side": 256, "batch": 2, "mode": "plain"}'

Models: unet3d, monai-unet, monai-basicunet, monai-segresnet, monai-swin-unetr (volumes, ``side``),
deeplabv3, resnet50 (images, ``side``), gpt2, bert, vit, transformer (see `build`).

Modes: ``plain`` (plain PyTorch), ``checkpoint`` (``torch.utils.checkpoint`` on every block of
oomless's default block policy, the baseline users write by hand), ``save_on_cpu`` (PyTorch's
offload of every saved tensor to host memory; on CUDA), ``oomless`` (``oomless.fit`` at
``memory``; ``"memory": "floor"`` first asks the planner for its smallest budget, as a user reading
the PlanError would, and plans again at that). ``versus`` times speed only: the model checkpointed
and a copy under oomless's plan for ``memory`` (``"baseline": "save_on_cpu"``: that against the
plan), their steps interleaved in one process (`versus`), so that what slows this machine for a
while slows both alike; no memory is reported.

The peak is the rise above a baseline taken after imports and a warm-up step of the same model at a
small size (library start-up is not the step's memory): on CPU the process's resident set (glibc told
to return freed memory), on CUDA ``torch.cuda.max_memory_allocated``. Everything after the baseline
counts: the model, the optimizer's state, planning (its profiling steps) and ``steps`` training steps.
``"report_floor": true`` also reports the smallest budget oomless plans for (``floor_bytes``);
``"over_floor": 1.1`` plans ``"memory": "floor"`` at that multiple of it;
``"fused_head": true`` trains GPT-2 without its head, the loss through `oomless.linear_cross_entropy`;
``"split"`` and ``"precision"`` are passed to `oomless.plan` (default None: the planner splits chains
where it must; fp32).
Used by bench/bench_max_size.py and tests/test_floor.py.
"""

import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time

# Before torch: every mode gets PyTorch's huge pages for large CPU tensors, as a user of the CLI or
# of a script that imports oomless first does (`oomless.profile.rss.turn_on_huge_pages_unless_set`).
import oomless  # noqa: I001

import torch
import torch.nn.functional as F
from torch import nn

from oomless.errors import PlanError
from oomless.models import make_torchvision_importable
from oomless.profile.blocks import find_blocks
from oomless.profile.tensors import call_model
from oomless.profile.rss import (current_rss_bytes, give_back_free_heap, peak_rss_bytes, reset_peak_rss,
                                 return_freed_memory_to_the_system)

from common import checkpoint_every_block  # bench/common.py (this script's folder is on sys.path)

make_torchvision_importable()   # before torchvision or transformers is imported (src/oomless/models/vision.py)


def build(config: dict, device: torch.device, small: bool = False):
    """(model, inputs, loss_fn) for ``config``, seeded; ``small`` is the warm-up's size."""
    torch.manual_seed(0)
    name = config["model"]
    batch = config.get("batch", 1)
    if name in ("unet3d", "monai-unet", "monai-basicunet", "monai-segresnet"):
        side = 16 if small else config["side"]
        channels = config.get("channels", 1)
        volume = torch.randn(batch, channels, side, side, side, device=device)
        # With the loss in slabs the labels are one byte per voxel (it makes each slab's int64).
        labels = (volume[:, 0] > 0.5).to(torch.uint8 if config.get("loss_in_slabs") else torch.long)
        if name == "monai-basicunet" and small:
            side = 32   # it halves the volume four times, and normalises each channel over what is left
            volume = torch.randn(batch, channels, side, side, side, device=device)
            labels = (volume[:, 0] > 0.5).to(labels.dtype)
        if name == "unet3d":
            from oomless.models import UNet3D
            model = UNet3D(in_channels=channels, base_channels=config.get("base_channels", 8),
                           depth=config.get("depth", 3))
        elif name == "monai-unet":
            from monai.networks.nets import UNet
            model = UNet(spatial_dims=3, in_channels=channels, out_channels=2, channels=(8, 16, 32, 64),
                         strides=(2, 2, 2), num_res_units=2, dropout=0.1)
        elif name == "monai-basicunet":
            from monai.networks.nets import BasicUNet
            model = BasicUNet(spatial_dims=3, in_channels=channels, out_channels=2, features=(8, 8, 16, 32, 64, 8))
        else:
            from monai.networks.nets import SegResNet
            model = SegResNet(spatial_dims=3, in_channels=channels, out_channels=2, init_filters=8)
        if config.get("loss_in_slabs"):
            # The loss computed in slabs (oomless.loss_in_slabs): none of its per-voxel tensors whole.
            return model.to(device), volume, lambda out: oomless.loss_in_slabs(F.cross_entropy, out, labels)
        return model.to(device), volume, lambda out: F.cross_entropy(out, labels)
    if name == "deeplabv3":
        # torchvision's DeepLabv3, no weights: square RGB images, two classes. Trains at a batch of 2 or
        # more: its image-pooling branch normalises a 1x1 map over the batch.
        from oomless.models import build_deeplabv3
        side = min(64, config["side"]) if small else config["side"]     # the warm-up no larger than the step
        images = torch.randn(batch, 3, side, side, device=device)
        labels = (images[:, 0] > 0.5).long()
        model = build_deeplabv3(num_classes=2, backbone=config.get("backbone", "resnet50"))
        if config.get("loss_in_slabs"):
            return model.to(device), images, lambda out: oomless.loss_in_slabs(F.cross_entropy, out["out"], labels)
        return model.to(device), images, lambda out: F.cross_entropy(out["out"], labels)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        length = 32 if small else config.get("length", 256)
        settings = GPT2Config(n_layer=config.get("layers", 6), n_embd=config.get("dim", 256),
                              n_head=config.get("heads", 4), vocab_size=config.get("vocab", 2000),
                              n_positions=max(length, 1024), attn_implementation="eager",
                              use_cache=False)  # training: no KV cache (recompute would append to it)
        model = GPT2LMHeadModel(settings)
        tokens = torch.randint(0, settings.vocab_size, (batch, length), device=device)
        if config.get("fused_head"):
            # The model without its head (the head's weight is the tied embedding, a parameter of the
            # body): oomless.linear_cross_entropy makes the logits a chunk of rows at a time.
            body = model.transformer.to(device)
            head = model.get_output_embeddings()    # holds the tied weight only (the loss reads no other)
            return body, tokens, lambda out: oomless.linear_cross_entropy(out.last_hidden_state[:, :-1],
                                                                          head.weight, tokens[:, 1:])
        loss = (lambda *pair: oomless.loss_in_slabs(F.cross_entropy, *pair)) if config.get("loss_in_slabs") \
            else F.cross_entropy
        return (model.to(device), tokens,
                lambda out: loss(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()))
    if name == "monai-swin-unetr":
        # MONAI's SwinUNETR: windowed attention over a 3D volume; batch norm, windows of 4 (see
        # tests/test_model_zoo.py); at least 32^3 (it halves the volume five times).
        from monai.networks.nets import SwinUNETR
        side = 32 if small else config["side"]
        volume = torch.randn(batch, 1, side, side, side, device=device)
        model = SwinUNETR(in_channels=1, out_channels=2, feature_size=config.get("feature_size", 12),
                          depths=(2, 2, 2, 2), num_heads=(3, 6, 12, 24), window_size=4, norm_name="batch")
        labels = (volume[:, 0] > 0.5).long()
        return model.to(device), volume, lambda out: F.cross_entropy(out, labels)
    if name == "bert":
        # Hugging Face BERT, masked-language-model loss over 15 % of the tokens, padding masked.
        from transformers import BertConfig, BertForMaskedLM
        length = 32 if small else config.get("length", 256)
        dim = config.get("dim", 256)
        settings = BertConfig(vocab_size=config.get("vocab", 2000), hidden_size=dim,
                              num_hidden_layers=config.get("layers", 6), num_attention_heads=config.get("heads", 4),
                              intermediate_size=4 * dim, max_position_embeddings=max(length, 512),
                              attn_implementation="eager")
        model = BertForMaskedLM(settings)
        tokens = torch.randint(0, settings.vocab_size, (batch, length), device=device)
        mask = torch.ones_like(tokens)
        mask[:, length - length // 8:] = 0
        labels = torch.where(torch.rand(tokens.shape, device=device) < 0.15, tokens, torch.full_like(tokens, -100))
        inputs = {"input_ids": tokens, "attention_mask": mask, "labels": labels}
        return model.to(device), inputs, lambda out: out.loss
    if name == "vit":
        # Hugging Face ViT, image classification.
        from transformers import ViTConfig, ViTForImageClassification
        side = 32 if small else config.get("side", 224)
        dim = config.get("dim", 256)
        settings = ViTConfig(image_size=side, patch_size=config.get("patch", 16), num_channels=3, hidden_size=dim,
                             num_hidden_layers=config.get("layers", 6), num_attention_heads=config.get("heads", 4),
                             intermediate_size=4 * dim, num_labels=10, attn_implementation="eager")
        model = ViTForImageClassification(settings)
        images = torch.randn(batch, 3, side, side, device=device)
        labels = torch.randint(0, 10, (batch,), device=device)
        return model.to(device), images, lambda out: F.cross_entropy(out.logits, labels)
    if name == "resnet50":
        # torchvision's ResNet-50, no weights, image classification.
        from torchvision import models
        side = 64 if small else config.get("side", 224)
        model = models.resnet50(weights=None, num_classes=10)
        images = torch.randn(batch, 3, side, side, device=device)
        labels = torch.randint(0, 10, (batch,), device=device)
        return model.to(device), images, lambda out: F.cross_entropy(out, labels)
    if name == "transformer":
        from oomless.models import TinyTransformer
        length = 32 if small else config.get("length", 512)
        model = TinyTransformer(vocab_size=512, dim=config.get("dim", 256), depth=config.get("depth", 6),
                                heads=8, max_len=max(length, 512), dropout=0.1)
        tokens = torch.randint(0, 512, (batch, length), device=device)
        return model.to(device), tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten())
    raise SystemExit(f"unknown model {name!r}")


def checkpoint_units(model: nn.Module, model_name: str = "") -> list[tuple[str, nn.Module]]:
    """What a user checkpoints by hand: every item of the model's outermost ``nn.ModuleList``s (U-Net
    stages, transformer layers); where the model has none, oomless's default blocks. DeepLabv3's one
    ModuleList holds its ASPP's parallel branches, not its stages: there too oomless's blocks (the
    backbone's bottlenecks and the head's modules), as a user checkpoints a ResNet."""
    if model_name == "deeplabv3":
        return find_blocks(model)
    units = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(outer + ".") for outer, _ in units):
            units += [(f"{name}.{index}", item) for index, item in enumerate(module)]
    return units or find_blocks(model)


def checkpoint_each_unit(model: nn.Module, model_name: str = "") -> list[str]:
    """Wrap every checkpoint unit in torch.utils.checkpoint (in-place modules, which checkpoint cannot
    take, stay plain); returns the wrapped names."""
    names = [name for name, _ in checkpoint_units(model, model_name) if name]
    left_plain = checkpoint_every_block(model, names)
    return [name for name in names if name not in left_plain]


def _autocast(device: torch.device, precision: str):
    """torch.autocast for ``precision`` ("fp32": disabled), as a plain PyTorch user trains in it."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32")


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def _current(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else current_rss_bytes()


# On CPU nothing refuses memory: a trial far over the limit would run for many minutes (and may
# exhaust the machine) only to be called "does not fit". Stopped once resident memory passes this share
# of the limit (above the baseline), with an out-of-memory message the caller reads as "does not fit".
OVER_LIMIT_SHARE = 1.5


def _stop_when_over(limit_bytes: float) -> None:
    def watch():
        while True:
            if _current(torch.device("cpu")) > limit_bytes:
                print(f"out of memory: resident memory passed {limit_bytes / 2**20:.0f} MiB "
                      f"({OVER_LIMIT_SHARE} x the limit above the baseline); stopped", file=sys.stderr, flush=True)
                os._exit(3)   # bench_max_size.py's OVER_LIMIT_EXIT_STATUS: "does not fit"
            time.sleep(0.05)
    threading.Thread(target=watch, daemon=True).start()


def run(config: dict) -> dict:
    device = torch.device(config.get("device", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())   # set_per_process_memory_fraction needs the index
    torch.set_num_threads(config.get("threads", 2))
    return_freed_memory_to_the_system()
    mode = config["mode"]
    if mode == "versus":
        return versus(config, device)
    precision = config.get("precision", "fp32")
    _warm_up(config, device, precision, oomless_too=mode == "oomless")
    _reset_peak(device)
    baseline = _current(device)
    if device.type == "cuda" and config.get("memory_limit_bytes"):
        # The caching allocator refuses to grow past this: going over is an out-of-memory error.
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min((baseline + config["memory_limit_bytes"]) / total, 1.0), device)
    if device.type == "cpu" and config.get("memory_limit_bytes"):
        _stop_when_over(baseline + OVER_LIMIT_SHARE * config["memory_limit_bytes"])
    result = {"config": config}
    model, inputs, loss_fn = build(config, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if mode == "checkpoint":
        result["wrapped_blocks"] = len(checkpoint_each_unit(model, config["model"]))
    elif mode == "oomless":
        memory = config["memory"]
        arguments = {"loss_fn": loss_fn, "optimizer": optimizer, "precision": precision, "split": config.get("split")}
        if memory == "floor":
            # The smallest budget oomless plans for, as a user reads it from PlanError, then plans at it.
            result["floor_bytes"] = _floor(model, inputs, arguments)
            memory = result["memory_bytes"] = int(result["floor_bytes"] * config.get("over_floor", 1.0))
        try:
            plan = oomless.plan(model, inputs, memory, **arguments)
        except PlanError as error:
            result.update(fits=False, refused=str(error), minimum_bytes=error.minimum_bytes)
            return result
        oomless.apply(model, plan, optimizer=optimizer)
        result.update(memory_bytes=plan.memory_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                      predicted_step_seconds=plan.predicted_step_seconds,
                      decisions=sorted(set(plan.decisions.values())), reserve_bytes=plan.reserve_bytes,
                      static_bytes=plan.static_bytes, activation_budget=plan.activation_budget,
                      split=plan.split,
                      # By name: modules around blocks among them are recomputed whole (`oomless.plan.segments`).
                      recomputed=sorted(name for name, decision in plan.decisions.items() if decision == "recompute"))
    # Planning's peak apart: it profiles the model whole on the device ("Parameters off the device" in
    # the README), so a plan that moves parameters off trains below what planning held. (The
    # profiler resets the peak mark as it measures, on CPU and CUDA: this is the mark as planning left
    # it, at least its last profiling step's peak.)
    planning_peak = _peak(device) - baseline
    _reset_peak(device)
    def forward_context() -> contextlib.ExitStack:
        # oomless enters the plan's autocast itself (its hooks); the others as users write it.
        stack = contextlib.ExitStack()
        stack.enter_context(_autocast(device, "fp32" if mode == "oomless" else precision))
        if mode == "save_on_cpu":
            stack.enter_context(_offloading(device))
        return stack
    step_seconds = [_timed_step(model, inputs, loss_fn, optimizer, device, forward_context)
                    for _ in range(config.get("steps", 2))]
    result["steps_peak_bytes"] = _peak(device) - baseline     # the training steps (and what they hold)
    result["planning_peak_bytes"] = planning_peak               # the model, the optimizer, planning's last marks
    result["peak_bytes"] = max(planning_peak, result["steps_peak_bytes"])   # planning's profiling steps included
    result["step_seconds"] = step_seconds
    if mode == "oomless":
        stats = oomless.stats(model)
        result.update(ledger_peak_bytes=stats.peak_activation_bytes, offloaded_bytes=stats.offloaded_bytes,
                      recomputed_blocks=stats.recomputed_blocks)
        result["fits"] = result["peak_bytes"] <= result["memory_bytes"]
        result["steps_fit"] = result["steps_peak_bytes"] <= result["memory_bytes"]
        if config.get("report_floor") and "floor_bytes" not in result:
            # Asked after the peak is read: a refused plan's profiling (of the step unsplit and split)
            # is not part of training at ``memory``.
            oomless.remove(model)
            result["floor_bytes"] = _floor(model, inputs, arguments)
    return result


def _warm_up(config: dict, device: torch.device, precision: str, oomless_too: bool) -> None:
    """A step at a small size: kernels' caches and lazily imported library code are start-up."""
    model, inputs, loss_fn = build(config, device, small=True)
    optimizer = torch.optim.Adam(model.parameters())
    if oomless_too:
        # oomless's own code paths (its hooks, chains in slabs, copies) started up at the small size
        # too, as the plain step's kernels are for every mode: its modules imported on first use and
        # libtorch's code for autocast in slabs, ~7 MiB for the bf16 U-Net in slabs, are a process's
        # start-up, not the step's (the planner's checks run them before its profile's baseline).
        _warm_up_oomless(model, inputs, loss_fn, optimizer, precision, config.get("split"))
    else:
        with _autocast(device, precision):
            loss = loss_fn(call_model(model, inputs))
        loss.backward()
        del loss
        optimizer.step()
    del model, inputs, loss_fn, optimizer
    # What the warm-up freed leaves the process before the baseline: an oomless warm-up's objects in
    # reference cycles (its optimizer state's file mappings among them: ResNet-50's Adam state, the
    # same size at the warm-up's small images, was released during the measured run and its rise
    # read -145 MiB), and glibc's free heap pages.
    gc.collect()
    give_back_free_heap()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _offloading(device: torch.device):
    """PyTorch's offload of every saved tensor to host memory, as its users write it."""
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def _timed_step(model, inputs, loss_fn, optimizer, device: torch.device, forward_context=contextlib.nullcontext) -> float:
    """Seconds of one training step, its forward (and loss) under ``forward_context()``."""
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    with forward_context():
        loss = loss_fn(call_model(model, inputs))
    loss.backward()
    optimizer.step()
    del loss
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def versus(config: dict, device: torch.device) -> dict:
    """Step times of the baseline (checkpoint on every block, or save_on_cpu) and of oomless planned for
    ``memory`` bytes, one step of each in turn after a step of each to warm up: on a machine whose
    speed drifts (a shared 2-core CPU varies by 15 % from minute to minute), separate processes
    compare different moments; alternate steps compare the same ones. fp32 only."""
    baseline = config.get("baseline", "checkpoint")
    if baseline not in ("checkpoint", "save_on_cpu"):
        raise SystemExit(f"baseline must be checkpoint or save_on_cpu, not {baseline!r}")
    # As the "oomless" mode warms up: planning for ``memory`` then counts the step as that run's does,
    # without a fresh process's start-up (at tiny sizes that alone passes checkpointing's peak).
    _warm_up(config, device, "fp32", oomless_too=True)
    reference, inputs, loss_fn = build(config, device)
    if baseline == "checkpoint":
        checkpoint_each_unit(reference, config["model"])
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-4)
    model, model_inputs, model_loss_fn = build(config, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    try:
        plan = oomless.plan(model, model_inputs, config["memory"], loss_fn=model_loss_fn, optimizer=optimizer,
                            split=config.get("split"))
    except PlanError as error:
        return {"config": config, "fits": False, "refused": str(error), "minimum_bytes": error.minimum_bytes}
    oomless.apply(model, plan, optimizer=optimizer)
    offload = (lambda: _offloading(device)) if baseline == "save_on_cpu" else contextlib.nullcontext
    baseline_seconds, oomless_seconds = [], []
    for index in range(config.get("steps", 4) + 1):
        baseline_step = _timed_step(reference, inputs, loss_fn, reference_optimizer, device, offload)
        oomless_step = _timed_step(model, model_inputs, model_loss_fn, optimizer, device)
        if index:   # the first of each warms up
            baseline_seconds.append(baseline_step)
            oomless_seconds.append(oomless_step)
    ratios = [ours / theirs for ours, theirs in zip(oomless_seconds, baseline_seconds)]
    return {"config": config, "baseline": baseline, "memory_bytes": plan.memory_bytes,
            "decisions": sorted(set(plan.decisions.values())), "predicted_step_seconds": plan.predicted_step_seconds,
            "recomputed": sorted(name for name, decision in plan.decisions.items() if decision == "recompute"),
            "baseline_step_seconds": baseline_seconds, "oomless_step_seconds": oomless_seconds,
            # The ratio of each pair of neighbouring steps, and their median: the speed half's verdict.
            "step_ratios": ratios, "median_step_ratio": statistics.median(ratios)}


def _warm_up_oomless(model, inputs, loss_fn, optimizer, precision: str, split) -> None:
    """One step of ``model`` (the warm-up's size) planned at its smallest budget, as the run plans."""
    arguments = {"loss_fn": loss_fn, "optimizer": optimizer, "precision": precision, "split": split}
    try:
        plan = oomless.plan(model, inputs, _floor(model, inputs, arguments), **arguments)
    except (PlanError, oomless.InputError):
        # Too small to plan so (chains too short for their slabs): keeping every block.
        plan = oomless.plan(model, inputs, "64GiB", **{**arguments, "split": False})
    oomless.apply(model, plan, optimizer=optimizer)
    loss = loss_fn(call_model(model, inputs))
    loss.backward()
    del loss
    optimizer.step()
    oomless.remove(model)


def _floor(model, inputs, arguments: dict) -> int:
    try:
        oomless.plan(model, inputs, 1, **arguments)
    except PlanError as error:
        return error.minimum_bytes
    raise AssertionError("oomless planned a step within 1 byte")


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
