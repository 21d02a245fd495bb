"""``FusionReport``: what was fused, what wasn't, and why - as data.

A report is a pydantic model (``report.to_json()`` round-trips through
``FusionReport.model_validate_json``), ``str(report)`` is a readable table and
``report.to_html(path)`` one self-contained page (``report_html.py``): the
graph coloured by group, every skipped candidate with its reason, each
group's kernel source and the timings that were measured.
"""

from __future__ import annotations

import linecache
import os
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .quantize import QuantizedLayer
from .report_html import (
    alternatives,
    eager_lines,
    format_bytes,
    group_origin,
    group_sentence,
    render_html,
    summary_lines,
)

#: How many alternatives not taken the text report lists by name (the page lists all).
ALTERNATIVES_LISTED = 8


class GroupEntry(BaseModel):
    """One fusion candidate and its fate."""

    model_config = ConfigDict(extra="forbid")
    strategy: str
    nodes: list[str]
    ops: list[str]
    fused: bool
    reason_code: str
    reason: str = ""
    kernel: Optional[str] = None
    config: dict[str, int] = Field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    # Which graph the group is in: the forward, or a backward graph (gradients).
    phase: Literal["forward", "backward"] = "forward"
    # What the two times measure: the group's forward, or (with gradients on) its forward
    # and its backward as one step.
    timed: Literal["forward", "forward+backward"] = "forward"
    # Whether both sides were timed captured as one CUDA graph each and replayed (the GPU's
    # time alone, as a step replayed as CUDA graphs runs), not launched op by op.
    timed_in_graph: bool = False
    time_eager_ms: Optional[float] = None
    time_fused_ms: Optional[float] = None
    max_error: Optional[float] = None
    # Whether an output missed eager's by more than the tolerance and was kept because it is
    # as close to the group's ops run in float64 as eager's own (docs/verification.md).
    float64_judged: bool = False
    tuning_s: float = 0.0
    cache_hit: bool = False
    kernel_source: Optional[str] = None  # the generated Triton source, where one was written
    # With dynamic dims (docs/dynamic.md): the sizes the kernel takes at run time, by
    # parameter name, and the size buckets of the dynamic dims it was tuned for; or why the kernel stays
    # specialised on the shape; and whether an earlier shape of the class checked it on
    # synthetic inputs (this one on its real inputs only).
    run_time_sizes: dict[str, int] = Field(default_factory=dict)
    size_buckets: list[int] = Field(default_factory=list)
    specialised: Optional[str] = None
    class_checked: bool = False
    # With gradients on (a forward group): the nodes whose results its kernel writes for its
    # backward, which reads them instead of computing them again (products' results), and
    # their bytes held from forward to backward; and its products whose results it could not
    # store (its strategy writes no such output), which its backward computes again where it
    # needs them (docs/training.md, "What a backward saves").
    saved_for_backward: list[str] = Field(default_factory=list)
    saved_bytes: int = 0
    products_recomputed: list[str] = Field(default_factory=list)


