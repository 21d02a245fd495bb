"""``MXInt8Linear``: a linear layer whose weight is stored as MXINT8.

Its buffers ``weight_q`` (int8 elements) and ``weight_scale`` (uint8 E8M0
scales) are the packed weight, so ``state_dict`` saves and loads it; ``bias``
stays a float parameter. Its forward computes through ``mxint8_weight``, the
dequantised weight, which the plugin's lowering turns into a weight that the
fused product kernels decode in registers - eager, the same function runs in
plain torch.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from .format import BLOCK, dequantize_mxint8, padded, quantize_mxint8


def mxint8_weight(data: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, k]`` weight in ``dtype`` that ``data`` and ``scales`` encode (one graph node when traced)."""
    return dequantize_mxint8(data, scales, k, dtype)


# Traced as one call (not the torch ops inside), so a lowering can recognise it.
torch.fx.wrap("mxint8_weight")


class MXInt8Linear(nn.Module):
    """``y = x @ dequantize(weight_q, weight_scale).T + bias``, activations in their own dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        k = padded(in_features)
        self.register_buffer("weight_q", torch.zeros(out_features, k, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, k // BLOCK, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "MXInt8Linear":
        """The quantised copy of ``linear`` (``ValueError`` on NaN/infinite weights)."""
        packed = quantize_mxint8(linear.weight)
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        layer.weight_q.copy_(packed["data"])
        layer.weight_scale.copy_(packed["scales"])
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        layer.train(linear.training)
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxint8(self.weight_q, self.weight_scale, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, mxint8_weight(self.weight_q, self.weight_scale, self.in_features, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format=mxint8"
        )
