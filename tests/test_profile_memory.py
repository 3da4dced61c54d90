"""The profiler's memory readings cover the whole step a plan will run (CPU: resident memory).

Three ways a step holds memory that a per-block reading of one all-swap step misses: what runs
before the first block (a streamed outer level's encoder), what a step leaves held for later steps
(oneDNN keeps a kernel's workspace for its shapes), and what the plan's own step holds over what the
sizing step measured. Each case below allocates a 16 MiB tensor that only that path sees. And one
it must not count: a 16 MiB output the loss does not save is freed before backward in the step as
the API defines it (``loss_fn(model(x)).backward()``); a loop that keeps it is warned. Nor does a
later profile count what the timing step's plan started up (recompute's code path, run first there).
"""

import functools
import warnings

import torch
from torch import nn

import oomless
from oomless.plan.planner import reserve_bytes

WIDTH = 64
WIDE_BYTES = 16 * 2**20
BLOCKS = ["blocks.0", "blocks.1"]


def wide(x: torch.Tensor) -> torch.Tensor:
    """A 16 MiB tensor made from ``x`` (every page written: resident)."""
    return x.detach().repeat(1, WIDE_BYTES // (x.shape[0] * x.shape[1] * 4)).contiguous()


class WideBeforeBlocks(nn.Module):
    """Holds 16 MiB in its own forward before the first block, and frees it before that block runs."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))

    def forward(self, x):
        shift = wide(x).mean()
        return self.blocks(x - shift)


class KeepsAWorkspace(nn.Module):
    """As oneDNN does: the first call at a shape allocates a workspace that stays held afterwards. Its
    second block's output (64 MiB at a batch of 256) makes the step's rise four times the workspace:
    the profiler does not take it for a fresh process's start-up."""

    def __init__(self):
        super().__init__()
        self.workspaces = {}
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 65536))

    def forward(self, x):
        if tuple(x.shape) not in self.workspaces:
            self.workspaces[tuple(x.shape)] = wide(x)
        return self.blocks(x)


class WiderOnItsSecondStep(nn.Module):
    """Holds 16 MiB during its forward from its second call on: the profiler's timing step holds
    more than its sizing step measured, as a step measured twice on a busy heap can."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))

    def forward(self, x):
        self.calls += 1
        held = wide(x) if self.calls >= 2 else None
        out = self.blocks(x)
        del held
        return out


def profile(model, batch=16):
    inputs = torch.randn(batch, WIDTH)
    return oomless.profile(model, inputs, loss_fn=lambda out: out.square().mean(), blocks=BLOCKS)


def test_memory_before_the_first_block_counts_in_its_forward():
    measured = profile(WideBeforeBlocks())
    first = measured.blocks[0]
    assert first.name == "blocks.0"
    assert first.forward_other_bytes >= 0.9 * WIDE_BYTES
    assert reserve_bytes(measured) >= 0.9 * WIDE_BYTES


def test_a_workspace_left_by_an_earlier_profile_counts_in_the_next():
    model = KeepsAWorkspace()
    first = profile(model, batch=256)
    second = profile(model, batch=256)     # its steps start with the workspace already held
    # Allocated before the first block: in its forward's working memory, both times.
    assert first.blocks[0].forward_other_bytes >= 0.9 * WIDE_BYTES
    # Half: what the first profile left is read from resident memory, which heap pages freed by
    # earlier code (reused or returned meanwhile) move by megabytes; without it the reading is ~0.
    assert second.blocks[0].forward_other_bytes >= 0.5 * WIDE_BYTES, "held by the process while it trains"


def test_the_rehearsed_plan_holding_more_than_predicted_raises_the_margin():
    # In a fresh process the first profile's first step is start-up: its sizes are measured again on
    # a second step, which would already hold the 16 MiB. A profile before makes this process warm.
    profile(WiderOnItsSecondStep())
    measured = profile(WiderOnItsSecondStep())
    assert measured.rehearsal_excess_bytes >= 0.9 * WIDE_BYTES
    plan = oomless.plan(WiderOnItsSecondStep(), torch.randn(16, WIDTH), "1GiB", profile=measured,
                        loss_fn=lambda out: out.square().mean(), blocks=BLOCKS)
    # Planned with the excess on top: the prediction covers what the rehearsal held.
    assert plan.predicted_peak_bytes - plan.static_bytes >= measured.rehearsal_excess_bytes


class WideOutput(nn.Module):
    """Its output is 16 MiB (a batch of 64 x 65536 logits)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDE_BYTES // (64 * 4)))

    def forward(self, x):
        return self.blocks(x)


def classes(out: torch.Tensor) -> torch.Tensor:
    """Cross-entropy saves its log-probabilities, not the logits: the loss leaves the output unsaved."""
    return nn.functional.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))


