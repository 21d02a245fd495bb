import triton
import triton.language as tl


@triton.jit
def attn3(qh, ql, kh, kl, vh, vl, scales, out, N, BH, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          SPLIT_IN_KERNEL: tl.constexpr):
    # Softmax attention with fp32 accuracy from fp16 tensor cores: every operand is a pair of fp16 values
    # (hi + lo) of a power-of-two-scaled copy; three products per product (lo*hi + hi*lo + hi*hi).
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * D
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    row_mask = rows < N
    d_cols = tl.arange(0, D)[None, :]
    d_rows = tl.arange(0, D)[:, None]
    q_hi = tl.load(qh + base + rows * D + d_cols, mask=row_mask, other=0)
    q_lo = tl.load(ql + base + rows * D + d_cols, mask=row_mask, other=0)
    qk_scale = tl.load(scales + bh)
    v_unscale = tl.load(scales + BH + bh)
    m_i = tl.full((BLOCK_M, 1), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M, 1), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)[None, :]
        key_rows = n0 + tl.arange(0, BLOCK_N)[:, None]
        key_mask = keys < N
        k_hi = tl.load(kh + base + keys * D + d_rows, mask=key_mask, other=0)
        k_lo = tl.load(kl + base + keys * D + d_rows, mask=key_mask, other=0)
        s = tl.dot(q_lo, k_hi)
        s = tl.dot(q_hi, k_lo, s)
        s = tl.dot(q_hi, k_hi, s)
        s = s * qk_scale
        s = tl.where(key_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1)[:, None])
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)[:, None]
        p_hi = p.to(tl.float16)
        p_lo = (p - p_hi.to(tl.float32)).to(tl.float16)
        v_hi = tl.load(vh + base + key_rows * D + d_cols, mask=key_rows < N, other=0)
        v_lo = tl.load(vl + base + key_rows * D + d_cols, mask=key_rows < N, other=0)
        pv = tl.dot(p_lo, v_hi)
        pv = tl.dot(p_hi, v_lo, pv)
        pv = tl.dot(p_hi, v_hi, pv)
        acc = acc * alpha + pv
        m_i = m_new
    o = tl.where(l_i > 0, acc / l_i, 0.0) * v_unscale
    tl.store(out + base + rows * D + d_cols, o, mask=row_mask)
