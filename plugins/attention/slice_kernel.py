"""The slice attention chain: three kernels, each reading the point features once.

1. ``aggregate``, grid (splits, batch entries): for its share of the points,
   ``BLOCK_N`` at a time, the slice weights ``w = softmax(steps(x @ Ws^T + bs))``
   (all slices of a point in registers), then ``w^T @ fx`` and the column sums
   of ``w`` added up (fp32); the partial sums are stored;
2. ``mix``, grid (batch entries): adds the partials in a fixed order, divides
   the tokens by ``steps(sums)``, maps them to q, k and v, and runs softmax
   attention among the ``g`` slices; stores the mixed tokens ``t'`` [g, dv];
3. ``scatter``, grid (point blocks, batch entries): recomputes ``w`` for its
   points from ``x`` (the same code as stage 1, so the same values: cheaper than
   writing and reading the n x g weights when ``dx < g``) and stores ``w @ t'``.

Every intermediate is rounded where eager rounds it. Inside the kernels the
points are the ``rows`` and the slices the ``keys`` (the names the written-out
steps read their tiles with).
"""

from __future__ import annotations

import torch

from autofuser import KernelSource
from autofuser.kernel import (
    INT32_LIMIT,
    POINTER_TYPES,
    TL_DTYPES,
    as_operand,
    cdiv_text,
    chain_digest,
    chain_module,
    chain_stages,
    dot_block,
    dot_line,
    index_term,
    op_label,
    rounded,
    split_chunk,
    stored,
    used_helpers,
)

from .kernel import ROUNDED, _all, _Writer, kernel_header, load_cast
from .layout import LinearMap, SliceLayout
from .linear_kernel import _offsets


def _fp32_or(dtype: torch.dtype):
    """A product's operand dtype: ``None`` for fp32 (``dot_line``'s convention)."""
    return None if dtype == torch.float32 else dtype


def _round(w: _Writer, name: str, dtype: torch.dtype, why: str, indent: int) -> None:
    if dtype in ROUNDED:
        w.emit(f"{name} = {rounded(name, dtype)}  # {why}", indent)


def _linear(
    w: _Writer, result: str, tile: str, linear: LinearMap, in_block: str, out_block: str, precision: str, indent: int
) -> None:
    """``result = tile @ weight^T + bias`` (weight [out, in] read transposed), rounded to the map's dtype."""
    operand = _fp32_or(linear.dtype)
    in_idx, out_idx = f"tl.arange(0, {in_block})[:, None]", f"tl.arange(0, {out_block})[None, :]"
    w.emit(
        f"wt = tl.load(in{linear.weight} + {out_idx} * {linear.width_in} + {in_idx}, "
        f"mask=({in_idx} < {linear.width_in}) & ({out_idx} < {linear.width_out}), other=0).to(tl.float32)",
        indent,
    )
    w.emit(
        f"{result} = {dot_line(as_operand(tile, operand), as_operand('wt', operand), operand, precision)}"
        f"  # {op_label(linear.node)}",
        indent,
    )
    if linear.bias is not None:
        w.emit(
            f"{result} += tl.load(in{linear.bias} + {out_idx}, mask={out_idx} < {linear.width_out}, other=0)"
            ".to(tl.float32)",
            indent,
        )
    _round(w, result, linear.dtype, "the map's dtype", indent)


def _weights(w: _Writer, L: SliceLayout, indent: int) -> None:
    """``w`` [rows, BLOCK_G]: the slice weights of this block of points (``rows``, ``row_mask``)."""
    x_cast = load_cast(L.x.dtype, None, need_fp32=True)
    x_tile = w.tile_load(L.x, "x_base", "rows", "dx_cols", ("row_mask", _mask("dx_cols", L.dx)), x_cast, full=True)
    w.emit(f"x = {x_tile}", indent)
    _linear(w, "logits", "x", L.to_slice, "BLOCK_DX", "BLOCK_G", L.precision, indent)
    w.steps(L.logit_steps, "logits", L.logit_tiles, indent)
    w.emit('logits = tl.where(key_mask, logits, float("-inf"))', indent)
    w.emit("e = tl.exp(logits - tl.max(logits, axis=1)[:, None])", indent)
    w.emit("wts = e / tl.sum(e, axis=1)[:, None]  # softmax over the slices", indent)
    _round(w, "wts", L.weights_dtype, "the softmax's dtype", indent)
    w.emit("wts = tl.where(row_mask, wts, 0.0)  # points past n weigh nothing", indent)


