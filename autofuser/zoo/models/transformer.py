"""Plain softmax Transformer (Vaswani et al., "Attention Is All You Need", 2017),
the vanilla baseline of the neural-solver benchmarks.

Pre-norm blocks with multi-head softmax attention over all mesh points. The
attention is written out, ``softmax(q k^T / sqrt(d)) v``, as the baseline is
usually written (``attention="sdpa"`` uses ``F.scaled_dot_product_attention``
instead). Written out, the score matrix is [B, heads, N, N]: 16 GB in fp32 for
the airfoil batch (4 x 8 x 11271^2) - memory-bound work for a fuser.

Input: points ``x`` [B, N, 2]; output [B, N, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ._layers import mlp


class SoftmaxAttention(nn.Module):
    def __init__(self, width: int, heads: int, attention: str = "explicit"):
        super().__init__()
        if attention not in ("explicit", "sdpa"):
            raise ValueError(f"attention must be 'explicit' or 'sdpa', got {attention!r}")
        self.heads = heads
        self.attention = attention
        self.scale = (width // heads) ** -0.5
        self.to_qkv = nn.Linear(width, 3 * width, bias=False)
        self.to_out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), self.to_qkv(x).chunk(3, dim=-1))
        if self.attention == "sdpa":
            z = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
            z = torch.matmul(scores.softmax(dim=-1), v)
        return self.to_out(rearrange(z, "b h n d -> b n (h d)"))


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int, attention: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = SoftmaxAttention(width, heads, attention)
        self.norm2 = nn.LayerNorm(width)
        self.feed_forward = mlp(width, mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class Transformer(nn.Module):
    def __init__(
        self,
        width: int = 128,
        layers: int = 8,
        heads: int = 8,
        mlp_ratio: int = 2,
        in_dim: int = 2,
        out_dim: int = 1,
        attention: str = "explicit",
    ):
        super().__init__()
        self.embed = mlp(in_dim, 2 * width, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads, mlp_ratio, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
