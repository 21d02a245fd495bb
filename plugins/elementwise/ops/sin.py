"""``torch.sin``, ``x.sin()``: positional and time embeddings (``sin(t * freqs)``)."""

import torch

from autofuser import LoweringSpec, Sample

from ._common import lowering, randn, refuse_out, require_float_output, unary_samples


@lowering
def lower_sin(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.sin({0})", input)


def _samples(dtype):
    # Scale 3 spans a full period; an embedding's phases (position times frequency) reach
    # hundreds of radians, where the range reduction must stay exact in fp32.
    return unary_samples(dtype, scale=3.0, nans=True) + [
        Sample(args=(randn((7, 33), dtype, scale=200.0),), note="embedding-sized phases")
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.sin",
        description="sine",
        targets=(torch.sin, "sin"),
        kind="pointwise",
        lower=lower_sin,
        samples=_samples,
        references=(torch.sin, lambda x: x.sin()),
    ),
]
