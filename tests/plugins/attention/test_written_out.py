"""Written-out softmax attention made one call (``plugins/attention/written_out.py``).

An exact ``softmax(q @ k^T * scale) @ v`` with enough keys is rewritten into the
plugin's ``flash_attention(q, k, v, scale=...)`` before planning: each spelling (matmul,
``@``, ``.mT``, ``transpose``, ``*`` and ``/`` by numbers, ``softmax`` as a function,
a method and ``nn.Softmax``) is rewritten, the rewritten graph computes what the
original does, and the fused model matches eager in its outputs and its gradients
(fp32, batch 1 and 3, 300 keys, non-square), with its backward holding no N x M
tensor where eager's holds several. Chains that are not exactly that function - a
bias, dropout in training, scores read elsewhere, a softmax with a dtype, over
another dim, 3-d operands, fewer keys, heads too wide for the flash kernels - stay as
written. 16-bit chains (under autocast or in a 16-bit model) are rewritten only where
the graph is compiled with gradients on, and trained under autocast are as near
float64 as eager is.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import autofuser
from autofuser_core.capture import capture
from autofuser_plugins.attention import written_out
from autofuser_plugins.attention.flash_op import flash_attention
from autofuser_plugins.attention.written_out import rewrite_written_out_attention

KEYS = 300  # above written_out.MIN_KEYS
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=4e-2)}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def test_the_keys_here_are_enough_for_the_rewrite():
    assert KEYS >= written_out.MIN_KEYS


class Chain(nn.Module):
    """One spelling of written-out attention over q, k, v of shape [B, H, L, D]."""

    def __init__(self, form: str, dropout: float = 0.0):
        super().__init__()
        self.form = form
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v):
        d = q.shape[-1]
        if self.form == "matmul_mul":
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * d**-0.5, dim=-1), v)
        if self.form == "at_div_method":
            return ((q @ k.mT) / math.sqrt(d)).softmax(-1) @ v
        if self.form == "two_scalings_module":
            return self.softmax(2.0 * (q @ k.transpose(3, 2)) * (0.5 / math.sqrt(d))) @ v
        if self.form == "functional_dim_kw":
            return F.softmax(q.matmul(k.transpose(-1, -2)) * 0.3, dim=3).matmul(v)
        # Not exactly SDPA: left as written.
        scores = q @ k.transpose(-2, -1) * d**-0.5
        if self.form == "bias":
            return (scores + 0.1 * torch.ones_like(scores[..., :1, :])).softmax(-1) @ v
        if self.form == "dropout":
            return self.dropout(scores.softmax(-1)) @ v
        if self.form == "scores_read_elsewhere":
            return scores.softmax(-1) @ v, scores.mean()
        if self.form == "softmax_dtype":
            return scores.softmax(-1, dtype=torch.float32) @ v
        if self.form == "softmax_over_queries":
            return scores.softmax(-2) @ v
        if self.form == "key_written_before_the_last_product":
            p = scores.softmax(-1)
            k.mul_(3.0)  # the chain read k before this; a call put at the last product would read it after
            return p @ v
        raise ValueError(self.form)


REWRITTEN = ["matmul_mul", "at_div_method", "two_scalings_module", "functional_dim_kw"]


def qkv(batch: int, n: int, m: int, d: int, dtype=torch.float32, grad: bool = False):
    """q, k, v [B, 2, L, D] as views of [B, L, 2 * D] projections' outputs (as a model makes them)."""
    made = [torch.randn(batch, length, 2 * d, dtype=dtype) for length in (n, m, m)]
    return [rearrange(t.requires_grad_(grad), "b l (h d) -> b h l d", h=2) for t in made]


def _rewritten(model: nn.Module, *inputs) -> tuple[int, torch.fx.GraphModule]:
    gm = capture(model, *inputs)
    count = rewrite_written_out_attention(gm)
    gm.recompile()
    return count, gm


@pytest.mark.parametrize("form", REWRITTEN)
def test_each_spelling_is_rewritten_and_computes_the_same(form):
    q, k, v = qkv(3, 37, KEYS, 16)
    model = Chain(form)
    count, gm = _rewritten(model, q, k, v)
    assert count == 1, gm.code
    calls = [n for n in gm.graph.nodes if n.target is flash_attention]
    assert len(calls) == 1 and not [n for n in gm.graph.nodes if "softmax" in str(n.target)], gm.code
    got = gm(q, k, v)
    torch.testing.assert_close(got, model(q, k, v), **TOLERANCES[torch.float32])
    assert got.is_contiguous()


