"""The Triton source writer for groups with one matrix product.

The kernel computes ``C[rows, cols]`` tiles of ``BLOCK_M x BLOCK_N``:

1. program ids map to tiles in grouped order (``GROUP_M`` row tiles share
   their column tiles' weights in L2); a second grid axis walks the batch when
   ``B`` has batch dims;
2. each reduction in the prologue (layer-norm statistics over ``K``) is one
   pass over ``K`` in ``BLOCK_K`` steps, in dependency order (the mean before
   the variance), each row's result kept in registers;
3. the main loop loads, per ``BLOCK_K`` step, the prologue's inputs, computes
   the A tile through the prologue (normalisation, scale, cast), loads the B
   tile and accumulates ``tl.dot`` in fp32 - operands rounded to the product's
   dtype, TF32 for fp32 only where torch allows it;
4. the epilogue (bias, activation, residual, a norm over ``N`` when one program
   holds all of ``N``) runs on the accumulator, and each output is stored
   through its own strides.

The indexing of rows, batch, ``K`` and ``N`` uses the same coordinate and
stride scheme as ``codegen.py``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch

from .codegen import (INT32_LIMIT, TL_DTYPES, KernelSource, _header, _literal, _short, emit_offsets, next_power_of_2,
                      row_reduction, triton_cdiv, used_helpers)
from .group import GroupProgram, collect_values
from .ir import Value
from .matmul_layout import PackedOperand
from .rounding import interpreting, rounded, stored

_NEUTRAL = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}
_COMBINE = {"sum": "{0} + {1}", "max": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
            "min": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"}


class _Block:
    """Emits one straight-line block of the DAG (its own memo: loads differ per loop step)."""

    def __init__(self, writer: "_MatmulWriter", indent: int, site: str, known: dict[int, str]):
        self.w = writer
        self.indent = indent
        # The inner axis of this block's tiles: "k" loads at (rows, ks), "h" at (rows, hs), "n" at (rows, cols).
        self.axis, self.axis_mask, self.width = {"k": ("ks", "k_mask", "BLOCK_K"), "h": ("hs", "h_mask", "BLOCK_H"),
                                                 "n": ("cols", "col_mask", "BLOCK_N")}[site]
        self.names = dict(known)
        self.loads: dict[tuple, str] = {}

    def emit(self, line: str) -> None:
        self.w.lines.append("    " * self.indent + line)

    def value(self, v: Value) -> str:
        if v.uid in self.names:
            return self.names[v.uid]
        if v.op == "const":
            return _literal(v.constant)
        if v.op == "load":
            name = self.load(v)
        elif v.op == "pointwise":
            operands = [self.value(a) for a in v.args]
            name = self.w.fresh()
            self.emit(f"{name} = {v.template.format(*operands)}")
        elif v.op == "reduce":
            arg = self.value(v.args[0])
            name = self.w.fresh()
            full = f"tl.broadcast_to({arg}, (BLOCK_M, {self.width}))"
            self.emit(f"{name} = {row_reduction(v.reduce_op, full, f'row_mask & {self.axis_mask}')}")
        else:
            raise ValueError(f"{v.op} cannot be emitted here")
        self.names[v.uid] = name
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
        inner = None if inner_stride == 0 else (axis if inner_stride == 1 else f"{axis} * {inner_stride}")
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


class _MatmulWriter:
    def __init__(self, program: GroupProgram):
        self.program = program
        self.layout = program.matmul
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


def write_matmul_kernel(program: GroupProgram, strategy: str, helpers: Optional[dict[str, str]] = None) -> KernelSource:
    """Write the Triton source for a group with one product; see module doc."""
    L = program.matmul
    w = _MatmulWriter(program)
    dot = L.dot
    rank = len(L.out_domain)
    row_dims = [rank - 2] if L.batched else list(range(rank - 1))
    batch_dims = list(range(rank - 2)) if L.batched else []
    values = _all_values(program)
    loads = [v for v in values if v.op == "load" and v is not dot.args[1]]

    # Per site: strides over row dims and batch dims.
    sites: list[tuple] = [("load", v.uid) for v in loads] + [("out", k) for k in range(len(program.outputs))]
    strides = [L.load_strides[v.uid] for v in loads] + [t.domain_stride for t in program.outputs]
    wide = needs_int64(program)

    constexprs: dict[str, int] = {}
    if L.epilogue_reduces:
        constexprs["BLOCK_N"] = dot_block(L.n)

    w.emit("pid = tl.program_id(0)")
    w.emit(f"num_m = tl.cdiv({L.rows}, BLOCK_M)")
    w.emit(f"num_n = tl.cdiv({L.n}, BLOCK_N)")
    w.emit("in_group = GROUP_M * num_n")
    w.emit("first_m = (pid // in_group) * GROUP_M")
    w.emit("size_m = tl.minimum(num_m - first_m, GROUP_M)")
    w.emit("pid_m = first_m + (pid % in_group) % size_m")
    w.emit("pid_n = (pid % in_group) // size_m")
    cast = ".to(tl.int64)" if wide else ""
    w.emit(f"rows = (pid_m{cast} * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
    w.emit(f"cols = (pid_n{cast} * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]")
    w.emit(f"row_mask = rows < {L.rows}")
    w.emit(f"col_mask = cols < {L.n}")
    row_offs = emit_offsets(w.emit, [L.out_domain[d] for d in row_dims], [[st[d] for d in row_dims] for st in strides], "rows", "r")
    b_row = None
    if batch_dims:
        w.emit(f"batch = tl.program_id(1){cast}")
        batch_sizes = [L.out_domain[d] for d in batch_dims]
        batch_offs = emit_offsets(w.emit, batch_sizes, [[st[d] for d in batch_dims] for st in strides] + [[L.b_strides[d] for d in batch_dims]], "batch", "b")
        b_row = batch_offs[-1]
    else:
        batch_offs = [None] * (len(strides) + 1)
    for site, ro, bo in zip(sites, row_offs, batch_offs):
        w.site_offsets[site] = (ro, bo)

    a, b = dot.args
    b_index = program.input_of_load[b.uid]
    b_tensor = program.inputs[b_index]
    bk, bn = L.b_strides[-2], L.b_strides[-1]
    b_terms = [t for t in (b_row, _term("kk", bk), _term("cols", bn)) if t]

    def b_load(start: str) -> list[str]:
        return weight_tile("b_tile", b_index, b_tensor.dtype, " + ".join(b_terms) or "0", f"(kk < {L.k}) & col_mask",
                           L.b_packed, start, "BLOCK_K", "cols", "col_mask")
    prologue_values = [v for v in values if v.uid in L.prologue]
    if L.prologue_reduces and keeps_rows(L.k, L.operand_dtype):
        # 2+3, rows of A on chip: the norm's statistics and the product in one step, no passes over K.
        constexprs["BLOCK_K"] = dot_block(L.k, L.b_packed)
        w.emit("ks = tl.arange(0, BLOCK_K)[None, :]")
        w.emit("kk = tl.arange(0, BLOCK_K)[:, None]")
        w.emit(f"k_mask = ks < {L.k}")
        a_name = _Block(w, 1, "k", {}).value(a)
        w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))")
        for line in b_load("0"):
            w.emit(line)
        w.emit(f"acc = {_dot_line('a_tile', 'b_tile', L.operand_dtype, L.precision, L.b_packed)}")
    else:
        # 2. prologue reductions, one pass over K per level
        known = _emit_prepasses(w, prologue_values, L.k)
        # 3. main loop
        w.emit("acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)")
        w.emit(f"for k0 in range(0, {L.k}, BLOCK_K):")
        w.emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]", 2)
        w.emit(f"k_mask = ks < {L.k}", 2)
        w.emit("kk = k0 + tl.arange(0, BLOCK_K)[:, None]", 2)
        a_name = _Block(w, 2, "k", known).value(a)
        for line in b_load("k0"):
            w.emit(line, 2)
        w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))", 2)
        w.emit(f"acc += {_dot_line('a_tile', 'b_tile', L.operand_dtype, L.precision, L.b_packed)}", 2)

    # 4. epilogue and stores
    block = _Block(w, 1, "n", {dot.uid: "acc"})
    _emit_stores(w, program, block)
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr", "GROUP_M: tl.constexpr"]
    source, name = _assemble(program, w, blocks, helpers, "mm", strategy,
                             f"# product: rows {L.rows} x K {L.k} x N {L.n}, batch {L.batch}, "
                             f"operands {str(L.operand_dtype).removeprefix('torch.') if L.operand_dtype else L.precision}")

    def grid(config, rows=L.rows, n=L.n, batch=L.batch):
        block_n = constexprs.get("BLOCK_N", config.get("BLOCK_N"))
        return (triton_cdiv(rows, config["BLOCK_M"]) * triton_cdiv(n, block_n), batch)

    return KernelSource(name=name, source=source, layout="matmul", grid=grid, constexprs=constexprs)


def weight_tile(target: str, index: int, dtype: torch.dtype, offset: str, mask: str, packed: Optional[PackedOperand],
                start: str, width: str, across: str, across_mask: str) -> list[str]:
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
    s_terms = [_term(blocks, packed.strides[-2]) or f"{blocks} * 0"] + [t for t in [_term(across, packed.strides[-1])] if t]
    return [
        f"{blocks} = {start} // {packed.block} + tl.arange(0, {width} // {packed.block})[:, None]",
        f"{target}_scales = tl.load(in{packed.scales} + {' + '.join(s_terms)}, "
        f"mask=({blocks} < {packed.blocks}) & {across_mask}, other=0)",
        f"{target} = {packed.decode}(tl.load(in{index} + {offset}, mask={mask}, other=0), {target}_scales)",
    ]


def _term(axis: str, stride: int) -> Optional[str]:
    if stride == 0:
        return None
    return axis if stride == 1 else f"{axis} * {stride}"


def _all_values(program: GroupProgram) -> list[Value]:
    return sorted(collect_values(program.output_values).values(), key=lambda v: v.uid)


def _emit_rows(w: _MatmulWriter, out_domain, rows: int, sites: list, strides: list, wide: bool, grouped_n: Optional[int]) -> None:
    """Program ids -> ``rows``/``cols`` tiles, masks, and each site's row offset."""
    cast = ".to(tl.int64)" if wide else ""
    if grouped_n is None:
        w.emit(f"pid_m = tl.program_id(0){cast}")
        w.emit("cols = tl.arange(0, BLOCK_N)[None, :]")
    w.emit("rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
    w.emit(f"row_mask = rows < {rows}")
    w.emit(f"col_mask = cols < {out_domain[-1]}")
    row_dims = list(range(len(out_domain) - 1))
    offsets = emit_offsets(w.emit, [out_domain[d] for d in row_dims], [[st[d] for d in row_dims] for st in strides], "rows", "r")
    for site, ro in zip(sites, offsets):
        w.site_offsets[site] = (ro, None)


def _emit_prepasses(w: _MatmulWriter, prologue_values: list[Value], k: int, indent: int = 1) -> dict[int, str]:
    """Step 2 of the module doc: each level of prologue reductions is one pass over K."""
    known: dict[int, str] = {}
    for level in _reduction_levels(prologue_values):
        for v in level:
            name = w.fresh()
            known[v.uid] = name
            w.emit(f"{name} = tl.full((BLOCK_M, 1), {_NEUTRAL[v.reduce_op]}, tl.float32)", indent)
        w.emit(f"for k0 in range(0, {k}, BLOCK_K):", indent)
        w.emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]", indent + 1)
        w.emit(f"k_mask = ks < {k}", indent + 1)
        block = _Block(w, indent + 1, "k", {u: n for u, n in known.items() if u not in {v.uid for v in level}})
        for v in level:
            arg = block.value(v.args[0])
            part = row_reduction(v.reduce_op, f"tl.broadcast_to({arg}, (BLOCK_M, BLOCK_K))", "row_mask & k_mask")
            block.emit(f"{known[v.uid]} = {_COMBINE[v.reduce_op].format(known[v.uid], part)}")
    return known


