"""Attention over every mesh point, the way transformer PDE solvers use it.

At N = 221 * 51 = 11271 points, batch 4, 8 heads of width 16 (the airfoil
solvers' shape) and 8 heads of width 64, in one run on one GPU:

- softmax attention: ``F.scaled_dot_product_attention`` (no mask);
- Galerkin linear attention: ``q @ (LN(k)^T @ LN(v)) / n`` as the zoo's
  Galerkin Transformer writes it (q, k, v rearranged from one [B, N, 3HD]
  projection output);
- slice attention as the zoo's Transolver writes it (64 slices), from the
  projected point features to the scattered result.

Each in strict fp32 (torch's default), with TF32 allowed (on every side), and
in bf16 under ``torch.autocast``; under eager, ``torch.compile`` in each mode
of ``--compile-modes`` (default: the default mode and reduce-overhead, timed as
its CUDA-graph replays) and AutoFuser. Every output is checked against eager before it is timed (a
failed check is marked in the table). Beside each case: its FLOP count and the
time those FLOPs take at the matrix rate of that precision, measured in the
same run with a large ``torch.matmul``.

    python benchmarks/attention.py --out bench-results/ [--widths 16,64] [--forms softmax,galerkin,slice]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.testing
from einops import rearrange

from _compile_modes import add_compile_modes_argument, compile_key, compile_keys_in
from matmul import _cells, _flat, _ms, column_title, measure, precision  # the matmul benchmark's timing, checks, cells

N = 221 * 51
BATCH = 4
HEADS = 8
SLICES = 64
#: Largest relative error (||got - eager|| / ||eager||) each precision may show.
CHECK = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 4e-2}


class Softmax(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class Galerkin(nn.Module):
    """The zoo Galerkin Transformer's attention between its projections."""

    def __init__(self, width: int):
        super().__init__()
        self.norm_k, self.norm_v = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, qkv):
        n = qkv.shape[1]
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=HEADS) for t in qkv.chunk(3, dim=-1))
        k, v = self.norm_k(k), self.norm_v(v)
        context = torch.einsum("bhnd,bhne->bhde", k, v) / n
        return torch.einsum("bhnd,bhde->bhne", q, context)


