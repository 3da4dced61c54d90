"""A swapped storage is resident until its copy is out *and* the forward has let go of it (a block's
output is the next block's input; a skip lives until it is added back). The runtime's ledger counts
it that long, the profile records how many blocks the forward held each saved storage, whatever the
copies' speed, and the simulator keeps it on the ledger that long. Before, a storage left the ledger
when its copy ended: what a phase held beyond the ledger then depended on the copies' timing, and a
floor plan's step went 2-3 MB over its named budget when they ran faster than in the profiling step.
A forward dropped without backward frees all it saved, copies out and ledger entries included, as its
graph goes."""

import copy
import functools
import gc
import time

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import oomless
import oomless.runtime.install
from oomless.plan.simulate import simulate
from oomless.profile.profile import BlockProfile, LinkProfile, Profile
from oomless.profile.rss import current_rss_bytes, give_back_free_heap, return_freed_memory_to_the_system
from oomless.runtime.install import installed_state
from oomless.runtime.tiers import DiskTier
from tests.conftest import train_steps
from tests.test_swap import BATCH, WIDTH, LinearRelu, SlowTier

STORAGE = BATCH * WIDTH * 4    # one block's saved storage: its ReLU's output
BLOCKS = ["first", "middle.0", "middle.1", "last"]
MiB = 2**20


class SkipModel(nn.Module):
    """``first``'s output is a skip added back before ``last``; each LinearRelu saves its output."""

    def __init__(self):
        super().__init__()
        self.first = LinearRelu()
        self.middle = nn.Sequential(LinearRelu(), LinearRelu())
        self.last = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        skip = self.first(x)
        y = self.middle(skip)
        return self.last(y + skip)


def _skip_model():
    torch.manual_seed(0)
    return SkipModel(), torch.randn(BATCH, WIDTH)


def _settled_ledger(model) -> int:
    """The ledger once every copy out has ended and the runtime has looked (its `poll`)."""
    state = installed_state(model)
    for entry in list(state.engine.pending_out):
        if entry.ticket is not None:
            state.tier.wait_out(entry.ticket)
    state.engine.poll()
    return state.ledger.resident_activation_bytes


def test_a_swapped_storage_the_forward_still_holds_stays_on_the_ledger_after_its_copy(monkeypatch):
    model, inputs = _skip_model()
    reference = copy.deepcopy(model)
    seen = {}

    def loss_fn(out):
        seen["after forward"] = _settled_ledger(model)   # skip and y are gone with the forward's frame
        return out.square().mean()

    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, blocks=BLOCKS, min_swap_bytes=0,
                        decisions={name: "swap" for name in BLOCKS})
    tier = SlowTier()
    monkeypatch.setattr(oomless.runtime.install, "make_tier", lambda device: tier)
    oomless.apply(model, plan)

    def before_last(module, args):
        seen.setdefault("before last", _settled_ledger(model))

    model.last.register_forward_pre_hook(before_last)
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), inputs, lambda out: out.square().mean(), 1)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs, loss_fn, 1)

    # Before ``last``: every copy out has ended, but the skip (first's output) and y (middle.1's)
    # are still the forward's; middle.0's output is not (the Sequential moved on).
    assert seen["before last"] == 2 * STORAGE
    assert seen["after forward"] == 0
    assert oomless.stats(model).resident_activation_bytes == 0
    for (name, expected), (_, actual) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(expected.grad, actual.grad), f"gradient of {name} differs"


@pytest.mark.parametrize("write_delay", [0.0, 0.05])
def test_the_profile_records_how_long_the_forward_holds_each_saved_storage_whatever_the_copies_speed(
        monkeypatch, write_delay):
    """With every write to disk held back 50 ms, each copy is still running when the next blocks start
    (the tier holds a reference of its own then): the profile reads the same lifetimes."""
    write = DiskTier._write

    def slow_write(self, ticket, holding):
        time.sleep(write_delay)
        write(self, ticket, holding)

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    model, inputs = _skip_model()
    profile = oomless.profile(model, inputs, loss_fn=lambda out: out.square().mean(), blocks=BLOCKS)
    lifetimes = {block.name: block.saved_alive_blocks for block in profile.blocks}
    sizes = {block.name: block.saved_sizes for block in profile.blocks}
    # In blocks after its own, in the order they ran, until the forward let go of it; a whole number:
    # at the start of that block (4: once the forward had returned, before the loss).
    assert sizes["first"] == [STORAGE] and lifetimes["first"] == [4.0]         # the skip: past ``last``
    assert sizes["middle.0"] == [STORAGE] and lifetimes["middle.0"] == [2.0]   # middle.1's input
    assert sizes["middle.1"] == [STORAGE] and lifetimes["middle.1"] == [2.0]   # y, past ``last``
    assert sizes["last"] == [STORAGE] and lifetimes["last"] == [1.0]           # y + skip, past ``last``


def _profile(alive: list[list[int]]) -> Profile:
    blocks = [BlockProfile(name=f"b{index}", forward_seconds=0.01, backward_seconds=0.02, saved_bytes=MiB,
                           largest_saved_bytes=MiB, saved_sizes=[MiB], saved_alive_blocks=lifetime,
                           input_bytes=MiB, output_bytes=MiB, calls=1, forward_other_bytes=0, backward_other_bytes=0)
              for index, lifetime in enumerate(alive)]
    # Copies take 1 ms, well within a block's 10 ms forward.
    return Profile(device="cuda:0", blocks=blocks, parameter_bytes=0, gradient_bytes=0, buffer_bytes=0,
                   optimizer_state_bytes=0, input_bytes=0, unassigned_saved_bytes=0, loss_seconds=0.01,
                   link=LinkProfile("pcie", 1e9, 1e9), loss_other_bytes=0)


