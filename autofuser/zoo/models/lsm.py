"""Latent Spectral Models (Wu, Hu, Luo, Wang and Long, "Solving High-Dimensional
PDEs with Latent Spectral Models", ICML 2023) on the 221 x 51 grid.

1. Lift: the coordinates and the normalised mesh indices (4 channels) -> width
   ``d``, channels first, zero-padded at the end of each axis to a multiple of
   ``2**depth`` (221 x 51 -> 224 x 64) so that every scale halves exactly.
2. Encoder, as in U-Net: double conv 3 x 3 - BatchNorm - ReLU at full size,
   then ``depth`` times 2 x 2 max-pool and a double conv; channels ``d, 2d,
   4d, 8d, 8d`` for depth 4 (the last scale keeps the previous width).
3. At every scale a *neural spectral block* on the feature map, split into
   patches of a fixed size (the padded size / ``2**depth``: 14 x 4 on Airfoil,
   so the finest scale has 16 x 16 patches and the coarsest one):

   - hierarchical projection: ``num_token`` learned latent queries per head
     attend over the patch's points (keys and values from a 1 x 1 conv), plus
     the latent queries themselves (a residual);
   - neural spectral operator: each latent token component ``t`` is expanded
     on the fixed basis ``sin(k pi t / K), cos(k pi t / K)``, ``k = 0..K-1``
     with ``K = num_basis``, and replaced by ``t + sum_k w_k basis_k(t)`` with
     learned weights per channel and basis function;
   - back to the points: each point (query from a 1 x 1 conv) attends over the
     patch's latent tokens; residual around the block.

   Both attentions take softmax of the plain dot products (no 1/sqrt(d)
   scale), as the authors' reference configuration does.

4. Decoder: bilinear upsampling (``align_corners=True``) to the skip's size,
   concatenation with the processed skip, double conv; halving the channels
   back to ``d``. A 1 x 1 conv, the padding cropped off, then the projection
   ``d -> 128 -> out_dim`` with GELU between.

Patches are split and merged with einops, heads likewise.

Input: grid ``x`` [B, H, W, 2] (channels last); output [B, H, W, out_dim].
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ._layers import grid_positions, mlp
from .unet import DoubleConv


class Up(nn.Module):
    """Bilinear upsampling to the skip's size, ``cat((skip, x))``, double conv."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = DoubleConv(in_channels, out_channels, in_channels // 2, activation=nn.ReLU)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=True)
        return self.conv(torch.cat((skip, x), dim=1))


class NeuralSpectralBlock2d(nn.Module):
    """Patchwise latent tokens, a learned combination of trigonometric basis
    functions on them, and attention back to the points (residual)."""

    frequencies: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, width: int, num_basis: int, num_token: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"LSM: width {width} is not divisible by heads={heads}; choose heads dividing it")
        self.heads = heads
        head_dim = width // heads
        self.latent = nn.Parameter(torch.rand(heads, num_token, head_dim) / width)
        self.to_key_value = nn.Conv2d(width, 2 * width, kernel_size=1)
        self.to_query = nn.Conv2d(width, width, kernel_size=1)
        # k * pi / K for k = 0..K-1: the frequencies of the sin and cos basis.
        self.register_buffer("frequencies", math.pi * torch.arange(num_basis, dtype=torch.float32) / num_basis)
        self.basis_weights = nn.Parameter(torch.randn(width, 2 * num_basis) / (2 * num_basis))

    def spectral(self, tokens: torch.Tensor) -> torch.Tensor:
        """``t + sum_k w_k basis_k(t)`` for every token component ``t``: tokens [P, heads, L, d]."""
        angles = tokens[..., None] * self.frequencies
        basis = torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1)
        weights = rearrange(self.basis_weights, "(heads d) k -> heads d k", heads=self.heads)
        return tokens + torch.einsum("phldk,hdk->phld", basis, weights)

    def forward(self, x: torch.Tensor, patch: tuple[int, int]) -> torch.Tensor:
        height, width = x.shape[-2:]
        ph, pw = patch
        points = rearrange(x, "b c (nh ph) (nw pw) -> (b nh nw) c ph pw", ph=ph, pw=pw)

        # Hierarchical projection: the latent queries attend over the patch's points.
        key, value = self.to_key_value(points).chunk(2, dim=1)
        key = rearrange(key, "p (heads d) ph pw -> p heads (ph pw) d", heads=self.heads)
        value = rearrange(value, "p (heads d) ph pw -> p heads (ph pw) d", heads=self.heads)
        weights = torch.softmax(self.latent @ key.transpose(-1, -2), dim=-1)
        tokens = self.spectral(weights @ value + self.latent)

        # Back to the points: each point attends over the patch's latent tokens.
        query = rearrange(self.to_query(points), "p (heads d) ph pw -> p heads (ph pw) d", heads=self.heads)
        weights = torch.softmax(query @ tokens.transpose(-1, -2), dim=-1)
        out = rearrange(weights @ tokens, "p heads (ph pw) d -> p (heads d) ph pw", ph=ph, pw=pw) + points
        return rearrange(out, "(b nh nw) c ph pw -> b c (nh ph) (nw pw)", nh=height // ph, nw=width // pw)


class LSM2d(nn.Module):
    def __init__(
        self,
        width: int = 32,
        num_token: int = 4,
        num_basis: int = 12,
        depth: int = 4,
        heads: int = 8,
        in_dim: int = 2,
        out_dim: int = 1,
        projection: int = 128,
    ):
        super().__init__()
        self.depth = depth
        # d, 2d, 4d, ... for the first `depth` scales; the coarsest keeps the width of the one above.
        channels = [width * 2**i for i in range(depth)] + [width * 2 ** (depth - 1)]
        self.lift = nn.Linear(in_dim + 2, width)
        self.stem = DoubleConv(width, width, activation=nn.ReLU)
        self.down = nn.ModuleList(
            nn.Sequential(nn.MaxPool2d(2), DoubleConv(channels[i], channels[i + 1], activation=nn.ReLU))
            for i in range(depth)
        )
        self.process = nn.ModuleList(NeuralSpectralBlock2d(c, num_basis, num_token, heads) for c in channels)
        # Scale i receives channels[i] from below and its skip's channels[i]; it passes on channels[i - 1].
        self.up = nn.ModuleList(Up(2 * channels[i], channels[max(i - 1, 0)]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, width, kernel_size=1)
        self.project = mlp(width, projection, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rearrange(self.lift(torch.cat((x, grid_positions(x)), dim=-1)), "b x y c -> b c x y")
        height, width = h.shape[-2:]
        multiple = 2**self.depth
        h = F.pad(h, (0, -width % multiple, 0, -height % multiple))
        # One patch size for every scale: the finest splits into multiple x multiple patches, the coarsest is one.
        patch = (h.shape[-2] // multiple, h.shape[-1] // multiple)

        features = [self.stem(h)]
        for down in self.down:
            features.append(down(features[-1]))
        h = self.process[-1](features.pop(), patch)
        for up, process in zip(self.up, reversed(self.process[:-1])):
            h = up(h, process(features.pop(), patch))
        h = self.head(h)[:, :, :height, :width]
        return self.project(rearrange(h, "b c x y -> b x y c"))