class GraphNode(BaseModel):
    """One node of the graph that was planned (after plugins' graph passes)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    op: str  # placeholder, get_attr, call_function, call_method, call_module, output
    target: str
    inputs: list[str] = Field(default_factory=list)
    shape: Optional[list[int]] = None
    dtype: Optional[str] = None
    # Where it came from: the submodule whose forward made it ("" the model's own), and the
    # line of the user's code ("model.py:42 in forward: h = self.lin(x)"), where known.
    module: Optional[str] = None
    source: Optional[str] = None
    # Whether its result re-reads an input's memory (a view), so it moves no data.
    free: bool = False


class NodeEntry(BaseModel):
    """A node that no group covers, and why."""

    model_config = ConfigDict(extra="forbid")
    node: str
    target: str
    reason_code: str
    reason: str
    phase: Literal["forward", "backward"] = "forward"  # as GroupEntry's
    # Its result re-read an input's memory (a view) when the graph ran: no data moved.
    free: bool = False


class FusionReport(BaseModel):
    """Everything one compiled signature decided."""

    model_config = ConfigDict(extra="forbid")
    signature: str = ""
    device: str = ""
    plugins: list[str] = Field(default_factory=list)
    groups: list[GroupEntry] = Field(default_factory=list)
    unfused_nodes: list[NodeEntry] = Field(default_factory=list)
    opaque: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    compile_s: float = 0.0
    graph: list[GraphNode] = Field(default_factory=list)
    # Seconds spent in each step of the compile (capture, plan, generate, verify -
    # tuning included -, rewrite, cuda_graph, forward_check), in order.
    phases: dict[str, float] = Field(default_factory=dict)
    # The "backward" phase split up: the same steps summed over every backward graph built,
    # with "trace" (tracing, partitioning and checking each graph against eager's backward).
    backward_phases: dict[str, float] = Field(default_factory=dict)
    quantized: list[QuantizedLayer] = Field(default_factory=list)
    # The model's class name (a torch.compile graph: "graph N of <function>").
    model: str = ""
    # The whole forward (or, with gradients on, training step: ``whole``) timed as the user
    # calls it, fused against the original model, where it was timed (on a GPU).
    whole: Literal["forward", "training step"] = "forward"
    whole_eager_ms: Optional[float] = None
    whole_fused_ms: Optional[float] = None
    # Whether the calls of this signature run the original model (fusing lost, or failed).
    runs_original: bool = False
    # The dynamic dims of this signature's shape class ("x dim 1 (size 37, bucket 64)"):
    # empty where it is specialised on its shapes (docs/dynamic.md).
    dynamic_dims: list[str] = Field(default_factory=list)

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    @property
    def fused(self) -> list[GroupEntry]:
        return [g for g in self.groups if g.fused]

    @property
    def skipped(self) -> list[GroupEntry]:
        return [g for g in self.groups if not g.fused]

    def to_json(self, **kwargs) -> str:
        return self.model_dump_json(indent=kwargs.pop("indent", 1), **kwargs)

    def to_html(self, path: Union[str, Path, None] = None, title: str = "") -> str:
        """One self-contained HTML page (no external assets) of this report;
        written to ``path`` when given. Returns the page."""
        page = render_html(self, title)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def __str__(self) -> str:
        """The report in the order a user reads it: a summary (what was fused, the measured
        result, where the time goes), the fused groups, what stayed eager and why, then the
        alternatives the planner weighed and did not take."""
        what = self.model or "the model"
        lines = [f"AutoFuser report: {what}, inputs {self.signature or '?'} on {self.device or '?'}"]
        lines += [f"  {line}" for line in summary_lines(self)]
        order = {node.name: i for i, node in enumerate(self.graph)}
        fused = sorted(
            ((k, g) for k, g in enumerate(self.groups) if g.fused),
            key=lambda kg: (kg[1].phase != "forward", min((order.get(n, 0) for n in kg[1].nodes), default=0)),
        )
        if fused:
            lines += ["", f"Fused ({len(fused)} kernel{'s' if len(fused) != 1 else ''}):"]
            for k, g in fused:
                lines += _group_lines(self, k, g)
        others = set(alternatives(self))
        refused = [(k, g) for k, g in enumerate(self.groups) if not g.fused and k not in others]
        eager = eager_lines(self)
        if refused or eager or self.opaque:
            lines += ["", "Stayed eager:"]
            for k, g in refused:
                lines += _group_lines(self, k, g)
            lines += [f"  {line}" for line in eager]
            for path, reason in self.opaque.items():
                lines.append(f"  {path or '<whole model>'}: could not be traced, runs as it is: {reason}")
        if others:
            codes = sorted({self.groups[k].reason_code for k in others})
            lines += [
                "",
                f"Alternatives not taken: {len(others)} other grouping(s) of ops, each losing to a group above "
                f"({', '.join(codes)}):",
            ]
            for k in sorted(others)[:ALTERNATIVES_LISTED]:
                g = self.groups[k]
                lines.append(f"  #{k} {_strategy(g)}: {' > '.join(g.ops)}: {g.reason or g.reason_code}")
            if len(others) > ALTERNATIVES_LISTED:
                lines.append(f"  ... and {len(others) - ALTERNATIVES_LISTED} more (report.skipped lists them all)")
        if self.quantized:
            before = sum(q.bytes_before for q in self.quantized)
            after = sum(q.bytes_after for q in self.quantized)
            lines.append("")
            lines.append(
                f"Quantised weights: {len(self.quantized)} layer(s), {format_bytes(before)} -> {format_bytes(after)}"
            )
            for q in self.quantized:
                lines.append(
                    f"  {q.name} {q.shape}: {q.format}, {format_bytes(q.bytes_before)} -> {format_bytes(q.bytes_after)}"
                )
        if self.notes:
            lines += ["", "Notes:"] + [f"  {note}" for note in self.notes]
        lines.append("")
        lines.append(f"plugins: {', '.join(self.plugins) or 'none'}")
        return "\n".join(lines)


def _strategy(group: GroupEntry) -> str:
    return group.strategy if group.phase == "forward" else f"{group.strategy} (backward)"


def _group_lines(report: FusionReport, k: int, g: GroupEntry) -> list[str]:
    """One group: its number, strategy and ops in full; what it does or why it stayed
    eager; where in the user's code it came from; traffic and times."""
    lines = [f"  #{k} {_strategy(g)}: {' > '.join(g.ops)}  (nodes {', '.join(g.nodes)})"]
    lines.append(f"      {group_sentence(g)}")
    for place in group_origin(report, g)[:3]:
        lines.append(f"      from {place}")
    facts = []
    if g.fused:
        facts.append(f"memory traffic {format_bytes(g.bytes_before)} -> {format_bytes(g.bytes_after)} (predicted)")
    if g.time_eager_ms is not None and g.time_fused_ms is not None:
        both = " forward and backward (f+b)" if g.timed == "forward+backward" else ""
        both += ", each as one CUDA graph" if g.timed_in_graph else ""
        facts.append(f"{g.time_fused_ms:.3f} ms fused vs {g.time_eager_ms:.3f} ms eager{both}")
    if g.kernel:
        facts.append(f"kernel {g.kernel}" + (" (tuned config from the cache)" if g.cache_hit else ""))
    if g.saved_for_backward:
        facts.append(
            f"saves {len(g.saved_for_backward)} value(s) for backward ({', '.join(g.saved_for_backward)}, "
            f"{format_bytes(g.saved_bytes)})"
        )
    if g.products_recomputed:
        facts.append(f"backward computes {', '.join(g.products_recomputed)} again")
    if facts:
        lines.append(f"      {'; '.join(facts)}")
    return lines


