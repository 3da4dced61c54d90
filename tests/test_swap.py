"""Swap (runtime/saved.py) is exact and keeps the activation budget.

A swapped tensor is stored as its whole storage and rebuilt in backward as a view of the copy that
comes back, with the saved offset, sizes and strides: views at a nonzero storage offset, transposed
views and two saved views of one storage must come back as exactly those views, so training equals
plain PyTorch bit for bit.

When copies fall behind (a slow tier), the runtime must wait for earlier copies before a new saved
storage passes the budget, and backward's prefetch must stop at the budget and resume as room is
freed. The tier here is a stand-in whose copies out never finish on their own: only `wait_out`
finishes one. So every bound below holds only because the runtime waited or paused, whatever the
machine's speed.
"""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import oomless
import oomless.runtime.install
from tests.conftest import train_steps

BATCH, WIDTH = 8, 32


class ChunkProduct(nn.Module):
    """Saves both halves of one storage (``mul`` saves each factor): offsets 0 and WIDTH, row stride 2 * WIDTH."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, 2 * WIDTH)

    def forward(self, x):
        left, right = self.linear(x).chunk(2, dim=1)
        return left * right


class ShiftedScale(nn.Module):
    """Saves ``h[:, 1:]``: storage offset 1, rows not contiguous."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.randn(WIDTH - 1))

    def forward(self, x):
        h = self.linear(x)
        return torch.cat([h[:, :1], h[:, 1:] * self.scale], dim=1)


class TransposedProduct(nn.Module):
    """Saves ``h.narrow(1, 1, WIDTH - 1).t()`` for ``mm``'s weight gradient: offset 1, strides (1, WIDTH)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH - 1) / WIDTH)

    def forward(self, x):
        h = self.linear(x)
        return torch.mm(self.weight, h.narrow(1, 1, WIDTH - 1).t()).t()


def _views_model():
    torch.manual_seed(0)
    return nn.Sequential(ChunkProduct(), ShiftedScale(), TransposedProduct(), ChunkProduct())


def _assert_same_gradients(reference: nn.Module, model: nn.Module) -> None:
    for (name, expected), (_, actual) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(expected.grad, actual.grad), f"gradient of {name} differs"


def test_swapped_views_come_back_at_their_offsets_and_strides():
    model = _views_model()
    reference = copy.deepcopy(model)
    inputs = torch.randn(BATCH, WIDTH)
    loss_fn = lambda out: out.square().mean()       # noqa: E731
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0)
    assert list(plan.decisions) == ["0", "1", "2", "3"]
    oomless.apply(model, plan.with_decisions({name: "swap" for name in plan.decisions}))

    steps = 2
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), inputs, loss_fn, steps)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs, loss_fn, steps)

    for (name, expected), (_, actual) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(expected.grad, actual.grad), f"gradient of {name} differs"
        assert torch.equal(expected, actual), f"parameter {name} differs"
    # Every storage a block saves went out and came back, once per step, however many views of it
    # were saved: block 0 its Linear's output (BATCH x 2 WIDTH; the model's input stays resident),
    # blocks 1 and 2 their input and their Linear's output, block 3 its input and its Linear's output.
    row_bytes = WIDTH * 4
    per_step = BATCH * row_bytes * (2 + 2 + 2 + (1 + 2))
    assert oomless.stats(model).offloaded_bytes == steps * per_step


class SlowTier:
    """A swap tier whose copies out finish only when the runtime waits for them (`wait_out`), so a
    saved storage stays on the ledger until then. Records every call, in order, as (call, ticket)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._tickets = 0

    def put(self, data):
        ticket = {"number": self._tickets, "host": data.clone(), "out": False}
        self._tickets += 1
        self.calls.append(("put", ticket["number"]))
        return ticket

    def is_out(self, ticket) -> bool:
        return ticket["out"]

    def wait_out(self, ticket) -> None:
        self.calls.append(("wait_out", ticket["number"]))
        ticket["out"] = True

    def prefetch(self, ticket) -> None:
        self.calls.append(("prefetch", ticket["number"]))

    def get(self, ticket):
        self.calls.append(("get", ticket["number"]))
        return ticket["host"]

    def release(self, ticket) -> None:
        self.calls.append(("release", ticket["number"]))

    def drop_copy_in(self, ticket) -> None:
        pass

    def collect_stall_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        pass

    def tickets(self, call: str) -> list[int]:
        return [number for name, number in self.calls if name == call]


