"""Transolver's structured-mesh model as its authors wrote it (Wu et al., "Transolver:
A Fast Transformer Solver for PDEs on General Geometries", ICML 2024; the
``Transolver_Structured_Mesh_2D`` model of the authors' standard-benchmark code,
run on Airfoil with 8 layers, width 128, 8 heads, 64 slices, MLP ratio 2, batch 8).

Physics-Attention over the H x W grid: the points are put back on the grid
(``reshape``, ``permute``, ``contiguous``) and projected by two 3 x 3
convolutions (``x_mid`` decides the slice assignment, ``fx_mid`` is what is
aggregated), each turned into per-head tokens by ``permute -> contiguous ->
reshape -> permute -> contiguous``; the slice weights are
``softmax(Linear(x_mid) / clamp(temperature, 0.1, 5))``, the slice tokens their
weighted means (``einsum`` and a division by the weights' sum, ``repeat``-ed
over the head width), softmax attention among the slices, and the
de-slicing ``einsum``. Blocks are pre-norm; the last block ends in a layer norm
and a linear head. The preprocessing MLP (coordinates -> 2 x width -> width,
GELU) and the learnable offset added to every token are the authors'.

The zoo's ``transolver`` is the same method written the way this project's
other models are (einops, no copies); this one keeps the authors' layout
operations, copies included: the code a user brings.

Input: points ``x`` [B, N, 2] with N = H * W in mesh order; output [B, N, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange


class _MLP(nn.Module):
    """The authors' MLP with ``n_layers=0``: Linear -> GELU -> Linear."""

    def __init__(self, n_input: int, n_hidden: int, n_output: int):
        super().__init__()
        self.linear_pre = nn.Sequential(nn.Linear(n_input, n_hidden), nn.GELU())
        self.linear_post = nn.Linear(n_hidden, n_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_post(self.linear_pre(x))


class PhysicsAttentionStructuredMesh2D(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, slice_num: int, height: int, width: int, kernel: int = 3):
        super().__init__()
        inner_dim = dim_head * heads
        self.dim_head, self.heads = dim_head, heads
        self.scale = dim_head**-0.5
        self.softmax = nn.Softmax(dim=-1)
        self.temperature = nn.Parameter(torch.ones([1, heads, 1, 1]) * 0.5)
        self.height, self.width = height, width
        self.in_project_x = nn.Conv2d(dim, inner_dim, kernel, 1, kernel // 2)
        self.in_project_fx = nn.Conv2d(dim, inner_dim, kernel, 1, kernel // 2)
        self.in_project_slice = nn.Linear(dim_head, slice_num)
        torch.nn.init.orthogonal_(self.in_project_slice.weight)  # distinct slices from the start
        self.to_q = nn.Linear(dim_head, dim_head, bias=False)
        self.to_k = nn.Linear(dim_head, dim_head, bias=False)
        self.to_v = nn.Linear(dim_head, dim_head, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, points, channels = x.shape
        x = x.reshape(batch, self.height, self.width, channels).contiguous().permute(0, 3, 1, 2).contiguous()

        # (1) slice
        fx_mid = (
            self.in_project_fx(x)
            .permute(0, 2, 3, 1)
            .contiguous()
            .reshape(batch, points, self.heads, self.dim_head)
            .permute(0, 2, 1, 3)
            .contiguous()
        )  # B H N C
        x_mid = (
            self.in_project_x(x)
            .permute(0, 2, 3, 1)
            .contiguous()
            .reshape(batch, points, self.heads, self.dim_head)
            .permute(0, 2, 1, 3)
            .contiguous()
        )  # B H N C
        slice_weights = self.softmax(
            self.in_project_slice(x_mid) / torch.clamp(self.temperature, min=0.1, max=5)
        )  # B H N G
        slice_norm = slice_weights.sum(2)  # B H G
        slice_token = torch.einsum("bhnc,bhng->bhgc", fx_mid, slice_weights)
        slice_token = slice_token / ((slice_norm + 1e-5)[:, :, :, None].repeat(1, 1, 1, self.dim_head))

        # (2) attention among slice tokens
        q_slice_token = self.to_q(slice_token)
        k_slice_token = self.to_k(slice_token)
        v_slice_token = self.to_v(slice_token)
        dots = torch.matmul(q_slice_token, k_slice_token.transpose(-1, -2)) * self.scale
        attn = self.softmax(dots)
        out_slice_token = torch.matmul(attn, v_slice_token)  # B H G D

        # (3) deslice
        out_x = torch.einsum("bhgc,bhng->bhnc", out_slice_token, slice_weights)
        out_x = rearrange(out_x, "b h n d -> b n (h d)")
        return self.to_out(out_x)


class TransolverBlock2D(nn.Module):
    def __init__(
        self, heads: int, hidden: int, mlp_ratio: int, slices: int, mesh: tuple[int, int], last: bool, out_dim: int
    ):
        super().__init__()
        self.last = last
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = PhysicsAttentionStructuredMesh2D(hidden, heads, hidden // heads, slices, *mesh)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = _MLP(hidden, hidden * mlp_ratio, hidden)
        if last:
            self.ln_3 = nn.LayerNorm(hidden)
            self.mlp2 = nn.Linear(hidden, out_dim)

    def forward(self, fx: torch.Tensor) -> torch.Tensor:
        fx = self.attn(self.ln_1(fx)) + fx
        fx = self.mlp(self.ln_2(fx)) + fx
        if self.last:
            return self.mlp2(self.ln_3(fx))
        return fx


class TransolverStructured2D(nn.Module):
    def __init__(
        self,
        width: int = 128,
        layers: int = 8,
        heads: int = 8,
        slices: int = 64,
        mlp_ratio: int = 2,
        mesh: tuple[int, int] = (221, 51),
        in_dim: int = 2,
        out_dim: int = 1,
    ):
        super().__init__()
        self.preprocess = _MLP(in_dim, width * 2, width)
        self.blocks = nn.ModuleList(
            TransolverBlock2D(heads, width, mlp_ratio, slices, mesh, last=i == layers - 1, out_dim=out_dim)
            for i in range(layers)
        )
        self.apply(self._init_weights)
        self.placeholder = nn.Parameter((1 / width) * torch.rand(width, dtype=torch.float))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.constant_(module.bias, 0)
        elif isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
            nn.init.constant_(module.bias, 0)
            nn.init.constant_(module.weight, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fx = self.preprocess(x)
        fx = fx + self.placeholder[None, None, :]
        for block in self.blocks:
            fx = block(fx)
        return fx
