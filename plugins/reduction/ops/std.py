"""``std``: torch.std and Tensor.std, the square root of the variance of :mod:`var`."""

import torch

from autofuser import LoweringSpec

from ._common import reduction_samples
from .var import deviations, scaled_variance


def lower_std(ctx, *args, **kwargs):
    deviation, dims, denominator, keepdim = deviations(ctx, "std", args, kwargs)
    return scaled_variance(
        ctx, deviation, dims, denominator, keepdim, lambda m, p: ctx.pointwise("tl.sqrt({0}) * {1}", m, p)
    )


SPECS = [
    LoweringSpec(
        name="reduction.std",
        description="Standard deviation over dims, unbiased/correction, keepdim either way (two-pass).",
        targets=(torch.std, "std"),
        kind="reduction",
        lower=lower_std,
        samples=reduction_samples,
        references=(
            lambda x: x.std(-1),
            lambda x: torch.std(x, 1, keepdim=True),
            lambda x: torch.std(x, dim=(0, -1), correction=0),
            lambda x: torch.std(x, 1, False, True),
            lambda x: x.std(unbiased=False),
            lambda x: torch.std(x, False),
            lambda x: x.std(dim=-1, correction=2, keepdim=True),
        ),
    )
]
