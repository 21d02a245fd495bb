"""``FusionReport.to_html``: one self-contained page to look at.

No external assets, no script: inline CSS and an inline SVG drawing of the
graph, so the file can be mailed, attached to an issue or opened offline.
The markup is in the jinja2 templates ``templates/report.html.j2`` (the page)
and ``templates/graph.svg.j2`` (the graph), autoescaped; this module works out
what goes in them (the wording, the layout's geometry).

Sections, in the order a user reads them: the measured result and a summary;
the graph, laid out in layers (``layout``) with each fused group a cluster of its
nodes in the group's colour (grey: run as in eager, dashed: free views); the
fused groups with what each does, the line of the user's code it came from,
traffic and timings; what stayed eager and why, opaque parts included; the
alternatives the planner did not take; the generated kernel sources, collapsed.

The wording both renderings share (the summary, what stayed eager, readable op
names) lives here too. report.py imports this module (``to_html`` calls
``render_html``, its text uses the shared wording); this module never imports report.py
when it runs: it only reads the report it is given, and names its type for the
type checker alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional

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
CLUSTER_HEAD, CLUSTER_PAD, INNER_GAP_Y, DUMMY_W = 24, 10, 14, 8  # a cluster's title row and padding

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
td.what { min-width: 260px; max-width: 420px; }
.summary { background: #eef6ee; border: 1px solid #9c9; padding: 4px 14px; }
.headline { font-size: 18px; font-weight: 600; }
details { margin: 6px 0; } summary { cursor: pointer; }
"""


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
    ("_operator.", "operator."),
    ("builtins.", ""),
)

#: Reason codes of candidates that lost to another grouping of the same ops, not to eager.
ALTERNATIVE_CODES = frozenset({"overlap", "split_faster", "larger_group_faster"})


def readable_target(target: str) -> str:
    """An op as a user writes it: ``torch.view_as_real``, not where torch keeps it."""
    if target.startswith("torch._ops.aten.aten::"):  # an ATen op of a backward graph
        return "torch.ops.aten." + target[len("torch._ops.aten.aten::") :]
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
    if group.saved_for_backward:
        return (
            f"{n} ops in one kernel: the values between them stay on chip, but for "
            f"{', '.join(group.saved_for_backward)}, written for backward"
        )
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


class Coverage(NamedTuple):
    """The forward graph's call nodes by what runs them (``coverage``)."""

    fused: int  # in fused groups
    library: int  # left to a library call on purpose (``library_calls``)
    eager: int  # real work run as in eager, for no such reason
    views: int  # free views: no data moved, counted as neither

    @property
    def compute(self) -> int:
        return self.fused + self.library + self.eager

    def share(self, count: int) -> float:
        """``count`` as a share (0-100) of the compute nodes."""
        return 100.0 * count / self.compute if self.compute else 100.0


def _library_code(code: str) -> bool:
    """A candidate's reason code saying the library's call was measured (or is known) faster:
    ``slower`` (the fused kernel lost to eager when timed) and a strategy's ``*_faster``
    refusal (the conv plugin's ``cudnn_faster``); splits and regroupings are no such verdict."""
    return code == "slower" or (code.endswith("_faster") and code not in ALTERNATIVE_CODES)


#: A lowering's refusal saying its op already runs as a plugin's own kernels, outside groups.
OWN_KERNELS_CODE = "own_kernels"


def library_calls(report: "FusionReport") -> dict[str, str]:
    """The forward's nodes no fused group covers that are left to a library call on
    purpose, each with why: complex-valued ones (an FFT, a complex product: kernels
    read real tensors, the library computes these), those whose group was refused
    because the library's call was measured (or is known) faster, and calls a plugin
    runs as its own kernels (its lowering refuses with ``own_kernels``)."""
    covered = {name for g in report.fused if g.phase == "forward" for name in g.nodes}
    nodes = {n.name: n for n in report.graph}
    out: dict[str, str] = {}
    for entry in report.unfused_nodes:
        if entry.phase == "forward" and entry.reason_code == OWN_KERNELS_CODE and entry.node not in covered:
            out[entry.node] = "the plugin's own kernels"
    for group in report.groups:
        if group.phase == "forward" and not group.fused and _library_code(group.reason_code):
            for name in group.nodes:
                if name not in covered:
                    out.setdefault(name, f"the library's call is faster [{group.reason_code}]")
    for node in report.graph:
        if not node.op.startswith("call_") or node.name in covered or node.name in out or node.free:
            continue
        dtypes = [node.dtype, *(nodes[i].dtype for i in node.inputs if i in nodes)]
        if any(d is not None and d.startswith("complex") for d in dtypes):
            out[node.name] = "complex-valued: the library's kernel (kernels read real tensors)"
    return out


