"""``torch.erf``, ``torch.special.erf``, ``x.erf()``: the error function, which the
exact GELU's derivative holds (a backward graph's ``gelu`` becomes ``erf`` and
``exp`` under torch's decompositions)."""

import torch

from autofuser import LoweringSpec

from ._common import lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_erf(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.erf({0})", input)


SPECS = [
    LoweringSpec(
        name="elementwise.erf",
        description="the error function",
        targets=(torch.erf, torch.special.erf, "erf"),
        kind="pointwise",
        lower=lower_erf,
        # scale 3 reaches the saturated tails (erf(x) rounds to +-1 past |x| = 3.9 in fp32).
        samples=lambda dtype: unary_samples(dtype, scale=3.0, nans=True),
        references=(torch.erf, torch.special.erf, lambda x: x.erf()),
    ),
]
