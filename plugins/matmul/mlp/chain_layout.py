"""Laying out a row-tiled chain: a block of rows kept on chip through a
sequence of linear, layer norm, softmax, pointwise and MLP steps.

Every value of the group lives in *row space*: its last dim is its width, all
other dims are the chain's rows (``lead``, broadcast where a value is smaller).
A program holds ``BLOCK_M`` rows; each value is either a whole-row tile
``[BLOCK_M, P]`` (``P``: the width padded to a power of two, 16 at least), a
per-row scalar ``[BLOCK_M, 1]`` (a norm's statistics), or is made a chunk of
columns at a time inside one product's loop.

Each product (*step*) runs in one of four modes, chosen from how its result is
used:

- ``hidden``: the product's result only feeds pointwise ops that feed exactly
  one other product (an MLP's ``fc2(act(fc1(x)))``): it is made ``BLOCK_S``
  columns at a time and each chunk is consumed by that product at once, so the
  hidden activation never exists whole;
- ``tail``: the result only feeds pointwise ops whose results are outputs (the
  next block's qkv projection, with its bias): made and stored ``BLOCK_S``
  columns at a time;
- ``streamed``: the result is needed whole (a layer norm, a residual, another
  step), and its input is computed from memory by pointwise ops alone: the
  product loops over ``K`` in ``BLOCK_S`` steps, as a plain matmul kernel does;
- ``whole``: the result is needed whole and its input is an on-chip row block:
  one ``tl.dot`` over the whole width, or, when a ``hidden`` step feeds it,
  accumulated over that step's chunks.

Whole-row tiles bound the widths a chain can serve (``MAX_ROW_WIDTH`` in the
strategy); chunked widths don't.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from autofuser import GroupProgram, GroupRefused, Value
from autofuser.kernel import collect_values, domain_strides, dot_block, fp32_precision

from ..layout import check_fits, convert_weight_once, product_operand_dtype
from .mlp_layout import weight_strides


@dataclass
class ChainStep:
    """One product of the chain and how its loop runs."""

    index: int  # its chunk size is the block parameter BLOCK_S{index}
    dot: Value
    k: int
    n: int
    mode: str  # "hidden" | "tail" | "streamed" | "whole"
    weight_strides: tuple[int, int]  # over (K, N)
    operand_dtype: Optional[torch.dtype]  # None: fp32 operands
    region: list[Value] = field(default_factory=list)  # hidden/tail: values made per chunk (the product first)
    consumer: Optional[Value] = None  # hidden: the product that consumes the chunks
    fed_by: Optional[int] = None  # whole: the hidden step whose chunks it accumulates

    @property
    def chunked(self) -> bool:
        """Whether the step has a chunk size to tune (``BLOCK_S{index}``)."""
        return self.mode != "whole"

    @property
    def chunked_width(self) -> int:
        """The extent its chunks walk: ``K`` when streamed, else ``N``."""
        return self.k if self.mode == "streamed" else self.n


@dataclass
class ChainLayout:
    lead: tuple[int, ...]  # the row dims
    steps: list[ChainStep]
    width: dict[int, int]  # value uid -> width (1: a per-row scalar)
    load_strides: dict[int, tuple[int, ...]] = field(default_factory=dict)  # over lead + (width,)
    precision: str = "ieee"  # fp32 products: "tf32" where torch allows it, else the strict mode
    row_widths: set[int] = field(default_factory=set)  # widths held as whole-row tiles
    reductions: int = 0

    @property
    def rows(self) -> int:
        n = 1
        for s in self.lead:
            n *= s
        return n

    def step_of(self, dot: Value) -> ChainStep:
        return next(s for s in self.steps if s.dot is dot)


def lay_out_chain(program: GroupProgram, values: dict[int, Value]) -> None:
    """``compose_group``'s layout for a chain (see module doc); raises ``GroupRefused``."""
    ordered = sorted(values.values(), key=lambda v: v.uid)
    dots = [v for v in ordered if v.op == "dot"]
    weights = {d.args[1].uid for d in dots}  # matrices, outside row space
    ordered_rows = [v for v in ordered if v.uid not in weights]
    rank = max(len(v.shape) for v in ordered_rows)
    if rank < 2:
        raise GroupRefused("no_rows", "a chain needs values with rows and columns")
    aligned = {v.uid: (1,) * (rank - len(v.shape)) + tuple(v.shape) for v in ordered_rows}
    lead = [1] * (rank - 1)
    for v in ordered_rows:
        for d, s in enumerate(aligned[v.uid][:-1]):
            if s != 1:
                if lead[d] not in (1, s):
                    raise GroupRefused("shape_mismatch", f"row sizes {lead[d]} and {s} meet in dim {d}")
                lead[d] = s
    lead_t = tuple(lead)
    width = {v.uid: aligned[v.uid][-1] for v in ordered_rows}
    users: dict[int, list[Value]] = {v.uid: [] for v in ordered}
    for v in ordered:
        for a in v.args:
            users[a.uid].append(v)

    if any(v.op == "load" and getattr(v, "packed", None) is not None for v in ordered):
        raise GroupRefused(
            "packed_weight", "a chain kernel does not decode quantised weights; the product strategies do"
        )
    for d in dots:
        if d.args[1].op != "load":
            raise GroupRefused("computed_weight", "a chain's products must read their weights from memory")
        if any(u.op != "dot" or u.args[1] is not d.args[1] for u in users[d.args[1].uid]):
            raise GroupRefused("weight_reused", "a product's weight is also read as a row value")
    reductions = 0
    for v in ordered:
        if v.op == "reduce":
            last = len(v.args[0].shape) - 1
            if v.dims != (last,) or not v.keepdim or v.args[0].shape[-1] == 1:
                raise GroupRefused(
                    "unsupported_reduction", "a chain's reductions must run over the last dim with keepdim"
                )
            reductions += 1

    layout = ChainLayout(lead=lead_t, steps=[], width=width, reductions=reductions)
    for v in ordered:
        if v.op != "load" or v.uid in weights:
            continue
        meta = program.inputs[program.input_of_load[v.uid]]
        domain = lead_t + (width[v.uid],)
        check_fits(meta.shape, domain)
        layout.load_strides[v.uid] = domain_strides(meta.shape, meta.stride, domain)

    output_uids = {v.uid for v in program.output_values}
    fed: dict[int, int] = {}  # consumer dot uid -> hidden step index
    for index, d in enumerate(dots):
        a = d.args[0]
        k, n = width[a.uid], width[d.uid]
        if min(k, n) < 2:
            raise GroupRefused(
                "degenerate_product",
                "a product with one input or output column (a chain keeps "
                "those outside: they are reductions, not steps)",
            )
        step = ChainStep(
            index=index,
            dot=d,
            k=k,
            n=n,
            mode="whole",
            weight_strides=weight_strides(program, d.args[1], d, (k, n)),
            operand_dtype=product_operand_dtype(d),
        )
        convert_weight_once(program, d.args[1], step.operand_dtype)
        if d.uid in fed:
            step.fed_by = fed[d.uid]
        else:
            region, boundary = _chunk_region(d, ordered, width)
            region_outputs = [v for v in region if v.uid in output_uids]
            if len(boundary) == 1 and boundary[0].op == "dot" and boundary[0].args[0] in region and not region_outputs:
                step.mode, step.region, step.consumer = "hidden", region, boundary[0]
                fed[boundary[0].uid] = index
            elif not boundary and region_outputs:
                step.mode, step.region = "tail", region
            elif _from_memory(a):
                step.mode = "streamed"
        layout.steps.append(step)

    # Values made inside a step's loop (chunk regions, a streamed step's input) are not held whole;
    # a load is held whole where some value made outside the loops reads it.
    in_loops = {v.uid for s in layout.steps for v in s.region}
    in_loops |= set().union(*[_collect(s.dot.args[0]) for s in layout.steps if s.mode == "streamed"])
    layout.row_widths = {
        width[v.uid]
        for v in ordered_rows
        if v.op != "const"
        and width[v.uid] > 1
        and (any(u.uid not in in_loops for u in users[v.uid]) if v.op == "load" else v.uid not in in_loops)
    }
    layout.precision = fp32_precision()

    for tensor, value in zip(program.outputs, program.output_values):
        domain = lead_t + (width[value.uid],)
        check_fits(tensor.shape, domain)
        shape = (1,) * (len(domain) - len(tensor.shape)) + tuple(tensor.shape)
        if any(s == 1 and t != 1 for s, t in zip(shape, domain)) or aligned[value.uid] != domain:
            raise GroupRefused("output_broadcasts", f"output {tensor.name} is smaller than the chain's rows")
        tensor.domain_stride = domain_strides(tensor.shape, tensor.stride, domain)
    program.domain = lead_t + (max(width.values()),)
    program.reduced_dims = ()
    program.product_layout = layout


