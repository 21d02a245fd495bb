"""Where a cold first call spends its time, on a GPU.

Two parts, both printed:

1. **Fresh-interpreter compile stages.** Fresh processes that do what a
   compile worker started as a new interpreter would - import torch and
   Triton, optionally make the GPU current, then warm up (compile) a small
   kernel for three configs - timing each stage, one process alone and 16 at
   once, each mode in its own empty Triton cache: ``device``
   (``torch.cuda.set_device`` first), ``lazy`` (no ``set_device``: Triton asks
   torch for the device and its capability) and ``target`` (Triton's driver
   told the GPU target up front, so the process never initialises CUDA). These
   numbers are why configs now compile in forks (``precompile.py``).
2. **A cold ``autofuser.fuse`` first call** of zoo models under ``cProfile``
   (main thread), with the progress log time-stamped and the report's phases.

    python benchmarks/profile_cold.py --models fno lsm --dtype fp32
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

KERNEL = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x, y, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(x + offs, mask=mask)
        b = tl.load(y + offs, mask=mask)
        tl.store(out + offs, tl.exp(a) * 0.5 + b, mask=mask)
''')

STAGES = textwrap.dedent('''
    import json, sys, time
    marks = [("start", time.perf_counter())]
    import torch
    marks.append(("import torch", time.perf_counter()))
    import triton
    marks.append(("import triton", time.perf_counter()))
    mode, capability = sys.argv[1], int(sys.argv[2])
    if mode == "device":
        torch.cuda.set_device(0)
    elif mode == "target":
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver

        class Fixed:
            def __init__(self, real):
                self.real = real
            def __getattr__(self, name):
                return getattr(self.real, name)
            def get_current_target(self):
                return GPUTarget("cuda", capability, 32)
            def get_current_device(self):
                return 0
            def get_current_stream(self, device=None):
                return 0
        driver.set_active(Fixed(driver.active))
    marks.append(("gpu set-up", time.perf_counter()))
    sys.path.insert(0, sys.argv[3])
    import probe_kernel
    for block in (256, 512, 1024):
        probe_kernel.axpy.warmup(torch.float32, torch.float32, torch.float32, 8, grid=(1,), BLOCK=block)
        marks.append((f"warmup {block}", time.perf_counter()))
    print(json.dumps({name: marks[i][1] - marks[i - 1][1] for i, (name, _) in enumerate(marks) if i}))
''')


def worker_stages(capability: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="af-probe-"))
    (folder / "probe_kernel.py").write_text(KERNEL)
    (folder / "stages.py").write_text(STAGES)
    print("\n## fresh-interpreter compile stages (seconds; median and max over the processes)")
    for mode in ("device", "lazy", "target"):
        for count in (1, 16):
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix=f"af-triton-{mode}-"))
            start = time.perf_counter()
            procs = [subprocess.Popen([sys.executable, str(folder / "stages.py"), mode, str(capability), str(folder)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for _ in range(count)]
            results = []
            for proc in procs:
                out, err = proc.communicate(timeout=300)
                try:
                    results.append(json.loads(out.strip().splitlines()[-1]))
                except (ValueError, IndexError):
                    print(f"  {mode} x{count}: a process failed: {err.strip()[-400:]}")
            wall = time.perf_counter() - start
            if results:
                cells = ", ".join(f"{k} {statistics.median(r[k] for r in results):.2f}/{max(r[k] for r in results):.2f}"
                                  for k in results[0])
                print(f"  {mode:6s} x{count:2d}: wall {wall:.2f}; {cells}")


def cold_fuse(name: str, dtype: str) -> None:
    import torch

    import autofuser
    from autofuser_zoo.harness import build, first_call_s, forward_call
    from autofuser_zoo.models import MODELS

    entry = MODELS[name]
    device = torch.device("cuda")
    model, x, _ = build(entry, "airfoil", entry.batch("airfoil"), device)
    model.eval()
    first_call_s(forward_call(model, x, device, dtype), device)  # eager once, as the harness does
    print(f"\n## cold first call: {name} {dtype}")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  %(relativeCreated)8.0f ms  %(message)s"))
    logger = logging.getLogger("autofuser")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    fused = autofuser.fuse(model, cache_dir=tempfile.mkdtemp(prefix="af-cold-"))
    profile = cProfile.Profile()
    _, seconds = first_call_s(forward_call(lambda inputs: profile.runcall(fused, inputs), x, device, dtype), device)
    print(f"  first call {seconds:.2f} s")
    logger.removeHandler(handler)
    report = fused.report()
    print("  phases: " + ", ".join(f"{k} {v:.2f}" for k, v in report.phases.items()))
    stream = io.StringIO()
    pstats.Stats(profile, stream=stream).sort_stats("cumulative").print_stats(45)
    print(stream.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["fno"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--no-stages", action="store_true")
    args = parser.parse_args(argv)
    import torch

    major, minor = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    if not args.no_stages:
        worker_stages(major * 10 + minor)
    for name in args.models:
        cold_fuse(name, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
