"""The splits a kept group with a product is timed against (``SplitRule``s, on a GPU).

A layer norm fused in front of a linear is recomputed by every column tile of the
product (or held in registers beside it), so the norm as a kernel of its own can
win; a row-tiled kernel of several products can lose to shorter groups. Which
split wins depends on the shapes and the GPU, so the strategies declare the
splits and the core times them: BENCHMARKS.md, "Measurements behind rules in the
code". The matmul strategies declare ``NORM_APART``; the mlp plugin's strategies
all three.
"""

from __future__ import annotations

from typing import Optional

from autofuser import GroupProgram, SplitRule, Value
from autofuser.kernel import collect_values, product_count


def reduction_prologue(program: Optional[GroupProgram]) -> bool:
    """Whether a row reduction computed before any of the group's products feeds one
    (a layer norm in front of a linear): a reduction that no product precedes."""
    if program is None:
        return False
    values = collect_values(program.output_values)
    # Whether a product is upstream of each value: every value once, args before their users.
    after_product: dict[int, bool] = {}
    for v in _args_first(values):
        after_product[v.uid] = any(a.op == "dot" or after_product[a.uid] for a in v.args)
    return any(
        v.op == "reduce" and not after_product[v.uid]
        for dot in values.values()
        if dot.op == "dot"
        for v in collect_values(dot.args).values()
    )


def _args_first(values: dict[int, Value]) -> list[Value]:
    """``values`` ordered so that each comes after every one of its args."""
    order: list[Value] = []
    placed: set[int] = set()
    for root in values.values():
        stack = [(root, False)]
        while stack:
            v, expanded = stack.pop()
            if v.uid in placed:
                continue
            if expanded:
                placed.add(v.uid)
                order.append(v)
                continue
            stack.append((v, True))
            stack.extend((a, False) for a in v.args if a.uid not in placed)
    return order


def _norm_apart(program: GroupProgram):
    if reduction_prologue(program):
        return "split_prologue", "split with its row reduction apart from the product it feeds"
    return None


def _several_products(program: GroupProgram) -> bool:
    return product_count(program) > 1


# A group of several products kept in round 1, as groups of fewer products (the
# row-tiled kernel may lose to shorter ones).
FEWER_PRODUCTS = SplitRule(
    description="into groups of fewer products", applies=_several_products, fewer_products=1, first_round_only=True
)
# The same where a row reduction feeds one of its products, with that reduction in a group
# of its own too (an MLP behind its layer norm as the norm's kernel and two linear kernels).
FEWER_PRODUCTS_NORM_APART = SplitRule(
    description="into groups of fewer products, the row reduction before a product on its own",
    applies=lambda program: _several_products(program) and reduction_prologue(program),
    fewer_products=1,
    refuse=_norm_apart,
    first_round_only=True,
)
# A group whose product a row reduction feeds, with that reduction in a group of its own
# (layer norm + linear, or an MLP behind its norm, as the norm's kernel and the rest).
NORM_APART = SplitRule(
    description="with the row reduction before a product on its own", applies=reduction_prologue, refuse=_norm_apart
)
