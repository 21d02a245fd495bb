"""``amax``: torch.amax and Tensor.amax (the max values only; torch.max(x, dim),
which also returns indices, is not claimed)."""

import torch

from autofuser import LoweringSpec, Sample

from ._common import bind, float_input, reduction_dims


def lower_amax(ctx, *args, **kwargs):
    b = bind(ctx, "amax", args, kwargs, ("input", "dim", "keepdim"), ("out",), {"dim": (), "keepdim": False})
    x, shape = float_input(ctx, "amax", b["input"])
    # amax's default dim=() means every dim.
    dims = reduction_dims(ctx, "amax", b["dim"], len(shape), empty_means_all=True)
    return ctx.reduce("max", x, dims, keepdim=bool(b["keepdim"]))


def _samples(dtype):
    return [
        Sample(args=(torch.randn(shape, dtype=dtype),), note=f"shape {shape}")
        for shape in ((3, 37), (1, 129), (2, 5, 17), (4, 6, 9))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.amax",
        description="The max over dims (an int, a tuple, or () for all), keepdim either way.",
        targets=(torch.amax, "amax"),
        kind="reduction",
        lower=lower_amax,
        samples=_samples,
        references=(
            lambda x: x.amax(-1),
            lambda x: torch.amax(x, 1, keepdim=True),
            lambda x: torch.amax(x, dim=(0, -1)),
            lambda x: x.amax(dim=[0], keepdim=True),
            lambda x: torch.amax(x),
            lambda x: x.amax(dim=()),
        ),
    )
]
