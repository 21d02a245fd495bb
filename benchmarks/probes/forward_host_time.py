"""GPU probe: is a fused forward of ``benchmarks/matmul.py`` bound by the host?

For a few bf16 cases at width 128 (M = 90168 rows), fused as ``matmul.py`` fuses them:

- host time per forward at the real shape: the GPU is kept busy by a spin kernel
  (``torch.cuda._sleep``) while the host issues 20 forwards, so the loop's wall time is
  the host's alone (a forward that synchronises would show the spin's length instead);
- the forward's median time by ``triton.testing.do_bench``, five times over, for the
  spread between repeats;
- the sum of the report's group times (GPU time of the kernels, eager groups at their
  measured time).

Eager beside each. With ``--profile``, also where the host time of 20 fused forwards
goes (``cProfile``, GPU kept busy as above), to OUT_DIR/forward_host_profile.txt.

    python3 benchmarks/probes/forward_host_time.py OUT_DIR [--profile]"""
import cProfile
import io
import pstats
import json
import os
import sys
import time

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import autofuser  # noqa: E402
from matmul import M, BlockTail, Mlp, PostAttention, precision  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
PROFILE = "--profile" in sys.argv
ISSUED = 20


def host_us(fn, x) -> float:
    fn(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # about 2 s of GPU time: longer than issuing the forwards
    start = time.perf_counter()
    for _ in range(ISSUED):
        fn(x)
    took = (time.perf_counter() - start) / ISSUED * 1e6
    torch.cuda.synchronize()
    return took


def profile(fn, x) -> str:
    fn(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(ISSUED):
        fn(x)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def main():
    results = {}
    for name, factory in (("MLP", Mlp), ("block tail", BlockTail), ("post-attention", PostAttention)):
        torch.manual_seed(0)
        model = factory(128).cuda().eval()
        xs = [torch.randn(M, 128, device="cuda") for _ in range(getattr(factory, "inputs", 1))]
        x = xs[0] if len(xs) == 1 else tuple(xs)
        call = (lambda f: (lambda a: f(*a))) if len(xs) > 1 else (lambda f: f)
        with precision("bf16"), torch.no_grad():
            fused = autofuser.fuse(model, progress=False)
            eager_fn, fused_fn = call(model), call(fused)
            fused_fn(x)
            report = fused.report()
            groups = sum((g.time_fused_ms if g.fused else 0.0) or 0.0 for g in report.groups)
            row = {
                "host_us": {"eager": host_us(eager_fn, x), "autofuser": host_us(fused_fn, x)},
                "do_bench_ms": {s: [float(triton.testing.do_bench(lambda: f(x), warmup=10, rep=60,
                                                                   return_mode="median")) for _ in range(5)]
                                for s, f in (("eager", eager_fn), ("autofuser", fused_fn))},
                "fused_groups_ms": groups,
                "notes": list(report.notes),
                "kernels": len(fused.kernels()),
            }
            if PROFILE:
                with open(os.path.join(OUT, "forward_host_profile.txt"), "a") as f:
                    (graph_module, _), = fused._compiled.values()
                    f.write(f"== {name}\n{graph_module.code}\n{profile(fused_fn, x)}\n")
        results[name] = row
        print(name, json.dumps(row), flush=True)
        with open(os.path.join(OUT, "forward_host_time.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
