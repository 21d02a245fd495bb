"""``F.gelu(x, approximate=...)`` and ``nn.GELU``: exact (erf) and tanh forms; also
ATen's ``gelu``, which a backward graph recomputes its forward with."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import GELU, TANH, helper, lowering, require_float_output, unary_samples


@lowering
def lower_gelu(ctx, input, approximate="none"):
    if ctx.module is not None:
        approximate = ctx.module.approximate
    require_float_output(ctx)
    if approximate == "none":
        # torch: x * 0.5 * (1 + erf(x / sqrt(2))); the helper computes the same function
        # with one polynomial and an exp2, at fp32 accuracy (see its comment)
        return ctx.pointwise(helper(ctx, GELU) + "({0})", input)
    if approximate == "tanh":
        # torch: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
        tanh = helper(ctx, TANH)
        return ctx.pointwise(
            "0.5 * {0} * (1.0 + " + tanh + "(0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0})))", input
        )
    ctx.refuse("unsupported_argument", f"gelu approximate={approximate!r} (torch knows 'none' and 'tanh')")


SPECS = [
    LoweringSpec(
        name="elementwise.gelu",
        description="GELU, exact (erf) or tanh-approximated",
        targets=(F.gelu, torch.nn.GELU, torch.ops.aten.gelu.default),
        kind="pointwise",
        lower=lower_gelu,
        samples=lambda dtype: unary_samples(dtype, scale=3.0, nans=True),
        references=(
            F.gelu,
            lambda x: F.gelu(x, approximate="tanh"),
            lambda x: F.gelu(x, approximate="none"),
            torch.nn.GELU(),
            torch.nn.GELU(approximate="tanh"),
            lambda x: torch.ops.aten.gelu.default(x, approximate="tanh"),
        ),
    ),
]
