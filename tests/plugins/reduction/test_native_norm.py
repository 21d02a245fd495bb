"""The reduction plugin's rewrite of ATen's ``native_layer_norm`` into the ops it
computes (``autofuser_plugins.reduction.native_norm``): the rewritten graph gives
eager's statistics (within a rounding of fp32) and normalised rows, in each dtype,
and in a backward graph the statistics join the norm's derivative in one row kernel.
"""

from __future__ import annotations

import operator
import zlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import ShapeProp

import autofuser
from autofuser_plugins.reduction.native_norm import decompose_native_layer_norms

# The statistics: fp32 math in both, two summation orders; 16-bit results round once.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def _graph(fn, *inputs) -> torch.fx.GraphModule:
    gm = make_fx(fn)(*inputs)
    ShapeProp(gm).propagate(*inputs)
    return gm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,normalized,affine",
    [((3, 37, 24), (24,), True), ((1, 5, 7), (5, 7), False), ((2, 3, 4, 45), (45,), True)],
    ids=str,
)
@pytest.mark.parametrize("read", [(1, 2), (0, 1, 2), (2,)], ids=str)
def test_native_layer_norm_becomes_the_ops_it_computes(dtype, shape, normalized, affine, read):
    x = (torch.randn(*shape) * 3 + 1.5).to(dtype)
    weight = torch.randn(*normalized).to(dtype) if affine else None
    bias = torch.randn(*normalized).to(dtype) if affine else None

    def fn(x, weight, bias):
        results = torch.ops.aten.native_layer_norm.default(x, list(normalized), weight, bias, 1e-5)
        return tuple(results[i] for i in read)

    gm = _graph(fn, x, weight, bias)
    expected = gm(x, weight, bias)
    assert decompose_native_layer_norms(gm) == 1
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.native_layer_norm.default not in targets and operator.getitem not in targets
    got = gm(x, weight, bias)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, **TOLERANCES[dtype])


def test_a_native_layer_norm_read_whole_is_left_alone():
    """Its tuple returned as it is (not read by index): nothing to rewrite into."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    norm = graph.call_function(torch.ops.aten.native_layer_norm.default, (x, [9], None, None, 1e-5))
    graph.output(norm)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    ShapeProp(gm).propagate(torch.randn(4, 9))
    assert decompose_native_layer_norms(gm) == 0
    assert norm in gm.graph.nodes


class NormThenScale(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)
            self.norm.bias.normal_(0.0, 0.3)

    def forward(self, x):
        return torch.sigmoid(self.norm(x * 1.5 + 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_layer_norms_backward_recomputes_its_statistics_inside_its_row_kernel(dtype, batch):
    model = NormThenScale(29).to(dtype)
    reference = NormThenScale(29).to(torch.float64)
    reference.load_state_dict(model.state_dict())
    x, grad = torch.randn(batch, 37, 29, dtype=dtype), torch.randn(batch, 37, 29, dtype=dtype)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)

    def gradients(module, x, grad):
        x = x.clone().requires_grad_()
        module(x).backward(grad)
        return [x.grad, *(p.grad for p in module.parameters())]

    got = gradients(fused, x, grad)
    exact = gradients(reference, x.double(), grad.double())
    model.zero_grad()
    expected = gradients(model, x, grad)
    for g, e, r in zip(got, expected, exact):
        scale = float(r.abs().max())
        eager_error = float((e.double() - r).abs().max())
        error = float((g.double() - r).abs().max())
        assert error <= 2 * eager_error + (1e-6 if dtype == torch.float32 else 1e-2) * scale, (error, eager_error)
    report = fused.report()
    backward = [g for g in report.fused if g.phase == "backward"]
    assert any({"reduction.mean", "reduction.var"} <= set(g.ops) and "reduction.sum" in g.ops for g in backward), str(
        report
    )
    assert not [n for n in report.unfused_nodes if "native_layer_norm" in n.target], str(report)
