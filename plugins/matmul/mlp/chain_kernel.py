"""The Triton source writer for row-tiled chains (layout: ``chain_layout``).

One program owns ``BLOCK_M`` rows and walks the chain's values in creation
order:

1. row coordinates, each tensor's row offset, and one column index per width
   held as a whole-row tile (``c96 = tl.arange(0, 128)[None, :]`` and its mask);
2. whole-row values are computed once, in registers: loads, pointwise ops,
   norms and softmaxes (``tl.sum``/``tl.max`` along the row, padding columns
   masked), and products - ``whole`` steps as one ``tl.dot`` of the row block
   by the weight, ``streamed`` steps as a loop over ``K`` chunks;
3. a ``hidden`` step loops over its columns ``BLOCK_S`` at a time: the chunk
   of the product, the pointwise ops on it (bias, activation), and the
   consumer's ``acc += chunk @ W2[chunk, :]``;
4. outputs made whole are stored at the end; a ``tail`` step loops over its
   columns and stores each chunk of its outputs.

Operands of every product are rounded to the product's dtype (fp16/bf16), or
run in TF32 / 3xTF32 / fp32 for fp32 as torch's precision setting says - the
same rules and helpers as the matmul and MLP kernels. Padding columns of a
product's input are zeroed, so they meet the weight's zero rows without
producing NaNs.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from autofuser import GroupProgram, KernelSource, Value
from autofuser.kernel import (
    TL_DTYPES,
    TileWriter,
    ValueEmitter,
    as_operand,
    assemble_kernel,
    dot_line,
    emit_offsets,
    index_term,
    needs_int64,
    row_reduction,
    sized,
    stored,
    triton_cdiv,
)

from .chain_layout import ChainLayout, ChainStep, padded


class _Context(ValueEmitter):
    """One straight-line block: its indent, and the column axis of each width it
    reads (whole-row tiles at the top level; one chunk axis inside a step's loop)."""

    def __init__(
        self,
        writer: "_ChainWriter",
        indent: int,
        axes: dict[int, tuple[str, str, str]],
        known: Optional[dict[int, str]] = None,
    ):
        super().__init__(known)
        self.w = writer
        self.indent = indent
        self.axes = axes  # width -> (index name, mask name, tile width)

    def emit(self, line: str) -> None:
        self.w.lines.append("    " * self.indent + line)

    def fresh(self) -> str:
        return self.w.fresh()

    def tile(self, name: str, width: int) -> str:
        cols = self.axes[width][2] if width > 1 else "1"
        return f"tl.broadcast_to({name}, (BLOCK_M, {cols}))"

    def reduce(self, v: Value, arg: str) -> str:
        inner = self.w.layout.width[v.args[0].uid]
        name = self.w.fresh()
        mask = f"row_mask & {self.axes[inner][1]}"
        self.emit(f"{name} = {row_reduction(v.reduce_op, self.tile(arg, inner), mask)}")
        return name

    def dot(self, v: Value) -> str:
        return self.w.product(self, self.w.layout.step_of(v))

    def load(self, v: Value) -> str:
        w = self.w
        width = w.layout.width[v.uid]
        index = w.program.input_of_load[v.uid]
        tensor = w.program.inputs[index]
        inner_stride = w.layout.load_strides[v.uid][-1]
        row = w.row_offsets[("load", v.uid)]
        axis, axis_mask, _ = self.axes.get(width, (None, None, None))
        inner = index_term(axis, inner_stride) if axis and inner_stride else None
        terms = [t for t in (row, inner) if t]
        masks = [m for m, used in (("row_mask", row), (axis_mask, inner)) if used]
        cast = "" if tensor.dtype == torch.bool else ".to(tl.float32)"
        name = f"x{index}_{w.fresh()}"
        if not terms:
            self.emit(f"{name} = tl.load(in{index}){cast}")
        else:
            mask_arg = f", mask={' & '.join(masks)}, other=0" if masks else ""
            self.emit(f"{name} = tl.load(in{index} + {' + '.join(terms)}{mask_arg}){cast}")
        return name

    def store(self, k: int, value: Value) -> None:
        w = self.w
        t = w.program.outputs[k]
        width = w.layout.width[value.uid]
        res = self.value(value)
        axis, axis_mask, cols = self.axes[width] if width > 1 else (None, None, "1")
        terms = [x for x in (w.row_offsets[("out", k)], index_term(axis, t.domain_stride[-1]) if axis else None) if x]
        mask = "row_mask" + (f" & {axis_mask}" if axis else "")
        data = res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])
        self.emit(
            f"tl.store(out{k} + {' + '.join(terms) or '0'}, tl.broadcast_to({data}, (BLOCK_M, {cols})), mask={mask})"
        )


