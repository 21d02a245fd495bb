"""Finding linear attention - no softmax - and reading it into a
``LinearAttentionLayout`` (or an ``AttentionLayout`` of form "fourier").

Two forms, as neural operators write them (Cao, "Choose a Transformer:
Fourier or Galerkin", 2021):

1. Galerkin-type, ``q @ (k^T @ v) / n``::

       k' = layer_norm(k)       optional, over the head width, used only here (same for v)
       c  = k'^T @ v'           einsum ``bhnd,bhne->bhde`` (lowered as an extern op), or a
                                product whose left operand is a k^T view
       c  = steps(c)            ops by constants only (``/ n``)
       o  = q @ c
       o  = steps(o)            ops by constants only

   The context ``c`` is d x dv per head: the chain sums it over the points in
   splits and then applies it to every query (``linear_kernel.py``).

2. Fourier-type, ``(q @ k^T) @ v / n``: a product ``s = q @ k^T`` (k^T a
   transposed view or an einsum that transposes), pointwise steps on ``s``,
   no softmax, ``o = s @ v``, then ops by constants on ``o``. Computed as
   written by default: the online kernel of softmax attention without the
   softmax, so the N x M scores never reach memory but the cost stays
   quadratic. With ``fuse(..., reassociate_products=True)``, and when every
   step is a multiplication or division by a constant, it becomes the
   Galerkin chain ``q @ (k^T @ v)``: linear in N, with other rounding.

Every intermediate must be used only inside the chain; otherwise the group is
refused with the name of the outside user.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from autofuser import GroupRefused, KernelTensor, program_from_nodes
from autofuser.kernel import AttrRef, attr_tensor, fp32_precision, tensor_meta

from .layout import AttentionLayout, AttentionProgram, LinearAttentionLayout, RowNorm
from .match import (
    MAX_SCORE_STEPS,
    _head_widths,
    _is_pointwise,
    _operand,
    _operand_dtype,
    _values,
    product,
    score_steps,
    steps_after,
)

#: Ops on a chain value by constants that the walks pass through.
MAX_CONSTANT_STEPS = 4
#: Targets that scale by a constant (and so commute with a product, for reassociation).
SCALING = (operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div", "__mul__", "__truediv__")


def _einsum_parts(node: torch.fx.Node):
    """(equation, operands) of an einsum node, or ``None``."""
    if node.op != "call_function" or node.target is not torch.einsum or not node.args:
        return None
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(node.args[0], str) or len(operands) != 2:
        return None
    return node.args[0].replace(" ", ""), operands


def transposed_a_einsum(view, node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, bool]]:
    """``(a, b, swapped)`` for an einsum lowered as extern that computes ``a^T @ b``
    (``swapped``: its output is ``(a^T @ b)^T``), else ``None``."""
    value = view.lowered.get(node)
    parts = _einsum_parts(node)
    if value is None or value.op != "extern" or parts is None:
        return None
    equation, (a, b) = parts
    if not all(isinstance(t, torch.fx.Node) for t in (a, b)):
        return None
    lhs, out = equation.split("->")
    ea, eb = lhs.split(",")
    if ea[-2] != eb[-2] or out[-2:] not in (ea[-1] + eb[-1], eb[-1] + ea[-1]):
        return None
    return a, b, out[-2:] != ea[-1] + eb[-1]


def _context(view, node: torch.fx.Node):
    """How ``node`` computes ``k^T @ v``: ``(k, k_dims, v, v_dims)`` with the dims
    (rows, cols) each is read along as [points, width], or ``None``."""
    found = transposed_a_einsum(view, node)
    if found is not None:
        a, b, swapped = found
        return None if swapped else (a, (-2, -1), b, (-2, -1))
    dot = product(view, node)
    if dot is None or not _is_transposed_view(dot.args[0].source):  # k^T marks the context
        return None
    return (dot.args[0].source, (-1, -2), dot.args[1].source, (-1, -2) if dot.transpose_b else (-2, -1))


def _constant_step(view, node: torch.fx.Node, previous: torch.fx.Node) -> bool:
    """Is ``node`` a pointwise op on ``previous`` and constants only, of its shape?"""
    if not _is_pointwise(view, node):
        return False
    loads = [v for v in _values(view.lowered[node]) if v.op == "load"]
    if not loads or any(v.source is not previous for v in loads):
        return False
    meta, prev = tensor_meta(node), tensor_meta(previous)
    return meta is not None and prev is not None and tuple(meta.shape) == tuple(prev.shape)


def _constant_steps_back(view, node: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """Walk back from ``node`` through constant steps: (steps in order, the first value)."""
    steps: list[torch.fx.Node] = []
    current = node
    while len(steps) < MAX_CONSTANT_STEPS and _is_pointwise(view, current):
        inputs = current.all_input_nodes
        if len(inputs) != 1 or not _constant_step(view, current, inputs[0]):
            break
        steps.insert(0, current)
        current = inputs[0]
    return steps, current


def _constant_steps_forward(view, node: torch.fx.Node) -> list[torch.fx.Node]:
    steps: list[torch.fx.Node] = []
    current = node
    while len(steps) < MAX_CONSTANT_STEPS and len(current.users) == 1:
        user = next(iter(current.users))
        if not _constant_step(view, user, current):
            break
        steps.append(user)
        current = user
    return steps


def layer_norm_of(view, node: torch.fx.Node, width: int):
    """``(input, eps, weight, bias)`` if ``node`` is a layer norm over its last dim
    of size ``width`` (weight/bias: ``AttrRef``, an fx node or ``None``), else ``None``."""
    if node not in view.lowered:
        return None
    if node.op == "call_module":
        module = view.gm.get_submodule(node.target)
        if type(module) is not torch.nn.LayerNorm or tuple(module.normalized_shape) != (width,):
            return None
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], torch.fx.Node):
            return None
        weight = AttrRef(f"{node.target}.weight") if module.weight is not None else None
        bias = AttrRef(f"{node.target}.bias") if module.bias is not None else None
        return node.args[0], float(module.eps), weight, bias
    if node.op == "call_function" and node.target in (F.layer_norm, torch.layer_norm):
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        if set(bound) - set(names) or not isinstance(bound.get("input"), torch.fx.Node):
            return None
        shape = bound.get("normalized_shape")
        if not isinstance(shape, (list, tuple, torch.Size)) or tuple(shape) != (width,):
            return None
        eps = bound.get("eps", 1e-5)
        if not isinstance(eps, (int, float)):
            return None
        affine = [bound.get(k) for k in ("weight", "bias")]
        if any(a is not None and not isinstance(a, torch.fx.Node) for a in affine):
            return None
        return bound["input"], float(eps), *affine
    return None


# ---------------------------------------------------------------------------
# Walking the graph (propose)
# ---------------------------------------------------------------------------


def _through_transpose(view, source: torch.fx.Node, dims, user: torch.fx.Node):
    """``(x, (-2, -1), [view])`` when ``source`` is ``x.transpose(-2, -1)`` used only by
    ``user`` (lowered as an extern view, so it can join the chain), else as given."""
    value = view.lowered.get(source)
    if (
        dims == (-1, -2)
        and value is not None
        and value.op == "extern"
        and _is_transposed_view(source)
        and set(source.users) == {user}
    ):
        return source.args[0], (-2, -1), [source]
    return source, dims, []


def _norm_feeding(view, source: torch.fx.Node, dims, user: torch.fx.Node) -> list[torch.fx.Node]:
    """The layer norm over the head width (and the k^T view after it) feeding only ``user``, if any."""
    source, dims, views = _through_transpose(view, source, dims, user)
    meta = tensor_meta(source)
    if dims != (-2, -1) or meta is None or len(meta.shape) < 2 or set(source.users) != {(views or [user])[0]}:
        return []
    return [source] + views if layer_norm_of(view, source, meta.shape[-1]) is not None else []


def galerkin_chain(view, output: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """The Galerkin chain whose ``q @ context`` is ``output``, in graph order, or ``None``."""
    dot = product(view, output)
    if dot is None or dot.transpose_b:
        return None
    steps, context = _constant_steps_back(view, dot.args[1].source)
    found = _context(view, context)
    if found is None or (steps and set(context.users) != {steps[0]}) or context is dot.args[0].source:
        return None
    k, k_dims, v, v_dims = found
    norms = _norm_feeding(view, k, k_dims, context) + _norm_feeding(view, v, v_dims, context)
    nodes = norms + [context] + steps + [output] + _constant_steps_forward(view, output)
    return sorted(dict.fromkeys(nodes), key=view.order.__getitem__)


def _is_transposed_view(node: torch.fx.Node) -> bool:
    """``x.transpose(-2, -1)``, ``x.mT`` or a permute swapping the last two dims."""
    meta = tensor_meta(node)
    if meta is None or len(meta.shape) < 2:
        return False
    rank = len(meta.shape)
    if (
        node.op == "call_method"
        and node.target in ("transpose", "swapaxes")
        or (node.op == "call_function" and node.target in (torch.transpose, torch.swapaxes))
    ):
        dims = sorted(d % rank for d in node.args[1:3] if isinstance(d, int))
        return dims == [rank - 2, rank - 1]
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("mT",):
        return True
    return False


def fourier_chain(view, output: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """``[q @ k^T, steps..., (that) @ v, steps...]`` with no softmax, or ``None``."""
    from .match import _back_to_product

    dot = product(view, output)
    if dot is None:
        return None
    back = _back_to_product(view, dot.args[0].source, MAX_SCORE_STEPS)
    if back is None:
        return None
    scores = product(view, back[0])
    if scores is None or not (scores.transpose_b or _is_transposed_view(scores.args[1].source)):
        return None
    if any(softmax_like(n) for n in back):
        return None
    nodes = back + [output] + _constant_steps_forward(view, output)
    return sorted(dict.fromkeys(nodes), key=view.order.__getitem__)


def softmax_like(node: torch.fx.Node) -> bool:
    from .match import SOFTMAX_FUNCTIONS

    return (node.op == "call_method" and node.target in ("softmax", "log_softmax")) or (
        node.op == "call_function" and node.target in SOFTMAX_FUNCTIONS
    )


def find_linear_attention(view) -> list[list[torch.fx.Node]]:
    """Every Galerkin chain and every Fourier chain (propose)."""
    found = []
    for node in view.nodes:
        if product(view, node) is None:
            continue
        chain = galerkin_chain(view, node) or fourier_chain(view, node)
        if chain is not None:
            found.append(chain)
    return found


# ---------------------------------------------------------------------------
# Reading a group (compose)
# ---------------------------------------------------------------------------


def check_private(nodes: list[torch.fx.Node], last: torch.fx.Node, what: str) -> None:
    members = set(nodes)
    for node in nodes:
        if node is last:
            continue
        outside = [u.name for u in node.users if u not in members]
        if outside:
            raise GroupRefused(
                "intermediate_used_elsewhere",
                f"{node.name} ({what}) is also used by {', '.join(outside)}: it has to be written "
                "for it, so this chain stays as ordinary groups",
            )


def _with_norm_params(view, base, nodes) -> dict:
    """Add the layer norms' parameters as kernel inputs; the index of every input by source."""
    for node in nodes:
        meta = tensor_meta(node)
        found = layer_norm_of(view, node, meta.shape[-1]) if meta is not None else None
        if found is None:
            continue
        for param in found[2:]:
            if isinstance(param, AttrRef):
                tensor = attr_tensor(view.gm, param.path)
                base.inputs.append(KernelTensor(param, tuple(tensor.shape), tensor.dtype, tuple(tensor.stride())))
    return {t.source: k for k, t in enumerate(base.inputs)}


