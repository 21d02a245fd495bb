"""Tile products: writing a kernel whose programs hold ``BLOCK_M`` rows and loop over
tiles of a product's reduction (``BLOCK_K``) and columns (``BLOCK_N``).

The conventions every product strategy shares (one product, MLP blocks, chains of
products, attention, convolutions):

- a program's rows are ``rows`` (``[BLOCK_M, 1]``) with ``row_mask``; the reduction
  axis of A tiles is ``ks`` (``[1, BLOCK_K]``, ``k_mask``) and of B tiles ``kk``
  (``[BLOCK_K, 1]``); the columns are ``cols`` (``[1, BLOCK_N]``, ``col_mask``);
- ``TileWriter`` collects a kernel's lines, fresh names and each load's or store's row
  and batch offsets (``site_offsets``); ``TileBlock`` writes the IR values of one
  straight-line block at one of those axes;
- ``tl.dot`` operands are rounded to the product's dtype (``as_operand``), and fp32
  products use the precision eager would (``dot_line``); a quantised weight
  (``PackedOperand``) is decoded tile by tile in registers (``weight_tile``);
- each output is stored through its own strides in its own dtype (``emit_stores``), and
  ``assemble_kernel`` names the kernel after its ops and a hash of its text.

The product layout a strategy attaches to its program (``GroupProgram.product_layout``)
gives each load's strides over its domain as ``load_strides``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .codegen import (
    INT32_LIMIT,
    REDUCTION_NEUTRAL,
    TL_DTYPES,
    ValueEmitter,
    next_power_of_2,
    op_stem,
    row_reduction,
    strategy_header,
    used_helpers,
)
from .dynamic import size_parameters, sized
from .group import GroupProgram, collect_values
from .ir import Value
from .rounding import interpreting, rounded, stored


@dataclass
class PackedOperand:
    """A product's weight stored quantised (``ir.PackedWeight``): where its scales are."""

    scales: int  # input index of the scales tensor
    strides: tuple[int, ...]  # the scales' strides over the weight's domain, the reduction dim counted in blocks
    blocks: int  # scale blocks along the reduction dim
    block: int  # elements per scale
    decode: str  # the @triton.jit helper turning (elements, scales) tiles into fp32
    exact_tf32: bool = False  # decoded values are exact in TF32


def dot_block(n: int, packed: Optional[PackedOperand] = None) -> int:
    """A block size covering ``n`` that ``tl.dot`` accepts (16 at least), and a
    multiple of a quantised weight's block when it runs along that weight's reduction."""
    return max(16, packed.block if packed is not None else 1, next_power_of_2(n))


_COMBINE = {
    "sum": "{0} + {1}",
    "max": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "min": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
}


class TileBlock(ValueEmitter):
    """Emits one straight-line block of the DAG (its own memo: loads differ per loop step)."""

    def __init__(self, writer: "TileWriter", indent: int, site: str | tuple[str, str, str], known: dict[int, str]):
        super().__init__(known)
        self.w = writer
        self.indent = indent
        # The inner axis of this block's tiles: "k" loads at (rows, ks), "n" at (rows, cols); a
        # strategy with another axis passes its own (offsets name, mask name, block constexpr).
        self.axis: str
        self.axis_mask: str
        self.width: str
        self.axis, self.axis_mask, self.width = (
            {"k": ("ks", "k_mask", "BLOCK_K"), "n": ("cols", "col_mask", "BLOCK_N")}[site]
            if isinstance(site, str)
            else site
        )
        self.loads: dict[tuple, str] = {}

    def emit(self, line: str) -> None:
        self.w.lines.append("    " * self.indent + line)

    def fresh(self) -> str:
        return self.w.fresh()

    def reduce(self, v: Value, arg: str) -> str:
        name = self.w.fresh()
        full = f"tl.broadcast_to({arg}, (BLOCK_M, {self.width}))"
        self.emit(f"{name} = {row_reduction(v.reduce_op, full, f'row_mask & {self.axis_mask}')}")
        return name

    def load(self, v: Value) -> str:
        w = self.w
        index = w.program.input_of_load[v.uid]
        tensor = w.program.inputs[index]
        strides = w.layout.load_strides[v.uid]
        key = (index, strides)
        if key in self.loads:
            return self.loads[key]
        row, batch = w.site_offsets[("load", v.uid)]
        inner_stride = strides[-1]
        axis, inner_mask = self.axis, self.axis_mask
        inner = index_term(axis, inner_stride)
        terms = [t for t in (row, batch, inner) if t]
        cast = "" if tensor.dtype == torch.bool else ".to(tl.float32)"
        name = f"x{index}_{w.fresh()}"
        if not terms:
            self.emit(f"{name} = tl.load(in{index}){cast}")
        else:
            masks = [m for m, used in (("row_mask", row), (inner_mask, inner)) if used]
            mask = " & ".join(masks) if masks else None
            mask_arg = f", mask={mask}, other=0" if mask else ""
            self.emit(f"{name} = tl.load(in{index} + {' + '.join(terms)}{mask_arg}){cast}")
        self.loads[key] = name
        return name


