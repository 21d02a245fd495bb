"""``torch.maximum`` / ``torch.minimum`` and their methods, NaN propagating as in torch.

(``torch.max(x, y)`` shares its target with the ``torch.max`` reduction and is
not claimed here.)
"""

import torch

from autofuser import LoweringSpec

from ._common import binary_samples, lowering, refuse_out, require_float_output


@lowering
def lower_maximum(ctx, input, other, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", input, other)


@lowering
def lower_minimum(ctx, input, other, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", input, other)


SPECS = [
    LoweringSpec(
        name="elementwise.maximum",
        description="elementwise max(x, y), NaN propagating",
        targets=(torch.maximum, "maximum"),
        kind="pointwise",
        lower=lower_maximum,
        samples=lambda dtype: binary_samples(dtype, nans=True),
        references=(torch.maximum, lambda x, y: x.maximum(y)),
    ),
    LoweringSpec(
        name="elementwise.minimum",
        description="elementwise min(x, y), NaN propagating",
        targets=(torch.minimum, "minimum"),
        kind="pointwise",
        lower=lower_minimum,
        samples=lambda dtype: binary_samples(dtype, nans=True),
        references=(torch.minimum, lambda x, y: x.minimum(y)),
    ),
]
