"""nn.Linear and F.linear: ``x @ weight.T + bias``, the weight read in place (no transpose copy)."""

import torch
import torch.nn.functional as F

from autofuser import PRODUCT_TOLERANCES, LoweringSpec, Sample


def lower_linear_function(ctx, x, weight, bias=None):
    out = ctx.matmul(x, weight, transpose_b=True)
    return out if bias is None else ctx.pointwise("{0} + {1}", out, bias)


def lower_linear_module(ctx, x):
    module = ctx.module
    if type(module).forward is not torch.nn.Linear.forward:
        ctx.refuse("custom_forward", f"{type(module).__name__} overrides Linear.forward")
    out = ctx.matmul(x, ctx.attr("weight"), transpose_b=True)
    return out if module.bias is None else ctx.pointwise("{0} + {1}", out, ctx.attr("bias"))


def _linear_samples(dtype):
    return [
        Sample(
            args=(
                torch.randn(37, 24, dtype=dtype),
                torch.randn(40, 24, dtype=dtype) * 0.2,
                torch.randn(40, dtype=dtype),
            )
        ),
        Sample(args=(torch.randn(3, 21, 48, dtype=dtype), torch.randn(19, 48, dtype=dtype) * 0.2, None)),
        Sample(
            args=(
                torch.randn(1, 5, 17, dtype=dtype),
                torch.randn(33, 17, dtype=dtype) * 0.2,
                torch.randn(33, dtype=dtype),
            )
        ),
    ]


def _module_samples(dtype):
    return [Sample(args=(torch.randn(2, 29, 24, dtype=dtype),)), Sample(args=(torch.randn(61, 24, dtype=dtype),))]


def _linear_module(bias):
    layer = torch.nn.Linear(24, 37, bias=bias)
    torch.nn.init.normal_(layer.weight, std=0.2)
    if bias:
        torch.nn.init.normal_(layer.bias)
    return layer


SPECS = [
    LoweringSpec(
        name="matmul.linear",
        description="F.linear(x, weight, bias)",
        targets=(F.linear,),
        kind="matmul",
        lower=lower_linear_function,
        samples=_linear_samples,
        references=(F.linear, lambda x, w, b: F.linear(x, w, b) if b is not None else F.linear(x, w)),
        tolerances=PRODUCT_TOLERANCES,
    ),
    LoweringSpec(
        name="matmul.linear_module",
        description="nn.Linear",
        targets=(torch.nn.Linear,),
        kind="matmul",
        lower=lower_linear_module,
        samples=_module_samples,
        references=(_linear_module(True), _linear_module(False)),
        tolerances=PRODUCT_TOLERANCES,
    ),
]
