"""``torch.where(cond, a, b)`` and ``a.where(cond, b)``; a and b are tensors or Python numbers."""

import torch

from autofuser import LoweringSpec, Sample

from ._common import FLOAT_DTYPES, lowering, randn, refuse_out


@lowering
def lower_where(ctx, *args, **kwargs):
    if ctx.node.op == "call_method":  # self.where(condition, other)
        return _where(ctx, *args, **kwargs)
    return _torch_where(ctx, *args, **kwargs)


@lowering
def _torch_where(ctx, condition, input=None, other=None, *, out=None):
    return _select(ctx, condition, input, other, out)


@lowering
def _where(ctx, input, condition, other, *, out=None):
    return _select(ctx, condition, input, other, out)


def _select(ctx, condition, input, other, out):
    refuse_out(ctx, out)
    if input is None or other is None:
        ctx.refuse("unsupported_argument", "torch.where(condition) alone is nonzero(): a data-dependent shape")
    if ctx.out_dtype not in FLOAT_DTYPES + (torch.bool,) or ctx.out_shape is None:
        ctx.refuse("unsupported_dtype", f"where with result dtype {ctx.out_dtype} (kernels store float or bool)")
    cond = ctx.tensor(condition)
    if not cond.is_bool:
        ctx.refuse("unsupported_dtype", "where's condition must be a bool tensor")
    return ctx.pointwise("tl.where({0}, {1}, {2})", cond, input, other, is_bool=ctx.out_dtype == torch.bool)


def _samples(dtype):
    return [
        Sample(args=(torch.randn(3, 37) > 0, randn((3, 37), dtype), randn((3, 37), dtype)), note="same shapes"),
        Sample(args=(torch.randn(5, 1, 7) > 0, randn((6, 7), dtype), randn((7,), dtype)), note="all three broadcast"),
        Sample(args=(torch.randn(1, 129) > 0.5, randn((1, 129), dtype), randn((), dtype)), note="0-d other"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.where",
        description="cond ? a : b",
        targets=(torch.where, "where"),
        kind="pointwise",
        lower=lower_where,
        samples=_samples,
        references=(
            torch.where,
            lambda c, x, y: x.where(c, y),
            lambda c, x, y: torch.where(c, x, 0.0),
            lambda c, x, y: torch.where(c, -1.5, y),
            lambda c, x, y: torch.where(c, x, float("-inf")),
        ),
    ),
]
