"""``FusionReport.to_html``: one self-contained page to look at.

No external assets, no script: inline CSS and an inline SVG drawing of the
graph, so the file can be mailed, attached to an issue or opened offline.

Sections: a summary; the graph, laid out in layers (each node one layer below
its deepest input) and coloured by the fused group it belongs to (grey: left
eager); every fusion group with its fate, reason, traffic and the timings that
were measured; the nodes left eager and why; opaque parts; the generated
kernel source of every group that got one.

report.py imports this module (``to_html`` calls ``render_html``, and its text
table writes sizes with ``format_bytes``); this module never imports report.py
when it runs: it only reads the report it is given, and names its type for the
type checker alone.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: at run time report.py imports this module, not the reverse
    from .report import FusionReport

#: Fill colours of fused groups, in turn (readable with black text).
PALETTE = (
    "#8dd3c7",
    "#ffffb3",
    "#bebada",
    "#fb8072",
    "#80b1d3",
    "#fdb462",
    "#b3de69",
    "#fccde5",
    "#bc80bd",
    "#ccebc5",
    "#ffed6f",
    "#a6cee3",
    "#b2df8a",
    "#fdbf6f",
    "#cab2d6",
    "#e5c494",
)
EAGER_FILL = "#e8e8e8"
IO_FILL = "#ffffff"

NODE_W, NODE_H, GAP_X, GAP_Y, MARGIN = 176, 34, 16, 30, 12

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.fused { color: #0a6b0a; font-weight: 600; } .skipped { color: #a33; font-weight: 600; }
.swatch { display: inline-block; width: 12px; height: 12px; border: 1px solid #555; vertical-align: middle; }
.graph { overflow: auto; max-height: 80vh; border: 1px solid #ccc; }
.graph text { font: 11px monospace; pointer-events: none; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 8px; overflow: auto; font-size: 12px; }
code { font-size: 12px; }
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def format_bytes(n: float) -> str:
    """``n`` bytes as the report writes them, here and in its text table: 1.5 KiB, -3 B."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n} B"


# -- wording shared by the text report and the page ------------------------------

#: Internal homes of public torch functions -> the names users write.
_PUBLIC_NAMES = (
    ("torch._VariableFunctionsClass.", "torch."),
    ("torch._C._VariableFunctions.", "torch."),
    ("torch._C._nn.", "torch.nn.functional."),
    ("torch._C._fft.", "torch.fft."),
    ("torch._C._linalg.", "torch.linalg."),
    ("torch._C._special.", "torch.special."),
    ("torch._C.TensorBase.", "Tensor."),
    ("torch._tensor.Tensor.", "Tensor."),
    ("_operator.getitem", "x[...] (indexing)"),
    ("_operator.", "operator."),
    ("builtins.", ""),
)

#: Reason codes of candidates that lost to another grouping of the same ops, not to eager.
ALTERNATIVE_CODES = frozenset({"overlap", "split_faster", "larger_group_faster"})


def readable_target(target: str) -> str:
    """An op as a user writes it: ``torch.view_as_real``, not where torch keeps it."""
    for internal, public in _PUBLIC_NAMES:
        if target.startswith(internal):
            return public + target[len(internal) :]
    return target


def free_nodes(report: "FusionReport") -> set[str]:
    """Names of the nodes whose result re-reads an input's memory (views): they move no data."""
    return {node.name for node in report.graph if node.free}


def alternatives(report: "FusionReport") -> list[int]:
    """Indices of skipped candidates that were other ways of grouping ops that are fused
    anyway (or that lost to another grouping): not a reason anything stayed eager."""
    covered = {name for g in report.groups if g.fused for name in g.nodes}
    return [
        k
        for k, g in enumerate(report.groups)
        if not g.fused and (g.reason_code in ALTERNATIVE_CODES or set(g.nodes) <= covered)
    ]


def group_sentence(group) -> str:
    """What a group does, in words: the strategy's own summary where it gave one."""
    if group.reason and group.reason_code == "fused":
        return group.reason
    if not group.fused:
        return f"{group.reason_code}: {group.reason}"
    n = len(group.nodes)
    if n == 1:
        return "one op as a generated kernel"
    return f"{n} ops in one kernel: the values between them stay on chip, never written to memory"


def group_origin(report: "FusionReport", group) -> list[str]:
    """Where in the user's code a group's ops came from: each distinct source line (or,
    where none was recorded, submodule), in graph order."""
    by_name = {node.name: node for node in report.graph}
    places: list[str] = []
    for name in group.nodes:
        node = by_name.get(name)
        if node is None:
            continue
        place = node.source or (f"module {node.module}" if node.module else None)
        if place and place not in places:
            places.append(place)
    return places