class _ChainWriter(TileWriter):
    def __init__(self, program: GroupProgram):
        super().__init__(program)
        self.layout: ChainLayout = program.product_layout
        self.row_offsets: dict[tuple, Optional[str]] = {}
        self.top: Optional[_Context] = None
        self.accumulators: dict[int, str] = {}  # whole step fed by a hidden step -> its accumulator
        self.widths: list[int] = []  # every width > 1 in the chain

    def row_axes(self) -> dict[int, tuple[str, str, str]]:
        return {width: (f"c{width}", f"m{width}", str(padded(width))) for width in self.widths}

    def weight_tile(self, step: ChainStep, k_axis: str, n_axis: str, k_limit: str, n_mask: str) -> tuple[str, str]:
        """A name and the load of the weight's ``[k_axis, n_axis]`` tile (``k_axis`` a column vector)."""
        sk, sn = step.weight_strides
        index = self.program.input_of_load[step.dot.args[1].uid]
        off = " + ".join(t for t in (index_term(k_axis, sk), index_term(n_axis, sn)) if t) or "0"
        name = f"w{step.index}_{self.fresh()}"
        return name, f"tl.load(in{index} + {off}, mask=({k_axis} < {k_limit}) & {n_mask}, other=0).to(tl.float32)"

    def operand(self, ctx: _Context, value: Value, step: ChainStep, mask: str, cols: str) -> str:
        """``value`` as a product operand: a [BLOCK_M, cols] tile, padding zeroed, in the product's dtype."""
        name = self.fresh()
        tile = f"tl.broadcast_to({ctx.value(value)}, (BLOCK_M, {cols}))"
        ctx.emit(f"{name} = {as_operand(f'tl.where({mask}, {tile}, 0.0)', step.operand_dtype)}")
        return name

    def product(self, ctx: _Context, step: ChainStep) -> str:
        """The whole-row result of a ``whole`` or ``streamed`` step (emitted at the top level)."""
        L = self.layout
        if step.fed_by is not None:
            self.hidden_loop(L.steps[step.fed_by], step)
            return self.accumulators[step.index]
        pn = padded(step.n)
        if step.mode == "whole":
            a_op = self.operand(ctx, step.dot.args[0], step, f"m{step.k}", str(padded(step.k)))
            name, load = self.weight_tile(step, f"k{step.k}", f"c{step.n}", str(step.k), f"m{step.n}")
            ctx.emit(f"{name} = {load}")
            acc = f"acc{step.index}"
            ctx.emit(f"{acc} = {dot_line(a_op, name, step.operand_dtype, L.precision)}")
            return acc
        # streamed: A is made from memory one K chunk at a time
        acc = f"acc{step.index}"
        block = f"BLOCK_S{step.index}"
        ctx.emit(f"{acc} = tl.zeros((BLOCK_M, {pn}), tl.float32)")
        ctx.emit(f"for s{step.index} in range(0, {step.k}, {block}):")
        inner = _Context(self, ctx.indent + 1, {step.k: (f"ks{step.index}", f"ks{step.index}_mask", block)})
        inner.emit(f"ks{step.index} = s{step.index} + tl.arange(0, {block})[None, :]")
        inner.emit(f"ks{step.index}_mask = ks{step.index} < {step.k}")
        inner.emit(f"kk{step.index} = s{step.index} + tl.arange(0, {block})[:, None]")
        a_op = self.operand(inner, step.dot.args[0], step, f"ks{step.index}_mask", block)
        name, load = self.weight_tile(step, f"kk{step.index}", f"c{step.n}", str(step.k), f"m{step.n}")
        inner.emit(f"{name} = {load}")
        inner.emit(f"{acc} += {dot_line(a_op, name, step.operand_dtype, L.precision)}")
        return acc

    def chunk_loop(self, step: ChainStep) -> _Context:
        """Open the loop over ``step``'s columns; returns the loop body's context
        with the step's product chunk computed."""
        L = self.layout
        top = self.top
        i = step.index
        block = f"BLOCK_S{i}"
        a_op = self.operand(top, step.dot.args[0], step, f"m{step.k}", str(padded(step.k)))
        # Per-row scalars the chunk reads (a norm's statistics) are computed once, outside the loop.
        region = {v.uid for v in step.region}
        for v in step.region[1:]:
            for a in v.args:
                if a.uid not in region and a.op not in ("const", "load"):
                    top.value(a)
        top.emit(f"for s{i} in range(0, {step.n}, {block}):")
        body = _Context(
            self,
            top.indent + 1,
            {step.n: (f"cs{i}", f"cs{i}_mask", block)},
            {u: n for u, n in top.names.items() if L.width.get(u) == 1},
        )
        body.emit(f"cs{i} = s{i} + tl.arange(0, {block})[None, :]")
        body.emit(f"cs{i}_mask = cs{i} < {step.n}")
        name, load = self.weight_tile(step, f"k{step.k}", f"cs{i}", str(step.k), f"cs{i}_mask")
        body.emit(f"{name} = {load}")
        body.emit(f"chunk{i} = {dot_line(a_op, name, step.operand_dtype, L.precision)}")
        body.names[step.dot.uid] = f"chunk{i}"
        return body

    def hidden_loop(self, step: ChainStep, consumer: ChainStep) -> None:
        """Step 3 of the module doc: ``consumer``'s accumulator made from ``step``'s chunks."""
        i, acc = step.index, f"acc{consumer.index}"
        self.top.emit(f"{acc} = tl.zeros((BLOCK_M, {padded(consumer.n)}), tl.float32)")
        body = self.chunk_loop(step)
        block = f"BLOCK_S{i}"
        mid = self.operand(body, consumer.dot.args[0], consumer, f"cs{i}_mask", block)
        body.emit(f"hs{i} = s{i} + tl.arange(0, {block})[:, None]")
        name, load = self.weight_tile(consumer, f"hs{i}", f"c{consumer.n}", str(step.n), f"m{consumer.n}")
        body.emit(f"{name} = {load}")
        body.emit(f"{acc} += {dot_line(mid, name, consumer.operand_dtype, self.layout.precision)}")
        self.accumulators[consumer.index] = acc

    def tail_loop(self, step: ChainStep, outputs: list[tuple[int, Value]]) -> None:
        """Step 4 for a ``tail`` step: each chunk of its outputs stored as it is made."""
        body = self.chunk_loop(step)
        for k, value in outputs:
            body.store(k, value)


