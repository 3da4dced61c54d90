"""Synthetic volumes: deterministic in (seed, index), lesions bright and labelled, shapes as asked."""

import torch

from oomless.data import SyntheticVolumes, make_volume, synthetic_tokens


def test_same_seed_and_index_give_identical_items():
    first = SyntheticVolumes(16, seed=3)[5]
    again = SyntheticVolumes(16, seed=3)[5]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_items_do_not_depend_on_the_global_rng_or_on_access_order():
    dataset = SyntheticVolumes(16, seed=1)
    torch.manual_seed(0)
    in_order = [dataset[index][0] for index in range(3)]
    torch.manual_seed(123)
    backwards = [dataset[index][0] for index in reversed(range(3))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(in_order, backwards))


def test_different_seeds_and_indices_differ():
    volume, _ = SyntheticVolumes(16, seed=0)[0]
    assert not torch.equal(volume, SyntheticVolumes(16, seed=1)[0][0])
    assert not torch.equal(volume, SyntheticVolumes(16, seed=0)[1][0])


def test_shapes_dtypes_channels_and_anisotropic_sizes():
    volume, label = SyntheticVolumes((8, 12, 16), seed=0, channels=2)[0]
    assert volume.shape == (2, 8, 12, 16) and volume.dtype == torch.float32
    assert label.shape == (8, 12, 16) and label.dtype == torch.int64
    assert set(label.unique().tolist()) <= {0, 1}
    volumes, labels = SyntheticVolumes(16, seed=0).batch(start=4, count=3)
    assert volumes.shape == (3, 1, 16, 16, 16) and labels.shape == (3, 16, 16, 16)
    assert torch.equal(volumes[1], SyntheticVolumes(16, seed=0)[5][0])


def test_labels_mark_the_bright_lesions():
    for index in range(10):
        volume, label = make_volume((24, 24, 24), seed=7, index=index)
        lesion = label == 1
        assert 0 < lesion.sum() < 0.25 * label.numel()
        # Tissue around the lesion: the brain is where intensity is well above background.
        tissue = (~lesion) & (volume[0] > 0.25)
        assert volume[0][lesion].mean() > volume[0][tissue].mean() + 0.25
        # Thresholding alone nearly recovers the labels: the task is learnable, not noise.
        predicted = volume[0] > 0.7
        dice = 2 * (predicted & lesion).sum() / (predicted.sum() + lesion.sum())
        assert dice > 0.8


def test_synthetic_tokens_are_deterministic_and_in_range():
    tokens = synthetic_tokens(batch=4, length=20, vocab_size=50, seed=2)
    assert tokens.shape == (4, 20) and tokens.dtype == torch.int64
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 50
    assert torch.equal(tokens, synthetic_tokens(batch=4, length=20, vocab_size=50, seed=2))
    assert not torch.equal(tokens, synthetic_tokens(batch=4, length=20, vocab_size=50, seed=3))