def train_on_a_slow_tier(model, reference, inputs, loss_fn, plan, budget, prefetch_bytes, monkeypatch,
                         tier: SlowTier | None = None) -> SlowTier:
    """Apply ``plan`` to ``model`` with one activation budget for every phase and swaps to ``tier``
    (a new `SlowTier` if None), then train it and ``reference`` (plain) one step each; returns the tier."""
    plan = dataclasses.replace(plan, activation_budget=budget, prefetch_bytes=prefetch_bytes,
                               blocks=[dataclasses.replace(block, forward_limit_bytes=None, backward_limit_bytes=None)
                                       for block in plan.blocks])
    tier = SlowTier() if tier is None else tier
    monkeypatch.setattr(oomless.runtime.install, "make_tier", lambda device: tier)
    oomless.apply(model, plan)
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), inputs, loss_fn, steps=1)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs, loss_fn, steps=1)
    return tier


class LinearRelu(nn.Module):
    """Saves one storage of its own: its output (ReLU's backward reads it, the next block's Linear too)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.linear(x))


def _linear_relus(blocks: int, decisions: dict[str, str] | None = None):
    """(model, plain reference, inputs, loss_fn, plan): ``blocks`` LinearRelu blocks, each saving exactly
    its output (the loss saves nothing), planned with every block swapped except as ``decisions`` say."""
    torch.manual_seed(0)
    model = nn.Sequential(*(LinearRelu() for _ in range(blocks)))
    reference = copy.deepcopy(model)
    inputs = torch.randn(BATCH, WIDTH)
    loss_fn = lambda out: out.sum()     # noqa: E731
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0,
                        decisions={str(index): "swap" for index in range(blocks)} | (decisions or {}))
    return model, reference, inputs, loss_fn, plan


def test_a_slow_tier_makes_swaps_wait_and_prefetch_pause_within_the_budget(monkeypatch):
    blocks = 6
    model, reference, inputs, loss_fn, plan = _linear_relus(blocks)
    # Room for two blocks' outputs, in every phase: the third saved storage must wait for a copy.
    storage_bytes = BATCH * WIDTH * 4
    budget = 2 * storage_bytes
    tier = train_on_a_slow_tier(model, reference, inputs, loss_fn, plan, budget, None, monkeypatch)

    stats = oomless.stats(model)
    assert stats.offloaded_bytes == blocks * storage_bytes
    assert stats.peak_activation_bytes == budget, "the budget is reached and never passed"
    assert stats.resident_activation_bytes == 0
    # Forward: each storage past the second waited for the oldest copy still running, in the order
    # the copies were queued.
    assert tier.tickets("put") == list(range(blocks))
    assert tier.tickets("wait_out") == list(range(blocks - 2))
    for waited in range(blocks - 2):
        assert tier.calls.index(("wait_out", waited)) < tier.calls.index(("put", waited + 2))
    # Backward: everything comes back, last saved first; the budget holds two outputs, so the prefetch
    # of block k's output waits until block k + 2's has been used and released.
    assert tier.tickets("prefetch") == list(reversed(range(blocks)))
    for fetched in range(blocks - 2):
        assert tier.calls.index(("release", fetched + 2)) < tier.calls.index(("prefetch", fetched))
    _assert_same_gradients(reference, model)


@pytest.mark.parametrize("window_storages, ahead", [(2, 2), (2 - 1e-9, 1)])
def test_the_prefetch_window_counts_bytes_exactly(monkeypatch, window_storages, ahead):
    """Backward brings swapped storages back ahead of use while the bytes fetched and not yet used fit
    the plan's prefetch window: a window of exactly two storages keeps two ahead of the one in use, a
    window one byte short of that keeps one (the budget here is far from binding)."""
    blocks = 5
    model, reference, inputs, loss_fn, plan = _linear_relus(blocks)
    storage_bytes = BATCH * WIDTH * 4
    window = int(window_storages * storage_bytes)     # 2 - 1e-9 storages: one byte short of two
    tier = train_on_a_slow_tier(model, reference, inputs, loss_fn, plan, 100 * storage_bytes, window, monkeypatch)

    backward = [call for call in tier.calls if call[0] in ("prefetch", "get")]
    for used in range(blocks - 1, 0, -1):
        # When storage ``used`` is taken, the next ``ahead`` in backward's order are already coming back.
        issued = [number for name, number in backward[:backward.index(("get", used))] if name == "prefetch"]
        assert min(issued) == max(used - ahead, 0), (used, backward)
    _assert_same_gradients(reference, model)


def test_a_recomputed_block_waits_for_copies_still_on_the_ledger(monkeypatch):
    """Backward reaches a recomputed block while earlier blocks' copies out are still running (a slow
    disk, a short loss): the recomputed tensors join the ledger only after those copies have made room."""
    blocks = 5
    model, reference, inputs, loss_fn, plan = _linear_relus(blocks, {str(blocks - 1): "recompute"})
    storage_bytes = BATCH * WIDTH * 4
    budget = 2 * storage_bytes
    tier = train_on_a_slow_tier(model, reference, inputs, loss_fn, plan, budget, 0, monkeypatch)

    stats = oomless.stats(model)
    assert stats.recomputed_blocks == 1
    # The forward leaves the last two swapped outputs on the ledger (copies not finished, the budget
    # full); the recomputed block's own output needs one of them to finish first.
    assert stats.peak_activation_bytes == budget, "the budget is reached and never passed"
    last_put = tier.tickets("put")[-1]
    assert ("wait_out", last_put - 1) in tier.calls
    assert stats.resident_activation_bytes == 0
    _assert_same_gradients(reference, model)


def test_prefetch_takes_the_room_of_the_phases_still_ahead(monkeypatch):
    """Per-block backward limits: the last block's backward (first in backward) allows two outputs,
    the others four. Its tighter limit binds until its Linear has used block 4's output (that
    output's first use, so its place), then no longer: the prefetch of block 1's output goes out
    during block 4's backward, before its Linear needs block 3's output, not two blocks later."""
    blocks = 6
    model, reference, inputs, loss_fn, plan = _linear_relus(blocks)
    storage_bytes = BATCH * WIDTH * 4
    limits = [4 * storage_bytes] * (blocks - 1) + [2 * storage_bytes]
    plan = dataclasses.replace(plan, activation_budget=4 * storage_bytes, prefetch_bytes=None,
                               blocks=[dataclasses.replace(block, forward_limit_bytes=None, backward_limit_bytes=limit)
                                       for block, limit in zip(plan.blocks, limits)])
    tier = SlowTier()
    monkeypatch.setattr(oomless.runtime.install, "make_tier", lambda device: tier)
    oomless.apply(model, plan)
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), inputs, loss_fn, steps=1)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs, loss_fn, steps=1)

    assert oomless.stats(model).peak_activation_bytes == 4 * storage_bytes
    assert tier.calls.index(("get", 4)) < tier.calls.index(("prefetch", 1)) < tier.calls.index(("get", 3))
    assert tier.calls.index(("release", 4)) < tier.calls.index(("prefetch", 0)) < tier.calls.index(("get", 3))
    _assert_same_gradients(reference, model)


class _CopiedTier(SlowTier):
    """A `SlowTier` whose copies out are done as soon as they are asked for: the forward's swapped
    storages leave the ledger once freed, and backward's prefetch alone decides what comes back."""

    def is_out(self, ticket) -> bool:
        return True


