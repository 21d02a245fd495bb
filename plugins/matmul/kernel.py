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
stride scheme as ``autofuser_core/codegen.py``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch

from autofuser_core.codegen import (
    INT32_LIMIT,
    TL_DTYPES,
    KernelSource,
    _header,
    _short,
    emit_offsets,
    literal,
    row_reduction,
    triton_cdiv,
    used_helpers,
)
from autofuser_core.group import GroupProgram, collect_values
from autofuser_core.ir import Value
from autofuser_core.rounding import interpreting, rounded, stored

from .layout import PackedOperand, dot_block

_NEUTRAL = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}
_COMBINE = {
    "sum": "{0} + {1}",
    "max": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "min": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
}


class DagBlock:
    """Emits one straight-line block of the DAG (its own memo: loads differ per loop step)."""

    def __init__(self, writer: "MatmulWriter", indent: int, site, known: dict[int, str]):
        self.w = writer
        self.indent = indent
        # The inner axis of this block's tiles: "k" loads at (rows, ks), "n" at (rows, cols); a
        # strategy with another axis passes its own (offsets name, mask name, block constexpr).
        self.axis, self.axis_mask, self.width = (
            {"k": ("ks", "k_mask", "BLOCK_K"), "n": ("cols", "col_mask", "BLOCK_N")}[site]
            if isinstance(site, str)
            else site
        )
        self.names = dict(known)
        self.loads: dict[tuple, str] = {}

    def emit(self, line: str) -> None:
        self.w.lines.append("    " * self.indent + line)

    def value(self, v: Value) -> str:
        if v.uid in self.names:
            return self.names[v.uid]
        if v.op == "const":
            return literal(v.constant)
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


class MatmulWriter:
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
    w = MatmulWriter(program)
    dot = L.dot
    rank = len(L.out_domain)
    row_dims = [rank - 2] if L.batched else list(range(rank - 1))
    batch_dims = list(range(rank - 2)) if L.batched else []
    values = all_values(program)
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
    row_offs = emit_offsets(
        w.emit, [L.out_domain[d] for d in row_dims], [[st[d] for d in row_dims] for st in strides], "rows", "r"
    )
    b_row = None
    if batch_dims:
        w.emit(f"batch = tl.program_id(1){cast}")
        batch_sizes = [L.out_domain[d] for d in batch_dims]
        batch_offs = emit_offsets(
            w.emit,
            batch_sizes,
            [[st[d] for d in batch_dims] for st in strides] + [[L.b_strides[d] for d in batch_dims]],
            "batch",
            "b",
        )
        b_row = batch_offs[-1]
    else:
        batch_offs = [None] * (len(strides) + 1)
    for site, ro, bo in zip(sites, row_offs, batch_offs):
        w.site_offsets[site] = (ro, bo)

    a, b = dot.args
    b_index = program.input_of_load[b.uid]
    b_tensor = program.inputs[b_index]
    bk, bn = L.b_strides[-2], L.b_strides[-1]
    b_terms = [t for t in (b_row, index_term("kk", bk), index_term("cols", bn)) if t]

    def b_load(start: str) -> list[str]:
        return weight_tile(
            "b_tile",
            b_index,
            b_tensor.dtype,
            " + ".join(b_terms) or "0",
            f"(kk < {L.k}) & col_mask",
            L.b_packed,
            start,
            "BLOCK_K",
            "cols",
            "col_mask",
        )

    prologue_values = [v for v in values if v.uid in L.prologue]
    if L.resident:
        # 2+3, rows of A on chip: the norm's statistics and the product in one step, no passes over K.
        constexprs["BLOCK_K"] = L.block_k
        w.emit("ks = tl.arange(0, BLOCK_K)[None, :]")
        w.emit("kk = tl.arange(0, BLOCK_K)[:, None]")
        w.emit(f"k_mask = ks < {L.k}")
        a_name = DagBlock(w, 1, "k", {}).value(a)
        w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))")
        for line in b_load("0"):
            w.emit(line)
        w.emit(f"acc = {dot_line('a_tile', 'b_tile', L.operand_dtype, L.precision, L.b_packed)}")
    else:
        # 2. prologue reductions, one pass over K per level
        known = emit_prepasses(w, prologue_values, L.k)
        # 3. main loop
        w.emit("acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)")
        w.emit(f"for k0 in range(0, {L.k}, BLOCK_K):")
        w.emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]", 2)
        w.emit(f"k_mask = ks < {L.k}", 2)
        w.emit("kk = k0 + tl.arange(0, BLOCK_K)[:, None]", 2)
        a_name = DagBlock(w, 2, "k", known).value(a)
        for line in b_load("k0"):
            w.emit(line, 2)
        w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))", 2)
        w.emit(f"acc += {dot_line('a_tile', 'b_tile', L.operand_dtype, L.precision, L.b_packed)}", 2)

    # 4. epilogue and stores
    block = DagBlock(w, 1, "n", {dot.uid: "acc"})
    emit_stores(w, program, block)
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr", "GROUP_M: tl.constexpr"]
    source, name = assemble_kernel(
        program,
        w,
        blocks,
        helpers,
        "mm",
        strategy,
        f"# product: rows {L.rows} x K {L.k} x N {L.n}, batch {L.batch}, "
        f"operands "
        f"{str(L.operand_dtype).removeprefix('torch.') if L.operand_dtype else L.precision}",
    )

    def grid(config, rows=L.rows, n=L.n, batch=L.batch):
        block_n = constexprs.get("BLOCK_N", config.get("BLOCK_N"))
        return (triton_cdiv(rows, config["BLOCK_M"]) * triton_cdiv(n, block_n), batch)

    return KernelSource(name=name, source=source, layout="matmul", grid=grid, constexprs=constexprs)


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
    return axis if stride == 1 else f"{axis} * {stride}"


def all_values(program: GroupProgram) -> list[Value]:
    return sorted(collect_values(program.output_values).values(), key=lambda v: v.uid)


def emit_prepasses(w: MatmulWriter, prologue_values: list[Value], k: int, indent: int = 1) -> dict[int, str]:
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
        block = DagBlock(w, indent + 1, "k", {u: n for u, n in known.items() if u not in {v.uid for v in level}})
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


def emit_stores(w: MatmulWriter, program: GroupProgram, block: DagBlock) -> None:
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
