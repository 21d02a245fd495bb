"""Factorized Fourier Neural Operator (Tran et al., "Factorized Fourier Neural
Operators", ICLR 2023), structured-mesh (airfoil) variant.

Each operator layer transforms every spatial axis separately:

    z = sum_d IFFT_d( R_d . FFT_d(v) )          (one 1-D FFT per axis, lowest modes_d kept)
    v <- v + FF(z)                              (residual after the feed-forward)

where ``R_d`` are complex weights [width, width, modes_d] and ``FF`` is a
two-layer feed-forward network (expansion ``factor``, ReLU, weight-normalised
linear layers). The paper's airfoil configuration: width 64, modes (32, 16),
8 layers, factor 4, weight norm on, no weight sharing, batch size 10.

The FFTs run in fp32 (``.float()``) also under autocast (cuFFT has no bfloat16).

Input: grid ``x`` [B, H, W, 2] (channels last); output [B, H, W, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange
from torch.nn.utils.parametrizations import weight_norm

from ._layers import grid_positions


class FactorizedSpectralLayer(nn.Module):
    def __init__(self, width: int, modes: tuple[int, int], factor: int = 4, use_weight_norm: bool = True):
        super().__init__()
        self.modes = modes
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(width, width, m, dtype=torch.cfloat) * (2.0 / (2 * width)) ** 0.5) for m in modes
        )
        wrap = weight_norm if use_weight_norm else (lambda layer: layer)
        self.feed_forward = nn.Sequential(
            wrap(nn.Linear(width, factor * width)), nn.ReLU(), wrap(nn.Linear(factor * width, width))
        )

    def _along(self, v: torch.Tensor, dim: int, weight: torch.Tensor, modes: int) -> torch.Tensor:
        """Spectral convolution of ``v`` [b, c, x, y] along one spatial dim (-2 or -1)."""
        n = v.shape[dim]
        v_ft = torch.fft.rfft(v, dim=dim, norm="ortho")
        out_ft = torch.zeros_like(v_ft)
        if dim == -2:
            out_ft[:, :, :modes, :] = torch.einsum("bixy,iox->boxy", v_ft[:, :, :modes, :], weight)
        else:
            out_ft[:, :, :, :modes] = torch.einsum("bixy,ioy->boxy", v_ft[:, :, :, :modes], weight)
        return torch.fft.irfft(out_ft, n=n, dim=dim, norm="ortho")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = rearrange(x, "b x y c -> b c x y").float()
        z = self._along(v, -2, self.weights[0], self.modes[0]) + self._along(v, -1, self.weights[1], self.modes[1])
        return x + self.feed_forward(rearrange(z, "b c x y -> b x y c"))


class FFNO2d(nn.Module):
    def __init__(
        self,
        width: int = 64,
        modes: tuple[int, int] = (32, 16),
        layers: int = 8,
        factor: int = 4,
        use_weight_norm: bool = True,
        in_dim: int = 2,
        out_dim: int = 1,
        projection: int = 128,
    ):
        super().__init__()
        self.lift = nn.Linear(in_dim + 2, width)
        self.layers = nn.ModuleList(
            FactorizedSpectralLayer(width, modes, factor, use_weight_norm) for _ in range(layers)
        )
        self.project = nn.Sequential(nn.Linear(width, projection), nn.Linear(projection, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(torch.cat((x, grid_positions(x)), dim=-1))
        for layer in self.layers:
            h = layer(h)
        return self.project(h)