@pytest.mark.parametrize(
    "form",
    [
        "bias",
        "dropout",
        "scores_read_elsewhere",
        "softmax_dtype",
        "softmax_over_queries",
        "key_written_before_the_last_product",
    ],
)
def test_chains_that_are_not_exactly_sdpa_stay_as_written(form):
    q, k, v = qkv(2, 37, KEYS, 16)
    model = Chain(form, dropout=0.5).train()
    count, gm = _rewritten(model, q, k.clone(), v)
    assert count == 0, gm.code
    assert not [n for n in gm.graph.nodes if n.target is flash_attention]


def test_few_keys_three_dim_operands_or_wide_heads_stay_as_written():
    q, k, v = qkv(2, 37, written_out.MIN_KEYS - 1, 16)
    assert _rewritten(Chain("matmul_mul"), q, k, v)[0] == 0
    q3, k3, v3 = (t.flatten(0, 1) for t in qkv(2, 37, KEYS, 16))
    assert _rewritten(Chain("matmul_mul"), q3, k3, v3)[0] == 0
    wide = written_out.MAX_HEAD_WIDTH + 1
    q, k, v = qkv(1, 5, KEYS, 16)
    assert _rewritten(Chain("matmul_mul"), q, k, torch.randn(1, 2, KEYS, wide))[0] == 0
    assert _rewritten(Chain("matmul_mul"), *qkv(1, 5, KEYS, wide))[0] == 0


