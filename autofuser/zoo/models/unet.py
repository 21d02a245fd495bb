"""U-Net (Ronneberger et al., "U-Net: Convolutional Networks for Biomedical
Image Segmentation", MICCAI 2015), the convolutional baseline of the
neural-solver benchmarks, on the 221 x 51 computational grid.

Encoder: ``depth`` times (2 x 2 max-pool, then two conv 3 x 3 - BatchNorm - GELU),
doubling the channels; decoder: bilinear upsampling to the skip connection's
exact size (221 x 51 halves to odd sizes, so the upsampled map is interpolated
to the skip's shape rather than cropped or padded), concatenation with the
skip, two conv-BN-GELU. A 1 x 1 convolution gives the output field.

Input: grid ``x`` [B, H, W, 2] (channels last; the normalised mesh indices are
appended); output [B, H, W, out_dim].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ._layers import grid_positions


class DoubleConv(nn.Module):
    """(conv 3 x 3 - BatchNorm - activation) x 2; the first maps to ``mid_channels`` (default:
    ``out_channels``); the activation is GELU unless another module class is given."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        mid_channels: int | None = None,
        activation: type[nn.Module] = nn.GELU,
    ):
        super().__init__()
        mid = mid_channels or out_channels
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, mid, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            activation(),
            nn.Conv2d(mid, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            activation(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Up(nn.Module):
    def __init__(self, in_channels: int, skip_channels: int, out_channels: int):
        super().__init__()
        self.conv = DoubleConv(in_channels + skip_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        return self.conv(torch.cat((skip, x), dim=1))


class UNet2d(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, in_dim: int = 2, out_dim: int = 1):
        super().__init__()
        channels = [width * 2**i for i in range(depth + 1)]
        self.stem = DoubleConv(in_dim + 2, width)
        self.down = nn.ModuleList(DoubleConv(channels[i], channels[i + 1]) for i in range(depth))
        self.up = nn.ModuleList(Up(channels[i + 1], channels[i], channels[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, out_dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(rearrange(torch.cat((x, grid_positions(x)), dim=-1), "b x y c -> b c x y"))
        skips = []
        for down in self.down:
            skips.append(h)
            h = down(F.max_pool2d(h, kernel_size=2))
        for up in self.up:
            h = up(h, skips.pop())
        return rearrange(self.head(h), "b c x y -> b x y c")