def test_prefetch_leaves_room_for_the_recomputes_before_its_use(monkeypatch):
    """Blocks swap, swap, swap, recompute, recompute, swap; the budget holds four outputs. Backward
    starts with the last block's output on the ledger and room for three more: bringing back all
    three swapped outputs at once left none for the recomputed blocks' own outputs, which then
    joined them on the ledger (five outputs: over the budget by one). Now what is brought back ahead of use leaves room for each recompute still to come."""
    decisions = {"3": "recompute", "4": "recompute"}
    model, reference, inputs, loss_fn, plan = _linear_relus(6, decisions)
    storage_bytes = BATCH * WIDTH * 4
    tier = train_on_a_slow_tier(model, reference, inputs, loss_fn, plan, 4 * storage_bytes, None, monkeypatch,
                                _CopiedTier())

    stats = oomless.stats(model)
    assert stats.recomputed_blocks == 2
    assert stats.peak_activation_bytes == 4 * storage_bytes, "the budget is reached and never passed"
    assert stats.resident_activation_bytes == 0
    assert sorted(tier.tickets("prefetch")) == sorted(tier.tickets("put"))
    _assert_same_gradients(reference, model)


class RecomputedTwice(nn.Module):
    """``a`` is called twice (weight sharing): s0, s1, a, s2, a, s3."""

    def __init__(self):
        super().__init__()
        self.s0, self.s1, self.a, self.s2, self.s3 = (LinearRelu() for _ in range(5))

    def forward(self, x):
        return self.s3(self.a(self.s2(self.a(self.s1(self.s0(x))))))


