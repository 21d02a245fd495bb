"""``nn.LayerNorm``: the module form of :mod:`layer_norm`, with its weight and
bias read from the module at call time (``elementwise_affine=False`` and
``bias=False`` leave them out)."""

import torch

from autofuser import LoweringSpec, Sample

from ._common import bind, check_module_forward, count, float_input
from .layer_norm import normalized_dims, number


def lower_layer_norm_module(ctx, *args, **kwargs):
    op = "LayerNorm"
    check_module_forward(ctx, torch.nn.LayerNorm)
    b = bind(ctx, op, args, kwargs, ("input",))
    x, shape = float_input(ctx, op, b["input"])
    dims, _ = normalized_dims(ctx, op, ctx.module.normalized_shape, shape)
    weight = ctx.attr("weight") if ctx.module.weight is not None else None
    bias = ctx.attr("bias") if ctx.module.bias is not None else None
    eps = number(ctx, op, "eps", ctx.module.eps)
    return ctx.normalize(x, dims, count(shape, dims), eps, weight, bias)


def _affine(module):
    """Random weight and bias, so a lowering that drops either shows."""
    for param in (module.weight, module.bias):
        if param is not None:
            torch.nn.init.normal_(param)
    return module


def _samples(dtype):
    return [
        Sample(args=(torch.randn(shape, dtype=dtype),), note=f"shape {shape}")
        for shape in ((6, 37), (2, 6, 37), (1, 3, 6, 37))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.layer_norm_module",
        description="nn.LayerNorm over its normalized_shape, affine or not.",
        targets=(torch.nn.LayerNorm,),
        kind="reduction",
        lower=lower_layer_norm_module,
        samples=_samples,
        references=(
            _affine(torch.nn.LayerNorm(37)),
            _affine(torch.nn.LayerNorm((6, 37), eps=1e-3)),
            torch.nn.LayerNorm(37, elementwise_affine=False),
            _affine(torch.nn.LayerNorm(37, bias=False)),
        ),
    )
]
