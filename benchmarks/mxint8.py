"""MXINT8 weights fused into the product kernels, against fp32, on one GPU in one run.

Cases:

- a zoo transformer PDE solver on the Airfoil configuration (221 x 51 mesh,
  batch 4): ``galerkin`` (Galerkin Transformer) by default; ``--models
  galerkin,transformer`` adds the softmax-attention Transformer (then the run
  likely exceeds 8 minutes);
- the product chains of ``benchmarks/matmul.py`` (M = 8 * 221 * 51 rows,
  widths 128 and 256): linear + GELU, layer norm + linear, MLP, feed-forward half.

Systems, side by side in this process, all under torch's default fp32 matmul
precision ("highest": no TF32 anywhere): fp32 eager, ``torch.compile`` in each
mode of ``--compile-modes`` (default: the default mode and reduce-overhead,
timed as its CUDA-graph replays), AutoFuser fp32, eager on the MXINT8-quantised model (dequantising in torch on
every call), and AutoFuser MXINT8 (``fuse(model, quantize="mxint8")``).
Every output is checked before it is timed: fp32 systems against fp32 eager,
the MXINT8 AutoFuser against eager of the same quantised model (fp32
tolerance); each row also gives the error against fp32 eager (for MXINT8,
the quantisation error), the weight bytes (parameters and buffers), and the
speed-up over eager.

    python benchmarks/mxint8.py --out bench-results/ [--models galerkin] [--widths 128,256]

Writes ``mxint8.json`` and ``mxint8.md`` to ``--out``; prints progress to stderr.
``--device cpu`` is a smoke run of the same code under Triton's interpreter
(tiny zoo configuration, 64 rows, no ``torch.compile``, rough timings).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

import autofuser
from autofuser.zoo.models import MESHES, MODELS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compile_modes import (  # noqa: E402
    DEFAULT_COMPILE_MODES,
    LEGACY_KEYS,
    add_compile_modes_argument,
    compile_key,
    compile_keys_in,
    compiled,
    mode_of,
)
from matmul import CASES, M  # noqa: E402  (the product chains of the matmul benchmark)

TITLES = {
    "eager": "fp32 eager",
    "autofuser": "AutoFuser fp32",
    "eager-mxint8": "eager MXINT8",
    "autofuser-mxint8": "AutoFuser MXINT8",
}


def systems_of(compile_keys) -> tuple[str, ...]:
    """Every system of a row, in table order, with torch.compile's cells under ``compile_keys``."""
    return ("eager", *compile_keys, "autofuser", "eager-mxint8", "autofuser-mxint8")


#: The systems of a run in the default modes.
SYSTEMS = systems_of(compile_key(mode) for mode in DEFAULT_COMPILE_MODES)


def is_compile(system: str) -> bool:
    return system in LEGACY_KEYS or system.startswith("torch.compile")


def column_title(system: str) -> str:
    return TITLES.get(system) or compile_key(mode_of(system))


