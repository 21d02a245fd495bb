"""``x + y``, ``torch.add(x, y, alpha=a)``, ``x.add(y)``: ``x + a * y``."""

import operator

import torch

from autofuser import LoweringSpec

from ._common import binary_samples, lowering, number, refuse_out, require_float_output


@lowering
def lower_add(ctx, input, other, *, alpha=1, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    alpha = number(ctx, alpha, "alpha")
    if alpha == 1:
        return ctx.pointwise("{0} + {1}", input, other)
    return ctx.pointwise("{0} + {2} * {1}", input, other, alpha)


SPECS = [
    LoweringSpec(
        name="elementwise.add",
        description="x + alpha * y (tensors or Python numbers, broadcast)",
        targets=(torch.add, operator.add, "add"),
        kind="pointwise",
        lower=lower_add,
        samples=lambda dtype: binary_samples(dtype),
        references=(
            lambda x, y: x + y,
            torch.add,
            lambda x, y: x.add(y),
            lambda x, y: torch.add(x, y, alpha=0.5),
            lambda x, y: x.add(y, alpha=-2),
            lambda x, y: 2.5 + x,  # recorded as operator.add(2.5, x)
            lambda x, y: torch.add(y, 3),
        ),
    ),
]
