"""Chains with matrix products at the widths transformer PDE solvers use.

For M = 8 * 221 * 51 rows and widths 128 and 256, in one run on one GPU:

- linear + GELU (w -> 2w);
- layer norm + linear (w -> w);
- MLP (w -> 2w -> w, GELU, residual);
- a transformer block's feed-forward half (x + MLP(LN(x)));
- its block tail (the feed-forward half, then the next block's LN -> qkv) and
  the whole post-attention part (``x + proj(attn)`` first): row-tiled chains
  of three and four products;

each in strict fp32, with TF32 allowed (on every side), and in bf16 under
``torch.autocast``; under eager, ``torch.compile`` in each mode of
``--compile-modes`` (default: the default mode and reduce-overhead, timed as
its CUDA-graph replays; ``--max-autotune`` adds max-autotune-no-cudagraphs)
and AutoFuser. Every output is checked against eager before it is timed. Beside each case: its
roofline floor, ``max(bytes / copy bandwidth, FLOPs / matrix rate)``, with the
bandwidth and the matrix rate of each precision measured in the same run.

    python benchmarks/matmul.py --out bench-results/ [--compile-modes default,reduce-overhead,max-autotune]
        [--cases "block tail,post-attention"]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

import autofuser

from _compile_modes import add_compile_modes_argument, compile_key, compile_keys_in, compiled, mode_of

M = 8 * 221 * 51


class LinearGelu(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lin = torch.nn.Linear(w, 2 * w)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x))


class NormLinear(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.norm = torch.nn.LayerNorm(w)
        self.lin = torch.nn.Linear(w, w)

    def forward(self, x):
        return self.lin(self.norm(x))


class Mlp(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.fc1 = torch.nn.Linear(w, 2 * w)
        self.fc2 = torch.nn.Linear(2 * w, w)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class FeedForwardHalf(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.norm = torch.nn.LayerNorm(w)
        self.fc1 = torch.nn.Linear(w, 2 * w)
        self.fc2 = torch.nn.Linear(2 * w, w)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class BlockTail(torch.nn.Module):
    """A pre-norm transformer block after its attention's residual: LN -> MLP -> + residual,
    then the next block's LN -> qkv projection (a row-tiled chain of three products)."""

    def __init__(self, w):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(w)
        self.fc1 = torch.nn.Linear(w, 2 * w)
        self.fc2 = torch.nn.Linear(2 * w, w)
        self.norm2 = torch.nn.LayerNorm(w)
        self.qkv = torch.nn.Linear(w, 3 * w, bias=False)

    def forward(self, x):
        h = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm1(x))))
        return h, self.qkv(self.norm2(h))


class PostAttention(BlockTail):
    """``x + proj(attn)`` first: the whole post-attention part, four products in one chain."""

    inputs = 2

    def __init__(self, w):
        super().__init__(w)
        self.proj = torch.nn.Linear(w, w)

    def forward(self, x, attn):
        return super().forward(x + self.proj(attn))


CASES = {
    "linear+GELU": (LinearGelu, lambda w: 2 * M * w * 2 * w, lambda w, e: (M * w + M * 2 * w) * e + 2 * w * w * 4),
    "layernorm+linear": (NormLinear, lambda w: 2 * M * w * w, lambda w, e: 2 * M * w * e + w * w * 4),
    "MLP w-2w-w": (Mlp, lambda w: 4 * M * w * 2 * w, lambda w, e: 2 * M * w * e + 4 * w * w * 4),
    "FFN half (LN+MLP+res)": (FeedForwardHalf, lambda w: 4 * M * w * 2 * w, lambda w, e: 2 * M * w * e + 4 * w * w * 4),
}
#: Row-tiled chains: several inputs or outputs (apart from CASES, which other benchmarks reuse one tensor in, one out).
CHAIN_CASES = {
    "block tail: LN+MLP+res+LN+linear": (
        BlockTail,
        lambda w: 2 * M * 7 * w * w,
        lambda w, e: 5 * M * w * e + 7 * w * w * 4,
    ),
    "post-attention: proj+res+block tail": (
        PostAttention,
        lambda w: 2 * M * 8 * w * w,
        lambda w, e: 6 * M * w * e + 8 * w * w * 4,
    ),
}