def test_prefetch_leaves_room_for_a_shared_blocks_second_recompute_where_that_call_ran(monkeypatch):
    """``a``'s second call is recomputed at its own place in backward, after s3's backward and
    before s2's. The room was left under the block's index only (its first call's place), so s2's
    saves, brought back during s3's backward, took the room of that recompute: five outputs on the
    ledger for a budget of four."""
    torch.manual_seed(0)
    model, inputs, loss_fn = RecomputedTwice(), torch.randn(BATCH, WIDTH), lambda out: out.sum()
    reference = copy.deepcopy(model)
    names = ["s0", "s1", "a", "s2", "s3"]
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, blocks=names,
                        decisions={name: "swap" for name in names} | {"a": "recompute"})
    storage_bytes = BATCH * WIDTH * 4
    train_on_a_slow_tier(model, reference, inputs, loss_fn, plan, 4 * storage_bytes, None, monkeypatch, _CopiedTier())

    stats = oomless.stats(model)
    assert stats.recomputed_blocks == 2
    assert stats.peak_activation_bytes == 4 * storage_bytes, "the budget is reached and never passed"
    _assert_same_gradients(reference, model)


def test_a_block_called_on_its_own_recomputes_like_plain_pytorch():
    """A block of an applied model called directly (outside the model's forward, so before any
    forward of the model has begun) is still recomputed, and its gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(*(LinearRelu() for _ in range(3)))
    reference = copy.deepcopy(model)
    inputs = torch.randn(BATCH, WIDTH)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=lambda out: out.sum(), min_swap_bytes=0,
                        decisions={str(index): "recompute" for index in range(3)})
    oomless.apply(model, plan)
    model[1](inputs).sum().backward()
    reference[1](inputs).sum().backward()
    assert oomless.stats(model).recomputed_blocks == 1
    for (name, expected), (_, actual) in zip(reference[1].named_parameters(), model[1].named_parameters()):
        assert torch.equal(expected.grad, actual.grad), f"gradient of {name} differs"


def test_the_disk_tier_counts_what_it_moved_and_removes_a_file_released_while_still_being_written(tmp_path):
    """The CPU tier: the bytes it reports moved (the planner's bandwidth) are the bytes it wrote and
    read; a ticket released while its write is still running has its file removed once the write ends
    (not before: the write would create it again, and the file would outlive the step)."""
    import os
    import threading

    from oomless.runtime.tiers import DiskTier

    tier = DiskTier(str(tmp_path))
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    ticket = tier.put(data)
    assert torch.equal(tier.get(ticket), data)
    assert (tier.moved["out"][0], tier.moved["in"][0]) == (4000, 4000)
    assert tier.measured_rates(minimum_bytes=4000) is not None and tier.measured_rates(minimum_bytes=4001) is None
    tier.release(ticket)
    assert not os.path.exists(ticket.path)

    write, go = tier._write, threading.Event()
    tier._write = lambda ticket, data: (go.wait(), write(ticket, data))
    slow = tier.put(data)
    tier.release(slow)                  # its write has not started yet
    go.set()
    tier._writer.shutdown(wait=True)    # the write, then its done-callbacks, have run
    assert not os.path.exists(slow.path)
    tier.close()


class SparseMix(nn.Module):
    """Mixes the batch rows with a sparse buffer: ``sparse.mm`` saves that sparse matrix for backward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mix", torch.eye(BATCH).to_sparse())

    def forward(self, x):
        return torch.relu(self.linear(torch.sparse.mm(self.mix, x)))


def test_a_model_with_a_sparse_buffer_plans_and_swaps_its_dense_tensors_only():
    """A sparse tensor has no storage to copy out: the buffer's bytes are counted from its indices and
    values, it is saved as it is, and the dense saved tensors around it are swapped."""
    torch.manual_seed(0)
    model = nn.Sequential(*(SparseMix() for _ in range(3)))
    reference = copy.deepcopy(model)
    inputs = torch.randn(BATCH, WIDTH)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=lambda out: out.sum(), min_swap_bytes=0,
                        decisions={str(index): "swap" for index in range(3)})
    oomless.apply(model, plan)
    model(inputs).sum().backward()
    reference(inputs).sum().backward()
    assert oomless.stats(model).offloaded_bytes > 0
    _assert_same_gradients(reference, model)
