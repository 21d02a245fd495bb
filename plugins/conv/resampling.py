"""Upsampling as index arithmetic: what ``F.interpolate`` / ``nn.Upsample`` compute
for each output element, spelled out so a kernel can read the low-resolution
input directly instead of materialising the upsampled tensor.

``parse_resample(node, root)`` reads an interpolate call or an ``nn.Upsample``
module from the graph and returns a ``Resample`` (or a refusal sentence);
``Resample.nearest_index`` / ``linear_position`` give, for one spatial dim,
where an output coordinate reads from, as Triton expressions. The formulas are
ATen's, in fp32 as its kernels compute them:

- ``nearest``: ``src = min(floor(dst * ratio), in - 1)``;
- ``nearest-exact``: ``src = min(floor((dst + 0.5) * ratio), in - 1)``;
- ``linear``/``bilinear``/``trilinear``: ``src = ratio * (dst + 0.5) - 0.5``
  clamped at 0 (``align_corners``: ``ratio * dst``), taps ``i0 = int(src)`` and
  ``i1 = i0 + (i0 < in - 1)``, weights ``1 - l`` and ``l = src - i0``;

with ``ratio = 1 / scale_factor`` when a scale factor is given (and not
recomputed), else ``in / out`` (``(in - 1) / (out - 1)`` with
``align_corners``), rounded to fp32.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from autofuser.kernel import AttrRef, tensor_meta

#: Modes with their spatial rank (None: any), the ones fused here.
MODES = {"nearest": None, "nearest-exact": None, "linear": 1, "bilinear": 2, "trilinear": 3}
INTERPOLATE_FUNCTIONS = (F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear)


@dataclass(frozen=True)
class Resample:
    """One upsampling node: its input, mode and per-spatial-dim sizes and fp32 ratios."""

    source: torch.fx.Node
    mode: str
    in_sizes: tuple[int, ...]
    out_sizes: tuple[int, ...]
    ratios: tuple[float, ...]  # fp32 values, exactly as ATen computes them
    align_corners: bool

    @property
    def linear(self) -> bool:
        return self.mode not in ("nearest", "nearest-exact")

    def nearest_index(self, dim: int, coord: str) -> str:
        """The source index along spatial dim ``dim`` of output coordinate ``coord`` (nearest modes)."""
        position = f"{coord}.to(tl.float32)"
        if self.mode == "nearest-exact":
            position = f"({position} + 0.5)"
        return f"tl.minimum(tl.floor({position} * {self.ratios[dim]!r}).to(tl.int32), {self.in_sizes[dim] - 1})"

    def linear_position(self, dim: int, coord: str) -> str:
        """The fractional source position along spatial dim ``dim`` (linear modes), >= 0."""
        position = f"{coord}.to(tl.float32)"
        if self.align_corners:
            return f"({position} * {self.ratios[dim]!r})"
        return f"tl.maximum({self.ratios[dim]!r} * ({position} + 0.5) - 0.5, 0.0)"


def _fp32(value) -> float:
    return float(np.float32(value))


def _ratio(linear: bool, n_in: int, n_out: int, scale: Optional[float], align_corners: bool) -> float:
    if linear and align_corners:
        return _fp32(np.float32(n_in - 1) / np.float32(n_out - 1)) if n_out > 1 else 0.0
    if scale is not None and scale > 0:
        return _fp32(1.0 / scale)
    return _fp32(np.float32(n_in) / np.float32(n_out))


def _bind(function, node: torch.fx.Node) -> dict:
    return inspect.signature(function).bind(*node.args, **node.kwargs).arguments


def parse_resample(node: torch.fx.Node, root: torch.nn.Module) -> Union[Resample, str]:
    """The ``Resample`` an interpolate / Upsample node computes, or why it isn't fused."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if not isinstance(module, torch.nn.Upsample) or type(module).forward is not torch.nn.Upsample.forward:
            return f"{type(module).__name__} is not a plain nn.Upsample"
        if len(node.args) != 1 or node.kwargs:
            return "Upsample called with more than its input"
        source, mode, align = node.args[0], module.mode, module.align_corners
        scale_factor, recompute = module.scale_factor, module.recompute_scale_factor
    elif node.op == "call_function" and node.target in INTERPOLATE_FUNCTIONS:
        try:
            args = _bind(node.target, node)
        except TypeError as err:
            return f"arguments don't bind: {err}"
        source = args.get("input")
        if node.target is F.upsample_nearest:
            mode, align = "nearest", None
        elif node.target is F.upsample_bilinear:
            mode, align = "bilinear", True
        else:
            mode, align = args.get("mode", "nearest"), args.get("align_corners")
        scale_factor = args.get("scale_factor")
        recompute = args.get("recompute_scale_factor")
        if args.get("antialias", False):
            return "antialias=True"
    else:
        return "not an interpolate call"
    if mode not in MODES:
        return f"mode {mode!r} (fused: {', '.join(MODES)})"
    in_meta, out_meta = tensor_meta(source), tensor_meta(node)
    if in_meta is None or out_meta is None or in_meta.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return "input is not a float tensor"
    spatial = len(in_meta.shape) - 2
    if spatial < 1 or (MODES[mode] is not None and MODES[mode] != spatial):
        return f"mode {mode!r} on a {len(in_meta.shape)}-d input"
    if isinstance(scale_factor, (int, float)) or scale_factor is None:
        scales = (None if scale_factor is None else float(scale_factor),) * spatial
    elif isinstance(scale_factor, (tuple, list)) and len(scale_factor) == spatial:
        scales = tuple(float(s) for s in scale_factor)
    else:
        return f"scale_factor={scale_factor!r}"
    if recompute:
        scales = (None,) * spatial
    align = bool(align) if MODES[mode] is not None else False
    in_sizes, out_sizes = tuple(in_meta.shape[2:]), tuple(out_meta.shape[2:])
    ratios = tuple(_ratio(MODES[mode] is not None, i, o, s, align) for i, o, s in zip(in_sizes, out_sizes, scales))
    return Resample(source, mode, in_sizes, out_sizes, ratios, align)


