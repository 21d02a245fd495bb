"""Tests of the text report (``str(FusionReport)``) and of ``FusedKernel``'s repr: a
summary first, then the fused groups, then what stayed eager and why in words, then the
alternatives the planner did not take; views reported as free, not as left eager."""

from __future__ import annotations

import torch

import autofuser
from autofuser_core.report import FusionReport, GraphNode, GroupEntry, NodeEntry
from autofuser_core.report_html import coverage, library_calls, readable_target


class NormGeluViews(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(19)

    def forward(self, x):
        b, n, c = x.shape
        h = torch.nn.functional.gelu(self.norm(x)) * 0.5 + 1.0
        return h.reshape(b, n * c), x.permute(2, 0, 1)


def _fused():
    torch.manual_seed(0)
    model = NormGeluViews().eval()
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction"], progress=False)
    x = torch.randn(1, 7, 19)
    with torch.no_grad():
        for got, want in zip(fused(x), model(x)):
            torch.testing.assert_close(got, want)
    return fused


def test_text_report_leads_with_the_summary_and_calls_views_free():
    fused = _fused()
    report = fused.report()
    assert report.fused, str(report)
    text = str(report)
    first, *_ = text.splitlines()
    assert first.startswith("AutoFuser report: NormGeluViews, inputs (float32[1, 7, 19]) on cpu")
    summary = text.index("fused kernel")
    assert summary < text.index("\nFused (") < text.index("\nStayed eager:")
    assert "not timed (no GPU" in text[: text.index("\nFused (")]
    # Both views re-read their input's memory: free, listed together, never as an op left eager.
    views = {n.name for n in report.graph if n.free}
    assert {"reshape", "permute"} <= views, report.graph
    eager_part = text[text.index("\nStayed eager:") :]
    assert "free views, no data moved" in eager_part and "Tensor.reshape" in eager_part
    assert "Tensor.permute" in eager_part
    assert "Tensor.reshape:" not in eager_part and "left eager" not in text
    # The share of compute ops in fused groups, views counted as neither.
    in_groups, library, eager, free = coverage(report)
    assert in_groups == sum(len(g.nodes) for g in report.fused) and free >= 2 and library == 0
    share = f"({100 * in_groups / (in_groups + eager):.0f}% of the compute ops)"
    assert share in text.splitlines()[1] and "library" not in text.splitlines()[1], text
    # The fused group says where in forward it came from, and its ops in full.
    group = report.fused[0]
    assert " > ".join(group.ops) in text
    assert "test_report.py:" in text and "in forward: h = torch.nn.functional.gelu(self.norm(x))" in text


def test_fused_kernel_repr_names_its_group_and_ops():
    fused = _fused()
    [kernel] = fused.kernels()
    text = repr(kernel)
    group = fused.report().fused[0]
    assert "object at 0x" not in text
    assert text.startswith(f"<FusedKernel {group.kernel} by {group.strategy}: ")
    assert " > ".join(group.ops) in text and ", ".join(group.nodes) in text


def test_measured_summary_and_alternatives_last():
    report = FusionReport(
        model="Solver",
        signature="(float32[4, 8])",
        device="cuda:0",
        whole_eager_ms=1.0,
        whole_fused_ms=0.4,
        graph=[
            GraphNode(name="x", op="placeholder", target="x"),
            GraphNode(name="add", op="call_function", target="_operator.add", inputs=["x"]),
            GraphNode(name="relu", op="call_function", target="torch.relu", inputs=["add"]),
            GraphNode(name="vr", op="call_function", target="torch._VariableFunctionsClass.view_as_real"),
        ],
        groups=[
            GroupEntry(
                strategy="elementwise",
                nodes=["add"],
                ops=["elementwise.add"],
                fused=False,
                reason_code="overlap",
                reason="overlaps a group that was already kept",
                bytes_before=110_000,
            ),
            GroupEntry(
                strategy="elementwise",
                nodes=["add", "relu"],
                ops=["elementwise.add", "elementwise.relu"],
                fused=True,
                reason_code="fused",
                kernel="af_flat_add_relu_0",
                bytes_before=200_000,
                bytes_after=100_000,
                time_eager_ms=0.3,
                time_fused_ms=0.1,
            ),
        ],
        unfused_nodes=[
            NodeEntry(
                node="vr",
                target="torch._VariableFunctionsClass.view_as_real",
                reason_code="no_lowering",
                reason="no loaded plugin can fuse this op",
            ),
            NodeEntry(
                node="relu",  # a name of the forward graph too: this one is a backward graph's
                target="torch.erf",
                reason_code="no_lowering",
                reason="no loaded plugin can fuse this op",
                phase="backward",
            ),
        ],
    )
    text = str(report)
    assert "Measured forward: 0.400 ms fused vs 1.000 ms eager, 2.50x eager's speed." in text
    assert "Where the time goes: fused kernels 0.100 ms" in text and "outside the fused kernels" in text
    assert "torch.view_as_real: no loaded plugin can fuse this op" in text and "_VariableFunctionsClass" not in text
    assert text.index("Measured forward") < text.index("\nFused (") < text.index("\nStayed eager:")
    assert text.index("\nStayed eager:") < text.index("\nAlternatives not taken: 1")
    assert "in backward, torch.erf: no loaded plugin" in text
    assert "-> 0 B" not in text  # a candidate not taken moves nothing: no traffic is shown for it


def test_internal_names_read_as_users_write_them():
    assert readable_target("torch._VariableFunctionsClass.view_as_real") == "torch.view_as_real"
    assert readable_target("torch._C._nn.gelu") == "torch.nn.functional.gelu"
    assert readable_target("_operator.getitem") == "operator.getitem"
    assert readable_target("Tensor.reshape") == "Tensor.reshape"
    assert readable_target("torch._ops.aten.aten::view") == "torch.ops.aten.view"


class NormedProjection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.norm = torch.nn.Linear(24, 40), torch.nn.LayerNorm(40)

    def forward(self, x):
        return self.norm(torch.nn.functional.gelu(self.proj(x)))


def test_views_of_a_backward_graph_are_free_too():
    """A backward graph's views (ATen's view, permute) move no data: listed as free, not
    as ops that stayed eager."""
    fused = autofuser.fuse(NormedProjection(), progress=False, tune=False, verify_speed=False)
    x = torch.randn(3, 37, 24, requires_grad=True)
    fused(x).square().sum().backward()
    report = fused.report()
    free = [n for n in report.unfused_nodes if n.phase == "backward" and n.free]
    assert free, str(report)
    text = str(report)
    assert "free views, no data moved" in text and "torch.ops.aten.view" in text, text
    assert "in backward, torch.ops.aten.view" not in text, text


class SpectralLayer(torch.nn.Module):
    """An FNO-style layer without the fft plugin: FFTs and a complex product between
    pointwise work and a product that fuse."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 5, 4, 3, 2) / 3)
        self.lift = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = self.lift(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        spectrum = torch.fft.rfft2(h)[:, :, :4, :3]
        mixed = torch.einsum("bixy,ioxy->boxy", spectrum, torch.view_as_complex(self.weight))
        return torch.nn.functional.gelu(torch.fft.irfft2(mixed, s=(4, 3)) * 0.5 + 1.0)


def test_coverage_counts_complex_library_calls_apart_from_work_left_eager():
    model = SpectralLayer()
    x = torch.randn(1, 3, 11, 7)
    with torch.no_grad():
        expected = model(x)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        torch.testing.assert_close(fused(x), expected, atol=1e-5, rtol=1e-5)
    report = fused.report()
    counts = coverage(report)
    library = library_calls(report)
    targets = {n.name: n.target for n in report.graph}
    # rfft2, the complex einsum and irfft2 (complex in or out); the slice of the spectrum and
    # the complex view of the real weights are views
    assert sorted(name for name in library) == ["einsum", "fft_irfft2", "fft_rfft2"], library
    assert all(any(op in targets[name] for op in ("rfft2", "einsum")) for name in library), targets
    assert all("complex-valued" in why for why in library.values())
    assert counts.library == 3 and counts.fused >= 3 and counts.eager == 0, counts
    first = str(report).splitlines()[1]
    assert f"{counts.share(counts.fused):.0f}% of the compute ops, 100% with the library calls" in first, first
    assert "3 are library calls left on purpose" in first and "0 ops run as in eager" in first, first
    assert "library call on purpose (complex-valued" in str(report)


class ChunkedProjection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Linear(6, 10)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)  # a tuple of views
        return torch.sigmoid(q) * k.contiguous()


def test_a_tuple_of_views_is_a_free_view_and_a_copy_is_work():
    model = ChunkedProjection()
    x = torch.randn(3, 7, 6)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    report = fused.report()
    free = {readable_target(n.target) for n in report.graph if n.free}
    assert any("chunk" in t for t in free), report.graph
    assert not any("contiguous" in t for t in free)  # a permuted or sliced tensor made contiguous is copied
