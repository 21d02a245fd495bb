"""``torch.compile(model, backend="autofuser")``: Dynamo's graphs, graph breaks
included, go through the same pipeline (on CPU under Triton's interpreter)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
import torch
import torch.nn.functional as F

from autofuser.dynamo import autofuser_backend, compiled_graphs

PLUGINS = ["elementwise", "reduction", "matmul"]
OPTIONS = {"plugins": PLUGINS, "progress": False}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(torch.nn.Module):
    def __init__(self, width=19, hidden=37):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x)))) * 0.5


class WithGraphBreak(torch.nn.Module):
    """A data-dependent branch: Dynamo splits the forward into several graphs."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(11, 13)
        self.norm = torch.nn.LayerNorm(13)

    def forward(self, x):
        h = torch.tanh(self.first(x)) * 2.0
        if h.mean() > 0:  # a Python bool from a tensor: a graph break
            h = h + 1.0
        else:
            h = h - 1.0
        return torch.softmax(self.norm(h), dim=-1)


def _fused_groups():
    return [g for module in compiled_graphs() for g in module.report().groups if g.fused]


def test_registered_through_torchs_entry_point():
    points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert points.get("autofuser") == "autofuser.dynamo:autofuser_backend"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("autofuser") is autofuser_backend


@pytest.mark.parametrize("shape", [(2, 19), (3, 7, 19)])
def test_matches_eager_and_fuses(shape):
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="autofuser", options=OPTIONS)
    with torch.no_grad():
        for _ in range(2):  # the second call reuses what the first compiled
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert len(compiled_graphs()) == 1
    groups = _fused_groups()
    assert groups and {"reduction.layer_norm", "elementwise.gelu"} <= {op for g in groups for op in g.ops}


def test_graph_breaks_feed_the_same_pipeline():
    torch.manual_seed(1)
    model = WithGraphBreak().eval()
    compiled = torch.compile(model, backend="autofuser", options=OPTIONS)
    with torch.no_grad():
        for x in (torch.randn(4, 11) + 3.0, torch.randn(4, 11) - 3.0, torch.randn(2, 5, 11)):
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    graphs = compiled_graphs()
    assert len(graphs) >= 3, "the forward should have been split at the branch"
    # Each piece fused its own ops: the first linear + tanh, and softmax(norm(h +- 1)) after the break.
    ops = [{op for g in module.report().groups if g.fused for op in g.ops} for module in graphs]
    assert any("elementwise.tanh" in o for o in ops)
    assert any({"reduction.layer_norm", "reduction.softmax"} <= o for o in ops)


def test_gradients_match_eager():
    torch.manual_seed(2)
    model = Block()
    compiled = torch.compile(model, backend="autofuser", options=OPTIONS)
    x = torch.randn(2, 5, 19, requires_grad=True)
    compiled(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    model(x).square().sum().backward()
    want = [x.grad] + [p.grad for p in model.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert _fused_groups()


def test_bad_options_say_what_is_wrong():
    compiled = torch.compile(Block().eval(), backend="autofuser", options={"tune_budget": 3})
    with pytest.raises(Exception, match="tune_budget.*Known options"):
        compiled(torch.randn(2, 19))


def test_progress_names_the_graph_in_one_short_line(capfd):
    torch.manual_seed(4)
    model = Block().eval()
    compiled = torch.compile(model, backend="autofuser", options={"plugins": PLUGINS, "progress": True})
    x = torch.randn(1, 6, 19)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("autofuser:")]
    assert lines, "no progress line"
    # Named after the user's function, not "GraphModule"; every parameter is one of the
    # graph's inputs, yet the line stays short.
    assert all("GraphModule" not in line and len(line) < 120 for line in lines), lines
    assert re.match(r"autofuser: graph \d+ of forward \(test_dynamo\.py\): capture", lines[0]), lines
    assert "compiled in" in lines[-1] and "fused kernel(s)" in lines[-1]
    module = compiled_graphs()[-1]  # graphs of earlier tests may still be alive
    assert re.fullmatch(r"graph \d+ of forward \(test_dynamo\.py\)", module.report().model)
    # Its nodes come from fx's generated code: no line is pinned on the caller's.
    assert not [n.source for n in module.report().graph if n.source], module.report().graph
