"""``torch.clamp`` / ``torch.clip`` (min and max scalars or tensors, either may
be None), ``torch.clamp_min``, ``torch.clamp_max`` and their methods.

clamp(x, lo, hi) is min(max(x, lo), hi), as in torch (so hi wins when lo > hi),
with NaN propagating from any operand.
"""

import torch

from autofuser import LoweringSpec, Sample

from ._common import lowering, randn, refuse_out, require_float_output, with_nans

# A bound equal to x keeps x, as eager does (clamp(-0.0, min=0.0) is -0.0; tl.maximum
# orders -0.0 below +0.0), and a NaN in either operand gives NaN (x < NaN is false,
# so the first where picks a NaN bound).
MAXIMUM = "tl.where({1} != {1}, {1}, tl.where({0} < {1}, {1}, {0}))"
MINIMUM = "tl.where({1} != {1}, {1}, tl.where({1} < {0}, {1}, {0}))"


@lowering
def lower_clamp(ctx, input, min=None, max=None, *, out=None):
    refuse_out(ctx, out)
    if min is None and max is None:
        ctx.refuse("unsupported_argument", "clamp without min or max")
    require_float_output(ctx)
    value = ctx.tensor(input)
    if min is not None:
        value = ctx.pointwise(MAXIMUM, value, min)
    if max is not None:
        value = ctx.pointwise(MINIMUM, value, max)
    return value


@lowering
def lower_clamp_min(ctx, input, min, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise(MAXIMUM, input, min)


@lowering
def lower_clamp_max(ctx, input, max, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise(MINIMUM, input, max)


def _samples(dtype):
    """(x, lo, hi) with lo < hi mostly, sometimes not (then hi wins)."""
    return [
        Sample(args=(randn((3, 37), dtype, scale=2.0), randn((3, 37), dtype) - 1, randn((3, 37), dtype) + 1)),
        Sample(
            args=(randn((5, 1, 7), dtype, scale=2.0), randn((6, 7), dtype) - 1, randn((7,), dtype) + 1),
            note="broadcast bounds",
        ),
        Sample(
            args=(with_nans(randn((1, 129), dtype, scale=2.0)), randn((), dtype) - 1, randn((), dtype) + 1),
            note="NaNs, 0-d bounds",
        ),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.clamp",
        description="min(max(x, lo), hi), either bound optional",
        targets=(torch.clamp, torch.clip, "clamp", "clip"),
        kind="pointwise",
        lower=lower_clamp,
        samples=_samples,
        references=(
            torch.clamp,
            torch.clip,
            lambda x, lo, hi: x.clamp(lo, hi),
            lambda x, lo, hi: x.clip(min=lo),
            lambda x, lo, hi: torch.clamp(x, max=hi),
            lambda x, lo, hi: torch.clamp(x, -0.5, 0.5),
            lambda x, lo, hi: x.clamp(min=0.25),
            lambda x, lo, hi: torch.clip(x, None, -0.1),
            lambda x, lo, hi: x.clamp(0.5, -0.5),  # lo > hi: everything becomes hi
        ),
    ),
    LoweringSpec(
        name="elementwise.clamp_min",
        description="max(x, lo)",
        targets=(torch.clamp_min, "clamp_min"),
        kind="pointwise",
        lower=lower_clamp_min,
        samples=_samples,
        references=(
            lambda x, lo, hi: torch.clamp_min(x, lo),
            lambda x, lo, hi: x.clamp_min(hi),
            lambda x, lo, hi: x.clamp_min(0.3),
        ),
    ),
    LoweringSpec(
        name="elementwise.clamp_max",
        description="min(x, hi)",
        targets=(torch.clamp_max, "clamp_max"),
        kind="pointwise",
        lower=lower_clamp_max,
        samples=_samples,
        references=(
            lambda x, lo, hi: torch.clamp_max(x, hi),
            lambda x, lo, hi: x.clamp_max(lo),
            lambda x, lo, hi: torch.clamp_max(x, -0.3),
        ),
    ),
]
