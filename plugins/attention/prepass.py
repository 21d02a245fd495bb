"""Passes over q, k and v before the softmax attention kernel (``kernel.py``).

Every program of the attention kernel reads all of its batch entry's keys and
values: with ``N`` queries in blocks of ``BLOCK_M``, each k and v tile is read
``N / BLOCK_M`` times. Whatever is done to a tile on its way to the tensor
cores is done that many times too, so two conversions run once, in a pass of
their own, when there are enough queries (``PREPASS_MIN_QUERIES``):

- ``copy``: a 16-bit product (autocast) over fp32 k or v. The pass writes the
  operand dtype, rounded to nearest even as autocast's own cast does, into a
  contiguous scratch tensor; the kernel's tiles then go from memory to the
  tensor cores unchanged (converted in the kernel, each tile would go through
  registers first, for every query block).
- ``split``: fp32 products where torch does not allow TF32. q, k and v are
  scaled by powers of two so that their largest magnitudes lie in
  ``[2^13, 2^14)`` and written as two fp16 parts, ``hi = fp16(x)`` and
  ``lo = fp16(x - hi)``: 22 significant bits, and fp16's range covers the
  scaled values, so small entries keep their bits down to ``2^-24`` of the
  largest (``lo`` then rounds below the fp16 normal range). The kernel
  computes each product as three fp16 products with fp32 accumulation
  (``lo*hi + hi*lo + hi*hi``; ``lo*lo`` is below fp32's precision) and undoes
  the scales exactly. This is the same error as three TF32 products (3xTF32:
  11 + 11 bits) at fp16's tensor-core rate, twice TF32's on an H100/H200.
  q and v have one scale per row (one query or key, all its head-width
  entries), written beside the parts; k has one per batch entry (a pass of
  its own finds the largest exponent first, ``write_max_pass``), so the
  kernel's loop over the keys reads no per-key factor for the scores. That
  loses nothing that matters: the softmax is sensitive to the scores'
  absolute error, and a key row far below the entry's largest gets an
  absolute error of at most ``2^-38`` of ``|q| max|k|``, far below eager's own
  rounding of the largest scores. v's per-row scales keep small value rows
  exact relative to themselves (the output may be dominated by them); the
  kernel moves each key's factor onto p and scales each query's row of p to
  fp16's range on its own (``kernel._split_pv``).

Rows of all zeros or of subnormals get a clamped exponent, and rows holding
an infinity or NaN are left unscaled. A NaN anywhere gives NaN where eager's
does, and an infinity in v gives a non-finite output where eager's is one
(NaN where eager's is infinite: ``0 * inf`` in a low-part product), with
every other output right. An infinity in q or k can make a score NaN where
eager's is infinite, and so its query's output NaN where eager's may be
finite, as with 3xTF32 (whose low parts are ``inf - inf``); verification
against eager on the compile-time inputs catches it there, not on later ones.
"""

from __future__ import annotations

from typing import Optional

import torch

from autofuser.kernel import TL_DTYPES, emit_offsets, index_term, stored

from .layout import AttentionLayout, Operand

#: Passes run only from this many queries: fewer, and each k and v tile is read by a program
#: or two, so a pass (one more launch, and a write and read of its tensor) can't pay.
PREPASS_MIN_QUERIES = 256
#: Rows (queries or keys) one program of a pass converts.
PASS_ROWS = 128
#: The exponent a split row's largest magnitude is scaled to (just under ``2^SPLIT_EXPONENT``).
SPLIT_EXPONENT = 14
#: fp16 parts of a split operand, and the 16-bit dtype of the products.
SPLIT_DTYPE = torch.float16


def pass_modes(L: AttentionLayout) -> dict[str, Optional[str]]:
    """How the kernel reads q, k and v: ``None`` (through their own strides, as stored),
    ``"copy"`` or ``"split"`` (after a pass; see the module doc). q is split by a pass too
    (with its written-out ops applied first): split in the kernel, its parts would be
    stored to shared memory again in every step of the loop over the keys."""
    if L.form == "fourier" or L.n < PREPASS_MIN_QUERIES:
        return {"q": None, "k": None, "v": None}
    if L.precision == "tf32x3" and L.qk_dtype is None and L.pv_dtype is None:
        return {"q": "split", "k": "split", "v": "split"}
    return {
        "q": None,
        **{
            name: "copy" if operand is not None and op.dtype != operand else None
            for name, op, operand in (("k", L.k, L.qk_dtype), ("v", L.v, L.pv_dtype))
        },
    }


def exponent_lines(amax: str, name: str) -> list[str]:
    """Lines setting ``name`` (int32) to ``e`` with ``amax < 2^e``, clamped to [-100, 127]
    so that ``2^(14 - e)`` and ``2^(e - 14)`` are normal fp32 numbers. A row holding an
    infinity or NaN is not scaled (``e = 14``): its finite entries keep their values."""
    return [
        f"{name} = ((({amax}).to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 126",
        f"{name} = tl.where({name} > 128, {SPLIT_EXPONENT}, tl.minimum(tl.maximum({name}, -100), 127))",
    ]


def power_of_two(exponent: str) -> str:
    """``2.0 ** exponent`` for an int32 expression in the normal range, built from its bits."""
    return f"((({exponent}) + 127) << 23).to(tl.float32, bitcast=True)"