def _train_beside_eager(batch: int, autocast: bool):
    """(fused module, the fused side's output and q/k/v projection gradients, eager's) of
    one step of ``Chain("at_div_method")`` on the same data, checked within the dtype's
    tolerance (gradients' absolute part relative to their largest entry)."""
    model = Chain("at_div_method")
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    results = []
    for runner in (fused, model):
        torch.manual_seed(7)
        q, k, v = qkv(batch, 41, KEYS, 16, grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = runner(q, k, v)
        out.float().square().sum().backward()
        results.append((out.detach().float(), [t._base.grad for t in (q, k, v)]))  # the projections' gradients
    (got, got_grads), (expected, expected_grads) = results
    tolerance = TOLERANCES[torch.bfloat16 if autocast else torch.float32]
    torch.testing.assert_close(got, expected, **tolerance)
    for name, g, e in zip("qkv", got_grads, expected_grads):
        scale = max(1.0, float(e.abs().max()))
        torch.testing.assert_close(g, e, atol=tolerance["atol"] * scale, rtol=tolerance["rtol"], msg=name)
    return [g.reason for g in fused.report().fused if g.strategy == "softmax_attention"]


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_training_matches_eager(batch):
    summaries = _train_beside_eager(batch, autocast=False)
    assert len(summaries) == 1 and "written out" in summaries[0] and "flash_attention call" in summaries[0]


def _calls(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.target in (F.scaled_dot_product_attention, flash_attention)]


def test_chains_of_each_dtype_become_flash_attention_calls():
    """fp32 chains and 16-bit ones (under autocast, or a 16-bit model) become the plugin's
    flash attention; a chain whose result's dtype differs from its operands' (fp32
    operands under autocast) stays as written."""
    q, k, v = (t.bfloat16() for t in qkv(2, 37, KEYS, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        count, gm = _rewritten(Chain("matmul_mul"), q, k, v)
        assert count == 1 and _calls(gm) == [flash_attention], gm.code
        torch.testing.assert_close(gm(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=2e-2, rtol=4e-2)
        assert _rewritten(Chain("matmul_mul"), *(t.float() for t in (q, k, v)))[0] == 0
    for dtype in (torch.float16, torch.bfloat16):
        count, gm = _rewritten(Chain("at_div_method"), *(t.to(dtype) for t in (q, k, v)))
        assert count == 1 and _calls(gm) == [flash_attention], gm.code
    count, gm = _rewritten(Chain("at_div_method"), *(t.float() for t in (q, k, v)))
    assert count == 1 and _calls(gm) == [flash_attention], gm.code


def test_an_inference_graph_keeps_16_bit_chains_as_written():
    """The flash call serves the backward alone: without gradients a 16-bit chain stays as
    the user wrote it (its groups checked against it), an fp32 one is still rewritten."""
    q, k, v = (t.bfloat16() for t in qkv(2, 37, KEYS, 16))
    gm = capture(Chain("matmul_mul"), q, k, v)
    assert rewrite_written_out_attention(gm, gradients=False) == 0
    gm = capture(Chain("matmul_mul"), *(t.float() for t in (q, k, v)))
    assert rewrite_written_out_attention(gm, gradients=False) == 1


def test_the_plugin_rewrites_16_bit_chains_only_when_compiling_with_gradients():
    q, k, v = (t.bfloat16() for t in qkv(1, 37, KEYS, 16))
    for grad in (False, True):
        fused = autofuser.fuse(Chain("matmul_mul"), progress=False, tune=False, verify_speed=False)
        with torch.set_grad_enabled(grad):
            fused(*(t.requires_grad_(grad) for t in (q.clone(), k.clone(), v.clone())))
        summaries = [g.reason for g in fused.report().fused if g.strategy == "softmax_attention"]
        assert len(summaries) == 1 and ("flash_attention call" in summaries[0]) == grad, summaries


def _projections_under_autocast(batch: int):
    """q, k, v as the bf16 outputs of fp32 projections under autocast, a model's way."""
    q, k, v = (t._base for t in qkv(batch, 41, KEYS, 16, grad=True))
    weights = [torch.randn(32, 32) / 32**0.5 for _ in range(3)]
    return [t.detach().requires_grad_() for t in (q, k, v)], weights


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_training_under_autocast_is_as_near_float64_as_eager(batch):
    """Under autocast the chain becomes the flash call: the fused step's output and
    gradients are no farther from a float64 run than eager's (which rounds its scores
    to bf16 first), within bf16's tolerance."""

    class Projected(nn.Module):
        def __init__(self, weights):
            super().__init__()
            self.w = nn.ParameterList(nn.Parameter(w) for w in weights)
            self.chain = Chain("at_div_method")

        def forward(self, q, k, v):
            q, k, v = (rearrange(t @ w, "b l (h d) -> b h l d", h=2) for t, w in zip((q, k, v), self.w))
            return self.chain(q, k, v)

    (q, k, v), weights = _projections_under_autocast(batch)
    model = Projected(weights)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    grad = torch.randn(batch, 2, 41, 16)
    results = {}
    for name, runner, autocast, dtype in (
        ("fused", fused, True, torch.float32),
        ("eager", model, True, torch.float32),
        ("float64", model, False, torch.float64),
    ):
        if dtype == torch.float64:
            model.double()  # last: the fused model has run
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = runner(*leaves)
        grads = torch.autograd.grad(out, [*leaves, *model.parameters()], grad.to(out.dtype))
        results[name] = [out.detach(), *grads]
    summaries = [g.reason for g in fused.report().fused if g.strategy == "softmax_attention"]
    assert len(summaries) == 1 and "flash_attention call" in summaries[0], summaries
    for j, (got, eager, exact) in enumerate(zip(results["fused"], results["eager"], results["float64"])):
        error = float((got.double() - exact).norm() / exact.norm())
        eager_error = float((eager.double() - exact).norm() / exact.norm())
        assert error <= max(2 * eager_error, 1e-2), (j, error, eager_error)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_the_fused_backward_holds_no_scores_tensor():
    n, m = 37, KEYS
    model = Chain("matmul_mul")
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    q, k, v = qkv(3, n, m, 16, grad=True)
    fused(q, k, v).sum().backward()  # compiles
    seen = {}
    for name, runner in (("fused", fused), ("eager", model)):
        out = runner(q, k, v)
        with _Shapes() as recorder:
            out.square().sum().backward()
        seen[name] = [s for s in recorder.shapes if s[-2:] == (n, m)]
    assert seen["eager"], "the recorder must see eager's N x M tensors in its backward"  # so the next check can fail
    assert not seen["fused"], seen["fused"]


@pytest.mark.parametrize("strict", ["tf32x3", "ieee"])
def test_an_fp32_call_keeps_the_precision_its_compile_chose(strict, monkeypatch):
    """``fuse(strict_fp32_products=...)`` is in force while compiling; the flash kernels
    launch later, so the rewrite passes the compile's choice to the call."""
    rewritten = []

    def spy(gm, gradients=True):
        count = rewrite_written_out_attention(gm, gradients)
        rewritten.extend(n.kwargs.get("precision") for n in gm.graph.nodes if n.target is flash_attention)
        return count

    import autofuser_plugins.attention as plugin

    monkeypatch.setattr(plugin, "rewrite_written_out_attention", spy)
    fused = autofuser.fuse(
        Chain("matmul_mul"), strict_fp32_products=strict, progress=False, tune=False, verify_speed=False
    )
    fused(*qkv(1, 37, KEYS, 16))
    assert rewritten == [strict]
    q, k, v = (t.bfloat16() for t in qkv(1, 37, KEYS, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        count, gm = _rewritten(Chain("matmul_mul"), q, k, v)
    (call,) = [n for n in gm.graph.nodes if n.target is flash_attention]
    assert "precision" not in call.kwargs  # 16-bit products: no fp32 precision to keep
