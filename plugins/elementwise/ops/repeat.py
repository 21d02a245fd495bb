"""``x.repeat(*sizes)``: the tensor tiled ``sizes[d]`` times along each dim (new leading
dims where ``sizes`` is longer than ``x``'s rank).

Lowered as a wrapped shifted read (``ctx.read_shifted(..., mode="wrap")``): output
coordinate ``i`` along a dim of size ``n`` reads ``i mod n``, and a new leading dim
reads the operand as size 1. Eager writes every copy; inside a group the repeats are
read where they are used, so the division of Transolver's slice tokens by their
repeated norm (``t / (norm + 1e-5)[..., None].repeat(1, 1, 1, d)``) is one kernel.
"""

import torch

from autofuser import LoweringSpec, Sample

from ._common import lowering, randn, require_float_output


@lowering
def lower_repeat(ctx, input, *sizes):
    require_float_output(ctx)
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = tuple(sizes[0])
    shape = ctx.shape(input)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes) or len(sizes) < len(shape):
        ctx.refuse("unsupported_argument", f"repeat{sizes!r}: one positive int a dim (at least the input's rank)")
    new = len(sizes) - len(shape)
    out = tuple(sizes[:new]) + tuple(n * s for n, s in zip(shape, sizes[new:]))
    return ctx.read_shifted(input, out, [0] * len(out), mode="wrap", new_dims=range(new))


def _samples(dtype):
    # (x, y): x.repeat(2, 1, 3) has y's shape (a new leading dim, a dim of 2 tiled 3 times)
    return [
        Sample(args=(randn((37, 2), dtype), randn((2, 37, 6), dtype)), note="(37, 2) -> (2, 37, 6)"),
        Sample(args=(randn((5, 2), dtype), randn((2, 5, 6), dtype)), note="(5, 2) -> (2, 5, 6)"),
        Sample(args=(randn((1, 2), dtype), randn((2, 1, 6), dtype)), note="one row"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.repeat",
        description="the tensor tiled along each dim (a wrapped shifted read)",
        targets=("repeat",),
        kind="pointwise",
        lower=lower_repeat,
        samples=_samples,
        references=(
            lambda x, y: y / (x + 1e-5).repeat(2, 1, 3).abs().add(1),
            # a computed value repeated inside a chain
            lambda x, y: torch.sigmoid(x * 2).repeat(2, 1, 3) - y,
            # a size-1 dim repeated, as Transolver repeats its slice norm over the head width
            lambda x, y: y * x[:, :1].repeat(2, 1, 6),
        ),
    ),
]
