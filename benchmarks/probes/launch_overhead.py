"""GPU probe: host time per forward, for a forward whose GPU work is too short to hide it.

Layer norm + linear at width 128 on 64 rows (microseconds of GPU work): each system's
forward is called N times back to back and the loop's wall time divided by N, so this is
the time the host needs to issue one forward. AutoFuser with kernels launched through
Triton's ``JITFunction.run`` on every call, and launched directly (``DirectLaunch``);
eager; ``torch.compile``. Also, for the 90168-row case of ``matmul.py``, each system's
median forward from ``triton.testing.do_bench``.

    python3 benchmarks/probes/launch_overhead.py"""
import contextlib
import time

import torch
import triton.testing

import autofuser
from autofuser_core import launch

N = 2000


def host_us(fn, x):
    for _ in range(50):
        fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(N):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / N * 1e6


@contextlib.contextmanager
def through_triton(fused):
    """Every launch of ``fused``'s kernels through Triton's ``JITFunction.run``."""
    direct_of, kernels = launch.DirectLaunch.of, fused.kernels()
    saved = [k.direct for k in kernels]
    launch.DirectLaunch.of = staticmethod(lambda *a, **k: None)
    for k in kernels:
        k.direct = None
    try:
        yield
    finally:
        launch.DirectLaunch.of = direct_of
        for k, d in zip(kernels, saved):
            k.direct = d


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.LayerNorm(128), torch.nn.Linear(128, 128)).cuda().eval()
with torch.no_grad():
    for rows in (64, 8 * 221 * 51):
        x = torch.randn(rows, 128, device="cuda")
        fused = autofuser.fuse(model, progress=False, cuda_graphs=False)
        compiled = torch.compile(model)
        fused(x), compiled(x)
        for name, fn, context in (("eager", model, contextlib.nullcontext()),
                                  ("torch.compile", compiled, contextlib.nullcontext()),
                                  ("autofuser, Triton's launch", fused, through_triton(fused)),
                                  ("autofuser, direct launch", fused, contextlib.nullcontext())):
            with context:
                ms = triton.testing.do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median")
                us = host_us(fn, x)
            print(f"rows {rows:6d}  {name:28s} host {us:7.1f} us/forward   do_bench {ms * 1e3:7.1f} us")
