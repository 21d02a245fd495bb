"""What the elementwise op files share (this module defines no ``SPECS``).

- ``lowering``: binds a node's arguments to the lowering's signature the way
  torch would, and turns an argument it doesn't know into a refusal instead of
  a ``TypeError`` - so an op file lists torch's parameters and nothing else.
- refusals every op needs: ``out=``, ``inplace=True``, results that are not
  fp32/fp16/bf16 (integer or float64 arithmetic stays eager).
- ``@triton.jit`` helpers for functions Triton lacks (``tanh``, ``log1p``,
  ``expm1``, a branch-free exact GELU), written to be accurate in fp32 and to run under
  ``TRITON_INTERPRET=1``.
- sample builders: fresh ``torch.randn`` data in awkward shapes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch

from autofuser import LoweringContext, Sample, Value

#: Results a kernel can store; anything else stays eager.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# Binding and refusing
# ---------------------------------------------------------------------------


def lowering(fn: Callable[..., Value]) -> Callable[..., Value]:
    """Wrap ``fn(ctx, <torch's parameters>)`` so that arguments which don't bind
    to its signature (a keyword torch added later, one positional too many)
    refuse the node instead of raising ``TypeError`` inside the planner."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def lower(ctx: LoweringContext, *args: Any, **kwargs: Any) -> Value:
        try:
            signature.bind(ctx, *args, **kwargs)
        except TypeError as err:
            ctx.refuse("unsupported_argument", f"{_op_name(ctx)}: {err}")
        return fn(ctx, *args, **kwargs)

    return lower


def _op_name(ctx: LoweringContext) -> str:
    target = ctx.node.target
    if ctx.module is not None:
        return type(ctx.module).__name__
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def refuse_out(ctx: LoweringContext, out: Any) -> None:
    if out is not None:
        ctx.refuse("out_argument", f"{_op_name(ctx)}: out= writes into a caller's tensor; left to eager")


def refuse_inplace(ctx: LoweringContext, inplace: Any) -> None:
    if inplace:
        ctx.refuse("inplace", f"{_op_name(ctx)}: inplace=True mutates its input; left to eager")


def require_float_output(ctx: LoweringContext) -> None:
    """Refuse unless eager produced an fp32/fp16/bf16 tensor for this node
    (integer and bool arithmetic, float64 and non-tensor results stay eager)."""
    if ctx.out_shape is None:
        ctx.refuse("not_a_tensor", f"{_op_name(ctx)}: the result is not a tensor")
    if ctx.out_dtype not in FLOAT_DTYPES:
        ctx.refuse("unsupported_dtype", f"{_op_name(ctx)}: result dtype {ctx.out_dtype} (kernels store fp32/fp16/bf16)")


def require_bool_output(ctx: LoweringContext) -> None:
    if ctx.out_shape is None:
        ctx.refuse("not_a_tensor", f"{_op_name(ctx)}: the result is not a tensor")
    if ctx.out_dtype != torch.bool:
        ctx.refuse("unsupported_dtype", f"{_op_name(ctx)}: result dtype {ctx.out_dtype}, expected bool")


def number(ctx: LoweringContext, value: Any, what: str) -> float:
    """A Python number argument (``alpha``, ``negative_slope``...) as a float;
    anything else (a tensor, a traced value) is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        ctx.refuse("unsupported_argument", f"{_op_name(ctx)}: {what}={value!r} is not a Python number")
    return float(value)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------
# Triton helpers (``ctx.helper``); names are prefixed, since every plugin's
# helpers share one kernel module.
# ---------------------------------------------------------------------------

TANH = "elementwise_tanh"
_TANH_SOURCE = """@triton.jit
def elementwise_tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) <= 1: nothing overflows,
    # and NaN passes through. Near 0, 1 - e cancels, so |x| < 0.1 uses the odd
    # Taylor series (next term ~ 0.02 x^9: below fp32 resolution there), whose
    # -0.0 + (+0.0) would turn tanh(-0.0) into +0.0: an exact zero is returned as it is.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    large = (1.0 - e) / (1.0 + e)
    large = tl.where(x < 0, -large, large)
    x2 = x * x
    small = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397))
    return tl.where(x == 0.0, x, tl.where(ax < 0.1, small, large))
