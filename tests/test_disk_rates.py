"""The disk's rates a profile records come from enough transfers to tell.

The timing step rehearses a plan; where that plan swaps a little (two 4 MiB storages of a chain of
twelve), its rates are those of a handful of files. They set the profile's link only where the step
moved a quarter of what it could swap each way; else the sizing step's stay (every swappable storage
moved once each way). Checked by counting which transfers the recorded rates come from, not by
timing them.
"""

import collections

import torch

import oomless
from oomless.profile.profiler import LINK_MIN_BYTES, LINK_SHARE
from oomless.runtime.tiers import DiskTier
from tests.test_lagging_copies import ACTIVATION_BYTES, BATCH, BLOCKS, WIDTH, _loss, _model


def _count_transfers(monkeypatch):
    """Bytes each disk tier moved, per direction; and every tier's `measured_rates` answer, to find
    the tier a link came from."""
    moved: dict[DiskTier, collections.Counter] = collections.defaultdict(collections.Counter)
    answers: list[tuple[DiskTier, tuple[float, float] | None]] = []
    counted = DiskTier._count

    def count(self, direction, num_bytes, seconds):
        moved[self][direction] += num_bytes
        counted(self, direction, num_bytes, seconds)
    monkeypatch.setattr(DiskTier, "_count", count)
    measured = DiskTier.measured_rates

    def rates(self, *arguments, **keywords):
        answer = measured(self, *arguments, **keywords)
        answers.append((self, answer))
        return answer
    monkeypatch.setattr(DiskTier, "measured_rates", rates)
    return moved, answers


def _source(profile, answers) -> DiskTier:
    link = (profile.link.out_bytes_per_second, profile.link.in_bytes_per_second)
    sources = [tier for tier, answer in answers if answer == link]
    assert len(sources) == 1, "the link's rates are not one disk tier's measured transfers"
    return sources[0]


def test_a_rehearsal_that_swaps_a_little_does_not_set_the_disks_rates(monkeypatch):
    model, inputs = _model(), torch.randn(BATCH, WIDTH)
    blocks = [str(index) for index in range(BLOCKS)]
    profile = oomless.profile(model, inputs, loss_fn=_loss, blocks=blocks)
    kept = oomless.plan(model, inputs, 2**40, loss_fn=_loss, blocks=blocks, profile=profile,
                        decisions=dict.fromkeys(blocks, "keep"))
    # Room for all but two blocks' activations: the plan rehearsed swaps two of twelve, 8 MiB.
    memory = kept.predicted_peak_bytes - ACTIVATION_BYTES - ACTIVATION_BYTES // 4
    moved, answers = _count_transfers(monkeypatch)
    rehearsed = oomless.profile(model, inputs, loss_fn=_loss, blocks=blocks, memory=memory)
    assert any(0 < transfers["out"] < BLOCKS * ACTIVATION_BYTES for transfers in moved.values()), \
        "the rehearsal swapped every block or none"
    # Before, 8 MiB each way set the rates: those of two files.
    least = max(BLOCKS * ACTIVATION_BYTES // LINK_SHARE, LINK_MIN_BYTES)
    transfers = moved[_source(rehearsed, answers)]
    assert min(transfers["out"], transfers["in"]) >= least, dict(transfers)
