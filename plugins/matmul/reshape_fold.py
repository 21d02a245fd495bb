"""Products over flattened rows, and transposes of transposes, written as what they are.

ATen spells a linear layer on a ``[*lead, K]`` input as ``view -> mm (or addmm) ->
view``: the rows flattened to 2-D, the product, the rows unflattened. A backward
graph (its recompute of the forward, and every input gradient ``dY @ W``) is full of
these, and so is user code that reshapes around ``mm``. The views are free in
eager, but a view between a product and the pointwise work after it keeps the two
in separate groups (a group reads views of its inputs through strides; it can't
hold one between two of its members). So the sandwich becomes one
``torch.matmul(x, w)`` on the unflattened input (``+ bias`` for ``addmm``), whose
result is the unflattened one: the product strategies then take the activation
derivative, the bias and the residual after it as their epilogue.

``permute(permute(x, p), q)`` - a transposed weight transposed back, as ATen's
derivative of ``x @ W.T`` has it - becomes one permute, or ``x`` itself.

Both rewrites compute the identical values: ``torch.matmul`` of a 3-D (or wider)
input and a matrix flattens the rows the same way, and composed permutes are one
permute.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx

#: Views that flatten or unflatten rows: ATen's (backward graphs), torch's and the methods.
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}
_VIEW_FUNCTIONS = {torch.reshape}
_VIEW_METHODS = {"view", "reshape"}
#: ``mm(a, b)`` and ``addmm(bias, a, b)``, as torch functions (what ``to_torch_level`` makes of ATen's) or ATen's.
_MM = {torch.mm, torch.ops.aten.mm.default}
_ADDMM = {torch.addmm, torch.ops.aten.addmm.default}
_PERMUTES = {torch.permute, torch.ops.aten.permute.default}


def _meta(node) -> Optional[object]:
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return meta if hasattr(meta, "shape") else None


def _is_view(node) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return node.target in _VIEWS or node.target in _VIEW_FUNCTIONS
    return node.op == "call_method" and node.target in _VIEW_METHODS


def _flattened_rows(view) -> Optional[torch.fx.Node]:
    """The ``[*lead, K]`` tensor (rank >= 3) that ``view`` flattens to ``[prod(lead), K]``."""
    if not _is_view(view) or not view.args or not isinstance(view.args[0], torch.fx.Node):
        return None
    source, flat, meta = view.args[0], _meta(view), _meta(view.args[0])
    if flat is None or meta is None or len(meta.shape) < 3 or len(flat.shape) != 2:
        return None
    *lead, k = meta.shape
    return source if tuple(flat.shape) == (math.prod(lead), k) else None


def _default_scaling(node) -> bool:
    """``addmm``'s beta and alpha are 1 (a plain bias)."""
    known = not node.kwargs.keys() - {"beta", "alpha"}
    return known and all(node.kwargs.get(name, 1) == 1 for name in ("beta", "alpha")) and len(node.args) == 3


def fold_flattened_products(gm: torch.fx.GraphModule) -> int:
    """Rewrite each ``view -> mm/addmm -> view`` over flattened rows as a ``torch.matmul``
    of the unflattened input (plus the bias, a vector, for ``addmm``); returns how many."""
    graph, folded = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not (node.target in _MM or node.target in _ADDMM):
            continue
        is_addmm = node.target in _ADDMM
        if is_addmm and not _default_scaling(node):
            continue
        bias, a, b = node.args if is_addmm else (None, *node.args[:2])
        x = _flattened_rows(a)
        b_meta, out_meta = _meta(b), _meta(node)
        if x is None or b_meta is None or out_meta is None or len(b_meta.shape) != 2:
            continue
        bias_meta = _meta(bias)
        if bias is not None and (bias_meta is None or tuple(bias_meta.shape) != (out_meta.shape[1],)):
            continue
        users = list(node.users)
        if len(users) != 1 or not _is_view(users[0]):
            continue
        unflatten = users[0]
        result = _meta(unflatten)
        lead = tuple(_meta(x).shape[:-1])
        if result is None or tuple(result.shape) != (*lead, out_meta.shape[1]) or result.dtype != out_meta.dtype:
            continue
        with graph.inserting_before(unflatten):
            product = graph.call_function(torch.matmul, (x, b))
            product.meta["tensor_meta"] = result
            replacement = product
            if bias is not None:
                replacement = graph.call_function(torch.add, (product, bias))
                replacement.meta["tensor_meta"] = result
        unflatten.replace_all_uses_with(replacement)
        graph.erase_node(unflatten)
        graph.erase_node(node)
        if not a.users:
            graph.erase_node(a)
        folded += 1
    return folded


def fold_double_permutes(gm: torch.fx.GraphModule) -> int:
    """``permute(permute(x, p), q)`` as ``permute(x, p[q])``, or ``x`` where that is the
    identity; returns how many were folded."""
    graph, folded = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _PERMUTES or len(node.args) != 2:
            continue
        inner = node.args[0]
        if not (isinstance(inner, torch.fx.Node) and inner.op == "call_function" and inner.target in _PERMUTES):
            continue
        if len(inner.args) != 2 or not isinstance(inner.args[0], torch.fx.Node):
            continue
        p, q = list(inner.args[1]), list(node.args[1])
        if len(p) != len(q) or not all(isinstance(d, int) for d in (*p, *q)):
            continue
        rank = len(p)
        composed = [p[d % rank] % rank for d in q]
        if composed == list(range(rank)):
            node.replace_all_uses_with(inner.args[0])
        else:
            with graph.inserting_before(node):
                single = graph.call_function(node.target, (inner.args[0], composed))
            single.meta = dict(node.meta)
            node.replace_all_uses_with(single)
        graph.erase_node(node)
        if not inner.users:
            graph.erase_node(inner)
        folded += 1
    return folded
