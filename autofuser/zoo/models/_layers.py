"""Small building blocks shared by several zoo models."""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import repeat


def mlp(in_dim: int, hidden: int, out_dim: int, activation: type[nn.Module] = nn.GELU) -> nn.Sequential:
    """Linear -> activation -> Linear, the point-wise lifting/projection every solver uses."""
    return nn.Sequential(nn.Linear(in_dim, hidden), activation(), nn.Linear(hidden, out_dim))


def grid_positions(x: torch.Tensor) -> torch.Tensor:
    """Normalised mesh indices in [0, 1]^2 for a channels-last batch ``x`` of shape [B, H, W, C].

    FNO-type models see the computational (i, j) grid next to the physical
    coordinates, as in the FNO and Geo-FNO airfoil experiments.
    """
    batch, height, width, _ = x.shape
    gi = torch.linspace(0, 1, height, device=x.device, dtype=x.dtype)
    gj = torch.linspace(0, 1, width, device=x.device, dtype=x.dtype)
    grid = torch.stack(torch.meshgrid(gi, gj, indexing="ij"), dim=-1)
    return repeat(grid, "h w c -> b h w c", b=batch)