def describe_graph(gm) -> list[GraphNode]:
    """The nodes of an fx ``GraphModule`` as report data."""
    from .capture import FREE_KEY, SOURCE_KEY
    from .registry import describe_target

    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            target = f"{node.target} ({type(gm.get_submodule(node.target)).__name__})"
        elif node.op in ("call_function", "call_method"):
            target = describe_target(node.target)
        else:
            target = str(node.target)
        meta = node.meta.get("tensor_meta")
        shape = list(meta.shape) if hasattr(meta, "shape") else None
        stack = node.meta.get("nn_module_stack")
        module = None
        if isinstance(stack, dict) and stack:
            module = next(reversed(stack.values()))[0]
        elif node.op.startswith("call_"):
            module = ""  # made by the model's own forward
        source = None
        where = node.meta.get(SOURCE_KEY)
        if where is not None:
            file, line, function = where
            code = linecache.getline(file, line).strip()
            source = f"{os.path.basename(file)}:{line} in {function}" + (f": {code}" if code else "")
        dtype = str(meta.dtype).removeprefix("torch.") if hasattr(meta, "dtype") else None
        nodes.append(
            GraphNode(
                name=node.name,
                op=node.op,
                target=target,
                inputs=[n.name for n in node.all_input_nodes],
                shape=shape,
                dtype=dtype,
                module=module,
                source=source,
                free=node.op != "call_module" and bool(node.meta.get(FREE_KEY, False)),
            )
        )
    return nodes
