"""FNO and F-FNO before and after the FFT plugin (examples/autofuser-plugin-fft).

For the zoo's ``fno`` and ``ffno`` in their airfoil configuration (fp32, eval,
no grad), side by side in one process:

- eager PyTorch;
- ``torch.compile`` in each mode of ``--compile-modes`` (default: the default
  mode and reduce-overhead, timed as its CUDA-graph replays);
- AutoFuser with the bundled plugins only (the spectral convolution stays eager);
- AutoFuser with the bundled plugins and ``fft``.

Every output is checked against eager (relative L2 error, and a failure above
1e-4) before anything is timed; a system that fails becomes an error cell.
The report of the ``fft`` run is saved too, so the table can be checked
against what was fused.

    pip install ./examples/autofuser-plugin-fft
    python benchmarks/fft_plugin.py --out bench-results/fft

Writes ``fft_plugin.json`` and ``fft_plugin.md`` to ``--out``; progress on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

import autofuser
from autofuser.zoo.harness import first_call_s, relative_error, timed
from autofuser.zoo.models import MESHES, MODELS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compile_modes import (  # noqa: E402
    DEFAULT_COMPILE_MODES,
    add_compile_modes_argument,
    compile_key,
    compile_keys_in,
    compiled,
)

BUNDLED = ["elementwise", "reduction", "matmul", "attention"]
AUTOFUSER_SYSTEMS = ("autofuser (bundled)", "autofuser + fft")
MAX_ERROR = 1e-4


def progress(message: str) -> None:
    print(f"fft_plugin: {message}", file=sys.stderr, flush=True)


def bench_model(
    name: str,
    device: torch.device,
    iters: int,
    warmup: int,
    cache: str,
    config: str,
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES,
) -> dict:
    entry = MODELS[name]
    torch.manual_seed(0)
    model = entry.make(config).to(device).eval()
    coords = torch.rand(entry.batch(config), *MESHES[config], 2, device=device)
    x = entry.inputs(coords)
    row: dict = {"model": name, "batch": entry.batch(config)}
    with torch.no_grad():
        reference = model(x)
        systems = {
            "eager": lambda: model,
            **{compile_key(mode): (lambda mode=mode: compiled(model, mode)) for mode in compile_modes},
            "autofuser (bundled)": lambda: autofuser.fuse(model, plugins=BUNDLED, cache_dir=cache, progress=False),
            "autofuser + fft": lambda: autofuser.fuse(
                model, plugins=BUNDLED + ["fft"], cache_dir=cache, progress=False
            ),
        }
        for system, build in systems.items():
            progress(f"{name}: {system}")
            try:
                torch._dynamo.reset()
                runner = build()
                out, first_s = first_call_s(lambda: runner(x), device)
                error = relative_error(out, reference)
                if not error <= MAX_ERROR:
                    raise AssertionError(f"relative error {error:.3g} > {MAX_ERROR}")
                ms = timed(lambda: runner(x), iters, warmup, device)["ms"]
                cell = {"ms": ms, "first_call_s": first_s, "rel_error": error}
                if system.startswith("autofuser"):
                    report = runner.report()
                    cell["fused_groups"] = len(report.fused)
                    cell["spectral_groups_fused"] = sum(
                        g.fused for g in report.groups if g.strategy == "fft.spectral_mix"
                    )
                    cell["report"] = report.model_dump(mode="json")
            except Exception as err:
                traceback.print_exc()
                cell = {"error": f"{type(err).__name__}: {err}"}
            row[system] = cell
            progress(f"{name}: {system}: {cell.get('ms', cell.get('error'))}")
    return row


def render(result: dict) -> str:
    """The markdown table of ``result`` (as ``fft_plugin.json`` or ``benchmarks/results/fft_plugin.json``
    holds it): a column per system its rows have."""
    systems = ("eager", *compile_keys_in(result["rows"]), *AUTOFUSER_SYSTEMS)
    lines = [
        f"FNO / F-FNO with and without autofuser-plugin-fft on {result.get('device', result.get('gpu'))} "
        f"({result['date']}), fp32, {result['config']} configuration; median ms per forward (speed-up over eager)",
        "",
        "| model | batch | " + " | ".join(systems) + " | spectral groups fused |",
        "|---|---|" + "---|" * len(systems) + "---|",
    ]
    for row in result["rows"]:
        eager = row["eager"].get("ms")
        cells = []
        for system in systems:
            cell = row.get(system, {"error": "not run"})
            if "ms" not in cell:
                cells.append(f"error: {cell['error'][:60]}")
            else:
                cells.append(f"{cell['ms']:.3f} ({eager / cell['ms']:.2f}x)" if eager else f"{cell['ms']:.3f}")
        spectral = row["autofuser + fft"].get("spectral_groups_fused", "-")
        lines.append(f"| {row['model']} | {row['batch']} | " + " | ".join(cells) + f" | {spectral} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for fft_plugin.json and fft_plugin.md")
    parser.add_argument("--models", default="fno,ffno")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--config",
        choices=("airfoil", "tiny"),
        default="airfoil",
        help="tiny: toy sizes, a quick check that the script runs",
    )
    add_compile_modes_argument(parser)
    args = parser.parse_args(argv)
    import autofuser_plugin_fft  # noqa: F401 - fail early, with pip's instructions, if it isn't installed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        progress("no GPU: timings on the CPU mean little (kernels run under Triton's interpreter)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name in args.models.split(","):
            rows.append(bench_model(name, device, args.iters, args.warmup, cache, args.config, args.compile_modes))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": args.config,
        "rows": rows,
    }
    (out / "fft_plugin.json").write_text(json.dumps(result, indent=1))
    table = render(result)
    (out / "fft_plugin.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