def coverage(report: "FusionReport") -> Coverage:
    """The forward graph's call nodes as ``Coverage(fused, library, eager, views)``: in
    fused groups, left to a library call on purpose (``library_calls``), other work run as
    in eager, and free views, which move no data and count as none of the others (an
    opaque part counts as one op run as in eager, whatever it holds)."""
    free = free_nodes(report)
    covered = {name for g in report.fused if g.phase == "forward" for name in g.nodes}
    calls = [n.name for n in report.graph if n.op.startswith("call_")] or [
        n.node for n in report.unfused_nodes if n.phase == "forward"
    ]
    library = library_calls(report)
    views = sum(1 for name in calls if name in free and name not in covered)
    on_purpose = sum(1 for name in calls if name not in free and name not in covered and name in library)
    costly = sum(1 for name in calls if name not in free and name not in covered and name not in library)
    return Coverage(len(covered), on_purpose, costly, views)


def dynamic_lines(report: "FusionReport") -> list[str]:
    """The summary's word on dynamic dims (docs/dynamic.md): which, which kernels take
    sizes at run time (and the size buckets that key their tuning), which stay specialised
    and why, and which were checked for an earlier shape of the class."""
    if not report.dynamic_dims:
        return []
    fused = report.fused
    run_time = [g for g in fused if g.run_time_sizes]
    buckets = sorted({b for g in run_time for b in g.size_buckets})
    keyed = f"; tuning keyed by size bucket(s) {', '.join(map(str, buckets))}" if buckets else ""
    lines = [
        f"Dynamic dims: {'; '.join(report.dynamic_dims)}.",
        f"{len(run_time)} of {len(fused)} fused kernel(s) take their sizes at run time (one source for every "
        f"size of the class){keyed}.",
    ]
    specialised = sorted({g.strategy for g in fused if g.specialised})
    if specialised:
        # A strategy that takes run-time sizes may still write one form of its groups per shape
        # (``literal_sizes``); each entry's ``specialised`` says why.
        lines.append(
            f"Specialised on each shape (their strategies, or these forms of their groups, don't take "
            f"run-time sizes): {', '.join(specialised)}."
        )
    checked = sum(g.class_checked for g in fused)
    if checked:
        lines.append(f"{checked} kernel(s) checked on synthetic inputs for an earlier shape of this class.")
    return lines


