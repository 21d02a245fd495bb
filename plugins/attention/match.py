"""Finding softmax attention in a graph, and reading a found group into an
``AttentionLayout`` (or refusing it with a reason the report shows).

Two forms are recognised:

1. a ``scaled_dot_product_attention`` node that ``ops/sdpa.py`` lowered (as an
   extern op: its arguments are read here, from the node);
2. the same computation written out, found by walking the graph back and
   forth from each softmax over the last dim::

       q' = prologue(q)     optional pointwise ops on q alone (``q * scale``), used only here
       s  = q' @ k^T        a node lowered to one product of two tensors: matmul, @, bmm,
                            einsum; k^T as a .transpose(-2, -1) / .mT view, or transposed
                            by the einsum itself
       s  = steps(s)        pointwise ops on the scores: scale (mul/div), an additive bias,
                            masked_fill / where with a mask - any tensors they read must
                            broadcast to the scores
       p  = softmax(s, -1)
       p  = identity(p)     optional: dropout in eval, casts
       o  = p @ v           a product of p and a tensor

   Every intermediate must be used only inside the chain: otherwise the N x M
   scores have to exist in memory anyway, and the group is refused with the
   name of the outside user.

The products and steps are recognised by their lowered IR (a ``dot`` of two
loads, pointwise values), not by op names, so every lowering of a product or
a pointwise op that any plugin registers takes part.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from autofuser import GroupRefused, Value, program_from_nodes
from autofuser.kernel import AttrRef, collect_values, domain_strides, fp32_precision, tensor_meta

from .flash_op import flash_attention
from .layout import AttentionLayout, AttentionProgram, Operand, Step
from .ops.sdpa import MAX_HEAD_WIDTH, SDPA_FUNCTIONS, sdpa_arguments

SOFTMAX_FUNCTIONS = (F.softmax, torch.softmax, torch.special.softmax)
#: Methods that only convert p's dtype between the softmax and the product (p is rounded
#: to the product's operand dtype anyway).
CASTS = ("to", "type", "type_as", "float", "half", "bfloat16")
#: How far the walks go: steps between product and softmax, ops on q, ops after the softmax.
MAX_SCORE_STEPS = 8
MAX_Q_STEPS = 4
MAX_POST_STEPS = 4
ROUNDED = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# Recognising the pieces
# ---------------------------------------------------------------------------


def is_sdpa(view, node: torch.fx.Node) -> bool:
    value = view.lowered.get(node)
    return value is not None and value.op == "extern" and node.target in SDPA_FUNCTIONS


def softmax_dim(node: torch.fx.Node, gm: torch.nn.Module):
    """The dim of a softmax node (``None`` if it isn't one; ``"?"`` if it isn't a plain int)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if not isinstance(module, torch.nn.Softmax):
            return None
        dim = module.dim
    elif (node.op == "call_method" and node.target == "softmax") or (
        node.op == "call_function" and node.target in SOFTMAX_FUNCTIONS
    ):
        rest = node.args[1:]
        dim = node.kwargs.get("dim", rest[0] if rest else None)
    else:
        return None
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else "?"


def product(view, node: torch.fx.Node) -> Optional[Value]:
    """``node``'s lowered ``dot`` if it is one product of two tensors read from memory."""
    value = view.lowered.get(node)
    if value is None or value.op != "dot":
        return None
    if all(a.op == "load" and isinstance(a.source, torch.fx.Node) for a in value.args):
        return value
    return None


def _values(root: Value) -> list[Value]:
    return list(collect_values([root]).values())


def _is_pointwise(view, node: torch.fx.Node) -> bool:
    value = view.lowered.get(node)
    return value is not None and all(v.op in ("load", "const", "pointwise") for v in _values(value))


