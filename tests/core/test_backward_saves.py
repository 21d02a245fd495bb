"""What a fused group's backward takes from its forward (``compile._save_products``,
``backward.trace_backward``): with gradients on, the kernel also writes the results of
the group's products, and the backward graph reads them instead of computing the
products again - as eager's backward does, which never recomputes a GEMM.

Each test trains fused against eager (and float64) and counts the matrix products in
the traced backward graphs: a forward product whose operands both need gradients costs
two products in backward (``dY @ W`` and ``dY^T @ X``), and one more where its result is
computed again."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser.kernel import MAX_PRODUCTS
from autofuser_core import compile as compile_module
from autofuser_core.backward import BACKWARD_GRAPH_KEY

from _helpers import trains_like_eager

#: Matrix products as a traced backward graph spells them (torch functions, or ATen's
#: where no torch function gives the same result).
PRODUCTS = {
    torch.mm,
    torch.bmm,
    torch.matmul,
    torch.addmm,
    torch.baddbmm,
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
}
#: Gradients against eager's (same dtype) and float64's: fp32 at product tolerance, the
#: absolute part relative to the gradient's largest entry (sums over rows cancel).
FP32 = dict(atol=1e-4, rtol=1e-4)
BF16 = dict(atol=2e-2, rtol=4e-2)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def backward_products(monkeypatch):
    """The matrix products of each backward graph compiled, counted as traced (before any
    graph pass), in order."""
    counts: list[int] = []
    original = compile_module.compile_graph

    def counting(gm, *args, **kwargs):
        if gm.meta.get(BACKWARD_GRAPH_KEY):
            counts.append(sum(n.op == "call_function" and n.target in PRODUCTS for n in gm.graph.nodes))
        return original(gm, *args, **kwargs)

    monkeypatch.setattr(compile_module, "compile_graph", counting)
    return counts


class MlpBlock(nn.Module):
    """A transformer's feed-forward half: Linear -> GELU -> Linear, residual, layer norm."""

    def __init__(self, width: int = 20, hidden: int = 36):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))


class ScoresChain(nn.Module):
    """Attention written with batched products: scores, softmax over keys, values."""

    def forward(self, q, k, v):
        scores = torch.bmm(q, k.transpose(1, 2)) * 0.25
        return torch.bmm(torch.softmax(scores, dim=-1), v)


class BiasTanh(nn.Module):
    """``addmm`` with a bias, and an activation on its result."""

    def __init__(self, k: int = 24, n: int = 40):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) * k**-0.5)
        self.bias = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.tanh(torch.addmm(self.bias, x, self.weight))


