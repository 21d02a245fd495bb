"""Passes over q, k and v before softmax attention (``plugins/attention/prepass.py``).

From 256 queries on, the attention strategy runs passes over its inputs first:

- in strict fp32, q and v are scaled by a power of two per row and k once per
  batch entry, each is split into two fp16 parts, and every product runs as
  three fp16 products (3xFP16);
- under autocast with fp32 inputs, k and v are converted to the 16-bit
  operand dtype once, instead of in every program.

Checked here against eager and against float64, on awkward shapes and on
inputs whose rows span twelve orders of magnitude (the case scaling is for),
with rows of zeros, infinities and masks; and which groups get which pass.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from test_attention import TOLERANCES, Attention, attention_function, extras_for, make_input, run_fused

import autofuser

N, M = 300, 277  # 300 queries: passes run; 277 keys: the last key block is partial


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def chain_source(fused) -> str:
    (kernel,) = [k for k in fused.kernels() if k.source.layout in ("attention", "attention_chain")]
    return kernel.source.source


def worst_row_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest error of an output row relative to that row's norm (float64 reference)."""
    diff = (got.double() - reference).flatten(0, -2).norm(dim=-1)
    size = reference.flatten(0, -2).norm(dim=-1)
    return float((diff / size.clamp_min(1e-300)).max())


@pytest.mark.parametrize("form", ["sdpa_bool_mask", "sdpa_causal", "written_scale_bias", "timm"])
@pytest.mark.parametrize("d", [24, 64])
def test_split_pass_matches_eager_and_float64(form, d):
    q, k, v = (make_input(1, length, d, "rearranged", torch.float32) for length in (N, M, M))
    if form == "sdpa_causal":
        k, v = make_input(1, N, d, "rearranged", torch.float32), make_input(1, N, d, "rearranged", torch.float32)
    extras = extras_for(form, 1, N, k.shape[1], torch.float32)
    model = Attention(form, "rearranged")
    fused, got, expected = run_fused(model, q, k, v, *extras)
    assert "split pass over k, split pass over v" in chain_source(fused)
    torch.testing.assert_close(got, expected, equal_nan=True, **TOLERANCES[torch.float32])
    with torch.no_grad():
        reference = model(
            q.double(), k.double(), v.double(), *[e.double() if e.is_floating_point() else e for e in extras]
        )
    rows = ~reference.isnan().any(-1)
    eager_error = worst_row_error(expected[rows], reference[rows])
    assert worst_row_error(got[rows], reference[rows]) <= 4 * eager_error + 1e-7


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def spread(shape, exponents=(-8, 4)) -> torch.Tensor:
    """Normal values, each row scaled by 10^U(exponents): rows 12 orders of magnitude apart."""
    scale = 10.0 ** torch.empty(shape[:-1] + (1,)).uniform_(*exponents)
    return torch.randn(shape) * scale


def test_split_pass_keeps_fp32_accuracy_across_magnitudes():
    """Fp32 accuracy against float64 with rows of v spanning magnitudes (each scaled on its
    own) and keys from 1e-8 to 1 (one scale per head, enough for the scores' absolute error):
    an unscaled fp16 split would leave small rows in fp16's subnormals (errors of 1e-3 and
    worse near 1e-8)."""
    q = torch.randn(1, 2, N, 24) * 0.3
    # Keys up to 1 (larger scores make the softmax itself ill-conditioned: eager's fp32 error
    # grows with them), values up to 1e4.
    k, v = spread((1, 2, M, 24), (-8, 0)), spread((1, 2, M, 24))
    k[0, 0, 5] = 0.0  # a key of zeros, and a value of zeros
    v[0, 1, 7] = 0.0
    v[0, 0] *= 1e-6  # a whole head of tiny values
    fused, got, expected = run_fused(Sdpa(), q, k, v)
    assert "split pass over k" in chain_source(fused)
    reference = Sdpa()(q.double(), k.double(), v.double())
    eager_error = worst_row_error(expected, reference)
    error = worst_row_error(got, reference)
    assert error <= 4 * eager_error + 1e-7, (error, eager_error)
    assert error < 2e-5


def test_split_pass_keeps_infinities_and_nan():
    """Non-finite outputs exactly where eager's are (an infinity may come out NaN: ``0 * inf``
    in a low-part product, as with 3xTF32), and every finite output right: a row of v
    holding an infinity must not wipe out its neighbours' small values."""
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    clean = (q.clone(), k.clone(), v.clone())
    v[0, 0, 3, 5] = float("inf")
    v[0, 0, :64] *= 1e-6  # the infinity's neighbours in its key block: small
    k[0, 1, 4, 2] = float("nan")
    model = Sdpa().eval()
    with torch.no_grad():
        expected = model(q, k, v)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(*clean)  # compiled on finite inputs, then run on the non-finite ones
        (kernel,) = [k for k in fused.kernels() if k.source.layout == "attention_chain"]
        got = kernel(q, k, v)
    assert expected[0, 0, :, 5].isinf().all() and expected[0, 1].isnan().all()
    finite = expected.isfinite()
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got[finite], expected[finite], **TOLERANCES[torch.float32])