#: Bytes of one row of A (K padded to a power of 2) up to which a program keeps its
#: rows of A on chip instead of streaming them in BLOCK_K steps, and computes their
#: norm in one go: K <= 256 for 16-bit operands, K <= 128 for fp32 (measured on an
#: H200: fp32 rows of 256 spill and run 3x slower than streaming).
RESIDENT_ROW_BYTES = 512


def needs_int64(program: GroupProgram) -> bool:
    """Whether some offset into some tensor of the kernel (weights included) can pass 2**31 - 1."""
    extents = [sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride)) + 1
               for t in program.inputs + program.outputs]
    return max(extents + [math.prod(program.domain)]) > INT32_LIMIT


def dot_block(n: int, packed: Optional[PackedOperand] = None) -> int:
    """A block size covering ``n`` that ``tl.dot`` accepts (16 at least), and a
    multiple of a quantised weight's block when it runs along that weight's reduction."""
    return max(16, packed.block if packed is not None else 1, next_power_of_2(n))


def keeps_rows(k: int, operand_dtype) -> bool:
    return dot_block(k) * (2 if operand_dtype is not None else 4) <= RESIDENT_ROW_BYTES


def _operand(expr: str, dtype) -> str:
    """``expr`` converted once to a product's operand dtype."""
    if dtype is None:
        return expr
    if dtype == torch.bfloat16 and interpreting():
        return rounded(expr, dtype)
    return f"{expr}.to({TL_DTYPES[dtype]})"


