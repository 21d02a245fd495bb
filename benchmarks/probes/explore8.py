"""GPU probe 8: where the width-128 bf16 MLP's forward spends its time, and what the
persistent MLP kernel's tile loop could change.

1. The forward as ``matmul.py`` fuses it (bf16 autocast, 90168 rows): ``do_bench`` of the
   forward, of one CUDA-graph replay of it (the GPU's time alone), of the kernel alone
   and of the launcher's two weight conversions.
2. The persistent MLP kernel, hand-written with the generated kernel's numerics (bf16
   roundings, the same GELU), in variants:
   - ``plain``: the generated kernel's order, weights read as fp32 and converted in the
     prologue (no launcher conversion) or read as bf16;
   - ``pipelined``: the next slice's first product issued before this slice's second;
   - ``tail``: the row blocks that would leave most programs idle in the last round are
     run as half blocks (5 rounds of 128 rows and one of 64, not 6 of 128);
   - ``bh128``: hidden slices of 128 columns, not 64.
3. The generated kernel's streamed form with its hidden loop marked for Triton's warp
   specialisation (``tl.range(..., warp_specialize=True)``).

    python3 benchmarks/probes/explore8.py OUT_DIR
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import edit, load_variant, mlp_case, ms, results_file, run_parts, time_variants  # noqa: E402
from autofuser_plugins.elementwise.ops._common import _GELU_SOURCE  # noqa: E402

R, save = results_file("explore8.json")
# The generated kernels' GELU helper, as the elementwise plugin writes it.
GELU = _GELU_SOURCE.replace("def elementwise_gelu(", "def gelu(")


def persistent_source(rows: int, width: int, bh: int, order: str, tail: bool) -> str:
    """x + fc2(gelu(fc1(x))) over ``rows`` x ``width`` fp32 rows, bf16 products, hidden 2 * width."""
    k = n = width
    h = 2 * width
    slices = h // bh
    out = ["import triton", "import triton.language as tl", GELU, "",
           "@triton.jit",
           "def mlp(in0, in1, in2, in3, in4, out0, BLOCK_M: tl.constexpr, PROGRAMS: tl.constexpr):",
           f"    kk = tl.arange(0, {k})[:, None]",
           f"    cols = tl.arange(0, {n})[None, :]"]
    for s in range(slices):
        out += [f"    hs = {s * bh} + tl.arange(0, {bh})[None, :]",
                f"    hh = {s * bh} + tl.arange(0, {bh})[:, None]",
                f"    w1_{s} = tl.load(in1 + kk + hs * {k}).to(tl.float32).to(tl.bfloat16)",
                f"    w2_{s} = tl.load(in3 + hh + cols * {h}).to(tl.float32).to(tl.bfloat16)"]

    def hidden(s, ind):
        return [f"{ind}hs = {s * bh} + tl.arange(0, {bh})[None, :]",
                f"{ind}acc1 = tl.dot(a_op, w1_{s})",
                f"{ind}v = (acc1 + tl.load(in2 + hs)).to(tl.bfloat16).to(tl.float32)",
                f"{ind}hid_{s} = gelu(v).to(tl.bfloat16)"]

    def body(block, row0, ind):
        lines = [f"{ind}rows = ({row0} + tl.arange(0, {block}))[:, None]",
                 f"{ind}row_mask = rows < {rows}",
                 f"{ind}ks = tl.arange(0, {k})[None, :]",
                 f"{ind}a_op = tl.load(in0 + rows * {k} + ks, mask=row_mask, other=0).to(tl.bfloat16)",
                 f"{ind}acc2 = tl.zeros(({block}, {n}), tl.float32)"]
        if order == "plain":
            for s in range(slices):
                lines += hidden(s, ind) + [f"{ind}acc2 += tl.dot(hid_{s}, w2_{s})"]
        else:  # the next slice's first product before this slice's second
            lines += hidden(0, ind)
            for s in range(1, slices):
                lines += [f"{ind}acc1 = tl.dot(a_op, w1_{s})",
                          f"{ind}acc2 += tl.dot(hid_{s - 1}, w2_{s - 1})",
                          f"{ind}hs = {s * bh} + tl.arange(0, {bh})[None, :]",
                          f"{ind}v = (acc1 + tl.load(in2 + hs)).to(tl.bfloat16).to(tl.float32)",
                          f"{ind}hid_{s} = gelu(v).to(tl.bfloat16)"]
            lines += [f"{ind}acc2 += tl.dot(hid_{slices - 1}, w2_{slices - 1})"]
        lines += [f"{ind}x = tl.load(in0 + rows * {k} + cols, mask=row_mask, other=0)",
                  f"{ind}y = (acc2 + tl.load(in4 + cols)).to(tl.bfloat16).to(tl.float32)",
                  f"{ind}tl.store(out0 + rows * {n} + cols, x + y, mask=row_mask)"]
        return lines

    if not tail:
        out += [f"    for tile in range(tl.program_id(0), tl.cdiv({rows}, BLOCK_M), PROGRAMS):"]
        out += body("BLOCK_M", "tile * BLOCK_M", "        ")
    else:
        out += [f"    main = ({rows} // BLOCK_M) // PROGRAMS * PROGRAMS",
                "    for tile in range(tl.program_id(0), main, PROGRAMS):"]
        out += body("BLOCK_M", "tile * BLOCK_M", "        ")
        out += [f"    for tile in range(tl.program_id(0), tl.cdiv({rows} - main * BLOCK_M, BLOCK_M // 2), PROGRAMS):"]
        out += body("BLOCK_M // 2", "main * BLOCK_M + tile * (BLOCK_M // 2)", "        ")
    return "\n".join(out) + "\n"


def forward_and_kernel():
    """Part 1."""
    import autofuser
    from autofuser_core.launch import cast_inputs
    from matmul import M, Mlp, precision
    res = R.setdefault("forward", {})
    torch.manual_seed(0)
    model = Mlp(128).cuda().eval()
    x = torch.randn(M, 128, device="cuda")
    with precision("bf16"), torch.no_grad():
        res["eager_ms"] = ms(lambda: model(x))
        fused = autofuser.fuse(model, progress=False)
        fused(x)
        res["forward_ms"] = ms(lambda: fused(x))
        res["notes"] = list(fused.report().notes)
        (kernel,) = fused.kernels()
        res["config"] = kernel.config
        live = kernel.with_live_attrs([x])
        res["conversions_ms"] = ms(lambda: cast_inputs(live, kernel.casts))
        inputs = cast_inputs(live, kernel.casts)
        res["kernel_launch_ms"] = ms(lambda: kernel.launch(*live))
        res["kernel_only_ms"] = ms(lambda: kernel.launch(*inputs)) if not kernel.casts else None
        # The GPU's time alone: the forward captured once, replayed.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(x)
        graph.replay()
        torch.cuda.synchronize()
        res["graph_replay_ms"] = ms(graph.replay)
        res["graph_matches"] = bool(torch.equal(out, fused(x)))
        # The same kernel fed fp32 weights (the persistent prologue converts them).
        raw = [t for t in live]
        outs = [torch.empty_strided(s, st, dtype=d, device="cuda") for s, st, d in kernel.output_layout]
        args = kernel.source.launch_args(kernel.config)
        g = lambda: kernel.kernel[kernel.source.grid(kernel.config)](*raw, *outs, **args)
        if kernel.config.get("PERSISTENT"):
            g()
            torch.cuda.synchronize()
            res["fp32_weights_matches"] = bool(torch.equal(outs[0], fused(x)))
            res["fp32_weights_kernel_ms"] = ms(g)
    print("forward", res, flush=True)


def hand_written():
    """Part 2."""
    from matmul import M
    res = R.setdefault("hand", {})
    case = mlp_case("autocast", 128)
    res["eager_ms"] = case["eager_ms"]
    k = case["kernel"]
    live = list(case["inputs"])  # the weights converted as the launcher converts them
    fp32 = k.with_live_attrs([live[0]])  # the weights as the model holds them
    expected = case["expected"].float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {f"{o}{'_tail' if t else ''}_bh{bh}": (o, t, bh) for o in ("plain", "pipelined") for t in (False, True)
                for bh in (64, 128)}
    for tag, (order, tail, bh) in variants.items():
        kern = load_variant(persistent_source(M, 128, bh, order, tail), f"e8_{tag}").mlp
        for weights, inputs in (("fp32w", fp32), ("bf16w", live)):
            if weights == "bf16w" and tag != "plain_bh64":
                continue
            for block, warps, stages in ((128, 8, 1), (128, 8, 2)):
                key = f"{tag} {weights} {block},{warps},{stages}"
                try:
                    out = torch.full_like(case["outputs"][0], float("nan"))
                    grid = (min(sms, -(-M // block)),)
                    g = lambda: kern[grid](*inputs, out, BLOCK_M=block, PROGRAMS=sms, num_warps=warps,
                                           num_stages=stages)
                    g()
                    torch.cuda.synchronize()
                    err = float((out.float() - expected).norm() / expected.norm())
                    res[key] = {"ms": ms(g), "rel_err": err}
                except Exception as e:
                    res[key] = repr(e)[:300]
                print("hand", key, res[key], flush=True)
            save()


def warp_specialised():
    """Part 3."""
    res = R.setdefault("streamed_ws", {})
    case = mlp_case("autocast", 128)
    source = case["kernel"].source.source
    variants = {"as_generated": source,
                "ws": edit(r"for h0 in range\(0, (\d+), BLOCK_H\):",
                           r"for h0 in tl.range(0, \1, BLOCK_H, warp_specialize=True):", source)}
    configs = [{"BLOCK_M": m, "BLOCK_H": 64, "BLOCK_K": 128, "num_warps": w, "num_stages": s, "PERSISTENT": 0,
                "PROGRAMS": 1} for m, w, s in ((64, 4, 2), (128, 8, 2), (128, 4, 2))]
    time_variants(case, variants, configs, res, "ws", save)


if __name__ == "__main__":
    run_parts([forward_and_kernel, hand_written, warp_specialised], R, save)
