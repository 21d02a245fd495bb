"""GPU probe 5: what would make the width-256 product kernels faster?

1. Linear + GELU (w -> 2w, M = 90168 rows), hand-written in two forms that share their
   tile code: one output tile per program (the form AutoFuser generates), and persistent
   (one program per multiprocessor walking tiles, its K loop flattened into the tile loop
   by Triton's pipeliner, ``tl.range(..., flatten=True)``, so the next tile's loads are in
   flight during this tile's epilogue). Under bf16 autocast with the weight read as fp32
   and converted per tile, and read as bf16 (converted once per call, not timed here);
   and in TF32.
2. The MLP kernel (w -> 2w -> w) at width 256 under bf16 autocast over configs the
   strategy's validity rule refuses (taller row blocks, more warps), with each compiled
   kernel's registers and spills: the rule keeps 32-row blocks, and each such block reads
   both weights from L2 again.

    python3 benchmarks/probes/explore5.py OUT_DIR
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import load_variant, mlp_case, ms, results_file, run_parts  # noqa: E402
from matmul import M, precision  # noqa: E402

R, save = results_file("explore5.json")


KERNEL = """import triton
import triton.language as tl


@triton.jit
def linear_gelu(x, w, b, out, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                BF16: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = num_m * num_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN):
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % size_m
        pid_n = (tile % in_group) // size_m
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)[None, :]
            kk = k0 + tl.arange(0, BLOCK_K)[:, None]
            a = tl.load(x + rows * K + ks, mask=rows < M, other=0)
            bt = tl.load(w + kk + cols * K)
            if BF16:
                acc = tl.dot(a.to(tl.bfloat16), bt.to(tl.bfloat16), acc)
            else:
                acc = tl.dot(a, bt, acc, input_precision="tf32")
        v = acc + tl.load(b + cols)
        if BF16:
            v = v.to(tl.bfloat16).to(tl.float32)
        v = elementwise_gelu(v)
        tl.store(out + rows * N + cols, v.to(out.dtype.element_ty), mask=rows < M)
"""


def linear_gelu_kernel():
    """The kernel above with the erf-free GELU AutoFuser generates."""
    from autofuser_plugins.elementwise.ops._common import _GELU_SOURCE
    return load_variant(KERNEL + "\n\n" + _GELU_SOURCE, "explore5_linear_gelu").linear_gelu


LINEAR_CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
    (128, 256, 64, 8, 3), (128, 256, 32, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (256, 128, 64, 8, 3),
    (64, 256, 64, 4, 3), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
]


def linear_part(width, mode, weight):
    key = f"linear+GELU w{width} {mode} W{weight}"
    res = R.setdefault(key, {})
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = torch.nn.Linear(width, 2 * width).to(dev)
    x = torch.randn(M, width, device=dev)
    with precision(mode), torch.no_grad():
        expected = torch.nn.functional.gelu(lin(x))
        res["eager_ms"] = ms(lambda: torch.nn.functional.gelu(lin(x)))
        res["eager_linear_ms"] = ms(lambda: lin(x))
    w = lin.weight.detach()
    if weight == "bf16":
        w = w.to(torch.bfloat16)
    out = torch.empty(M, 2 * width, device=dev, dtype=expected.dtype)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    linear_gelu = linear_gelu_kernel()
    for bm, bn, bk, warps, stages in LINEAR_CONFIGS:
        tiles = triton.cdiv(M, bm) * triton.cdiv(2 * width, bn)
        for form, programs, flatten in (("tile", tiles, False), ("persistent", sms, True),
                                        ("persistent2", 2 * sms, True)):
            name = f"{form} {bm},{bn},{bk},{warps},{stages}"
            try:
                out.fill_(float("nan"))
                run = lambda: linear_gelu[(min(programs, tiles),)](
                    x, w, lin.bias, out, M, 2 * width, width, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                    PROGRAMS=min(programs, tiles), FLATTEN=flatten, BF16=mode == "bf16",
                    num_warps=warps, num_stages=stages)
                compiled = run()
                torch.cuda.synchronize()
                err = float((out.float() - expected.float()).norm() / expected.float().norm())
                res[name] = {"ms": ms(run), "rel_err": err, "regs": getattr(compiled, "n_regs", None),
                             "spills": getattr(compiled, "n_spills", None)}
            except Exception as e:  # a config the GPU refuses (resources) must not end the rest
                res[name] = repr(e)[:300]
            print(key, name, res[name], flush=True)
    save()


MLP_CONFIGS = [  # BLOCK_M, BLOCK_H, num_warps, num_stages
    (32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2),
    (128, 32, 8, 2), (128, 64, 16, 2), (128, 32, 16, 2), (128, 64, 8, 1), (64, 64, 8, 3), (128, 128, 16, 2),
    (256, 32, 16, 2),
]


def mlp_part(width):
    res = R.setdefault(f"mlp w{width} autocast", {})
    case = mlp_case("autocast", width)
    k, inputs, outs, expected = case["kernel"], case["inputs"], case["outputs"], case["expected"]
    res["eager_ms"] = case["eager_ms"]
    res["input_dtypes"] = [str(t.dtype) for t in inputs]
    for bm, bh, warps, stages in MLP_CONFIGS:
        cfg = {"BLOCK_M": bm, "BLOCK_H": bh, "BLOCK_K": 64, "num_warps": warps, "num_stages": stages}
        if "PERSISTENT" in k.config:
            cfg.update(PERSISTENT=0, PROGRAMS=1)
        name = f"{bm},{bh},{warps},{stages}"
        try:
            outs[0].fill_(float("nan"))
            run = lambda: k.kernel[k.source.grid(cfg)](*inputs, *outs, **k.source.launch_args(cfg))
            compiled = run()
            torch.cuda.synchronize()
            err = float((outs[0].float() - expected.float()).norm() / expected.float().norm())
            res[name] = {"ms": ms(run), "rel_err": err, "regs": getattr(compiled, "n_regs", None),
                         "spills": getattr(compiled, "n_spills", None)}
        except Exception as e:
            res[name] = repr(e)[:300]
        print("mlp", width, name, res[name], flush=True)
    save()


if __name__ == "__main__":
    parts = [lambda: mlp_part(256)]
    parts += [lambda w=w, m=m, wt=wt: linear_part(w, m, wt) for w, m, wt in (
        (256, "bf16", "bf16"), (256, "bf16", "fp32"), (256, "tf32", "fp32"), (128, "bf16", "bf16"),
        (128, "tf32", "fp32"))]
    run_parts(parts, R, save)
