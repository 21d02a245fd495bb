"""The Triton source writer for MLP groups (``mlp_layout.MlpLayout``).

One program holds ``BLOCK_M`` rows and all ``N`` columns of the output, and
walks the hidden width ``H`` in ``BLOCK_H`` slices: each slice of the first
product's result, with the pointwise ops between the products applied, is
consumed by the second product at once, so the hidden activation never
reaches memory. The prologue (passes over ``K`` for a norm's statistics, or
rows of A kept on chip), the epilogue and the stores are the single-product
writer's (``autofuser.kernel``, tile products), as are the indexing scheme and
the kernel's name (``af_mlp_<ops>_<hash of the source>``). Where both weights
fit in shared memory the kernel has a second, persistent form
(``write_mlp_kernel``).
"""

from __future__ import annotations

import re
from typing import Optional

from autofuser import GroupProgram, KernelSource
from autofuser.kernel import (
    TileBlock,
    TileWriter,
    all_values,
    as_operand,
    assemble_kernel,
    dot_block,
    dot_line,
    emit_offsets,
    emit_prepasses,
    emit_stores,
    index_term,
    needs_int64,
    sized,
    triton_cdiv,
    weight_tile,
)

from .mlp_layout import PERSISTENT_BLOCK_H

#: The hidden axis of the second product's A tiles: (offsets, mask, block constexpr).
HIDDEN_AXIS = ("hs", "h_mask", "BLOCK_H")


