"""The HTML report: ``report.to_html(path)`` and ``autofuser report MODULE:FACTORY``.

The page is checked as text (self-contained, every part present) and rendered
in headless Chromium (skipped, with the reason, where Chromium is absent; CI
installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from collections import Counter

import pytest
import torch

import autofuser
from autofuser.cli import main as cli_main
from autofuser_core.report import FusionReport, GroupEntry
from autofuser_core.report_html import PALETTE

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


def _fused_report(folder):
    # From a real file, as a user's model is: the report quotes its lines.
    path = folder / "block_factory.py"
    path.write_text(FACTORY)
    namespace: dict = {}
    exec(compile(FACTORY, str(path), "exec"), namespace)
    model, x = namespace["make"]()
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction", "matmul"], progress=False)
    with torch.no_grad():
        fused(x)
    return fused.report()


def test_page_is_self_contained_and_has_every_part(tmp_path):
    report = _fused_report(tmp_path)
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
    assert skipped.reason and skipped.reason.split(";")[0].replace("'", "&#39;") in page
    for group in report.fused:
        assert group.kernel_source and "@triton.jit" in group.kernel_source
        assert group.kernel in page
    assert page.count('class="kernel-source"') == sum(1 for g in report.groups if g.kernel_source)
    assert "not measured" in page  # on CPU nothing is timed, and the page says so
    # The result leads; alternatives come after what was fused and what stayed eager;
    # sources are collapsed.
    order = [page.index(f'id="{part}"') for part in ("summary", "graph", "groups", "eager", "skipped", "kernels")]
    assert order == sorted(order)
    assert "forward not timed (no GPU" in page[: page.index('id="graph"')]
    assert page.count("<details") == page.count('class="kernel-source"') and "<details open" not in page
    # One cluster per fused group, its nodes drawn inside it; each group says where in forward it came from.
    assert page.count('<g class="cluster"') == len(report.fused)
    for group in report.fused:
        assert f'id="cluster-{report.groups.index(group)}"' in page
    assert "block_factory.py:12 in forward: h = torch.nn.functional.gelu(self.lin(self.norm(x)))" in page


def test_names_from_the_users_model_are_escaped():
    """The page shows the model's class name, its submodules' names and its source lines:
    a model whose names are markup gets them shown as text, never run as a script."""

    class Hostile(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("<script>alert(1)</script>", torch.nn.Linear(7, 5))

        def forward(self, x):
            return torch.relu(getattr(self, "<script>alert(1)</script>")(x) * 2.0 + 1.0)

    Hostile.__name__ = Hostile.__qualname__ = "<script>alert('model')</script>"
    torch.manual_seed(0)
    model, x = Hostile().eval(), torch.randn(3, 7)
    fused = autofuser.fuse(model, plugins=["elementwise", "matmul"], progress=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
    report = fused.report()
    assert report.model.startswith("<script>") and any(n.module == "<script>alert(1)</script>" for n in report.graph)
    page = report.to_html()
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#39;model&#39;)&lt;/script&gt;" in page  # the model's name, as text
    assert 'data-node="_script_alert_1_script_"' in page and "&lt;script&gt;alert(1)&lt;/script&gt; (Linear)" in page


def test_the_templates_ship_with_the_package():
    """The page's templates are package data: a wheel without them could not write a page."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    import autofuser_core

    root = Path(autofuser_core.__file__).parent
    templates = sorted(p.relative_to(root).as_posix() for p in (root / "templates").iterdir())
    assert "templates/report.html.j2" in templates and "templates/graph.svg.j2" in templates
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["autofuser_core"]
    assert all(any(Path(t).match(p) for p in patterns) for t in templates), (templates, patterns)


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
    report.whole_eager_ms, report.whole_fused_ms = 0.05, 0.02
    page = report.to_html()
    assert "2.50x eager&#39;s speed: 0.020 ms fused vs 0.050 ms eager per forward" in page
    assert page.index("2.50x") < page.index('id="graph"')
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
    assert "forward not timed" in rendered and rendered.index('id="summary"') < rendered.index('id="graph"')
    assert len(re.findall(r'<g class="cluster"', rendered)) == len(report.fused) > 0
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
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 1600)
    # Not blank: a good part of the page is drawn (text, tables, the graph), not one colour.
    counts = Counter(pixels)
    background = counts.most_common(1)[0][1]
    assert len(pixels) - background > len(pixels) // 50, "the screenshot is (nearly) blank"
    # The clusters are on screen, each fused group's nodes filled in its own colour.
    fills = {tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in PALETTE[: len(report.fused)]}
    for fill in fills:
        assert counts[fill] > 500, f"no node in the colour {fill} is visible"


def _png_pixels(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(width, height, RGB of each pixel) of an 8-bit RGB or RGBA PNG, as Chromium writes
    its screenshots: IDAT inflated, each row's filter undone (PNG spec, section 9)."""
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    channels = 3 if colour == 2 else 4
    chunks, offset = [], 8
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset : offset + 4]), data[offset + 4 : offset + 8]
        if kind == b"IDAT":
            chunks.append(data[offset + 8 : offset + 8 + length])
        offset += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    previous = bytearray(stride)
    pixels = []
    for y in range(height):
        start = y * (stride + 1)
        kind, row = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = row[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                row[i] = (row[i] + left) & 255
            elif kind == 2:
                row[i] = (row[i] + up) & 255
            elif kind == 3:
                row[i] = (row[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                row[i] = (row[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        pixels += [tuple(row[i : i + 3]) for i in range(0, stride, channels)]
        previous = row
    return width, height, pixels


def test_the_page_module_does_not_import_the_report_module():
    """The dependency is one way: report.py imports report_html (``to_html``), and
    report_html, imported first, leaves report.py unimported (no import cycle)."""
    code = "import sys, autofuser_core.report_html; assert 'autofuser_core.report' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