def _speedup(eager_ms: float, fused_ms: float) -> str:
    return f"{eager_ms / fused_ms:.2f}x" if fused_ms > 0 else "-"


def summary_lines(report: "FusionReport") -> list[str]:
    """The few sentences a user reads first: what was fused, the measured result, where
    the time goes, what the compile cost."""
    fused = report.fused
    free = free_nodes(report)
    covered = {name for g in fused for name in g.nodes}
    calls = [n.name for n in report.graph if n.op.startswith("call_")] or [n.node for n in report.unfused_nodes]
    in_groups = len(covered)
    views = sum(1 for name in calls if name in free and name not in covered)
    costly = sum(1 for name in calls if name not in free and name not in covered)
    lines = [
        f"{len(fused)} fused kernel{'s' if len(fused) != 1 else ''} run {in_groups} op{'s' if in_groups != 1 else ''}; "
        f"{costly} op{'s run' if costly != 1 else ' runs'} as in eager"
        + (f", {views} more {'are free views' if views > 1 else 'is a free view'} (no data moved)" if views else "")
        + (f"; {len(report.opaque)} part(s) could not be traced" if report.opaque else "")
        + "."
    ]
    what = report.whole
    if report.whole_eager_ms is not None and report.whole_fused_ms is not None:
        eager_ms, fused_ms = report.whole_eager_ms, report.whole_fused_ms
        verdict = (
            "not faster enough: the original model runs"
            if report.runs_original
            else f"{_speedup(eager_ms, fused_ms)} eager's speed"
        )
        lines.append(f"Measured {what}: {fused_ms:.3f} ms fused vs {eager_ms:.3f} ms eager, {verdict}.")
    elif report.runs_original:
        lines.append(f"The original model runs for these inputs (see the notes); no {what} time was measured.")
    else:
        lines.append(
            f"The {what} was not timed"
            + (" (no GPU: kernels ran under Triton's CPU interpreter)" if "cuda" not in report.device else "")
            + "."
        )
    timed = [(k, g) for k, g in enumerate(report.groups) if g.fused and g.time_fused_ms is not None]
    if timed:
        total = sum(g.time_fused_ms or 0.0 for _, g in timed)
        top = sorted(timed, key=lambda kg: -(kg[1].time_fused_ms or 0.0))[:3]
        where = ", ".join(
            f"#{k} {g.strategy} {g.time_fused_ms:.3f} ms ({100 * (g.time_fused_ms or 0.0) / total:.0f}%)"
            for k, g in top
        )
        rest = ""
        if report.whole_fused_ms is not None and report.whole_fused_ms > total:
            rest = f"; outside the fused kernels (eager ops, launches) {report.whole_fused_ms - total:.3f} ms"
        lines.append(f"Where the time goes: fused kernels {total:.3f} ms, most in {where}{rest}.")
    elif fused:
        before = sum(g.bytes_before for g in fused)
        after = sum(g.bytes_after for g in fused)
        top = sorted(((k, g) for k, g in enumerate(report.groups) if g.fused), key=lambda kg: -kg[1].bytes_after)[:3]
        where = ", ".join(f"#{k} {g.strategy} {format_bytes(g.bytes_after)}" for k, g in top)
        lines.append(
            f"Memory traffic of the fused ops (predicted, not timed): {format_bytes(before)} -> "
            f"{format_bytes(after)}; the most in {where}."
        )
    if report.compile_s:
        steps = sorted(report.phases.items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"Compiling took {report.compile_s:.2f} s"
            + (": " + ", ".join(f"{name} {s:.2f} s" for name, s in steps) if steps else "")
            + "."
        )
    return lines


def eager_lines(report: "FusionReport") -> list[str]:
    """What stayed eager and why, one line per kind: free views together, then each op and
    reason with its count (a line of the user's code where all its nodes share one)."""
    free = free_nodes(report)
    views: dict[str, int] = {}
    by_reason: dict[tuple[str, str, str], list[str]] = {}
    for n in report.unfused_nodes:
        target = readable_target(n.target)
        if n.node in free:
            views[target] = views.get(target, 0) + 1
        else:
            by_reason.setdefault((target, n.reason_code, n.reason), []).append(n.node)
    lines = []
    if views:
        listed = ", ".join(f"{t} x{c}" if c > 1 else t for t, c in views.items())
        lines.append(f"free views, no data moved (they need no kernel): {listed}")
    for (target, code, reason), nodes in by_reason.items():
        count = f" x{len(nodes)}" if len(nodes) > 1 else ""
        lines.append(f"{target}{count}: {reason} [{code}]")
    return lines


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def _group_colours(report: "FusionReport") -> dict[int, str]:
    """Group index -> fill colour, for fused groups."""
    colours: dict[int, str] = {}
    for k, group in enumerate(report.groups):
        if group.fused:
            colours[k] = PALETTE[len(colours) % len(PALETTE)]
    return colours


