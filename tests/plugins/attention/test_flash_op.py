"""``flash_attention`` and its two operators (``plugins/attention/flash_op.py``).

The call's result and its gradients match attention computed in float64 (fp32: no
farther than eager SDPA's own error, times a small factor; 16-bit: within the dtype's
tolerance, under autocast too), on awkward shapes, causal or not, through the
kernels (the interpreter here) and through the torch-ops reference that serves a CPU
without Triton, a block of queries at a time; its second derivatives (``create_graph``)
match float64's; ``make_fx`` sees each operator as one node, so a traced backward
holds no scores tensor; what it does not take raises ``ValueError``.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from autofuser_plugins.attention import flash_op
from autofuser_plugins.attention.flash_op import flash_attention, reference_backward, reference_forward

from _helpers import reference_path_only

# Largest error of a result against float64, relative to the largest float64 entry.
TOLERANCES = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: fp32: no farther from float64 than this many times eager SDPA's own distance (plus a floor).
FP32_FACTOR, FP32_FLOOR = 4.0, 1e-6

SHAPES = [  # (B, H, N, M, D, Dv)
    (1, 1, 37, 53, 24, 24),
    (3, 2, 70, 19, 16, 40),
    (1, 2, 33, 33, 72, 8),
]


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def _operands(shape, dtype):
    """q, k, v as [B, H, L, D] views of [B, L, H, D] tensors (a model's layout), and a non-contiguous dout."""
    b, h, n, m, d, dv = shape
    q, k, v = (torch.randn(b, length, h, width).transpose(1, 2) for length, width in ((n, d), (m, d), (m, dv)))
    dout = torch.randn(b, h, dv, n).transpose(-1, -2)
    return [t.to(dtype) for t in (q, k, v)], dout.to(dtype)


def _float64(q, k, v, dout, scale, causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.double())]


def _written_out(q, k, v, is_causal, scale):
    """Attention in torch ops (SDPA's CPU kernel has no second derivative)."""
    s = q @ k.transpose(-1, -2) * scale
    if is_causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def _distance(got, expected) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max())


