"""Autocast's conversion of a layer norm's output for a linear layer, made a node of the graph.

Under ``torch.autocast`` a linear layer converts an fp32 input to the autocast
dtype itself, inside the op. A producer in a group of its own (a layer norm,
which autocast runs in fp32) then writes fp32, and eager's linear reads that
back and writes a 16-bit copy before its product: ``torch.compile``'s norm
writes the 16-bit value at once. With the conversion a node of its own
(``x.to(dtype)``, what autocast does), the producer's group can take it, and
the linear reads the 16-bit value as it is (autocast passes it through). The
graph computes the same values, as autocast rounds the same way.

Only a layer norm's output read by ``nn.Linear`` or ``F.linear``: a weight stays
a parameter (the product strategies convert it once per call), and ``matmul``'s
operands stay as they are (a converted second operand would be a computed one,
which the product layouts read only from memory).
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from .layout import contiguous_strides


def _calls(gm: torch.fx.GraphModule, node: torch.fx.Node, function, module_type) -> bool:
    """Whether ``node`` calls ``function`` or a module of exactly ``module_type``."""
    if node.op == "call_function":
        return node.target is function
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)) is module_type
    return False


def make_autocast_casts_explicit(gm: torch.fx.GraphModule) -> int:
    """Put a ``to(dtype)`` node between a layer norm (autocast runs it in fp32) and each
    linear that converts its output (the linear's result is fp16/bf16); one per norm and
    dtype. Returns how many were added. Other inputs are left to the linear: their
    producers gain nothing from the node, and attention patterns that read projections
    of a value (``plugins/attention``) would have to see through it."""
    casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not _calls(gm, node, F.linear, torch.nn.Linear) or not node.args:
            continue
        x = node.args[0]
        if not isinstance(x, torch.fx.Node):
            continue
        if not _calls(gm, x, F.layer_norm, torch.nn.LayerNorm):
            continue
        x_meta, out_meta = x.meta.get("tensor_meta"), node.meta.get("tensor_meta")
        if not hasattr(x_meta, "dtype") or not hasattr(out_meta, "dtype"):
            continue
        if x_meta.dtype != torch.float32 or out_meta.dtype not in (torch.float16, torch.bfloat16):
            continue
        # A contiguous input keeps its strides through the conversion (the value's
        # meta below says so); others are left to the linear's own conversion.
        if tuple(x_meta.stride) != contiguous_strides(tuple(x_meta.shape)):
            continue
        cast = casts.get((x, out_meta.dtype))
        if cast is None:
            with gm.graph.inserting_after(x):
                cast = gm.graph.call_method("to", (x, out_meta.dtype))
            cast.meta["tensor_meta"] = x_meta._replace(dtype=out_meta.dtype)
            casts[(x, out_meta.dtype)] = cast
        node.args = (cast, *node.args[1:])
    return len(casts)
