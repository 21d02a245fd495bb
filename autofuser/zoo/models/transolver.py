"""Transolver (Wu et al., "Transolver: A Fast Transformer Solver for PDEs on
General Geometries", ICML 2024).

Physics-Attention: each point is softly assigned to ``slices`` learnable
physical states, per head:

1. project the features twice (``x_mid`` decides the assignment, ``fx_mid`` is
   what gets aggregated); on a structured mesh both projections are 3 x 3
   convolutions over the (H, W) grid, as in the paper's structured-mesh variant
   used for Airfoil; on a point cloud they are linear layers;
2. slice weights ``w = softmax(linear(x_mid) / temperature)`` over the slices,
   with a learnable temperature per head;
3. slice tokens ``s_g = sum_n w_ng fx_n / sum_n w_ng`` (weighted mean);
4. softmax attention among the ``slices`` tokens of each head;
5. scatter back: point n gets ``sum_g w_ng s_g``; heads are merged by a linear layer.

Blocks are pre-norm (attention, then an MLP); the last layer norm and a linear
head give the output field.

Input: points ``x`` [B, N, 2] with N = H * W in mesh order; output [B, N, out_dim].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from einops import rearrange

from ._layers import mlp


class PhysicsAttention(nn.Module):
    def __init__(self, width: int, heads: int, slices: int, mesh: Optional[tuple[int, int]] = None):
        super().__init__()
        self.heads, self.mesh = heads, mesh
        head_dim = width // heads
        self.scale = head_dim**-0.5
        self.project_x: nn.Module
        self.project_fx: nn.Module
        if mesh is None:
            self.project_x = nn.Linear(width, width)
            self.project_fx = nn.Linear(width, width)
        else:
            self.project_x = nn.Conv2d(width, width, kernel_size=3, padding=1)
            self.project_fx = nn.Conv2d(width, width, kernel_size=3, padding=1)
        self.to_slice = nn.Linear(head_dim, slices)
        nn.init.orthogonal_(self.to_slice.weight)  # distinct slices from the start
        self.temperature = nn.Parameter(torch.full((1, heads, 1, 1), 0.5))
        self.to_q = nn.Linear(head_dim, head_dim, bias=False)
        self.to_k = nn.Linear(head_dim, head_dim, bias=False)
        self.to_v = nn.Linear(head_dim, head_dim, bias=False)
        self.to_out = nn.Linear(width, width)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mesh is None:
            x_mid, fx_mid = self.project_x(x), self.project_fx(x)
            split = "b n (heads d) -> b heads n d"
        else:
            height, width = self.mesh
            grid = rearrange(x, "b (h w) c -> b c h w", h=height, w=width)
            x_mid, fx_mid = self.project_x(grid), self.project_fx(grid)
            split = "b (heads d) h w -> b heads (h w) d"
        return (rearrange(x_mid, split, heads=self.heads), rearrange(fx_mid, split, heads=self.heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_mid, fx_mid = self._project(x)
        weights = torch.softmax(self.to_slice(x_mid) / self.temperature, dim=-1)  # [b, heads, n, slices]
        norm = weights.sum(dim=2)  # [b, heads, slices]
        tokens = torch.einsum("bhnd,bhng->bhgd", fx_mid, weights) / (norm[..., None] + 1e-5)
        q, k, v = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        attention = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        tokens = torch.matmul(attention, v)
        out = torch.einsum("bhgd,bhng->bhnd", tokens, weights)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class TransolverBlock(nn.Module):
    def __init__(self, width: int, heads: int, slices: int, mlp_ratio: int, mesh: Optional[tuple[int, int]]):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = PhysicsAttention(width, heads, slices, mesh)
        self.norm2 = nn.LayerNorm(width)
        self.feed_forward = mlp(width, mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class Transolver(nn.Module):
    def __init__(
        self,
        width: int = 128,
        layers: int = 8,
        heads: int = 8,
        slices: int = 64,
        mlp_ratio: int = 2,
        mesh: Optional[tuple[int, int]] = (221, 51),
        in_dim: int = 2,
        out_dim: int = 1,
    ):
        super().__init__()
        self.embed = mlp(in_dim, 2 * width, width)
        self.placeholder = nn.Parameter(torch.rand(width) / width)  # learnable offset of every token
        self.blocks = nn.ModuleList(TransolverBlock(width, heads, slices, mlp_ratio, mesh) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.placeholder
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
