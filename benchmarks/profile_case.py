"""Where one fused forward spends its time: the report's notes (CUDA graph or
not, whole-forward times) and a ``torch.profiler`` table of the GPU kernels and
the host time per call, for one case of ``benchmarks/attention.py`` (a form) or of ``benchmarks/matmul.py``
(a case whose name contains ``--form``).

    python benchmarks/profile_case.py --form galerkin --width 64 --mode bf16
    python benchmarks/profile_case.py --form w-2w-w --width 128 --mode tf32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import autofuser
from autofuser_core.timing import forward_ms as forward_time

from attention import FORMS, Softmax, _inputs
from matmul import CASES, CHAIN_CASES, M, _ms, precision


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--form", default="galerkin", help=f"{', '.join(sorted(FORMS))} or part of a matmul case name")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument(
        "--mode",
        default="bf16",
        choices=["fp32", "tf32", "bf16", "bf16-weights"],
        help="bf16: autocast over fp32 parameters; bf16-weights: parameters and inputs in bf16 "
        "(no autocast), to see what reading fp32 weights costs a fused kernel",
    )
    parser.add_argument("--tune-budget", type=float, default=2.0)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    if args.form in FORMS:
        model = (Softmax() if args.form == "softmax" else FORMS[args.form](args.width)).to(device).eval()
        inputs = _inputs(args.form, args.width, device)
    else:
        factories = [f for name, (f, _, _) in {**CASES, **CHAIN_CASES}.items() if args.form in name]
        if not factories:
            parser.error(
                f"--form {args.form!r} is neither an attention form ({', '.join(sorted(FORMS))}) nor part of "
                f"a matmul case name ({'; '.join({**CASES, **CHAIN_CASES})})"
            )
        factory = factories[0]
        model = factory(args.width).to(device).eval()
        inputs = [torch.randn(M, args.width, device=device) for _ in range(getattr(factory, "inputs", 1))]
    if args.mode == "bf16-weights":
        model = model.to(torch.bfloat16)
        inputs = [x.to(torch.bfloat16) for x in inputs]
    cache = tempfile.mkdtemp(prefix="autofuser-profile-")
    with precision("fp32" if args.mode == "bf16-weights" else args.mode), torch.no_grad():
        fused = autofuser.fuse(model, tune_budget_s=args.tune_budget, progress=False, cache_dir=cache)
        fused(*inputs)
        print(fused.report(), file=sys.stderr)
        for entry in sorted(Path(cache, "tuning").glob("*.json")):  # every config tuning timed, fastest first
            data = json.loads(entry.read_text())
            print(f"tuning {data['key']['kernel']}:")
            for timing in sorted(data.get("timings", []), key=lambda t: t["ms"])[:8]:
                print(f"  {timing['ms']:.4f} ms  {timing['config']}")
        for name, fn in (("eager", model), ("autofuser", fused)):
            print(f"{name}: {_ms(fn, *inputs):.4f} ms (do_bench: L2 flushed before each call)")
            print(
                f"{name}: {forward_time(fn, tuple(inputs)):.4f} ms (calls back to back, as the whole-forward check "
                "and the zoo harness time them)"
            )
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                fn(*inputs)
            host = (time.perf_counter() - start) / 50
            torch.cuda.synchronize()
            print(f"{name}: {1e3 * host:.4f} ms host time per call (launch only, unsynchronised)")
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(20):
                fused(*inputs)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
