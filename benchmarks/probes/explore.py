"""GPU probe: where the MLP and softmax-attention kernels lose time, and what a
persistent MLP kernel and fp16-split (3xFP16) attention would give. Writes
explore.json to the folder given."""
import itertools, json, math, os, sys
import torch, triton, triton.testing
import torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import run_parts
import autofuser
from autofuser_core.launch import cast_inputs
from matmul import Mlp, precision, M
from persistent_mlp import pmlp
from attention_fp16x3 import attn3

OUT = sys.argv[1]
R = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count

def ms(fn):
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))

def save():
    json.dump(R, open(os.path.join(OUT, "explore.json"), "w"), indent=1)

def sweep(k, inputs, configs, expected=None, tol=None):
    """Time kernel k over configs; compile them in threads first."""
    raw = k.with_live_attrs(inputs)
    inputs = cast_inputs(raw, k.casts)  # as the kernel's own config's launcher converts them
    outs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d in k.output_layout]
    def launch(cfg):  # a config that converts its inputs itself takes them unconverted
        args = raw if k.source.converts_casts(cfg) else inputs
        k.kernel[k.source.grid(cfg)](*args, *outs, **k.source.launch_args(cfg))
    res = []
    for cfg in configs:
        try:
            launch(cfg); torch.cuda.synchronize()
            err = None
            if expected is not None:
                err = float(((outs[0].float() - expected.float()).norm() / expected.float().norm()))
            t = ms(lambda: launch(cfg))
            res.append({"config": cfg, "ms": t, "rel_err": err})
        except Exception as e:
            res.append({"config": cfg, "error": repr(e)[:300]})
            torch.cuda.synchronize()
    return sorted(res, key=lambda r: r.get("ms", 1e9))

def part_mlp():
    R["mlp"] = {}
    w = 128
    torch.manual_seed(0)
    model = Mlp(w).to(dev).eval()
    x = torch.randn(M, w, device=dev)
    for mode in ("bf16", "tf32"):
        r = R["mlp"][mode] = {}
        with precision(mode), torch.no_grad():
            expected = model(x)
            r["eager_ms"] = ms(lambda: model(x))
            fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
            fused(x)
            ks = [k for k in fused.kernels() if k.source.layout == "mlp"]
            r["report"] = str(fused.report())[-1500:]
            if ks:
                configs = [{"BLOCK_M": m, "BLOCK_H": h, "BLOCK_K": 64, "num_warps": nw, "num_stages": ns}
                           for m, h, (nw, ns) in itertools.product((64, 128, 256), (32, 64, 128), ((4, 2), (8, 2), (8, 3)))]
                r["sweep"] = sweep(ks[0], [x], configs, expected)
                r["source"] = ks[0].source.source
            if mode == "bf16":
                xb = x.to(torch.bfloat16)
                w1, b1 = model.fc1.weight.to(torch.bfloat16), model.fc1.bias.to(torch.bfloat16)
                w2, b2 = model.fc2.weight.to(torch.bfloat16), model.fc2.bias.to(torch.bfloat16)
                out = torch.empty_like(xb)
                r["persistent"] = []
                for bm, nw, ns in ((128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2)):
                    try:
                        g = lambda: pmlp[(SMS,)](xb, w1, b1, w2, b2, out, M, NUM_PROGS=SMS, BLOCK_M=bm, num_warps=nw, num_stages=ns)
                        g(); torch.cuda.synchronize()
                        err = float((out.float() - expected.float()).norm() / expected.float().norm())
                        r["persistent"].append({"BLOCK_M": bm, "warps": nw, "stages": ns, "ms": ms(g), "rel_err": err})
                    except Exception as e:
                        r["persistent"].append({"BLOCK_M": bm, "warps": nw, "stages": ns, "error": repr(e)[:300]})
        save()
        print("mlp", mode, r.get("eager_ms"), (r.get("sweep") or [{}])[:3], r.get("persistent"), flush=True)
    with precision("tf32"), torch.no_grad():
        c = torch.compile(model)
        c(x); c(x)
        R["mlp"]["tf32"]["compile_ms"] = ms(lambda: c(x))
    with precision("bf16"), torch.no_grad():
        torch._dynamo.reset(); c = torch.compile(model)
        c(x); c(x)
        R["mlp"]["bf16"]["compile_ms"] = ms(lambda: c(x))
    save()

