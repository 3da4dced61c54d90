"""Data for ``oomless train``: synthetic, seeded, generated on the fly."""

from oomless.data.synthetic import SyntheticVolumes, make_volume, synthetic_tokens

__all__ = ["SyntheticVolumes", "make_volume", "synthetic_tokens"]