def squares(out: torch.Tensor) -> torch.Tensor:
    """A square saves its input: the output stays alive into backward whoever holds it."""
    return out.square().mean()


def test_the_output_the_loss_does_not_save_is_counted_freed_before_backward():
    x = torch.randn(64, WIDTH)
    freed = oomless.profile(WideOutput(), x, loss_fn=classes, blocks=BLOCKS).output_freed_bytes
    assert WIDE_BYTES <= freed <= WIDE_BYTES + 2**20
    assert oomless.profile(WideOutput(), x, loss_fn=squares, blocks=BLOCKS).output_freed_bytes == 0
    plan = oomless.plan(WideOutput(), x, "1GiB", loss_fn=classes, blocks=BLOCKS)
    assert plan.output_freed_bytes == freed


def _warnings_of(step) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    kept = [warning for warning in caught if "keeps the model's output" in str(warning.message)]
    assert all(warning.filename == __file__ for warning in kept), "names the loop's line, not oomless's or torch's"
    return [str(warning.message) for warning in kept]


def test_a_loop_keeping_the_output_into_backward_is_warned_once():
    x = torch.randn(64, WIDTH)
    for loss_fn, warned in [(classes, True), (squares, False)]:
        model = WideOutput()
        oomless.fit(model, x, "1GiB", loss_fn=loss_fn, blocks=BLOCKS, decisions={name: "swap" for name in BLOCKS})
        assert not _warnings_of(lambda: loss_fn(model(x)).backward()), "the output dropped: nothing to say"

        def keeping():
            output = model(x)
            loss_fn(output).backward()
            return output

        messages = _warnings_of(keeping)
        assert bool(messages) == warned, (loss_fn.__name__, messages)
        if warned:
            assert "16.00 MiB" in messages[0] and "del output" in messages[0]
            assert not _warnings_of(keeping), "once"


class _CachedInBackward(torch.autograd.Function):
    """Identity whose backward makes, the first time, a 16 MiB cache it keeps (as oneDNN keeps a
    backward kernel's workspace for its shapes): made after the forward's phases were read."""

    caches: dict = {}

    @staticmethod
    def forward(ctx, x):
        ctx.key = tuple(x.shape)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.key not in _CachedInBackward.caches:
            _CachedInBackward.caches[ctx.key] = torch.ones(WIDE_BYTES // 4)
        return grad


class KeepsACacheFromItsBackward(nn.Module):
    """Its output is 128 MiB at a batch of 512: the cache is far under a quarter of the step's rise
    (not a fresh process starting up) and far over a fiftieth."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 65536))

    def forward(self, x):
        return _CachedInBackward.apply(self.blocks(x))


def test_what_the_first_step_leaves_held_counts_from_the_start_of_the_step():
    # Training steps hold the cache from their start, the first profiling step only from its
    # backward: its forward's phases are read again on a step that starts with it.
    model = KeepsACacheFromItsBackward()
    measured = profile(model, batch=512)
    assert any("left" in note and "held" in note for note in measured.notes), measured.notes
    assert measured.blocks[0].forward_other_bytes >= 0.9 * WIDE_BYTES
    # Named apart, for a refusal that blames a phase of it (`plan.planner._working_parts`).
    assert 0.9 * WIDE_BYTES <= measured.held_from_start_bytes <= 1.5 * WIDE_BYTES


class KeepsALargeCacheFromItsBackward(KeepsACacheFromItsBackward):
    """The same cache (16 MiB) on a step of small outputs: most of the first step's rise, as a fresh
    process's start-up is (14-25 MiB kept by a U-Net's first step), and held by training all the same."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def test_a_first_step_keeping_most_of_its_rise_is_not_taken_for_start_up():
    # Told apart by size (more than a quarter of the rise: start-up), the cache was left out of every
    # phase; the training steps hold it throughout.
    model = KeepsALargeCacheFromItsBackward()
    measured = profile(model, batch=64)   # its cache keyed by its (64, 64) output, made here first
    assert any("left" in note and "held" in note for note in measured.notes), measured.notes
    assert measured.blocks[0].forward_other_bytes >= 0.9 * WIDE_BYTES
    assert reserve_bytes(measured) >= 0.9 * WIDE_BYTES