def _gradients(model: nn.Module, inputs, weights: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    """Gradients of ``(model(*inputs) * weights).sum()`` for every input and parameter."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(*leaves)
    (out.double() * weights.double()).sum().backward()
    found = [x.grad for x in leaves] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return found


def _check_gradients(model: nn.Module, inputs, dtype: str, plugins=None):
    """The fused model's gradients against eager's in the same dtype, and against
    float64's no further off than eager's own (bf16: autocast). Returns its report."""
    autocast = dtype == "bf16"
    eager = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    fused = autofuser.fuse(model, plugins=plugins, progress=False, tune=False, verify_speed=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        weights = torch.randn(eager(*inputs).shape)
    got = _gradients(fused, inputs, weights, autocast)
    expected = _gradients(eager, inputs, weights, autocast)
    truth = _gradients(exact, [x.double() for x in inputs], weights, False)
    tol = BF16 if autocast else FP32
    for index, (ours, theirs, true) in enumerate(zip(got, expected, truth)):
        scale = max(1.0, float(true.abs().max()))
        torch.testing.assert_close(ours, theirs, atol=tol["atol"] * scale, rtol=tol["rtol"], msg=f"gradient {index}")
        if autocast:
            # As close to float64 as eager's bf16 gradient, up to bf16's own rounding.
            eager_error = float((theirs.double() - true).abs().max())
            ours_error = float((ours.double() - true).abs().max())
            assert ours_error <= 2 * eager_error + 1e-2 * scale, (index, ours_error, eager_error)
        else:
            torch.testing.assert_close(ours.double(), true, atol=FP32["atol"] * scale, rtol=FP32["rtol"])
    return fused.report()


def _forward_groups(report):
    return [g for g in report.fused if g.phase == "forward"]


# ---------------------------------------------------------------------------
# Products saved: gradients as eager's, no product computed again
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_an_mlp_blocks_second_product_is_saved_and_its_hidden_one_computed_on_chip(dtype, batch, backward_products):
    """The MLP kernel keeps the hidden activation on chip, so it stores only the second
    product's result (what the layer norm's derivative needs); its backward computes
    the first product again - once - and the second never."""
    report = _check_gradients(MlpBlock(), [torch.randn(batch, 37, 20)], dtype)
    (group,) = _forward_groups(report)
    assert group.strategy == "mlp", str(report)
    assert group.saved_for_backward == ["fc2"] and group.products_recomputed == ["fc1"], str(report)
    assert group.saved_bytes == batch * 37 * 20 * (2 if dtype == "bf16" else 4)
    # x, both weights need gradients: 2 products each, and fc1 once more.
    assert backward_products == [2 * 2 + 1]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_single_product_groups_save_every_product_and_recompute_none(dtype, backward_products):
    """With one product per group, each is a linear and its epilogue, which stores the
    product's result: the backward graphs hold only the gradients' products."""
    token = MAX_PRODUCTS.set(1)
    try:
        report = _check_gradients(MlpBlock(), [torch.randn(3, 29, 20)], dtype)
    finally:
        MAX_PRODUCTS.reset(token)
    groups = _forward_groups(report)
    assert sorted(n for g in groups for n in g.saved_for_backward) == ["fc1", "fc2"], str(report)
    assert not any(g.products_recomputed for g in groups), str(report)
    assert sum(backward_products) == 2 * 2
    assert "2 product result(s)" in str(report)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_batched_scores_chain_saves_its_scores(dtype, batch, backward_products):
    """Attention written with ``bmm`` (no attention plugin: the product strategies take
    it): the scores' product is saved, softmax's derivative recomputes the probabilities
    from it, and no forward product is computed again."""
    q, k, v = torch.randn(batch, 37, 12), torch.randn(batch, 29, 12), torch.randn(batch, 29, 20)
    report = _check_gradients(ScoresChain(), [q, k, v], dtype, plugins=["elementwise", "reduction", "matmul"])
    saved = [n for g in _forward_groups(report) for n in g.saved_for_backward]
    assert saved == ["bmm"], str(report)
    # q, k, v and the probabilities all need gradients: 2 products per forward product.
    assert sum(backward_products) == 2 * 2


@pytest.mark.parametrize(("dtype", "rows", "k", "n"), [("fp32", 221 * 51, 5, 7), ("bf16", 111, 23, 37)])
def test_addmm_with_bias_saves_its_product(dtype, rows, k, n, backward_products):
    """Once over 221 x 51 rows (a mesh's points); K and N not powers of two."""
    report = _check_gradients(BiasTanh(k, n), [torch.randn(rows, k)], dtype)
    (group,) = _forward_groups(report)
    assert group.saved_for_backward == ["addmm"], str(report)
    assert group.saved_bytes == rows * n * (2 if dtype == "bf16" else 4)
    assert sum(backward_products) == 2


class NormedChain(nn.Module):
    """Three products with norms between them: one row-tiled chain."""

    def __init__(self, width: int = 20, hidden: int = 36):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.fc1, self.fc2, self.fc3 = nn.Linear(width, hidden), nn.Linear(hidden, width), nn.Linear(width, width)

    def forward(self, x):
        y = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return torch.tanh(self.fc3(self.norm2(y)))


def test_a_row_chain_saves_each_steps_product(backward_products):
    report = _check_gradients(NormedChain(), [torch.randn(2, 23, 20)], "fp32")
    (group,) = _forward_groups(report)
    assert group.strategy == "row_chain", str(report)
    assert group.saved_for_backward == ["fc1", "fc2", "fc3"] and not group.products_recomputed, str(report)
    assert sum(backward_products) == 3 * 2


def test_a_block_trains_like_eager_from_saved_products():
    """A few SGD steps: the saved values are the current step's, not the first's."""
    token = MAX_PRODUCTS.set(1)
    try:
        report = trains_like_eager(MlpBlock(), torch.randn(3, 19, 20))
    finally:
        MAX_PRODUCTS.reset(token)
    assert any(g.saved_for_backward for g in report.fused), str(report)


# ---------------------------------------------------------------------------
# Nothing held that the backward does not read; recomputed where nothing can be stored
# ---------------------------------------------------------------------------


class LinearResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(20, 20)

    def forward(self, x):
        return x + self.fc(x) * 0.5


def test_a_product_whose_result_no_derivative_reads_is_neither_written_nor_held(backward_products, monkeypatch):
    """A residual add's and a scale's derivatives don't read the product's result: the
    backward traced on meta tensors before the kernel is written reads none, so the
    kernel writes nothing for it and nothing is held from forward to backward."""
    from autofuser_core.launch import FusedKernel

    written = []
    init = FusedKernel.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        written.append(self.saved_names)

    monkeypatch.setattr(FusedKernel, "__init__", recording)
    report = _check_gradients(LinearResidual(), [torch.randn(2, 23, 20)], "fp32")
    (group,) = _forward_groups(report)
    assert group.saved_for_backward == [] and group.saved_bytes == 0 and group.products_recomputed == [], str(report)
    assert written and not any(written), written
    assert sum(backward_products) == 2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_strategy_that_stores_no_intermediate_recomputes_and_trains_correctly(dtype, backward_products):
    """The online-softmax attention kernel never writes its scores: its group keeps
    recomputing them in backward, says so in the report, and its gradients are eager's."""
    q, k, v = torch.randn(3, 37, 12), torch.randn(3, 29, 12), torch.randn(3, 29, 20)
    report = _check_gradients(ScoresChain(), [q, k, v], dtype)
    (group,) = _forward_groups(report)
    assert group.strategy == "softmax_attention", str(report)
    assert group.saved_for_backward == [] and group.products_recomputed == ["bmm"], str(report)
    assert sum(backward_products) == 2 * 2 + 1
    assert "compute 1 product(s) again in backward" in str(report)


def test_inference_kernels_write_nothing_for_backward():
    """Without gradients the kernels are the plain ones: no output saved for backward,
    and the same kernel as a compile of the same group without the saving."""
    model = MlpBlock()
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    x = torch.randn(2, 19, 20)
    with torch.no_grad():
        fused(x)
    (inference,) = fused.kernels()
    assert inference.saved_names == [] and inference.n_visible == len(inference.output_layout)
    fused(x.requires_grad_())  # train signature: its own compile
    training = [k for k in fused.kernels() if k.saved_names]
    assert training and all(k.source.source_hash != inference.source.source_hash for k in training)


def test_gradients_of_gradients_recompute_from_the_inputs():
    """``create_graph=True`` takes the differentiable recompute of the group's eager ops,
    whatever its kernel saved."""
    model = nn.Sequential(nn.Linear(3, 24), nn.Tanh())
    eager = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    x = torch.randn(37, 3)
    results = []
    for net in (fused, eager):
        leaf = x.clone().requires_grad_()
        (du,) = torch.autograd.grad(net(leaf).sum(), leaf, create_graph=True)
        du.square().sum().backward()
        results.append([leaf.grad] + [p.grad for p in net.parameters()])
    assert any(g.saved_for_backward for g in fused.report().fused), str(fused.report())
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, **FP32)