def _dot_line(a: str, b: str, dtype, precision: str, packed: Optional[PackedOperand] = None) -> str:
    if dtype is None and precision == "tf32x3" and packed is not None and packed.exact_tf32:
        # b is exact in TF32: a = a_hi + a_lo in TF32 parts, two products instead of three.
        hi = f"({a}.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)"
        return (f"tl.dot({hi}, {b}, input_precision=\"tf32\") + "
                f"tl.dot({a} - {hi}, {b}, input_precision=\"tf32\")")
    if dtype is None:
        return f"tl.dot({a}, {b}, input_precision=\"{precision}\")"
    tl_dtype = TL_DTYPES[dtype]
    if dtype == torch.bfloat16 and interpreting():
        # The interpreter's bf16 dot is broken; round the operands and multiply in fp32 instead.
        return f"tl.dot({rounded(a, dtype)}, {rounded(b, dtype)}, input_precision=\"ieee\")"
    return f"tl.dot({a}.to({tl_dtype}), {b}.to({tl_dtype}))"


def write_mlp_kernel(program: GroupProgram, strategy: str, helpers: Optional[dict[str, str]] = None) -> KernelSource:
    """Two products with the hidden activation made and consumed ``BLOCK_H`` columns at a time:

    for each block of rows: prologue statistics (passes over K); then for each
    ``BLOCK_H`` slice of the hidden width, ``acc1 = A @ W1[:, slice]`` over K,
    the pointwise middle (bias, activation) on ``acc1``, and ``acc2 +=
    middle @ W2[slice, :]``; finally the epilogue on ``acc2`` (all N columns
    are in the program) and the stores.
    """
    L = program.matmul
    w = _MatmulWriter(program)
    values = _all_values(program)
    weights = {L.dot1.args[1].uid, L.dot2.args[1].uid}
    loads = [v for v in values if v.op == "load" and v.uid not in weights]
    sites = [("load", v.uid) for v in loads] + [("out", k) for k in range(len(program.outputs))]
    strides = [L.load_strides[v.uid] for v in loads] + [t.domain_stride for t in program.outputs]
    wide = needs_int64(program)
    constexprs = {"BLOCK_N": dot_block(L.n)}
    _emit_rows(w, L.out_domain, L.rows, sites, strides, wide, None)

    w1 = program.input_of_load[L.dot1.args[1].uid]
    w2 = program.input_of_load[L.dot2.args[1].uid]
    (w1k, w1h), (w2h, w2n) = L.w1_strides, L.w2_strides
    w1_off = " + ".join(t for t in (_term("kk", w1k), _term("hs", w1h)) if t) or "0"
    w1_dtype, w2_dtype = program.inputs[w1].dtype, program.inputs[w2].dtype
    resident = keeps_rows(L.k, L.operand_dtypes[0])
    if resident:
        # The rows of A fit on chip: compute them (with their norm) once and reuse them
        # for every slice of the hidden width.
        constexprs["BLOCK_K"] = dot_block(L.k, L.w1_packed)
        w.emit("ks = tl.arange(0, BLOCK_K)[None, :]")
        w.emit("kk = tl.arange(0, BLOCK_K)[:, None]")
        w.emit(f"k_mask = ks < {L.k}")
        a_name = _Block(w, 1, "k", {}).value(L.dot1.args[0])
        w.emit(f"a_op = {_operand(f'tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))', L.operand_dtypes[0])}")
    else:
        known = _emit_prepasses(w, [v for v in values if v.uid in L.prologue], L.k)
    w.emit("acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)")
    w.emit(f"for h0 in range(0, {L.h}, BLOCK_H):")
    w.emit("hs = h0 + tl.arange(0, BLOCK_H)[None, :]", 2)
    w.emit("hh = h0 + tl.arange(0, BLOCK_H)[:, None]", 2)
    w.emit(f"h_mask = hs < {L.h}", 2)
    if resident:
        for line in weight_tile("w1_tile", w1, w1_dtype, w1_off, f"(kk < {L.k}) & h_mask", L.w1_packed, "0",
                                "BLOCK_K", "hs", "h_mask"):
            w.emit(line, 2)
        w.emit(f"acc1 = {_dot_line('a_op', 'w1_tile', L.operand_dtypes[0], L.precision, L.w1_packed)}", 2)
    else:
        w.emit("acc1 = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)", 2)
        w.emit(f"for k0 in range(0, {L.k}, BLOCK_K):", 2)
        w.emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]", 3)
        w.emit("kk = k0 + tl.arange(0, BLOCK_K)[:, None]", 3)
        w.emit(f"k_mask = ks < {L.k}", 3)
        a_name = _Block(w, 3, "k", known).value(L.dot1.args[0])
        for line in weight_tile("w1_tile", w1, w1_dtype, w1_off, f"(kk < {L.k}) & h_mask", L.w1_packed, "k0",
                                "BLOCK_K", "hs", "h_mask"):
            w.emit(line, 3)
        w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))", 3)
        w.emit(f"acc1 += {_dot_line('a_tile', 'w1_tile', L.operand_dtypes[0], L.precision, L.w1_packed)}", 3)
    block = _Block(w, 2, "h", {L.dot1.uid: "acc1"})
    hidden = block.value(L.dot2.args[0])
    w2_off = " + ".join(t for t in (_term("hh", w2h), _term("cols", w2n)) if t) or "0"
    for line in weight_tile("w2_tile", w2, w2_dtype, w2_off, f"(hh < {L.h}) & col_mask", L.w2_packed, "h0",
                            "BLOCK_H", "cols", "col_mask"):
        w.emit(line, 2)
    # Hidden columns past H hold act(0) but meet zero rows of W2: they add nothing.
    w.emit(f"hidden_tile = tl.broadcast_to({hidden}, (BLOCK_M, BLOCK_H))", 2)
    w.emit(f"acc2 += {_dot_line('hidden_tile', 'w2_tile', L.operand_dtypes[1], L.precision, L.w2_packed)}", 2)

    block = _Block(w, 1, "n", {L.dot2.uid: "acc2"})
    _emit_stores(w, program, block)
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr", "BLOCK_H: tl.constexpr"]
    source, name = _assemble(program, w, blocks, helpers, "mlp", strategy,
                             f"# MLP: rows {L.rows} x K {L.k} -> hidden {L.h} -> N {L.n}, operands "
                             f"{[str(d).removeprefix('torch.') if d else L.precision for d in L.operand_dtypes]}")

    def grid(config, rows=L.rows):
        return (triton_cdiv(rows, config["BLOCK_M"]),)

    return KernelSource(name=name, source=source, layout="mlp", grid=grid, constexprs=constexprs)


