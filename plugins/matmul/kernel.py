"""The Triton source writer for groups with one matrix product.

The kernel computes ``C[rows, cols]`` tiles of ``BLOCK_M x BLOCK_N``:

1. program ids map to tiles in grouped order (``GROUP_M`` row tiles share
   their column tiles' weights in L2); a second grid axis walks the batch when
   ``B`` has batch dims (folded into the first where the batch is longer than
   CUDA's second axis takes, ``MAX_GRID_YZ``);
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
stride scheme as ``autofuser.kernel.write_kernel``.
"""

from __future__ import annotations

from typing import Optional

from autofuser import GroupProgram, KernelSource
from autofuser.kernel import (
    MAX_GRID_YZ,
    TileBlock,
    TileWriter,
    all_values,
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

#: Strict fp32 products sum K in chunks of this many elements (a multiple of every BLOCK_K).
K_CHUNK = 512


def strict_fp32(layout) -> bool:
    """Whether a product runs in fp32 at fp32's accuracy (no 16-bit operands, no TF32)."""
    return layout.operand_dtype is None and layout.precision != "tf32"


def write_matmul_kernel(
    program: GroupProgram, strategy: str, helpers: Optional[dict[str, str]] = None, split: bool = False
) -> KernelSource:
    """Write the Triton source for a group with one product; see module doc. ``split``: a
    lone product (its only output, no prologue reduction, no packed weight, written
    contiguous) whose K the programs split among them (``SPLIT_K``, grid axis 0): each
    program sums its share of K for its tile and stores it unrounded as one fp32 partial
    row of the output's size (``KernelSource.partial_outputs``); the launcher adds the
    rows. For outputs of a few tiles over a long K (a weight's gradient over every point,
    a head's K^T V), whose unsplit grid would leave most of the chip idle."""
    L = program.product_layout
    w = TileWriter(program)
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

    # More batch entries than CUDA's grid takes on an axis of its own (MAX_GRID_YZ): the batch
    # is folded into axis 0, each program's batch entry the quotient of its id by the tiles.
    folded = bool(batch_dims) and not split and L.batch > MAX_GRID_YZ
    cast = ".to(tl.int64)" if wide else ""
    w.emit(f"num_m = tl.cdiv({sized(L.rows)}, BLOCK_M)")
    w.emit(f"num_n = tl.cdiv({sized(L.n)}, BLOCK_N)")
    if folded:
        w.emit(f"pid_all = tl.program_id(0){cast}")
        w.emit("pid = pid_all % (num_m * num_n)")
    else:
        w.emit(f"pid = tl.program_id({1 if split else 0})")
    w.emit("in_group = GROUP_M * num_n")
    w.emit("first_m = (pid // in_group) * GROUP_M")
    w.emit("size_m = tl.minimum(num_m - first_m, GROUP_M)")
    w.emit("pid_m = first_m + (pid % in_group) % size_m")
    w.emit("pid_n = (pid % in_group) // size_m")
    w.emit(f"rows = (pid_m{cast} * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
    w.emit(f"cols = (pid_n{cast} * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]")
    w.emit(f"row_mask = rows < {sized(L.rows)}")
    w.emit(f"col_mask = cols < {sized(L.n)}")
    row_offs = emit_offsets(
        w.emit, [L.out_domain[d] for d in row_dims], [[st[d] for d in row_dims] for st in strides], "rows", "r"
    )
    b_row = None
    if batch_dims:
        w.emit("batch = pid_all // (num_m * num_n)" if folded else f"batch = tl.program_id({2 if split else 1}){cast}")
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

    # The K this program sums: all of it, or with ``split`` its share [k_lo, k_hi).
    k_end = "k_hi" if split else sized(L.k)
    if split:
        w.emit(f"k_per = tl.cdiv(tl.cdiv({sized(L.k)}, SPLIT_K), BLOCK_K) * BLOCK_K")
        w.emit("k_lo = tl.program_id(0) * k_per")
        w.emit(f"k_hi = tl.minimum(k_lo + k_per, {sized(L.k)})")

    def b_load(start: str) -> list[str]:
        return weight_tile(
            "b_tile",
            b_index,
            b_tensor.dtype,
            " + ".join(b_terms) or "0",
            f"(kk < {k_end}) & col_mask",
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
        w.emit(f"k_mask = ks < {sized(L.k)}")
        a_name = TileBlock(w, 1, "k", {}).value(a)
        w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))")
        for line in b_load("0"):
            w.emit(line)
        w.emit(f"acc = {dot_line('a_tile', 'b_tile', L.operand_dtype, L.precision, L.b_packed)}")
    else:
        # 2. prologue reductions, one pass over K per level
        known = emit_prepasses(w, prologue_values, L.k)
        # 3. main loop
        w.emit("acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)")
        chunked = strict_fp32(L) and L.k > K_CHUNK
        k_start = "k_lo" if split else "0"
        if chunked:
            # Tensor cores do not round each addition into their fp32 accumulator to nearest:
            # its error grows with K. A long K in strict fp32 is summed in chunks, each chunk's
            # sum added to ``acc`` by an ordinary fp32 addition.
            w.emit(f"for c0 in range({k_start}, {k_end}, {K_CHUNK}):")
            w.emit("part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)", 2)
            w.emit(f"for k0 in range(c0, tl.minimum(c0 + {K_CHUNK}, {k_end}), BLOCK_K):", 2)
        else:
            w.emit(f"for k0 in range({k_start}, {k_end}, BLOCK_K):")
        inner = 3 if chunked else 2
        w.emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]", inner)
        w.emit(f"k_mask = ks < {k_end}", inner)
        w.emit("kk = k0 + tl.arange(0, BLOCK_K)[:, None]", inner)
        a_name = TileBlock(w, inner, "k", known).value(a)
        for line in b_load("k0"):
            w.emit(line, inner)
        w.emit(f"a_tile = tl.broadcast_to({a_name}, (BLOCK_M, BLOCK_K))", inner)
        target = "part" if chunked else "acc"
        w.emit(f"{target} += {dot_line('a_tile', 'b_tile', L.operand_dtype, L.precision, L.b_packed)}", inner)
        if chunked:
            w.emit("acc += part", 2)

    # 4. epilogue and stores
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr", "GROUP_M: tl.constexpr"]
    if split:
        # The partial row of this program's share of K, unrounded (the launcher's sum rounds
        # once), at each element's offset in the contiguous output.
        ro, bo = w.site_offsets[("out", 0)]
        n_term = index_term("cols", program.outputs[0].domain_stride[-1]) or "cols * 0"
        off = " + ".join(x for x in (ro or "rows * 0", bo, n_term) if x)
        numel = 1
        for size in program.outputs[0].shape:
            numel *= size
        w.emit(f"tl.store(out0 + tl.program_id(0) * {sized(numel)} + {off}, acc, mask=row_mask & col_mask)")
        blocks.append("SPLIT_K: tl.constexpr")
    else:
        block = TileBlock(w, 1, "n", {dot.uid: "acc"})
        emit_stores(w, program, block)
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
        tiles = triton_cdiv(rows, config["BLOCK_M"]) * triton_cdiv(n, block_n)
        if folded:
            return (tiles * batch,)
        return (config["SPLIT_K"], tiles, batch) if split else (tiles, batch)

    return KernelSource(
        name=name,
        source=source,
        layout="matmul",
        grid=grid,
        constexprs=constexprs,
        partial_outputs=(0,) if split else (),
    )
