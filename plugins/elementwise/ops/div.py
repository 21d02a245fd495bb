"""``x / y``, ``torch.div``, ``torch.divide``, ``torch.true_divide`` and their
methods: true division only (``rounding_mode`` "trunc"/"floor" stays eager)."""

import operator

import torch

from autofuser import LoweringSpec

from ._common import binary_samples, lowering, refuse_out, require_float_output


@lowering
def lower_div(ctx, input, other, *, rounding_mode=None, out=None):
    refuse_out(ctx, out)
    if rounding_mode is not None:
        ctx.refuse("unsupported_argument", f"division with rounding_mode={rounding_mode!r} is left to eager")
    require_float_output(ctx)
    return ctx.pointwise("{0} / {1}", input, other)


SPECS = [
    LoweringSpec(
        name="elementwise.div",
        description="true division x / y (tensors or Python numbers, broadcast)",
        targets=(torch.div, torch.divide, torch.true_divide, operator.truediv, "div", "divide", "true_divide"),
        kind="pointwise",
        lower=lower_div,
        # Divisors stay >= 0.05: dividing by values near 0 makes huge quotients
        # whose comparison says nothing about the lowering.
        samples=lambda dtype: binary_samples(dtype, positive=(False, True)),
        references=(
            lambda x, y: x / y,
            torch.div,
            torch.divide,
            torch.true_divide,
            lambda x, y: x.div(y),
            lambda x, y: x.divide(y, rounding_mode=None),
            lambda x, y: x.true_divide(y),
            lambda x, y: 3 / y,  # recorded as operator.truediv(3, y)
            lambda x, y: x / 7.0,
        ),
    ),
]
