"""Slice ("physics") attention as Transolver writes it (the ``slice_attention`` strategy).

The zoo's ``PhysicsAttention`` (point-cloud variant: linear projections) is
fused into one group - slice weights with their temperature, aggregation with
the normalisation by the weight sums, attention among the slices, scatter
back - that runs as a chain of three kernels, and matches eager on awkward
shapes (37, 603 and 1127 points, head widths 16, 24 and 64, batch 1 and 3, 8 and
32 slices) in fp32, fp16 and bf16 (also under autocast). The report names
the form; a chain whose weights are used elsewhere is refused with a reason.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch
from einops import rearrange
from test_attention import TOLERANCES  # the softmax attention tests' tolerances

import autofuser
from autofuser.zoo.models import MODELS
from autofuser.zoo.models.transolver import PhysicsAttention
from autofuser_plugins.attention import strategy as S

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HEADS = 2
CASES = [
    # batch, points, head width, slices, dtype
    (3, 37, 24, 8, F32),
    (1, 1127, 16, 32, F32),
    (1, 37, 64, 8, F32),
    (3, 37, 16, 8, F16),
    # 1127 points once (fp32); bf16's long case needs fewer for the same ragged edges: with
    # the default config (4 splits of 64-point blocks) 603 points are 3 blocks a split, and
    # the last split ends in a partial block and empty ones, as 1127's (5 blocks a split) does.
    (1, 603, 16, 32, BF16),
    (1, 37, 64, 8, BF16),
]


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def make(width: int, slices: int, dtype) -> PhysicsAttention:
    model = PhysicsAttention(HEADS * width, HEADS, slices)
    with torch.no_grad():
        model.temperature.uniform_(0.3, 1.0)  # a different temperature per head
        for linear in (model.to_q, model.to_k, model.to_v):
            linear.weight.mul_(3.0)  # attention among the slices far from uniform
    return model.to(DEVICE, dtype).eval()


def run(model, x):
    # Strict fp32 convolutions on both sides: cuDNN's default runs eager's fp32 convolutions
    # (the zoo Transolver's, on a structured grid) in TF32, which fp32 tolerances do not cover.
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        expected = model(x)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(x)
    return fused, got, expected


def slice_groups(fused):
    return [g for g in fused.report().fused if g.strategy == "slice_attention"]


@pytest.mark.parametrize("batch,n,width,slices,dtype", CASES, ids=str)
def test_slice_attention_matches_eager_as_one_chain(batch, n, width, slices, dtype):
    model = make(width, slices, dtype)
    x = torch.randn(batch, n, HEADS * width, dtype=dtype, device=DEVICE)
    fused, got, expected = run(model, x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    (group,) = slice_groups(fused)
    assert group.reason.startswith(f"form slice: slice attention ({n} points -> {slices} slices"), group.reason
    # Every step is inside the group: the weights, their sum, the aggregation, q/k/v, the
    # softmax among slices and the scatter; nothing of it went to another group.
    assert group.ops.count("matmul.linear_module") == 4 and group.ops.count("reduction.softmax") == 2, group.ops
    assert {"reduction.sum", "matmul.einsum"} <= set(group.ops), group.ops
    chain = [k for k in fused.kernels() if k.source.layout == "attention_chain"]
    assert len(chain) == 1 and chain[0].source.source.count("@triton.jit\ndef af_attention_slice") == 3


def test_slice_attention_under_autocast_bf16():
    model = make(16, 8, F32)
    x = torch.randn(3, 37, HEADS * 16, device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        fused, got, expected = run(model, x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[BF16])
    assert len(slice_groups(fused)) == 1, str(fused.report())


class LeakyWeights(PhysicsAttention):
    """Slice attention that also returns a statistic of its slice weights."""

    def forward(self, x):
        x_mid, fx_mid = self._project(x)
        weights = torch.softmax(self.to_slice(x_mid) / self.temperature, dim=-1)
        norm = weights.sum(dim=2)
        tokens = torch.einsum("bhnd,bhng->bhgd", fx_mid, weights) / (norm[..., None] + 1e-5)
        q, k, v = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        mixed = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1) @ v
        return torch.einsum("bhgd,bhng->bhnd", mixed, weights), weights.amax(dim=-1)


def test_weights_used_elsewhere_are_refused_with_reason():
    model = LeakyWeights(HEADS * 16, HEADS, 8).to(DEVICE).eval()
    x = torch.randn(1, 37, HEADS * 16, device=DEVICE)
    fused, got, expected = run(model, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOLERANCES[F32])
    assert not slice_groups(fused)
    refused = [g for g in fused.report().groups if g.strategy == "slice_attention"]
    assert refused and refused[0].reason_code == "intermediate_used_elsewhere", str(fused.report())


def test_zoo_transolver_tiny_fuses_its_slice_attention():
    entry = MODELS["transolver"]
    model = entry.make("tiny").to(DEVICE).eval()
    x = entry.inputs(torch.rand(2, 17, 9, 2, device=DEVICE))
    fused, got, expected = run(model, x)
    torch.testing.assert_close(got, expected, **TOLERANCES[F32])
    groups = slice_groups(fused)
    assert len(groups) == len(model.blocks), str(fused.report())
    assert all(g.reason.startswith("form slice") for g in groups)


def test_tf32_products_fuse_slice_attention_without_pipelined_8_warp_configs():
    """With TF32 allowed the chain runs plain-TF32 products; 8-warp configurations with a
    pipelined loop faulted on an H200 (Triton 3.6), so none is proposed and the rule refuses them."""
    model = make(16, 8, F32)
    x = torch.randn(3, 37, HEADS * 16, device=DEVICE, dtype=F32)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 allowed
    try:
        fused, got, expected = run(model, x)
    finally:
        torch.set_float32_matmul_precision(before)
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)  # TF32 products on every side
    (group,) = slice_groups(fused)
    assert group.reason.startswith("form slice"), group.reason

    def program(precision, slices=64):
        dims = dict(g=slices, dx=16, df=16, dq=16, dv=16, n=11271)
        return SimpleNamespace(slices=SimpleNamespace(precision=precision, **dims))

    pipelined_8_warps = {"BLOCK_M": 128, "BLOCK_N": 64, "SPLITS": 16, "num_warps": 8, "num_stages": 2}
    assert "out of bounds" in S.slice_is_valid(program("tf32"), pipelined_8_warps)
    assert S.slice_is_valid(program("tf32x3"), pipelined_8_warps) is None
    assert S.slice_is_valid(program("tf32"), {**pipelined_8_warps, "num_stages": 1}) is None
    tf32 = S.slice_configs(program("tf32"))
    assert len(tf32) == len(S.SLICE_CONFIGS)
    assert not any("out of bounds" in (S.slice_is_valid(program("tf32"), c) or "") for c in tf32)
    assert any(c["num_warps"] == 8 and c["num_stages"] == 2 for c in S.slice_configs(program("ieee")))
    default = S.slice_default_config(program("tf32", 128))  # 8 warps for this many slices
    assert default["num_warps"] == 8 and default["num_stages"] == 1, default


class AuthorsForms(PhysicsAttention):
    """The forms of the authors' code: the temperature clamped, the norm offset by eps
    before its view and repeated over the head width."""

    def forward(self, x):
        x_mid, fx_mid = self._project(x)
        weights = torch.softmax(self.to_slice(x_mid) / torch.clamp(self.temperature, min=0.1, max=5), dim=-1)
        norm = weights.sum(2)
        tokens = torch.einsum("bhnd,bhng->bhgd", fx_mid, weights)
        tokens = tokens / ((norm + 1e-5)[:, :, :, None].repeat(1, 1, 1, fx_mid.shape[-1]))
        q, k, v = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        attention = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.scale, dim=-1)
        out = torch.einsum("bhgd,bhng->bhnd", torch.matmul(attention, v), weights)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_the_authors_clamped_temperature_and_repeated_norm_are_one_chain(dtype):
    model = AuthorsForms(HEADS * 24, HEADS, 8)
    with torch.no_grad():
        model.temperature.uniform_(0.05, 1.0)  # some heads below the clamp's minimum
    model = model.to(DEVICE, dtype).eval()
    x = torch.randn(3, 37, HEADS * 24, dtype=dtype, device=DEVICE)
    fused, got, expected = run(model, x)
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    (group,) = slice_groups(fused)
    assert {"elementwise.repeat", "attention.unsqueeze_index", "elementwise.add"} <= set(group.ops), group.ops
    # the clamp reads parameters only: computed beside the chain, which reads its result
    assert "elementwise.clamp" not in group.ops


def test_chains_differing_only_in_their_batch_are_two_kernels(tmp_path):
    """Two programs of one slice attention that differ only in the batch entries its
    launcher covers get two kernel names: a process reuses a loaded module by its name."""
    model = make(8, 5, torch.float32)
    fused = autofuser.fuse(
        model, progress=False, tune=False, verify_speed=False, cache_dir=str(tmp_path), dynamic=False
    )
    names = set()
    for batch in (2, 4):
        x = torch.randn(batch, 37, HEADS * 8, device=DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
        (group,) = slice_groups(fused)  # fused: not refused as a mismatch
        names.add(group.kernel)
    assert len(names) == 2
