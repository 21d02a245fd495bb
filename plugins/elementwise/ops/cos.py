"""``torch.cos``, ``x.cos()``: positional and time embeddings (``cos(t * freqs)``)."""

import torch

from autofuser import LoweringSpec, Sample

from ._common import lowering, randn, refuse_out, require_float_output, unary_samples


@lowering
def lower_cos(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.cos({0})", input)


def _samples(dtype):
    # Scale 3 spans a full period; an embedding's phases (position times frequency) reach
    # hundreds of radians, where the range reduction must stay exact in fp32.
    return unary_samples(dtype, scale=3.0, nans=True) + [
        Sample(args=(randn((7, 33), dtype, scale=200.0),), note="embedding-sized phases")
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.cos",
        description="cosine",
        targets=(torch.cos, "cos"),
        kind="pointwise",
        lower=lower_cos,
        samples=_samples,
        references=(torch.cos, lambda x: x.cos()),
    ),
]
