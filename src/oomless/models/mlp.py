"""Small test models: an MLP as a Sequential, and a model whose forward returns a dict."""

import torch
from torch import nn


class MLP(nn.Sequential):
    """Linear layers of the given widths with ReLU between them (none after the last).

    ``MLP(sizes=(16, 32, 32, 4))`` is Linear(16, 32), ReLU, Linear(32, 32), ReLU, Linear(32, 4).
    Being a Sequential, each layer is a candidate block for oomless.
    """

    def __init__(self, sizes: tuple[int, ...] | list[int] = (16, 32, 32, 4)):
        sizes = tuple(sizes)
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output width, got sizes={sizes}")
        layers: list[nn.Module] = []
        for index, (width_in, width_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(width_in, width_out))
            if index < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)
        self.sizes = sizes


class DictOutputModel(nn.Module):
    """Returns ``{"logits": ..., "aux": ...}``: outputs that are not a single tensor must still work."""

    def __init__(self, in_features: int = 16, hidden: int = 32, out_features: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh()),
            nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()),
        ])
        self.logits = nn.Linear(hidden, out_features)
        self.aux = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        return {"logits": self.logits(x), "aux": self.aux(x).squeeze(-1)}