@contextlib.contextmanager
def precision(mode):
    """Torch's matmul precision for ``mode``; every system runs under it."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        if mode == "bf16":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                yield
        else:
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        torch.set_float32_matmul_precision(old[1])


def _ms(fn, *args):
    return float(triton.testing.do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median"))


def run_header(bandwidth: float) -> dict:
    """What every suite's JSON starts with: the date, the GPU, torch's and Triton's
    versions, and the copy bandwidth its floors are taken at."""
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GB/s": bandwidth / 1e9,
    }


def measure_ceilings(device):
    x = torch.randn(2**28, device=device)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / (_ms(lambda: y.copy_(x)) * 1e-3)
    x = y = None  # 2 GiB: freed before the products are timed
    n = 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    rates = {}
    for mode in ("fp32", "tf32", "bf16"):
        with precision(mode):
            rates[mode] = 2 * n**3 / (_ms(torch.matmul, a, b) * 1e-3)
    return bandwidth, rates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--widths", default="128,256")
    parser.add_argument("--modes", default="fp32,tf32,bf16")
    parser.add_argument("--cases", default="", help="comma-separated substrings: only cases whose name contains one")
    add_compile_modes_argument(parser)
    parser.add_argument(
        "--max-autotune", action="store_true", help="also torch.compile max-autotune-no-cudagraphs (a mode to add)"
    )
    parser.add_argument("--tune-budget", type=float, default=8.0, help="AutoFuser tuning seconds per group")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("matmul.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth, rates = measure_ceilings(device)
    modes = tuple(args.compile_modes)
    if args.max_autotune and "max-autotune-no-cudagraphs" not in modes:
        modes += ("max-autotune-no-cudagraphs",)
    systems = ["eager", *(compile_key(mode) for mode in modes), "autofuser"]
    rows = []
    for width in [int(w) for w in args.widths.split(",")]:
        for case, (factory, flops_of, bytes_of) in {**CASES, **CHAIN_CASES}.items():
            if args.cases and not any(part in case for part in args.cases.split(",")):
                continue
            torch.manual_seed(0)
            model = factory(width).to(device).eval()
            xs = [torch.randn(M, width, device=device) for _ in range(getattr(factory, "inputs", 1))]
            for mode in args.modes.split(","):
                row = {"case": case, "width": width, "mode": mode}
                element = 2 if mode == "bf16" else 4
                floor_ms = 1e3 * max(bytes_of(width, element) / bandwidth, flops_of(width) / rates[mode])
                row["floor_ms"] = floor_ms
                with precision(mode), torch.no_grad():
                    expected = _flat(model(*xs))
                    for system in systems:
                        row[system] = measure(system, model, xs, expected, args.tune_budget)
                rows.append(row)
                print(_line(row, systems), file=sys.stderr, flush=True)
                (out / "matmul.partial.json").write_text(json.dumps(rows, indent=1))
    result = {
        **run_header(bandwidth),
        "matmul_TFLOP/s": {k: v / 1e12 for k, v in rates.items()},
        "rows": M,
        "cases": rows,
    }
    (out / "matmul.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (out / "matmul.md").write_text(text + "\n")
    print(text)
    return 0


def systems_in(rows) -> list[str]:
    """The systems of a table of ``rows``: eager, torch.compile in each mode the rows have
    (rows written before a mode was measured have no column for it), AutoFuser."""
    return ["eager", *compile_keys_in(rows), "autofuser"]


def column_title(system: str) -> str:
    if system in ("eager", "autofuser"):
        return {"eager": "eager", "autofuser": "AutoFuser"}[system]
    return compile_key(mode_of(system))


def table(result) -> str:
    """The markdown table of a run's ``result`` (as ``matmul.json`` holds it, or a run of
    ``benchmarks/results/matmul.json``)."""
    rates, rows = result["matmul_TFLOP/s"], result["cases"]
    header = (
        f"M = {result.get('rows', result.get('rows_M'))} rows; {result['gpu']}, {result['date']}, "
        f"torch {result['torch']}, "
        f"Triton {result['triton']}; copy {result['copy_GB/s']:.0f} GB/s; matrix rate fp32 {rates['fp32']:.0f}, "
        f"tf32 {rates['tf32']:.0f}, bf16 {rates['bf16']:.0f} TFLOP/s. Time in ms (speedup over eager)."
    )
    systems = systems_in(rows)
    lines = [
        header,
        "",
        "| case | width | precision | floor | " + " | ".join(column_title(s) for s in systems) + " |",
        "|---|---|---|---|" + "---|" * len(systems),
    ]
    lines += [_line(row, systems) for row in rows]
    return "\n".join(lines)


def _flat(out):
    """One fp32 vector of a model's output(s), to compare systems by relative error."""
    outs = out if isinstance(out, tuple) else (out,)
    return torch.cat([o.float().flatten() for o in outs])


def build_system(system: str, model, tune_budget: float):
    """The callable a benchmark times for ``system``: eager, torch.compile in a mode
    (``torch.compile``, ``torch.compile <mode>``: ``_compile_modes``) or AutoFuser."""
    if system == "eager":
        return model
    if system == "autofuser":
        return autofuser.fuse(model, tune_budget_s=tune_budget, progress=False)
    torch._dynamo.reset()
    return compiled(model, mode_of(system))


def measure(system: str, model, inputs, expected, tune_budget: float, keep=lambda group: True) -> dict:
    """One system's cell: its first call (seconds, checked against ``expected`` by
    relative error), then its median time; for AutoFuser also the groups ``keep``
    selects. A system that fails gives a cell with the error, not a crash."""
    try:
        start = time.perf_counter()
        fn = build_system(system, model, tune_budget)
        got = _flat(fn(*inputs))
        torch.cuda.synchronize()
        cell = {
            "first_call_s": time.perf_counter() - start,
            "rel_err": float((got - expected).norm() / expected.norm()),
        }
        cell["ms"] = _ms(fn, *inputs)
        if system == "autofuser":
            cell["notes"] = list(fn.report().notes)  # e.g. whether the forward replays as a CUDA graph
            cell["groups"] = [
                {
                    "strategy": g.strategy,
                    "ops": g.ops,
                    "fused": g.fused,
                    "reason": g.reason_code,
                    "summary": g.reason,
                    "config": g.config,
                    "eager_ms": g.time_eager_ms,
                    "fused_ms": g.time_fused_ms,
                }
                for g in fn.report().groups
                if keep(g)
            ]
        return cell
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def _cells(row, systems) -> list[str]:
    """Each system's 'ms (speedup over eager)', marked ' !' where its output failed the check."""
    cells = []
    eager = row.get("eager", {}).get("ms")
    for s in systems:
        r = row.get(s, {})
        if "ms" in r:
            speed = f" ({eager / r['ms']:.2f}x)" if eager else ""
            cells.append(f"{r['ms']:.3f}{speed}{' !' if r.get('checked') is False else ''}")
        else:
            cells.append(r.get("error", "-")[:60])
    return cells


def _line(row, systems):
    return (
        f"| {row['case']} | {row['width']} | {row['mode']} | {row['floor_ms']:.3f} | "
        + " | ".join(_cells(row, systems))
        + " |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
