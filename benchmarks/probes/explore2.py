"""GPU probe 2: where the split-pass attention chain (head width 64, strict fp32) and the
MLP kernel (bf16, width 128; streamed and persistent) spend their time: variants of the generated
sources with one part replaced, timed side by side.

    python3 benchmarks/probes/explore2.py OUT_DIR [attention] [mlp]"""
import importlib.util, json, os, re, sys, traceback
import torch, triton, triton.testing
import torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import run_parts
import autofuser
from autofuser_core.planner import plan_fusion_groups

OUT = sys.argv[1]
R = {}
dev = torch.device("cuda")

def ms(fn):
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))

def load(source, tag):
    path = os.path.join("/tmp", f"variant_{tag}.py")
    open(path, "w").write(source)
    spec = importlib.util.spec_from_file_location(f"variant_{tag}", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def save():
    json.dump(R, open(os.path.join(OUT, "explore2.json"), "w"), indent=1)

class S(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

def attention():
    B, H, N, D = 4, 8, 11271, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev) for _ in range(3))
    torch.backends.cuda.matmul.allow_tf32 = False
    e = F.scaled_dot_product_attention(q, k, v)
    gm = autofuser.capture(S(), q, k, v)
    plan = plan_fusion_groups(gm, autofuser.load_plugins().registry)
    (c,) = [c for c in plan.kept if c.strategy.name == "softmax_attention"]
    src = c.strategy.generate(c.program, plan.view.helpers)
    base = src.source
    R["attn_source"] = base
    variants = {
        "as_generated": base,
        "no_k_unscale_load": re.sub(r"k_unscale = tl\.load\([^\n]*\)", "k_unscale = 1.0", base),
        "no_v_unscale_loads": re.sub(r"g = tl\.load\([^\n]*\)", "g = 1.0",
                                     re.sub(r"v_unscale = tl\.load\([^\n]*\)", "v_unscale = 1.0", base)),
    }
    variants["no_unscale_loads"] = re.sub(r"k_unscale = tl\.load\([^\n]*\)", "k_unscale = 1.0", variants["no_v_unscale_loads"])
    out = torch.empty_like(q)
    res = R["attn"] = {}
    for tag, source in variants.items():
        try:
            mod = load(source, tag)
            entry = getattr(mod, src.name)
            for cfg in ((128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)):
                m, n, w, s = cfg
                f = lambda: entry[(1,)](q, k, v, out, BLOCK_M=m, BLOCK_N=n, BLOCK_D=64, BLOCK_DV=64, num_warps=w, num_stages=s)
                f(); torch.cuda.synchronize()
                err = float((out - e).norm() / e.norm())
                res[f"{tag} {cfg}"] = {"ms": ms(f), "rel_err": err}
                print("attn", tag, cfg, res[f"{tag} {cfg}"], flush=True)
        except Exception:
            res[tag] = traceback.format_exc()[-1500:]
            print(res[tag], flush=True)
        save()
    # passes alone: the launcher with the attend launch removed
    try:
        passes_only = re.sub(r"\n        \S+_attend\[[^\n]*", "", base)
        mod = load(passes_only, "passes")
        entry = getattr(mod, src.name)
        f = lambda: entry[(1,)](q, k, v, out, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64, num_warps=8, num_stages=2)
        f(); torch.cuda.synchronize()
        res["passes_only"] = ms(f)
        print("passes", res["passes_only"], flush=True)
    except Exception:
        res["passes_only"] = traceback.format_exc()[-1500:]
    save()

def mlp():
    """Under autocast (fp32 model and input) and as a bf16 model (bf16 input)."""
    for setup in ("autocast", "bf16_model"):
        mlp_setup(setup)


def mlp_setup(setup):
    import contextlib
    from matmul import Mlp, precision, M
    from autofuser_core.launch import FusedKernel, cast_inputs
    torch.manual_seed(0)
    model = Mlp(128).to(dev).eval()
    x = torch.randn(M, 128, device=dev)
    if setup == "bf16_model":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    res = R.setdefault("mlp", {}).setdefault(setup, {})
    mode = precision("bf16") if setup == "autocast" else contextlib.nullcontext()
    with mode, torch.no_grad():
        expected = model(x)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(x)
        (k,) = [n.target for gm, _ in fused._compiled.values() for n in gm.graph.nodes
                if n.op == "call_function" and isinstance(n.target, FusedKernel) and n.target.source.layout == "mlp"]
        inputs = cast_inputs(k.with_live_attrs([x]), k.casts)
        outs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d in k.output_layout]
        base = k.source.source
        gelu = r"(?<!def )elementwise_gelu\((\w+)\)"
        variants = {"as_generated": base,
                    # the exact GELU through libdevice's erff, as generated before the helper
                    "libdevice_erf": re.sub(gelu, r"\1 * 0.5 * (1.0 + tl.erf(\1 * 0.7071067811865476))", base),
                    "no_gelu": re.sub(gelu, r"(\1)", base),
                    "no_rounding": re.sub(r"\.to\(tl\.bfloat16\)\.to\(tl\.float32\)", "", base)}
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        configs = [{"BLOCK_M": m, "BLOCK_H": h, "BLOCK_K": 64, "num_warps": w, "num_stages": s, "PERSISTENT": p,
                    "PROGRAMS": sms if p else 1}
                   for m, h, w, s, p in ((32, 64, 4, 2, 0), (64, 64, 4, 2, 0), (128, 64, 8, 2, 0), (64, 64, 4, 3, 1),
                                         (64, 64, 4, 2, 1), (128, 64, 8, 1, 1))]
        for tag, source in variants.items():
            mod = load(source, f"mlp_{setup}_{tag}")
            kern = getattr(mod, k.source.name)
            for cfg in configs:  # each on its own: one a GPU refuses (resources) must not end the rest
                key = f"{tag} {cfg['BLOCK_M']},{cfg['BLOCK_H']},{cfg['num_warps']},{cfg['num_stages']},p{cfg['PERSISTENT']}"
                try:
                    g = lambda: kern[k.source.grid(cfg)](*inputs, *outs, **k.source.launch_args(cfg))
                    g(); torch.cuda.synchronize()
                    err = float((outs[0].float() - expected.float()).norm() / expected.float().norm())
                    res[key] = {"ms": ms(g), "rel_err": err}
                except Exception as e:
                    res[key] = repr(e)[:200]
                print("mlp", setup, key, res[key], flush=True)
            save()

run_parts([globals()[name] for name in (sys.argv[2:] or ["attention", "mlp"])], R, save)