class Slice(nn.Module):
    """The zoo Transolver's physics attention between its projections."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = width**-0.5
        self.to_slice = nn.Linear(width, SLICES)
        nn.init.orthogonal_(self.to_slice.weight)
        self.temperature = nn.Parameter(torch.full((1, HEADS, 1, 1), 0.5))
        self.to_q, self.to_k, self.to_v = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x_mid, fx_mid):
        weights = torch.softmax(self.to_slice(x_mid) / self.temperature, dim=-1)
        norm = weights.sum(dim=2)
        tokens = torch.einsum("bhnd,bhng->bhgd", fx_mid, weights) / (norm[..., None] + 1e-5)
        q, k, v = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        attention = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        return torch.einsum("bhgd,bhng->bhnd", torch.matmul(attention, v), weights)


def _inputs(form: str, width: int, device):
    heads = (BATCH, HEADS, N, width)
    if form == "softmax":
        return tuple(torch.randn(heads, device=device) for _ in range(3))
    if form == "galerkin":
        return (torch.randn(BATCH, N, 3 * HEADS * width, device=device),)
    return torch.randn(heads, device=device), torch.randn(heads, device=device)


def _flops(form: str, d: int) -> float:
    """Multiply-adds x 2 of the products (the softmax's and norms' few FLOPs per element left out)."""
    bh = BATCH * HEADS
    if form == "softmax":
        return bh * 4.0 * N * N * d  # q @ k^T and p @ v
    if form == "galerkin":
        return bh * 4.0 * N * d * d  # k^T @ v and q @ context
    g = SLICES
    # x @ Ws^T, w^T @ fx, w @ t' over the points; q/k/v maps and attention among the slices
    return bh * (6.0 * N * d * g + 6.0 * g * d * d + 4.0 * g * g * d)


FORMS = {"softmax": Softmax, "galerkin": Galerkin, "slice": Slice}


def measure_rates(device):
    n = 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    rates = {}
    for mode in ("fp32", "tf32", "bf16"):
        with precision(mode):
            rates[mode] = 2 * n**3 / (_ms(torch.matmul, a, b) * 1e-3)
    return rates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--widths", default="16,64")
    parser.add_argument("--forms", default="softmax,galerkin,slice")
    parser.add_argument("--modes", default="fp32,tf32,bf16")
    parser.add_argument("--tune-budget", type=float, default=5.0, help="AutoFuser tuning seconds per group")
    add_compile_modes_argument(parser)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no new case after this many seconds (the rest are listed as not run)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rates = measure_rates(device)
    print("matrix rate TFLOP/s: " + ", ".join(f"{k} {v / 1e12:.0f}" for k, v in rates.items()), file=sys.stderr)
    systems = ["eager", *(compile_key(mode) for mode in args.compile_modes), "autofuser"]
    rows = []
    for width in [int(w) for w in args.widths.split(",")]:
        for form in args.forms.split(","):
            torch.manual_seed(0)
            model = FORMS[form](width).to(device).eval() if form != "softmax" else Softmax().eval()
            inputs = _inputs(form, width, device)
            for mode in args.modes.split(","):
                flops = _flops(form, width)
                row = {
                    "form": form,
                    "width": width,
                    "mode": mode,
                    "GFLOP": flops / 1e9,
                    "at_matrix_rate_ms": 1e3 * flops / rates[mode],
                }
                if time.perf_counter() - started > args.budget_s:
                    row.update({s: {"error": f"not run: past --budget-s {args.budget_s:g}"} for s in systems})
                    rows.append(row)
                    continue
                with precision(mode), torch.no_grad():
                    expected = _flat(model(*inputs))
                    for system in systems:
                        row[system] = measure(
                            system, model, inputs, expected, args.tune_budget, keep=lambda g: "attention" in g.strategy
                        )
                        if "rel_err" in row[system]:
                            row[system]["checked"] = row[system]["rel_err"] <= CHECK[mode]
                rows.append(row)
                print(_line(row, systems) + f"  [{time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)
                (out / "attention.partial.json").write_text(json.dumps(rows, indent=1))
            del model, inputs
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "matmul_TFLOP/s": {k: v / 1e12 for k, v in rates.items()},
        "points": N,
        "batch": BATCH,
        "heads": HEADS,
        "slices": SLICES,
        "cases": rows,
        "seconds": time.perf_counter() - started,
    }
    (out / "attention.json").write_text(json.dumps(result, indent=1))
    header = (
        f"N = {N} points, batch {BATCH}, {HEADS} heads ({SLICES} slices); {result['gpu']}, {result['date']}, "
        f"torch {result['torch']}, Triton {result['triton']}; matrix rate fp32 {rates['fp32'] / 1e12:.0f}, "
        f"tf32 {rates['tf32'] / 1e12:.0f}, bf16 {rates['bf16'] / 1e12:.0f} TFLOP/s. Time in ms (speedup over "
        "eager); 'at matrix rate': the form's FLOPs at that rate; '!' marks an output that failed its check "
        "against eager; AutoFuser's group column: the form recognised (fused) or why not."
    )
    table = "\n".join([header, "", *rows_table(rows)])
    (out / "attention.md").write_text(table + "\n")
    print(table)
    return 0


def rows_table(rows) -> list[str]:
    """The markdown table of ``rows`` (as ``attention.json`` or a summary in
    ``benchmarks/results/attention.json`` holds them): a column per system the rows have."""
    systems = ["eager", *compile_keys_in(rows), "autofuser"]
    return [
        "| form | head width | precision | GFLOP | at matrix rate | "
        + " | ".join(column_title(s) for s in systems)
        + " | AutoFuser's group |",
        "|---|---|---|---|---|" + "---|" * (len(systems) + 1),
        *(_line(row, systems) for row in rows),
    ]


def _line(row, systems):
    cells = _cells(row, systems)
    groups = row.get("autofuser", {}).get("groups", [])
    # A summary's groups (benchmarks/results/attention.json) are the fused ones, without a summary of their own.
    group = next((g for g in groups if g.get("fused", True)), groups[0] if groups else None)
    if group is None:
        what = "-"
    elif group.get("fused", True):
        what = group.get("summary", group["strategy"]).split(":")[0]
    else:
        what = f"eager: {group['reason']}"
    return (
        f"| {row['form']} | {row['width']} | {row['mode']} | {row['GFLOP']:.2f} | {row['at_matrix_rate_ms']:.3f} | "
        + " | ".join(cells)
        + f" | {what} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