def _emit_stores(w: _MatmulWriter, program: GroupProgram, block: _Block) -> None:
    """Step 4's stores: each output through its own strides, masked to the tile."""
    results = [block.value(v) for v in program.output_values]
    for k, (t, res) in enumerate(zip(program.outputs, results)):
        ro, bo = w.site_offsets[("out", k)]
        # rows and cols always appear (times 0 for one row or a width-1 output), so the
        # pointer tile is [BLOCK_M, BLOCK_N].
        n_term = _term("cols", t.domain_stride[-1]) or "cols * 0"
        off = " + ".join(x for x in (ro or "rows * 0", bo, n_term) if x)
        store = res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])
        w.emit(f"tl.store(out{k} + {off}, tl.broadcast_to({store}, (BLOCK_M, BLOCK_N)), mask=row_mask & col_mask)")


def _assemble(program, w, blocks, helpers, layout, strategy, extra_header):
    params = [f"in{k}" for k in range(len(program.inputs))] + [f"out{k}" for k in range(len(program.outputs))]
    body = "\n".join(w.lines)
    helper_text = used_helpers(helpers, body)
    digest = hashlib.sha256(f"{helper_text}\n{', '.join(params + blocks)}\n{body}".encode()).hexdigest()[:10]
    stem = "_".join(dict.fromkeys(_short(op) for op in program.op_names))[:48].strip("_")
    name = f"af_{layout}_{stem}_{digest}"
    header = _header(program, layout, strategy) + "\n" + extra_header
    source = (
        f"{header}\nimport triton\nimport triton.language as tl\n\n\n"
        + (helper_text + "\n\n\n" if helper_text else "")
        + f"@triton.jit\ndef {name}({', '.join(params + blocks)}):\n{body}\n"
    )
    return source, name
