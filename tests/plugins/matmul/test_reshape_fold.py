"""The matmul plugin's graph rewrites of flattened products and double permutes
(``autofuser_plugins.matmul.reshape_fold``), on user graphs, on ATen graphs as a
backward graph holds them, and through training: the gradient of an input, ``dY @ W``,
takes the activation's derivative after it as its epilogue.

Each rewrite is checked twice: the rewritten graph computes the identical values on
fresh random inputs, and the fused model equals eager (forward and gradients against
eager and float64) at awkward shapes: batch 1 and 3, widths that are no powers of two.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import ShapeProp

import autofuser
from autofuser_plugins.matmul.reshape_fold import fold_double_permutes, fold_flattened_products

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=4e-2),
}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def _aten_graph(fn, *inputs) -> torch.fx.GraphModule:
    gm = make_fx(fn)(*inputs)
    ShapeProp(gm).propagate(*inputs)
    return gm


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ---------------------------------------------------------------------------
# The rewrites on their own
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(1, 7), (3, 37), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_a_linear_layer_in_aten_becomes_one_matmul_computing_the_same(lead, bias):
    x = torch.randn(*lead, 24)
    weight, b = torch.randn(40, 24), torch.randn(40)
    gm = _aten_graph(lambda x, w, b: F.linear(x, w, b if bias else None), x, weight, b)
    assert torch.ops.aten.view.default in _targets(gm)
    expected = gm(x, weight, b)

    assert fold_flattened_products(gm) == 1
    gm.graph.lint()
    gm.recompile()
    targets = _targets(gm)
    assert torch.matmul in targets and torch.ops.aten.view.default not in targets
    assert (torch.add in targets) == bias
    assert torch.equal(gm(x, weight, b), expected)


def test_a_flattened_product_is_left_alone_where_the_rows_do_not_come_back():
    """The product's rows reshaped otherwise, a product read flat too, or a bias of
    rows (not one vector): no rewrite."""

    def other_shape(x, w):
        return torch.mm(x.reshape(-1, 24), w).reshape(37, 3, 40)

    def read_flat(x, w):
        p = torch.mm(x.reshape(-1, 24), w)
        return p.reshape(3, 37, 40), p.sum()

    def bias_of_rows(x, w, b):
        return torch.addmm(b, x.reshape(-1, 24), w).reshape(3, 37, 40)

    x, w = torch.randn(3, 37, 24), torch.randn(24, 40)
    for fn, inputs in ((other_shape, (x, w)), (read_flat, (x, w)), (bias_of_rows, (x, w, torch.randn(111, 40)))):
        gm = _aten_graph(fn, *inputs)
        assert fold_flattened_products(gm) == 0, fn.__name__


@pytest.mark.parametrize(
    "p,q",
    [((1, 0), (1, 0)), ((0, 2, 1), (0, 2, 1)), ((2, 0, 1), (1, 2, 0)), ((0, 2, 1), (1, 0, 2))],
    ids=str,
)
def test_a_permute_of_a_permute_becomes_one(p, q):
    x = torch.randn(*(5, 7, 3)[: len(p)])
    gm = _aten_graph(lambda x: torch.permute(torch.permute(x, p), q) * 2.0, x)
    expected = gm(x)
    assert fold_double_permutes(gm) == 1
    gm.graph.lint()
    gm.recompile()
    got = gm(x)
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    identity = [p[d] for d in q] == list(range(len(p)))
    assert _targets(gm).count(torch.ops.aten.permute.default) == (0 if identity else 1)


# ---------------------------------------------------------------------------
# Through fuse(): user code that flattens rows around mm, and training
# ---------------------------------------------------------------------------


class FlatProducts(nn.Module):
    """A projection written as reshape -> mm -> reshape, then GELU and a residual."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, hidden) / width**0.5)
        self.bias = nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        h = torch.addmm(self.bias, rows, self.weight).reshape(*x.shape[:-1], -1)
        return F.gelu(h) + 0.5 * h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_product_over_flattened_rows_takes_its_epilogue(dtype, batch):
    model = FlatProducts(24, 45).to(dtype)
    x = torch.randn(batch, 37, 24, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        fused = autofuser.fuse(model, progress=False, tune=False)
        got = fused(x)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    report = fused.report()
    product_groups = [g for g in report.fused if "matmul.matmul" in g.ops]
    assert len(product_groups) == 1, str(report)
    assert "elementwise.gelu" in product_groups[0].ops, str(report)


class Block(nn.Module):
    """A transformer block's MLP half: x + W2 gelu(W1 x + b1) + b2, then a layer norm."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(width, hidden), nn.Linear(hidden, width), nn.LayerNorm(width)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.2)
            self.norm.bias.normal_(0.0, 0.2)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x))))


def _gradients(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    model(x).backward(grad)
    return {"x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_an_input_gradient_takes_the_activation_derivative_as_its_epilogue(dtype, batch):
    """The block's backward graph: ``dY @ W2`` and GELU's derivative in one kernel with
    a product, gradients within eager's error of float64."""
    model = Block(24, 45).to(dtype)
    eager, reference = copy.deepcopy(model), copy.deepcopy(model).double()
    x, grad = torch.randn(batch, 37, 24, dtype=dtype), torch.randn(batch, 37, 24, dtype=dtype)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)

    got = _gradients(fused, x, grad)
    expected = _gradients(eager, x, grad)
    exact = _gradients(reference, x.double(), grad.double())

    for name, value in got.items():
        scale = float(exact[name].abs().max())
        if dtype == torch.float32:
            torch.testing.assert_close(value, expected[name], atol=1e-5 * max(1.0, scale), rtol=1e-4)
        else:  # no worse than twice eager's own error against float64 (and a small floor)
            eager_error = float((expected[name].double() - exact[name]).abs().max())
            error = float((value.double() - exact[name]).abs().max())
            assert error <= 2 * eager_error + 1e-2 * scale, (name, error, eager_error)

    backward = [g for g in fused.report().fused if g.phase == "backward"]
    derivative_with_product = [
        g for g in backward if "matmul.matmul" in g.ops and "elementwise.erf" in g.ops and "elementwise.exp" in g.ops
    ]
    assert derivative_with_product, str(fused.report())


def test_the_block_trains_at_the_airfoil_mesh_size():
    """The same backward at M = 221 * 51 rows (the Airfoil mesh, batch 1): the row-tiled
    kernels' last block is partial, and the weight gradients sum 11271 rows."""
    model = Block(24, 45)
    eager, reference = copy.deepcopy(model), copy.deepcopy(model).double()
    x, grad = torch.randn(1, 221 * 51, 24), torch.randn(1, 221 * 51, 24)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    got, expected = _gradients(fused, x, grad), _gradients(eager, x, grad)
    exact = _gradients(reference, x.double(), grad.double())
    for name, value in got.items():
        scale = float(exact[name].abs().max())
        eager_error = float((expected[name].double() - exact[name]).abs().max())
        error = float((value.double() - exact[name]).abs().max())
        assert error <= 2 * eager_error + 1e-6 * scale, (name, error, eager_error)
    assert any("matmul.matmul" in g.ops for g in fused.report().fused if g.phase == "backward")
