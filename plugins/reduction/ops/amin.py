"""``amin``: torch.amin and Tensor.amin (the min values only; torch.min(x, dim),
which also returns indices, is not claimed)."""

import torch

from autofuser import LoweringSpec, Sample

from ._common import bind, float_input, reduction_dims


def lower_amin(ctx, *args, **kwargs):
    b = bind(ctx, "amin", args, kwargs, ("input", "dim", "keepdim"), ("out",), {"dim": (), "keepdim": False})
    x, shape = float_input(ctx, "amin", b["input"])
    # amin's default dim=() means every dim.
    dims = reduction_dims(ctx, "amin", b["dim"], len(shape), empty_means_all=True)
    return ctx.reduce("min", x, dims, keepdim=bool(b["keepdim"]))


def _samples(dtype):
    return [
        Sample(args=(torch.randn(shape, dtype=dtype),), note=f"shape {shape}")
        for shape in ((3, 37), (1, 129), (2, 5, 17), (4, 6, 9))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.amin",
        description="The min over dims (an int, a tuple, or () for all), keepdim either way.",
        targets=(torch.amin, "amin"),
        kind="reduction",
        lower=lower_amin,
        samples=_samples,
        references=(
            lambda x: x.amin(-1),
            lambda x: torch.amin(x, 1, keepdim=True),
            lambda x: torch.amin(x, dim=(0, -1)),
            lambda x: x.amin(dim=[0], keepdim=True),
            lambda x: torch.amin(x),
            lambda x: x.amin(dim=()),
        ),
    )
]
