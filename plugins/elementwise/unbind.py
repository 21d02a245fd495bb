"""``torch.unbind`` / ``x.unbind(dim)`` as one ``select`` per part taken.

``unbind`` returns a tuple of views, which no kernel produces: the planner never
sees its parts as tensors computed from ``x``. Each part a graph reads is
``unbind(x, dim)[k]``, the same view as ``torch.select(x, dim, k)``, which is
lowered (``ops/select.py``); so this pass rewrites every ``getitem`` of an unbind
by an int into that select, with the part's recorded metadata, and drops the
unbind once nothing else reads it. An unbind whose tuple is read any other way
(passed on whole, indexed by a slice) is left as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx


def _unbind_dim(node: torch.fx.Node):
    """``(x, dim)`` if ``node`` is an unbind, else ``None``."""
    is_unbind = (node.op == "call_function" and node.target is torch.unbind) or (
        node.op == "call_method" and node.target == "unbind"
    )
    if not is_unbind or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if len(node.args) > 2 or set(node.kwargs) - {"dim"} or not isinstance(dim, int) or isinstance(dim, bool):
        return None
    return node.args[0], dim


def unbind_as_selects(gm: torch.fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        found = _unbind_dim(node)
        if found is None:
            continue
        source, dim = found
        parts = list(node.users)
        if not parts or not all(
            p.op == "call_function"
            and p.target is operator.getitem
            and len(p.args) == 2
            and isinstance(p.args[1], int)
            and not isinstance(p.args[1], bool)
            for p in parts
        ):
            continue
        for part in parts:
            part.target = torch.select
            part.args = (source, dim, part.args[1])
        gm.graph.erase_node(node)