def split_lines(tile: str, prefix: str, finite: bool = False) -> list[str]:
    """Lines splitting an fp32 ``tile`` (already scaled) into ``{prefix}_hi`` and ``{prefix}_lo``.
    An infinite entry keeps ``lo = 0`` (``inf - inf`` would make the product NaN where eager's
    is infinite) unless the tile is ``finite`` (or NaN) by construction."""
    low = f"{tile} - {prefix}_hi.to(tl.float32)"
    if not finite:
        low = f'tl.where(tl.abs({tile}) < float("inf"), {low}, 0.0)'
    half = TL_DTYPES[SPLIT_DTYPE]
    return [f"{prefix}_hi = {tile}.to({half})", f"{prefix}_lo = ({low}).to({half})"]


def _read_rows(
    L: AttentionLayout, op: Operand, rows: int, width: int, block: int, cast64: str, steps: tuple[str, ...]
) -> list[str]:
    """A pass's first lines: this program's ``BLOCK_R`` rows of ``op`` as the fp32 tile ``x``
    ([BLOCK_R, BLOCK_W], 0 past the rows and the width), ``steps`` applied."""
    lines: list[str] = []
    emit = lambda line: lines.append("    " + line)  # noqa: E731
    emit(f"pid = tl.program_id(0){cast64}")
    emit(f"batch = tl.program_id(1){cast64}")
    offset = emit_offsets(emit, list(L.batch), [list(op.batch_strides)], "batch", "b")[0]
    emit(f"src = in{op.index}" + (f" + {offset}" if offset else ""))
    emit("r = pid * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]")
    emit("c = tl.arange(0, BLOCK_W)[None, :]")
    emit(f"r_mask = r < {rows}")
    col_mask = f" & (c < {width})" if width < block else ""
    terms = " + ".join(t for t in (index_term("r", op.row_stride), index_term("c", op.col_stride)) if t) or "0"
    emit(f"x = tl.load(src + {terms}, mask=r_mask{col_mask}, other=0).to(tl.float32)")
    lines += steps
    if steps and width < block:
        emit(f"x = tl.where(c < {width}, x, 0.0)  # padding stays 0")
    return lines


def _row_exponents() -> list[str]:
    lines = ["    amax = tl.max(tl.abs(x), axis=1)[:, None]  # per row: one key's head-width entries"]
    return lines + ["    " + line for line in exponent_lines("amax", "e")]


def write_max_pass(
    L: AttentionLayout, name: str, op: Operand, rows: int, width: int, block: int, cast64: str
) -> tuple[list, list, list]:
    """The pass before a split with one scale per batch entry: each program's largest row
    exponent, combined by ``atomic_max`` into ``{name}_e`` ([batch] int32, filled with -128)."""
    lines = _read_rows(L, op, rows, width, block, cast64, ())
    lines += _row_exponents()
    lines.append(f"    tl.atomic_max({name}_e + batch, tl.max(tl.where(r_mask, e, -128)))")
    return [f"in{op.index}", f"{name}_e"], ["BLOCK_R", "BLOCK_W"], lines


def write_pass(
    L: AttentionLayout,
    name: str,
    op: Operand,
    rows: int,
    width: int,
    block: int,
    mode: str,
    operand: Optional[torch.dtype],
    cast64: str,
    steps: tuple[str, ...] = (),
    per_entry: bool = False,
) -> tuple[list, list, list]:
    """One pass's ``(params, blocks, lines)`` for ``autofuser.kernel.chain_stages``: grid (blocks of
    ``PASS_ROWS`` rows, batch entries); reads ``op`` ([rows, width] per batch entry) through
    its strides and writes ``{name}_a`` (and for a split ``{name}_b``, the low parts, and
    ``{name}_f``, each row's unscale factor), contiguous [batch, rows, block].
    ``steps``: lines run on the loaded tile ``x`` first (q's written-out ops). ``per_entry``:
    one scale for the whole batch entry, its exponent read from ``{name}_e``
    (``write_max_pass``), and no factors written."""
    lines = _read_rows(L, op, rows, width, block, cast64, steps)
    emit = lambda line: lines.append("    " + line)  # noqa: E731
    emit(f"dst = batch * {rows * block} + r * BLOCK_W + c")
    if mode == "copy":
        emit(f"tl.store({name}_a + dst, {stored('x', operand, TL_DTYPES[operand])}, mask=r_mask)")
        return [f"in{op.index}", f"{name}_a"], ["BLOCK_R", "BLOCK_W"], lines
    if per_entry:
        emit(f"e = tl.load({name}_e + batch)  # the batch entry's largest row exponent")
    else:
        lines += _row_exponents()
    emit(f"x = x * {power_of_two(f'{SPLIT_EXPONENT} - e')}  # the largest magnitude to [2^13, 2^14)")
    for line in split_lines("x", "x"):
        emit(line)
    emit(f"tl.store({name}_a + dst, x_hi, mask=r_mask)")
    emit(f"tl.store({name}_b + dst, x_lo, mask=r_mask)")
    if per_entry:
        return [f"in{op.index}", f"{name}_a", f"{name}_b", f"{name}_e"], ["BLOCK_R", "BLOCK_W"], lines
    emit(f"unscale = {power_of_two(f'e - {SPLIT_EXPONENT}')}")
    emit(f"tl.store({name}_f + batch * {rows} + r, unscale, mask=r_mask)")
    return [f"in{op.index}", f"{name}_a", f"{name}_b", f"{name}_f"], ["BLOCK_R", "BLOCK_W"], lines
