"""Flash attention, forward and backward, as hand-written Triton kernels.

``flash_forward`` computes ``out = softmax(scale * q @ k^T) @ v`` and the
scores' natural-log logsumexp per query (``lse``); ``flash_backward`` computes
q's, k's and v's gradients from them, flash-attention-2 style. Neither ever
holds more of the N x M scores than one ``BLOCK_M x BLOCK_N`` tile in
registers, and the backward is deterministic: every gradient element is
summed by one program, in a fixed order, with no atomics.

Tensors are ``q [B, H, N, D]``, ``k [B, H, M, D]``, ``v [B, H, M, Dv]``, read
through their own strides (a ``[B, N, H, D]`` tensor transposed to
``[B, H, N, D]`` costs no copy). Head widths are padded to a power of two of
at least 16 (``tl.dot``'s minimum) and masked. ``causal`` is top-left aligned,
as ``F.scaled_dot_product_attention(is_causal=True)``: query ``i`` sees keys
``j <= i``, so every query sees key 0 and no row's softmax is empty.

The kernels, each launched on a 1-d grid of (row block, batch-head) pairs with
the row blocks of one batch-head adjacent (they read the same k and v):

1. ``_forward_kernel``, one program per block of queries: the online softmax
   in base 2 (``log2(e)`` folded into the scale), with a running row max
   ``m``, a running sum ``l`` of ``exp2(s - m)`` and a running ``p @ v``,
   rescaled by ``exp2(m_old - m_new)`` whenever a key block raises the max;
   ``out = acc / l`` and ``lse = (m + log2(l)) * ln(2)``;
2. ``_delta_kernel``: ``delta = rowsum(dout * out)`` in fp32, the softmax
   backward's correction term (``sum_j p_ij dp_ij``, without the N x M ``p``);
3. ``_dkdv_kernel``, one program per block of keys, looping over the queries
   that see them: recomputes ``p^T = exp(scale * k q^T - lse)`` tile by tile,
   ``dv += p^T dout`` and ``dk += scale * ds^T q`` with
   ``ds = p * (dout v^T - delta)``;
4. ``_dq_kernel``, one program per block of queries, looping over the keys
   they see: the same ``ds``, ``dq += scale * ds k``.

With ``causal``, each loop starts or ends at the diagonal: key blocks wholly
after a query block's last query, and query blocks wholly before a key
block's first key, are never visited.

Products: 16-bit inputs multiply in their own dtype (``p`` and ``ds`` rounded
to it, as eager's are) with fp32 accumulation; fp32 inputs multiply in the
precision the caller passes (a compiled graph passes its compile's), else in TF32
where torch allows it for matmuls and in 3xTF32 (near-fp32 accuracy at
tensor-core rate) where it does not (``dot_precision``). Under Triton's CPU
interpreter bf16 products are broken and bf16 conversions truncate, so there
bf16 tiles are held in fp32, rounded to nearest even on their bits
(``autofuser.kernel.round_bf16``) and multiplied in
fp32: the same values a GPU's bf16 product gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from autofuser.kernel import INT32_LIMIT, fp32_precision, interpreting, next_power_of_2, round_bf16, triton_cdiv

from .kernel import LOG2E

LN2 = 0.6931471805599453
# The same for the kernels, which read only constexpr globals.
_LOG2E_K = tl.constexpr(LOG2E)
_LN2_K = tl.constexpr(LN2)
#: The widest head (q's and k's ``D``, v's ``Dv``) the kernels hold in registers.
MAX_HEAD_WIDTH = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: ``tl.dot``'s ``input_precision`` values an fp32 attention may be asked for.
PRECISIONS = ("tf32", "tf32x3", "ieee")


def dot_precision(asked: Optional[str] = None) -> str:
    """``tl.dot``'s ``input_precision`` for fp32 inputs: ``asked`` (one of
    ``PRECISIONS``; a compiled graph passes the precision its compile chose, so a
    ``fuse(strict_fp32_products=...)`` choice holds when the kernels launch), else the
    project's rule for fp32 products (``autofuser.kernel.fp32_precision``) read now: TF32
    where torch allows it for matmuls (``torch.backends.cuda.matmul.allow_tf32``, or a
    float32 matmul precision below "highest"), else 3xTF32, whose error is close to a
    plain fp32 product's at tensor-core rate."""
    if asked is None:
        return fp32_precision()
    if asked not in PRECISIONS:
        raise ValueError(f"flash attention: precision must be one of {', '.join(PRECISIONS)} or None; got {asked!r}")
    return asked


