"""einsum equations beyond the matrix-product forms, written as the batched product they are.

An einsum of two operands sorts its letters into four kinds: *batch* letters
(both operands and the output), *row* letters (the first operand and the
output), *column* letters (the second operand and the output) and *contracted*
letters (both operands, not the output). Any such equation is one batched
matrix product, which is how ``torch.einsum`` itself computes it (permute,
reshape, ``bmm``, reshape, permute). ``rewrite_einsums_as_products`` writes
those steps into the graph, so the product is ``torch.matmul`` - which this
plugin's lowering and strategies serve - between views:

1. ``a`` is permuted to ``[batch, rows, contracted]`` and ``b`` to
   ``[batch, contracted, columns]``;
2. several row (column) letters are merged into one matrix dim where that is
   a view of the permuted operand; where it is not, every row (column) letter
   but the last becomes a leading dim of the product, read by the other operand
   through a size-1 dim (broadcast), so nothing is copied; several contracted
   letters are always merged (a copy where the operand's strides don't allow a
   view, as einsum's own reshape copies);
3. ``torch.matmul`` of the two, then a reshape and a permute to the output's
   letters (views of the product's contiguous result).

``bixy,ioxy->boxy`` (FNO's per-mode channel mixing) is the product over modes
``[x, y, b, i] @ [x, y, i, o]``; ``bnij,bjk->bnik`` reads ``b`` as
``[b, 1, j, k]``; ``bhkl,bhxld->bhxkd`` reads ``a`` as ``[b, h, 1, k, l]``.

Left as einsum, with the reason ``lower_einsum`` reports: the matrix-product
forms the lowering takes as they are (and the ``a^T @ b`` forms the attention
plugin folds into its kernels), complex and integer operands (no kernel reads
them: they stay the library's product), ellipses, a letter repeated within an
operand (a diagonal), a letter summed within one operand, and operands of
other than two. The rewritten graph computes the same values (the same
products, summed in another order only where the kernel's order differs,
which verification checks against the original einsum's tolerance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx

from autofuser import annotate_node, broadcast_shapes

from .ops.einsum import parse_matmul_equation, parse_transposed_a_equation

#: Operand dtypes the product kernels read (complex and integer einsums stay the library's).
REAL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ProductForm:
    """How one einsum becomes ``matmul(a_view, b_view)`` followed by a view to the output.

    Each ``*_steps`` is a list of ``("permute", dims)`` / ``("reshape", shape)``
    applied in order; ``out_steps`` turn the product's result into the einsum's.
    """

    a_steps: tuple[tuple[str, tuple[int, ...]], ...]
    b_steps: tuple[tuple[str, tuple[int, ...]], ...]
    out_steps: tuple[tuple[str, tuple[int, ...]], ...]


def split_equation(equation: Any, operand_count: int) -> Union[tuple[str, str, str], str]:
    """``(a, b, out)`` letters of a two-operand equation (the implicit output made
    explicit, as torch does: the letters that occur once, sorted), or why not."""
    if not isinstance(equation, str):
        return "the equation is not a string"
    if operand_count != 2:
        return f"einsum of {operand_count} operands (only two are a matrix product)"
    eq = equation.replace(" ", "")
    if "." in eq:
        return "ellipsis ('...') equations stay eager"
    lhs, out = eq.split("->") if "->" in eq else (eq, None)
    parts = lhs.split(",")
    if len(parts) != 2:
        return "the equation does not name two operands"
    a, b = parts
    if out is None:
        letters = a + b
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if not (a + b + out).isalpha():
        return f"equation {equation!r} has characters other than letters"
    for name, letters in (("first operand", a), ("second operand", b), ("output", out)):
        if len(set(letters)) != len(letters):
            return f"a letter repeated within the {name} (a diagonal) stays eager"
    summed = [c for c in a + b if c not in out and (c in a) != (c in b)]
    if summed:
        return f"letter {summed[0]!r} is summed within one operand (not a product over it)"
    missing = [c for c in out if c not in a and c not in b]
    if missing:
        return f"output letter {missing[0]!r} is in no operand"
    return a, b, out


def _is_view(shape: tuple[int, ...], stride: tuple[int, ...], steps, target: tuple[int, ...]) -> bool:
    """Whether ``steps`` then a reshape to ``target`` are views of a tensor of these strides."""
    t = torch.empty_strided(shape, stride, device="meta")
    for kind, arg in steps:
        t = t.permute(arg) if kind == "permute" else t.reshape(arg)
    try:
        t.view(target)
    except RuntimeError:
        return False
    return True


def product_form(equation: Any, a_meta: Any, b_meta: Any, merge_always: bool = False) -> Union[ProductForm, str]:
    """The ``ProductForm`` of ``torch.einsum(equation, a, b)`` for operands of these
    tensor metadata (shape, stride), or why there is none. ``merge_always``: merge
    several row (column) letters into one matrix dim even where that copies, as
    einsum itself does (its result then has einsum's strides)."""
    split = split_equation(equation, 2)
    if isinstance(split, str):
        return split
    a, b, out = split
    a_shape, b_shape = tuple(a_meta.shape), tuple(b_meta.shape)
    if len(a_shape) != len(a) or len(b_shape) != len(b):
        return "the equation's letters do not match the operands' dims"
    size = {}
    for letters, shape in ((a, a_shape), (b, b_shape)):
        for c, n in zip(letters, shape):
            if c in size and n != size[c] and 1 not in (n, size[c]):
                return f"letter {c!r} has sizes {size[c]} and {n}"
            size[c] = n if c not in size or size[c] == 1 else size[c]
    batch = [c for c in out if c in a and c in b]
    rows = [c for c in out if c in a and c not in b]
    cols = [c for c in out if c in b and c not in a]
    contracted = [c for c in a if c in b and c not in out]
    if any(a_shape[a.index(c)] != b_shape[b.index(c)] for c in contracted):
        return "a contracted letter has different sizes in the two operands (broadcast in a sum)"
    k = math.prod(size[c] for c in contracted)

    def split_lead(own, letters, shape, stride, own_first):
        """Merge every ``own`` letter into the matrix dim where that is a view; else
        all but the last lead (broadcast against the other operand)."""
        order = batch + (own + contracted if own_first else contracted + own)
        permuted = [("permute", tuple(letters.index(c) for c in order))]
        n_own = math.prod(size[c] for c in own)
        merged = [shape[letters.index(c)] for c in batch] + ([n_own, k] if own_first else [k, n_own])
        if len(own) <= 1 or merge_always or _is_view(shape, stride, permuted, tuple(merged)):
            return [], own
        return own[:-1], own[-1:]

    a_lead, a_own = split_lead(rows, a, a_shape, tuple(a_meta.stride), True)
    b_lead, b_own = split_lead(cols, b, b_shape, tuple(b_meta.stride), False)
    # The product's leading dims: batch, a's extra rows, b's extra columns; each operand
    # reads the other's extra dims as size 1.
    m = math.prod(size[c] for c in a_own)
    n = math.prod(size[c] for c in b_own)
    a_batch = [a_shape[a.index(c)] for c in batch]
    b_batch = [b_shape[b.index(c)] for c in batch]
    a_lead_shape = a_batch + [size[c] for c in a_lead] + [1] * len(b_lead)
    b_lead_shape = b_batch + [1] * len(a_lead) + [size[c] for c in b_lead]
    a_steps = [
        ("permute", tuple(a.index(c) for c in batch + a_lead + a_own + contracted)),
        ("reshape", tuple(a_lead_shape + [m, k])),
    ]
    b_steps = [
        ("permute", tuple(b.index(c) for c in batch + b_lead + contracted + b_own)),
        ("reshape", tuple(b_lead_shape + [k, n])),
    ]
    # The product is [batch, a_lead, b_lead, M, N]: split M and N into their letters,
    # then permute to the output's order.
    result_letters = batch + a_lead + b_lead + a_own + b_own
    result_shape = [max(a_shape[a.index(c)], b_shape[b.index(c)]) for c in batch]
    result_shape += [size[c] for c in a_lead + b_lead + a_own + b_own]
    out_steps: list[tuple[str, tuple[int, ...]]] = [("reshape", tuple(result_shape))]
    out_steps.append(("permute", tuple(result_letters.index(c) for c in out)))
    product_shape = tuple(result_shape[: len(batch) + len(a_lead) + len(b_lead)]) + (m, n)
    return ProductForm(
        tuple(_drop_identities(a_steps, a_shape)),
        tuple(_drop_identities(b_steps, b_shape)),
        tuple(_drop_identities(out_steps, product_shape)),
    )


def _drop_identities(steps, shape):
    """The steps without a permute that keeps the order or a reshape to the shape it has."""
    kept, current = [], tuple(shape)
    for kind, arg in steps:
        if kind == "permute":
            if arg == tuple(range(len(arg))):
                continue
            current = tuple(current[d] for d in arg)
        else:
            if arg == current:
                continue
            current = arg
        kept.append((kind, arg))
    return kept


def _meta(node: Any):
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return meta if hasattr(meta, "shape") else None


def _operands(node: torch.fx.Node) -> Optional[tuple[Any, list]]:
    if node.op != "call_function" or node.target is not torch.einsum or node.kwargs or not node.args:
        return None
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return equation, operands


def _apply(value: torch.Tensor, steps) -> list[torch.Tensor]:
    """The meta tensor after each step."""
    out = []
    for kind, arg in steps:
        value = torch.permute(value, arg) if kind == "permute" else torch.reshape(value, arg)
        out.append(value)
    return out


def _insert(graph: torch.fx.Graph, current, steps, values, start: torch.Tensor, origin: torch.fx.Node):
    """Nodes for ``steps`` after ``current`` (whose value is like ``start``), each with its
    metadata and whether it is a view; where the einsum came from (``origin``'s module)
    goes with them, for the report."""
    previous = start
    for (kind, arg), value in zip(steps, values):
        current = graph.call_function(torch.permute if kind == "permute" else torch.reshape, (current, arg))
        annotate_node(current, value, (previous,))
        previous = value
        if "nn_module_stack" in origin.meta:
            current.meta["nn_module_stack"] = origin.meta["nn_module_stack"]
    return current


def _form_with_einsums_layout(equation: str, metas: list, out_meta: Any):
    """The ``ProductForm`` whose result has the einsum's own shape and strides (code
    after it was traced against them: a ``.view`` may need them) and the meta tensors
    along it; ``None`` where neither form gives them. Tried first: the form that
    copies nothing; then the one that merges dims as einsum does."""
    for merge_always in (False, True):
        form = product_form(equation, *metas, merge_always=merge_always)
        if isinstance(form, str):
            return None
        a_value, b_value = (
            torch.empty_strided(tuple(m.shape), tuple(m.stride), dtype=m.dtype, device="meta") for m in metas
        )
        a_chain, b_chain = _apply(a_value, form.a_steps), _apply(b_value, form.b_steps)
        a_last, b_last = a_chain[-1] if a_chain else a_value, b_chain[-1] if b_chain else b_value
        # matmul's result, contiguous, in the einsum's dtype (autocast's, where it runs);
        # built, not computed: a meta matmul would import sympy, seconds of a cold first call
        lead = broadcast_shapes(a_last.shape[:-2], b_last.shape[:-2])
        product = torch.empty((*lead, a_last.shape[-2], b_last.shape[-1]), dtype=out_meta.dtype, device="meta")
        out_chain = _apply(product, form.out_steps)
        result = out_chain[-1] if out_chain else product
        if tuple(result.shape) == tuple(out_meta.shape) and tuple(result.stride()) == tuple(out_meta.stride):
            return form, (a_value, a_chain, b_value, b_chain, product, out_chain)
    return None


def served_as_is(equation: str) -> bool:
    """Forms the einsum lowering takes as they are: a plain product (either operand
    first), or ``a^T @ b``, which the attention plugin folds into its kernels."""
    eq = equation.replace(" ", "")
    if "->" not in eq:
        return False
    lhs, out = eq.split("->")
    swapped = ",".join(reversed(lhs.split(","))) + "->" + out
    return (
        parse_matmul_equation(eq) is not None
        or parse_matmul_equation(swapped) is not None
        or parse_transposed_a_equation(eq)
    )


def rewrite_einsums_as_products(gm: torch.fx.GraphModule) -> int:
    """Write each two-operand real einsum that is no plain matrix product as views
    around ``torch.matmul`` (module docstring); returns how many were rewritten."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        parts = _operands(node)
        if parts is None:
            continue
        equation, operands = parts
        if len(operands) != 2 or not isinstance(equation, str) or served_as_is(equation):
            continue
        metas = [_meta(t) for t in operands]
        out_meta = _meta(node)
        if out_meta is None or any(m is None or m.dtype not in REAL_DTYPES for m in (*metas, out_meta)):
            continue
        found = _form_with_einsums_layout(equation, metas, out_meta)
        if found is None:
            continue
        form, (a_value, a_chain, b_value, b_chain, product, out_chain) = found
        with graph.inserting_before(node):
            a = _insert(graph, operands[0], form.a_steps, a_chain, a_value, node)
            b = _insert(graph, operands[1], form.b_steps, b_chain, b_value, node)
            current = graph.call_function(torch.matmul, (a, b))
            current.meta = dict(node.meta)  # where the einsum came from, for the report
            annotate_node(current, product)
            current = _insert(graph, current, form.out_steps, out_chain, product, node)
        node.replace_all_uses_with(current)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten
