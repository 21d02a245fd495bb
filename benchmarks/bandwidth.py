"""Memory-bound kernels against the device's copy bandwidth.

Measures, in one run on one GPU:

- the copy bandwidth (``y.copy_(x)`` on 1 GiB, bytes read + written / time);
- a 6-op pointwise chain on 2**26 fp32 elements;
- layer norm and softmax on (65536, 1024) fp32;

each under eager PyTorch, ``torch.compile`` (default mode) and AutoFuser, as
the median of Triton's ``do_bench``. Every output is checked against eager
before it is timed. Prints a markdown table and writes ``bandwidth.json`` and
``bandwidth.md`` to ``--out``.

    python benchmarks/bandwidth.py --out bench-results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton.testing

import autofuser


class PointwiseChain(torch.nn.Module):
    """Six pointwise ops; eager reads and writes 2**26 floats six times over."""

    def forward(self, x, y):
        a = x * y
        b = a + 1.0
        c = torch.sigmoid(b)
        d = c * x
        e = d - y
        return torch.relu(e)


class Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


def _ms(fn, *args) -> float:
    return float(triton.testing.do_bench(lambda: fn(*args), warmup=25, rep=200, return_mode="median"))


def copy_bandwidth(device) -> float:
    x = torch.randn(2**28, device=device)
    y = torch.empty_like(x)
    ms = _ms(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def cases(device):
    n = 2**26
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    yield "pointwise chain (6 ops), 2^26 fp32", PointwiseChain(), (x, y), 3 * n * 4
    rows = torch.randn(65536, 1024, device=device)
    ln = torch.nn.LayerNorm(1024).to(device)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    yield "layer norm (65536, 1024) fp32", ln, (rows,), 2 * rows.numel() * 4
    yield "softmax (65536, 1024) fp32", Softmax(), (rows,), 2 * rows.numel() * 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bandwidth.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peak = copy_bandwidth(device)
    rows = []
    for name, model, inputs, nbytes in cases(device):
        model.eval()
        with torch.no_grad():
            expected = model(*inputs)
            fused = autofuser.fuse(model)
            compiled = torch.compile(model)
            row = {"case": name, "bytes": nbytes}
            for label, fn in (("eager", model), ("torch.compile", compiled), ("autofuser", fused)):
                got = fn(*inputs)
                err = float((got - expected).abs().max() / expected.abs().max())
                ms = _ms(fn, *inputs)
                row[label] = {
                    "ms": ms,
                    "GB/s": nbytes / (ms * 1e-3) / 1e9,
                    "of_copy": nbytes / (ms * 1e-3) / 1e9 / peak,
                    "max_rel_err": err,
                }
            row["report"] = json.loads(fused.report().to_json())
        rows.append(row)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GB/s": peak,
        "cases": rows,
    }
    (out / "bandwidth.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"Copy bandwidth {peak:.0f} GB/s on {result['gpu']} ({result['date']}, torch {result['torch']}, "
        f"Triton {result['triton']}). Time in ms (share of copy bandwidth).",
        "",
        "| case | eager | torch.compile | AutoFuser | AutoFuser vs eager |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [f"{row[k]['ms']:.3f} ({row[k]['of_copy']:.0%})" for k in ("eager", "torch.compile", "autofuser")]
        speedup = row["eager"]["ms"] / row["autofuser"]["ms"]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {speedup:.2f}x |")
    table = "\n".join(lines)
    (out / "bandwidth.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
