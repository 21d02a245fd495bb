"""Laying out an MLP: a group with two matrix products and only pointwise ops
between them (``lin2(act(lin1(x)))``), with a prologue before the first
product (a layer norm over ``K``) and an epilogue after the second (bias,
residual, a norm over ``N``).

The layout is the generic composition's for groups of two products: the
plugin registers ``lay_out_mlp`` as a ``ProductLayoutSpec``, and
``compose_group`` calls it for every such group (a planning view's
``space_groups`` grow MLPs through it). Each load gets strides for the domain
it is read in: ``[..., M, K]`` before the first product, ``[..., M, H]``
between the two, ``[..., M, N]`` after the second. The kernel is
``mlp_kernel.write_mlp_kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from autofuser import GroupProgram, GroupRefused, ProductLayoutSpec, Value
from autofuser.kernel import (
    ROUNDED_DTYPES,
    PackedOperand,
    domain_strides,
    dot_block,
    fp32_precision,
    read_view,
    triton_cdiv,
)

from ..layout import (
    check_fits,
    collect_uids,
    convert_weight_once,
    depending_on,
    install_layout,
    keeps_rows,
    multiprocessors,
    outputs_from,
    packed_only_as_weights,
    product_operand_dtype,
    weight_operand,
)

#: The hidden slice of the MLP kernel's persistent form (its slices are written out one by one).
PERSISTENT_BLOCK_H = 64
#: Shared memory both weights may take in the persistent form: the rest of what one block may
#: use (``device_limits().shared_memory_per_block_max``; the persistent form needs nearly all)
#: holds the pipelined row blocks of A.
PERSISTENT_WEIGHT_BYTES = 160 * 1024
#: Hidden slices the persistent form writes out, at most.
MAX_PERSISTENT_SLICES = 8
#: Rows per multiprocessor from which the persistent form is offered: 4 row blocks of 128
#: (67584 rows on an H200's 132). Below, loading the weights once per program saves little (the
#: zoo's bf16 MLPs, with 13k-45k rows, always tuned to the streamed form) and its configs only
#: add compiles.
PERSISTENT_MIN_ROWS_PER_SM = 4 * 128
#: A fixed row count that replaces ``PERSISTENT_MIN_ROWS_PER_SM`` times the device's
#: multiprocessors (tests set it); ``None``: the device's.
PERSISTENT_MIN_ROWS: Optional[int] = None


def persistent_min_rows() -> int:
    """Rows from which the persistent form is offered on the current device."""
    if PERSISTENT_MIN_ROWS is not None:
        return PERSISTENT_MIN_ROWS
    return PERSISTENT_MIN_ROWS_PER_SM * multiprocessors()


@dataclass
class MlpLayout:
    """Two products with only pointwise ops between them (``lin2(act(lin1(x)))``):
    the hidden activation, ``[..., M, H]``, is made ``BLOCK_H`` columns at a
    time and consumed by the second product at once - it never reaches memory."""

    dot1: Value
    dot2: Value
    out_domain: tuple[int, ...]  # [..., M, N]
    k: int
    h: int
    prologue: set[int]
    load_strides: dict[int, tuple[int, ...]] = field(default_factory=dict)
    w1_strides: tuple[int, int] = (0, 0)  # over (K, H)
    w2_strides: tuple[int, int] = (0, 0)  # over (H, N)
    w1_packed: Optional[PackedOperand] = None  # a weight stored quantised
    w2_packed: Optional[PackedOperand] = None
    operand_dtypes: tuple[Optional[torch.dtype], Optional[torch.dtype]] = (None, None)
    precision: str = "ieee"

    @property
    def n(self) -> int:
        return self.out_domain[-1]

    @property
    def resident(self) -> bool:
        """Whether a program's rows of A (with their prologue) stay on chip, computed once
        and reused for every slice of the hidden width; else they stream over K per slice."""
        return keeps_rows(self.k, self.operand_dtypes[0])

    @property
    def block_k(self) -> Optional[int]:
        """The K tile when the rows are resident (the whole padded K), else ``None``: a config's."""
        return dot_block(self.k, self.w1_packed) if self.resident else None

    @property
    def weight_bytes(self) -> int:
        """Both weights as the persistent form holds them: 16-bit, padded to its tiles (A's
        rows resident, which the form needs, so K's tile is the whole padded K)."""
        h = triton_cdiv(self.h, PERSISTENT_BLOCK_H) * PERSISTENT_BLOCK_H
        return 2 * h * (self.block_k + dot_block(self.n))

    @property
    def persistent(self) -> bool:
        """Whether the kernel has its persistent form (``mlp_kernel``): enough rows, 16-bit
        products over float weights that fit in shared memory together, A's rows on chip."""
        return (
            self.rows >= persistent_min_rows()
            and self.resident
            and self.w1_packed is None
            and self.w2_packed is None
            and all(d in ROUNDED_DTYPES for d in self.operand_dtypes)
            and self.h <= MAX_PERSISTENT_SLICES * PERSISTENT_BLOCK_H
            and self.weight_bytes <= PERSISTENT_WEIGHT_BYTES
        )

    @property
    def rows(self) -> int:
        n = 1
        for s in self.out_domain[:-1]:
            n *= s
        return n