"""

LOG1P = "elementwise_log1p"
_LOG1P_SOURCE = """@triton.jit
def elementwise_log1p(u):
    # log(1 + u) loses u's low bits when 1 + u rounds; log(w) * u / (w - 1)
    # with w = 1 + u divides that rounding back out (Goldberg, 1991).
    w = 1.0 + u
    exact = tl.log(w) * (u / (w - 1.0))
    return tl.where(w == 1.0, u, tl.where(w == float("inf"), w, exact))
"""

EXPM1 = "elementwise_expm1"
_EXPM1_SOURCE = """@triton.jit
def elementwise_expm1(x):
    # exp(x) - 1 cancels near 0; (u - 1) * x / log(u) with u = exp(x) corrects
    # the rounding of u (Kahan). u == 1, u - 1 == -1 and u == inf are exact cases.
    # (Nested tl.where, not & or |: the interpreter can't combine a 0-d int1
    # with a block of them.)
    u = tl.exp(x)
    um1 = u - 1.0
    exact = um1 * (x / tl.log(u))
    exact = tl.where(um1 == -1.0, um1, exact)
    exact = tl.where(u == float("inf"), um1, exact)
    return tl.where(u == 1.0, x, exact)
"""

POW = "elementwise_pow"
_POW_SOURCE = """@triton.jit
def elementwise_pow(a, b):
    # |a| ** b through exp2/log2, then C's pow rules: a negative base keeps its
    # sign for odd integer b and gives NaN for fractional b (a = -inf excepted:
    # +inf or +0); b == 0, a == 1 and (|a| == 1, |b| == inf) give exactly 1,
    # NaN or not. (Nested tl.where, not & or |: the interpreter can't combine
    # a 0-d int1 with a block of them.)
    magnitude = tl.exp2(b * tl.log2(tl.abs(a)))
    integer_sign = tl.where(tl.floor(b * 0.5) * 2.0 != b, -1.0, 1.0)
    fractional_sign = tl.where(a == float("-inf"), 1.0, float("nan"))
    negative_base_sign = tl.where(tl.floor(b) != b, fractional_sign, integer_sign)
    result = tl.where(a < 0, magnitude * negative_base_sign, magnitude)
    result = tl.where(tl.abs(b) == float("inf"), tl.where(tl.abs(a) == 1.0, 1.0, result), result)
    result = tl.where(a == 1.0, 1.0, result)
    return tl.where(b == 0.0, 1.0, result)
"""

GELU = "elementwise_gelu"
# The exact GELU, x * Phi(x) with Phi(x) = erfc(-x / sqrt(2)) / 2, without an erf: with
# t = |x| / sqrt(2), erfc(t) / 2 = 2^(t * q(t) - 1), q a degree-7 fit of log2(erfc(t)) / t
# on [0, 4] (weighted by erfc, so Phi's absolute error stays below 1e-8 before rounding).
# Phi = e for x < 0 (no cancellation, where eager's 1 + erf cancels: Phi's relative error
# stays below 2e-6 down to x = -3, 1% at -4.9; past that only the absolute error, below
# 1e-8, is bounded) and 1 - e for x >= 0. One polynomial, one exp2 and a select, where
# libdevice's erff picks one of two coefficient sets per element and runs an exp2 for one
# of them: compiled for a tile, predicated moves of both sets. Past t = 4 the fit falls
# faster than log2(erfc) to -inf, so Phi goes to 0 and 1; inf gives inf, -inf and NaN give
# NaN, as x * (1 + erf) does. benchmarks/gelu_accuracy.py checks every fp32 x of 41
# binades, both signs, against float64 (BENCHMARKS.md, GELU accuracy; docs/architecture.md,
# "Tolerances").
_GELU_SOURCE = """@triton.jit
def elementwise_gelu(x):
    # x * Phi(x) without an erf: Phi = e = 2^(t * q(t) - 1) for x < 0 and 1 - e for x >= 0,
    # t = |x| / sqrt(2), q a degree-7 fit of log2(erfc(t)) / t. How and how accurate:
    # the comment above _GELU_SOURCE in autofuser_plugins/elementwise/ops/_common.py.
    t = tl.abs(x * 0.7071067811865476)
    q = t * -4.535645348369144e-05 + 0.00044549000449478626
    q = q * t + -0.001489384681917727
    q = q * t + -0.0007747217314317822
    q = q * t + 0.028253760188817978
    q = q * t + -0.14848165214061737
    q = q * t + -0.9184163808822632
    q = q * t + -1.6279085874557495
    e = tl.exp2(t * q - 1.0)
    return x * tl.where(x < 0, e, 1.0 - e)
