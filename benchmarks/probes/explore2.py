"""GPU probe 2: where the split-pass attention chain (head width 64, strict fp32) and the
MLP kernel (bf16, width 128; streamed and persistent) spend their time: variants of the generated
sources with one part replaced, timed side by side.

    python3 benchmarks/probes/explore2.py OUT_DIR [attention] [mlp]"""
import json, os, sys, traceback
import torch
import torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import edit, load_variant as load, mlp_case, ms, run_parts, time_variants
import autofuser
from autofuser_core.planner import plan_fusion_groups

OUT = sys.argv[1]
R = {}
dev = torch.device("cuda")

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
        "no_k_unscale_load": edit(r"k_unscale = tl\.load\([^\n]*\)", "k_unscale = 1.0", base),
        "no_v_unscale_loads": edit(r"g = tl\.load\([^\n]*\)", "g = 1.0",
                                     edit(r"v_unscale = tl\.load\([^\n]*\)", "v_unscale = 1.0", base)),
    }
    variants["no_unscale_loads"] = edit(r"k_unscale = tl\.load\([^\n]*\)", "k_unscale = 1.0", variants["no_v_unscale_loads"])
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
        passes_only = edit(r"\n        \S+_attend\[[^\n]*", "", base)
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
    case = mlp_case(setup)
    base = case["kernel"].source.source
    gelu = r"(?<!def )elementwise_gelu\((\w+)\)"
    variants = {"as_generated": base,
                # the exact GELU through libdevice's erff, as generated before the helper
                "libdevice_erf": edit(gelu, r"\1 * 0.5 * (1.0 + tl.erf(\1 * 0.7071067811865476))", base),
                "no_gelu": edit(gelu, r"(\1)", base),
                "no_rounding": edit(r"\.to\(tl\.bfloat16\)\.to\(tl\.float32\)", "", base)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [{"BLOCK_M": m, "BLOCK_H": h, "BLOCK_K": 64, "num_warps": w, "num_stages": s, "PERSISTENT": p,
                "PROGRAMS": sms if p else 1}
               for m, h, w, s, p in ((32, 64, 4, 2, 0), (64, 64, 4, 2, 0), (128, 64, 8, 2, 0), (64, 64, 4, 3, 1),
                                     (64, 64, 4, 2, 1), (128, 64, 8, 1, 1))]
    time_variants(case, variants, configs, R.setdefault("mlp", {}).setdefault(setup, {}), f"mlp {setup}", save)

run_parts([globals()[name] for name in (sys.argv[2:] or ["attention", "mlp"])], R, save)
