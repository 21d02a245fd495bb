"""Finding slice ("physics") attention as Transolver writes it, and reading it
into a ``SliceLayout`` (or refusing it with a reason)::

    w  = softmax(steps(to_slice(x)), -1)     nn.Linear over the head width, then pointwise
                                             steps (``/ temperature``), softmax over slices
    s  = w.sum(dim=-2)                       the weights' sum over the points
    a  = einsum(fx, w)                       w^T @ fx: ``bhnd,bhng->bhgd`` (or w first)
    t  = a / steps(s[..., None])             ``+ eps`` and the view, by constants only
    q, k, v = to_q(t), to_k(t), to_v(t)      nn.Linear maps of the tokens
    t' = softmax(q @ k^T * scale) @ v        written-out softmax attention among the slices
    o  = w @ t'                              ``einsum('bhgd,bhng->bhnd', t', w)`` or a matmul

``w`` must be used by exactly the sum, the aggregation and the scatter, and
every other intermediate only inside the chain. The whole chain becomes three
kernels (``slice_kernel.py``).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx

from autofuser import GroupRefused, KernelTensor, program_from_nodes
from autofuser.kernel import AttrRef, attr_tensor, fp32_precision, tensor_meta

from .layout import AttentionProgram, LinearMap, SliceLayout
from .linear import _constant_step, check_private, transposed_a_einsum
from .match import (
    FLOATS,
    MAX_SCORE_STEPS,
    _is_pointwise,
    _operand,
    _roles,
    _step,
    _values,
    product,
    softmax_dim,
    steps_after,
    written_out_chain,
)

#: Widest slice count and head width the kernels keep in registers.
MAX_SLICES = 128
MAX_WIDTH = 128
DIVISIONS = (operator.truediv, torch.div, torch.true_divide, "div", "__truediv__")


def linear_module(view, node: torch.fx.Node) -> Optional[torch.nn.Linear]:
    if node.op != "call_module" or node not in view.lowered or len(node.args) != 1 or node.kwargs:
        return None
    module = view.gm.get_submodule(node.target)
    return module if type(module) is torch.nn.Linear else None


def _logit_path(view, softmax: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """``[to_slice, step, ...]`` from the slice linear to the softmax's input."""
    path: list[torch.fx.Node] = []
    current = softmax.args[0] if softmax.args and isinstance(softmax.args[0], torch.fx.Node) else None
    while current is not None and len(path) <= MAX_SCORE_STEPS:
        if len(current.users) != 1:
            return None
        path.insert(0, current)
        if linear_module(view, current) is not None:
            return path
        if not _is_pointwise(view, current):
            return None
        previous = [
            a
            for a in current.all_input_nodes
            if a in view.lowered and len(a.users) == 1 and not _from_parameters_only(a)
        ]
        current = previous[0] if len(previous) == 1 else None
    return None


