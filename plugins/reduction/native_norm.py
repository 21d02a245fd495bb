"""ATen's ``native_layer_norm`` as the ops it computes, so that they fuse.

A backward graph recomputes a layer norm's statistics with ``native_layer_norm``,
which returns the normalised rows, their mean and ``1 / sqrt(var + eps)`` at once, and
reads the mean and the reciprocal deviation only: eager writes the normalised rows too,
for nothing, and the statistics reach the norm's derivative (a row kernel over the same
rows) through memory. Written as ``mean``, ``var`` and ``rsqrt`` over the normalised
dims, they join that row kernel; the normalised rows, where read, are ``F.layer_norm``.

The statistics are computed as ATen does: in fp32 (``.float()`` first for a 16-bit
input), rounded once to the dtype ATen returns them in (the traced node's); the
variance is the biased one (divided by the row's length).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

_NATIVE_LAYER_NORM = {torch.native_layer_norm, torch.ops.aten.native_layer_norm.default}


def _meta(node):
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return meta if hasattr(meta, "shape") else None


def _call(graph: torch.fx.Graph, target, args, kwargs, meta) -> torch.fx.Node:
    node = graph.call_function(target, tuple(args), dict(kwargs))
    node.meta["tensor_meta"] = meta
    return node


def decompose_native_layer_norms(gm: torch.fx.GraphModule) -> int:
    """Replace each ``native_layer_norm`` whose results are read by index by the ops of the
    results read; returns how many were replaced."""
    graph, replaced = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _NATIVE_LAYER_NORM or node.kwargs:
            continue
        if len(node.args) != 5 or not isinstance(node.args[0], torch.fx.Node):
            continue
        x, shape, weight, bias, eps = node.args
        x_meta = _meta(x)
        users = list(node.users)
        if x_meta is None or not isinstance(eps, float) or not isinstance(shape, (list, tuple)):
            continue
        if not users or not all(
            u.op == "call_function" and u.target is operator.getitem and u.args[1] in (0, 1, 2) and _meta(u)
            for u in users
        ):
            continue
        rank = len(x_meta.shape)
        dims = list(range(rank - len(shape), rank))
        with graph.inserting_before(node):
            x32 = x
            if x_meta.dtype != torch.float32:
                x32 = graph.call_method("float", (x,))
                x32.meta["tensor_meta"] = x_meta._replace(dtype=torch.float32)
            for user in users:
                meta = _meta(user)
                if user.args[1] == 0:
                    value = _call(graph, F.layer_norm, (x, list(shape), weight, bias, eps), {}, meta)
                else:
                    stat32 = meta._replace(dtype=torch.float32)
                    if user.args[1] == 1:
                        value = _call(graph, torch.mean, (x32,), {"dim": dims, "keepdim": True}, stat32)
                    else:
                        var = _call(graph, torch.var, (x32,), {"dim": dims, "unbiased": False, "keepdim": True}, stat32)
                        shifted = _call(graph, torch.add, (var, eps), {}, stat32)
                        value = _call(graph, torch.rsqrt, (shifted,), {}, stat32)
                    if meta.dtype != torch.float32:
                        rounded = graph.call_method("to", (value, meta.dtype))
                        rounded.meta["tensor_meta"] = meta
                        value = rounded
                user.replace_all_uses_with(value)
                graph.erase_node(user)
        graph.erase_node(node)
        replaced += 1
    return replaced
