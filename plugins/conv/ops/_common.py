"""Argument checks shared by the conv plugin's ops (this module defines no ``SPECS``)."""

from __future__ import annotations

from typing import Any

import torch

from autofuser import LoweringContext, Value

#: What a kernel reads and stores for the ops that move values (cat, stack, pooling).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def per_channel(ctx: LoweringContext, arg: Any, channels: int, spatial: int, op: str, name: str) -> Value:
    """A per-channel tensor (``[C]``) read as ``[C, 1, ..., 1]`` (``spatial`` ones), so it
    broadcasts over the spatial dims of a channels-first ``[B, C, *spatial]``."""
    value = ctx.tensor(arg)
    if tuple(value.shape) != (channels,):
        ctx.refuse("shape_mismatch", f"{op}: {name} of shape {list(value.shape)}, expected [{channels}]")
    return ctx.read_as(value, (channels,) + (1,) * spatial)


def int_tuple(ctx: LoweringContext, op: str, name: str, value: Any, rank: int) -> tuple[int, ...]:
    """An int or a tuple of ``rank`` ints (``stride=1``, ``padding=(0, 0)``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * rank
    if (
        isinstance(value, (tuple, list))
        and len(value) == rank
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return tuple(value)
    ctx.refuse("unsupported_argument", f"{op}: {name}={value!r} is not an int or {rank} ints")


def float_tensor(ctx: LoweringContext, op: str, arg: Any) -> tuple[int, ...]:
    """The shape of a float tensor argument; anything else is refused."""
    if not ctx.is_tensor(arg):
        ctx.refuse("not_a_tensor", f"{op}: {arg!r} is not a tensor")
    if ctx.dtype(arg) not in (torch.float32, torch.float16, torch.bfloat16):
        ctx.refuse("unsupported_dtype", f"{op}: input of dtype {ctx.dtype(arg)}")
    shape = ctx.shape(arg)
    if 0 in shape:
        ctx.refuse("empty_input", f"{op}: empty input of shape {list(shape)}")
    return shape


def module_forward_is(ctx: LoweringContext, base: type) -> None:
    """Refuse a subclass of ``base`` that overrides ``forward``: it is not ``base``'s maths."""
    if type(ctx.module).forward is not base.forward:
        ctx.refuse("overridden_forward", f"{type(ctx.module).__name__} overrides {base.__name__}.forward")


def tensor_list(ctx: LoweringContext, op: str, tensors: Any, dim: Any, kwargs: dict) -> list:
    """``tensors`` (a cat's or a stack's) as a list, after the checks both need: graph
    values, all of the result's dtype, fp32/fp16/bf16, an int ``dim``, no keywords."""
    if kwargs:
        ctx.refuse("unsupported_argument", f"{op}: keyword arguments {sorted(kwargs)}")
    if not isinstance(tensors, (tuple, list)) or not tensors or not all(ctx.is_tensor(t) for t in tensors):
        ctx.refuse("unsupported_argument", f"{op}: the tensors must be a non-empty list of graph values")
    if not isinstance(dim, int) or isinstance(dim, bool):
        ctx.refuse("unsupported_argument", f"{op}: dim={dim!r} is not an int")
    if ctx.out_dtype not in FLOAT_DTYPES or any(ctx.dtype(t) != ctx.out_dtype for t in tensors):
        ctx.refuse("unsupported_dtype", f"{op}: inputs of mixed dtypes, or not fp32/fp16/bf16")
    return list(tensors)
