"""Argument handling shared by the reduction ops (this module defines no ``SPECS``).

A lowering receives an fx node's arguments exactly as the user wrote them, in
whichever form (``torch.sum(x, 1)``, ``x.sum(dim=1)``, ``torch.sum(x, dim=[1])``).
These helpers bind them to names the way torch does, normalise ``dim`` and
refuse - with a reason - every combination a fused kernel can't reproduce, so
an op file only spells out its own maths.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from autofuser import LoweringContext, Sample, Value

#: Dtypes a kernel loads and stores; anything else stays eager.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bind(
    ctx: LoweringContext,
    op: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    positional: Sequence[str],
    keyword_only: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Map ``args``/``kwargs`` onto names as torch's signature would.

    ``positional`` names the parameters that may be passed by position (the
    tensor first); ``keyword_only`` those that may only be passed by name.
    An unknown keyword, too many positional arguments or a non-``None``
    ``out=`` is refused: the node stays eager.
    """
    if len(args) > len(positional):
        ctx.refuse(
            "unsupported_argument", f"{op}: {len(args)} positional arguments, expected at most {len(positional)}"
        )
    bound = dict(defaults or {})
    bound.update(zip(positional, args))
    for name, value in kwargs.items():
        if name not in positional and name not in keyword_only:
            ctx.refuse("unsupported_argument", f"{op}: keyword argument {name}= is not supported")
        if name in positional[: len(args)]:
            ctx.refuse("unsupported_argument", f"{op}: {name} given both by position and by keyword")
        bound[name] = value
    if bound.get("out") is not None:
        ctx.refuse("out_argument", f"{op}: out= writes into a caller's tensor; left to eager")
    return bound


def float_input(ctx: LoweringContext, op: str, arg: Any) -> tuple[Value, tuple[int, ...]]:
    """The op's tensor input as a Value, with its shape.

    Refused: non-tensors, non-float dtypes (integer and bool reductions produce
    int64 or bool results), 0-d tensors (nothing to reduce) and empty tensors
    (their reductions are identities, nan or errors that a kernel can't mirror).
    """
    if not isinstance(arg, torch.fx.Node) or not ctx.is_tensor(arg):
        ctx.refuse("not_a_tensor", f"{op}: input {arg!r} is not a tensor")
    dtype = ctx.dtype(arg)
    if dtype not in FLOAT_DTYPES:
        ctx.refuse("unsupported_dtype", f"{op}: input of dtype {dtype}; only float32/float16/bfloat16 are fused")
    shape = ctx.shape(arg)
    if len(shape) == 0:
        ctx.refuse("scalar_input", f"{op}: 0-d input, nothing to reduce")
    if 0 in shape:
        ctx.refuse("empty_input", f"{op}: empty input of shape {shape}")
    if ctx.out_dtype is not None and ctx.out_dtype not in FLOAT_DTYPES:
        ctx.refuse("unsupported_dtype", f"{op}: result of dtype {ctx.out_dtype} is not a float kernel output")
    return ctx.tensor(arg), shape


def reduction_dims(
    ctx: LoweringContext, op: str, dim: Any, rank: int, empty_means_all: bool = False
) -> tuple[int, ...]:
    """``dim`` (``None``, an int, or a tuple/list of ints) -> sorted non-negative dims.

    ``None`` means every dim. An empty tuple means every dim only for ops
    whose default is ``()`` (``amax``/``amin``); elsewhere its meaning has
    changed across torch versions, so it is refused. Named dims, dims that
    are fx nodes, out-of-range and repeated dims are refused too.
    """
    if dim is None:
        return tuple(range(rank))
    if isinstance(dim, int) and not isinstance(dim, bool):
        dims = (dim,)
    elif isinstance(dim, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in dim):
        dims = tuple(dim)
    else:
        ctx.refuse("unsupported_argument", f"{op}: dim={dim!r} is not an int, a tuple of ints or None")
    if not dims:
        if empty_means_all:
            return tuple(range(rank))
        ctx.refuse("unsupported_argument", f"{op}: an empty dim list; pass dim=None to reduce every dim")
    for d in dims:
        if not -rank <= d < rank:
            ctx.refuse("unsupported_argument", f"{op}: dim {d} out of range for a {rank}-d input")
    normalised = sorted(d % rank for d in dims)
    if len(set(normalised)) != len(normalised):
        ctx.refuse("unsupported_argument", f"{op}: dim={dim!r} repeats a dim")
    return tuple(normalised)


def one_dim(ctx: LoweringContext, op: str, dim: Any, rank: int) -> int:
    """A single required dim (softmax, log_softmax); ``None`` is refused.

    ``dim=None`` makes torch guess a dim from the rank and warn that the
    implicit choice is deprecated; a fused kernel should not bake that guess in.
    """
    if dim is None:
        ctx.refuse("implicit_dim", f"{op}: dim=None (torch's deprecated implicit dim); pass dim explicitly")
    if not isinstance(dim, int) or isinstance(dim, bool):
        ctx.refuse("unsupported_argument", f"{op}: dim={dim!r} is not an int")
    if not -rank <= dim < rank:
        ctx.refuse("unsupported_argument", f"{op}: dim {dim} out of range for a {rank}-d input")
    return dim % rank


def count(shape: Sequence[int], dims: Sequence[int]) -> int:
    """How many elements one reduction over ``dims`` of ``shape`` combines."""
    return math.prod(shape[d] for d in dims)


_TL_NAMES = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}


def cast_to_dtype_arg(ctx: LoweringContext, op: str, value: Value, input_dtype: torch.dtype, dtype: Any) -> Value:
    """Apply a ``dtype=`` argument: torch casts the input to it before computing.

    Upcasts (and no-ops) change nothing in an fp32 kernel; a downcast rounds
    the input as eager does (the cast the core uses to round results). Non-float
    dtypes, and float64, which kernels don't store, are refused.
    """
    if dtype is None:
        return value
    if dtype not in FLOAT_DTYPES:
        ctx.refuse("unsupported_dtype", f"{op}: dtype={dtype} is not float32/float16/bfloat16")
    if dtype == input_dtype or dtype == torch.float32:
        return value
    return ctx.pointwise("{0}.to(%s).to(tl.float32)" % _TL_NAMES[dtype], value)


def check_module_forward(ctx: LoweringContext, base: type) -> None:
    """Refuse a subclass of ``base`` that overrides ``forward``: it is not ``base``'s maths."""
    if type(ctx.module).forward is not base.forward:
        ctx.refuse("overridden_forward", f"{type(ctx.module).__name__} overrides {base.__name__}.forward")


def reduction_samples(dtype: torch.dtype) -> list[Sample]:
    """The samples every reduction over dims is checked on: a row of 37, a batch of 1
    over 129, and 3-d shapes whose reduced dims are not powers of two."""
    return [
        Sample(args=(torch.randn(shape, dtype=dtype),), note=f"shape {shape}")
        for shape in ((3, 37), (1, 129), (2, 5, 17), (4, 6, 9))
    ]
