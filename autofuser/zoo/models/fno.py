"""Fourier Neural Operator (Li et al., "Fourier Neural Operator for Parametric
Partial Differential Equations", ICLR 2021), in the 2-D form of the Geo-FNO
airfoil experiments (Li et al., 2022: FNO on the 221 x 51 structured mesh).

1. Lift: the coordinates and the normalised mesh indices (4 channels) -> width.
2. Fourier layers: ``v <- GELU(K v + W v)``, where ``K`` is a spectral
   convolution (``rfft2``, multiply the lowest ``modes`` frequencies by learned
   complex weights - both the positive and negative frequencies of the first
   axis - zero the rest, ``irfft2``) and ``W`` a 1 x 1 convolution; no GELU after
   the last layer.
3. Project: width -> 128 -> out_dim, GELU in between.

cuFFT has no bfloat16 transform, so the spectral convolution runs in fp32
(``x.float()``) also under autocast; the rest follows autocast.

Input: grid ``x`` [B, H, W, 2] (channels last); output [B, H, W, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ._layers import grid_positions, mlp


class SpectralConv2d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, modes: tuple[int, int]):
        super().__init__()
        self.out_channels = out_channels
        self.modes = modes
        scale = 1.0 / (in_channels * out_channels)
        shape = (in_channels, out_channels, *modes)
        self.weight_positive = nn.Parameter(scale * torch.rand(shape, dtype=torch.cfloat))
        self.weight_negative = nn.Parameter(scale * torch.rand(shape, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        m1, m2 = self.modes
        x_ft = torch.fft.rfft2(x.float())
        out_ft = torch.zeros(batch, self.out_channels, height, width // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], self.weight_positive)
        out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], self.weight_negative)
        return torch.fft.irfft2(out_ft, s=(height, width))


class FNO2d(nn.Module):
    def __init__(
        self,
        width: int = 32,
        modes: tuple[int, int] = (12, 12),
        layers: int = 4,
        in_dim: int = 2,
        out_dim: int = 1,
        projection: int = 128,
    ):
        super().__init__()
        self.lift = nn.Linear(in_dim + 2, width)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, kernel_size=1) for _ in range(layers))
        self.project = mlp(width, projection, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(torch.cat((x, grid_positions(x)), dim=-1))
        h = rearrange(h, "b x y c -> b c x y")
        last = len(self.spectral) - 1
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise)):
            h = spectral(h) + pointwise(h)
            if i < last:
                h = F.gelu(h)
        return self.project(rearrange(h, "b c x y -> b x y c"))
