"""einsum equations that are matrix products (``bhnd,bhmd->bhnm``, ``bij,bjk->bik``).

An equation qualifies when, with two operands, its letters split into batch
letters (in both operands and the output, leading, in the same order), one row
letter (first operand and output), one column letter (second operand and
output) and one contracted letter (both operands, not the output), and the
first operand is ``batch, row, contracted``. The second operand may be
``batch, contracted, column`` or ``batch, column, contracted`` (read
transposed through its strides). An equation that is one of these with its
operands swapped (``bhgd,bhng->bhnd``: weights @ tokens) is lowered with them
swapped.

Equations that contract the leading matrix dim of both operands
(``bhnd,bhne->bhde``: ``k^T @ v``, as linear and slice attention write it) have
no plain product in the IR (its ``a`` is read untransposed): they are lowered as
extern ops, which only a strategy with its own compose takes (the attention
plugin's linear and slice attention); anywhere else they run eager. Every other
two-operand equation of real tensors (several batch, row, column or contracted
letters: ``bixy,ioxy->boxy``, ``bnij,bjk->bnik``) was written by this plugin's
graph pass as views around ``torch.matmul`` (``einsum_rewrite.py``) before
lowering; what reaches this lowering then stays eager, with the reason.
"""

from typing import Optional

import torch

from autofuser import PRODUCT_TOLERANCES, LoweringSpec, Sample
from autofuser.kernel import tensor_meta


def parse_matmul_equation(equation: str) -> Optional[bool]:
    """``transpose_b`` for a matmul-shaped equation, else ``None``."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    a, b = ops
    if len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(out)) != len(out):
        return None
    contracted = [c for c in a if c in b and c not in out]
    batch = [c for c in out if c in a and c in b]
    rows = [c for c in a if c in out and c not in b]
    cols = [c for c in b if c in out and c not in a]
    if len(contracted) != 1 or len(rows) != 1 or len(cols) != 1:
        return None
    if set(a) | set(b) != set(batch) | set(rows) | set(cols) | set(contracted):
        return None
    prefix = "".join(batch)
    if a != prefix + rows[0] + contracted[0] or out != prefix + rows[0] + cols[0]:
        return None
    if b == prefix + contracted[0] + cols[0]:
        return False
    if b == prefix + cols[0] + contracted[0]:
        return True
    return None


def parse_transposed_a_equation(equation: str) -> bool:
    """Is ``equation`` ``a^T @ b`` (or its transpose): both operands ``batch, contracted, x``?"""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return False
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2 or any(len(set(t)) != len(t) for t in (*ops, out)):
        return False
    a, b = ops
    if len(a) != len(b) or len(out) != len(a) or len(a) < 2 or a[:-2] != b[:-2] or a[:-2] != out[:-2]:
        return False
    contracted, row, col = a[-2], a[-1], b[-1]
    return b[-2] == contracted and len({contracted, row, col}) == 3 and out[-2:] in (row + col, col + row)


def lower_einsum(ctx, equation, *operands):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or len(operands) != 2:
        ctx.refuse("unsupported_equation", "einsum with other than an equation and two operands")
    transpose_b = parse_matmul_equation(equation)
    if transpose_b is not None:
        return ctx.matmul(operands[0], operands[1], transpose_b=transpose_b)
    lhs, out = equation.replace(" ", "").split("->") if "->" in equation else (equation, "")
    swapped = ",".join(reversed(lhs.split(","))) + "->" + out
    transpose_b = parse_matmul_equation(swapped)
    if transpose_b is not None:
        return ctx.matmul(operands[1], operands[0], transpose_b=transpose_b)
    if parse_transposed_a_equation(equation) and all(ctx.is_tensor(t) for t in operands):
        return ctx.extern()
    # Every other product form was written as views around matmul by the plugin's graph
    # pass (einsum_rewrite.py); say why this one was not.
    from ..einsum_rewrite import product_form

    if not all(ctx.is_tensor(t) for t in operands):
        ctx.refuse("unsupported_equation", f"einsum {equation!r}: an operand is not a tensor")
    form = product_form(equation, *(tensor_meta(t) for t in operands))
    why = (
        form
        if isinstance(form, str)
        else "written as a batched product its result would have other strides than einsum's, "
        "and code after it was traced against einsum's"
    )
    ctx.refuse("unsupported_equation", f"einsum {equation!r} is not a matrix product: {why}; it runs as in eager")


def _samples(dtype):
    return [
        Sample(args=(torch.randn(2, 3, 29, 16, dtype=dtype), torch.randn(2, 3, 31, 16, dtype=dtype))),
        Sample(args=(torch.randn(1, 2, 37, 24, dtype=dtype), torch.randn(1, 2, 19, 24, dtype=dtype))),
    ]


SPECS = [
    LoweringSpec(
        name="matmul.einsum",
        description="torch.einsum equations that are (batched) matrix products",
        targets=(torch.einsum,),
        kind="matmul",
        lower=lower_einsum,
        samples=_samples,
        references=(
            lambda q, k: torch.einsum("bhnd,bhmd->bhnm", q, k),
            lambda q, k: torch.einsum("bhnd,bhmd->bhnm", q, k) * 0.25,
            lambda q, k: torch.einsum("bhmd,bhnd->bhnm", k, q),  # operands swapped
        ),
        tolerances=PRODUCT_TOLERANCES,
    ),
]