class TileWriter:
    """A kernel's lines, fresh names and each load's and store's (row, batch) offsets
    (``site_offsets``), for a group laid out by a product layout."""

    def __init__(self, program: GroupProgram):
        if program.product_layout is None:
            raise ValueError("TileWriter writes groups laid out by a product layout (program.product_layout)")
        self.program = program
        self.layout: Any = program.product_layout
        self.lines: list[str] = []
        self.count = 0
        self.site_offsets: dict = {}

    def fresh(self) -> str:
        self.count += 1
        return f"v{self.count}"

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)


def _reduction_levels(prologue_values: list[Value]) -> list[list[Value]]:
    level: dict[int, int] = {}

    def depth(v: Value) -> int:
        if v.uid in level:
            return level[v.uid]
        below = max((depth(a) for a in v.args), default=0)
        level[v.uid] = below + (1 if v.op == "reduce" else 0)
        return level[v.uid]

    reductions = [v for v in prologue_values if v.op == "reduce"]
    for v in reductions:
        depth(v)
    levels: dict[int, list[Value]] = {}
    for v in reductions:
        levels.setdefault(level[v.uid], []).append(v)
    return [levels[k] for k in sorted(levels)]


def weight_tile(
    target: str,
    index: int,
    dtype: torch.dtype,
    offset: str,
    mask: str,
    packed: Optional[PackedOperand],
    start: str,
    width: str,
    across: str,
    across_mask: str,
) -> list[str]:
    """The lines loading a product's weight tile ``[width, BLOCK_*]`` into ``target`` as fp32.

    A quantised weight (``packed``) loads its element tile and the tile of its
    scales - ``width // block`` rows from scale block ``start // block`` (tiles
    along the reduction are multiples of ``block``), ``across`` the other axis
    - and decodes both with the quantiser's helper, in registers.
    """
    if packed is None:
        cast = "" if dtype == torch.bool else ".to(tl.float32)"
        return [f"{target} = tl.load(in{index} + {offset}, mask={mask}, other=0){cast}"]
    blocks = f"{target}_blocks"
    # The block term always appears (times 0 for one block), so the pointers form a tile.
    s_terms = [index_term(blocks, packed.strides[-2]) or f"{blocks} * 0"] + [
        t for t in [index_term(across, packed.strides[-1])] if t
    ]
    return [
        f"{blocks} = {start} // {packed.block} + tl.arange(0, {width} // {packed.block})[:, None]",
        f"{target}_scales = tl.load(in{packed.scales} + {' + '.join(s_terms)}, "
        f"mask=({blocks} < {packed.blocks}) & {across_mask}, other=0)",
        f"{target} = {packed.decode}(tl.load(in{index} + {offset}, mask={mask}, other=0), {target}_scales)",
    ]


def index_term(axis: str, stride: int) -> Optional[str]:
    if stride == 0:
        return None
    return axis if stride == 1 else f"{axis} * {sized(stride)}"


def all_values(program: GroupProgram) -> list[Value]:
    return sorted(collect_values(program.output_values).values(), key=lambda v: v.uid)


