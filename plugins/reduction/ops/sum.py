"""``sum``: torch.sum and Tensor.sum over all dims, one dim or several."""

import torch

from autofuser import LoweringSpec

from ._common import bind, cast_to_dtype_arg, float_input, reduction_dims, reduction_samples


def lower_sum(ctx, *args, **kwargs):
    b = bind(ctx, "sum", args, kwargs, ("input", "dim", "keepdim"), ("dtype", "out"), {"dim": None, "keepdim": False})
    x, shape = float_input(ctx, "sum", b["input"])
    dims = reduction_dims(ctx, "sum", b["dim"], len(shape))
    x = cast_to_dtype_arg(ctx, "sum", x, ctx.dtype(b["input"]), b.get("dtype"))
    return ctx.reduce("sum", x, dims, keepdim=bool(b["keepdim"]))


SPECS = [
    LoweringSpec(
        name="reduction.sum",
        description="Sum over dims (None, an int or a tuple), keepdim either way.",
        targets=(torch.sum, "sum"),
        kind="reduction",
        lower=lower_sum,
        samples=reduction_samples,
        references=(
            lambda x: x.sum(-1),
            lambda x: torch.sum(x, 1, keepdim=True),
            lambda x: torch.sum(x, dim=(0, -1)),
            lambda x: x.sum(dim=[0], keepdim=True),
            lambda x: x.sum(0, True),
            lambda x: torch.sum(x),
            lambda x: x.sum(),
        ),
    )
]
