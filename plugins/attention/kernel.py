"""The online-softmax (flash-style) attention kernel writer.

Grid: (query blocks, batch entries). One program computes ``BLOCK_M`` rows
of the output of one batch entry (one head of one sample):

1. it loads its ``BLOCK_M x D`` tile of q once (running the written-out ops
   on q, if any) and keeps it, as the product's operand, in registers;
2. it walks the keys ``BLOCK_N`` at a time: loads k's tile transposed
   (``[D, BLOCK_N]``, through k's own strides), ``s = q @ k^T`` in fp32, then
   the scale and mask (SDPA) or the written-out steps (scale, bias,
   ``masked_fill``/``where``, each rounded where eager rounds); keys past M,
   and for ``is_causal`` keys after the query, get -inf;
3. online softmax in base 2: ``m`` is the running row max, ``l`` the running
   sum of ``exp2(s - m)`` and ``acc`` the running ``p @ v``; when a block
   raises the max, ``l`` and ``acc`` are rescaled by ``exp2(m_old - m_new)``;
   ``p`` is rounded to v's operand dtype for the product, as eager's
   probabilities are;
4. ``out = acc / l``, stored in the output's dtype through its strides.

The N x M scores only ever exist as one ``BLOCK_M x BLOCK_N`` tile in
registers: the kernel's one store is the output's. Head widths are padded to
a power of two >= 16 (``tl.dot``'s minimum) with masks; shapes and strides
are compile-time constants, like every AutoFuser kernel.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Optional

import torch

from autofuser import KernelSource, Value
from autofuser.kernel import (
    INT32_LIMIT,
    POINTER_TYPES,
    TL_DTYPES,
    ValueEmitter,
    as_operand,
    cdiv_text,
    chain_digest,
    chain_module,
    chain_stages,
    dot_block,
    dot_line,
    emit_offsets,
    index_term,
    interpreting,
    op_label,
    rounded,
    sized,
    stored,
    triton_cdiv,
    used_helpers,
)
from autofuser.kernel import kernel_header as core_kernel_header

from .layout import AttentionLayout, Operand, Step
from .prepass import (
    PASS_ROWS,
    SPLIT_DTYPE,
    SPLIT_EXPONENT,
    pass_modes,
    power_of_two,
    split_lines,
    write_max_pass,
    write_pass,
)

LOG2E = 1.4426950408889634
ROUNDED = (torch.float16, torch.bfloat16)


def _all(masks) -> str:
    """``a & b``, each comparison parenthesised (``&`` binds tighter than ``<``)."""
    return " & ".join(f"({m})" if " " in m and len(masks) > 1 else m for m in masks)


def load_cast(tensor_dtype: torch.dtype, operand_dtype: Optional[torch.dtype], need_fp32: bool = False) -> str:
    """How an operand tile is loaded: as stored when that already is the product's
    operand dtype (the dot reads it as is), else converted to fp32 (and rounded
    to the operand dtype by ``as_operand``/``dot_line``). The interpreter's bf16
    product works on rounded fp32 values, so there bf16 is loaded as fp32 too."""
    if tensor_dtype == torch.float32:
        return ""
    native = tensor_dtype == operand_dtype and not (tensor_dtype == torch.bfloat16 and interpreting())
    return "" if native and not need_fp32 else ".to(tl.float32)"


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.count = 0
        self.bases: dict[int, str] = {}  # operand id -> its batch entry's base pointer
        self.modes: dict[str, Optional[str]] = {"q": None, "k": None, "v": None}  # prepass.pass_modes

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)

    def fresh(self) -> str:
        self.count += 1
        return f"t{self.count}"

    def tile_load(
        self, op: Operand, base: str, rows: str, cols: str, masks: tuple, cast: str, full: bool = False
    ) -> str:
        """``tl.load`` of ``op`` at ``rows`` x ``cols``, masked along the axes it walks. ``full``:
        the tile has both axes even where the tensor broadcasts (``tl.dot`` operands)."""
        terms, used = [], []
        for axis, stride, mask in ((rows, op.row_stride, masks[0]), (cols, op.col_stride, masks[1])):
            term = index_term(axis, stride) or (f"{axis} * 0" if full else None)
            if term:
                terms.append(term)
                used += [mask] if mask else []
        if not terms:
            return f"tl.load({base}){cast}"
        mask = f", mask={_all(used)}, other=0" if used else ""
        return f"tl.load({base} + {' + '.join(terms)}{mask}){cast}"

    def steps(self, steps: list[Step], current: str, tiles: dict, indent: int, counts: bool = False) -> str:
        """Emit written-out ``steps`` on the tile named ``current``; returns the result's name.
        ``counts``: a constant that is a size derived from a dynamic one, or its reciprocal
        (the ``/ n`` of linear attention), is read at run time (``run_time_constant``)."""
        loaded: dict = {}
        for step in steps:
            result = _StepValues(self, current, tiles, loaded, indent, counts).value(step.value)
            if step.dtype in ROUNDED:
                result = rounded(result, step.dtype)
            self.emit(f"{current} = {result}  # {op_label(step.node)}", indent)
        return current


def run_time_constant(constant) -> Optional[str]:
    """A step's constant as a run-time size where it is one that derives from a dynamic
    size (``sized``), ``n``, or its reciprocal ``1 / n`` (``x / n``, ``x * (1.0 / n)``:
    linear attention's scale by the point count, which capture wrote as a literal);
    else ``None`` (the literal stays). Which constants are named never decides
    correctness: each program passes its own sizes."""
    if isinstance(constant, bool) or not isinstance(constant, (int, float)) or not math.isfinite(constant):
        return None
    if constant >= 2 and float(constant).is_integer():
        name = sized(int(constant))
        return None if name == str(int(constant)) else name
    if 0 < constant <= 0.5:
        n = round(1.0 / constant)
        name = sized(n)
        # Only an exact reciprocal: 1.0 / n in double is what ``1.0 / n`` wrote.
        return f"(1.0 / {name})" if 1.0 / n == constant and name != str(n) else None
    return None


class _StepValues(ValueEmitter):
    """One written-out step's values on the tile named ``current``: a load of a
    tensor in ``tiles`` reads it at (rows, keys), once for all the steps
    (``loaded``); any other load is the previous step's result."""

    def __init__(self, writer: _Writer, current: str, tiles: dict, loaded: dict, indent: int, counts: bool = False):
        super().__init__()
        self.w, self.current, self.tiles, self.loaded, self.indent = writer, current, tiles, loaded, indent
        self.counts = counts

    def value(self, v: Value) -> str:
        if self.counts and v.op == "const" and v.size is None:
            found = run_time_constant(v.constant)
            if found is not None:
                return found
        return super().value(v)

    def emit(self, line: str) -> None:
        self.w.emit(line, self.indent)

    def fresh(self) -> str:
        return self.w.fresh()

    def load(self, v: Value) -> str:
        if v.source not in self.tiles:
            return self.current  # the previous step's result
        if v.source not in self.loaded:
            op = self.tiles[v.source]
            name = f"x{op.index}"
            cast = "" if op.dtype == torch.bool else ".to(tl.float32)"
            tile = self.w.tile_load(op, self.w.bases[id(op)], "rows", "keys", ("row_mask", "key_mask"), cast)
            self.emit(f"{name} = {tile}")
            self.loaded[v.source] = name
        return self.loaded[v.source]


def write_attention_kernel(program, strategy: str, helpers: Optional[dict[str, str]] = None) -> KernelSource:
    """Write the Triton source for an ``AttentionProgram``; see module doc."""
    L: AttentionLayout = program.attention
    w = _Writer()
    w.modes = pass_modes(L)
    block_d, block_dv = dot_block(L.d), dot_block(L.dv)
    extents = [
        L.q.extent(L.batch, L.n, L.d),
        L.k.extent(L.batch, L.m, L.d),
        L.v.extent(L.batch, L.m, L.dv),
        L.out.extent(L.batch, L.n, L.dv),
    ]
    if any(w.modes.values()):
        extents.append(L.batch_numel * max(L.n, L.m) * max(block_d, block_dv))  # the passes' copies
    extents += [op.extent(L.batch, L.n, L.m) for op in ([L.mask] if L.mask else []) + list(L.tiles.values())]
    wide = max(extents) > INT32_LIMIT
    cast64 = ".to(tl.int64)" if wide else ""

    # Operands and the base pointer of this program's batch entry in each; q, k and v after
    # a pass are read from its contiguous scratch instead.
    operands = [(name, "in", op) for name, op in (("q", L.q), ("k", L.k), ("v", L.v)) if w.modes[name] is None]
    operands.append(("out", "out", L.out))
    if L.mask is not None:
        operands.append(("mask", "in", L.mask))
    operands += [(f"x{op.index}", "in", op) for op in L.tiles.values()]
    w.emit(f"pid_m = tl.program_id(0){cast64}")
    w.emit(f"batch = tl.program_id(1){cast64}")
    offsets = emit_offsets(w.emit, list(L.batch), [list(op.batch_strides) for _, _, op in operands], "batch", "b")
    for (name, kind, op), off in zip(operands, offsets):
        w.emit(f"{name}_base = {kind}{op.index}" + (f" + {off}" if off else ""))
        w.bases[id(op)] = f"{name}_base"
    for name, rows, width in (("q", L.n, block_d), ("k", L.m, block_d), ("v", L.m, block_dv)):
        if w.modes[name] is not None:
            parts = ("a", "b") if w.modes[name] == "split" else ("a",)
            for part in parts:
                w.emit(f"{name}{part}_base = {name}_{part} + batch * {rows * width}  # the pass's contiguous copy")
            if w.modes[name] == "split" and name != "k":
                w.emit(f"{name}f_base = {name}_f + batch * {rows}  # its rows' unscale factors")

    w.emit("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # this program's queries")
    w.emit(f"row_mask = rows < {L.n}")
    w.emit("d_cols = tl.arange(0, BLOCK_D)[None, :]  # head width, along q's tile")
    w.emit("d_rows = tl.arange(0, BLOCK_D)[:, None]  # head width, along k^T's tile")
    w.emit("dv_cols = tl.arange(0, BLOCK_DV)[None, :]  # head width of v and the output")
    d_mask = f"d_cols < {L.d}" if L.d < block_d else None
    dr_mask = f"d_rows < {L.d}" if L.d < block_d else None
    dv_mask = f"dv_cols < {L.dv}" if L.dv < block_dv else None

    # 1. q's tile, once.
    if w.modes["q"] == "split":  # its written-out ops were applied by the pass
        w.emit("q_hi = tl.load(qa_base + rows * BLOCK_D + d_cols, mask=row_mask, other=0)")
        w.emit("q_lo = tl.load(qb_base + rows * BLOCK_D + d_cols, mask=row_mask, other=0)")
        w.emit("q_f = tl.load(qf_base + rows, mask=row_mask, other=0)")
        # k has one scale per batch entry (prepass.write_max_pass): both undone by one factor.
        w.emit(f"q_f = q_f * {power_of_two(f'tl.load(k_e + batch) - {SPLIT_EXPONENT}')}")
    else:
        q_cast = load_cast(L.q.dtype, L.qk_dtype, need_fp32=bool(L.q_steps))
        w.emit(f"q = {w.tile_load(L.q, 'q_base', 'rows', 'd_cols', ('row_mask', d_mask), q_cast, full=True)}")
        if L.q_steps:
            w.steps(L.q_steps, "q", {}, 1)
        operand = as_operand("q", L.qk_dtype) if q_cast or L.q_steps else "q"
        if operand != "q":
            w.emit(f"q = {operand}  # the product's operand dtype")

    # 2.-3. the keys, BLOCK_N at a time, with the running max, sum and accumulator.
    if L.form == "fourier":
        _fourier_loop(w, L, dr_mask, dv_mask)
    else:
        _softmax_loop(w, L, dr_mask, dv_mask)

    # 4. normalise and store.
    if L.form == "fourier":
        w.emit("out = acc  # no softmax: the products' sum is the output")
        if L.out_steps and L.pv_dtype in ROUNDED:
            w.emit(f"out = {rounded('out', L.pv_dtype)}  # the product's dtype")
        w.steps(L.out_steps, "out", {}, 1)
    elif L.empty_rows_zero:
        w.emit("out = tl.where(l_i == 0, 0.0, acc / l_i)  # all keys masked: 0, as torch gives (NaN stays NaN)")
    else:
        w.emit("out = acc / l_i  # a row whose scores are all -inf gives NaN, as eager's softmax does")
    out_off = " + ".join(
        [index_term("rows", L.out.row_stride) or "rows * 0", index_term("dv_cols", L.out.col_stride) or "dv_cols * 0"]
    )
    out_mask = _all([m for m in ("row_mask", dv_mask) if m])
    w.emit(f"tl.store(out_base + {out_off}, {stored('out', L.out.dtype, TL_DTYPES[L.out.dtype])}, mask={out_mask})")
    if any(w.modes.values()):
        return _finish_chain(program, strategy, helpers, w, L, block_d, block_dv, cast64)
    return _finish(program, strategy, helpers, w, L, block_d, block_dv)


def _key_block(w: _Writer, L: AttentionLayout, dr_mask) -> None:
    """The loop head: this block's keys, k's tile transposed and ``s = q @ k^T``."""
    w.emit(f"for n0 in range(0, {'hi' if L.causal else L.m}, BLOCK_N):")
    w.emit("keys = n0 + tl.arange(0, BLOCK_N)[None, :]  # along the scores' columns", 2)
    w.emit("key_rows = n0 + tl.arange(0, BLOCK_N)[:, None]  # the same keys, along v's rows", 2)
    w.emit(f"key_mask = keys < {L.m}", 2)
    mode = w.modes["k"]
    if mode is None:
        k_cast = load_cast(L.k.dtype, L.qk_dtype)
        w.emit(f"kt = {w.tile_load(L.k, 'k_base', 'keys', 'd_rows', ('key_mask', dr_mask), k_cast, full=True)}", 2)
        w.emit(f"s = {dot_line('q', 'kt', L.qk_dtype, L.precision)}  # q @ k^T", 2)
        return
    if mode == "copy":
        cast = load_cast(L.qk_dtype, L.qk_dtype)
        w.emit(f"kt = tl.load(ka_base + keys * BLOCK_D + d_rows, mask=key_mask, other=0){cast}", 2)
        w.emit(f"s = {dot_line('q', 'kt', L.qk_dtype, L.precision)}  # q @ k^T", 2)
        return
    w.emit("kt_hi = tl.load(ka_base + keys * BLOCK_D + d_rows, mask=key_mask, other=0)", 2)
    w.emit("kt_lo = tl.load(kb_base + keys * BLOCK_D + d_rows, mask=key_mask, other=0)", 2)
    w.emit("s = tl.dot(q_lo, kt_hi)  # q @ k^T in three fp16 products, the small ones first", 2)
    w.emit("s = tl.dot(q_hi, kt_lo, s)", 2)
    w.emit("s = tl.dot(q_hi, kt_hi, s)", 2)
    w.emit("s = s * q_f  # the scales undone: powers of two, exact", 2)


def _load_v(w: _Writer, L: AttentionLayout, dv_mask) -> None:
    if w.modes["v"] is None:
        v_cast = load_cast(L.v.dtype, L.pv_dtype)
        v_tile = w.tile_load(L.v, "v_base", "key_rows", "dv_cols", (f"key_rows < {L.m}", dv_mask), v_cast, full=True)
        w.emit(f"v = {v_tile}", 2)
    else:  # the copy made by the pass: contiguous, and 0 past the head width
        w.emit(
            f"v = tl.load(va_base + key_rows * BLOCK_DV + dv_cols, mask=key_rows < {L.m}, other=0)"
            f"{load_cast(L.pv_dtype, L.pv_dtype)}",
            2,
        )


def _split_pv(w: _Writer, L: AttentionLayout) -> str:
    """``p @ v`` from v's split rows (``prepass.py``): each key's unscale factor ``f`` moves
    onto its column of p, and each query's row of ``p * f`` is scaled by a power of two so
    that its largest lies in [2^14, 2^15) (fp16's range keeps every term within 2^-24 of the
    row's largest, whatever the rows of v around it); that power of two comes back on the
    product. Returns the product's expression."""
    w.emit("v_unscale = tl.load(vf_base + keys, mask=key_mask, other=0)", 2)
    w.emit("pf = p * v_unscale  # each key's weight times its unscale factor: powers of two, exact", 2)
    w.emit("g = tl.max(pf, axis=1)[:, None]", 2)
    w.emit(
        "g = (g.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)"
        "  # the power of two at or below it",
        2,
    )
    w.emit("g = tl.where(g > 0, g, 1.0)  # a row with no weight here (masked keys, subnormal g)", 2)
    w.emit("g_inv = ((254 << 23) - g.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # 1 / g, exact", 2)
    w.emit(f"pp = (pf * g_inv) * {float(2**SPLIT_EXPONENT)!r}  # below 2^{SPLIT_EXPONENT + 1}", 2)
    for line in split_lines("pp", "p", finite=True):
        w.emit(line, 2)
    w.emit(f"v_hi = tl.load(va_base + key_rows * BLOCK_DV + dv_cols, mask=key_rows < {L.m}, other=0)", 2)
    w.emit(f"v_lo = tl.load(vb_base + key_rows * BLOCK_DV + dv_cols, mask=key_rows < {L.m}, other=0)", 2)
    w.emit("pv = tl.dot(p_lo, v_hi)  # p @ v in three fp16 products, the small ones first", 2)
    w.emit("pv = tl.dot(p_hi, v_lo, pv)", 2)
    w.emit("pv = tl.dot(p_hi, v_hi, pv)", 2)
    return f"pv * (g * {2.0**-SPLIT_EXPONENT!r})"


def _fourier_loop(w: _Writer, L: AttentionLayout, dr_mask, dv_mask) -> None:
    """``acc += steps(q @ k^T) @ v`` block by block: no softmax, so no running max or sum."""
    w.emit("acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)  # running sum of s @ v")
    _key_block(w, L, dr_mask)
    if L.scores_dtype in ROUNDED:
        w.emit(f"s = {rounded('s', L.scores_dtype)}  # the product's dtype", 2)
    w.steps(L.score_steps, "s", L.tiles, 2)
    w.emit("s = tl.where(key_mask, s, 0.0)  # keys past M add nothing", 2)
    _load_v(w, L, dv_mask)
    w.emit(f"acc += {dot_line('s', 'v', L.pv_dtype, L.precision)}", 2)


def _softmax_loop(w: _Writer, L: AttentionLayout, dr_mask, dv_mask) -> None:
    w.emit('m_i = tl.full((BLOCK_M, 1), float("-inf"), tl.float32)  # running row max of s (base 2)')
    w.emit("l_i = tl.zeros((BLOCK_M, 1), tl.float32)  # running sum of exp2(s - m_i)")
    w.emit("acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)  # running sum of p @ v")
    if L.causal:
        w.emit(f"hi = tl.minimum({L.m}, (pid_m + 1) * BLOCK_M)  # causal: no key after this block's last query")
    _key_block(w, L, dr_mask)
    if L.form == "sdpa":
        if L.mask is None:
            w.emit(f"s = s * {L.scale * LOG2E!r}  # scale, and base 2 for exp2", 2)
        else:
            mask_cast = "" if L.mask.dtype == torch.bool else ".to(tl.float32)"
            w.emit(f"mask = {w.tile_load(L.mask, 'mask_base', 'rows', 'keys', ('row_mask', 'key_mask'), mask_cast)}", 2)
            if L.mask.dtype == torch.bool:
                w.emit(f"""s = tl.where(mask, s * {L.scale * LOG2E!r}, float("-inf"))  # scale, bool mask, base 2""", 2)
            else:
                w.emit(f"s = (s * {L.scale!r} + mask) * {LOG2E!r}  # scale, additive mask, base 2", 2)
    else:
        if L.scores_dtype in ROUNDED:
            w.emit(f"s = {rounded('s', L.scores_dtype)}  # the product's dtype", 2)
        w.steps(L.score_steps, "s", L.tiles, 2)
        w.emit(f"s = s * {LOG2E!r}  # base 2 for exp2", 2)
    keep = "key_mask & (keys <= rows)" if L.causal else "key_mask"
    w.emit(
        f"""s = tl.where({keep}, s, float("-inf"))  # keys past M"""
        f"""{" or after the query" if L.causal else ""} weigh nothing""",
        2,
    )
    w.emit("m_new = tl.maximum(m_i, tl.max(s, axis=1)[:, None])", 2)
    w.emit('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0, not NaN', 2)
    w.emit("alpha = tl.exp2(m_i - m_safe)  # rescales what was summed under the old max", 2)
    w.emit("p = tl.exp2(s - m_safe)", 2)
    w.emit("l_i = l_i * alpha + tl.sum(p, axis=1)[:, None]", 2)
    if w.modes["v"] == "split":
        w.emit(f"acc = acc * alpha + {_split_pv(w, L)}", 2)
    else:
        _load_v(w, L, dv_mask)
        w.emit(f"acc = acc * alpha + {dot_line('p', 'v', L.pv_dtype, L.precision)}", 2)
    w.emit("m_i = m_new", 2)


def _finish(program, strategy, helpers, w: _Writer, L: AttentionLayout, block_d: int, block_dv: int) -> KernelSource:
    params = [f"in{k}" for k in range(len(program.inputs))] + ["out0"]
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_D: tl.constexpr", "BLOCK_DV: tl.constexpr"]
    body = "\n".join(w.lines)
    helper_text = used_helpers(helpers, body)
    digest = hashlib.sha256(f"{helper_text}\n{', '.join(params + blocks)}\n{body}".encode()).hexdigest()[:10]
    name = f"af_attention_{L.form}_{digest}"
    source = (
        f"{_header(program, strategy)}\nimport triton\nimport triton.language as tl\n\n\n"
        + (helper_text + "\n\n\n" if helper_text else "")
        + f"@triton.jit\ndef {name}({', '.join(params + blocks)}):\n{body}\n"
    )

    def grid(config, n=L.n, batch=L.batch_numel):
        return (triton_cdiv(n, config["BLOCK_M"]), batch)

    return KernelSource(
        name=name, source=source, layout="attention", grid=grid, constexprs={"BLOCK_D": block_d, "BLOCK_DV": block_dv}
    )


def _finish_chain(
    program, strategy, helpers, w: _Writer, L: AttentionLayout, block_d: int, block_dv: int, cast64: str
) -> KernelSource:
    """The kernel after passes over q, k and/or v (``prepass.py``): a chain of the passes (k's
    split takes two: its exponent first) and the attention kernel."""
    inputs = [f"in{k}" for k in range(len(program.inputs))]
    types = {name: POINTER_TYPES[t.dtype] for name, t in zip(inputs, program.inputs)}
    types["out0"] = POINTER_TYPES[L.out.dtype]
    sources, scratch, allocs, passes = [], [], [], []
    for name, op, rows, width, block, operand in (
        ("q", L.q, L.n, L.d, block_d, L.qk_dtype),
        ("k", L.k, L.m, L.d, block_d, L.qk_dtype),
        ("v", L.v, L.m, L.dv, block_dv, L.pv_dtype),
    ):
        mode = w.modes[name]
        if mode is None:
            continue
        dtype = SPLIT_DTYPE if mode == "split" else operand
        # A split k has one scale per batch entry (its exponent, "_e"), q and v one per row ("_f").
        per_entry = name == "k" and mode == "split"
        parts = [(f"{name}_a", dtype)]
        if mode == "split":
            parts += [(f"{name}_b", dtype), (f"{name}_e", torch.int32) if per_entry else (f"{name}_f", torch.float32)]
        shapes = {"a": (L.batch_numel, rows, block), "b": (L.batch_numel, rows, block), "f": (L.batch_numel, rows)}
        for part, part_dtype in parts:
            types[part] = POINTER_TYPES[part_dtype]
            if part.endswith("_e"):  # filled below any exponent: the max pass raises it
                allocs.append(f"{part} = torch.full(({L.batch_numel},), -128, dtype=torch.int32, device=device)")
            else:
                allocs.append(f"{part} = torch.empty({shapes[part[-1]]}, dtype={part_dtype}, device=device)")
        scratch += [part for part, _ in parts]
        steps = ()
        if name == "q" and L.q_steps:
            q_writer = _Writer()
            q_writer.steps(L.q_steps, "x", {}, 1)
            steps = tuple(q_writer.lines)
        width_key = "BLOCK_DV" if name == "v" else "BLOCK_D"
        if per_entry:
            sources.append(write_max_pass(L, name, op, rows, width, block, cast64))
            passes.append((f"{name}_max", rows, width_key, [f"{name}_e"], op.index))
        sources.append(write_pass(L, name, op, rows, width, block, mode, operand, cast64, steps, per_entry))
        passes.append((name, rows, width_key, [part for part, _ in parts], op.index))
    body = "\n".join(w.lines)
    read = [name for name in inputs if re.search(rf"\b{name}\b", body)]  # not what the passes read instead
    params = read + scratch + ["out0"]
    sources.append((params, ["BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV"], w.lines))
    bodies = "\n".join("\n".join(lines) for _, _, lines in sources)
    helper_text = used_helpers(helpers, bodies)
    # The name hashes what the launcher runs too (the scratch it allocates, the grids): a
    # process reuses a module by its name, and two programs can differ only there (the batch).
    launcher = repr((allocs, [(p[0], p[1]) for p in passes], L.n, L.batch_numel))
    name = f"af_attention_{L.form}_{chain_digest(helper_text, bodies, repr(params), launcher)}"
    stage_names = [f"{name}_pass_{p[0]}" for p in passes] + [f"{name}_attend"]
    functions, stages = chain_stages(stage_names, sources, types)
    launch = ["device = out0.device"] + allocs
    derived = {"PASS_ROWS": repr(PASS_ROWS)}
    for stage, (_, rows, width_key, parts, index) in zip(stages, passes):
        stage["constexprs"] = {"BLOCK_R": "PASS_ROWS", "BLOCK_W": width_key}
        # num_stages as warmup compiled them (no loop in a pass: only Triton's cache key sees it)
        launch.append(
            f"{stage['name']}[({cdiv_text(str(rows), str(PASS_ROWS))}, {L.batch_numel})](in{index}, "
            f"{', '.join(parts)}, BLOCK_R={PASS_ROWS}, BLOCK_W={width_key}, num_warps=num_warps, "
            "num_stages=num_stages)"
        )
    launch.append(
        f"{stage_names[-1]}[({cdiv_text(str(L.n), 'BLOCK_M')}, {L.batch_numel})]({', '.join(params)}, "
        "BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, num_warps=num_warps, "
        "num_stages=num_stages)"
    )
    signature = ", ".join(
        inputs + ["out0", "*", "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "num_warps=4", "num_stages=2"]
    )
    passes_text = ", ".join(f"{m} pass over {n}" for n, m in w.modes.items() if m)
    header = kernel_header(program, f"{strategy} strategy, online softmax after a {passes_text}", _sizes(L))
    source = chain_module(
        header, helper_text, functions, name, launch, signature, stages, derived, tuple(inputs + ["out0"])
    )
    return KernelSource(
        name=name,
        source=source,
        layout="attention_chain",
        grid=lambda config: (1,),
        constexprs={"BLOCK_D": block_d, "BLOCK_DV": block_dv},
    )


def _dtype(dtype) -> str:
    return "fp32" if dtype is None else str(dtype).removeprefix("torch.")


def kernel_header(program, title: str, sizes: str) -> str:
    """The core's kernel comment block, with the form recognised and the sizes."""
    return core_kernel_header(program, title, [program.summary, sizes])


def _sizes(L: AttentionLayout) -> str:
    fp32 = "3xFP16 (fp16 parts of scaled rows)" if pass_modes(L)["k"] == "split" else L.precision
    return (
        f"batch {list(L.batch)}, {L.n} queries, {L.m} keys, head widths {L.d} -> {L.dv}; operands of "
        f"q @ k^T {_dtype(L.qk_dtype)}, of p @ v {_dtype(L.pv_dtype)}"
        + (f", fp32 products {fp32}" if None in (L.qk_dtype, L.pv_dtype) else "")
    )


def _header(program, strategy: str) -> str:
    return kernel_header(program, f"{strategy} strategy, online softmax", _sizes(program.attention))