def _emit_rows(
    w: TileWriter, out_domain, rows: int, sites: list, strides: list, wide: bool, tile: str = "tl.program_id(0)"
) -> None:
    """The row block ``tile`` -> ``rows`` tiles (all ``BLOCK_N`` columns), masks, and each site's row offset."""
    # tl.cast, not .to: the persistent form's tile is a Python int under the interpreter
    w.emit(f"pid_m = tl.cast({tile}, tl.int64)" if wide else f"pid_m = {tile}")
    w.emit("cols = tl.arange(0, BLOCK_N)[None, :]")
    w.emit("rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
    w.emit(f"row_mask = rows < {sized(rows)}")
    w.emit(f"col_mask = cols < {out_domain[-1]}")
    row_dims = list(range(len(out_domain) - 1))
    offsets = emit_offsets(
        w.emit, [out_domain[d] for d in row_dims], [[st[d] for d in row_dims] for st in strides], "rows", "r"
    )
    for site, ro in zip(sites, offsets):
        w.site_offsets[site] = (ro, None)


def write_mlp_kernel(program: GroupProgram, strategy: str, helpers: Optional[dict[str, str]] = None) -> KernelSource:
    """Two products with the hidden activation made and consumed ``BLOCK_H`` columns at a time:

    for each block of rows: prologue statistics (passes over K); then for each
    ``BLOCK_H`` slice of the hidden width, ``acc1 = A @ W1[:, slice]`` over K,
    the pointwise middle (bias, activation) on ``acc1``, and ``acc2 +=
    middle @ W2[slice, :]``; finally the epilogue on ``acc2`` (all N columns
    are in the program) and the stores.

    Where both weights fit in shared memory (``L.persistent``: enough rows, 16-bit
    operands, rows of A on chip), the kernel has a second form, chosen by the config's
    ``PERSISTENT``: a grid of at most ``PROGRAMS`` programs (one per
    multiprocessor) that each load both weights once - slice by slice, written
    out - and then walk row blocks ``tile, tile + PROGRAMS, ...``. Every row
    block then reads only its rows from memory: the weights come from shared
    memory, not again from L2 for each block. With ``SPLIT_TAIL`` the programs
    (exactly ``PROGRAMS`` of them) walk the rounds in which each has a whole
    block, then the rest of the rows as half blocks (``strategy.split_tail``).
    """
    L = program.product_layout
    constexprs = {"BLOCK_N": dot_block(L.n)}
    if L.resident:
        constexprs["BLOCK_K"] = L.block_k
    streamed = TileWriter(program)
    _write_rows(streamed, program, "tl.program_id(0)", None)
    w = streamed
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr", "BLOCK_H: tl.constexpr"]
    if L.persistent:
        w = TileWriter(program)
        weights = _write_weights(w, program)
        # SPLIT_TAIL: the rounds in which every program has a whole row block, then the
        # rest as half blocks, so the last round is half as long (``strategy.split_tail``
        # says where it is shorter).
        whole, halves = TileWriter(program), TileWriter(program)
        _write_rows(whole, program, "tile", weights)
        _write_rows(halves, program, "(2 * whole + tile)", weights)
        w.emit("if SPLIT_TAIL:  # whole row blocks while every program has one, then half blocks")
        w.emit(f"whole = {sized(L.rows)} // BLOCK_M // PROGRAMS * PROGRAMS", 2)
        w.emit("for tile in range(tl.program_id(0), whole, PROGRAMS):", 2)
        w.lines += ["        " + line for line in whole.lines]
        w.emit(
            f"for tile in range(tl.program_id(0), tl.cdiv({sized(L.rows)} - whole * BLOCK_M, BLOCK_M // 2), PROGRAMS):",
            2,
        )
        w.lines += ["        " + re.sub(r"\bBLOCK_M\b", "(BLOCK_M // 2)", line) for line in halves.lines]
        w.emit("else:")
        w.emit(f"for tile in range(tl.program_id(0), tl.cdiv({sized(L.rows)}, BLOCK_M), PROGRAMS):", 2)
        w.lines += ["        " + line for line in whole.lines]
        persistent = w.lines
        w.lines = (
            ["    if PERSISTENT:  # weights in shared memory, row blocks in a loop"]
            + ["    " + line for line in persistent]
            + ["    else:  # one row block per program, weight slices from memory"]
            + ["    " + line for line in streamed.lines]
        )
        blocks += ["PERSISTENT: tl.constexpr", "PROGRAMS: tl.constexpr", "SPLIT_TAIL: tl.constexpr"]
    source, name = assemble_kernel(
        program,
        w,
        blocks,
        helpers,
        "mlp",
        strategy,
        f"# MLP: rows {L.rows} x K {L.k} -> hidden {L.h} -> N {L.n}, operands "
        f"{[str(d).removeprefix('torch.') if d else L.precision for d in L.operand_dtypes]}",
    )

    def grid(config, rows=L.rows):
        blocks = triton_cdiv(rows, config["BLOCK_M"])
        if not config.get("PERSISTENT"):
            return (blocks,)
        # Split, each loop's stride is PROGRAMS: every one of them must run (some may find no block).
        return (config["PROGRAMS"] if config.get("SPLIT_TAIL") else min(blocks, config["PROGRAMS"]),)

    # The persistent form reads each weight once per program, in its prologue, and converts
    # it there: the launcher's conversion (two more launches per call) costs more than it
    # saves the kernel (BENCHMARKS.md, "Measurements behind rules in the code").
    return KernelSource(
        name=name,
        source=source,
        layout="mlp",
        grid=grid,
        constexprs=constexprs,
        converts_casts=lambda config: bool(config.get("PERSISTENT")),
    )


def _weight_names(program: GroupProgram):
    L = program.product_layout
    w1 = program.input_of_load[L.dot1.args[1].uid]
    w2 = program.input_of_load[L.dot2.args[1].uid]
    (w1k, w1h), (w2h, w2n) = L.w1_strides, L.w2_strides
    w1_off = " + ".join(t for t in (index_term("kk", w1k), index_term("hs", w1h)) if t) or "0"
    w2_off = " + ".join(t for t in (index_term("hh", w2h), index_term("cols", w2n)) if t) or "0"
    return w1, w2, w1_off, w2_off


def _hidden_slice(w: TileWriter, start: str, block: str, h: int, indent: int, rows: bool = True) -> None:
    """A hidden slice's offsets: ``hs`` along the columns (with ``h_mask``) and, with ``rows``,
    ``hh`` along the rows (where a W2 tile is loaded)."""
    w.emit(f"hs = {start} + tl.arange(0, {block})[None, :]", indent)
    if rows:
        w.emit(f"hh = {start} + tl.arange(0, {block})[:, None]", indent)
    w.emit(f"h_mask = hs < {h}", indent)


def _second_product(
    w: TileWriter, program: GroupProgram, indent: int, width: str, w2_tile: str, w2_load: list[str]
) -> None:
    """A hidden slice's middle (the pointwise ops on ``acc1``) and ``acc2 += middle @ W2``;
    ``w2_load``: the lines loading the slice's W2 tile, where it is not on chip yet."""
    L = program.product_layout
    hidden = TileBlock(w, indent, HIDDEN_AXIS, {L.dot1.uid: "acc1"}).value(L.dot2.args[0])
    for line in w2_load:
        w.emit(line, indent)
    # Hidden columns past H hold act(0) but meet zero rows of W2: they add nothing.
    w.emit(f"hidden_tile = tl.broadcast_to({hidden}, (BLOCK_M, {width}))", indent)
    w.emit(f"acc2 += {dot_line('hidden_tile', w2_tile, L.operand_dtypes[1], L.precision, L.w2_packed)}", indent)


def _write_weights(w: TileWriter, program: GroupProgram) -> list[tuple[str, str]]:
    """The persistent form's preamble: both weights, slice by slice, as product operands.
    Returns each slice's (W1 tile, W2 tile) names."""
    L = program.product_layout
    w1, w2, w1_off, w2_off = _weight_names(program)
    w.emit("cols = tl.arange(0, BLOCK_N)[None, :]")
    w.emit(f"col_mask = cols < {L.n}")
    w.emit("kk = tl.arange(0, BLOCK_K)[:, None]")
    names = []
    for s in range(triton_cdiv(L.h, PERSISTENT_BLOCK_H)):
        _hidden_slice(w, str(s * PERSISTENT_BLOCK_H), PERSISTENT_BLOCK_H, L.h, 1)
        pair = (f"w1_{s}", f"w2_{s}")
        for line in weight_tile(
            pair[0],
            w1,
            program.inputs[w1].dtype,
            w1_off,
            f"(kk < {L.k}) & h_mask",
            None,
            "0",
            "BLOCK_K",
            "hs",
            "h_mask",
        ):
            w.emit(line)
        for line in weight_tile(
            pair[1],
            w2,
            program.inputs[w2].dtype,
            w2_off,
            f"(hh < {L.h}) & col_mask",
            None,
            "0",
            "BLOCK_H",
            "cols",
            "col_mask",
        ):
            w.emit(line)
        w.emit(f"{pair[0]} = {as_operand(pair[0], L.operand_dtypes[0])}")
        w.emit(f"{pair[1]} = {as_operand(pair[1], L.operand_dtypes[1])}")
        names.append(pair)
    return names


def _write_rows(w: TileWriter, program: GroupProgram, tile: str, weights: Optional[list]) -> None:
    """One row block's code: ``tile`` is its index; ``weights`` the persistent form's
    weight slices (``_write_weights``), or ``None`` to stream them over ``BLOCK_H``."""
    L = program.product_layout
    values = all_values(program)
    weight_loads = {L.dot1.args[1].uid, L.dot2.args[1].uid}
    loads = [v for v in values if v.op == "load" and v.uid not in weight_loads]
    sites = [("load", v.uid) for v in loads] + [("out", k) for k in range(len(program.outputs))]
    strides = [L.load_strides[v.uid] for v in loads] + [t.domain_stride for t in program.outputs]
    _emit_rows(w, L.out_domain, L.rows, sites, strides, needs_int64(program), tile)

    w1, w2, w1_off, w2_off = _weight_names(program)
    w1_dtype, w2_dtype = program.inputs[w1].dtype, program.inputs[w2].dtype
    resident = L.resident
    if resident:
        # The rows of A fit on chip: compute them (with their norm) once and reuse them
        # for every slice of the hidden width.
        w.emit("ks = tl.arange(0, BLOCK_K)[None, :]")
        if weights is None:  # the W1 tiles' rows (the persistent form loaded its weights already)
            w.emit("kk = tl.arange(0, BLOCK_K)[:, None]")
        w.emit(f"k_mask = ks < {L.k}")
        a_name = TileBlock(w, 1, "k", {}).value(L.dot1.args[0])
        w.emit(f"a_op = {as_operand(f'tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))', L.operand_dtypes[0])}")
    else:
        known = emit_prepasses(w, [v for v in values if v.uid in L.prologue], L.k)
    w.emit("acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)")
    if weights:  # the slices written out, their tiles already on chip
        for s, (w1_tile, w2_tile) in enumerate(weights):
            _hidden_slice(w, str(s * PERSISTENT_BLOCK_H), PERSISTENT_BLOCK_H, L.h, 1, rows=False)
            w.emit(f"acc1 = {dot_line('a_op', w1_tile, L.operand_dtypes[0], L.precision)}")
            _second_product(w, program, 1, str(PERSISTENT_BLOCK_H), w2_tile, [])
    else:
        w.emit(f"for h0 in range(0, {L.h}, BLOCK_H):")
        _hidden_slice(w, "h0", "BLOCK_H", L.h, 2)
        if resident:
            for line in weight_tile(
                "w1_tile", w1, w1_dtype, w1_off, f"(kk < {L.k}) & h_mask", L.w1_packed, "0", "BLOCK_K", "hs", "h_mask"
            ):
                w.emit(line, 2)
            w.emit(f"acc1 = {dot_line('a_op', 'w1_tile', L.operand_dtypes[0], L.precision, L.w1_packed)}", 2)
        else:
            w.emit("acc1 = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)", 2)
            w.emit(f"for k0 in range(0, {L.k}, BLOCK_K):", 2)
            w.emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]", 3)
            w.emit("kk = k0 + tl.arange(0, BLOCK_K)[:, None]", 3)
            w.emit(f"k_mask = ks < {L.k}", 3)
            a_name = TileBlock(w, 3, "k", known).value(L.dot1.args[0])
            for line in weight_tile(
                "w1_tile", w1, w1_dtype, w1_off, f"(kk < {L.k}) & h_mask", L.w1_packed, "k0", "BLOCK_K", "hs", "h_mask"
            ):
                w.emit(line, 3)
            w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))", 3)
            w.emit(f"acc1 += {dot_line('a_tile', 'w1_tile', L.operand_dtypes[0], L.precision, L.w1_packed)}", 3)
        w2_load = weight_tile(
            "w2_tile",
            w2,
            w2_dtype,
            w2_off,
            f"(hh < {L.h}) & col_mask",
            L.w2_packed,
            "h0",
            "BLOCK_H",
            "cols",
            "col_mask",
        )
        _second_product(w, program, 2, "BLOCK_H", "w2_tile", w2_load)

    block = TileBlock(w, 1, "n", {L.dot2.uid: "acc2"})
    emit_stores(w, program, block)