def test_a_checkpointed_forward_saves_its_products_again_when_recomputed():
    """Activation checkpointing drops what the forward saved and runs it again in
    backward: the second run's kernel writes the products' results again, and the
    gradients are eager's, the first (compiling) call included."""
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(nn.Linear(20, 36), nn.GELU(), nn.Linear(36, 20), nn.Tanh())
    reference = copy.deepcopy(model)
    token = MAX_PRODUCTS.set(1)
    try:
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        for _ in range(2):
            grads, x = [], torch.randn(2, 17, 20)
            for module in (fused, reference):
                leaf = x.clone().requires_grad_()
                checkpoint(module, leaf, use_reentrant=False).square().mean().backward()
                grads.append([leaf.grad] + [p.grad for p in module.parameters()])
                module.zero_grad(set_to_none=True)
            for ours, theirs in zip(*grads):
                torch.testing.assert_close(ours, theirs, **FP32)
    finally:
        MAX_PRODUCTS.reset(token)
    saved = [n for g in _forward_groups(fused.report()) for n in g.saved_for_backward]
    assert sorted(saved) == ["_0", "_2"], str(fused.report())


def test_a_kernel_writing_a_wrong_saved_value_keeps_its_group_eager(monkeypatch):
    """A saved value is checked against eager's value of its node like any output: one
    off by 1 leaves the group eager (``mismatch``), and the gradients stay eager's."""
    from autofuser_core.launch import FusedKernel

    launch = FusedKernel.launch

    def off_by_one(self, *inputs):
        outputs = launch(self, *inputs)
        for saved in outputs[self.n_visible :]:
            saved.add_(1.0)
        return outputs

    monkeypatch.setattr(FusedKernel, "launch", off_by_one)
    report = _check_gradients(BiasTanh(), [torch.randn(37, 24)], "fp32")
    (group,) = [g for g in report.groups if g.phase == "forward" and "matmul.addmm" in g.ops and len(g.ops) == 2]
    assert not group.fused and group.reason_code == "mismatch" and "addmm" in group.reason, str(report)