def split16(x):
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax)), torch.zeros_like(amax))
    s = torch.exp2(14 - e)
    xs = x * s
    hi = xs.half()
    lo = (xs - hi.float()).half()
    return hi.contiguous(), lo.contiguous(), s.flatten()

def part_attention():
    R["attn"] = {}
    B, H, N, D = 4, 8, 11271, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev) for _ in range(3))
    # float64 reference on two heads
    def ref(h):
        qq, kk, vv = (t[0, h].double() for t in (q, k, v))
        s = qq @ kk.T / math.sqrt(D)
        return torch.softmax(s, -1) @ vv
    refs = [ref(0), ref(5)]
    def err64(o):
        o = o.double()
        return max(float((o[0, h] - r).norm() / r.norm()) for h, r in zip((0, 5), refs))
    r = R["attn"]["fp32"] = {}
    with precision("fp32"), torch.no_grad():
        e = F.scaled_dot_product_attention(q, k, v)
        r["eager_ms"] = ms(lambda: F.scaled_dot_product_attention(q, k, v)); r["eager_err64"] = err64(e)
        class S(torch.nn.Module):
            def forward(self, q, k, v):
                return F.scaled_dot_product_attention(q, k, v)
        fused = autofuser.fuse(S(), progress=False, tune=False, verify_speed=False)
        fused(q, k, v)
        ks = [kk for kk in fused.kernels() if kk.source.layout == "attention"]
        if ks:
            cfgs = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
                    for m, n, w, s in ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3))]
            r["tf32x3"] = sweep(ks[0], [q, k, v], cfgs, e)[:5]
            inputs = ks[0].with_live_attrs([q, k, v]); out = torch.empty_like(q)
            best = r["tf32x3"][0]["config"]
            ks[0].kernel[ks[0].source.grid(best)](*inputs, out, **ks[0].source.launch_args(best))
            r["tf32x3_err64"] = err64(out)
        (qh, ql, sq), (kh, kl, sk), (vh, vl, sv) = split16(q), split16(k), split16(v)
        torch.cuda.synchronize()
        r["split_ms"] = ms(lambda: (split16(q), split16(k), split16(v)))
        scales = torch.cat([(1 / math.sqrt(D)) * 1.4426950408889634 / (sq * sk), 1 / sv]).float().contiguous()
        out = torch.empty_like(q)
        r["fp16x3"] = []
        for bm, bn, nw, ns in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            if bm == 128 and nw == 4 and bn == 128:
                continue
            try:
                g = lambda: attn3[(triton.cdiv(N, bm), B * H)](qh, ql, kh, kl, vh, vl, scales, out, N, B * H, D=D,
                                                              BLOCK_M=bm, BLOCK_N=bn, SPLIT_IN_KERNEL=0, num_warps=nw, num_stages=ns)
                g(); torch.cuda.synchronize()
                r["fp16x3"].append({"cfg": [bm, bn, nw, ns], "ms": ms(g), "err64": err64(out),
                                    "rel_vs_eager": float((out - e).norm() / e.norm())})
            except Exception as ex:
                r["fp16x3"].append({"cfg": [bm, bn, nw, ns], "error": repr(ex)[:300]})
        r["fp16x3"].sort(key=lambda a: a.get("ms", 1e9))
        save()
        print("attn fp32", r.get("eager_ms"), r.get("eager_err64"), r.get("tf32x3", [])[:2], r.get("tf32x3_err64"), r["fp16x3"][:3], flush=True)
    r = R["attn"]["bf16"] = {}
    with precision("bf16"), torch.no_grad():
        e = F.scaled_dot_product_attention(q, k, v)
        r["eager_ms"] = ms(lambda: F.scaled_dot_product_attention(q, k, v))
        fused = autofuser.fuse(S(), progress=False, tune=False, verify_speed=False)
        fused(q, k, v)
        ks = [kk for kk in fused.kernels() if kk.source.layout == "attention"]
        if ks:
            cfgs = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
                    for m, n, w, s in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4),
                                       (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 8, 3))]
            r["af"] = sweep(ks[0], [q, k, v], cfgs, e)
            r["source"] = ks[0].source.source
        save()
        print("attn bf16", r.get("eager_ms"), r.get("af", [])[:3], flush=True)

run_parts((part_mlp, part_attention), R, save)