def write_chain_kernel(program: GroupProgram, strategy: str, helpers: Optional[dict[str, str]] = None) -> KernelSource:
    """Write the Triton source for a row-tiled chain; see module doc."""
    L: ChainLayout = program.product_layout
    w = _ChainWriter(program)
    loads = [uid for uid in L.load_strides]
    sites = [("load", uid) for uid in loads] + [("out", k) for k in range(len(program.outputs))]
    strides = [L.load_strides[uid] for uid in loads] + [t.domain_stride for t in program.outputs]

    cast = ".to(tl.int64)" if needs_int64(program) else ""
    w.emit(f"pid = tl.program_id(0){cast}")
    w.emit("rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
    w.emit(f"row_mask = rows < {sized(L.rows)}")
    offsets = emit_offsets(w.emit, list(L.lead), [list(st[:-1]) for st in strides], "rows", "r")
    w.row_offsets = dict(zip(sites, offsets))
    w.widths = sorted({L.width[v] for v in L.width if L.width[v] > 1})
    w.top = _Context(w, 1, w.row_axes())
    axes_at = len(w.lines)

    tail_outputs: dict[int, list[tuple[int, Value]]] = {}
    region_of = {v.uid: s.index for s in L.steps if s.mode == "tail" for v in s.region}
    for k, value in enumerate(program.output_values):
        if value.uid in region_of:
            tail_outputs.setdefault(region_of[value.uid], []).append((k, value))
        else:
            w.top.store(k, value)
    for index, outputs in tail_outputs.items():
        w.tail_loop(L.steps[index], outputs)

    # The column index of each width the body holds whole (or walks as a weight's K axis).
    body = "\n".join(w.lines[axes_at:])
    axes = []
    for width in w.widths:
        if re.search(rf"\b[cmk]{width}\b", body):
            axes += [
                f"    c{width} = tl.arange(0, {padded(width)})[None, :]",
                f"    m{width} = c{width} < {width}",
                f"    k{width} = tl.arange(0, {padded(width)})[:, None]",
            ]
    w.lines[axes_at:axes_at] = axes

    blocks = ["BLOCK_M: tl.constexpr"] + [f"BLOCK_S{s.index}: tl.constexpr" for s in L.steps if s.chunked]
    modes = ", ".join(f"{s.mode if s.fed_by is None else 'accumulated'} {s.k}->{s.n}" for s in L.steps)
    dtypes = [str(s.operand_dtype).removeprefix("torch.") if s.operand_dtype else L.precision for s in L.steps]
    source, name = assemble_kernel(
        program,
        w,
        blocks,
        helpers,
        "chain",
        strategy,
        f"# row-tiled chain: rows {L.rows}; steps: {modes}; operands {dtypes}",
    )

    def grid(config, rows=L.rows):
        return (triton_cdiv(rows, config["BLOCK_M"]),)

    return KernelSource(name=name, source=source, layout="chain", grid=grid)