def _ms(fn, *args):
    if not args[0].is_cuda:  # smoke run: one call, wall clock
        start = time.perf_counter()
        fn(*args)
        return 1e3 * (time.perf_counter() - start)
    return float(triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=100, return_mode="median"))


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def bench_case(
    name: str, model: torch.nn.Module, x: torch.Tensor, tune_budget: float, deadline: float, systems=SYSTEMS
) -> dict:
    """Every system on one model and input; a failing or skipped system is a cell, not a crash."""
    row: dict = {"case": name}
    with torch.no_grad():
        expected = model(x)
        quantised_reference = None
        for system in systems:
            if time.perf_counter() > deadline:
                row[system] = {"error": "skipped: the run's time limit was reached"}
                continue
            try:
                start = time.perf_counter()
                if system == "eager":
                    fn, weights = model, _weight_bytes(model)
                elif is_compile(system):
                    torch._dynamo.reset()
                    fn, weights = compiled(model, mode_of(system)), _weight_bytes(model)
                elif system == "autofuser":
                    fn = autofuser.fuse(model, tune_budget_s=tune_budget, progress=False)
                    weights = _weight_bytes(model)
                elif system == "eager-mxint8":
                    quantised = autofuser.fuse(model, quantize="mxint8", progress=False)
                    fn, weights = quantised.model, _weight_bytes(quantised.model)
                else:
                    fn = autofuser.fuse(model, quantize="mxint8", tune_budget_s=tune_budget, progress=False)
                    weights = _weight_bytes(fn.model)
                if is_compile(system) and not x.is_cuda:
                    row[system] = {"error": "not run on the CPU"}
                    continue
                got = fn(x)  # checked before the next call (a CUDA-graph replay overwrites it)
                if x.is_cuda:
                    torch.cuda.synchronize()
                first = time.perf_counter() - start
                cell = {"first_call_s": first, "weight_bytes": weights, "rel_err_vs_fp32": _rel(got, expected)}
                if system == "eager-mxint8":
                    quantised_reference = got
                # The quantised eager model is the reference of the MXINT8 AutoFuser, not checked itself.
                reference = {"eager-mxint8": None, "autofuser-mxint8": quantised_reference}.get(system, expected)
                if system == "autofuser-mxint8" and reference is None:
                    raise RuntimeError("no eager MXINT8 output to check against")
                if reference is not None:
                    # fp32-level agreement with the eager computation of the same weights.
                    torch.testing.assert_close(got.float(), reference.float(), atol=1e-3, rtol=1e-3)
                cell["ms"] = _ms(fn, x)
                if system.startswith("autofuser"):
                    report = fn.report()
                    cell["fused_groups"] = len(report.fused)
                    cell["skipped_groups"] = len(report.skipped)
                    cell["quantised_layers"] = len(report.quantized)
                    cell["notes"] = report.notes
                    cell["groups"] = [
                        {
                            "strategy": g.strategy,
                            "ops": g.ops,
                            "fused": g.fused,
                            "reason": g.reason_code,
                            "eager_ms": g.time_eager_ms,
                            "fused_ms": g.time_fused_ms,
                        }
                        for g in report.groups
                    ]
                row[system] = cell
            except Exception as err:
                row[system] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
            finally:
                fn = None
                if x.is_cuda:
                    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--models", default="galerkin", help="zoo models (Airfoil configuration)")
    parser.add_argument("--widths", default="128,256", help="widths of the product chains ('' for none)")
    parser.add_argument("--tune-budget", type=float, default=1.0, help="AutoFuser tuning seconds per group")
    parser.add_argument(
        "--time-limit", type=float, default=420.0, help="seconds after which remaining systems are skipped (and say so)"
    )
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run under the interpreter")
    add_compile_modes_argument(parser)
    args = parser.parse_args(argv)
    systems = systems_of(compile_key(mode) for mode in args.compile_modes)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("mxint8.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    config, rows_m = ("airfoil", M) if device.type == "cuda" else ("tiny", 64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.time_limit
    cases = []
    for name in [m for m in args.models.split(",") if m]:
        entry = MODELS[name]
        torch.manual_seed(0)
        model = entry.make(config).to(device).eval()
        h, w = MESHES[config]
        x = entry.inputs(torch.rand(entry.batch(config), h, w, 2, device=device))
        cases.append((f"{entry.title} ({config}, batch {x.shape[0]})", model, x))
    for width in [int(w) for w in args.widths.split(",") if w]:
        for case, (factory, _, _) in CASES.items():
            torch.manual_seed(0)
            cases.append(
                (f"{case}, width {width}", factory(width).to(device).eval(), torch.randn(rows_m, width, device=device))
            )
    rows = []
    for name, model, x in cases:
        print(f"mxint8 bench: {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_case(name, model, x, args.tune_budget, deadline, systems))
        print(_line(rows[-1], systems), file=sys.stderr, flush=True)
        (out / "mxint8.partial.json").write_text(json.dumps(rows, indent=1))
        del model, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "rows": rows_m,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "precision": "fp32 highest (no TF32)",
        "cases": rows,
    }
    (out / "mxint8.json").write_text(json.dumps(result, indent=1))
    header = (
        f"{result['gpu']}, {result['date']}, torch {result['torch']}, Triton {result['triton']}; fp32 "
        "products without TF32 (AutoFuser: 3xTF32). Each cell: ms (speed-up over fp32 eager); "
        "weights: parameter + buffer bytes; error: relative L2 against fp32 eager."
    )
    table = "\n".join([header, "", *rows_table(rows)])
    (out / "mxint8.md").write_text(table + "\n")
    print(table)
    return 0


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def rows_table(rows) -> list[str]:
    """The markdown table of ``rows`` (as ``mxint8.json`` or a summary in
    ``benchmarks/results/mxint8.json`` holds them): a column per system the rows have."""
    systems = systems_of(compile_keys_in(rows))
    return [
        "| case | " + " | ".join(column_title(s) for s in systems) + " | weights fp32 -> MXINT8 | error MXINT8 |",
        "|---|" + "---|" * (len(systems) + 2),
        *(_line(row, systems) for row in rows),
    ]


def _line(row: dict, systems) -> str:
    eager = row.get("eager", {}).get("ms")
    cells = []
    for system in systems:
        cell = row.get(system, {})
        if "ms" in cell:
            cells.append(f"{cell['ms']:.3f}" + (f" ({eager / cell['ms']:.2f}x)" if eager else ""))
        else:
            cells.append(cell.get("error", "-")[:60])
    fp32_bytes = row.get("eager", {}).get("weight_bytes")
    q_bytes = row.get("autofuser-mxint8", {}).get("weight_bytes")
    weights = f"{_size(fp32_bytes)} -> {_size(q_bytes)}" if fp32_bytes and q_bytes else "-"
    err = row.get("autofuser-mxint8", {}).get("rel_err_vs_fp32")
    error = f"{err:.2e}" if err is not None else "-"
    return f"| {row['case']} | " + " | ".join(cells) + f" | {weights} | {error} |"


if __name__ == "__main__":
    raise SystemExit(main())
