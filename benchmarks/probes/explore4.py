"""GPU probe 4: is benchmarks/matmul.py's MLP (w -> 2w -> w, GELU, residual) faster as one
MLP kernel or as the two linear + epilogue kernels the planner falls back to?

For widths 128 and 256, under bf16 autocast and with TF32:

- the whole MLP fused with every plugin and fused without the mlp plugin (both tuned as
  a user's first call tunes them), against eager, with each group's tuned time;
- each of the two linear + epilogue kernels of the split, timed over a wider list of
  configs than tuning tries, with eager's time for the same ops, to see how far the
  tuned config and the kernel itself are from what cuBLAS and the best config give.

    python3 benchmarks/probes/explore4.py OUT_DIR [WIDTH,...]"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import autofuser  # noqa: E402
from _parts import ms, results_file, run_parts  # noqa: E402

from autofuser_core.launch import cast_inputs  # noqa: E402
from matmul import M, Mlp, precision  # noqa: E402

WIDTHS = [int(w) for w in (sys.argv[2] if len(sys.argv) > 2 else "128,256").split(",")]
WITHOUT_MLP = ["elementwise", "reduction", "matmul", "attention", "conv", "mxint8"]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the matmul strategy's list and more.
SWEEP = [(128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4),
         (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 32, 8, 3), (64, 64, 32, 4, 4),
         (64, 256, 32, 8, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 2),
         (128, 256, 64, 8, 4), (128, 256, 128, 8, 2), (256, 128, 32, 8, 3), (64, 256, 64, 4, 3),
         (128, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 32, 4, 4), (256, 64, 64, 8, 3)]
R, save = results_file("explore4.json")


def recorded_launches(fused, x):
    """Each kernel of ``fused`` (no CUDA graph) with the arguments one forward launched it
    with: (kernel, launch args, the output it wrote, copied). Recorded at
    ``FusedKernel.launch``, the one path every launch takes (on a GPU it calls the compiled
    kernel itself, not ``launcher``); the arguments are its inputs as the launcher
    converts them, then its outputs."""
    kernels = fused.kernels()
    seen = {}
    for k in kernels:
        def record(*inputs, _k=k, _launch=k.launch):
            outputs = _launch(*inputs)
            seen[_k.source.name] = [*cast_inputs(inputs, _k.casts), *outputs]
            return outputs
        k.launch = record
    fused(x)
    torch.cuda.synchronize()
    out = []
    for k in kernels:
        del k.launch  # the class's method again
        args = seen[k.source.name]
        out.append((k, args, args[-1].clone()))
    return out


def sweep_kernel(k, args, reference, res):
    for m, n, bk, warps, stages in SWEEP:
        cfg = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
        key = f"{m},{n},{bk},{warps},{stages}"
        try:
            launch = k.kernel[k.source.grid(cfg)]
            args[-1].fill_(float("nan"))
            run = lambda: launch(*args, **k.source.launch_args(cfg))
            run()
            torch.cuda.synchronize()
            err = float((args[-1].float() - reference.float()).norm() / reference.float().norm())
            res[key] = {"ms": ms(run), "rel_err": err}
        except Exception as e:  # a config the GPU refuses (resources) must not end the rest
            res[key] = repr(e)[:200]
        print(key, res[key], flush=True)
    # The output may be the next kernel's input: leave it as the forward wrote it.
    args[-1].copy_(reference)


def case(width, setup):
    res = R.setdefault(f"w{width} {setup}", {})
    torch.manual_seed(0)
    model = Mlp(width).cuda().eval()
    x = torch.randn(M, width, device="cuda")
    with precision(setup), torch.no_grad():
        res["eager_ms"] = ms(lambda: model(x))
        h = torch.nn.functional.gelu(model.fc1(x))
        res["eager_linear_gelu_ms"] = ms(lambda: torch.nn.functional.gelu(model.fc1(x)))
        res["eager_linear_res_ms"] = ms(lambda: x + model.fc2(h))
        res["eager_linear1_alone_ms"] = ms(lambda: model.fc1(x))
        for name, plugins in (("all", None), ("without_mlp", WITHOUT_MLP)):
            fused = autofuser.fuse(model, plugins=plugins, tune_budget_s=2, progress=False)
            fused(x)
            res[name] = {"ms": ms(lambda: fused(x)), "groups": [
                {"strategy": g.strategy, "fused": g.fused, "config": g.config, "eager_ms": g.time_eager_ms,
                 "fused_ms": g.time_fused_ms} for g in fused.report().groups]}
            print(width, setup, name, res[name], flush=True)
            save()
        fused = autofuser.fuse(model, plugins=WITHOUT_MLP, tune=False, cuda_graphs=False, verify_speed=False,
                               progress=False)
        fused(x)
        for k, args, reference in recorded_launches(fused, x):
            sweep_kernel(k, args, reference, res.setdefault(k.source.name, {}))
            save()


run_parts([lambda w=w, s=s: case(w, s) for w in WIDTHS for s in ("bf16", "tf32")], R, save)
