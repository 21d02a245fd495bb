"""``-x``, ``torch.neg``, ``torch.negative``."""

import operator

import torch

from autofuser import LoweringSpec

from ._common import lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_neg(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("-{0}", input)


SPECS = [
    LoweringSpec(
        name="elementwise.neg",
        description="-x",
        targets=(torch.neg, torch.negative, operator.neg, "neg", "negative"),
        kind="pointwise",
        lower=lower_neg,
        samples=lambda dtype: unary_samples(dtype),
        references=(lambda x: -x, torch.neg, torch.negative, lambda x: x.neg(), lambda x: x.negative()),
    ),
]
