"""Autocast's conversion of a linear layer's input as a node of the graph
(``plugins/matmul/autocast.py``): the same values, and a layer norm split off its
linear writes the 16-bit value the product reads."""

from __future__ import annotations

import torch
import torch.nn as nn

import autofuser
from autofuser_plugins.matmul.autocast import make_autocast_casts_explicit

from _helpers import stand_in_timer_by_kernel


class NormQkv(nn.Module):
    """A layer norm feeding three linears, and a linear on the raw input (left as it is)."""

    def __init__(self, width=24):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, 19) for _ in range(3))
        self.skip = nn.Linear(width, 19, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) * self.k(h) + self.v(h) + self.skip(x)


def _casts(gm):
    return [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]


def test_each_converted_value_gets_one_cast_and_the_graph_computes_the_same():
    torch.manual_seed(0)
    model = NormQkv().eval()
    x = torch.randn(3, 37, 24)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        gm = autofuser.capture(model, x)
        before = gm(x)
        assert make_autocast_casts_explicit(gm) == 1  # the norm's output (three users); not x
        gm.recompile()
        after = gm(x)
    (cast,) = _casts(gm)
    assert cast.meta["tensor_meta"].dtype == torch.bfloat16 and len(cast.users) == 3
    assert before.dtype == torch.bfloat16
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_without_autocast_nothing_changes():
    model = NormQkv().eval()
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        gm = autofuser.capture(model, x)
        assert make_autocast_casts_explicit(gm) == 0
    assert not _casts(gm)
    model16 = NormQkv().to(torch.bfloat16).eval()  # bf16 weights and input: no conversion either
    with torch.no_grad():
        gm = autofuser.capture(model16, x.to(torch.bfloat16))
        assert make_autocast_casts_explicit(gm) == 0


def test_a_layer_norm_split_off_its_linear_writes_what_the_product_reads(use_timer):
    """Timed as on a GPU (the norm + linear kernel slower than the norm's own kernel and
    the linear's): the norm's group takes the conversion and writes bf16."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 40)).eval()
    x = torch.randn(3, 19, 24)
    stand_in_timer_by_kernel(use_timer, lambda layout, normed: 0.6 if layout == "matmul" and normed else 0.1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = autofuser.fuse(model, progress=False)
        got, want = fused(x), model(x)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=4e-2)
    report = fused.report()
    (norm,) = [g for g in report.fused if g.strategy == "row_reduction"]
    assert norm.ops == ["reduction.layer_norm_module", "elementwise.cast"], str(report)
    (kernel,) = [k for k in fused.kernels() if k.__name__ == norm.kernel]
    assert [dtype for _, _, dtype in kernel.output_layout] == [torch.bfloat16]