@pytest.mark.parametrize("form", ["sdpa", "sdpa_float_mask", "written_masked_fill", "einsum"])
def test_copy_pass_under_autocast(form):
    """fp32 inputs under autocast: k and v converted to bf16 once, by the pass."""
    q, k, v = (make_input(1, length, 24, "transposed", torch.float32) for length in (N, M, M))
    extras = extras_for(form, 1, N, M, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, got, expected = run_fused(Attention(form, "transposed"), q, k, v, *extras)
    source = chain_source(fused)
    assert "copy pass over k, copy pass over v" in source
    assert attention_function(source).count("tl.store(") == 1  # the output's: no scores written
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), equal_nan=True, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("case", ["few_queries", "tf32", "bf16_inputs", "fp16_autocast_over_fp16"])
def test_no_pass_where_it_cannot_pay(case):
    """Fewer than 256 queries, TF32 products, or k and v already in the operand dtype:
    one kernel reads them as they are."""
    n, dtype = (100, torch.float32) if case == "few_queries" else (N, torch.float32)
    if case == "bf16_inputs":
        dtype = torch.bfloat16
    if case == "fp16_autocast_over_fp16":
        dtype = torch.float16
    q, k, v = (torch.randn(1, 2, length, 16, dtype=dtype) for length in (n, M, M))
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if case == "tf32" else "highest")
    try:
        with torch.autocast("cpu", dtype=torch.float16, enabled=case == "fp16_autocast_over_fp16"):
            fused, got, expected = run_fused(Sdpa(), q, k, v)
    finally:
        torch.set_float32_matmul_precision(old)
    assert "pass over" not in chain_source(fused)
    tolerance = dict(atol=5e-3, rtol=5e-3) if case == "tf32" else TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


def test_split_chains_skip_the_configs_that_miscompiled_on_a_gpu():
    """8 warps with 2 pipeline stages gave wrong 3xFP16 results on an H200 (Triton 3.6): the
    validity rule refuses them for split chains only (verification would keep such a group
    eager, losing it)."""
    from autofuser_core.planner import plan_fusion_groups
    from autofuser_plugins.attention import strategy as attention

    def program(autocast: bool):
        q, k, v = (torch.randn(1, 2, N, 64) for _ in range(3))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            plan = plan_fusion_groups(autofuser.capture(Sdpa(), q, k, v), autofuser.load_plugins().registry)
        (candidate,) = [c for c in plan.kept if c.strategy.name == "softmax_attention"]
        return candidate.program

    two_stages = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    assert "miscompute" in attention.is_valid(program(False), two_stages)
    assert attention.is_valid(program(False), {**two_stages, "num_stages": 3}) is None
    assert attention.is_valid(program(True), two_stages) is None  # the bf16 copy chain keeps them


class Causal(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("big", [1e2, 1e4, 1e6])
def test_split_pass_keeps_small_value_rows_beside_a_large_one(big):
    """Causal: queries 0-99 see only keys 0-99, whose values are 1e-6; key 120, in the same
    block of keys, is ``big``. Their outputs must keep fp32 accuracy relative to themselves
    (scaling p per block of keys would push the small rows into fp16's subnormals)."""
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    v[..., :100, :] *= 1e-6
    v[..., 120, :] *= big
    fused, got, expected = run_fused(Causal(), q, k, v)
    assert "split pass over v" in chain_source(fused)
    reference = Causal()(q.double(), k.double(), v.double())
    early = slice(0, 100)
    eager_error = worst_row_error(expected[..., early, :], reference[..., early, :])
    assert worst_row_error(got[..., early, :], reference[..., early, :]) <= 4 * eager_error + 1e-7


@pytest.mark.parametrize("scale", [0.0, 1e-32])
def test_split_pass_with_a_block_of_zero_or_tiny_values(scale):
    """A whole block of value rows at 0 (or 1e-32, below the clamp on exponents): no
    overflow in the rescaling of p, no NaN."""
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    v[0, 0, :128] *= scale
    fused, got, expected = run_fused(Sdpa(), q, k, v)
    assert "split pass over v" in chain_source(fused)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


def test_split_chain_default_config_is_valid_at_wide_heads():
    """Head width 128 asks for 8 warps; with the split chain the default takes 3 stages
    (2 are refused) rather than falling through to the smallest tiles."""
    from autofuser_core.planner import plan_fusion_groups
    from autofuser_plugins.attention import strategy as attention

    q, k, v = (torch.randn(1, 2, N, 128) for _ in range(3))
    plan = plan_fusion_groups(autofuser.capture(Sdpa(), q, k, v), autofuser.load_plugins().registry)
    (candidate,) = [c for c in plan.kept if c.strategy.name == "softmax_attention"]
    config = attention.default_config(candidate.program)
    assert config["num_warps"] == 8 and config["num_stages"] == 3 and config["BLOCK_M"] == 64
    assert attention.is_valid(candidate.program, config) is None