def _mask(cols: str, width: int):
    return None if width == dot_block(width) else f"{cols} < {width}"


def _head(w: _Writer, L: SliceLayout) -> None:
    w.emit("dx_cols = tl.arange(0, BLOCK_DX)[None, :]")
    w.emit("keys = tl.arange(0, BLOCK_G)[None, :]  # the slices")
    w.emit(f"key_mask = keys < {L.g}")


def write_slice_attention(program, strategy: str, helpers=None) -> KernelSource:
    L: SliceLayout = program.slices
    bg, bdx, bdf, bdq, bdv = (dot_block(s) for s in (L.g, L.dx, L.df, L.dq, L.dv))
    extents = [L.x.extent(L.batch, L.n, L.dx), L.fx.extent(L.batch, L.n, L.df), L.out.extent(L.batch, L.n, L.dv)]
    extents += [op.extent(L.batch, L.n, L.g) for op in L.logit_tiles.values()]
    cast64 = ".to(tl.int64)" if max(extents) > INT32_LIMIT else ""
    inputs = [f"in{k}" for k in range(len(program.inputs))]
    tiles = [(f"x{op.index}", f"in{op.index}", op) for op in L.logit_tiles.values()]
    agg_size, sum_size = bg * bdf, bg

    # 1. weights, aggregation and sums over each split of the points.
    a = _Writer()
    a.emit("split = tl.program_id(0)")
    a.emit(f"batch = tl.program_id(1){cast64}")
    _offsets(a, L.batch, [("x", f"in{L.x.index}", L.x), ("fx", f"in{L.fx.index}", L.fx)] + tiles)
    _head(a, L)
    a.emit("df_cols = tl.arange(0, BLOCK_DF)[None, :]")
    a.emit("agg = tl.zeros((BLOCK_G, BLOCK_DF), tl.float32)  # w^T @ fx over this split")
    a.emit("sums = tl.zeros((BLOCK_G,), tl.float32)  # w's column sums over this split")
    a.emit("for n0 in range(0, CHUNK, BLOCK_N):")
    a.emit("rows = split * CHUNK + n0 + tl.arange(0, BLOCK_N)[:, None]", 2)
    a.emit(f"row_mask = rows < {L.n}", 2)
    _weights(a, L, 2)
    agg_operand = _fp32_or(L.agg_dtype)
    fx_cast = load_cast(L.fx.dtype, agg_operand)
    fx_tile = a.tile_load(L.fx, "fx_base", "rows", "df_cols", ("row_mask", _mask("df_cols", L.df)), fx_cast, full=True)
    a.emit(f"fx = {fx_tile}", 2)
    a.emit(f"agg += {dot_line('tl.trans(wts)', 'fx', agg_operand, L.precision)}", 2)
    a.emit("sums += tl.sum(wts, axis=0)", 2)
    a.emit(
        f"tl.store(partial + (batch * SPLITS + split) * {agg_size} + tl.arange(0, BLOCK_G)[:, None] * BLOCK_DF "
        "+ df_cols, agg)"
    )
    a.emit(f"tl.store(partial_sums + (batch * SPLITS + split) * {sum_size} + tl.arange(0, BLOCK_G), sums)")
    aggregate = (
        inputs + ["partial", "partial_sums"],
        ["BLOCK_N", "CHUNK", "SPLITS", "BLOCK_G", "BLOCK_DX", "BLOCK_DF"],
        a.lines,
    )

    # 2. tokens, and attention among them.
    m = _Writer()
    m.emit(f"batch = tl.program_id(0){cast64}")
    m.emit("g_rows = tl.arange(0, BLOCK_G)[:, None]")
    m.emit("keys = tl.arange(0, BLOCK_G)[None, :]")
    m.emit("df_cols = tl.arange(0, BLOCK_DF)[None, :]")
    m.emit("agg = tl.zeros((BLOCK_G, BLOCK_DF), tl.float32)")
    m.emit("sums = tl.zeros((BLOCK_G, 1), tl.float32)")
    m.emit("for s in range(0, SPLITS):  # in order: the same sum on every run")
    m.emit(f"agg += tl.load(partial + (batch * SPLITS + s) * {agg_size} + g_rows * BLOCK_DF + df_cols)", 2)
    m.emit(f"sums += tl.load(partial_sums + (batch * SPLITS + s) * {sum_size} + g_rows)", 2)
    _round(m, "agg", L.agg_dtype, "the aggregation's dtype", 1)
    _round(m, "sums", L.sum_dtype, "the sum's dtype", 1)
    m.steps(L.sum_steps, "sums", {}, 1)
    m.emit(f"tokens = tl.where(g_rows < {L.g}, agg / sums, 0.0)  # padded slices stay 0")
    _round(m, "tokens", L.tokens_dtype, "the tokens' dtype", 1)
    _linear(m, "q", "tokens", L.to_q, "BLOCK_DF", "BLOCK_DQ", L.precision, 1)
    _linear(m, "k", "tokens", L.to_k, "BLOCK_DF", "BLOCK_DQ", L.precision, 1)
    _linear(m, "v", "tokens", L.to_v, "BLOCK_DF", "BLOCK_DV", L.precision, 1)
    scores_operand = _fp32_or(L.scores_dtype)
    s_dot = dot_line(
        as_operand("q", scores_operand), as_operand("tl.trans(k)", scores_operand), scores_operand, L.precision
    )
    m.emit(f"s = {s_dot}  # q @ k^T among the slices")
    _round(m, "s", L.scores_dtype, "the scores' dtype", 1)
    m.steps(L.score_steps, "s", {}, 1)
    m.emit(f's = tl.where(keys < {L.g}, s, float("-inf"))')
    m.emit("e = tl.exp(s - tl.max(s, axis=1)[:, None])")
    m.emit("p = e / tl.sum(e, axis=1)[:, None]")
    _round(m, "p", L.probs_dtype, "the softmax's dtype", 1)
    mixed_operand = _fp32_or(L.mixed_dtype)
    mixed_dot = dot_line(as_operand("p", mixed_operand), as_operand("v", mixed_operand), mixed_operand, L.precision)
    m.emit(f"mixed = {mixed_dot}")
    _round(m, "mixed", L.mixed_dtype, "the product's dtype", 1)
    m.emit(f"mixed = tl.where(g_rows < {L.g}, mixed, 0.0)")
    m.emit(f"tl.store(mixed_tokens + batch * {bg * bdv} + g_rows * BLOCK_DV + tl.arange(0, BLOCK_DV)[None, :], mixed)")
    mix = (
        inputs + ["partial", "partial_sums", "mixed_tokens"],
        ["SPLITS", "BLOCK_G", "BLOCK_DF", "BLOCK_DQ", "BLOCK_DV"],
        m.lines,
    )

    # 3. scatter back to the points.
    c = _Writer()
    c.emit(f"pid_m = tl.program_id(0){cast64}")
    c.emit(f"batch = tl.program_id(1){cast64}")
    _offsets(c, L.batch, [("x", f"in{L.x.index}", L.x), ("out", "out0", L.out)] + tiles)
    _head(c, L)
    c.emit("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    c.emit(f"row_mask = rows < {L.n}")
    _weights(c, L, 1)
    c.emit("dv_cols = tl.arange(0, BLOCK_DV)[None, :]")
    c.emit(f"mixed = tl.load(mixed_tokens + batch * {bg * bdv} + tl.arange(0, BLOCK_G)[:, None] * BLOCK_DV + dv_cols)")
    out_operand = _fp32_or(L.out_dtype)
    out_dot = dot_line(as_operand("wts", out_operand), as_operand("mixed", out_operand), out_operand, L.precision)
    c.emit(f"out = {out_dot}  # w @ t'")
    out_off = " + ".join(
        [index_term("rows", L.out.row_stride) or "rows * 0", index_term("dv_cols", L.out.col_stride) or "dv_cols * 0"]
    )
    c.emit(
        f"tl.store(out_base + {out_off}, {stored('out', L.out.dtype, TL_DTYPES[L.out.dtype])}, "
        f"mask={_all([x for x in ('row_mask', _mask('dv_cols', L.dv)) if x])})"
    )
    scatter = (inputs + ["mixed_tokens", "out0"], ["BLOCK_M", "BLOCK_G", "BLOCK_DX", "BLOCK_DV"], c.lines)

    stages_src = (aggregate, mix, scatter)
    bodies = "\n".join("\n".join(lines) for _, _, lines in stages_src)
    helper_text = used_helpers(helpers, bodies)
    # The name hashes what the launcher runs too (each split's points, the grids): a process
    # reuses a module by its name, and two programs can differ only there (the batch).
    launcher = repr((split_chunk(L.n), L.n, L.batch_numel))
    name = f"af_attention_slice_{chain_digest(helper_text, bodies, launcher)}"
    stage_names = [f"{name}_aggregate", f"{name}_mix", f"{name}_scatter"]
    types = {f"in{k}": POINTER_TYPES[t.dtype] for k, t in enumerate(program.inputs)}
    types.update(partial="*fp32", partial_sums="*fp32", mixed_tokens="*fp32", out0=POINTER_TYPES[L.out.dtype])
    functions, stages = chain_stages(stage_names, stages_src, types)
    batch, args = L.batch_numel, ", ".join(inputs)
    launch = [
        f"chunk = {split_chunk(L.n)}  # points per split",
        "device = out0.device",
        f"partial = torch.empty(({batch}, SPLITS, BLOCK_G, BLOCK_DF), dtype=torch.float32, device=device)",
        f"partial_sums = torch.empty(({batch}, SPLITS, BLOCK_G), dtype=torch.float32, device=device)",
        f"mixed_tokens = torch.empty(({batch}, BLOCK_G, BLOCK_DV), dtype=torch.float32, device=device)",
        "sizes = dict(BLOCK_G=BLOCK_G, BLOCK_DV=BLOCK_DV, num_warps=num_warps)",
        f"{stage_names[0]}[(SPLITS, {batch})]({args}, partial, partial_sums, BLOCK_N=BLOCK_N, CHUNK=chunk, "
        "SPLITS=SPLITS, BLOCK_G=BLOCK_G, BLOCK_DX=BLOCK_DX, BLOCK_DF=BLOCK_DF, num_warps=num_warps, "
        "num_stages=num_stages)",
        f"{stage_names[1]}[({batch},)]({args}, partial, partial_sums, mixed_tokens, SPLITS=SPLITS, "
        "BLOCK_DF=BLOCK_DF, BLOCK_DQ=BLOCK_DQ, **sizes)",
        f"{stage_names[2]}[({cdiv_text(str(L.n), 'BLOCK_M')}, {batch})]({args}, mixed_tokens, out0, BLOCK_M=BLOCK_M, "
        "BLOCK_DX=BLOCK_DX, **sizes)",
    ]
    signature = ", ".join(
        inputs
        + [
            "out0",
            "*",
            "BLOCK_M",
            "BLOCK_N",
            "SPLITS",
            "BLOCK_G",
            "BLOCK_DX",
            "BLOCK_DF",
            "BLOCK_DQ",
            "BLOCK_DV",
            "num_warps=4",
            "num_stages=2",
        ]
    )
    derived = {"CHUNK": split_chunk(L.n, "config['SPLITS']", "config['BLOCK_N']")}
    source = chain_module(
        _header(program, strategy),
        helper_text,
        functions,
        name,
        launch,
        signature,
        stages,
        derived,
        tuple(inputs + ["out0"]),
    )
    return KernelSource(
        name=name,
        source=source,
        layout="attention_chain",
        grid=lambda config: (1,),
        constexprs={"BLOCK_G": bg, "BLOCK_DX": bdx, "BLOCK_DF": bdf, "BLOCK_DQ": bdq, "BLOCK_DV": bdv},
    )


def _header(program, strategy: str) -> str:
    L: SliceLayout = program.slices
    return kernel_header(
        program,
        f"{strategy} strategy, a chain of three kernels",
        f"batch {list(L.batch)}, {L.n} points, {L.g} slices, widths x {L.dx}, fx {L.df}, q/k {L.dq}, "
        f"v {L.dv}; fp32 products {L.precision}",
    )