# ---------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    """One kernel's tiling: ``held`` rows per program (queries, or keys for dk and dv),
    ``step`` rows per iteration of its loop (keys, or queries), its warps and its
    software-pipelining stages."""

    held: int
    step: int
    num_warps: int
    num_stages: int


#: Widest head block (the wider of q's and v's, padded) -> (forward, backward) tiling.
#: Each program keeps its accumulators in registers (the forward one ``held x Dv`` tile
#: and q's; a dk/dv program dk, dv and its k and v tiles), and each loaded tile goes
#: through shared memory once per pipelining stage. Every kernel stays within 96 KiB of
#: shared memory (as Triton 3.9 compiles them for sm_80 to sm_90; sm_86 and sm_89 give a
#: block 99 KiB, the least of those). The backward's loop body holds four
#: ``held x step`` tiles (scores, p, dp, ds) to the forward's two, so it steps over
#: fewer rows at a time. The 16-wide entries are the fastest ``benchmarks/flash_blocks.py``
#: found (BENCHMARKS.md, "Measurements behind rules in the code"); the others follow the
#: shared-memory rule, untimed.
BLOCKS_16BIT = {
    16: (Blocks(64, 64, 4, 3), Blocks(64, 64, 4, 1)),
    32: (Blocks(64, 64, 4, 3), Blocks(64, 64, 4, 2)),
    64: (Blocks(64, 64, 4, 3), Blocks(64, 64, 4, 2)),
    128: (Blocks(64, 64, 8, 3), Blocks(64, 32, 8, 2)),
    256: (Blocks(32, 32, 8, 2), Blocks(32, 32, 8, 1)),
}
#: fp32 tiles take twice the bytes, and a 3xTF32 product keeps each operand's two parts.
BLOCKS_FP32 = {
    16: (Blocks(64, 64, 4, 3), Blocks(64, 32, 4, 1)),
    32: (Blocks(64, 32, 4, 2), Blocks(32, 32, 4, 2)),
    64: (Blocks(64, 32, 4, 2), Blocks(32, 32, 4, 2)),
    128: (Blocks(32, 32, 4, 2), Blocks(32, 16, 4, 1)),
    256: (Blocks(16, 16, 4, 2), Blocks(16, 16, 4, 1)),
}


def choose_blocks(head_block: int, dtype: torch.dtype, backward: bool) -> Blocks:
    """The tiling for heads padded to ``head_block`` (a power of two from 16 to 256)
    in ``dtype``: the forward's or the backward's (``BLOCKS_16BIT``, ``BLOCKS_FP32``).
    Every size is at least 16, ``tl.dot``'s minimum."""
    table = BLOCKS_FP32 if dtype == torch.float32 else BLOCKS_16BIT
    forward_blocks, backward_blocks = table[head_block]
    return backward_blocks if backward else forward_blocks


# ---------------------------------------------------------------------------
# Kernel helpers
# ---------------------------------------------------------------------------