# ---------------------------------------------------------------------------
# Transposed convolutions whose stride equals their kernel: a learned upsampling
# ---------------------------------------------------------------------------

TRANSPOSED_FUNCTIONS = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}
TRANSPOSED_MODULES = {torch.nn.ConvTranspose1d: 1, torch.nn.ConvTranspose2d: 2, torch.nn.ConvTranspose3d: 3}


@dataclass(frozen=True)
class TransposedConv:
    """``ConvTranspose`` with stride == kernel, no padding: every output pixel comes from
    exactly one input pixel, ``out[b, o, y] = bias[o] + sum_c x[b, c, y // k] * W[c, o, y % k]``."""

    source: torch.fx.Node
    weight: Union[torch.fx.Node, AttrRef]
    bias: Union[torch.fx.Node, AttrRef, None]
    kernel: tuple[int, ...]
    in_channels: int
    out_channels: int


def parse_transposed_conv(node: torch.fx.Node, root: torch.nn.Module) -> Union[TransposedConv, str]:
    """The ``TransposedConv`` a transposed-convolution node computes, or why it isn't fused."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        base = next((k for k in type(module).__mro__ if k in TRANSPOSED_MODULES), None)
        if base is None or type(module).forward is not base.forward:
            return f"{type(module).__name__} overrides the transposed convolution's forward"
        if len(node.args) != 1 or node.kwargs:
            return "called with more than its input (output_size)"
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r}"
        rank = TRANSPOSED_MODULES[base]
        source = node.args[0]
        weight = AttrRef(f"{node.target}.weight")
        bias = AttrRef(f"{node.target}.bias") if module.bias is not None else None
        geometry = (module.stride, module.padding, module.output_padding, module.groups, module.dilation)
        weight_shape = tuple(module.weight.shape)
    elif node.op == "call_function" and node.target in TRANSPOSED_FUNCTIONS:
        rank = TRANSPOSED_FUNCTIONS[node.target]
        names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
        if len(node.args) > len(names) or set(node.kwargs) - set(names[len(node.args) :]):
            return "arguments don't match conv_transpose(input, weight, bias, stride, padding, ...)"
        args = {
            "bias": None,
            "stride": 1,
            "padding": 0,
            "output_padding": 0,
            "groups": 1,
            "dilation": 1,
            **dict(zip(names, node.args)),
            **node.kwargs,
        }
        source, weight, bias = args["input"], args["weight"], args["bias"]
        if tensor_meta(weight) is None or (bias is not None and tensor_meta(bias) is None):
            return "weight or bias is not a tensor of the graph"
        geometry = tuple(args[k] for k in ("stride", "padding", "output_padding", "groups", "dilation"))
        weight_shape = tuple(tensor_meta(weight).shape)
    else:
        return "not a transposed convolution"
    meta = tensor_meta(source)
    if meta is None or meta.dtype not in (torch.float32, torch.float16, torch.bfloat16) or len(meta.shape) != rank + 2:
        return "input is not a batched float tensor"
    kernel = weight_shape[2:]

    def ints(value):
        return (value,) * rank if isinstance(value, int) else tuple(value)

    stride, padding, output_padding, groups, dilation = geometry
    if (
        ints(stride) != tuple(kernel)
        or any(ints(padding))
        or any(ints(output_padding))
        or groups != 1
        or any(d != 1 for d in ints(dilation))
    ):
        return "only stride == kernel, no padding, one group, no dilation is an upsampling"
    return TransposedConv(source, weight, bias, tuple(kernel), weight_shape[0], weight_shape[1])


def parse_upsampling(node: torch.fx.Node, root: torch.nn.Module) -> Union[Resample, TransposedConv, str]:
    """An interpolation or a stride == kernel transposed convolution, or why it isn't fused."""
    if node.op == "call_module" and isinstance(root.get_submodule(node.target), tuple(TRANSPOSED_MODULES)):
        return parse_transposed_conv(node, root)
    if node.op == "call_function" and node.target in TRANSPOSED_FUNCTIONS:
        return parse_transposed_conv(node, root)
    return parse_resample(node, root)
