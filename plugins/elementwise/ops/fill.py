"""``torch.zeros_like``, ``ones_like``, ``full_like``, ``x.new_zeros``, ``new_ones``,
``new_full``: a tensor of one value, an accumulator or mask that solver code starts
from (``acc = x.new_zeros(x.shape); acc = acc + ...``). Inside a kernel it is a
constant, never read from memory; as an output a kernel writes it.

Only float results are lowered, and only the dtype, device and layout eager would
give anyway: an explicit ``dtype=`` that differs is checked against the node's own
recorded dtype (the core rounds to it), and ``requires_grad=True`` or a
``memory_format`` stay eager.
"""

import math

import torch

from autofuser import LoweringSpec, Sample, Value

from ._common import is_number, randn, require_float_output


def _fill(ctx, value, kwargs):
    require_float_output(ctx)
    if kwargs.get("requires_grad") or kwargs.get("memory_format") not in (None, torch.preserve_format):
        ctx.refuse("unsupported_argument", "a new leaf tensor (requires_grad) or a memory_format stays eager")
    if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory"):
        ctx.refuse("unsupported_argument", "a non-strided layout or pinned memory stays eager")
    if kwargs.get("device") is not None:
        # the node's metadata records no device: one named may not be the kernel's
        ctx.refuse("unsupported_argument", "an explicit device= stays eager")
    if not is_number(value):
        ctx.refuse("unsupported_argument", f"fill value {value!r} is not a Python number")
    value = float(value)
    literal = repr(value) if math.isfinite(value) else f'float("{value}")'
    # A 0-d fp32 tensor of the value, broadcast by the node's shape: the kernel never loads it.
    return Value("pointwise", ctx.out_shape, template=f"tl.full((), {literal}, tl.float32)")


def lower_zeros_like(ctx, input, **kwargs):
    return _fill(ctx, 0.0, kwargs)


def lower_ones_like(ctx, input, **kwargs):
    return _fill(ctx, 1.0, kwargs)


def lower_full_like(ctx, input, fill_value, **kwargs):
    return _fill(ctx, fill_value, kwargs)


def lower_new_zeros(ctx, input, *size, **kwargs):
    return _fill(ctx, 0.0, kwargs)


def lower_new_ones(ctx, input, *size, **kwargs):
    return _fill(ctx, 1.0, kwargs)


def lower_new_full(ctx, input, size, fill_value, **kwargs):
    return _fill(ctx, fill_value, kwargs)


def _samples(dtype):
    return [
        Sample(args=(randn((3, 37), dtype),), note="(3, 37)"),
        Sample(args=(randn((1, 2, 3, 5, 7), dtype),), note="batch 1, rank 5"),
    ]


def _spec(name, description, target, lower, reference):
    return LoweringSpec(
        name=f"elementwise.{name}",
        description=description,
        targets=(target,),
        kind="pointwise",
        lower=lower,
        samples=_samples,
        # The fill feeds arithmetic, as in solver code; a fill alone is no more than
        # eager's own fill kernel.
        references=(reference,),
    )


SPECS = [
    _spec(
        "zeros_like",
        "zeros of the input's shape",
        torch.zeros_like,
        lower_zeros_like,
        lambda x: torch.zeros_like(x) + x * 2,
    ),
    _spec("ones_like", "ones of the input's shape", torch.ones_like, lower_ones_like, lambda x: x - torch.ones_like(x)),
    _spec(
        "full_like",
        "a value in the input's shape",
        torch.full_like,
        lower_full_like,
        lambda x: torch.full_like(x, -2.5) * x,
    ),
    _spec("new_zeros", "zeros of a given shape", "new_zeros", lower_new_zeros, lambda x: x.new_zeros(x.shape) + x),
    _spec(
        "new_ones", "ones of a given shape", "new_ones", lower_new_ones, lambda x: x.new_ones(x.shape[-1]) / (x * x + 1)
    ),
    _spec(
        "new_full",
        "a value in a given shape",
        "new_full",
        lower_new_full,
        # -inf: the start of a running maximum
        lambda x: torch.maximum(x.new_full(x.shape, float("-inf")), x * 3),
    ),
]
