"""``nn.RMSNorm``: the module form of :mod:`rms_norm`, its weight read from the
module at call time (``elementwise_affine=False`` leaves it out)."""

import torch

from autofuser import LoweringSpec, Sample

from ._common import bind, check_module_forward, count, float_input
from .layer_norm import normalized_dims, number
from .rms_norm import DEFAULT_EPS, rms_normalize


def lower_rms_norm_module(ctx, *args, **kwargs):
    op = "RMSNorm"
    check_module_forward(ctx, torch.nn.RMSNorm)
    b = bind(ctx, op, args, kwargs, ("input",))
    x, shape = float_input(ctx, op, b["input"])
    dims, _ = normalized_dims(ctx, op, ctx.module.normalized_shape, shape)
    weight = ctx.attr("weight") if ctx.module.weight is not None else None
    eps = DEFAULT_EPS if ctx.module.eps is None else number(ctx, op, "eps", ctx.module.eps)
    return rms_normalize(ctx, x, dims, count(shape, dims), eps, weight)


def _with_random_weight(module):
    """A random weight, so a lowering that drops it shows."""
    torch.nn.init.normal_(module.weight)
    return module


def _samples(dtype):
    return [
        Sample(args=(torch.randn(shape, dtype=dtype),), note=f"shape {shape}")
        for shape in ((6, 37), (2, 6, 37), (1, 3, 6, 37))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.rms_norm_module",
        description="nn.RMSNorm over its normalized_shape, with or without weight.",
        targets=(torch.nn.RMSNorm,),
        kind="reduction",
        lower=lower_rms_norm_module,
        samples=_samples,
        references=(
            _with_random_weight(torch.nn.RMSNorm(37)),
            _with_random_weight(torch.nn.RMSNorm((6, 37), eps=1e-4)),
            torch.nn.RMSNorm(37, elementwise_affine=False),
        ),
    )
]
