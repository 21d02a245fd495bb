"""``mean``: torch.mean and Tensor.mean over all dims, one dim or several."""

import torch

from autofuser import LoweringSpec

from ._common import bind, cast_to_dtype_arg, count, float_input, reduction_dims, reduction_samples


def lower_mean(ctx, *args, **kwargs):
    b = bind(ctx, "mean", args, kwargs, ("input", "dim", "keepdim"), ("dtype", "out"), {"dim": None, "keepdim": False})
    x, shape = float_input(ctx, "mean", b["input"])
    dims = reduction_dims(ctx, "mean", b["dim"], len(shape))
    x = cast_to_dtype_arg(ctx, "mean", x, ctx.dtype(b["input"]), b.get("dtype"))
    total = ctx.reduce("sum", x, dims, keepdim=bool(b["keepdim"]))
    # Divide, as eager does, rather than multiply by 1/N, which rounds twice.
    return ctx.pointwise("{0} / {1}", total, ctx.count(count(shape, dims)))


SPECS = [
    LoweringSpec(
        name="reduction.mean",
        description="Mean over dims (None, an int or a tuple), keepdim either way.",
        targets=(torch.mean, "mean"),
        kind="reduction",
        lower=lower_mean,
        samples=reduction_samples,
        references=(
            lambda x: x.mean(-1),
            lambda x: torch.mean(x, 1, keepdim=True),
            lambda x: torch.mean(x, dim=(0, -1)),
            lambda x: x.mean(dim=[0], keepdim=True),
            lambda x: torch.mean(x),
            lambda x: x.mean(),
        ),
    )
]
