"""GNOT (Hao et al., "GNOT: A General Neural Operator Transformer for Operator
Learning", ICML 2023), for the single-input-function case of Airfoil.

- Heterogeneous normalised attention: linear attention whose queries and keys
  are softmax-normalised over the feature dimension (so they are positive) and
  whose output is normalised by the query's total weight,
  ``z_n = q_n (sum_m k_m^T v_m) / (q_n . sum_m k_m)``.
- Each block: cross-attention from the query points to the input-function
  tokens, a gated mixture-of-experts feed-forward, self-attention, and a
  second gated MoE feed-forward, all pre-norm and residual.
- Geometric gating: the experts are mixed per point by ``softmax(gate(x))``, a
  small MLP of the point's coordinates.

Airfoil has one input function, the mesh itself: the query points and the
input-function points are both the mesh coordinates, embedded by two MLPs.

Input: points ``x`` [B, N, 2]; output [B, N, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from ._layers import mlp


class NormalizedLinearAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(width, width)
        self.to_k = nn.Linear(width, width)
        self.to_v = nn.Linear(width, width)
        self.to_out = nn.Linear(width, width)

    def forward(self, query: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        split = "b n (h d) -> b h n d"
        q = rearrange(self.to_q(query), split, h=self.heads).softmax(dim=-1)
        k = rearrange(self.to_k(context), split, h=self.heads).softmax(dim=-1)
        v = rearrange(self.to_v(context), split, h=self.heads)
        kv = torch.einsum("bhmd,bhme->bhde", k, v)
        normaliser = torch.einsum("bhnd,bhd->bhn", q, k.sum(dim=2))
        z = torch.einsum("bhnd,bhde->bhne", q, kv) / normaliser[..., None]
        return self.to_out(rearrange(z, "b h n d -> b n (h d)"))


class GatedMixtureOfExperts(nn.Module):
    """Feed-forward experts mixed per point by a softmax gate on the point's coordinates."""

    def __init__(self, width: int, experts: int, mlp_ratio: int, space_dim: int = 2):
        super().__init__()
        self.experts = nn.ModuleList(mlp(width, mlp_ratio * width, width) for _ in range(experts))
        self.gate = mlp(space_dim, width, experts)

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(pos), dim=-1)  # [b, n, experts]
        outputs = torch.stack([expert(h) for expert in self.experts], dim=-1)  # [b, n, c, experts]
        return (outputs * rearrange(weights, "b n e -> b n 1 e")).sum(dim=-1)


class GNOTBlock(nn.Module):
    def __init__(self, width: int, heads: int, experts: int, mlp_ratio: int):
        super().__init__()
        self.norm_query = nn.LayerNorm(width)
        self.norm_context = nn.LayerNorm(width)
        self.cross_attention = NormalizedLinearAttention(width, heads)
        self.norm_moe1 = nn.LayerNorm(width)
        self.moe1 = GatedMixtureOfExperts(width, experts, mlp_ratio)
        self.norm_self = nn.LayerNorm(width)
        self.self_attention = NormalizedLinearAttention(width, heads)
        self.norm_moe2 = nn.LayerNorm(width)
        self.moe2 = GatedMixtureOfExperts(width, experts, mlp_ratio)

    def forward(self, h: torch.Tensor, context: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = h + self.cross_attention(self.norm_query(h), self.norm_context(context))
        h = h + self.moe1(self.norm_moe1(h), pos)
        normed = self.norm_self(h)
        h = h + self.self_attention(normed, normed)
        return h + self.moe2(self.norm_moe2(h), pos)


class GNOT(nn.Module):
    def __init__(
        self,
        width: int = 128,
        layers: int = 8,
        heads: int = 8,
        experts: int = 3,
        mlp_ratio: int = 2,
        in_dim: int = 2,
        out_dim: int = 1,
    ):
        super().__init__()
        self.embed_query = mlp(in_dim, width, width)
        self.embed_function = mlp(in_dim, width, width)  # the single input function: the mesh
        self.blocks = nn.ModuleList(GNOTBlock(width, heads, experts, mlp_ratio) for _ in range(layers))
        self.head = mlp(width, width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_query(x)
        context = self.embed_function(x)
        for block in self.blocks:
            h = block(h, context, x)
        return self.head(h)