"""

_HELPERS = {TANH: _TANH_SOURCE, LOG1P: _LOG1P_SOURCE, EXPM1: _EXPM1_SOURCE, POW: _POW_SOURCE, GELU: _GELU_SOURCE}


def helper(ctx: LoweringContext, name: str) -> str:
    """Add one of this module's helpers to the kernel; returns its name for a template."""
    return ctx.helper(name, _HELPERS[name])


# ---------------------------------------------------------------------------
# Module forms
# ---------------------------------------------------------------------------


def module_attr(ctx: LoweringContext, name: str, default: Any = None) -> Any:
    return getattr(ctx.module, name, default)


# ---------------------------------------------------------------------------
# Samples: fresh random data, never zeros, in shapes that aren't powers of two
# ---------------------------------------------------------------------------

UNARY_SHAPES: tuple[tuple[int, ...], ...] = ((3, 37), (1, 129), (2, 3, 5, 7))
BINARY_SHAPES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((3, 37), (3, 37)),
    ((5, 1, 7), (6, 7)),  # both sides broadcast
    ((1, 129), ()),  # a 0-d tensor operand
    ((4, 1), (4, 33)),
)


def randn(shape: Sequence[int], dtype: torch.dtype, *, scale: float = 1.0, positive: bool = False) -> torch.Tensor:
    """``torch.randn`` in ``dtype``; ``positive`` keeps values >= 0.05 (for log, sqrt...)."""
    t = torch.randn(tuple(shape)) * scale
    if positive:
        t = t.abs() + 0.05
    return t.to(dtype)


def with_nans(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every 7th element NaN (maximum, relu, clamp must propagate them)."""
    t = t.clone()
    t.view(-1)[::7] = float("nan")
    return t


def unary_samples(
    dtype: torch.dtype,
    *,
    scale: float = 1.0,
    positive: bool = False,
    nans: bool = False,
    shapes: Sequence[Sequence[int]] = UNARY_SHAPES,
) -> list[Sample]:
    samples = [Sample(args=(randn(s, dtype, scale=scale, positive=positive),), note=f"{tuple(s)}") for s in shapes]
    if nans:
        samples.append(
            Sample(args=(with_nans(randn((3, 37), dtype, scale=scale, positive=positive)),), note="NaNs propagate")
        )
    return samples


def binary_samples(
    dtype: torch.dtype,
    *,
    scale: float = 1.0,
    nans: bool = False,
    shapes: Sequence[tuple[Sequence[int], Sequence[int]]] = BINARY_SHAPES,
    positive: tuple[bool, bool] = (False, False),
) -> list[Sample]:
    samples = [
        Sample(
            args=(
                randn(a, dtype, scale=scale, positive=positive[0]),
                randn(b, dtype, scale=scale, positive=positive[1]),
            ),
            note=f"{tuple(a)} with {tuple(b)}",
        )
        for a, b in shapes
    ]
    if nans:
        samples.append(
            Sample(
                # NaNs in both operands, partly at the same positions.
                args=(
                    with_nans(randn((3, 37), dtype, scale=scale)),
                    with_nans(randn((3, 37), dtype, scale=scale)).flip(-1),
                ),
                note="NaNs propagate",
            )
        )
    return samples