def _chunk_region(dot: Value, ordered: list[Value], width: dict[int, int]) -> tuple[list[Value], list[Value]]:
    """The pointwise values that can be made a chunk of ``dot``'s columns at a time
    (``dot`` first), and the values outside that read them (the boundary).

    Values are visited in creation order, so every operand is decided before its user."""
    n = width[dot.uid]
    region = [dot]
    inside = {dot.uid}
    boundary: list[Value] = []
    for v in ordered:
        if v.uid <= dot.uid or not any(a.uid in inside for a in v.args):
            continue
        if (
            v.op == "pointwise"
            and width[v.uid] == n
            and all(a.uid in inside or _chunk_safe(a, dot, n, width) for a in v.args)
        ):
            inside.add(v.uid)
            region.append(v)
        else:
            boundary.append(v)
    return region, boundary


def _chunk_safe(a: Value, dot: Value, n: int, width: dict[int, int]) -> bool:
    """An operand a chunk can read: a constant, a load of width 1 or ``n`` (read per
    chunk), or a per-row scalar computed before the product."""
    if a.op == "const":
        return True
    if a.op == "load":
        return width[a.uid] in (1, n)
    return width[a.uid] == 1 and not _depends_on(a, dot)


def _depends_on(v: Value, root: Value) -> bool:
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if x is root:
            return True
        if x.uid in seen or x.uid < root.uid:  # uids grow in creation order
            continue
        seen.add(x.uid)
        stack.extend(x.args)
    return False


def _from_memory(v: Value) -> bool:
    """Computed from loads and constants by pointwise ops alone (so it can be made per K chunk)."""
    if v.op in ("load", "const"):
        return True
    return v.op == "pointwise" and all(_from_memory(a) for a in v.args)


def _collect(root: Value) -> set[int]:
    return set(collect_values([root]))


def padded(width: int) -> int:
    """A whole-row tile's column count for ``width`` (what ``tl.dot`` accepts)."""
    return dot_block(width)