def simulate_(profile, decisions):
    return simulate(profile, decisions, prefetch_bytes=0)   # each storage back only when backward uses it


def test_the_simulator_keeps_a_swapped_storage_on_the_ledger_while_the_forward_holds_it():
    swap = ["swap"] * 4
    copied_and_gone = simulate_(_profile([[0.5], [0.5], [0.5], [0.5]]), swap)
    assert copied_and_gone.activation_peak_bytes == MiB
    assert copied_and_gone.forward_end_bytes == 0
    # b0's storage is a skip held until b2 starts: two storages at once until then.
    skip = simulate_(_profile([[2], [0.5], [0.5], [0.5]]), swap)
    assert skip.activation_peak_bytes == 2 * MiB
    assert skip.forward_end_bytes == 0
    # Held past the loss: still on the ledger when backward starts, and never counted twice.
    held = simulate_(_profile([[-1], [0.5], [0.5], [0.5]]), swap)
    assert held.forward_end_bytes == MiB
    assert held.activation_peak_bytes == 2 * MiB
    # Where the profile did not measure it (a hand-made or meta profile): out when its copy is.
    unmeasured = simulate_(_profile([[], [], [], []]), swap)
    assert unmeasured.activation_peak_bytes == MiB
    # Kept blocks are on the ledger anyway: the lifetimes change nothing.
    assert simulate_(_profile([[2], [0], [0], [0]]), ["keep"] * 4).activation_peak_bytes == 4 * MiB


TOKENS, FEATURES, CLASSES, DROPPED_FORWARDS = 256, 64, 1024, 6
NORM_MLP_BLOCKS = [f"blocks.{index}" for index in range(3)]


class NormMlp(nn.Module):
    """A residual MLP block whose layer norm saves two of its own outputs (mean and rstd)."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(FEATURES), nn.Linear(FEATURES, 4 * FEATURES), nn.GELU(),
                                 nn.Linear(4 * FEATURES, FEATURES))

    def forward(self, x):
        return x + self.mlp(x)


class NormMlps(nn.Module):
    """Its output's log-softmax, outside every block, saves its own output too (1 MiB)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(NormMlp(), NormMlp(), NormMlp())
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(x)).log_softmax(-1)


@functools.cache
def _norm_mlps_profile():
    """One profile for the three plans below (each profile takes seconds)."""
    model, inputs, loss_fn = _norm_mlps()
    return oomless.profile(model, inputs, loss_fn=loss_fn, blocks=NORM_MLP_BLOCKS)


def _norm_mlps():
    torch.manual_seed(0)
    inputs = torch.randn(TOKENS, FEATURES)
    labels = torch.randint(0, CLASSES, (TOKENS,))
    return NormMlps(), inputs, lambda out: nn.functional.nll_loss(out, labels)


def _settled_rss() -> int:
    give_back_free_heap()
    return current_rss_bytes()


@pytest.mark.parametrize("decision", ["keep", "swap", "recompute"])
def test_a_forward_dropped_without_backward_frees_what_it_saved(decision):
    """A validation loss computed with grad enabled (``loss_fn(model(x)).item()``) drops its graph
    without a backward; plain PyTorch then frees everything the graph saved. A tensor an op saves of
    its own outputs points back at that op's node: held as it came to the pack hook, it made a cycle
    through C++ that kept the whole graph alive. Before, the 6 forwards here held 3.0 MiB (keep: its
    first two forwards, the ones it counts), 6.3 (swap) and 7.4 (recompute) more than plain PyTorch's,
    and 3.6, 0.25 and 0.9 MiB stayed on the ledger for good; now 0.03 MiB at most, and none."""
    return_freed_memory_to_the_system()
    model, inputs, loss_fn = _norm_mlps()
    reference = copy.deepcopy(model)
    plan = oomless.plan(model, inputs, "1TiB", loss_fn=loss_fn, profile=_norm_mlps_profile(), min_swap_bytes=0,
                        decisions={name: decision for name in NORM_MLP_BLOCKS})
    outputs = []     # of every block and of the model, in each forward
    for module in [*model.blocks, model]:
        module.register_forward_hook(
            lambda module, args, output: outputs.append(StorageWeakRef(output.untyped_storage())))

    def written(timeout: float = 10.0) -> bool:
        """Whether every output is freed, waited for: a copy out still in flight (swap: the disk tier's
        writer thread) holds its tensor until it is written."""
        deadline = time.monotonic() + timeout
        while any(not output.expired() for output in outputs) and time.monotonic() < deadline:
            time.sleep(0.01)
        return all(output.expired() for output in outputs)

    def growth_over_dropped_forwards(trained) -> int:
        loss_fn(trained(inputs)).item()
        written()
        before = _settled_rss()
        for _ in range(DROPPED_FORWARDS):
            loss_fn(trained(inputs)).item()
        written()
        return _settled_rss() - before

    plain_growth = growth_over_dropped_forwards(reference)
    oomless.apply(model, plan)
    growth = growth_over_dropped_forwards(model)

    gc.collect()    # what only the collector frees is no leak: plain PyTorch's graph goes without it
    assert oomless.stats(model).resident_activation_bytes == 0
    assert written(), "a dropped forward's activations are freed"
    assert growth <= plain_growth + MiB, f"{growth / MiB:.1f} MiB held, plain PyTorch {plain_growth / MiB:.1f}"
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), inputs, loss_fn, 1)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), inputs, loss_fn, 1)
    assert oomless.stats(model).resident_activation_bytes == 0
    for (name, expected), (_, actual) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(expected, actual), f"{name} differs from plain PyTorch's after the step"
