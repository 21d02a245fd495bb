"""GPU probe 3: the width-128 MLP kernel (w -> 2w -> w, GELU, residual) under autocast to
bf16, as a bf16 model and in TF32: a sweep of configs (more programs per multiprocessor
with one pipeline stage, shorter hidden slices), the GELU taken out (a bound, not a
result), and two edits of the persistent form: the next row block's activations loaded
into registers while this one computes, and the residual read from the rows already
loaded instead of from memory again.

    python3 benchmarks/probes/explore3.py OUT_DIR [autocast] [bf16_model] [tf32]"""
import contextlib, importlib.util, json, os, re, sys
import torch, triton, triton.testing
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import run_parts
import autofuser

OUT = sys.argv[1]
R = {}
dev = torch.device("cuda")
STREAMED = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 1), (64, 32, 4, 1), (64, 128, 4, 1),
            (64, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 1), (128, 32, 4, 1)]
PERSISTENT = [(128, 8, 1), (64, 4, 1), (64, 8, 1), (64, 4, 2), (64, 4, 3), (128, 8, 2)]


def ms(fn):
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def load(source, tag):
    path = os.path.join("/tmp", f"variant3_{tag}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"variant3_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def save():
    with open(os.path.join(OUT, "explore3.json"), "w") as f:
        json.dump(R, f, indent=1)


def prefetch(source, rows, k, dtype_load):
    """The persistent loop with the next row block's A loaded at the top of each iteration."""
    first = re.search(r"\n( +)x0_v1 = tl\.load\(in0 \+ r0 \* (\d+) \+ ks, mask=row_mask & k_mask, other=0\)(\.to\(tl\.float32\))",
                      source)
    if first is None or "for tile in range(" not in source:
        raise ValueError("unexpected persistent loop")
    indent, stride, cast = first.group(1), first.group(2), first.group(3)
    loop = re.search(r"\n( +)for tile in range\(", source)
    head = (f"\n{loop.group(1)}ks_p = tl.arange(0, BLOCK_K)[None, :]"
            f"\n{loop.group(1)}rows_p = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]"
            f"\n{loop.group(1)}x_next = tl.load(in0 + rows_p * {stride} + ks_p, mask=(rows_p < {rows}) & (ks_p < {k}), other=0)")
    source = source[:loop.start()] + head + source[loop.start():]
    first = re.search(r"\n( +)x0_v1 = tl\.load\(in0 \+ r0 \* (\d+) \+ ks, mask=row_mask & k_mask, other=0\)(\.to\(tl\.float32\))",
                      source)
    body = (f"\n{indent}x0_v1 = x_next{cast}"
            f"\n{indent}rows_n = rows + PROGRAMS * BLOCK_M"
            f"\n{indent}x_next = tl.load(in0 + rows_n * {stride} + ks, mask=(rows_n < {rows}) & k_mask, other=0)")
    return source[:first.start()] + body + source[first.end():]


def reuse_residual(source):
    """The persistent loop's residual read from the A rows in registers (K == N only)."""
    out, n = re.subn(r"(\n {12})(x0_v\d+) = tl\.load\(in0 \+ r0 \* \d+ \+ cols, mask=row_mask & col_mask, other=0\)\.to\(tl\.float32\)",
                     r"\1\2 = x0_v1", source, count=1)
    if n != 1:
        raise ValueError("no residual load found in the persistent loop")
    return out


def setup_case(setup):
    from matmul import Mlp, precision, M
    from autofuser_core.launch import FusedKernel, cast_inputs
    torch.manual_seed(0)
    model = Mlp(128).to(dev).eval()
    x = torch.randn(M, 128, device=dev)
    if setup == "bf16_model":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    mode = {"autocast": precision("bf16"), "tf32": precision("tf32")}.get(setup, contextlib.nullcontext())
    res = R.setdefault(setup, {})
    with mode, torch.no_grad():
        expected = model(x)
        res["eager_ms"] = ms(lambda: model(x))
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(x)
        (k,) = [n.target for gm, _ in fused._compiled.values() for n in gm.graph.nodes
                if n.op == "call_function" and isinstance(n.target, FusedKernel) and n.target.source.layout == "mlp"]
        inputs = cast_inputs(k.with_live_attrs([x]), k.casts)
        outs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d in k.output_layout]
        base = k.source.source
        res["source"] = base
        gelu = r"(?<!def )elementwise_gelu\((\w+)\)"
        variants = {"as_generated": base, "no_gelu": re.sub(gelu, r"(\1)", base)}
        if "PERSISTENT: tl.constexpr" in base:
            variants["prefetch"] = prefetch(base, M, 128, x.dtype)
            variants["prefetch_reuse"] = reuse_residual(variants["prefetch"])
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        persistent = "PERSISTENT: tl.constexpr" in base
        configs = [{"BLOCK_M": m, "BLOCK_H": h, "BLOCK_K": 64, "num_warps": w, "num_stages": s,
                    **({"PERSISTENT": 0, "PROGRAMS": 1} if persistent else {})} for m, h, w, s in STREAMED]
        if persistent:
            configs += [{"BLOCK_M": m, "BLOCK_H": 64, "BLOCK_K": 64, "num_warps": w, "num_stages": s, "PERSISTENT": 1,
                         "PROGRAMS": sms} for m, w, s in PERSISTENT]
        for tag, source in variants.items():
            mod = load(source, f"{setup}_{tag}")
            kern = getattr(mod, k.source.name)
            for cfg in configs:
                if tag.startswith("prefetch") and not cfg.get("PERSISTENT"):
                    continue
                key = (f"{tag} {cfg['BLOCK_M']},{cfg['BLOCK_H']},{cfg['num_warps']},{cfg['num_stages']},"
                       f"p{cfg.get('PERSISTENT', 0)}")
                try:
                    for o in outs:
                        o.fill_(float("nan"))
                    g = lambda: kern[k.source.grid(cfg)](*inputs, *outs, **k.source.launch_args(cfg))
                    g()
                    torch.cuda.synchronize()
                    err = float((outs[0].float() - expected.float()).norm() / expected.float().norm())
                    res[key] = {"ms": ms(g), "rel_err": err}
                except Exception as e:  # a config the GPU refuses (resources) must not end the rest
                    res[key] = repr(e)[:200]
                print(setup, key, res[key], flush=True)
            save()


def autocast():
    setup_case("autocast")


def bf16_model():
    setup_case("bf16_model")


def tf32():
    setup_case("tf32")


run_parts([globals()[name] for name in (sys.argv[2:] or ["autocast", "bf16_model", "tf32"])], R, save)