def _passes_probabilities(view, node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Is ``node`` the identity on ``source`` (dropout in eval) or a float cast of it?"""
    value = view.lowered.get(node)
    if value is None:
        return False
    if value.op == "load" and value.source is source:
        return True
    meta = tensor_meta(node)
    return (
        node.op == "call_method"
        and node.target in CASTS
        and node.args
        and node.args[0] is source
        and meta is not None
        and meta.dtype in FLOATS
        and _is_pointwise(view, node)
    )


# ---------------------------------------------------------------------------
# Walking the graph (propose)
# ---------------------------------------------------------------------------


def _back_to_product(view, node: torch.fx.Node, depth: int = MAX_SCORE_STEPS) -> Optional[list[torch.fx.Node]]:
    """``[product, step, ..., node]``: the one path of pointwise ops from a product to ``node``."""
    if product(view, node) is not None:
        return [node]
    if depth == 0 or not _is_pointwise(view, node):
        return None
    paths = [p for arg in dict.fromkeys(node.all_input_nodes) if (p := _back_to_product(view, arg, depth - 1))]
    return paths[0] + [node] if len(paths) == 1 else None


def _forward_to_product(view, softmax: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """``[identity, ..., product]``: from the softmax through identities to the product reading p."""
    path: list[torch.fx.Node] = []
    current = softmax
    for _ in range(MAX_POST_STEPS + 1):
        for user in current.users:
            value = product(view, user)
            if value is not None and value.args[0].source is current and value.args[1].source is not current:
                return path + [user]
        passes = [u for u in current.users if _passes_probabilities(view, u, current)]
        if len(passes) != 1:
            return None
        current = passes[0]
        path.append(current)
    return None


def _only_load(view, node: torch.fx.Node):
    """The one tensor ``node``'s lowered value reads, or ``None``."""
    loads = {v.source for v in _values(view.lowered[node]) if v.op == "load"}
    return next(iter(loads)) if len(loads) == 1 else None


def _q_prologue(view, scores: torch.fx.Node) -> list[torch.fx.Node]:
    """Pointwise ops that make the product's left operand from one tensor (``q * scale``),
    used by nothing else: they run on q's tile, loaded once per program."""
    steps: list[torch.fx.Node] = []
    current = product(view, scores).args[0].source
    while len(steps) < MAX_Q_STEPS and _is_pointwise(view, current) and len(current.users) == 1:
        source = _only_load(view, current)
        if not isinstance(source, torch.fx.Node) or tensor_meta(source) is None:
            break
        if tuple(tensor_meta(source).shape) != tuple(tensor_meta(current).shape):
            break
        steps.insert(0, current)
        current = source
    return steps


def written_out_chain(view, softmax: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """The written-out attention around ``softmax``, in graph order, or ``None``."""
    if softmax_dim(softmax, view.gm) is None or softmax not in view.lowered:
        return None
    inputs = [a for a in softmax.all_input_nodes]
    if len(inputs) != 1:
        return None
    back = _back_to_product(view, inputs[0])
    forward = _forward_to_product(view, softmax)
    if back is None or forward is None:
        return None
    nodes = _q_prologue(view, back[0]) + back + [softmax] + forward
    return sorted(dict.fromkeys(nodes), key=view.order.__getitem__)


def find_attention(view) -> list[list[torch.fx.Node]]:
    """Every SDPA node, and every written-out chain (propose)."""
    found = []
    for node in view.nodes:
        if is_sdpa(view, node):
            found.append([node])
        elif softmax_dim(node, view.gm) is not None:
            chain = written_out_chain(view, node)
            if chain is not None:
                found.append(chain)
    return found


# ---------------------------------------------------------------------------
# Reading a group (compose)
# ---------------------------------------------------------------------------


def compose_attention(view, nodes: list[torch.fx.Node]) -> AttentionProgram:
    """The strategy's ``compose``: one SDPA node or one written-out chain."""
    names = {n: view.lowering_of[n].name for n in nodes if n in view.lowering_of}
    base = program_from_nodes(nodes, names)
    index = {t.source: k for k, t in enumerate(base.inputs)}
    if len(nodes) == 1 and is_sdpa(view, nodes[0]):
        layout, base.summary = _read_sdpa(nodes[0], index)
    else:
        layout, base.summary = _read_written_out(view, nodes, index)
    read = {op.index for op in (layout.q, layout.k, layout.v, layout.mask, *layout.tiles.values()) if op is not None}
    for k, tensor in enumerate(base.inputs):
        tensor.read = k in read  # e.g. the tensor a ``type_as`` takes only for its dtype
    if layout.qk_dtype is None or layout.pv_dtype is None:
        base.products_precision = layout.precision  # an fp32 product: "tf32" loosens the check
    return AttentionProgram(**{name: getattr(base, name) for name in base.__dataclass_fields__}, attention=layout)


def _check_fits(what: str, shape, domain) -> None:
    pad = len(domain) - len(shape)
    if pad < 0 or any(s not in (1, d) for s, d in zip(shape, domain[pad:])):
        raise GroupRefused("shape_mismatch", f"{what} {list(shape)} does not broadcast to {list(domain)}")


def _operand(what: str, tensor_meta_, index: int, batch, rows_dim: int, cols_dim: int, rows: int, cols: int) -> Operand:
    """A tensor read as a [rows, cols] matrix per batch entry (``rows_dim``/``cols_dim``: -1 or -2)."""
    shape, stride = tuple(tensor_meta_.shape), tuple(tensor_meta_.stride)
    matrix = {rows_dim: rows, cols_dim: cols}
    _check_fits(what, shape, tuple(batch) + (matrix[-2], matrix[-1]))
    strides = domain_strides(shape, stride, tuple(batch) + (matrix[-2], matrix[-1]))
    return Operand(index, tensor_meta_.dtype, tuple(strides[:-2]), strides[rows_dim], strides[cols_dim])


def _operand_dtype(dtype: torch.dtype, what: str) -> Optional[torch.dtype]:
    if dtype in ROUNDED:
        return dtype
    if dtype != torch.float32:
        raise GroupRefused("unsupported_dtype", f"{what} in {dtype}")
    return None


def _head_widths(d: int, dv: int) -> None:
    if max(d, dv) > MAX_HEAD_WIDTH:
        raise GroupRefused(
            "head_too_wide", f"head widths {d} and {dv}: the kernel keeps at most {MAX_HEAD_WIDTH} in registers"
        )


def _read_sdpa(node: torch.fx.Node, index: dict):
    """The layout of an SDPA node, and the report's sentence on it."""
    a = sdpa_arguments(*node.args, **node.kwargs)
    q, k, v, mask = (tensor_meta(a[name]) for name in ("query", "key", "value", "attn_mask"))
    out = tensor_meta(node)
    batch = tuple(out.shape[:-2])
    n, d = q.shape[-2], q.shape[-1]
    m, dv = k.shape[-2], v.shape[-1]
    _head_widths(d, dv)
    dtype = _operand_dtype(out.dtype, "attention")  # under autocast the node's dtype, not q's
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(d)
    layout = AttentionLayout(
        form="sdpa",
        batch=batch,
        n=n,
        m=m,
        d=d,
        dv=dv,
        q=_operand("query", q, index[a["query"]], batch, -2, -1, n, d),
        k=_operand("key", k, index[a["key"]], batch, -2, -1, m, d),
        v=_operand("value", v, index[a["value"]], batch, -2, -1, m, dv),
        out=_operand("output", out, 0, batch, -2, -1, n, dv),
        qk_dtype=dtype,
        pv_dtype=dtype,
        precision=fp32_precision(),
        scale=float(scale),
        mask=None if mask is None else _operand("attn_mask", mask, index[a["attn_mask"]], batch, -2, -1, n, m),
        causal=a["is_causal"],
        empty_rows_zero=True,
    )
    kind = "no mask" if mask is None else "bool mask" if mask.dtype == torch.bool else "additive mask"
    if node.target is flash_attention:  # written_out.py's rewrite of the user's chain
        summary = (
            f"form softmax (written out): softmax(q @ k^T * {float(scale):.4g}) @ v, as one "
            "flash_attention call (whose backward is this plugin's flash kernels), as one online-softmax "
            f"kernel over {n} queries x {m} "
            f"keys per head, head width {d}; the scores never reach memory"
        )
        return layout, summary
    summary = (
        f"form softmax (sdpa): scaled_dot_product_attention "
        f"({kind}{', causal' if a['is_causal'] else ''}) as one "
        f"online-softmax kernel over {n} queries x {m} keys per head, head width {d}; the scores never "
        "reach memory"
    )
    return layout, summary


def _roles(view, nodes: list[torch.fx.Node]):
    """(prologue, scores product, score steps, softmax, identities, output product) of a chain."""
    softmaxes = [n for n in nodes if softmax_dim(n, view.gm) is not None]
    for softmax in softmaxes:
        chain = written_out_chain(view, softmax)
        if chain is not None and set(chain) == set(nodes):
            back = _back_to_product(view, softmax.all_input_nodes[0])
            forward = _forward_to_product(view, softmax)
            return _q_prologue(view, back[0]), back[0], back[1:], softmax, forward[:-1], forward[-1]
    raise GroupRefused("not_attention", "the nodes are not one softmax attention chain")


def _read_written_out(view, nodes: list[torch.fx.Node], index: dict):
    prologue, scores, steps, softmax, identities, output = _roles(view, nodes)
    members = set(nodes)
    roles = {
        **{n: "q's prologue" for n in prologue},
        scores: "the scores",
        **{n: "the scores" for n in steps},
        softmax: "the softmax",
        **{n: "the probabilities" for n in identities},
    }
    for node, role in roles.items():
        outside = [u.name for u in node.users if u not in members]
        if outside:
            raise GroupRefused(
                "scores_used_elsewhere",
                f"{node.name} ({role}) is also used by {', '.join(outside)}: the N x M matrix has to be written "
                "for it, so this attention stays as ordinary groups",
            )

    scores_meta, out_meta = tensor_meta(scores), tensor_meta(output)
    rank = len(scores_meta.shape)
    dim = softmax_dim(softmax, view.gm)
    if dim == "?" or not -rank <= dim < rank or dim % rank != rank - 1:
        raise GroupRefused(
            "softmax_not_over_keys", f"{softmax.name} normalises over dim {dim}, not over the keys (the last dim)"
        )
    qk, pv = product(view, scores), product(view, output)
    batch = tuple(out_meta.shape[:-2])
    n, m = scores_meta.shape[-2:]
    if tuple(scores_meta.shape[:-2]) != batch:
        raise GroupRefused(
            "broadcast_batch",
            f"the scores' batch dims {list(scores_meta.shape[:-2])} differ from the output's {list(batch)}",
        )
    a_source = _only_load(view, prologue[0]) if prologue else qk.args[0].source
    for name, source in (("q", a_source), ("k", qk.args[1].source), ("v", pv.args[1].source)):
        if source in members or source not in index:
            raise GroupRefused("not_attention", f"{name} ({source.name}) is computed inside the chain")
    q_meta, k_meta, v_meta = (tensor_meta(s) for s in (a_source, qk.args[1].source, pv.args[1].source))
    d, dv = qk.args[0].shape[-1], out_meta.shape[-1]
    _head_widths(d, dv)
    for meta in (q_meta, k_meta, v_meta):
        _operand_dtype(meta.dtype, "an operand")

    layout = AttentionLayout(
        form="written_out",
        batch=batch,
        n=n,
        m=m,
        d=d,
        dv=dv,
        q=_operand("q", q_meta, index[a_source], batch, -2, -1, n, d),
        k=_operand("k", k_meta, index[qk.args[1].source], batch, *((-2, -1) if qk.transpose_b else (-1, -2)), m, d),
        v=_operand("v", v_meta, index[pv.args[1].source], batch, *((-1, -2) if pv.transpose_b else (-2, -1)), m, dv),
        out=_operand("output", out_meta, 0, batch, -2, -1, n, dv),
        qk_dtype=_operand_dtype(scores_meta.dtype, "the scores product"),
        pv_dtype=_operand_dtype(out_meta.dtype, "the output product"),
        precision=fp32_precision(),
        scores_dtype=scores_meta.dtype,
    )
    layout.q_steps = steps_after(view, a_source, prologue)
    layout.score_steps = score_steps(view, layout, scores, steps, index)
    ops = " -> ".join(view.lowering_of[n].name.rsplit(".", 1)[-1] for n in nodes)
    summary = (
        f"form softmax (written out): softmax attention ({ops}) as one online-softmax kernel "
        f"over {n} queries x {m} "
        f"keys per head, head width {d}; the scores never reach memory"
    )
    return layout, summary


def _step(view, node, previous, index, tiles) -> Step:
    """``node`` as a step on the tile made by ``previous``; other tensors it reads become [N, M] tiles."""
    value = view.lowered[node]
    meta = tensor_meta(node)
    if meta.dtype not in FLOATS:
        raise GroupRefused("unsupported_dtype", f"{node.name} produces {meta.dtype}")
    for v in _values(value):
        if v.op not in ("load", "const", "pointwise"):
            raise GroupRefused("not_pointwise", f"{node.name} is not a pointwise op on the scores")
        if v.op != "load" or v.source is previous:
            continue
        if isinstance(v.source, AttrRef) or tiles is None:
            raise GroupRefused(
                "unsupported_argument",
                f"{node.name} reads {getattr(v.source, 'path', v.source)}, "
                "which the attention kernel can't read per tile",
            )
        batch, n, m, table = tiles
        if v.source not in index:
            raise GroupRefused(
                "not_attention",
                f"{node.name} reads {v.source.name}, an earlier value of the chain: "
                "only the one before it can be read per tile",
            )
        if v.source not in table:
            table[v.source] = _operand(
                f"{v.source.name} (read by {node.name})", tensor_meta(v.source), index[v.source], batch, -2, -1, n, m
            )
    return Step(node, value, meta.dtype)


def steps_after(view, first: torch.fx.Node, nodes, index=None, tiles=None) -> list[Step]:
    """``nodes`` as steps, each on the tile made by the one before it (the first on ``first``'s)."""
    steps, previous = [], first
    for node in nodes:
        steps.append(_step(view, node, previous, index or {}, tiles))
        previous = node
    return steps


def score_steps(view, layout: AttentionLayout, scores: torch.fx.Node, steps, index) -> list[Step]:
    """The steps on the scores; tensors they read become [N, M] tiles (``layout.tiles``)."""
    shape = tuple(tensor_meta(scores).shape)
    for node in steps:
        if tuple(tensor_meta(node).shape) != shape:
            raise GroupRefused(
                "shape_mismatch", f"{node.name} broadcasts the scores to {list(tensor_meta(node).shape)}"
            )
    return steps_after(view, scores, steps, index, (layout.batch, layout.n, layout.m, layout.tiles))
