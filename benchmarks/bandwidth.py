"""Memory-bound kernels against the device's copy bandwidth.

Measures, in one run on one GPU:

- the copy bandwidth (``y.copy_(x)`` on 1 GiB, bytes read + written / time);
- a 6-op pointwise chain on 2**26 fp32 elements;
- layer norm and softmax on (65536, 1024) fp32;

each under eager PyTorch, ``torch.compile`` in each mode of ``--compile-modes``
(default: the default mode and reduce-overhead, timed as its CUDA-graph
replays) and AutoFuser, as the median of Triton's ``do_bench``. Every output is checked against eager
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

from _compile_modes import add_compile_modes_argument, compile_key, compile_keys_in, compiled


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
    add_compile_modes_argument(parser)
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
            row = {"case": name, "bytes": nbytes}
            systems = [("eager", lambda: model)]
            systems += [(compile_key(mode), lambda mode=mode: compiled(model, mode)) for mode in args.compile_modes]
            systems += [("autofuser", lambda: fused)]
            for label, build in systems:
                try:
                    torch._dynamo.reset()
                    fn = build()
                    got = fn(*inputs)
                    err = float((got - expected).abs().max() / expected.abs().max())  # before the next call
                    ms = _ms(fn, *inputs)
                except Exception as exc:  # a mode that fails to compile or run is its cell, not the end of the run
                    row[label] = {
                        "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    }
                    continue
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
    table = render(result)
    (out / "bandwidth.md").write_text(table + "\n")
    print(table)
    return 0


def render(result: dict) -> str:
    """The markdown table of ``result`` (as ``bandwidth.json`` or ``benchmarks/results/bandwidth.json``
    holds it): a column per system its cases have."""
    rows = result["cases"]
    systems = ["eager", *compile_keys_in(rows), "autofuser"]
    titles = {"eager": "eager", "autofuser": "AutoFuser"}
    lines = [
        f"Copy bandwidth {result['copy_GB/s']:.0f} GB/s on {result['gpu']} ({result['date']}, torch {result['torch']}, "
        f"Triton {result['triton']}). Time in ms (share of copy bandwidth).",
        "",
        "| case | " + " | ".join(titles.get(s, s) for s in systems) + " | AutoFuser vs eager |",
        "|---|" + "---|" * (len(systems) + 1),
    ]
    for row in rows:
        cells = []
        for system in systems:
            cell = row.get(system, {"error": "not run"})
            cells.append(f"{cell['ms']:.3f} ({cell['of_copy']:.0%})" if "ms" in cell else cell["error"][:60])
        eager, fused = row.get("eager", {}).get("ms"), row.get("autofuser", {}).get("ms")
        speedup = f"{eager / fused:.2f}x" if eager and fused else "-"
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
