"""``x ** y``, ``torch.pow``, ``x.pow(y)`` and ``torch.square``.

The exponent (or base) is a tensor or a Python number. Constant exponents
follow ATen's own special cases, so results agree bit for bit where ATen's do:
2 and 3 by multiplication, 0.5 as ``sqrt`` and -0.5 as ``rsqrt`` (so
``(-inf) ** 0.5`` is NaN, as in torch), -1 and -2 as reciprocals. Other small
integers multiply by repeated squaring. Everything else goes through the
``elementwise_pow`` helper: ``exp2(b * log2|a|)`` with C's rules for signs,
NaNs and the cases that are exactly 1.
"""

import math
import operator

import torch

from autofuser import LoweringSpec, Sample, Tolerance

from ._common import POW, helper, is_number, lowering, randn, refuse_out, require_float_output, unary_samples

#: Integer exponents up to this size multiply out; larger ones use exp2/log2.
MAX_MULTIPLIED_EXPONENT = 8


def _integer_power(ctx, base, n: int):
    """``base ** n`` for an integer 0 < n <= MAX_MULTIPLIED_EXPONENT, by squaring."""
    result = None
    square = ctx.tensor(base)
    while n:
        if n & 1:
            result = square if result is None else ctx.pointwise("{0} * {1}", result, square)
        n >>= 1
        if n:
            square = ctx.pointwise("{0} * {0}", square)
    return result


def _tensor_to_constant(ctx, base, exponent: float):
    if math.isnan(exponent) or math.isinf(exponent):
        ctx.refuse("unsupported_argument", f"pow with the exponent {exponent!r} is left to eager")
    if exponent == 0:
        # 1 everywhere, NaN bases included (C's pow(nan, 0) == 1).
        return ctx.pointwise("tl.where({0} == {0}, 1.0, 1.0)", base)
    if exponent == 1:
        return ctx.pointwise("{0} * 1.0", base)
    if exponent == 2:
        return ctx.pointwise("{0} * {0}", base)
    if exponent == 3:
        return ctx.pointwise("{0} * {0} * {0}", base)
    if exponent == 0.5:
        return ctx.pointwise("tl.sqrt({0})", base)
    if exponent == -0.5:
        return ctx.pointwise("tl.rsqrt({0})", base)
    if exponent == -1:
        return ctx.pointwise("1.0 / {0}", base)
    if exponent == -2:
        return ctx.pointwise("1.0 / ({0} * {0})", base)
    if exponent.is_integer() and 0 < abs(exponent) <= MAX_MULTIPLIED_EXPONENT:
        power = _integer_power(ctx, base, int(abs(exponent)))
        return power if exponent > 0 else ctx.pointwise("1.0 / {0}", power)
    # The constant becomes a tensor of the base's shape, so the helper sees two tensors.
    return ctx.pointwise(helper(ctx, POW) + "({0}, tl.where({0} == {0}, {1}, {1}))", base, exponent)


def _constant_to_tensor(ctx, base: float, exponent):
    if base == 2:
        return ctx.pointwise("tl.exp2({0})", exponent)
    if base > 0 and not math.isinf(base):
        # base ** y == exp2(y * log2(base)), log2 taken once here in double precision.
        # base == 1 gives exp2(0 * y) == 1, but pow(1, nan) is 1 and 0 * nan is not.
        if base == 1:
            return ctx.pointwise("tl.where({0} == {0}, 1.0, 1.0)", exponent)
        return ctx.pointwise("tl.exp2({0} * {1})", exponent, math.log2(base))
    return ctx.pointwise(helper(ctx, POW) + "(tl.where({1} == {1}, {0}, {0}), {1})", base, exponent)


@lowering
def lower_pow(ctx, input, exponent, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    if is_number(exponent):
        return _tensor_to_constant(ctx, input, float(exponent))
    if is_number(input):
        return _constant_to_tensor(ctx, float(input), exponent)
    return ctx.pointwise(helper(ctx, POW) + "({0}, {1})", input, exponent)


@lowering
def lower_square(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("{0} * {0}", input)


def _tensor_exponent_samples(dtype):
    return [
        # Positive bases with any exponent.
        Sample(args=(randn((3, 37), dtype, scale=2.0, positive=True), randn((3, 37), dtype)), note="positive base"),
        # Negative bases: integer exponents keep or flip the sign, others give NaN.
        Sample(
            args=(randn((5, 1, 7), dtype, scale=2.0), torch.randint(-3, 4, (6, 7)).to(dtype)),
            note="any base, integer exponents",
        ),
        Sample(args=(randn((1, 129), dtype, scale=2.0), randn((), dtype)), note="0-d exponent"),
    ]


_CONSTANT_EXPONENTS = (2, 3, 0.5, -0.5, -1, -2, 0, 1, 4, 7, -3, 1.7, -2.25, 12)

SPECS = [
    LoweringSpec(
        name="elementwise.pow",
        description="x ** y for tensor or Python-number base and exponent",
        targets=(torch.pow, operator.pow, "pow"),
        kind="pointwise",
        lower=lower_pow,
        samples=_tensor_exponent_samples,
        references=(
            lambda x, y: x**y,
            torch.pow,
            lambda x, y: x.pow(y),
            lambda x, y: 2**y,  # recorded as operator.pow(2, y)
            lambda x, y: torch.pow(1.5, y),
            lambda x, y: 0.5**y,
            lambda x, y: (-2.0) ** y,  # negative base: NaN for fractional y
        )
        + tuple(
            # Every special-cased constant exponent, on bases of both signs.
            (lambda n: lambda x, y: x**n)(n)
            for n in _CONSTANT_EXPONENTS
        ),
        tolerances={
            # exp2(y * log2|x|) carries log2's rounding times |y log2 x| (up to ~20
            # here) into the result: a few ulp more than one correctly rounded pow.
            "float32": Tolerance(atol=1e-5, rtol=3e-4),
        },
    ),
    LoweringSpec(
        name="elementwise.square",
        description="x * x",
        targets=(torch.square, "square"),
        kind="pointwise",
        lower=lower_square,
        samples=lambda dtype: unary_samples(dtype, scale=2.0),
        references=(torch.square, lambda x: x.square()),
    ),
]
