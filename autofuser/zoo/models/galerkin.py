"""Galerkin Transformer (Cao, "Choose a Transformer: Fourier or Galerkin", NeurIPS 2021).

Galerkin-type attention has no softmax: keys and values are layer-normalised
per head and the attention is ``Q (LN(K)^T LN(V)) / n`` - a d x d matrix per
head, so the cost is linear in the number of points ``n``. The encoder block is
attention and a feed-forward network, each with a residual connection; the
layer norms live inside the attention (on k and v), as in the paper.

Input: points ``x`` [B, N, 2] (mesh coordinates); output [B, N, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from ._layers import mlp


class GalerkinAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        head_dim = width // heads
        self.to_qkv = nn.Linear(width, 3 * width)
        # One norm over the head dimension, shared by the heads.
        self.norm_k = nn.LayerNorm(head_dim)
        self.norm_v = nn.LayerNorm(head_dim)
        self.to_out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), self.to_qkv(x).chunk(3, dim=-1))
        k, v = self.norm_k(k), self.norm_v(v)
        context = torch.einsum("bhnd,bhne->bhde", k, v) / n  # (K^T V) / n: the Galerkin projection
        z = torch.einsum("bhnd,bhde->bhne", q, context)
        return self.to_out(rearrange(z, "b h n d -> b n (h d)"))


class GalerkinBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.attention = GalerkinAttention(width, heads)
        self.feed_forward = mlp(width, mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.feed_forward(x)


class GalerkinTransformer(nn.Module):
    def __init__(
        self, width: int = 128, layers: int = 8, heads: int = 8, mlp_ratio: int = 2, in_dim: int = 2, out_dim: int = 1
    ):
        super().__init__()
        self.embed = mlp(in_dim, 2 * width, width)
        self.blocks = nn.ModuleList(GalerkinBlock(width, heads, mlp_ratio) for _ in range(layers))
        self.regressor = mlp(width, width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.regressor(h)
