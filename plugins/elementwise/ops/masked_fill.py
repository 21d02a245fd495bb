"""``x.masked_fill(mask, value)`` and ``torch.masked_fill``: ``value`` where the
boolean ``mask`` (broadcast to ``x``) is True, ``x`` elsewhere. ``value`` is a
Python number or a 0-d tensor; like eager, it is rounded to ``x``'s dtype
(the core rounds every op's result to the dtype eager produced).
"""

import torch

from autofuser import LoweringSpec, Sample, broadcast_shapes

from ._common import lowering, randn, require_float_output


@lowering
def lower_masked_fill(ctx, input, mask, value):
    require_float_output(ctx)
    condition = ctx.tensor(mask)
    if not condition.is_bool:
        ctx.refuse("unsupported_dtype", "masked_fill's mask must be a bool tensor")
    if ctx.is_tensor(value) and ctx.shape(value) != ():
        ctx.refuse("unsupported_argument", "masked_fill with a value that is not a number or a 0-d tensor")
    if tuple(broadcast_shapes(ctx.shape(input), ctx.shape(mask))) != ctx.shape(input):
        ctx.refuse("shape_mismatch", "masked_fill's mask would broadcast its input to a larger shape")
    return ctx.pointwise("tl.where({0}, {1}, {2})", condition, value, input)


def _samples(dtype):
    return [
        Sample(args=(randn((3, 37), dtype), torch.randn(3, 37) > 0), note="same shapes"),
        Sample(args=(randn((2, 3, 5, 7), dtype), torch.randn(5, 7) > 0.5), note="the mask broadcasts"),
        Sample(args=(randn((4, 33), dtype), torch.randn(4, 1) > 0), note="one mask value per row"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.masked_fill",
        description="x.masked_fill(mask, value): value where mask, x elsewhere",
        targets=(torch.masked_fill, "masked_fill"),
        kind="pointwise",
        lower=lower_masked_fill,
        samples=_samples,
        references=(
            lambda x, m: x.masked_fill(m, float("-inf")),
            lambda x, m: torch.masked_fill(x, m, 0.1),
            lambda x, m: x.masked_fill(m, -1e4),
            lambda x, m: x.masked_fill(m, torch.tensor(2.5)),
        ),
    ),
]