def _row_norm(view, node: Optional[torch.fx.Node], width: int, index: dict) -> Optional[RowNorm]:
    if node is None:
        return None
    source, eps, weight, bias = layer_norm_of(view, node, width)
    for what, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            meta = attr_tensor(view.gm, param.path) if isinstance(param, AttrRef) else tensor_meta(param)
            if tuple(meta.shape) != (width,) or meta.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise GroupRefused("unsupported_argument", f"{node.name}'s {what} is not a float vector of {width}")
    return RowNorm(
        node,
        eps,
        tensor_meta(node).dtype,
        None if weight is None else index[weight],
        None if bias is None else index[bias],
    )


def compose_linear_attention(view, nodes: list[torch.fx.Node]) -> AttentionProgram:
    """The ``linear_attention`` strategy's compose: a Galerkin chain or a Fourier chain."""
    names = {n: view.lowering_of[n].name for n in nodes if n in view.lowering_of}
    output = next((n for n in reversed(nodes) if product(view, n) is not None), None)
    if output is not None and galerkin_chain(view, output) == nodes:
        base = program_from_nodes(nodes, names)
        index = _with_norm_params(view, base, nodes)
        layout, base.summary = _read_galerkin(view, nodes, output, index)
        program = AttentionProgram(**{f: getattr(base, f) for f in base.__dataclass_fields__}, linear=layout)
    elif output is not None and fourier_chain(view, output) == nodes:
        base = program_from_nodes(nodes, names)
        index = {t.source: k for k, t in enumerate(base.inputs)}
        layout, base.summary = _read_fourier(view, nodes, output, index)
        field = "linear" if isinstance(layout, LinearAttentionLayout) else "attention"
        program = AttentionProgram(**{f: getattr(base, f) for f in base.__dataclass_fields__}, **{field: layout})
    else:
        raise GroupRefused("not_attention", "the nodes are not one linear attention chain")
    if program.linear is not None:
        fp32_products = torch.float32 in (program.linear.ctx_dtype, program.linear.out_dtype)
    else:
        fp32_products = None in (program.attention.qk_dtype, program.attention.pv_dtype)
    if fp32_products:  # "tf32" loosens the check against eager
        program.products_precision = (program.linear or program.attention).precision
    return program