@triton.jit
def _rows(start, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    # Row (or column) indices of a block; int64 where some tensor's offsets pass int32.
    idx = start + tl.arange(0, BLOCK)
    if WIDE:
        idx = idx.to(tl.int64)
    return idx


@triton.jit
def _load_tile(base, rows, cols, stride_r, stride_c, n_rows, n_cols, EMULATE_BF16: tl.constexpr):
    # A [rows, cols] tile through the tensor's strides, 0 outside it: padding adds
    # nothing to a product. Loading with rows and cols swapped gives the transposed tile.
    ptrs = base + rows[:, None] * stride_r + cols[None, :] * stride_c
    x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    if EMULATE_BF16:
        x = x.to(tl.float32)  # bf16 to fp32 is exact
    return x


@triton.jit
def _as_operand(x, like, EMULATE_BF16: tl.constexpr):
    # An fp32 tile (p, ds) as a product operand of the dtype of the tile ``like``.
    if EMULATE_BF16:
        return round_bf16(x)
    else:
        return x.to(like.dtype)


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    # acc + a @ b in fp32; the precision is only chosen for fp32 operands.
    if FP32_DOT:
        return tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _store_tile(base, rows, cols, stride_r, stride_c, n_rows, n_cols, x, EMULATE_BF16: tl.constexpr):
    # An fp32 tile stored in the tensor's dtype, rounded to nearest even.
    if EMULATE_BF16:
        x = round_bf16(x)
    ptrs = base + rows[:, None] * stride_r + cols[None, :] * stride_c
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def _seen(queries, keys, M, CAUSAL: tl.constexpr):
    # [queries, keys]: which key each query attends (keys past M are padding).
    seen = keys[None, :] < M
    if CAUSAL:
        seen = seen & (keys[None, :] <= queries[:, None])
    return seen


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@triton.jit
def _forward_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, M, D, DV,
    qk_scale,
    CAUSAL: tl.constexpr, EMULATE_BF16: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # qk_scale: scale * log2(e), so that exp2 of the scaled scores is exp of the scores.
    # Out [B, H, N, DV] through its strides; Lse [B, H, N] contiguous fp32.
    n_blocks = tl.cdiv(N, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % n_blocks
    bh = (pid // n_blocks).to(tl.int64)  # b * stride_b can pass int32 where no head's offsets do
    b = bh // H
    h = bh % H
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    o_base = Out + b * stride_ob + h * stride_oh

    queries = _rows(pid_m * BLOCK_M, BLOCK_M, WIDE)
    d = _rows(0, BLOCK_D, WIDE)
    dv = _rows(0, BLOCK_DV, WIDE)
    q = _load_tile(q_base, queries, d, stride_qn, stride_qd, N, D, EMULATE_BF16)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running row max of the scores (base 2)
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)  # running sum of p @ v
    hi = M
    if CAUSAL:
        hi = tl.minimum(M, (pid_m + 1) * BLOCK_M)  # no key after this block's last query
    for start_n in range(0, hi, BLOCK_N):
        keys = _rows(start_n, BLOCK_N, WIDE)
        kt = _load_tile(k_base, d, keys, stride_kd, stride_km, D, M, EMULATE_BF16)
        s = _dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), FP32_DOT, PRECISION) * qk_scale
        s = tl.where(_seen(queries, keys, M, CAUSAL), s, float("-inf"))
        # The first block holds key 0, which every query sees: m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_tile(v_base, keys, dv, stride_vm, stride_vd, M, DV, EMULATE_BF16)
        acc = _dot(_as_operand(p, v, EMULATE_BF16), v, acc * alpha[:, None], FP32_DOT, PRECISION)
        m_i = m_new

    _store_tile(o_base, queries, dv, stride_on, stride_od, N, DV, acc / l_i[:, None], EMULATE_BF16)
    tl.store(Lse + bh * N + queries, (m_i + tl.log2(l_i)) * _LN2_K, mask=queries < N)


