"""What the probes share: run each part, keep going past a failure, save after each; time
a kernel; load an edited kernel source; fuse the width-128 MLP of benchmarks/matmul.py and
time edited versions of its kernel over a list of configs."""
import contextlib
import os
import re
import traceback


def results_file(name: str):
    """A probe's results and the function that writes them, as JSON, to ``name`` in the
    folder its command line names (``OUT_DIR``, the first argument; else here)."""
    import json
    import sys
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    results: dict = {}

    def save():
        with open(os.path.join(out, name), "w") as f:
            json.dump(results, f, indent=1)

    return results, save


def run_parts(parts, results: dict, save) -> None:
    """Call each part; a failure is recorded in ``results["errors"]`` and printed, and the
    next part still runs. ``save()`` writes the results after every part."""
    for part in parts:
        try:
            part()
        except Exception:
            results.setdefault("errors", []).append(traceback.format_exc()[-2000:])
            print(traceback.format_exc(), flush=True)
        save()


def edit(pattern: str, replacement: str, source: str) -> str:
    """``re.sub`` that fails when ``pattern`` matches nothing: an edit that silently left
    the source as generated would time the baseline under another name."""
    out, count = re.subn(pattern, replacement, source)
    if not count:
        raise ValueError(f"the edit {pattern!r} matches nothing in the source")
    return out


def ms(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def load_variant(source: str, tag: str):
    """Import ``source`` (a kernel module) from a file of its own, so Triton can read it."""
    from autofuser_core.cache import module_from_source
    path = os.path.join("/tmp", f"variant_{tag}.py")
    with open(path, "w") as f:
        f.write(source)
    return module_from_source(f"variant_{tag}", source, path)


def mlp_case(setup: str, width: int = 128) -> dict:
    """benchmarks/matmul.py's MLP (M rows) fused without tuning under ``setup`` ("autocast":
    fp32 model under bf16 autocast, "bf16_model", "tf32"): its MLP kernel, the kernel's
    inputs (converted as its own config's launcher converts them; ``raw``: as they arrive,
    for configs that convert them themselves), outputs to write, eager's result and time."""
    import torch
    import autofuser
    from autofuser_core.launch import cast_inputs
    from matmul import M, Mlp, precision
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = Mlp(width).to(dev).eval()
    x = torch.randn(M, width, device=dev)
    if setup == "bf16_model":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    mode = {"autocast": precision("bf16"), "tf32": precision("tf32")}.get(setup, contextlib.nullcontext())
    with mode, torch.no_grad():
        expected = model(x)
        eager_ms = ms(lambda: model(x))
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(x)
    (kernel,) = [k for k in fused.kernels() if k.source.layout == "mlp"]
    raw = kernel.with_live_attrs([x])
    inputs = cast_inputs(raw, kernel.casts)
    outputs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d in kernel.output_layout]
    return {"kernel": kernel, "inputs": inputs, "raw": raw, "outputs": outputs, "expected": expected,
            "eager_ms": eager_ms}


def time_variants(case: dict, variants: dict, configs: list, res: dict, label: str, save, skip=lambda tag, cfg: False):
    """Time every edited source of ``variants`` (tag -> source) of ``case``'s kernel at every
    config; ``res["TAG M,H,WARPS,STAGES,pP"]`` = time and error against eager, or why it failed."""
    import torch
    k, inputs, outs, expected = case["kernel"], case["inputs"], case["outputs"], case["expected"]
    for tag, source in variants.items():
        kern = getattr(load_variant(source, f"{label}_{tag}"), k.source.name)
        for cfg in configs:
            if skip(tag, cfg):
                continue
            key = (f"{tag} {cfg['BLOCK_M']},{cfg['BLOCK_H']},{cfg['num_warps']},{cfg['num_stages']},"
                   f"p{cfg.get('PERSISTENT', 0)}")
            try:
                for o in outs:
                    o.fill_(float("nan"))
                args = case["raw"] if k.source.converts_casts(cfg) else inputs  # as that config's launcher
                g = lambda: kern[k.source.grid(cfg)](*args, *outs, **k.source.launch_args(cfg))
                g()
                torch.cuda.synchronize()
                err = float((outs[0].float() - expected.float()).norm() / expected.float().norm())
                res[key] = {"ms": ms(g), "rel_err": err}
            except Exception as e:  # a config the GPU refuses (resources) must not end the rest
                res[key] = repr(e)[:200]
            print(label, key, res[key], flush=True)
        save()