def _run(runner, q, k, v, dout, scale, causal):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = runner(*leaves, is_causal=causal, scale=scale)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def _check(got, q, k, v, dout, scale, causal):
    expected = _float64(q, k, v, dout, scale, causal)
    names = ("out", "dq", "dk", "dv")
    if q.dtype == torch.float32:
        eager = _run(F.scaled_dot_product_attention, q, k, v, dout, scale, causal)
        for name, g, e, x in zip(names, got, eager, expected):
            limit = FP32_FACTOR * _distance(e, x) + FP32_FLOOR
            assert _distance(g, x) <= limit, (name, _distance(g, x), limit)
    else:
        for name, g, x in zip(names, got, expected):
            assert g.dtype == q.dtype, name
            assert _distance(g, x) <= TOLERANCES[q.dtype], (name, _distance(g, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_result_and_gradients_match_float64(shape, causal, dtype):
    (q, k, v), dout = _operands(shape, dtype)
    got = _run(flash_attention, q, k, v, dout, 0.3, causal)
    assert got[0].is_contiguous() and got[0].shape == (*q.shape[:3], v.shape[-1])
    _check(got, q, k, v, dout, 0.3, causal)


def _reference_only(monkeypatch) -> list[str]:
    """The operators as on a CPU without Triton; returns the names of the reference
    functions as they are called (the kernels raise)."""
    monkeypatch.setattr(flash_op, "interpreting", lambda: False)
    references = ("reference_forward", "reference_backward")
    return reference_path_only(monkeypatch, flash_op, references, flash_op.flash, ("flash_forward", "flash_backward"))


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_matches_float64_a_block_of_queries_at_a_time(monkeypatch, causal):
    """Where Triton can't run (a CPU without the interpreter) the operators are the torch-ops
    reference; with a small block budget its loop over query blocks runs several times."""
    monkeypatch.setattr(flash_op, "REFERENCE_BLOCK_SCORES", 2 * 53 * 10)
    calls = _reference_only(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        (q, k, v), dout = _operands((2, 1, 37, 53, 24, 16), dtype)
        assert len(flash_op._query_blocks(q, 53)) > 2
        got = _run(flash_attention, q, k, v, dout, None, causal)
        _check(got, q, k, v, dout, 24**-0.5, causal)
    assert calls == ["reference_forward", "reference_backward"] * 2, calls


def test_the_reference_computes_in_fp32_under_the_callers_autocast(monkeypatch):
    """An operator's body runs under the caller's autocast: the reference turns it off, or
    its lse would come from 16-bit scores and its backward, recomputing them in fp32,
    would not normalise its probabilities. Backward inside autocast too."""
    calls = _reference_only(monkeypatch)
    (q, k, v), dout = _operands((1, 2, 64, 300, 16, 16), torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = flash_op.attention_forward(*leaves, 0.25, False, "")
        grads = torch.autograd.grad(out, leaves, dout)
    assert calls == ["reference_forward", "reference_backward"], calls
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * 0.25
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
    _check([out.detach(), *grads], q, k, v, dout, 0.25, False)


def test_the_reference_and_the_kernels_agree():
    (q, k, v), dout = _operands((1, 2, 45, 61, 16, 24), torch.float32)
    out, lse = flash_op.attention_forward(q, k, v, 0.25, True, "")
    ref_out, ref_lse = reference_forward(q, k, v, 0.25, True)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    got = flash_op.attention_backward(q, k, v, out, lse, dout, 0.25, True, "")
    for g, r in zip(got, reference_backward(q, k, v, out, lse, dout, 0.25, True)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_autocast_runs_it_in_the_autocast_dtype():
    (q, k, v), dout = _operands((1, 2, 29, 41, 16, 16), torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attention(*leaves)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, leaves, dout.bfloat16())
    assert all(g.dtype == torch.float32 for g in grads)  # back through autocast's casts
    expected = _float64(q, k, v, dout, 16**-0.5, False)
    for name, g, x in zip(("out", "dq", "dk", "dv"), [out.detach(), *grads], expected):
        assert _distance(g, x) <= TOLERANCES[torch.bfloat16], (name, _distance(g, x))


@pytest.mark.parametrize("causal", [False, True])
def test_second_derivatives_match_float64(causal):
    """A loss of the gradients (``create_graph=True``, a physics-informed loss's way) is
    differentiated through the operators' own backward."""
    (q, k, v), dout = _operands((1, 2, 13, 17, 8, 8), torch.float32)

    def gradient_of_gradient_norm(runner, leaves, grad):
        out = runner(*leaves, is_causal=causal, scale=0.4)
        first = torch.autograd.grad(out, leaves, grad, create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in first), leaves)

    got = gradient_of_gradient_norm(flash_attention, [t.clone().requires_grad_() for t in (q, k, v)], dout)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = gradient_of_gradient_norm(_written_out, leaves, dout.double())
    for name, g, x in zip("qkv", got, expected):
        assert _distance(g, x) <= 1e-4, (name, _distance(g, x))


def test_a_traced_backward_holds_the_operators_not_the_scores():
    (q, k, v), dout = _operands((1, 2, 40, 50, 8, 8), torch.float32)

    def backward(q, k, v, dout):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            return torch.autograd.grad(flash_attention(*leaves), leaves, dout)

    gm = make_fx(backward, decomposition_table=dict(core_aten_decompositions()))(q, k, v, dout)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert f"{flash_op.LIBRARY}.forward.default" in targets and f"{flash_op.LIBRARY}.backward.default" in targets
    shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert not [s for s in shapes if s[-2:] == (40, 50)], shapes
    for g, e in zip(gm(q, k, v, dout), _run(flash_attention, q, k, v, dout, None, False)[1:]):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(attn_mask=torch.ones(5, 7, dtype=torch.bool)), "attn_mask"),
        (dict(dropout_p=0.1), "dropout_p"),
        (dict(enable_gqa=True), "enable_gqa"),
        (dict(is_causal=1), "is_causal"),
    ],
)
def test_what_it_does_not_take_raises(kwargs, words):
    q, k, v = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 4)
    with pytest.raises(ValueError, match=words):
        flash_attention(q, k, v, **kwargs)


def test_other_ranks_and_dtypes_raise():
    with pytest.raises(ValueError, match="4-d"):
        flash_attention(torch.randn(5, 4), torch.randn(7, 4), torch.randn(7, 4))
    with pytest.raises(ValueError, match="float64"):
        flash_attention(*(torch.randn(1, 1, 5, 4, dtype=torch.float64) for _ in range(3)))


def test_the_precision_asked_for_reaches_the_backward_too(monkeypatch):
    """``flash_attention(..., precision=)`` is the compile's fp32 product precision: its
    backward, which autograd runs later, launches with it as the forward does."""
    asked = []
    for name in ("flash_forward", "flash_backward"):
        real = getattr(flash_op.flash, name)
        monkeypatch.setattr(
            flash_op.flash, name, lambda *args, _real=real, _name=name: asked.append((_name, args[-1])) or _real(*args)
        )
    q, k, v = (torch.randn(1, 2, 20, 8, requires_grad=True) for _ in range(3))
    flash_attention(q, k, v, precision="ieee").sum().backward()
    assert asked == [("flash_forward", "ieee"), ("flash_backward", "ieee")]
    with pytest.raises(ValueError, match="precision must be one of"):
        flash_attention(q, k, v, precision="fp64")
