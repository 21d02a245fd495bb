"""The hand-written flash attention kernels (``plugins/attention/flash.py``).

Forward (out and lse) and backward (dq, dk, dv) match a float64 reference
computed with plain torch math (scores, softmax, autograd) on awkward shapes:
37 or 70 queries against 53 or 19 keys, head widths 16/24/40/72 with v's
differing from q's, batch 1 and 3, 1 and 2 heads, causal and not, q/k/v as
transposed ``[B, N, H, D]`` views and a transposed dout, in fp32, fp16 and
bf16. fp32 must be no more than 4x as far from float64 as eager fp32
``F.scaled_dot_product_attention`` is (forward and each gradient); 16-bit
dtypes have their own tolerances. Small tiles make every loop run several
blocks, with query and key blocks of different sizes. The backward is
deterministic, and bad input is refused with a message naming the fix.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from autofuser_plugins.attention import flash

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: 16-bit inputs (p, ds and the outputs rounded to the dtype as eager rounds them; fp16
#: keeps 11 bits, bf16 8): the largest error against float64 relative to the reference's
#: largest magnitude, and the error's L2 norm relative to the reference's. The second
#: catches what is wrong everywhere by less than one rounding step (a gradient's scale
#: off by 1%) but averages rounding down.
TOLERANCES = {torch.float16: (2e-3, 8e-4), torch.bfloat16: (1.6e-2, 6e-3)}
#: fp32: at most this multiple of eager fp32's own error, plus a floor (eager can be exact
#: by chance on a small tensor).
EAGER_MULTIPLE, FP32_FLOOR = 4.0, 1e-6
#: lse comes from fp32 scores of the inputs as given, in every dtype.
LSE_TOLERANCE = 1e-5

CASES = [
    # batch, heads, queries, keys, q/k width, v width, causal, layout of q, k, v and dout
    pytest.param(1, 1, 37, 53, 16, 16, False, "contiguous", id="b1h1-37x53-d16"),
    pytest.param(3, 2, 37, 53, 24, 40, True, "transposed", id="b3h2-37x53-d24-dv40-causal"),
    pytest.param(1, 2, 70, 19, 40, 40, True, "transposed", id="b1h2-70x19-d40-causal"),
    pytest.param(3, 1, 70, 19, 72, 24, False, "transposed", id="b3h1-70x19-d72-dv24"),
]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def make(batch, heads, rows, width, dtype, layout):
    """A random [B, H, rows, width] tensor; ``transposed``: a view of a [B, rows, H, width] one."""
    if layout == "transposed":
        return torch.randn(batch, rows, heads, width, dtype=dtype, device=DEVICE).transpose(1, 2)
    return torch.randn(batch, heads, rows, width, dtype=dtype, device=DEVICE)


def reference(q, k, v, dout, scale, causal):
    """(out, lse, dq, dk, dv) in float64 from plain torch math on the inputs as given."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = scale * q @ k.transpose(-1, -2)
    if causal:
        n, m = scores.shape[-2:]
        after = torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(after, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(scores, dim=-1).detach(), q.grad, k.grad, v.grad


def eager(q, k, v, dout, scale, causal):
    """(out, dq, dk, dv) of eager ``F.scaled_dot_product_attention`` in the inputs' dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude; absolute where the
    reference is all zeros (dq of a lone causal query, whose softmax is constant)."""
    largest = ref.abs().max().item()
    return (x.double() - ref).abs().max().item() / (largest if largest > 0 else 1.0)


def l2_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def run(batch, heads, n, m, d, dv, causal, layout, dtype, scale=None):
    """Both passes on fresh inputs: the errors of out, dq, dk and dv against float64 (each
    ``(error, l2_error)``), lse's (absolute, relative where it passes 1), and eager's
    ``error`` where the dtype is fp32."""
    q, k = make(batch, heads, n, d, dtype, layout), make(batch, heads, m, d, dtype, layout)
    v = make(batch, heads, m, dv, dtype, layout)
    dout = make(batch, heads, n, dv, dtype, layout)
    scale = 1 / math.sqrt(d) if scale is None else scale
    out, lse = flash.flash_forward(q, k, v, scale, causal)
    dq, dk, dv_ = flash.flash_backward(q, k, v, out, lse, dout, scale, causal)

    assert out.shape == (batch, heads, n, dv) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (batch, heads, n) and lse.dtype == torch.float32 and lse.is_contiguous()
    for grad, like in ((dq, q), (dk, k), (dv_, v)):
        assert grad.shape == like.shape and grad.dtype == dtype and grad.is_contiguous()

    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, scale, causal)
    pairs = {"out": (out, ref_out), "dq": (dq, ref_dq), "dk": (dk, ref_dk), "dv": (dv_, ref_dv)}
    ours = {name: (error(x, ref), l2_error(x, ref)) for name, (x, ref) in pairs.items()}
    lse_error = (lse.double() - ref_lse).abs().max().item() / max(1.0, ref_lse.abs().max().item())
    theirs = None
    if dtype == torch.float32:
        e_out, e_dq, e_dk, e_dv = eager(q, k, v, dout, scale, causal)
        theirs = {"out": error(e_out, ref_out), "dq": error(e_dq, ref_dq), "dk": error(e_dk, ref_dk)}
        theirs["dv"] = error(e_dv, ref_dv)
    return ours, lse_error, theirs