def _from_parameters_only(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether ``node`` is computed from parameters and buffers alone (no input reaches it):
    the authors' ``torch.clamp(self.temperature, min=0.1, max=5)``, a step's operand, not
    the logits' path."""
    if node.op == "get_attr":
        return True
    if node.op == "placeholder" or depth == 0 or not node.all_input_nodes:
        return False
    return all(_from_parameters_only(a, depth - 1) for a in node.all_input_nodes)


def _sum_over_points(view, node: torch.fx.Node, weights: torch.fx.Node) -> bool:
    value = view.lowered.get(node)
    meta = tensor_meta(weights)
    return (
        value is not None
        and value.op == "reduce"
        and value.reduce_op == "sum"
        and meta is not None
        and value.args
        and value.args[0].op == "load"
        and value.args[0].source is weights
        and value.dims == (len(meta.shape) - 2,)
    )


def _denominator_path(view, start: torch.fx.Node, end: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """The single-user nodes from the sum ``start`` to ``end`` (views and steps by constants)."""
    path: list[torch.fx.Node] = []
    current = start
    while current is not end:
        if len(current.users) != 1 or len(path) > 4:
            return None
        user = next(iter(current.users))
        if user is end:
            return path
        value = view.lowered.get(user)
        if value is None or not (
            _is_identity_on_column(view, user, current) or _constant_step_any_shape(view, user, current)
        ):
            return None
        path.append(user)
        current = user
    return path


def _constant_step_any_shape(view, node, previous) -> bool:
    if not _is_pointwise(view, node):
        return False
    loads = [v for v in _values(view.lowered[node]) if v.op == "load"]
    return bool(loads) and all(v.source is previous for v in loads)


def _repeats_a_column(view, node, previous) -> bool:
    """``node`` repeats ``previous`` only along its size-1 dims, in place (the authors'
    ``norm[..., None].repeat(1, 1, 1, d)``): the same values as the broadcast the kernel
    reads the column with anyway."""
    value = view.lowered.get(node)
    shift = value.shift if value is not None and value.op == "shifted" else None
    if shift is None or shift.reshaped or shift.new_dims or shift.fixed_dims or shift.mode != "wrap":
        return False
    if value.args[0].op != "load" or value.args[0].source is not previous:
        return False
    if any(s != 1 for s in shift.scales) or any(o != 0 for o in shift.offsets):
        return False
    before, after = value.args[0].shape, value.shape
    return len(before) == len(after) and all(b == a or b == 1 for b, a in zip(before, after))


def _is_identity_on_column(view, node, previous) -> bool:
    """The views and repeats on the sums: the kernel holds the sums as a column already."""
    return view.lowered[node].op == "extern" or _repeats_a_column(view, node, previous)


def _aggregation(view, weights: torch.fx.Node):
    """(aggregation node, fx node) among the weights' users, or ``None``."""
    for user in weights.users:
        found = transposed_a_einsum(view, user)
        if found is None:
            continue
        a, b, swapped = found
        if a is weights and b is not weights and not swapped:
            return user, b
        if b is weights and a is not weights and swapped:
            return user, a
    return None


def _attention_among_slices(view, mixed: torch.fx.Node):
    """The written-out softmax attention chain whose output is ``mixed``."""
    for node in view.nodes:
        if softmax_dim(node, view.gm) is None:
            continue
        chain = written_out_chain(view, node)
        if chain is not None and chain[-1] is mixed:
            return chain
    return None


def slice_chain(view, scatter: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """Every node of the slice attention whose scatter ``w @ t'`` is ``scatter``, or ``None``."""
    dot = product(view, scatter)
    if dot is None or dot.transpose_b:
        return None
    weights, mixed = dot.args[0].source, dot.args[1].source
    if softmax_dim(weights, view.gm) is None or weights not in view.lowered:
        return None
    logits = _logit_path(view, weights)
    found = _aggregation(view, weights)
    sums = [u for u in weights.users if _sum_over_points(view, u, weights)]
    if logits is None or found is None or len(sums) != 1:
        return None
    aggregation, _ = found
    divisions = [
        u
        for u in aggregation.users
        if u.op in ("call_function", "call_method") and u.target in DIVISIONS and u.args[0] is aggregation
    ]
    if len(divisions) != 1:
        return None
    tokens = divisions[0]
    denominator = tokens.args[1] if len(tokens.args) > 1 and isinstance(tokens.args[1], torch.fx.Node) else None
    path = _denominator_path(view, sums[0], tokens) if denominator is not None else None
    attention = _attention_among_slices(view, mixed)
    if path is None or attention is None:
        return None
    maps = []
    for user in tokens.users:
        if linear_module(view, user) is None:
            return None
        maps.append(user)
    views = [u for m in maps for u in m.users if u in view.lowered and view.lowered[u].op == "extern"]
    nodes = logits + [weights, sums[0]] + path + [aggregation, tokens] + maps + views + attention + [scatter]
    return sorted(dict.fromkeys(nodes), key=view.order.__getitem__)


def find_slice_attention(view) -> list[list[torch.fx.Node]]:
    found = []
    for node in view.nodes:
        if product(view, node) is not None:
            chain = slice_chain(view, node)
            if chain is not None:
                found.append(chain)
    return found


# ---------------------------------------------------------------------------
# Reading a group (compose)
# ---------------------------------------------------------------------------


def _linear_map(view, node: torch.fx.Node, base, index: dict) -> LinearMap:
    module = linear_module(view, node)
    slots = []
    for name in ("weight", "bias"):
        param = getattr(module, name)
        if param is None:
            slots.append(None)
            continue
        ref = AttrRef(f"{node.target}.{name}")
        if ref not in index:
            tensor = attr_tensor(view.gm, ref.path)
            if not tensor.is_contiguous() or tensor.dtype not in FLOATS:
                raise GroupRefused("unsupported_argument", f"{node.target}.{name} is not a contiguous float tensor")
            index[ref] = len(base.inputs)
            base.inputs.append(KernelTensor(ref, tuple(tensor.shape), tensor.dtype, tuple(tensor.stride())))
        slots.append(index[ref])
    return LinearMap(node, slots[0], slots[1], tensor_meta(node).dtype, module.in_features, module.out_features)


def compose_slice_attention(view, nodes: list[torch.fx.Node]) -> AttentionProgram:
    """The ``slice_attention`` strategy's compose."""
    scatter = nodes[-1]
    if slice_chain(view, scatter) != nodes:
        raise GroupRefused("not_attention", "the nodes are not one slice attention chain")
    members = set(nodes)
    check_private(nodes, scatter, "an intermediate of the slice attention")
    names = {n: view.lowering_of[n].name for n in nodes if n in view.lowering_of}
    base = program_from_nodes(nodes, names)
    index = {t.source: k for k, t in enumerate(base.inputs)}

    dot = product(view, scatter)
    weights, mixed = dot.args[0].source, dot.args[1].source
    if softmax_dim(weights, view.gm) not in (-1, len(tensor_meta(weights).shape) - 1):
        raise GroupRefused("softmax_not_over_slices", f"{weights.name} normalises over another dim than the slices")
    logits = _logit_path(view, weights)
    aggregation, fx_node = _aggregation(view, weights)
    sums = next(u for u in weights.users if _sum_over_points(view, u, weights))
    tokens = next(u for u in aggregation.users if u in members and u.target in DIVISIONS)
    path = _denominator_path(view, sums, tokens)
    attention = _attention_among_slices(view, mixed)
    prologue, scores, steps, softmax2, identities, output = _roles(view, attention)
    if prologue or identities:
        raise GroupRefused("not_attention", "ops on q or on the probabilities of the slices' attention are not taken")
    if softmax_dim(softmax2, view.gm) not in (-1, len(tensor_meta(scores).shape) - 1):
        raise GroupRefused("softmax_not_over_keys", f"{softmax2.name} normalises over another dim than the keys")
    qk, pv = product(view, scores), product(view, output)
    q_node, k_node, v_node = qk.args[0].source, qk.args[1].source, pv.args[1].source
    if not qk.transpose_b:  # k^T as a transpose view
        if view.lowered.get(k_node) is None or view.lowered[k_node].op != "extern" or k_node not in members:
            raise GroupRefused("not_attention", f"{k_node.name} is not k^T of a slice token map")
        k_node = k_node.args[0]
    if pv.transpose_b:
        raise GroupRefused("not_attention", "v is read transposed")
    maps = {n: linear_module(view, n) for n in (q_node, k_node, v_node)}
    if any(m is None or n.args[0] is not tokens for n, m in maps.items()):
        raise GroupRefused("not_attention", "q, k and v of the slices' attention are not linear maps of the tokens")
    for node, previous in zip(steps, [scores] + steps):
        if not _constant_step(view, node, previous):
            raise GroupRefused(
                "not_pointwise", f"{node.name}: only scalings by constants are taken on the slices' scores"
            )

    x_node = logits[0].args[0]
    x_meta, fx_meta, w_meta, out_meta = (tensor_meta(n) for n in (x_node, fx_node, weights, scatter))
    batch = tuple(out_meta.shape[:-2])
    n, g = w_meta.shape[-2:]
    dx, df = x_meta.shape[-1], fx_meta.shape[-1]
    if tuple(w_meta.shape[:-2]) != batch or tuple(tensor_meta(mixed).shape[:-2]) != batch:
        raise GroupRefused("broadcast_batch", "the slice weights' or tokens' batch dims differ from the output's")
    for what, node in (("x", x_node), ("fx", fx_node)):
        if node not in index:
            raise GroupRefused("not_attention", f"{what} ({node.name}) is computed inside the chain")
    to_slice = _linear_map(view, logits[0], base, index)
    to_q, to_k, to_v = (_linear_map(view, m, base, index) for m in (q_node, k_node, v_node))
    dq, dv = to_q.width_out, to_v.width_out
    if g > MAX_SLICES or max(dx, df, dq, dv) > MAX_WIDTH:
        raise GroupRefused(
            "too_wide",
            f"{g} slices, head widths {dx}/{df}/{dq}/{dv}: the kernels keep at most "
            f"{MAX_SLICES} slices and widths up to {MAX_WIDTH} in registers",
        )
    layout = SliceLayout(
        batch=batch,
        n=n,
        g=g,
        dx=dx,
        df=df,
        dq=dq,
        dv=dv,
        x=_operand("x", x_meta, index[x_node], batch, -2, -1, n, dx),
        fx=_operand("fx", fx_meta, index[fx_node], batch, -2, -1, n, df),
        out=_operand("output", out_meta, 0, batch, -2, -1, n, dv),
        to_slice=to_slice,
        logit_steps=[],
        logit_tiles={},
        weights_dtype=w_meta.dtype,
        sum_dtype=tensor_meta(sums).dtype,
        sum_steps=[],
        agg_dtype=tensor_meta(aggregation).dtype,
        tokens_dtype=tensor_meta(tokens).dtype,
        to_q=to_q,
        to_k=to_k,
        to_v=to_v,
        scores_dtype=tensor_meta(scores).dtype,
        score_steps=[],
        probs_dtype=tensor_meta(softmax2).dtype,
        mixed_dtype=tensor_meta(mixed).dtype,
        out_dtype=out_meta.dtype,
        precision=fp32_precision(),
    )
    layout.logit_steps = steps_after(view, logits[0], logits[1:], index, (batch, n, g, layout.logit_tiles))
    # The views on the sums are the identity here: the kernel holds the sums as a column already.
    layout.sum_steps = []
    column = sums  # the last node whose values the kernel's column holds
    for node in path:
        if _is_identity_on_column(view, node, column):
            column = node
            continue
        layout.sum_steps.append(_step(view, node, column, {}, None))
        column = node
    layout.score_steps = steps_after(view, scores, steps)
    base.summary = (
        f"form slice: slice attention ({n} points -> {g} slices per head, head width {df}) as a chain "
        "of three kernels: slice weights and aggregation, attention among the slices, scatter back"
    )
    program = AttentionProgram(**{f: getattr(base, f) for f in base.__dataclass_fields__}, slices=layout)
    dtypes = (
        layout.to_slice.dtype,
        layout.agg_dtype,
        layout.to_q.dtype,
        layout.scores_dtype,
        layout.mixed_dtype,
        layout.out_dtype,
    )
    if torch.float32 in dtypes:
        program.products_precision = layout.precision
    for k, tensor in enumerate(program.inputs):
        if (
            isinstance(tensor.source, torch.fx.Node)
            and tensor.source is not x_node
            and tensor.source is not fx_node
            and tensor.source not in layout.logit_tiles
        ):
            tensor.read = False
    return program
