"""Comparisons ``>``, ``>=``, ``<``, ``<=``, ``==``, ``!=`` in their function,
method and operator forms; the results are bool.

torch compares in the operands' common dtype: a Python number, or a 0-d
tensor of a wider float type, is first rounded to the other operand's fp16 or
bf16. Rounding in a kernel is not enough for ``==``: ``fp16(0.1) == 0.1`` is
True in torch. So numbers are rounded here, and wider 0-d tensors are rounded
in the kernel, exactly as torch rounds them.
"""

import operator

import torch

from autofuser import LoweringSpec, Sample

from ._common import FLOAT_DTYPES, is_number, lowering, randn, refuse_out, require_bool_output

_ROUNDING = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}
_WIDTH = {torch.bool: 0, torch.bfloat16: 1, torch.float16: 1, torch.float32: 2}


def _operands(ctx, input, other):
    """Both operands as kernel values in torch's common dtype."""
    probes = [
        torch.empty(ctx.shape(a), dtype=ctx.dtype(a), device="meta") if ctx.is_tensor(a) else a for a in (input, other)
    ]
    for a in (input, other):
        if not ctx.is_tensor(a) and not is_number(a) and not isinstance(a, bool):
            ctx.refuse("unsupported_argument", f"comparison with {a!r}")
    common = torch.result_type(*probes)
    if common not in FLOAT_DTYPES + (torch.bool,):
        ctx.refuse("unsupported_dtype", f"comparison in {common}")
    values = []
    for a in (input, other):
        if not ctx.is_tensor(a):
            if common in _ROUNDING and not isinstance(a, bool):
                a = torch.tensor(float(a), dtype=torch.float64).to(common).item()
            values.append(ctx.const(a))
            continue
        value = ctx.tensor(a)
        if common in _ROUNDING and _WIDTH[ctx.dtype(a)] > _WIDTH[common]:
            value = ctx.pointwise("{0}.to(%s).to(tl.float32)" % _ROUNDING[common], value)
        values.append(value)
    return values


def _comparison(symbol):
    @lowering
    def lower(ctx, input, other, *, out=None):
        refuse_out(ctx, out)
        require_bool_output(ctx)
        a, b = _operands(ctx, input, other)
        return ctx.pointwise("{0} %s {1}" % symbol, a, b, is_bool=True)

    return lower


def _samples(dtype):
    """Operands that share about half their values, so ==, <= and >= see ties."""

    def pair(shape_a, shape_b):
        a = randn(shape_a, dtype)
        b = randn(shape_b, dtype)
        ties = torch.broadcast_to(a, torch.broadcast_shapes(a.shape, b.shape)).reshape(-1)[: b.numel()].reshape(b.shape)
        return a, torch.where(torch.rand(b.shape) < 0.5, ties, b)

    return [
        Sample(args=pair((3, 37), (3, 37))),
        Sample(args=pair((5, 1, 7), (6, 7)), note="broadcast"),
        Sample(args=pair((1, 129), ()), note="0-d operand"),
        Sample(
            args=(randn((2, 33), dtype), torch.full((2, 33), 0.1, dtype=dtype)),
            note="0.1 rounded to the dtype, compared with the number 0.1",
        ),
    ]


def _spec(op, symbol, operator_fn, targets):
    torch_fn = targets[0]
    method = next(t for t in targets if isinstance(t, str))
    return LoweringSpec(
        name=f"elementwise.{op}",
        description=f"x {symbol} y, bool result",
        targets=targets,
        kind="pointwise",
        lower=_comparison(symbol),
        samples=_samples,
        references=(
            (lambda f: lambda x, y: f(x, y))(operator_fn),
            torch_fn,
            (lambda m: lambda x, y: getattr(x, m)(y))(method),
            (lambda f: lambda x, y: f(y, 0.1))(operator_fn),  # a number: rounded to the dtype first
            # With the 0-d sample, an fp32 0-d tensor against fp16/bf16 x: rounded to x's dtype.
            (lambda f: lambda x, y: f(x, y.float()))(torch_fn),
        ),
    )


SPECS = [
    _spec("gt", ">", operator.gt, (torch.gt, torch.greater, operator.gt, "gt", "greater")),
    _spec("ge", ">=", operator.ge, (torch.ge, torch.greater_equal, operator.ge, "ge", "greater_equal")),
    _spec("lt", "<", operator.lt, (torch.lt, torch.less, operator.lt, "lt", "less")),
    _spec("le", "<=", operator.le, (torch.le, torch.less_equal, operator.le, "le", "less_equal")),
    _spec("eq", "==", operator.eq, (torch.eq, operator.eq, "eq")),
    _spec("ne", "!=", operator.ne, (torch.ne, torch.not_equal, operator.ne, "ne", "not_equal")),
]
