"""The chart in BENCHMARKS.md: speedup over eager of AutoFuser and ``torch.compile`` on
every zoo model, fp32 and bf16, from one zoo run of ``benchmarks/results/zoo.json``.
``torch.compile``'s modes are bars of their own: the default mode, and reduce-overhead
and max-autotune where the run measured them (``autofuser bench --compile-modes``); a
run from before they were measured has no cells for them, and no bars or legend entry.

Plain SVG written by hand (no plotting library needed); the speedup axis is
logarithmic, so 0.5x and 2x sit equally far from eager's 1x.

    python benchmarks/chart.py [--summary benchmarks/results/zoo.json] [--run N] [--out benchmarks/results/zoo.svg]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Every system a chart may show: (the rows' key, the legend's name, colour), in bar order.
SYSTEMS = (
    ("autofuser", "AutoFuser", "#1f77b4"),
    ("torch.compile", "torch.compile (default)", "#ff7f0e"),
    ("torch.compile reduce-overhead", "torch.compile (reduce-overhead)", "#2ca02c"),
    ("torch.compile max-autotune", "torch.compile (max-autotune)", "#9467bd"),
)
BAR, GAP, LABEL_W, PLOT_W, PANEL_GAP = 9, 8, 200, 330, 40


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def axis_range(speedups: list[float]) -> tuple[float, float]:
    """The axis' ends: the powers of two around every speedup and 1x, however far from 1x
    (a 0.001x bar must show, not fall off a fixed axis)."""
    values = [v for v in speedups if v > 0] + [1.0]
    lo, hi = 2.0 ** math.floor(math.log2(min(values))), 2.0 ** math.ceil(math.log2(max(values)))
    return lo, max(hi, 2 * lo)


def axis_ticks(lo: float, hi: float) -> list[float]:
    """Powers of two from ``lo`` to ``hi``, thinned to at most about 10 labels."""
    low, high = round(math.log2(lo)), round(math.log2(hi))
    step = max(1, math.ceil((high - low) / 10))
    exponents = sorted(set(range(0, low - 1, -step)) | set(range(0, high + 1, step)))
    return [2.0**e for e in exponents if low <= e <= high]


def systems_in(run: dict) -> list[tuple[str, str, str]]:
    """The systems of ``SYSTEMS`` that some row of ``run`` has a cell for, in bar order."""
    return [system for system in SYSTEMS if any(system[0] in r for r in run["rows"])]


def render(run: dict) -> str:
    systems = systems_in(run)
    dtypes = [d for d in ("fp32", "bf16") if any(r["dtype"] == d for r in run["rows"])]
    speedups = [r[s]["speedup"] for r in run["rows"] for s, _, _ in systems if r.get(s, {}).get("speedup")]
    lo, hi = axis_range(speedups)
    ticks = axis_ticks(lo, hi)

    def x(value: float) -> float:
        return LABEL_W + PLOT_W * (math.log2(value) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))

    models = list(dict.fromkeys(r["model"] for r in run["rows"]))
    panel_h = len(models) * (len(systems) * BAR + GAP)
    top = 60
    height = top + len(dtypes) * (panel_h + PANEL_GAP) + 20
    # The legend's entries side by side, each at least 120 wide (a swatch and its name).
    entry_w = [max(120, 30 + 6 * len(name)) for _, name, _ in systems]
    width = max(LABEL_W + PLOT_W + 70, LABEL_W + sum(entry_w))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">Speedup over eager, zoo run '
        f"{_esc(str(run['run']))} ({_esc(run['gpu'])}, commit {_esc(run['commit'])})</text>",
    ]
    for i, (_, name, colour) in enumerate(systems):
        lx = LABEL_W + sum(entry_w[:i])
        out.append(
            f'<rect x="{lx}" y="28" width="10" height="10" fill="{colour}"/>'
            f'<text x="{lx + 14}" y="37">{_esc(name)}</text>'
        )
    y0 = top
    for dtype in dtypes:
        rows = {r["model"]: r for r in run["rows"] if r["dtype"] == dtype}
        out.append(f'<text x="4" y="{y0 - 6}" font-weight="bold">{dtype}</text>')
        for t in ticks:
            if lo <= t <= hi:
                style = 'stroke="#444"' if t == 1 else 'stroke="#ddd"'
                out.append(
                    f'<line x1="{x(t):.1f}" y1="{y0}" x2="{x(t):.1f}" y2="{y0 + panel_h}" {style}/>'
                    f'<text x="{x(t):.1f}" y="{y0 + panel_h + 12}" text-anchor="middle" fill="#444">'
                    f"{t:g}x</text>"
                )
        y = y0
        for model in models:
            row = rows.get(model)
            out.append(
                f'<text x="{LABEL_W - 6}" y="{y + BAR + 3}" text-anchor="end">'
                f"{_esc(row['title'] if row else model)}</text>"
            )
            for key, _, colour in systems:
                value = row.get(key, {}).get("speedup") if row else None
                if value:
                    x1, x2 = sorted((x(1), x(value)))
                    out.append(
                        f'<rect x="{x1:.1f}" y="{y}" width="{max(x2 - x1, 1):.1f}" height="{BAR - 1}" '
                        f'fill="{colour}"/><text x="{max(x(value), x(1)) + 3:.1f}" y="{y + BAR - 1}" '
                        f'font-size="9">{value:.2f}x</text>'
                    )
                y += BAR
            y += GAP
        y0 += panel_h + PANEL_GAP
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summary", type=Path, default=HERE / "results" / "zoo.json")
    parser.add_argument("--run", default="N", help="which run of the summary (its 'run' field)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "zoo.svg")
    args = parser.parse_args(argv)
    runs = json.loads(args.summary.read_text())["runs"]
    (run,) = [r for r in runs if str(r["run"]) == args.run]
    args.out.write_text(render(run))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
