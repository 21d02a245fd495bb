"""FactFormer (Li, Shu and Barati Farimani, "Scalable Transformer for PDE
Surrogate Modeling", NeurIPS 2023).

Factorised attention on a grid: instead of one kernel over all H x W points,
a low-rank kernel per axis.

1. Learnable projection: ``phi_x = mean_y MLP_x(u)`` and ``phi_y = mean_x MLP_y(u)``
   reduce the field to one function per axis.
2. Per axis, per head: ``K_x = q_x k_x^T / H`` from linear maps of ``phi_x``
   (no softmax), with rotary position embeddings of the axis coordinate in
   q and k; likewise ``K_y``.
3. The kernel integral factorises:
   ``z(i, j) = sum_i' K_x(i, i') sum_j' K_y(j, j') v(i', j')``.

Blocks are pre-norm (factorised attention, then an MLP), residual.

Input: grid ``x`` [B, H, W, 2] (channels last); output [B, H, W, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange, reduce, repeat

from ._layers import mlp


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    pairs = rearrange(t, "... (f two) -> ... f two", two=2)
    first, second = pairs.unbind(dim=-1)
    return rearrange(torch.stack((-second, first), dim=-1), "... f two -> ... (f two)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., RoFormer) of a 1-D coordinate."""

    inv_freq: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, dim: int, scale: float = 64.0):
        super().__init__()
        self.scale = scale  # coordinates in [0, 1] are stretched to [0, scale]
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """Rotate ``t`` [b, h, n, d] by the angles of positions 0..1 along n."""
        n = t.shape[-2]
        positions = torch.linspace(0, self.scale, n, device=t.device)
        # A broadcast product, not an einsum: autocast would compute the angles in bf16.
        freqs = repeat(positions[:, None] * self.inv_freq, "n f -> n (f two)", two=2)
        return t * freqs.cos() + rotate_half(t) * freqs.sin()


class FactorizedAttention2D(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        head_dim = width // heads
        self.to_v = nn.Linear(width, width, bias=False)
        self.project_x = mlp(width, width, width)
        self.project_y = mlp(width, width, width)
        self.qk_x = nn.Linear(width, 2 * width, bias=False)
        self.qk_y = nn.Linear(width, 2 * width, bias=False)
        self.rotary = RotaryEmbedding(head_dim)
        self.to_out = nn.Linear(width, width)

    def _axis_kernel(self, phi: torch.Tensor, to_qk: nn.Linear) -> torch.Tensor:
        q, k = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), to_qk(phi).chunk(2, dim=-1))
        q, k = self.rotary(q), self.rotary(k)
        return torch.einsum("bhid,bhjd->bhij", q, k) / phi.shape[1]

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        v = rearrange(self.to_v(u), "b x y (h d) -> b h x y d", h=self.heads)
        phi_x = reduce(self.project_x(u), "b x y c -> b x c", "mean")
        phi_y = reduce(self.project_y(u), "b x y c -> b y c", "mean")
        kernel_x = self._axis_kernel(phi_x, self.qk_x)
        kernel_y = self._axis_kernel(phi_y, self.qk_y)
        z = torch.einsum("bhij,bhjyd->bhiyd", kernel_x, v)
        z = torch.einsum("bhkl,bhxld->bhxkd", kernel_y, z)
        return self.to_out(rearrange(z, "b h x y d -> b x y (h d)"))


class FactFormerBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = FactorizedAttention2D(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.feed_forward = mlp(width, mlp_ratio * width, width)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        u = u + self.attention(self.norm1(u))
        return u + self.feed_forward(self.norm2(u))


class FactFormer(nn.Module):
    def __init__(
        self, width: int = 128, layers: int = 8, heads: int = 8, mlp_ratio: int = 2, in_dim: int = 2, out_dim: int = 1
    ):
        super().__init__()
        self.embed = mlp(in_dim, 2 * width, width)
        self.blocks = nn.ModuleList(FactFormerBlock(width, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.embed(x)
        for block in self.blocks:
            u = block(u)
        return self.head(self.norm(u))
