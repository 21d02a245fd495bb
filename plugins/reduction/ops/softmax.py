"""``softmax`` in its five forms: F.softmax, torch.softmax, torch.special.softmax,
Tensor.softmax and nn.Softmax; also ATen's ``_softmax``, which a backward graph
recomputes its forward with.

exp(x - max) / sum(exp(x - max)): subtracting the row max first keeps exp from
overflowing; the max is a keepdim reduction so it broadcasts back over the row.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import bind, cast_to_dtype_arg, check_module_forward, float_input, one_dim

#: ATen's forms, ``(input, dim, half_to_float)``: what a traced backward graph calls.
ATEN_FORMS = (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default)


def softmax_operands(ctx, op, module_type, args, kwargs):
    """(input Value, the one dim) of any softmax-like node; ``dtype=`` applied."""
    if ctx.module is not None:
        check_module_forward(ctx, module_type)
        b = bind(ctx, op, args, kwargs, ("input",))
        b["dim"] = ctx.module.dim
    elif ctx.node.target in (F.softmax, F.log_softmax):
        b = bind(ctx, op, args, kwargs, ("input", "dim", "_stacklevel", "dtype"))
    elif ctx.node.target in ATEN_FORMS:
        b = bind(ctx, op, args, kwargs, ("input", "dim", "half_to_float"))
        if b["half_to_float"]:
            ctx.refuse("unsupported_argument", f"{op}: half_to_float=True (an fp32 result of half inputs)")
    else:  # torch.softmax, torch.special.softmax, Tensor.softmax: dtype may come third by position
        b = bind(ctx, op, args, kwargs, ("input", "dim", "dtype"))
    x, shape = float_input(ctx, op, b["input"])
    dim = one_dim(ctx, op, b.get("dim"), len(shape))
    return cast_to_dtype_arg(ctx, op, x, ctx.dtype(b["input"]), b.get("dtype")), dim


def lower_softmax(ctx, *args, **kwargs):
    x, dim = softmax_operands(ctx, "softmax", torch.nn.Softmax, args, kwargs)
    row_max = ctx.reduce("max", x, dim, keepdim=True)
    exps = ctx.pointwise("tl.exp({0} - {1})", x, row_max)
    return ctx.pointwise("{0} / {1}", exps, ctx.reduce("sum", exps, dim, keepdim=True))


def _samples(dtype):
    return [
        Sample(args=(torch.randn(shape, dtype=dtype),), note=f"shape {shape}")
        for shape in ((3, 37), (1, 129), (2, 5, 17), (4, 6, 9))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.softmax",
        description="Softmax over one dim (max-subtracted), optional dtype= upcast.",
        targets=(
            F.softmax,
            torch.softmax,
            torch.special.softmax,
            "softmax",
            torch.nn.Softmax,
            torch.ops.aten._softmax.default,
        ),
        kind="reduction",
        lower=lower_softmax,
        samples=_samples,
        references=(
            lambda x: x.softmax(-1),
            lambda x: torch.softmax(x, 1),
            lambda x: F.softmax(x, dim=-1),
            lambda x: F.softmax(x, 1, _stacklevel=5),
            lambda x: torch.special.softmax(x, 0),
            lambda x: x.softmax(-1, dtype=torch.float32),
            torch.nn.Softmax(dim=1),
            torch.nn.Softmax(dim=-1),
            lambda x: torch.ops.aten._softmax.default(x, -1, False),
        ),
    )
]
