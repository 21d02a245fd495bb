"""``F.pad(x, pad, mode, value)`` and ``torch.constant_pad_nd`` (a padding's form in
backward graphs): a border added around (or, with negative widths, cut from) the
last dims.

Lowered as a shifted read of the input, ``pad_left`` places earlier along each
padded dim: ``constant`` mode fills what falls outside with ``value`` (a negative
width crops), ``reflect`` mirrors about the edge, ``replicate`` repeats the edge
(clamp) and ``circular`` wraps around. Inside a group the padded values are
computed where they are read, so a pad between pointwise ops (or before a
max-pool) is one kernel and the padded tensor is never written.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import lowering, randn, require_float_output

#: F.pad's modes as shifted-read modes.
MODES = {"constant": "fill", "reflect": "reflect", "replicate": "clamp", "circular": "wrap"}


def lower_pad(ctx, *args, **kwargs):
    if ctx.node.target is torch.constant_pad_nd:
        return _constant_pad_nd(ctx, *args, **kwargs)
    return _functional_pad(ctx, *args, **kwargs)


@lowering
def _functional_pad(ctx, input, pad, mode="constant", value=None):
    return _pad(ctx, input, pad, mode, value)


@lowering
def _constant_pad_nd(ctx, input, pad, value=0):
    return _pad(ctx, input, pad, "constant", value)


def _pad(ctx, input, pad, mode, value):
    require_float_output(ctx)
    shape = ctx.shape(input)
    if mode not in MODES:
        ctx.refuse("unsupported_argument", f"pad mode {mode!r} (kernels read {sorted(MODES)})")
    pad = tuple(pad)
    if len(pad) % 2 or len(pad) // 2 > len(shape) or not all(isinstance(p, int) for p in pad):
        ctx.refuse("unsupported_argument", f"pad widths {pad!r}: pairs of ints, at most one pair per dim")
    if mode != "constant" and min(pad, default=0) < 0:
        ctx.refuse("unsupported_argument", f"negative pad widths {pad!r} in {mode} mode")
    if value is not None and not isinstance(value, (int, float)):
        ctx.refuse("unsupported_argument", f"pad value {value!r} is not a number")
    offsets = [0] * len(shape)
    for k in range(len(pad) // 2):  # pairs run from the last dim backwards
        offsets[len(shape) - 1 - k] = -pad[2 * k]
    fill = 0.0 if value is None else float(value)
    return ctx.read_shifted(input, ctx.out_shape, offsets, mode=MODES[mode], fill=fill)


def _samples(dtype):
    return [
        Sample(args=(randn((2, 3, 9, 7), dtype),), note="(2, 3, 9, 7)"),
        Sample(args=(randn((1, 5, 6, 11), dtype),), note="batch 1"),
        Sample(args=(randn((3, 4, 13), dtype),), note="rank 3"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.pad",
        description="a border around the last dims: constant, reflected, replicated or circular (a shifted read)",
        targets=(F.pad, torch.constant_pad_nd),
        kind="pointwise",
        lower=lower_pad,
        samples=_samples,
        references=(
            lambda x: F.pad(x * 2, (1, 2)) + 1,
            lambda x: torch.relu(F.pad(x, (2, 1, 1, 2), value=-0.5)),
            lambda x: F.pad(x, (2, 2, 1, 0), mode="reflect") * 3,
            lambda x: F.pad(torch.tanh(x), (1, 2, 2, 1), mode="replicate"),
            lambda x: F.pad(x, (1, 2, 2, 1), mode="circular") - x.mean(),
            # negative widths crop
            lambda x: F.gelu(F.pad(x, (-1, 2, 1, -2))),
            lambda x: torch.constant_pad_nd(x, (0, 1, 2, 0), 1.5) * x.sum(),
        ),
    ),
]
