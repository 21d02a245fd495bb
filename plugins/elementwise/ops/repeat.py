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


def _tiles(x, y):
    """The repeat counts that tile ``x`` to ``y``'s shape."""
    lead = y.dim() - x.dim()
    return (*y.shape[:lead], *(s // n for s, n in zip(y.shape[lead:], x.shape)))


def _samples(dtype):
    return [
        Sample(args=(randn((2, 3, 7, 1), dtype), randn((2, 3, 7, 5), dtype)), note="a size-1 dim repeated"),
        Sample(args=(randn((3, 5), dtype), randn((2, 6, 5), dtype)), note="tiled, a new leading dim"),
        Sample(args=(randn((1, 4), dtype), randn((1, 4), dtype)), note="batch 1, repeat once"),
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
            lambda x, y: y / (x + 1e-5).repeat(*_tiles(x, y)).abs().add(1),
            lambda x, y: (
                (x * 2).repeat(y.shape[0], 2, 1)[:, : y.shape[1]] * 0.5 + y
                if x.dim() == 2
                else x.repeat(1, 1, 1, 1) * y
            ),
        ),
    ),
]