def check(ours, lse_error, theirs, dtype):
    assert lse_error <= LSE_TOLERANCE, f"lse: error {lse_error:.2e}"
    for name, (err, l2) in ours.items():
        if dtype == torch.float32:
            bound = EAGER_MULTIPLE * theirs[name] + FP32_FLOOR
            assert err <= bound, f"{name}: error {err:.2e}, eager fp32's {theirs[name]:.2e}"
        else:
            largest, norm = TOLERANCES[dtype]
            assert err <= largest, f"{name}: error {err:.2e} over {largest:.0e}"
            assert l2 <= norm, f"{name}: L2 error {l2:.2e} over {norm:.0e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("batch, heads, n, m, d, dv, causal, layout", CASES)
def test_matches_float64(batch, heads, n, m, d, dv, causal, layout, dtype):
    check(*run(batch, heads, n, m, d, dv, causal, layout, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("held, step", [(16, 32), (32, 16)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_many_blocks(monkeypatch, held, step, causal, dtype):
    """Tiles of 16 and 32 rows: several query and key blocks in every loop, blocks of
    queries and keys of different sizes (the causal loops' bounds), last blocks partial."""
    monkeypatch.setattr(flash, "choose_blocks", lambda *args, **kwargs: flash.Blocks(held, step, 4, 1))
    check(*run(2, 2, 70, 53, 24, 40, causal, "transposed", dtype), dtype)


@pytest.mark.parametrize(
    "n, m, d, dv",
    [(1, 1, 1, 1), (5, 1, 3, 2), (1, 7, 256, 200)],
    ids=["one-query-one-key", "one-key", "widest-heads"],
)
def test_extreme_sizes(n, m, d, dv):
    """Single queries and keys, head widths of 1 and 256."""
    for causal in (False, True):
        check(*run(2, 1, n, m, d, dv, causal, "contiguous", torch.float32), torch.float32)


@pytest.mark.skipif(
    DEVICE.type != "cuda", reason="the interpreter runs one program at a time: no order of sums to vary, on a GPU only"
)
def test_backward_is_deterministic():
    q, k = make(1, 2, 70, 24, torch.float32, "transposed"), make(1, 2, 53, 24, torch.float32, "transposed")
    v, dout = make(1, 2, 53, 40, torch.float32, "transposed"), make(1, 2, 70, 40, torch.float32, "transposed")
    out, lse = flash.flash_forward(q, k, v, 0.2, True)
    first = flash.flash_backward(q, k, v, out, lse, dout, 0.2, True)
    second = flash.flash_backward(q, k, v, out, lse, dout, 0.2, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_wrong_scale_is_caught():
    """The positive control: a scale 2% off must fail the comparison."""
    q, k, v = (make(1, 1, 37, 16, torch.float32, "contiguous") for _ in range(3))
    out, _ = flash.flash_forward(q, k, v, 0.25 * 1.02, False)
    ref_out, *_ = reference(q, k, v, torch.ones_like(q), 0.25, False)
    assert error(out, ref_out) > 1e-3


def _tensors(dtype=torch.float32, q=(2, 2, 37, 16), k=(2, 2, 53, 16), v=(2, 2, 53, 24)):
    return [torch.randn(shape, device=DEVICE).to(dtype) for shape in (q, k, v)]


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda: _tensors(q=(2, 37, 16)), "q must be a 4-d tensor"),
        (lambda: _tensors(dtype=torch.float64), "share one dtype among float32, float16 and bfloat16"),
        (lambda: _tensors()[:2] + _tensors(dtype=torch.float16)[2:], "share one dtype"),
        (lambda: _tensors(k=(2, 1, 53, 16)), "same batch and heads"),
        (lambda: _tensors(k=(2, 2, 52, 16)), "as many keys"),
        (lambda: _tensors(k=(2, 2, 53, 24)), "same head width"),
        (lambda: _tensors(q=(2, 2, 37, 300), k=(2, 2, 53, 300)), "head widths up to 256"),
        (lambda: _tensors(v=(2, 2, 53, 0)), "at least 1"),
    ],
    ids=["rank", "float64", "mixed-dtypes", "heads", "keys", "width", "too-wide", "empty"],
)
def test_bad_input_is_refused(make_args, message):
    with pytest.raises(ValueError, match=message):
        flash.flash_forward(*make_args(), 0.25, False)


def test_bad_backward_input_is_refused():
    q, k, v = _tensors()
    out, lse = flash.flash_forward(q, k, v, 0.25, False)
    with pytest.raises(ValueError, match="lse must be"):
        flash.flash_backward(q, k, v, out, lse.double(), out, 0.25, False)
    with pytest.raises(ValueError, match="dout must be"):
        flash.flash_backward(q, k, v, out, lse, out[..., :8], 0.25, False)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(flash, "interpreting", lambda: False)
    q, k, v = (t.cpu() for t in _tensors())
    with pytest.raises(RuntimeError, match="CUDA device, or TRITON_INTERPRET=1"):
        flash.flash_forward(q, k, v, 0.25, False)


def test_a_precision_asked_for_reaches_every_fp32_product_and_a_bad_one_raises(monkeypatch):
    launched = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(kwargs.get("PRECISION"))
                return self.kernel[grid](*args, **kwargs)

            return run

    for name in ("_forward_kernel", "_dkdv_kernel", "_dq_kernel"):
        monkeypatch.setattr(flash, name, Recording(getattr(flash, name)))
    q, k, v = (torch.randn(1, 1, 20, 16, device=DEVICE) for _ in range(3))
    out, lse = flash.flash_forward(q, k, v, 0.25, False, "ieee")
    flash.flash_backward(q, k, v, out, lse, torch.randn_like(out), 0.25, False, "ieee")
    assert launched == ["ieee"] * 3
    with pytest.raises(ValueError, match="precision must be one of tf32, tf32x3, ieee"):
        flash.flash_forward(q, k, v, 0.25, False, "fp64")


def test_fp32_products_follow_torch_tf32_setting():
    """TF32 where torch allows it for matmuls, else 3xTF32 (near-fp32 accuracy)."""
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32  # a property of torch's cuBLAS settings: monkeypatch can't restore it
    try:
        matmul.allow_tf32 = False
        assert flash.dot_precision() == "tf32x3"
        matmul.allow_tf32 = True
        assert flash.dot_precision() == "tf32"
    finally:
        matmul.allow_tf32 = allowed