def _linear_layout(
    view,
    form,
    q_node,
    k_node,
    k_dims,
    v_node,
    v_dims,
    context,
    output,
    ctx_steps,
    out_steps,
    index,
    k_norm=None,
    v_norm=None,
) -> LinearAttentionLayout:
    out_meta, ctx_meta = tensor_meta(out_steps[-1] if out_steps else output), tensor_meta(context)
    batch = tuple(out_meta.shape[:-2])
    n, dv = out_meta.shape[-2:]
    d = tensor_meta(q_node).shape[-1]
    k_meta = tensor_meta(k_node)
    m = k_meta.shape[k_dims[0]]
    _head_widths(d, dv)
    for what, node in (("q", q_node), ("k", k_node), ("v", v_node)):
        if node not in index:
            raise GroupRefused("not_attention", f"{what} ({node.name}) is computed inside the chain")
        _operand_dtype(tensor_meta(node).dtype, what)
    if tuple(ctx_meta.shape[:-2]) != batch:
        raise GroupRefused(
            "broadcast_batch",
            f"the context's batch dims {list(ctx_meta.shape[:-2])} differ from the output's {list(batch)}",
        )
    layout = LinearAttentionLayout(
        form=form,
        batch=batch,
        n=n,
        m=m,
        d=d,
        dv=dv,
        q=_operand("q", tensor_meta(q_node), index[q_node], batch, -2, -1, n, d),
        k=_operand("k", k_meta, index[k_node], batch, *k_dims, m, d),
        v=_operand("v", tensor_meta(v_node), index[v_node], batch, *v_dims, m, dv),
        out=_operand("output", out_meta, 0, batch, -2, -1, n, dv),
        ctx_dtype=ctx_meta.dtype,
        out_dtype=tensor_meta(output).dtype,
        precision=fp32_precision(),
        k_norm=k_norm,
        v_norm=v_norm,
    )
    for dtype, what in ((layout.ctx_dtype, "the context product"), (layout.out_dtype, "the output product")):
        _operand_dtype(dtype, what)
    layout.ctx_steps = steps_after(view, context, ctx_steps)
    layout.out_steps = steps_after(view, output, out_steps)
    return layout


