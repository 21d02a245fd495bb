"""The linear attention chain: ``out = q @ steps(k'^T @ v')`` in three kernels.

1. ``partials``, grid (splits, batch entries): each program walks its share of
   the m points ``BLOCK_N`` at a time, loads k's and v's tiles once (through
   their strides), applies the layer norms over the head width in registers
   (rounded where eager rounds), and accumulates ``k'^T @ v'`` (d x dv, fp32);
   it stores that partial sum;
2. ``combine``, grid (batch entries): adds the splits' partials in a fixed
   order (the same result on every run), rounds to the context's eager dtype
   and applies the steps by constants (``/ n``);
3. ``apply``, grid (query blocks, batch entries): ``q @ context`` for
   ``BLOCK_M`` queries, the steps on the output, one store.

Points are read once (k and v in stage 1, q in stage 3); the only other
traffic is the d x dv partials. Head widths are padded to a power of two >= 16
(``tl.dot``'s minimum) with masks.

With dynamic dims (docs/dynamic.md) the point and query counts, the strides and
the batch entries are written through ``sized``, and so is the ``/ n`` on the
context: one source serves every point count. The launcher derives each split's
share of the points (``CHUNK``) from the count at launch, so any ``SPLITS`` and
``BLOCK_N`` are correct for any count.
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
    emit_offsets,
    index_term,
    op_label,
    rounded,
    size_parameters,
    sized,
    split_chunk,
    stored,
    used_helpers,
)

from .kernel import ROUNDED, _all, _Writer, kernel_header, load_cast
from .layout import LinearAttentionLayout, Operand, RowNorm


def _offsets(w: _Writer, batch, operands: list[tuple[str, str, Operand]]) -> None:
    offsets = emit_offsets(w.emit, list(batch), [list(op.batch_strides) for _, _, op in operands], "batch", "b")
    for (name, pointer, op), off in zip(operands, offsets):
        w.emit(f"{name}_base = {pointer}" + (f" + {off}" if off else ""))
        w.bases[id(op)] = f"{name}_base"


def emit_row_norm(w: _Writer, tile: str, norm: RowNorm, width: int, block: int, cols: str, indent: int = 2) -> None:
    """A layer norm over the columns of ``tile`` (``width`` of ``block`` are real), in fp32,
    rounded to its eager dtype; padded columns stay 0."""
    valid = f"{cols} < {width}"
    w.emit(f"mean = tl.sum({tile}, axis=1)[:, None] / {float(width)!r}  # {op_label(norm.node)}", indent)
    deviation = f"{tile} - mean" if width == block else f"tl.where({valid}, {tile} - mean, 0.0)"
    w.emit(f"{tile} = {deviation}", indent)
    w.emit(f"var = tl.sum({tile} * {tile}, axis=1)[:, None] / {float(width)!r}", indent)
    w.emit(f"{tile} = {tile} * tl.rsqrt(var + {norm.eps!r})", indent)
    mask = "" if width == block else f", mask={valid}, other=0"
    for index, op in ((norm.weight, "*"), (norm.bias, "+")):
        if index is not None:
            w.emit(f"{tile} = {tile} {op} tl.load(in{index} + {cols}{mask}).to(tl.float32)", indent)
    if norm.dtype in ROUNDED:
        w.emit(f"{tile} = {rounded(tile, norm.dtype)}  # layer norm's dtype", indent)


def write_linear_attention(program, strategy: str, helpers=None) -> KernelSource:
    L: LinearAttentionLayout = program.linear
    block_d, block_dv = dot_block(L.d), dot_block(L.dv)
    extents = [
        L.q.extent(L.batch, L.n, L.d),
        L.k.extent(L.batch, L.m, L.d),
        L.v.extent(L.batch, L.m, L.dv),
        L.out.extent(L.batch, L.n, L.dv),
    ]
    cast64 = ".to(tl.int64)" if max(extents) > INT32_LIMIT else ""
    ctx_operand = None if L.ctx_dtype == torch.float32 else L.ctx_dtype
    out_operand = None if L.out_dtype == torch.float32 else L.out_dtype
    ctx_size = block_d * block_dv
    inputs = [f"in{k}" for k in range(len(program.inputs))]

    # 1. partial sums of k'^T @ v' over each split of the points.
    w = _Writer()
    w.emit("split = tl.program_id(0)")
    w.emit(f"batch = tl.program_id(1){cast64}")
    _offsets(w, L.batch, [("k", f"in{L.k.index}", L.k), ("v", f"in{L.v.index}", L.v)])
    w.emit("d_cols = tl.arange(0, BLOCK_D)[None, :]  # head width of k")
    w.emit("dv_cols = tl.arange(0, BLOCK_DV)[None, :]  # head width of v")
    d_mask = f"d_cols < {L.d}" if L.d < block_d else None
    dv_mask = f"dv_cols < {L.dv}" if L.dv < block_dv else None
    w.emit("acc = tl.zeros((BLOCK_D, BLOCK_DV), tl.float32)  # this split's k'^T @ v'")
    w.emit("for n0 in range(0, CHUNK, BLOCK_N):")
    w.emit("points = split * CHUNK + n0 + tl.arange(0, BLOCK_N)[:, None]", 2)
    w.emit(f"point_mask = points < {sized(L.m)}", 2)
    for name, op, norm, width, block, cols, mask in (
        ("k", L.k, L.k_norm, L.d, block_d, "d_cols", d_mask),
        ("v", L.v, L.v_norm, L.dv, block_dv, "dv_cols", dv_mask),
    ):
        cast = load_cast(op.dtype, ctx_operand, need_fp32=norm is not None)
        w.emit(f"{name} = {w.tile_load(op, f'{name}_base', 'points', cols, ('point_mask', mask), cast, full=True)}", 2)
        if norm is not None:
            emit_row_norm(w, name, norm, width, block, cols)
            w.emit(f"{name} = tl.where(point_mask, {name}, 0.0)  # points past m add nothing", 2)
    w.emit(f"acc += {dot_line('tl.trans(k)', 'v', ctx_operand, L.precision)}", 2)
    w.emit(
        f"tl.store(partial + (batch * SPLITS + split) * {ctx_size} + tl.arange(0, BLOCK_D)[:, None] * BLOCK_DV "
        "+ dv_cols, acc)"
    )
    partial_params = inputs + ["partial"]
    partials = (partial_params, ["BLOCK_N", "CHUNK", "SPLITS", "BLOCK_D", "BLOCK_DV"], w.lines)

    # 2. the context: the partials added in order, rounded, the steps by constants.
    c = _Writer()
    c.emit(f"batch = tl.program_id(0){cast64}")
    c.emit("c_rows = tl.arange(0, BLOCK_D)[:, None]")
    c.emit("c_cols = tl.arange(0, BLOCK_DV)[None, :]")
    c.emit("ctx = tl.zeros((BLOCK_D, BLOCK_DV), tl.float32)")
    c.emit("for s in range(0, SPLITS):")
    c.emit(f"ctx += tl.load(partial + (batch * SPLITS + s) * {ctx_size} + c_rows * BLOCK_DV + c_cols)", 2)
    if L.ctx_dtype in ROUNDED:
        c.emit(f"ctx = {rounded('ctx', L.ctx_dtype)}  # the context product's dtype")
    if L.ctx_steps:
        c.steps(L.ctx_steps, "ctx", {}, 1, counts=True)  # ``/ n``: the point count at run time
        c.emit(f"ctx = tl.where((c_rows < {L.d}) & (c_cols < {L.dv}), ctx, 0.0)  # padding stays 0")
    c.emit(f"tl.store(context + batch * {ctx_size} + c_rows * BLOCK_DV + c_cols, ctx)")
    combine = (["partial", "context"], ["SPLITS", "BLOCK_D", "BLOCK_DV"], c.lines)

    # 3. q @ context for BLOCK_M queries.
    a = _Writer()
    a.emit(f"pid_m = tl.program_id(0){cast64}")
    a.emit(f"batch = tl.program_id(1){cast64}")
    _offsets(a, L.batch, [("q", f"in{L.q.index}", L.q), ("out", "out0", L.out)])
    a.emit("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    a.emit(f"row_mask = rows < {sized(L.n)}")
    a.emit("d_cols = tl.arange(0, BLOCK_D)[None, :]")
    a.emit("dv_cols = tl.arange(0, BLOCK_DV)[None, :]")
    a.emit(f"ctx = tl.load(context + batch * {ctx_size} + tl.arange(0, BLOCK_D)[:, None] * BLOCK_DV + dv_cols)")
    q_cast = load_cast(L.q.dtype, out_operand)
    a.emit(f"q = {a.tile_load(L.q, 'q_base', 'rows', 'd_cols', ('row_mask', d_mask), q_cast, full=True)}")
    a.emit(f"out = {dot_line('q', as_operand('ctx', out_operand), out_operand, L.precision)}  # q @ context")
    if L.out_dtype in ROUNDED:
        a.emit(f"out = {rounded('out', L.out_dtype)}  # the product's dtype")
    a.steps(L.out_steps, "out", {}, 1, counts=True)
    out_off = " + ".join(
        [index_term("rows", L.out.row_stride) or "rows * 0", index_term("dv_cols", L.out.col_stride) or "dv_cols * 0"]
    )
    a.emit(
        f"tl.store(out_base + {out_off}, {stored('out', L.out.dtype, TL_DTYPES[L.out.dtype])}, "
        f"mask={_all([m for m in ('row_mask', dv_mask) if m])})"
    )
    apply = (inputs + ["context", "out0"], ["BLOCK_M", "BLOCK_D", "BLOCK_DV"], a.lines)

    bodies = "\n".join("\n".join(lines) for _, _, lines in (partials, combine, apply))
    helper_text = used_helpers(helpers, bodies)
    # The launcher's sizes: the points (each split's share is derived at launch, so one
    # source serves every point count), the queries and the batch entries (the grids).
    points, queries, entries = sized(L.m), sized(L.n), sized(L.batch_numel)
    run_time = size_parameters()  # every size named above and in the kernels (docs/dynamic.md)
    # The name hashes what the launcher runs too: a process reuses a module by its name, and
    # two programs can differ only there (the batch entries, or which sizes it takes).
    launcher = f"{points} {queries} {entries} {run_time}"
    name = f"af_attention_{L.form}_{chain_digest(helper_text, bodies, repr(partial_params), launcher)}"
    stage_names = [f"{name}_partials", f"{name}_combine", f"{name}_apply"]
    types = {f"in{k}": POINTER_TYPES[t.dtype] for k, t in enumerate(program.inputs)}
    types.update(partial="*fp32", context="*fp32", out0=POINTER_TYPES[L.out.dtype])
    functions, stages = chain_stages(stage_names, (partials, combine, apply), types, run_time)
    passed = ["".join(f"{s}={s}, " for s in stage.get("sizes", ())) for stage in stages]
    launch = [
        f"chunk = {split_chunk(points)}  # points per split",
        "device = out0.device",
        f"partial = torch.empty(({entries}, SPLITS, BLOCK_D, BLOCK_DV), dtype=torch.float32, device=device)",
        f"context = torch.empty(({entries}, BLOCK_D, BLOCK_DV), dtype=torch.float32, device=device)",
        "sizes = dict(BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, num_warps=num_warps)",
        f"{stage_names[0]}[(SPLITS, {entries})]({', '.join(inputs)}, partial, {passed[0]}BLOCK_N=BLOCK_N, CHUNK=chunk, "
        "SPLITS=SPLITS, num_stages=num_stages, **sizes)",
        f"{stage_names[1]}[({entries},)](partial, context, {passed[1]}SPLITS=SPLITS, **sizes)",
        f"{stage_names[2]}[({cdiv_text(str(queries), 'BLOCK_M')}, {entries})]({', '.join(inputs)}, context, out0, "
        f"{passed[2]}BLOCK_M=BLOCK_M, **sizes)",
    ]
    signature = ", ".join(
        inputs
        + ["out0", "*", "BLOCK_M", "BLOCK_N", "SPLITS", "BLOCK_D", "BLOCK_DV", "num_warps=4", "num_stages=2"]
        + run_time
    )
    named_points = f"config[{points!r}]" if points != str(L.m) else L.m
    derived = {"CHUNK": split_chunk(named_points, "config['SPLITS']", "config['BLOCK_N']")}
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
        constexprs={"BLOCK_D": block_d, "BLOCK_DV": block_dv},
    )


def _header(program, strategy: str) -> str:
    L: LinearAttentionLayout = program.linear
    return kernel_header(
        program,
        f"{strategy} strategy, a chain of three kernels",
        f"batch {list(L.batch)}, {L.n} queries, {L.m} points, head widths {L.d} -> {L.dv}; fp32 products {L.precision}",
    )
