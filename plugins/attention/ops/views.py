"""Views inside slice and linear attention: ``norm[..., None]`` and ``k.transpose(-2, -1)``.

No plugin lowers views (a group reads a view through its strides instead), but
a view *between* two nodes of one chain has to be a member of the chain, or
contracting the chain would make a cycle (Transolver: the slice weights' sum
goes through ``[..., None]`` to the division of the slice tokens; its k comes
out of a linear map and is transposed for the product). These lowerings take
only such views - of a sum (``[..., None]``), of a linear map's or a layer
norm's result (the transpose) - and mark them extern: only a strategy with its
own compose takes them (``slice_attention``, ``linear_attention``), which
folds them into its kernels; anywhere else they run eager as before. Every
other view is refused as not lowered. Priority -1: any plugin that lowers
views for real wins over this.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

#: What a transpose must be of: results computed inside a chain, not inputs read through strides.
MAPS = (torch.nn.Linear, torch.nn.LayerNorm)
MAP_FUNCTIONS = (F.linear, F.layer_norm, torch.layer_norm)


def _is_unsqueeze_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items) and (
        any(i is None for i in items)
    )


def _is_sum(node) -> bool:
    return (node.op == "call_method" and node.target == "sum") or (
        node.op == "call_function" and node.target is torch.sum
    )


def _is_map(ctx, node) -> bool:
    if node.op == "call_module":
        return isinstance(ctx.root.get_submodule(node.target), MAPS)
    return node.op == "call_function" and node.target in MAP_FUNCTIONS


def lower_getitem(ctx, x, index):
    if not ctx.is_tensor(x) or not _is_unsqueeze_index(index) or not _is_sum(x):
        ctx.refuse(
            "no_lowering", "views are read through strides; only [..., None] of a sum inside slice attention is taken"
        )
    return ctx.extern()


def lower_transpose(ctx, x, dim0, dim1):
    rank = len(ctx.shape(x)) if ctx.is_tensor(x) else 0
    if (
        rank < 2
        or not all(isinstance(d, int) for d in (dim0, dim1))
        or sorted((dim0 % rank, dim1 % rank)) != [rank - 2, rank - 1]
        or not _is_map(ctx, x)
    ):
        ctx.refuse(
            "no_lowering",
            "views are read through strides; only the transpose of a linear map's or a "
            "layer norm's result inside attention is taken",
        )
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
