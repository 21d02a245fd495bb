"""U-FNO (Wen et al., "U-FNO - An enhanced Fourier neural operator-based deep-learning
model for multiphase flow", Advances in Water Resources 2022): an FNO whose later
layers add a small U-Net on the same grid beside the spectral convolution.

1. Lift: the coordinates and the normalised mesh indices (4 channels) -> width,
   channels first, zero-padded at the end of each axis to a multiple of 8 (the
   U-Net halves the grid three times; 221 x 51 -> 224 x 56 on Airfoil).
2. ``fourier_layers`` Fourier layers, ``v <- GELU(K v + W v)``, as in FNO
   (``fno.SpectralConv2d``, a 1 x 1 convolution ``W``).
3. ``ufourier_layers`` U-Fourier layers, ``v <- GELU(K v + U v + W v)``, no GELU
   after the last: ``U`` is U-FNO's U-Net - three 3 x 3 convolutions of stride 2
   (BatchNorm, LeakyReLU 0.1; the two deeper ones each followed by a 3 x 3 of
   stride 1), 4 x 4 transposed convolutions of stride 2 back up (LeakyReLU 0.1),
   each concatenated with the skip of its size, and a 3 x 3 convolution of the
   last concatenation (with the layer's input) to ``width`` channels. The
   original's dropout is left out (inference: it does nothing).
4. Crop the padding off; project: width -> 128 -> out_dim, GELU in between.

As in FNO, the spectral convolution runs in fp32 also under autocast (cuFFT has
no bfloat16 transform); the rest follows autocast.

Input: grid ``x`` [B, H, W, 2] (channels last); output [B, H, W, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ._layers import grid_positions, mlp
from .fno import SpectralConv2d

#: The U-Net halves the grid three times: the padded grid is a multiple of this.
PAD_MULTIPLE = 8


def _down(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.LeakyReLU(0.1),
    )


def _up(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.ConvTranspose2d(in_channels, out_channels, kernel_size=4, stride=2, padding=1), nn.LeakyReLU(0.1)
    )


class UNetBranch(nn.Module):
    """U-FNO's U-Net: [B, width, H, W] -> [B, width, H, W], H and W multiples of 8."""

    def __init__(self, width: int):
        super().__init__()
        self.conv1 = _down(width, width, 2)
        self.conv2 = nn.Sequential(_down(width, width, 2), _down(width, width, 1))
        self.conv3 = nn.Sequential(_down(width, width, 2), _down(width, width, 1))
        self.deconv2 = _up(width, width)
        self.deconv1 = _up(2 * width, width)
        self.deconv0 = _up(2 * width, width)
        self.output = nn.Conv2d(2 * width, width, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out1 = self.conv1(x)
        out2 = self.conv2(out1)
        out3 = self.conv3(out2)
        up1 = self.deconv1(torch.cat((out2, self.deconv2(out3)), dim=1))
        up0 = self.deconv0(torch.cat((out1, up1), dim=1))
        return self.output(torch.cat((x, up0), dim=1))


class UFNO2d(nn.Module):
    def __init__(
        self,
        width: int = 32,
        modes: tuple[int, int] = (12, 12),
        fourier_layers: int = 3,
        ufourier_layers: int = 3,
        in_dim: int = 2,
        out_dim: int = 1,
        projection: int = 128,
    ):
        super().__init__()
        layers = fourier_layers + ufourier_layers
        self.lift = nn.Linear(in_dim + 2, width)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, kernel_size=1) for _ in range(layers))
        self.unets = nn.ModuleList(UNetBranch(width) for _ in range(ufourier_layers))
        self.project = mlp(width, projection, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, height, width, _ = x.shape
        h = self.lift(torch.cat((x, grid_positions(x)), dim=-1))
        h = rearrange(h, "b x y c -> b c x y")
        h = F.pad(h, (0, -width % PAD_MULTIPLE, 0, -height % PAD_MULTIPLE))
        first_unet = len(self.spectral) - len(self.unets)
        last = len(self.spectral) - 1
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise)):
            out = spectral(h) + pointwise(h)
            if i >= first_unet:
                out = out + self.unets[i - first_unet](h)
            h = F.gelu(out) if i < last else out
        h = h[:, :, :height, :width]
        return self.project(rearrange(h, "b c x y -> b x y c"))