@triton.jit
def _delta_kernel(
    Out, DOut, Delta,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_gb, stride_gh, stride_gn, stride_gd,
    H, N, DV,
    WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # Delta [B, H, N] contiguous fp32: rowsum(dout * out), each product in fp32.
    n_blocks = tl.cdiv(N, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % n_blocks
    bh = (pid // n_blocks).to(tl.int64)
    b = bh // H
    h = bh % H
    queries = _rows(pid_m * BLOCK_M, BLOCK_M, WIDE)
    dv = _rows(0, BLOCK_DV, WIDE)
    o = _load_tile(Out + b * stride_ob + h * stride_oh, queries, dv, stride_on, stride_od, N, DV, False)
    do = _load_tile(DOut + b * stride_gb + h * stride_gh, queries, dv, stride_gn, stride_gd, N, DV, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + bh * N + queries, delta, mask=queries < N)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV_,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    H, N, M, D, DV,
    scale, qk_scale,
    CAUSAL: tl.constexpr, EMULATE_BF16: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # One block of BLOCK_N keys; loops over the queries BLOCK_M at a time. Tiles are
    # transposed ([keys, queries]) so that dk and dv accumulate as [keys, width].
    # DK [B, H, M, D] and DV_ [B, H, M, DV] contiguous; Lse, Delta [B, H, N] contiguous.
    n_blocks = tl.cdiv(M, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % n_blocks
    bh = (pid // n_blocks).to(tl.int64)
    b = bh // H
    h = bh % H
    q_base = Q + b * stride_qb + h * stride_qh
    g_base = DOut + b * stride_gb + h * stride_gh
    row_stats = bh * N  # this batch-head's first row of Lse and Delta

    keys = _rows(pid_n * BLOCK_N, BLOCK_N, WIDE)
    d = _rows(0, BLOCK_D, WIDE)
    dv = _rows(0, BLOCK_DV, WIDE)
    k = _load_tile(K + b * stride_kb + h * stride_kh, keys, d, stride_km, stride_kd, M, D, EMULATE_BF16)
    v = _load_tile(V + b * stride_vb + h * stride_vh, keys, dv, stride_vm, stride_vd, M, DV, EMULATE_BF16)

    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv_acc = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # no query before this block's first key sees it
    for start_m in range(lo, N, BLOCK_M):
        queries = _rows(start_m, BLOCK_M, WIDE)
        in_rows = queries < N
        qt = _load_tile(q_base, d, queries, stride_qd, stride_qn, D, N, EMULATE_BF16)
        lse = tl.load(Lse + row_stats + queries, mask=in_rows, other=0.0) * _LOG2E_K
        st = _dot(k, qt, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), FP32_DOT, PRECISION) * qk_scale
        seen = in_rows[None, :]
        if CAUSAL:
            seen = seen & (keys[:, None] <= queries[None, :])
        pt = tl.where(seen, tl.exp2(st - lse[None, :]), 0.0)  # softmax weights, transposed
        do = _load_tile(g_base, queries, dv, stride_gn, stride_gd, N, DV, EMULATE_BF16)
        dv_acc = _dot(_as_operand(pt, do, EMULATE_BF16), do, dv_acc, FP32_DOT, PRECISION)
        dpt = _dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), FP32_DOT, PRECISION)
        delta = tl.load(Delta + row_stats + queries, mask=in_rows, other=0.0)
        dst = pt * (dpt - delta[None, :])  # the scores' gradient, transposed, before the scale
        dk = _dot(_as_operand(dst, qt, EMULATE_BF16), tl.trans(qt), dk, FP32_DOT, PRECISION)

    _store_tile(DK + bh * M * D, keys, d, D, 1, M, D, dk * scale, EMULATE_BF16)
    _store_tile(DV_ + bh * M * DV, keys, dv, DV, 1, M, DV, dv_acc, EMULATE_BF16)


@triton.jit
def _dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    H, N, M, D, DV,
    scale, qk_scale,
    CAUSAL: tl.constexpr, EMULATE_BF16: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # One block of BLOCK_M queries; loops over the keys BLOCK_N at a time.
    # DQ [B, H, N, D] contiguous; Lse, Delta [B, H, N] contiguous.
    n_blocks = tl.cdiv(N, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % n_blocks
    bh = (pid // n_blocks).to(tl.int64)
    b = bh // H
    h = bh % H
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    queries = _rows(pid_m * BLOCK_M, BLOCK_M, WIDE)
    in_rows = queries < N
    d = _rows(0, BLOCK_D, WIDE)
    dv = _rows(0, BLOCK_DV, WIDE)
    q = _load_tile(Q + b * stride_qb + h * stride_qh, queries, d, stride_qn, stride_qd, N, D, EMULATE_BF16)
    do = _load_tile(DOut + b * stride_gb + h * stride_gh, queries, dv, stride_gn, stride_gd, N, DV, EMULATE_BF16)
    lse = tl.load(Lse + bh * N + queries, mask=in_rows, other=0.0) * _LOG2E_K
    delta = tl.load(Delta + bh * N + queries, mask=in_rows, other=0.0)

    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = M
    if CAUSAL:
        hi = tl.minimum(M, (pid_m + 1) * BLOCK_M)  # no key after this block's last query
    for start_n in range(0, hi, BLOCK_N):
        keys = _rows(start_n, BLOCK_N, WIDE)
        kt = _load_tile(k_base, d, keys, stride_kd, stride_km, D, M, EMULATE_BF16)
        vt = _load_tile(v_base, dv, keys, stride_vd, stride_vm, DV, M, EMULATE_BF16)
        s = _dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), FP32_DOT, PRECISION) * qk_scale
        p = tl.where(_seen(queries, keys, M, CAUSAL), tl.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, vt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), FP32_DOT, PRECISION)
        ds = p * (dp - delta[:, None])  # the scores' gradient, before the scale
        dq = _dot(_as_operand(ds, kt, EMULATE_BF16), tl.trans(kt), dq, FP32_DOT, PRECISION)

    _store_tile(DQ + bh * N * D, queries, d, D, 1, N, D, dq * scale, EMULATE_BF16)


# ---------------------------------------------------------------------------
# Host functions
# ---------------------------------------------------------------------------


def check_inputs(q, k, v, scale) -> None:
    """``ValueError`` naming what is wrong where q, k, v and ``scale`` are not what the kernels take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"flash attention: {name} must be a 4-d tensor [B, H, rows, width]; got {shape}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise ValueError(
            f"flash attention: q, k and v must share one dtype among float32, float16 and bfloat16; "
            f"got {q.dtype}, {k.dtype}, {v.dtype} (convert them first)"
        )
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"flash attention: q, k and v must have the same batch and heads (dims 0 and 1); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (repeat k and v over grouped heads first)"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"flash attention: k and v must have as many keys (dim 2); got {k.shape[2]} and {v.shape[2]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"flash attention: q and k must have the same head width (dim 3); got {q.shape[3]} and {k.shape[3]}"
        )
    if min(q.shape[:3]) < 1 or k.shape[2] < 1 or min(q.shape[3], v.shape[3]) < 1:
        raise ValueError(
            f"flash attention: every size must be at least 1; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if max(q.shape[3], v.shape[3]) > MAX_HEAD_WIDTH:
        raise ValueError(
            f"flash attention: head widths up to {MAX_HEAD_WIDTH} are supported; got {q.shape[3]} (q, k) and "
            f"{v.shape[3]} (v)"
        )
    if not q.device == k.device == v.device:
        raise ValueError(f"flash attention: q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"flash attention: scale must be a finite number; got {scale!r}")


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return
    raise RuntimeError(
        f"flash attention: Triton needs a CUDA device, or TRITON_INTERPRET=1 (set before Triton is imported) to "
        f"run on CPU tensors with its interpreter; got tensors on {device}"
    )


def _wide(*tensors: torch.Tensor) -> bool:
    """Whether an offset into one of ``tensors`` can pass int32 (through its strides)."""
    return any(sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1 > INT32_LIMIT for t in tensors)


def _head_block(width: int) -> int:
    return max(16, next_power_of_2(width))


def _products(dtype: torch.dtype, precision: Optional[str]) -> dict:
    """The kernels' product constexprs for inputs of ``dtype``."""
    emulate_bf16 = dtype == torch.bfloat16 and interpreting()
    return dict(
        EMULATE_BF16=emulate_bf16,
        FP32_DOT=dtype == torch.float32 or emulate_bf16,
        # Emulated bf16 operands are bf16 values held in fp32: exact products need "ieee".
        PRECISION=dot_precision(precision) if dtype == torch.float32 else "ieee",
    )


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, precision: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention: ``out [B, H, N, Dv]`` (q's dtype, contiguous) and
    ``lse [B, H, N]`` (fp32, contiguous).

    ``out = softmax(scale * q @ k^T) @ v`` and ``lse`` is the natural-log logsumexp
    over the keys of ``scale * q @ k^T``. ``q [B, H, N, D]``, ``k [B, H, M, D]``,
    ``v [B, H, M, Dv]`` in one dtype (float32, float16, bfloat16), any strides, head
    widths up to 256. ``causal``: query ``i`` attends keys ``j <= i`` (top-left
    aligned, as ``F.scaled_dot_product_attention(is_causal=True)``). ``precision``: fp32
    products' (``dot_precision``).
    """
    check_inputs(q, k, v, scale)
    dot_precision(precision)  # a bad value raises before anything launches
    _check_device(q.device)
    scale = float(scale)  # an fp32 argument: Triton would pass an int as an integer
    B, H, N, D = q.shape
    M, DV = k.shape[2], v.shape[3]
    out = torch.empty((B, H, N, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    block_d, block_dv = _head_block(D), _head_block(DV)
    blocks = choose_blocks(max(block_d, block_dv), q.dtype, backward=False)
    grid = (triton_cdiv(N, blocks.held) * B * H,)
    _forward_kernel[grid](
        q, k, v, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, N, M, D, DV,
        scale * LOG2E,
        CAUSAL=bool(causal), WIDE=_wide(q, k, v, out), **_products(q.dtype, precision),
        BLOCK_M=blocks.held, BLOCK_N=blocks.step, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return out, lse


def flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    causal: bool,
    precision: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``dq, dk, dv`` (contiguous, in q's, k's and v's dtype) of
    ``flash_forward(q, k, v, scale, causal, precision)``, given its ``out`` and ``lse``
    and the output's gradient ``dout`` (any strides; out's shape and dtype).

    Deterministic: no atomics, each gradient summed by one program in a fixed order.
    """
    check_inputs(q, k, v, scale)
    dot_precision(precision)
    B, H, N, D = q.shape
    M, DV = k.shape[2], v.shape[3]
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, H, N, DV) or t.dtype != q.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"flash attention backward: {name} must be [B, H, N, Dv] = {[B, H, N, DV]} in {q.dtype}; got {got}"
            )
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, H, N) or lse.dtype != torch.float32:
        got = f"{tuple(lse.shape)} {lse.dtype}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(
            f"flash attention backward: lse must be [B, H, N] = {[B, H, N]} in float32, as flash_forward "
            f"returns it; got {got}"
        )
    if any(t.device != q.device for t in (out, lse, dout)):
        raise ValueError(
            f"flash attention backward: out, lse and dout must be on q's device {q.device}; got "
            f"{out.device}, {lse.device}, {dout.device}"
        )
    _check_device(q.device)
    scale = float(scale)
    lse = lse.contiguous()
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    dq = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, H, M, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, H, M, DV), dtype=v.dtype, device=q.device)
    block_d, block_dv = _head_block(D), _head_block(DV)
    blocks = choose_blocks(max(block_d, block_dv), q.dtype, backward=True)
    wide = _wide(q, k, v, out, dout, dq, dk, dv)
    products = _products(q.dtype, precision)

    _delta_kernel[(triton_cdiv(N, blocks.held) * B * H,)](
        out, dout, delta,
        *out.stride(), *dout.stride(),
        H, N, DV,
        WIDE=wide, BLOCK_M=blocks.held, BLOCK_DV=block_dv,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    # dk and dv: each program holds a block of keys and steps over the queries.
    _dkdv_kernel[(triton_cdiv(M, blocks.held) * B * H,)](
        q, k, v, dout, lse, delta, dk, dv,
        *strides,
        H, N, M, D, DV,
        scale, scale * LOG2E,
        CAUSAL=bool(causal), WIDE=wide, **products,
        BLOCK_M=blocks.step, BLOCK_N=blocks.held, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    # dq: each program holds a block of queries and steps over the keys.
    _dq_kernel[(triton_cdiv(N, blocks.held) * B * H,)](
        q, k, v, dout, lse, delta, dq,
        *strides,
        H, N, M, D, DV,
        scale, scale * LOG2E,
        CAUSAL=bool(causal), WIDE=wide, **products,
        BLOCK_M=blocks.held, BLOCK_N=blocks.step, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return dq, dk, dv
