"""``torch.roll(x, shifts, dims)`` and ``x.roll(shifts, dims)``: every element moved
``shift`` places along a dim, those pushed past the end coming back at the start.

Lowered as a wrapped shifted read (``ctx.read_shifted(..., mode="wrap")``): output
coordinate ``i`` reads ``(i - shift) mod n``. Inside a group the values it reads
are computed at those coordinates, so the shifted windows of a Swin-style block
(``roll -> add -> gelu -> roll back``) run as one kernel, the rolled tensor never
written. A roll over the flattened tensor (``dims=None``, rank above 1) moves
elements across rows and stays eager.
"""

import torch

from autofuser import LoweringSpec, Sample

from ._common import lowering, randn, require_float_output


@lowering
def lower_roll(ctx, input, shifts, dims=None):
    require_float_output(ctx)
    shape = ctx.shape(input)
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    if dims is None:
        if len(shape) != 1:
            ctx.refuse("unsupported_argument", "roll without dims rolls the flattened tensor; left to eager")
        dims = (0,)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts) != len(dims) or not all(isinstance(x, int) and not isinstance(x, bool) for x in shifts + dims):
        ctx.refuse("unsupported_argument", f"roll: shifts {shifts!r} and dims {dims!r} must be ints, one shift a dim")
    offsets = [0] * len(shape)
    for shift, dim in zip(shifts, dims):
        offsets[dim % len(shape)] -= shift  # out[i] = x[i - shift]; several shifts of one dim add up
    return ctx.read_shifted(input, shape, offsets, mode="wrap")


def _samples(dtype):
    return [
        Sample(args=(randn((3, 37), dtype),), note="(3, 37)"),
        Sample(args=(randn((1, 7, 9, 5), dtype),), note="batch 1, a window grid"),
        Sample(args=(randn((2, 6, 11), dtype),), note="odd sizes"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.roll",
        description="elements moved along dims, wrapping around (a wrapped shifted read)",
        targets=(torch.roll, "roll"),
        kind="pointwise",
        lower=lower_roll,
        samples=_samples,
        references=(
            lambda x: torch.roll(x * 2, 1, -1) + x,
            lambda x: x.roll((-2, 3), (1, -1)),
            # shifts longer than the dim, negative and repeated dims
            lambda x: torch.nn.functional.gelu(torch.roll(x, (40, -9, 1), (-1, -1, 0)) - 1),
            # a shifted-window block: roll, pointwise, roll back
            lambda x: torch.roll(torch.sigmoid(torch.roll(x, (-1, -2), (-2, -1))) * x, (1, 2), (-2, -1)),
        ),
    ),
]
