"""``torch.tanh``, ``F.tanh``, ``x.tanh()``, ``nn.Tanh`` (Triton has no tanh:
see ``elementwise_tanh`` in ``_common``)."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import TANH, helper, lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_tanh(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise(helper(ctx, TANH) + "({0})", input)


def _samples(dtype):
    # Scale 3 covers the saturated tails; scale 0.05 the Taylor branch near 0.
    return unary_samples(dtype, scale=3.0, nans=True) + unary_samples(dtype, scale=0.05, shapes=((2, 45),))


SPECS = [
    LoweringSpec(
        name="elementwise.tanh",
        description="hyperbolic tangent",
        targets=(torch.tanh, F.tanh, "tanh", torch.nn.Tanh),
        kind="pointwise",
        lower=lower_tanh,
        samples=_samples,
        references=(torch.tanh, F.tanh, lambda x: x.tanh(), torch.nn.Tanh()),
    ),
]
