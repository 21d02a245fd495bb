"""``F.silu`` and ``nn.SiLU``: x * sigmoid(x)."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import lowering, module_attr, refuse_inplace, require_float_output, unary_samples


@lowering
def lower_silu(ctx, input, inplace=False):
    refuse_inplace(ctx, inplace or module_attr(ctx, "inplace", False))
    require_float_output(ctx)
    # torch's form x / (1 + exp(-x)): for x << 0, exp(-x) = inf gives -0, not NaN.
    return ctx.pointwise("{0} / (1.0 + tl.exp(-{0}))", input)


SPECS = [
    LoweringSpec(
        name="elementwise.silu",
        description="x * sigmoid(x)",
        targets=(F.silu, torch.nn.SiLU),
        kind="pointwise",
        lower=lower_silu,
        samples=lambda dtype: unary_samples(dtype, scale=4.0, nans=True),
        references=(F.silu, torch.nn.SiLU()),
    ),
]