def _read_galerkin(view, nodes, output, index):
    check_private(nodes, nodes[-1], "an intermediate of the linear attention")
    dot = product(view, output)
    ctx_steps, context = _constant_steps_back(view, dot.args[1].source)
    out_steps = nodes[nodes.index(output) + 1 :]
    k, k_dims, v, v_dims = _context(view, context)
    norms = {}
    for name, source, dims in (("k", k, k_dims), ("v", v, v_dims)):
        if source in nodes and view.lowered[source].op == "extern":  # a k^T view of a layer norm's result
            source, dims, _ = _through_transpose(view, source, dims, context)
        norms[name + "_dims"] = dims
        if source in nodes:
            width = tensor_meta(source).shape[-1]
            norms[name] = _row_norm(view, source, width, index)
            source = layer_norm_of(view, source, width)[0]
        norms[name + "_node"] = source
    layout = _linear_layout(
        view,
        "galerkin",
        dot.args[0].source,
        norms["k_node"],
        norms["k_dims"],
        norms["v_node"],
        norms["v_dims"],
        context,
        output,
        ctx_steps,
        out_steps,
        index,
        norms.get("k"),
        norms.get("v"),
    )
    fused = [f"layer norm on {w}" for w in ("k", "v") if norms.get(w)]
    summary = (
        f"form galerkin: q @ (k^T @ v){' with ' + ' and '.join(fused) if fused else ''} as a chain of three "
        f"kernels (k^T @ v summed over {layout.m} points in splits, then applied to {layout.n} queries), "
        f"head width {layout.d}; linear in the points"
    )
    return layout, summary


