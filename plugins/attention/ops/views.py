"""Views inside slice and linear attention: ``norm[..., None]`` and ``k.transpose(-2, -1)``.

No plugin lowers views (a group reads a view through its strides instead), but
a view *between* two nodes of one chain has to be a member of the chain, or
contracting the chain would make a cycle (Transolver: the slice weights' sum
goes through ``[..., None]`` to the division of the slice tokens, directly or after
``+ eps``; its k comes
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
import torch.fx
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


#: Arithmetic by a number on the way from the slice weights' sum to its view (the
#: authors' Transolver writes ``(norm + 1e-5)[:, :, :, None]``).
CONSTANT_STEPS = (operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.mul, torch.div)
CONSTANT_STEP_METHODS = ("add", "sub", "mul", "div", "__add__", "__radd__", "__mul__", "__rmul__", "__truediv__")


def _is_sum_or_step_of_one(node, depth: int = 3) -> bool:
    """A sum, or arithmetic with numbers (at most ``depth`` ops) on one."""
    if _is_sum(node):
        return True
    is_step = (node.op == "call_function" and node.target in CONSTANT_STEPS) or (
        node.op == "call_method" and node.target in CONSTANT_STEP_METHODS
    )
    operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    numbers = all(isinstance(a, (torch.fx.Node, int, float)) and not isinstance(a, bool) for a in node.args)
    return depth > 0 and is_step and numbers and len(operands) == 1 and _is_sum_or_step_of_one(operands[0], depth - 1)


def _is_map(ctx, node) -> bool:
    if node.op == "call_module":
        return isinstance(ctx.root.get_submodule(node.target), MAPS)
    return node.op == "call_function" and node.target in MAP_FUNCTIONS


def lower_getitem(ctx, x, index):
    if not ctx.is_tensor(x) or not _is_unsqueeze_index(index) or not _is_sum_or_step_of_one(x):
        ctx.refuse(
            "no_lowering",
            "views are read through strides; only [..., None] of a sum (or of a sum plus a number) inside "
            "slice attention is taken",
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
