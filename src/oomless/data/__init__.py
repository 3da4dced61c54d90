"""Data for ``oomless train``: synthetic volumes generated on the fly (``synthetic``), or NIfTI files
(``--data``): ``layout`` finds the cases, ``stage`` copies them locally, ``prepare`` checks and decodes
them, ``volumes`` fits and augments them, ``loader`` prefetches batches, ``open`` ties these together;
``make_dataset`` writes a small synthetic Decathlon-style dataset (``oomless make-data``)."""

from oomless.data.synthetic import SyntheticVolumes, make_volume, synthetic_tokens

__all__ = ["SyntheticVolumes", "make_volume", "synthetic_tokens"]
