"""``torch.sigmoid``, ``F.sigmoid``, ``torch.special.expit``, ``x.sigmoid()``, ``nn.Sigmoid``."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_sigmoid(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    # torch's formula; exp(-x) overflowing to inf gives exactly 0.
    return ctx.pointwise("1.0 / (1.0 + tl.exp(-{0}))", input)


SPECS = [
    LoweringSpec(
        name="elementwise.sigmoid",
        description="1 / (1 + exp(-x))",
        targets=(torch.sigmoid, F.sigmoid, torch.special.expit, "sigmoid", torch.nn.Sigmoid),
        kind="pointwise",
        lower=lower_sigmoid,
        samples=lambda dtype: unary_samples(dtype, scale=4.0, nans=True),
        references=(torch.sigmoid, F.sigmoid, torch.special.expit, lambda x: x.sigmoid(), torch.nn.Sigmoid()),
    ),
]
