"""``x * y``, ``torch.mul``, ``torch.multiply``, ``x.mul(y)``."""

import operator

import torch

from autofuser import LoweringSpec

from ._common import binary_samples, lowering, refuse_out, require_float_output


@lowering
def lower_mul(ctx, input, other, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("{0} * {1}", input, other)


SPECS = [
    LoweringSpec(
        name="elementwise.mul",
        description="x * y (tensors or Python numbers, broadcast)",
        targets=(torch.mul, torch.multiply, operator.mul, "mul", "multiply"),
        kind="pointwise",
        lower=lower_mul,
        samples=lambda dtype: binary_samples(dtype),
        references=(
            lambda x, y: x * y,
            torch.mul,
            torch.multiply,
            lambda x, y: x.mul(y),
            lambda x, y: y.multiply(x),
            lambda x, y: 2 * x,  # recorded as operator.mul(2, x)
            lambda x, y: y * -0.5,
        ),
    ),
]
