"""A UPT-like model (Alkin et al., "Universal Physics Transformers: A Framework for
Efficiently Scaling Neural Operators", NeurIPS 2024): the mesh is encoded into a
small, fixed set of latent tokens, a transformer runs on those tokens only, and a
decoder answers queries at the mesh points by cross-attention to them.

1. Point encoder: each point's coordinates as sine-cosine features at
   ``width // 4`` frequencies per coordinate (a fixed buffer), then an MLP to
   ``width``.
2. Pooling to latents (the encoder's perceiver block): ``latents`` learned
   query tokens cross-attend to every point (multi-head softmax attention,
   ``F.scaled_dot_product_attention``), followed by an MLP; the points reach
   the rest of the model only through these tokens. (UPT first pools points
   into supernodes by message passing over a radius graph; that step is
   value-dependent, and here the perceiver pools the points directly.)
3. Approximator: ``layers`` pre-norm transformer blocks on the latent tokens.
4. Query decoder: the same positional features of each query point (the mesh
   points themselves), an MLP to ``width``, one cross-attention block from
   the queries to the latent tokens, then layer norm and width -> out_dim.

Input: points ``x`` [B, N, 2]; output [B, N, out_dim].
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ._layers import mlp


class FourierFeatures(nn.Module):
    """[..., 2] coordinates -> [..., 4 * frequencies]: sin and cos of each coordinate
    times ``frequencies`` geometrically spaced wave numbers."""

    wavenumbers: torch.Tensor

    def __init__(self, frequencies: int, max_wavenumber: float = 64.0):
        super().__init__()
        exponents = torch.linspace(0, 1, frequencies)
        self.register_buffer("wavenumbers", math.pi * max_wavenumber**exponents, persistent=False)

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        angles = rearrange(coords[..., None] * self.wavenumbers, "... c f -> ... (c f)")
        return torch.cat((angles.sin(), angles.cos()), dim=-1)


class CrossAttention(nn.Module):
    """Multi-head softmax attention of queries ``q`` [B, M, width] to ``kv`` [B, N, width]."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(width, width, bias=False)
        self.to_kv = nn.Linear(width, 2 * width, bias=False)
        self.to_out = nn.Linear(width, width)

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        query = rearrange(self.to_q(q), "b m (h d) -> b h m d", h=self.heads)
        key, value = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in self.to_kv(kv).chunk(2, dim=-1))
        z = F.scaled_dot_product_attention(query, key, value)
        return self.to_out(rearrange(z, "b h m d -> b m (h d)"))


class Block(nn.Module):
    """Pre-norm attention (self-attention, or cross-attention to ``context``) and MLP, each
    with its residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, cross: bool = False):
        super().__init__()
        self.norm_q = nn.LayerNorm(width)
        self.norm_kv = nn.LayerNorm(width) if cross else None
        self.attention = CrossAttention(width, heads)
        self.norm_mlp = nn.LayerNorm(width)
        self.mlp = mlp(width, mlp_ratio * width, width)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        q = self.norm_q(x)
        kv = q if self.norm_kv is None or context is None else self.norm_kv(context)
        x = x + self.attention(q, kv)
        return x + self.mlp(self.norm_mlp(x))


class UPT(nn.Module):
    def __init__(
        self,
        width: int = 192,
        latents: int = 256,
        layers: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        in_dim: int = 2,
        out_dim: int = 1,
    ):
        super().__init__()
        if in_dim != 2:
            raise ValueError(f"UPT embeds 2-D coordinates; got in_dim={in_dim}")
        frequencies = max(1, width // 4)
        self.features = FourierFeatures(frequencies)
        self.encode = mlp(4 * frequencies, width, width)
        self.latent_queries = nn.Parameter(torch.randn(latents, width) * width**-0.5)
        self.pool = Block(width, heads, mlp_ratio, cross=True)
        self.approximator = nn.ModuleList(Block(width, heads, mlp_ratio) for _ in range(layers))
        self.embed_queries = mlp(4 * frequencies, width, width)
        self.decode = Block(width, heads, mlp_ratio, cross=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x)
        points = self.encode(features)
        latent = self.pool(self.latent_queries.expand(x.shape[0], -1, -1), points)
        for block in self.approximator:
            latent = block(latent)
        queries = self.decode(self.embed_queries(features), latent)
        return self.head(self.norm(queries))