def emit_prepasses(w: TileWriter, prologue_values: list[Value], k: int, indent: int = 1) -> dict[int, str]:
    """Step 2 of the module doc: each level of prologue reductions is one pass over K."""
    known: dict[int, str] = {}
    for level in _reduction_levels(prologue_values):
        for v in level:
            name = w.fresh()
            known[v.uid] = name
            w.emit(f"{name} = tl.full((BLOCK_M, 1), {REDUCTION_NEUTRAL[v.reduce_op]}, tl.float32)", indent)
        w.emit(f"for k0 in range(0, {sized(k)}, BLOCK_K):", indent)
        w.emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]", indent + 1)
        w.emit(f"k_mask = ks < {sized(k)}", indent + 1)
        block = TileBlock(w, indent + 1, "k", {u: n for u, n in known.items() if u not in {v.uid for v in level}})
        for v in level:
            arg = block.value(v.args[0])
            part = row_reduction(v.reduce_op, f"tl.broadcast_to({arg}, (BLOCK_M, BLOCK_K))", "row_mask & k_mask")
            block.emit(f"{known[v.uid]} = {_COMBINE[v.reduce_op].format(known[v.uid], part)}")
    return known


def needs_int64(program: GroupProgram) -> bool:
    """Whether some offset into some tensor of the kernel (weights included) can pass 2**31 - 1."""
    extents = [
        sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride)) + 1
        for t in program.inputs + program.outputs
    ]
    return max(extents + [math.prod(program.domain)]) > INT32_LIMIT


def as_operand(expr: str, dtype) -> str:
    """``expr`` converted once to a product's operand dtype."""
    if dtype is None:
        return expr
    if dtype == torch.bfloat16 and interpreting():
        return rounded(expr, dtype)
    return f"{expr}.to({TL_DTYPES[dtype]})"


def dot_line(a: str, b: str, dtype, precision: str, packed: Optional[PackedOperand] = None) -> str:
    if dtype is None and precision == "tf32x3" and packed is not None and packed.exact_tf32:
        # b is exact in TF32: a = a_hi + a_lo in TF32 parts, two products instead of three.
        hi = f"({a}.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)"
        return f'tl.dot({hi}, {b}, input_precision="tf32") + tl.dot({a} - {hi}, {b}, input_precision="tf32")'
    if dtype is None:
        return f'tl.dot({a}, {b}, input_precision="{precision}")'
    tl_dtype = TL_DTYPES[dtype]
    if dtype == torch.bfloat16 and interpreting():
        # The interpreter's bf16 dot is broken; round the operands and multiply in fp32 instead.
        return f'tl.dot({rounded(a, dtype)}, {rounded(b, dtype)}, input_precision="ieee")'
    return f"tl.dot({a}.to({tl_dtype}), {b}.to({tl_dtype}))"


def emit_stores(w: TileWriter, program: GroupProgram, block: TileBlock) -> None:
    """Step 4's stores: each output through its own strides, masked to the tile."""
    results = [block.value(v) for v in program.output_values]
    for k, (t, res) in enumerate(zip(program.outputs, results)):
        ro, bo = w.site_offsets[("out", k)]
        # rows and cols always appear (times 0 for one row or a width-1 output), so the
        # pointer tile is [BLOCK_M, BLOCK_N].
        n_term = index_term("cols", t.domain_stride[-1]) or "cols * 0"
        off = " + ".join(x for x in (ro or "rows * 0", bo, n_term) if x)
        store = res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])
        w.emit(f"tl.store(out{k} + {off}, tl.broadcast_to({store}, (BLOCK_M, BLOCK_N)), mask=row_mask & col_mask)")


def assemble_kernel(program, w, blocks, helpers, layout, strategy, extra_header):
    params = [f"in{k}" for k in range(len(program.inputs))] + [f"out{k}" for k in range(len(program.outputs))]
    params += size_parameters()  # run-time sizes of dynamic dims (none where the kernel is specialised)
    body = "\n".join(w.lines)
    helper_text = used_helpers(helpers, body)
    digest = hashlib.sha256(f"{helper_text}\n{', '.join(params + blocks)}\n{body}".encode()).hexdigest()[:10]
    stem = "_".join(dict.fromkeys(op_stem(op) for op in program.op_names))[:48].strip("_")
    name = f"af_{layout}_{stem}_{digest}"
    header = strategy_header(program, layout, strategy) + "\n" + extra_header
    source = (
        f"{header}\nimport triton\nimport triton.language as tl\n\n\n"
        + (helper_text + "\n\n\n" if helper_text else "")
        + f"@triton.jit\ndef {name}({', '.join(params + blocks)}):\n{body}\n"
    )
    return source, name
