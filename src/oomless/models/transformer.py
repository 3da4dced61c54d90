"""A tiny GPT-like decoder: the test bed for tied weights, in-place ops and dropout under oomless.

It deliberately carries the features that break naive activation offloading: an output head whose
weight *is* the token embedding (a parameter used twice), in-place ops on tensors autograd has saved
nothing of, and dropout, whose recompute must draw the same mask. Its attention is plain
matmul/softmax by default, so that its saved scores are there to plan; ``fused_attention=True``
calls `torch.nn.functional.scaled_dot_product_attention` instead, as models at scale do (on a GPU,
FlashAttention: no B x H x T x T scores saved).

    model = TinyTransformer(vocab_size=256, dim=64, depth=4, heads=4, max_len=128)
    logits = model(torch.randint(0, 256, (2, 32)))   # (2, 32, 256)
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from oomless.errors import InputError


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with plain matmul/softmax (no fused kernel hides the saved
    tensors), or with ``fused``, `F.scaled_dot_product_attention`."""

    def __init__(self, dim: int, heads: int, dropout: float, fused: bool = False):
        super().__init__()
        if dim % heads:
            raise InputError(f"dim {dim} must be divisible by heads {heads}")
        self.heads, self.fused, self.dropout_p = heads, fused, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                                                 is_causal=True)
            return self.proj(out.transpose(1, 2).reshape(batch, length, dim))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(dim // self.heads))
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu_(1)
        # In place is legal: neither matmul nor the scalar multiply saved their output for backward.
        scores.masked_fill_(causal, float("-inf"))
        weights = self.attn_dropout(F.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, length, dim)
        return self.proj(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, dropout: float, fused_attention: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout, fused_attention)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The residual adds go into the branch output, not into x: LayerNorm saved x for its
        # backward, so `x += ...` would bump x's version counter and autograd would refuse.
        branch = self.dropout(self.attn(self.ln1(x)))
        branch += x
        x = branch
        branch = self.dropout(self.fc_out(F.gelu(self.fc(self.ln2(x)))))
        branch += x
        return branch


class TinyTransformer(nn.Module):
    """Token + learned position embeddings, ``depth`` blocks, final LayerNorm, tied output head."""

    def __init__(self, vocab_size: int = 256, dim: int = 64, depth: int = 4, heads: int = 4,
                 max_len: int = 128, dropout: float = 0.1, fused_attention: bool = False):
        super().__init__()
        if not isinstance(fused_attention, bool):
            raise InputError(f"fused_attention must be True or False, got {fused_attention!r}")
        self.max_len = max_len
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, dropout, fused_attention) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): one Parameter, two uses, one gradient accumulated twice.
        self.head.weight = self.token_embedding.weight
        # GPT-2's embedding init: with nn.Embedding's N(0, 1) the tied head gives logits of std
        # ~sqrt(dim), softmax saturates and backward fills with denormals (20x slower on CPU).
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise InputError(f"TinyTransformer expects tokens of shape (N, T), got {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.max_len:
            raise InputError(f"sequence length {length} exceeds max_len {self.max_len}")
        positions = torch.arange(length, device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