def weight_strides(program: GroupProgram, load: Value, dot: Value, domain: tuple[int, int]) -> tuple[int, int]:
    """A float weight matrix's strides over ``domain`` (``(K, N)``): ``weight_operand``'s,
    for matrices only."""
    if load.packed is not None:
        raise GroupRefused("packed_weight", "this kernel does not decode quantised weights")
    if len(load.shape) != 2:
        raise GroupRefused("batched_weight", "an MLP's weights must be matrices")
    return tuple(weight_operand(program, load, dot, domain)[0])


def _mlp_weight(
    program: GroupProgram, dot: Value, domain: tuple[int, int]
) -> tuple[tuple[int, int], Optional[PackedOperand]]:
    """An MLP weight's strides over ``domain``, and its scales when it is stored quantised."""
    load = dot.args[1]
    if load.packed is None:
        return weight_strides(program, load, dot, domain), None
    strides, packed = weight_operand(program, load, dot, domain)
    return tuple(strides), packed


def lay_out_mlp(program: GroupProgram, values: dict[int, Value]) -> None:
    """The generic composition's layout for a group with two products (registered
    as a ``ProductLayoutSpec``); raises ``GroupRefused`` for anything but an MLP."""
    first, second = sorted((v for v in values.values() if v.op == "dot"), key=lambda d: d.uid)
    if first.column_dims != 1 or second.column_dims != 1:
        raise GroupRefused("several_products", "an MLP's products must have one column dim each")
    depends_first = depending_on(values, first)
    if second.args[0].uid not in depends_first:
        raise GroupRefused("several_products", "two products that don't feed each other")
    for d in (first, second):
        if d.args[1].op != "load":
            raise GroupRefused("computed_weight", "a product's second operand must be read from memory")
    prologue = set(collect_uids(first.args[0]))
    # Everything under the second product's input that isn't the first product's
    # own input: the first product, and the bias and activation on it.
    middle = set(collect_uids(second.args[0])) - prologue - {first.args[1].uid}
    if any(values[u].op in ("reduce", "dot") for u in middle - {first.uid}):
        raise GroupRefused("hidden_reduction", "only pointwise ops may sit between the two products")
    after_second = depending_on(values, second)
    outputs_from(program, values, after_second, second, middle | prologue, "the second product")
    for v in values.values():
        if v.op == "reduce":
            last = len(v.args[0].shape) - 1
            if v.dims != (last,) or not v.keepdim or v.args[0].shape[-1] == 1:
                raise GroupRefused("unsupported_reduction", "reductions must run over the last dim with keepdim")

    out_domain = tuple(second.shape)
    a = first.args[0]
    k, h = a.shape[-1], first.shape[-1]
    if tuple(first.shape[:-1]) != out_domain[:-1]:
        raise GroupRefused("shape_mismatch", "the two products have different rows")
    layout = MlpLayout(dot1=first, dot2=second, out_domain=out_domain, k=k, h=h, prologue=prologue)
    hidden = middle - {first.uid}  # the bias and activation on the first product
    domains = {"prologue": out_domain[:-1] + (k,), "middle": out_domain[:-1] + (h,), "epilogue": out_domain}
    for v in values.values():
        if v.op != "load" or v is first.args[1] or v is second.args[1]:
            continue
        where = "prologue" if v.uid in prologue else "middle" if v.uid in hidden else "epilogue"
        shape, stride = read_view(program.inputs[program.input_of_load[v.uid]], v.shape)
        check_fits(shape, domains[where])
        layout.load_strides[v.uid] = domain_strides(shape, stride, domains[where])
    packed_only_as_weights(values, (first.args[1], second.args[1]))
    layout.w1_strides, layout.w1_packed = _mlp_weight(program, first, (k, h))
    layout.w2_strides, layout.w2_packed = _mlp_weight(program, second, (h, out_domain[-1]))
    layout.operand_dtypes = (product_operand_dtype(first), product_operand_dtype(second))
    for dot, operand in zip((first, second), layout.operand_dtypes):
        convert_weight_once(program, dot.args[1], operand)
    layout.precision = fp32_precision()
    install_layout(program, layout, out_domain)


MLP_LAYOUT = ProductLayoutSpec(
    name="mlp",
    description="two products with only pointwise ops between them, the hidden activation made slice by slice.",
    products=2,
    lay_out=lay_out_mlp,
)