def _layers(report: "FusionReport") -> dict[str, int]:
    """Each node's layer: one below its deepest input (the graph is in topological order)."""
    depth: dict[str, int] = {}
    for node in report.graph:
        depth[node.name] = 1 + max((depth[i] for i in node.inputs if i in depth), default=-1)
    return depth


def render_svg(report: "FusionReport") -> str:
    """The graph as an inline SVG: boxes in layers, edges as lines, fill by group."""
    colours = _group_colours(report)
    group_of: dict[str, int] = {}
    for index, group in enumerate(report.groups):
        if group.fused:
            for name in group.nodes:
                group_of[name] = index
    depth = _layers(report)
    rows: dict[int, list[str]] = {}
    for node in report.graph:
        rows.setdefault(depth[node.name], []).append(node.name)
    position = {}
    for layer, names in rows.items():
        for column, name in enumerate(names):
            position[name] = (MARGIN + column * (NODE_W + GAP_X), MARGIN + layer * (NODE_H + GAP_Y))
    width = MARGIN * 2 + max((len(n) for n in rows.values()), default=1) * (NODE_W + GAP_X)
    height = MARGIN * 2 + max(len(rows), 1) * (NODE_H + GAP_Y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="the graph, coloured by fusion group">',
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" markerHeight="6" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#777"/></marker></defs>',
    ]
    for node in report.graph:
        x, y = position[node.name]
        for source in node.inputs:
            if source in position:
                sx, sy = position[source]
                parts.append(
                    f'<line x1="{sx + NODE_W / 2}" y1="{sy + NODE_H}" x2="{x + NODE_W / 2}" y2="{y}" '
                    'stroke="#999" stroke-width="1" marker-end="url(#arrow)"/>'
                )
    for node in report.graph:
        x, y = position[node.name]
        k = group_of.get(node.name)
        if k is not None:
            fill, group_class = colours[k], f"node group-{k}"
        else:
            fill = IO_FILL if node.op in ("placeholder", "output", "get_attr") else EAGER_FILL
            group_class = "node eager"
        shape = f" {node.dtype}{node.shape}" if node.shape is not None else ""
        where = f"group #{k} ({report.groups[k].strategy})" if k is not None else "not in a fused group"
        label = node.target.rsplit(".", 1)[-1] if node.op != "call_module" else node.target.split(" ")[0]
        if k is not None:
            label = f"#{k} {label}"
        parts.append(
            f'<g class="{group_class}" data-node="{_e(node.name)}"><title>{_e(node.name)} = {_e(node.op)} '
            f"{_e(node.target)}{_e(shape)}; {_e(where)}</title>"
            f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="5" fill="{fill}" '
            f'stroke="{"#333" if k is not None else "#999"}"/>'
            f'<text x="{x + 6}" y="{y + 14}">{_e(node.name[:24])}</text>'
            f'<text x="{x + 6}" y="{y + 27}" fill="#555">{_e(label[:26])}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _group_rows(report: "FusionReport", colours: dict[int, str]) -> list[str]:
    rows = []
    for k, g in enumerate(report.groups):
        swatch = f'<span class="swatch" style="background:{colours[k]}"></span> ' if k in colours else ""
        fate = '<span class="fused">fused</span>' if g.fused else '<span class="skipped">skipped</span>'
        reason = _e(g.reason_code) + (f": {_e(g.reason)}" if g.reason else "")
        timing = (
            f"{_ms(g.time_eager_ms)} / {_ms(g.time_fused_ms)}"
            if g.time_eager_ms is not None or g.time_fused_ms is not None
            else "not measured"
        )
        if g.timed == "forward+backward" and timing != "not measured":
            timing += "<br><small>forward + backward</small>"
        strategy = _e(g.strategy) + ("" if g.phase == "forward" else "<br><small>backward</small>")
        kernel = f'<a href="#kernel-{k}"><code>{_e(g.kernel)}</code></a>' if g.kernel_source else _e(g.kernel or "-")
        error = "-" if g.max_error is None else f"{g.max_error:.3g}"
        rows.append(
            f'<tr id="group-{k}"><td>{swatch}#{k}</td><td>{strategy}</td><td>{fate}</td><td>{reason}</td>'
            f"<td>{_e(' > '.join(g.ops))}<br><small>{_e(', '.join(g.nodes))}</small></td>"
            f'<td class="num">{format_bytes(g.bytes_before)} -> {format_bytes(g.bytes_after)}</td>'
            f'<td class="num">{timing}</td><td class="num">{error}</td><td>{kernel}'
            f"{' (cache hit)' if g.cache_hit else ''}</td></tr>"
        )
    return rows


def render_html(report: "FusionReport", title: str = "") -> str:
    """The page of ``report`` (``FusionReport.to_html``), headed ``title`` (default:
    "AutoFuser report")."""
    colours = _group_colours(report)
    fused, skipped = report.fused, report.skipped
    saved = sum(g.bytes_before - g.bytes_after for g in fused)
    heading = title or "AutoFuser report"
    out = [
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(heading)}</title>',
        f"<style>{CSS}</style></head><body>",
        f"<h1>{_e(heading)}</h1>",
        "<table>",
        f"<tr><th>inputs</th><td>{_e(report.signature or '-')}</td></tr>",
        f"<tr><th>device</th><td>{_e(report.device or '-')}</td></tr>",
        f"<tr><th>plugins</th><td>{_e(', '.join(report.plugins) or 'none')}</td></tr>",
        f"<tr><th>compile time</th><td>{report.compile_s:.2f} s"
        + (" (" + ", ".join(f"{_e(k)} {v:.2f} s" for k, v in report.phases.items()) + ")" if report.phases else "")
        + "</td></tr>",
        f'<tr><th>groups</th><td id="summary">{len(fused)} fused, {len(skipped)} skipped; predicted traffic '
        f"saved {format_bytes(saved)}</td></tr>",
        "</table>",
    ]
    if report.notes:
        out.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in report.notes) + "</ul>")

    out.append(f'<h2 id="graph">Graph ({len(report.graph)} nodes)</h2>')
    if report.graph:
        legend = " ".join(
            f'<span class="swatch" style="background:{c}"></span> <a href="#group-{k}">#{k} '
            f"{_e(report.groups[k].strategy)}</a>"
            for k, c in colours.items()
        )
        out.append(
            f"<p>Each fused group has its colour; grey nodes run eager, white ones are inputs, parameters "
            f"and the output. Hover a node for its op, shape and group.</p><p>{legend}</p>"
        )
        out.append(f'<div class="graph">{render_svg(report)}</div>')
    else:
        out.append("<p>No graph was recorded (the model could not be traced).</p>")

    out.append('<h2 id="groups">Fusion groups</h2>')
    if report.groups:
        out.append(
            "<table><tr><th>group</th><th>strategy</th><th>fate</th><th>reason</th><th>ops / nodes</th>"
            "<th>bytes before -> after (predicted)</th><th>eager / fused ms</th><th>max error</th>"
            "<th>kernel</th></tr>"
        )
        out += _group_rows(report, colours)
        out.append("</table>")
    else:
        out.append("<p>No fusion candidates.</p>")

    out.append(f'<h2 id="skipped">Skipped candidates ({len(skipped)})</h2>')
    if skipped:
        out.append("<ul>")
        for k, g in enumerate(report.groups):
            if not g.fused:
                out.append(
                    f'<li><a href="#group-{k}">#{k}</a> {_e(g.strategy)} over {_e(", ".join(g.nodes))}: '
                    f"<b>{_e(g.reason_code)}</b>{': ' + _e(g.reason) if g.reason else ''}</li>"
                )
        out.append("</ul>")
    else:
        out.append("<p>None.</p>")

    out.append(f'<h2 id="eager">Nodes left eager ({len(report.unfused_nodes)})</h2>')
    if report.unfused_nodes:
        out.append("<table><tr><th>node</th><th>op</th><th>reason</th></tr>")
        out += [
            f"<tr><td>{_e(n.node)}</td><td>{_e(n.target)}</td><td><b>{_e(n.reason_code)}</b>: {_e(n.reason)}</td></tr>"
            for n in report.unfused_nodes
        ]
        out.append("</table>")
    if report.opaque:
        out.append('<h2 id="opaque">Opaque parts (run as they are)</h2><ul>')
        out += [f"<li>{_e(path or '<whole model>')}: {_e(reason)}</li>" for path, reason in report.opaque.items()]
        out.append("</ul>")

    out.append('<h2 id="kernels">Generated kernels</h2>')
    written = [(k, g) for k, g in enumerate(report.groups) if g.kernel_source]
    if not written:
        out.append("<p>No kernel was generated.</p>")
    for k, g in written:
        fate = "fused" if g.fused else f"not used: {g.reason_code}"
        out.append(
            f'<h3 id="kernel-{k}">#{k} {_e(g.strategy)}: <code>{_e(g.kernel or "")}</code> ({_e(fate)})</h3>'
            f'<pre class="kernel-source">{_e(g.kernel_source)}</pre>'
        )
    out.append("</body></html>")
    return "\n".join(out)