def test_the_targets_the_loss_function_holds_are_static_bytes():
    x = torch.randn(64, WIDTH)
    labels = torch.randint(0, 10, (64, 2**14))      # 8 MiB of int64 class indices

    def closing_over(out):
        return nn.functional.cross_entropy(out[:, :10].unsqueeze(-1).expand(-1, -1, labels.shape[1]), labels)

    class Criterion:
        def __init__(self):
            self.labels = labels

        def __call__(self, out):
            return closing_over(out)

    for loss_fn in [closing_over, lambda out, target=labels: closing_over(out),
                    functools.partial(lambda out, target: closing_over(out), target=labels), Criterion()]:
        measured = oomless.profile(WideOutput(), x, loss_fn=loss_fn, blocks=BLOCKS)
        assert measured.target_bytes == labels.nbytes, loss_fn
    plan = oomless.plan(WideOutput(), x, "1GiB", loss_fn=closing_over, blocks=BLOCKS, profile=measured)
    assert plan.static_breakdown["targets"] == labels.nbytes
    assert {part.name: part.device_bytes for part in plan.static_parts}["targets"] == labels.nbytes
    # Tensors the model or the inputs hold already are counted there, not twice.
    assert oomless.profile(WideOutput(), x, loss_fn=lambda out: classes(out) + 0 * x.sum(), blocks=BLOCKS).target_bytes == 0


class StartsUpWhenRecomputed(nn.Module):
    """Its second block, the first time it runs inside backward (recomputed), makes a 16 MiB cache it
    keeps: the start-up of recompute's code path, which a plan keeping every block never runs."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), _RecomputeCache())

    def forward(self, x):
        return self.blocks(x)


class _RecomputeCache(nn.Linear):
    def __init__(self):
        super().__init__(WIDTH, WIDTH)
        self.caches = {}

    def forward(self, x):
        if torch._C._current_graph_task_id() >= 0 and tuple(x.shape) not in self.caches:
            self.caches[tuple(x.shape)] = wide(x)
        return super().forward(x)


def test_the_timing_steps_start_up_is_not_counted_by_a_later_profile():
    # Without a budget the timing step recomputes every block: the cache appears there, after the
    # sizes were read. Neither profile counts it (sizes come from the sizing steps), the second as
    # little as the first, so a plan made again from the same model names the same bytes.
    model = StartsUpWhenRecomputed()
    first = profile(model, batch=256)
    assert model.blocks[1].caches, "the timing step recomputed the block"
    second = profile(model, batch=256)
    assert first.blocks[1].forward_other_bytes < 0.5 * WIDE_BYTES
    assert second.blocks[1].forward_other_bytes < 0.5 * WIDE_BYTES


def test_inputs_larger_than_the_example_planned_are_warned_once_and_smaller_ones_not():
    """The plan holds for the example's inputs: a step on more bytes of input (a larger batch here)
    may pass its memory, and says so once, naming the loop's line; smaller inputs, a batch sliced
    from a larger tensor (its own bytes count, not its storage's), and evaluation without gradients
    are not warned."""
    example = torch.randn(64, WIDTH)
    model = WideOutput()
    oomless.fit(model, example, "1GiB", loss_fn=classes, blocks=BLOCKS, decisions={name: "swap" for name in BLOCKS})

    def messages(inputs, grad=True) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.set_grad_enabled(grad):
                loss = classes(model(inputs))
            if grad:
                loss.backward()
        found = [warning for warning in caught if "more than the" in str(warning.message)]
        assert all(warning.filename == __file__ for warning in found), "names the loop's line"
        return [str(warning.message) for warning in found]

    dataset = torch.randn(256, WIDTH)
    assert messages(example) == [] and messages(example[:32]) == [] and messages(dataset[64:128]) == []
    assert messages(dataset, grad=False) == []
    warned = messages(dataset)
    assert len(warned) == 1 and "inputs hold 64.00 KiB, more than the 16.00 KiB of the example" in warned[0], warned
    assert messages(dataset) == []          # once


def test_the_inputs_planned_and_run_are_counted_alike():
    """An example sliced from a larger tensor plans on its own bytes, not its storage's: a step on
    a batch 8 times larger warns. Two views of one tensor passed together count each, as planned:
    the same step does not warn."""
    dataset = torch.randn(1024, WIDTH)
    model = WideOutput()
    oomless.fit(model, dataset[:64], "1GiB", loss_fn=classes, blocks=BLOCKS,
                decisions={name: "swap" for name in BLOCKS})
    assert oomless.installed_plan(model).input_tensor_bytes == 64 * WIDTH * 4

    def warned(inputs) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            classes(model(inputs)).backward()
        return any("more than the" in str(warning.message) for warning in caught)

    assert not warned(dataset[64:128]) and warned(dataset[:512])

    class TwoViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 10))

        def forward(self, first, second):
            return self.blocks(first + second)

    tokens = torch.randn(65, WIDTH)
    two = TwoViews()
    oomless.fit(two, (tokens[:-1], tokens[1:]), "1GiB", loss_fn=classes, blocks=BLOCKS,
                decisions={name: "swap" for name in BLOCKS})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        classes(two(tokens[:-1], tokens[1:])).backward()
    assert not [warning for warning in caught if "more than the" in str(warning.message)]
