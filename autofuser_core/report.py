"""``FusionReport``: what was fused, what wasn't, and why - as data.

A report is a pydantic model (``report.to_json()`` round-trips through
``FusionReport.model_validate_json``), ``str(report)`` is a readable table and
``report.to_html(path)`` one self-contained page (``report_html.py``): the
graph coloured by group, every skipped candidate with its reason, each
group's kernel source and the timings that were measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .quantize import QuantizedLayer
from .report_html import format_bytes, render_html


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
    time_eager_ms: Optional[float] = None
    time_fused_ms: Optional[float] = None
    max_error: Optional[float] = None
    tuning_s: float = 0.0
    cache_hit: bool = False
    kernel_source: Optional[str] = None  # the generated Triton source, where one was written


class GraphNode(BaseModel):
    """One node of the graph that was planned (after plugins' graph passes)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    op: str  # placeholder, get_attr, call_function, call_method, call_module, output
    target: str
    inputs: list[str] = Field(default_factory=list)
    shape: Optional[list[int]] = None
    dtype: Optional[str] = None


class NodeEntry(BaseModel):
    """A node that no group covers, and why."""

    model_config = ConfigDict(extra="forbid")
    node: str
    target: str
    reason_code: str
    reason: str
    phase: Literal["forward", "backward"] = "forward"  # as GroupEntry's


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
    quantized: list[QuantizedLayer] = Field(default_factory=list)

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
        lines = [f"AutoFuser report - {self.signature or 'no signature'} on {self.device or '?'}"]
        lines.append(f"plugins: {', '.join(self.plugins) or 'none'}; compile {self.compile_s:.2f} s")
        if self.phases:
            lines.append("compile steps: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items()))
        fused = self.fused
        saved = sum(g.bytes_before - g.bytes_after for g in fused)
        lines.append(
            f"{len(fused)} fused group(s), {len(self.skipped)} skipped; predicted traffic saved {format_bytes(saved)}"
        )
        if self.groups:
            lines.append("")
            lines.append(f"{'':2}{'strategy':<20}{'ops':<44}{'bytes before->after':<24}{'eager/fused ms':<18}reason")
            for g in self.groups:
                mark = "+" if g.fused else "-"
                ops = " > ".join(g.ops)
                if len(ops) > 42:
                    ops = ops[:39] + "..."
                times = (
                    f"{g.time_eager_ms:.3f}/{g.time_fused_ms:.3f}"
                    if g.time_eager_ms is not None and g.time_fused_ms is not None
                    else "-"
                )
                if g.timed == "forward+backward" and times != "-":
                    times += " f+b"
                traffic = f"{format_bytes(g.bytes_before)} -> {format_bytes(g.bytes_after)}"
                strategy = g.strategy if g.phase == "forward" else f"{g.strategy} (bwd)"
                why = g.reason_code + (f": {g.reason}" if g.reason else "")
                if g.cache_hit:
                    why += " (cache hit)"
                lines.append(f"{mark:2}{strategy:<20}{ops:<44}{traffic:<24}{times:<18}{why}")
        if self.unfused_nodes:
            lines.append("")
            lines.append("left eager:")
            by_reason: dict[tuple[str, str, str], int] = {}
            for n in self.unfused_nodes:
                key = (n.target, n.reason_code, n.reason)
                by_reason[key] = by_reason.get(key, 0) + 1
            for (target, code, reason), count in by_reason.items():
                times = f" x{count}" if count > 1 else ""
                lines.append(f"  {target}{times}: {code}: {reason}")
        if self.opaque:
            lines.append("")
            lines.append("opaque parts (could not be traced, run as they are):")
            for path, reason in self.opaque.items():
                lines.append(f"  {path or '<whole model>'}: {reason}")
        if self.quantized:
            before = sum(q.bytes_before for q in self.quantized)
            after = sum(q.bytes_after for q in self.quantized)
            lines.append("")
            lines.append(
                f"quantised weights: {len(self.quantized)} layer(s), {format_bytes(before)} -> {format_bytes(after)}"
            )
            for q in self.quantized:
                lines.append(
                    f"  {q.name} {q.shape}: {q.format}, {format_bytes(q.bytes_before)} -> {format_bytes(q.bytes_after)}"
                )
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def describe_graph(gm) -> list[GraphNode]:
    """The nodes of an fx ``GraphModule`` as report data."""
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
        dtype = str(meta.dtype).removeprefix("torch.") if hasattr(meta, "dtype") else None
        nodes.append(
            GraphNode(
                name=node.name,
                op=node.op,
                target=target,
                inputs=[n.name for n in node.all_input_nodes],
                shape=shape,
                dtype=dtype,
            )
        )
    return nodes