def summary_lines(report: "FusionReport") -> list[str]:
    """The few sentences a user reads first: what was fused, the measured result, where
    the time goes, what the compile cost."""
    fused = [g for g in report.fused if g.phase == "forward"]
    backward = len(report.fused) - len(fused)
    counts = coverage(report)
    in_groups, library, costly, views = counts
    share = ""
    if counts.compute:
        share = f" ({counts.share(in_groups):.0f}% of the compute ops"
        if library:
            share += f", {counts.share(in_groups + library):.0f}% with the library calls left on purpose"
        share += ")"
    lines = [
        f"{len(fused)} fused kernel{'s run' if len(fused) != 1 else ' runs'} "
        f"{in_groups} op{'s' if in_groups != 1 else ''}{share}; "
        + (
            f"{library} {'are library calls' if library != 1 else 'is a library call'} left on purpose "
            "(complex-valued, or the library measured faster); "
            if library
            else ""
        )
        + f"{costly} op{'s run' if costly != 1 else ' runs'} as in eager"
        + (f", {views} more {'are free views' if views > 1 else 'is a free view'} (no data moved)" if views else "")
        + (f"; {len(report.opaque)} part(s) could not be traced" if report.opaque else "")
        + (f"; in backward, {backward} more fused kernel{'s' if backward != 1 else ''}" if backward else "")
        + "."
    ]
    what = report.whole
    if report.whole_eager_ms is not None and report.whole_fused_ms is not None:
        eager_ms, fused_ms = report.whole_eager_ms, report.whole_fused_ms
        verdict = (
            "not clearly faster: the original model runs"
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
    lines += dynamic_lines(report)
    saving = [g for g in fused if g.saved_for_backward]
    recomputing = [g for g in fused if g.products_recomputed]
    if saving or recomputing:
        values = sum(len(g.saved_for_backward) for g in saving)
        lines.append(
            f"For backward: {len(saving)} fused group(s) save {values} product result(s), "
            f"{format_bytes(sum(g.saved_bytes for g in saving))} held until backward"
            + (
                f"; {len(recomputing)} group(s) compute "
                f"{sum(len(g.products_recomputed) for g in recomputing)} product(s) again in backward"
                if recomputing
                else ""
            )
            + "."
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
    reason with its count (a line of the user's code where all its nodes share one); a
    library call left on purpose says so first."""
    free = free_nodes(report)
    library = library_calls(report)
    views: dict[str, int] = {}
    by_reason: dict[tuple[str, str, str], list[str]] = {}
    for n in report.unfused_nodes:
        target = readable_target(n.target)
        if n.free or (n.phase == "forward" and n.node in free):
            views[target] = views.get(target, 0) + 1
            continue
        if n.phase == "backward":
            target = f"in backward, {target}"
        elif n.node in library:
            target = f"library call on purpose ({library[n.node]}): {target}"
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
    """Group index -> fill colour, for the fused groups of the forward graph (the one drawn)."""
    colours: dict[int, str] = {}
    for k, group in enumerate(report.groups):
        if group.fused and group.phase == "forward":
            colours[k] = PALETTE[len(colours) % len(PALETTE)]
    return colours


@dataclass
class _Box:
    """One box of the layered layout: a node, a fused group drawn as a cluster of its
    nodes, or a bend point of an edge that spans layers (``dummy``)."""

    key: str
    width: float
    height: float
    layer: int = 0
    x: float = 0.0
    y: float = 0.0
    dummy: bool = False
    inner: dict[str, tuple[float, float]] = field(default_factory=dict)  # a cluster's nodes: offsets


def _inner_layout(
    names: list[str], inputs: dict[str, list[str]]
) -> tuple[dict[str, tuple[float, float]], float, float]:
    """A cluster's own nodes in layers (each one below its deepest input inside the group):
    offsets from the cluster's corner, and the cluster's size."""
    depth: dict[str, int] = {}
    for name in names:  # graph order is topological
        depth[name] = 1 + max((depth[i] for i in inputs[name] if i in depth), default=-1)
    rows: dict[int, list[str]] = defaultdict(list)
    for name in names:
        rows[depth[name]].append(name)
    columns = max(len(r) for r in rows.values())
    width = columns * NODE_W + (columns - 1) * GAP_X + 2 * CLUSTER_PAD
    offsets: dict[str, tuple[float, float]] = {}
    for layer, row in rows.items():
        left = (width - (len(row) * NODE_W + (len(row) - 1) * GAP_X)) / 2
        for column, name in enumerate(row):
            offsets[name] = (left + column * (NODE_W + GAP_X), CLUSTER_HEAD + layer * (NODE_H + INNER_GAP_Y))
    height = CLUSTER_HEAD + len(rows) * (NODE_H + INNER_GAP_Y) - INNER_GAP_Y + CLUSTER_PAD
    return offsets, float(width), float(height)


def layout(report: "FusionReport") -> tuple[dict[str, _Box], list[list[str]], dict[str, str]]:
    """A layered drawing of the graph (Sugiyama's steps, kept small): each fused group
    contracted to one cluster box; boxes put in layers by longest path; an edge spanning
    layers bent through a dummy box in each layer between, so it runs between boxes,
    never through one; the order within a layer by barycentre sweeps (fewer crossings);
    each box then placed under the middle of its inputs where there is room.

    Returns the boxes by key, each edge as the keys of the boxes it passes, and the
    cluster key of every node drawn inside a cluster."""
    colours = _group_colours(report)
    in_graph = {node.name for node in report.graph}
    box_of: dict[str, str] = {}
    members: dict[str, list[str]] = defaultdict(list)
    for k in colours:
        if all(name in in_graph for name in report.groups[k].nodes):
            for name in report.groups[k].nodes:
                box_of[name] = f"group-{k}"
    inputs = {node.name: [i for i in node.inputs if i in in_graph] for node in report.graph}
    order: list[str] = []
    position: dict[str, int] = {}
    for node in report.graph:
        key = box_of.get(node.name, node.name)
        members[key].append(node.name)
        if key not in position:
            position[key] = len(order)
            order.append(key)
    boxes: dict[str, _Box] = {}
    for key in order:
        if key.startswith("group-") and key not in in_graph:
            offsets, width, height = _inner_layout(members[key], inputs)
            boxes[key] = _Box(key, width, height, inner=offsets)
        else:
            boxes[key] = _Box(key, NODE_W, NODE_H)
    edges: set[tuple[str, str]] = set()
    for node in report.graph:
        for source in inputs[node.name]:
            a, b = box_of.get(source, source), box_of.get(node.name, node.name)
            if a != b:
                edges.add((a, b))
    # The contracted graph is acyclic (the planner keeps no group that makes a cycle), so
    # the order of first appearance lets each box come after all of its inputs once
    # settled by longest path: relax in rounds until nothing moves.
    preds: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(edges, key=lambda e: (position[e[0]], position[e[1]])):
        preds[b].append(a)
    for _ in range(len(order)):
        moved = False
        for key in order:
            layer = 1 + max((boxes[p].layer for p in preds[key]), default=-1)
            if layer != boxes[key].layer:
                boxes[key].layer, moved = layer, True
        if not moved:
            break
    paths: list[list[str]] = []
    for a, b in sorted(edges, key=lambda e: (position[e[0]], position[e[1]])):
        path = [a]
        for layer in range(boxes[a].layer + 1, boxes[b].layer):
            dummy = f"~{a}>{b}@{layer}"
            boxes[dummy] = _Box(dummy, DUMMY_W, NODE_H, layer=layer, dummy=True)
            path.append(dummy)
        paths.append(path + [b])
    up: dict[str, list[str]] = defaultdict(list)
    down: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        for a, b in zip(path, path[1:]):
            up[b].append(a)
            down[a].append(b)
    layers: dict[int, list[str]] = defaultdict(list)
    for key, box in boxes.items():
        layers[box.layer].append(key)
    rank = {key: i for i, key in enumerate(boxes)}
    for sweep in range(4):
        neighbours = up if sweep % 2 == 0 else down
        for layer in sorted(layers, reverse=sweep % 2 == 1):
            row = layers[layer]
            centre: dict[str, float] = {}
            for key in row:
                near = [rank[n] for n in neighbours[key]]
                centre[key] = sum(near) / len(near) if near else rank[key]
            row.sort(key=lambda key: centre[key])
            for i, key in enumerate(row):
                rank[key] = i
    top: float = MARGIN
    for layer in sorted(layers):
        row = layers[layer]
        # Each box under the middle of what feeds it, then pushed right just enough to keep
        # its neighbours' gap.
        right: float = MARGIN - GAP_X
        for key in row:
            box = boxes[key]
            feeding = [boxes[n].x + boxes[n].width / 2 for n in up[key]]
            wanted = (sum(feeding) / len(feeding) - box.width / 2) if feeding else MARGIN
            box.x = max(wanted, right + GAP_X)
            right = box.x + box.width
        box_height = max(boxes[key].height for key in row)
        for key in row:
            boxes[key].y = top + (box_height - boxes[key].height) / 2 if boxes[key].dummy else top
        top += box_height + GAP_Y
    shift = MARGIN - min((box.x for box in boxes.values()), default=MARGIN)
    for box in boxes.values():
        box.x += shift
    return boxes, paths, box_of


def render_svg(report: "FusionReport") -> str:
    """The graph as an inline SVG: fused groups as clusters of their nodes, filled in the
    group's colour; nodes left eager grey; inputs, parameters and the output white."""
    colours = _group_colours(report)
    boxes, paths, box_of = layout(report)
    clusters = []
    for key, box in boxes.items():
        if key.startswith("group-") and box.inner:
            index = int(key.removeprefix("group-"))
            group = report.groups[index]
            clusters.append(
                dict(
                    index=index,
                    strategy=group.strategy,
                    ops=group.ops,
                    colour=colours[index],
                    x=box.x,
                    y=box.y,
                    width=box.width,
                    height=box.height,
                )
            )
    edges = []
    for path in paths:
        points = []
        for i, key in enumerate(path):
            box = boxes[key]
            centre = box.x + box.width / 2
            if box.dummy:
                points += [(centre, box.y), (centre, box.y + box.height)]
            elif i == 0:
                points.append((centre, box.y + box.height))
            else:
                points.append((centre, box.y))
        d = f"M{points[0][0]:.1f},{points[0][1]:.1f}"
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            middle = (y0 + y1) / 2
            d += f" C{x0:.1f},{middle:.1f} {x1:.1f},{middle:.1f} {x1:.1f},{y1:.1f}"
        edges.append(d)
    by_name = {node.name: node for node in report.graph}
    inner_edges = []
    for key, box in boxes.items():
        inside = set(box.inner)
        for name in box.inner:
            x1, y1 = box.x + box.inner[name][0] + NODE_W / 2, box.y + box.inner[name][1]
            for source in by_name[name].inputs:
                if source in inside:
                    x0 = box.x + box.inner[source][0] + NODE_W / 2
                    inner_edges.append((x0, box.y + box.inner[source][1] + NODE_H, x1, y1))
    nodes = []
    for node in report.graph:
        cluster = box_of.get(node.name)
        k: Optional[int] = None
        if cluster is not None:
            box = boxes[cluster]
            x, y = box.x + box.inner[node.name][0], box.y + box.inner[node.name][1]
            k = int(cluster.removeprefix("group-"))
        else:
            x, y = boxes[node.name].x, boxes[node.name].y
        if k is not None:
            fill, css_class = colours[k], f"node group-{k}"
        else:
            fill = IO_FILL if node.op in ("placeholder", "output", "get_attr") else EAGER_FILL
            css_class = "node free" if node.free else "node eager"
        shape = f" {node.dtype}{node.shape}" if node.shape is not None else ""
        where = f"group #{k} ({report.groups[k].strategy})" if k is not None else "not in a fused group"
        if k is None and node.free:
            where = "a free view (no data moved)"
        origin = f"; {node.source}" if node.source else (f"; module {node.module}" if node.module else "")
        target = readable_target(node.target)
        if node.op == "call_module" or " " in target:
            label = target.split(" ")[0]  # "norm1 (LayerNorm)"
        else:
            label = target.rsplit(".", 1)[-1]
        nodes.append(
            dict(
                name=node.name,
                css_class=css_class,
                title=f"{node.name} = {node.op} {target}{shape}; {where}{origin}",
                x=x,
                y=y,
                fill=fill,
                stroke="#333" if k is not None else "#999",
                dashed=k is None and node.free,
                label=label,
            )
        )
    width = MARGIN + max((b.x + b.width for b in boxes.values()), default=0)
    height = MARGIN + max((b.y + b.height for b in boxes.values()), default=0)
    return _template("graph.svg.j2").render(
        width=width,
        height=height,
        clusters=clusters,
        edges=edges,
        inner_edges=inner_edges,
        nodes=nodes,
        node_w=NODE_W,
        node_h=NODE_H,
    )


def _headline(report: "FusionReport") -> str:
    """The measured result, in one line, or why there is none."""
    what = report.whole
    if report.whole_eager_ms is not None and report.whole_fused_ms is not None:
        eager_ms, fused_ms = report.whole_eager_ms, report.whole_fused_ms
        timed = f"{fused_ms:.3f} ms fused vs {eager_ms:.3f} ms eager per {what}"
        if report.runs_original:
            return f"The original model runs: not clearly faster fused ({timed})"
        return f"{_speedup(eager_ms, fused_ms)} eager's speed: {timed}"
    if report.runs_original:
        return "The original model runs for these inputs"
    return f"{len(report.fused)} fused kernel(s); {what} not timed" + (
        " (no GPU: kernels ran under Triton's CPU interpreter)" if "cuda" not in report.device else ""
    )


_environment = None


def _template(name: str):
    """A template of ``autofuser_core/templates`` (package data), autoescaped: every value
    put into a page is escaped unless marked safe, and the report carries the user's
    module, node and source-line names."""
    global _environment
    if _environment is None:
        import jinja2  # only for writing a page

        _environment = jinja2.Environment(
            loader=jinja2.PackageLoader("autofuser_core", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        _environment.filters.update(bytes=format_bytes, ms=_ms, f1=lambda v: f"{v:.1f}")
    return _environment.get_template(name)


def render_html(report: "FusionReport", title: str = "") -> str:
    """The page of ``report`` (``FusionReport.to_html``), headed ``title`` (default:
    "AutoFuser report"): the measured result and a summary first, the graph, the fused
    groups, what stayed eager and why, the alternatives not taken, the kernel sources
    (collapsed). Written from ``templates/report.html.j2``."""
    from markupsafe import Markup  # jinja2's own dependency

    others = alternatives(report)
    return _template("report.html.j2").render(
        report=report,
        heading=title or "AutoFuser report",
        css=Markup(CSS),
        headline=_headline(report),
        summary=summary_lines(report),
        colours=_group_colours(report),
        svg=Markup(render_svg(report)) if report.graph else "",
        fused=[(k, g) for k, g in enumerate(report.groups) if g.fused],
        refused=[(k, g) for k, g in enumerate(report.groups) if not g.fused and k not in others],
        others=others,
        origins={k: group_origin(report, g) for k, g in enumerate(report.groups)},
        sentence=group_sentence,
        eager=eager_lines(report),
        written=[(k, g) for k, g in enumerate(report.groups) if g.kernel_source],
    )
