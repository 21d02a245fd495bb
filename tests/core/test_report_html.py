"""The HTML report: ``report.to_html(path)`` and ``autofuser report MODULE:FACTORY``.

The page is checked as text (self-contained, every part present) and rendered
in headless Chromium (skipped, with the reason, where Chromium is absent; CI
installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import autofuser
from autofuser.cli import main as cli_main
from autofuser_core.report import FusionReport, GroupEntry

CHROMIUM = next(
    (
        p
        for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
        if p and os.path.exists(p)
    ),
    None,
)

FACTORY = textwrap.dedent("""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(19)
            self.lin = torch.nn.Linear(19, 23)

        def forward(self, x):
            same = x.float()                      # a no-op on fp32, returned: its group is refused
            h = torch.nn.functional.gelu(self.lin(self.norm(x)))
            return h * 0.5 + 1.0, same

    def make():
        torch.manual_seed(0)
        return Block().eval(), torch.randn(3, 5, 19)
""")


def _fused_report():
    namespace: dict = {}
    exec(FACTORY, namespace)
    model, x = namespace["make"]()
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction", "matmul"], progress=False)
    with torch.no_grad():
        fused(x)
    return fused.report()


def test_page_is_self_contained_and_has_every_part(tmp_path):
    report = _fused_report()
    assert report.fused and report.skipped and report.graph
    path = tmp_path / "report.html"
    page = report.to_html(path, title="block")
    assert path.read_text() == page
    # No external assets: no scripts, stylesheets, images or fonts fetched from anywhere.
    assert not re.search(r"<(script|link|img|iframe)\b", page)
    assert not re.search(r"""(src|href)=["'](?!#)""", page)
    assert "@import" not in page and "url(http" not in page
    for node in report.graph:
        assert f'data-node="{node.name}"' in page
    for group in report.groups:
        assert group.reason_code in page
    skipped = report.skipped[0]
    assert skipped.reason and skipped.reason.split(";")[0].replace("'", "&#x27;") in page
    for group in report.fused:
        assert group.kernel_source and "@triton.jit" in group.kernel_source
        assert group.kernel in page
    assert page.count('class="kernel-source"') == sum(1 for g in report.groups if g.kernel_source)
    assert "not measured" in page  # on CPU nothing is timed, and the page says so


def test_timings_and_colours_where_measured():
    report = FusionReport(
        signature="(float32[4, 8])",
        device="cuda:0",
        groups=[
            GroupEntry(
                strategy="elementwise",
                nodes=["add", "relu"],
                ops=["elementwise.add", "elementwise.relu"],
                fused=True,
                reason_code="fused",
                kernel="af_flat_add_relu_0",
                kernel_source="@triton.jit\n...",
                time_eager_ms=0.0123,
                time_fused_ms=0.0071,
            ),
            GroupEntry(
                strategy="elementwise",
                nodes=["mul"],
                ops=["elementwise.mul"],
                fused=False,
                reason_code="slower",
                reason="fused 0.0100 ms vs eager 0.0090 ms: kept eager for speed",
                time_eager_ms=0.009,
                time_fused_ms=0.01,
            ),
        ],
    )
    report.add_phase("capture", 0.25)
    report.add_phase("verify", 1.5)
    page = report.to_html()
    assert "capture 0.25 s, verify 1.50 s" in page
    assert "0.0123 / 0.0071" in page and "0.0090 / 0.0100" in page
    assert "kept eager for speed" in page
    assert 'id="group-0"' in page and "background:#" in page


def test_cli_refuses_a_bad_factory_with_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit, match="MODULE:FACTORY"):
        cli_main(["report", "no_colon_here"])
    (tmp_path / "wrong.py").write_text("def make():\n    return 3\n")
    with pytest.raises(SystemExit, match=r"must return \(model, inputs\)"):
        cli_main(["report", f"{tmp_path / 'wrong.py'}:make", "--out", str(tmp_path / "x.html")])


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium); CI installs it")
def test_cli_page_renders_in_headless_chromium(tmp_path):
    (tmp_path / "block_factory.py").write_text(FACTORY)
    out, as_json = tmp_path / "report.html", tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autofuser.cli",
            "report",
            f"{tmp_path / 'block_factory.py'}:make",
            "--out",
            str(out),
            "--json",
            str(as_json),
            "--plugins",
            "elementwise,reduction,matmul",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = FusionReport.model_validate_json(as_json.read_text())
    browser = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run(browser + ["--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and "</html>" in dom.stdout, dom.stderr[-2000:]
    rendered = dom.stdout
    assert "<title>AutoFuser report: Block" in rendered
    # Chromium parsed the SVG: one drawn node per graph node, fused ones in their group's colour.
    assert len(re.findall(r'<g class="node ', rendered)) == len(report.graph)
    fused_nodes = {n for g in report.fused for n in g.nodes}
    assert len(re.findall(r'<g class="node group-\d+"', rendered)) == len(fused_nodes) > 0
    assert f"{len(report.fused)} fused, {len(report.skipped)} skipped" in rendered
    assert report.skipped[0].reason_code in rendered
    for group in report.fused:
        assert group.kernel in rendered
    assert rendered.count("@triton.jit") >= len(report.fused)
    shot = tmp_path / "report.png"
    subprocess.run(
        browser + [f"--screenshot={shot}", "--window-size=1200,1600", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_the_page_module_does_not_import_the_report_module():
    """The dependency is one way: report.py imports report_html (``to_html``), and
    report_html, imported first, leaves report.py unimported (no import cycle)."""
    code = "import sys, autofuser_core.report_html; assert 'autofuser_core.report' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