def _read_fourier(view, nodes, output, index):
    from .match import _back_to_product

    check_private(nodes, nodes[-1], "an intermediate of the linear attention")
    pv = product(view, output)
    back = _back_to_product(view, pv.args[0].source, MAX_SCORE_STEPS)
    scores, steps = back[0], back[1:]
    out_steps = nodes[nodes.index(output) + 1 :]
    qk = product(view, scores)
    k_node = qk.args[1].source
    options = getattr(view, "options", None)
    reassociate = bool(getattr(options, "reassociate_products", False))
    scaling = all(_constant_step(view, s, p) and s.target in SCALING for s, p in zip(steps, [scores] + steps))
    if reassociate and scaling:
        k_dims = (-2, -1) if qk.transpose_b else (-1, -2)
        v_dims = (-1, -2) if pv.transpose_b else (-2, -1)
        layout = _linear_layout(
            view,
            "fourier",
            qk.args[0].source,
            k_node,
            k_dims,
            pv.args[1].source,
            v_dims,
            scores,
            output,
            steps,
            out_steps,
            index,
        )
        layout.ctx_dtype = tensor_meta(scores).dtype
        summary = (
            f"form fourier: (q @ k^T) @ v reassociated as q @ (k^T @ v) (reassociate_products=True) as a "
            f"chain of three kernels over {layout.m} points, head width {layout.d}; linear in the points"
        )
        return layout, summary
    layout = _fourier_as_written(view, scores, steps, output, out_steps, index)
    why = (
        "reassociate_products=True would make it linear"
        if scaling
        else "its score steps are not all scalings by constants, so it can't be reassociated"
    )
    summary = (
        f"form fourier: (q @ k^T) @ v as written, one kernel over {layout.n} queries x {layout.m} keys "
        f"per head, head width {layout.d}; the scores never reach memory ({why})"
    )
    return layout, summary


def _fourier_as_written(view, scores, steps, output, out_steps, index) -> AttentionLayout:
    qk, pv = product(view, scores), product(view, output)
    scores_meta = tensor_meta(scores)
    out_meta = tensor_meta(out_steps[-1] if out_steps else output)
    batch = tuple(out_meta.shape[:-2])
    n, m = scores_meta.shape[-2:]
    if tuple(scores_meta.shape[:-2]) != batch:
        raise GroupRefused(
            "broadcast_batch",
            f"the scores' batch dims {list(scores_meta.shape[:-2])} differ from the output's {list(batch)}",
        )
    q_node, k_node, v_node = qk.args[0].source, qk.args[1].source, pv.args[1].source
    for what, node in (("q", q_node), ("k", k_node), ("v", v_node)):
        if node not in index:
            raise GroupRefused("not_attention", f"{what} ({node.name}) is computed inside the chain")
        _operand_dtype(tensor_meta(node).dtype, what)
    d, dv = qk.args[0].shape[-1], out_meta.shape[-1]
    _head_widths(d, dv)
    layout = AttentionLayout(
        form="fourier",
        batch=batch,
        n=n,
        m=m,
        d=d,
        dv=dv,
        q=_operand("q", tensor_meta(q_node), index[q_node], batch, -2, -1, n, d),
        k=_operand("k", tensor_meta(k_node), index[k_node], batch, *((-2, -1) if qk.transpose_b else (-1, -2)), m, d),
        v=_operand("v", tensor_meta(v_node), index[v_node], batch, *((-1, -2) if pv.transpose_b else (-2, -1)), m, dv),
        out=_operand("output", out_meta, 0, batch, -2, -1, n, dv),
        qk_dtype=_operand_dtype(scores_meta.dtype, "the scores product"),
        pv_dtype=_operand_dtype(tensor_meta(output).dtype, "the output product"),
        precision=fp32_precision(),
        scores_dtype=scores_meta.dtype,
    )
    layout.score_steps = score_steps(view, layout, scores, steps, index)
    layout.out_steps = steps_after(view, output, out_steps)
    return layout
