"""Views inside slice attention: ``norm[..., None]`` and ``k.transpose(-2, -1)``.

No plugin lowers views (a group reads a view through its strides instead), but
a view *between* two nodes of one chain has to be a member of the chain, or
contracting the chain would make a cycle (Transolver: the slice weights' sum
goes through ``[..., None]`` to the division of the slice tokens). These
lowerings mark such views extern: only a strategy with its own compose takes
them (the ``slice_attention`` strategy, which folds them into its kernels);
anywhere else they run eager as before. Priority -1: any plugin that lowers
views for real wins over this.
"""

from __future__ import annotations

import operator

import torch

from autofuser import LoweringSpec


def _is_unsqueeze_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items) and (
        any(i is None for i in items))


def lower_getitem(ctx, x, index):
    if not ctx.is_tensor(x) or not _is_unsqueeze_index(index):
        ctx.refuse("unsupported_argument", "only indexing that adds size-1 dims ([..., None]) is taken")
    return ctx.extern()


def lower_transpose(ctx, x, dim0, dim1):
    rank = len(ctx.shape(x)) if ctx.is_tensor(x) else 0
    if rank < 2 or not all(isinstance(d, int) for d in (dim0, dim1)) or sorted((dim0 % rank, dim1 % rank)) != [
            rank - 2, rank - 1]:
        ctx.refuse("unsupported_argument", "only a transpose of the last two dims is taken")
    return ctx.extern()


SPECS = [
    LoweringSpec(
        name="attention.unsqueeze_index",
        description="x[..., None] inside slice attention (extern: the slice_attention strategy folds it in)",
        targets=(operator.getitem,),
        kind="layout",
        lower=lower_getitem,
        priority=-1,
    ),
    LoweringSpec(
        name="attention.transpose",
        description="x.transpose(-2, -1) inside slice attention (extern: the slice_attention strategy folds it in)",
        targets=("transpose", torch.transpose),
        kind="layout",
        lower=lower_transpose,
        priority=-1,
    ),
]
