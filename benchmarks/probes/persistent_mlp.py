import triton
import triton.language as tl


@triton.jit
def pmlp(x, w1, b1, w2, b2, out, M, NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr):
    # Persistent MLP, K = N = 128, H = 256 in 4 chunks of 64: both weights stay in shared memory.
    pid = tl.program_id(0)
    ks = tl.arange(0, 128)[None, :]
    kk = tl.arange(0, 128)[:, None]
    hc = tl.arange(0, 64)[None, :]
    hr = tl.arange(0, 64)[:, None]
    cols = tl.arange(0, 128)[None, :]
    w1_0 = tl.load(w1 + kk + (hc + 0) * 128)
    w1_1 = tl.load(w1 + kk + (hc + 64) * 128)
    w1_2 = tl.load(w1 + kk + (hc + 128) * 128)
    w1_3 = tl.load(w1 + kk + (hc + 192) * 128)
    w2_0 = tl.load(w2 + (hr + 0) + cols * 256)
    w2_1 = tl.load(w2 + (hr + 64) + cols * 256)
    w2_2 = tl.load(w2 + (hr + 128) + cols * 256)
    w2_3 = tl.load(w2 + (hr + 192) + cols * 256)
    num_tiles = tl.cdiv(M, BLOCK_M)
    for tile in range(pid, num_tiles, NUM_PROGS):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
        row_mask = rows < M
        xt = tl.load(x + rows * 128 + ks, mask=row_mask, other=0)
        acc2 = tl.zeros((BLOCK_M, 128), tl.float32)
        h = tl.dot(xt, w1_0) + tl.load(b1 + hc + 0).to(tl.float32)
        h = h.to(tl.bfloat16).to(tl.float32)
        h = h * 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))
        acc2 = tl.dot(h.to(tl.bfloat16), w2_0, acc2)
        h = tl.dot(xt, w1_1) + tl.load(b1 + hc + 64).to(tl.float32)
        h = h.to(tl.bfloat16).to(tl.float32)
        h = h * 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))
        acc2 = tl.dot(h.to(tl.bfloat16), w2_1, acc2)
        h = tl.dot(xt, w1_2) + tl.load(b1 + hc + 128).to(tl.float32)
        h = h.to(tl.bfloat16).to(tl.float32)
        h = h * 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))
        acc2 = tl.dot(h.to(tl.bfloat16), w2_2, acc2)
        h = tl.dot(xt, w1_3) + tl.load(b1 + hc + 192).to(tl.float32)
        h = h.to(tl.bfloat16).to(tl.float32)
        h = h * 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))
        acc2 = tl.dot(h.to(tl.bfloat16), w2_3, acc2)
        y = (acc2 + tl.load(b2 + cols).to(tl.float32)).to(tl.bfloat16).to(tl.float32) + tl.load(x + rows * 128 + cols, mask=row_mask, other=0).to(tl.float32)
        tl.store(out + rows * 128 + cols, y.to(tl.bfloat16), mask=row_mask)
