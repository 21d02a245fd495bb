"""Linear attention (the ``attention`` plugin's ``linear_attention`` strategy).

Galerkin-type ``q @ (LN(k)^T @ LN(v)) / n``, written with einsum (as the zoo's
Galerkin Transformer) and with matmul and a ``k^T`` view, becomes one chain
of kernels with the layer norms inside; Fourier-type ``(q @ k^T) @ v / n``
runs as written (with a scale and an additive bias on the scores, or a
``masked_fill`` mask), and reassociated to ``q @ (k^T @ v)`` only with
``reassociate_products=True``. Each matches eager on awkward shapes (37 and
1127 points, head widths 16, 24 and 64, batch 1 and 3) in fp32, fp16 and
bf16, and the report names the form it recognised.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
from einops import rearrange
from test_attention import TOLERANCES  # the softmax attention tests' tolerances

import autofuser
from autofuser.zoo.models import MODELS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS = 2


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class Galerkin(nn.Module):
    """``q @ (LN(k)^T @ LN(v)) / n`` with q, k, v rearranged from one [B, N, 3 * H * D] tensor."""

    def __init__(self, width: int, style: str):
        super().__init__()
        self.style = style
        self.norm_k, self.norm_v = nn.LayerNorm(width), nn.LayerNorm(width)
        for p in (*self.norm_k.parameters(), *self.norm_v.parameters()):
            nn.init.normal_(p)  # a lowering that dropped them would show

    def forward(self, qkv):
        n = qkv.shape[1]
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=HEADS) for t in qkv.chunk(3, dim=-1))
        k, v = self.norm_k(k), self.norm_v(v)
        if self.style == "einsum":
            context = torch.einsum("bhnd,bhne->bhde", k, v) / n
            return torch.einsum("bhnd,bhde->bhne", q, context)
        context = torch.matmul(k.transpose(-2, -1), v) * (1.0 / n)
        return torch.matmul(q, context)


class Fourier(nn.Module):
    """``(q @ k^T) @ v / n``, optionally with a scale and an additive bias, or a mask, on the scores."""

    def __init__(self, extra: str):
        super().__init__()
        self.extra = extra

    def forward(self, q, k, v, bias, mask):
        n = q.shape[-2]
        scores = q @ k.transpose(-2, -1)
        if self.extra == "bias":
            scores = scores * 0.5 + bias
        elif self.extra == "mask":
            scores = scores.masked_fill(~mask, 0.0)
        return (scores @ v) / n


def run(model, *inputs, **options):
    model = model.to(DEVICE).eval()
    with torch.no_grad():
        expected = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, **options)
        got = fused(*inputs)
    return fused, got, expected


def linear_groups(fused):
    return [g for g in fused.report().fused if g.strategy == "linear_attention"]


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
GALERKIN_CASES = [
    # style, batch, points, head width, dtype: every shape in fp32, the awkward ones in fp16/bf16 too
    ("einsum", 3, 37, 24, F32),
    ("einsum", 1, 1127, 16, F32),
    ("einsum", 1, 37, 64, F32),
    ("einsum", 3, 37, 24, F16),
    ("einsum", 1, 1127, 16, BF16),
    ("einsum", 1, 37, 64, BF16),
    ("matmul", 3, 37, 24, F32),
    ("matmul", 1, 37, 16, F16),
    ("matmul", 3, 37, 64, BF16),
]


@pytest.mark.parametrize("style,batch,n,d,dtype", GALERKIN_CASES, ids=str)
def test_galerkin_matches_eager_as_one_chain(style, batch, n, d, dtype):
    model = Galerkin(d, style).to(dtype)
    qkv = torch.randn(batch, n, 3 * HEADS * d, dtype=dtype, device=DEVICE)
    fused, got, expected = run(model, qkv)
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    (group,) = linear_groups(fused)
    assert group.reason.startswith("form galerkin"), group.reason
    assert "layer norm on k and layer norm on v" in group.reason, group.reason
    assert set(group.ops) >= {"reduction.layer_norm_module"}, group.ops
    # The only groups with products are the linear attention's: k^T v never went to a generic group.
    assert not [g for g in fused.report().fused if g is not group and any(op.startswith("matmul.") for op in g.ops)]


def test_galerkin_under_autocast_bf16():
    model = Galerkin(16, "einsum").to(DEVICE).eval()
    qkv = torch.randn(3, 37, 3 * HEADS * 16, device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        expected = model(qkv)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(qkv)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[torch.bfloat16])
    assert [g.reason.split(":")[0] for g in linear_groups(fused)] == ["form galerkin"]


def _fourier_inputs(batch, n, d, dtype):
    q, k, v = (torch.randn(batch, HEADS, n, d, dtype=dtype, device=DEVICE) for _ in range(3))
    bias = torch.randn(batch, 1, n, n, dtype=dtype, device=DEVICE)  # broadcast over heads
    mask = torch.rand(n, n, device=DEVICE) > 0.3
    return q, k, v, bias, mask


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("extra,batch,n,d", [("bias", 3, 37, 24), ("mask", 1, 37, 64), ("none", 1, 53, 16)])
def test_fourier_as_written_by_default(extra, batch, n, d, dtype):
    """As written the cost is quadratic in the points, under the interpreter too: 1127
    points run reassociated (below) only."""
    fused, got, expected = run(Fourier(extra), *_fourier_inputs(batch, n, d, dtype))
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    (group,) = linear_groups(fused)
    assert group.reason.startswith("form fourier: (q @ k^T) @ v as written"), group.reason
    kernel = [k for k in fused.kernels() if k.source.layout == "attention"]
    assert len(kernel) == 1 and kernel[0].source.source.count("tl.store(") == 1  # no N x N scores written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fourier_reassociated_only_when_allowed(dtype):
    inputs = _fourier_inputs(1, 1127, 16, dtype)
    fused, got, expected = run(Fourier("none"), *inputs, reassociate_products=True)
    # Reassociation changes the rounding: the products' sums run in another order.
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    (group,) = linear_groups(fused)
    assert group.reason.startswith("form fourier: (q @ k^T) @ v reassociated"), group.reason
    assert [k.source.layout for k in fused.kernels()] == ["attention_chain"]


def test_fourier_with_bias_is_not_reassociated():
    """A bias on the scores can't be moved past the product: as written, and the report says why."""
    fused, got, expected = run(Fourier("bias"), *_fourier_inputs(3, 37, 16, F32), reassociate_products=True)
    torch.testing.assert_close(got, expected, **TOLERANCES[F32])
    (group,) = linear_groups(fused)
    assert "can't be reassociated" in group.reason, group.reason


def test_context_used_elsewhere_is_refused_with_reason():
    class Leaky(nn.Module):
        def forward(self, q, k, v):
            context = torch.einsum("bhnd,bhne->bhde", k, v) / q.shape[-2]
            return torch.einsum("bhnd,bhde->bhne", q, context), context.sum()

    q, k, v = (torch.randn(1, HEADS, 37, 16, device=DEVICE) for _ in range(3))
    fused, got, expected = run(Leaky(), q, k, v)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOLERANCES[torch.float32])
    refused = [g for g in fused.report().groups if g.strategy == "linear_attention" and not g.fused]
    assert refused and refused[0].reason_code == "intermediate_used_elsewhere", str(fused.report())


def test_zoo_galerkin_tiny_fuses_its_attention():
    entry = MODELS["galerkin"]
    model = entry.make("tiny").to(DEVICE)
    x = entry.inputs(torch.rand(2, 17, 9, 2, device=DEVICE))
    fused, got, expected = run(model, x)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    groups = linear_groups(fused)
    assert len(groups) == len(model.blocks), str(fused.report())
    assert all(
        g.reason.startswith("form galerkin") and "layer norm on k and layer norm on v" in g.reason for g in groups
    )


def test_einsum_transposed_a_alone_stays_eager_with_reason():
    """k^T v by itself is an extern op: no generic group takes it, and it runs eager."""

    class Context(nn.Module):
        def forward(self, k, v):
            return torch.einsum("bnd,bne->bde", k, v) * 2.0

    k, v = torch.randn(3, 37, 16, device=DEVICE), torch.randn(3, 37, 24, device=DEVICE)
    fused, got, expected = run(Context(), k, v)
    torch.testing.assert_close(got, expected)
    report = fused.report()
    assert not [g for g in report.fused if "matmul.einsum" in g.ops]
    assert [(n.node, n.reason_code) for n in report.unfused_nodes] == [("einsum", "extern_not_taken")], str(report)


def test_chain_warmup_compiles_every_stage_with_its_own_arguments():
    """``warmup`` (the parallel compiler's entry point) reaches each kernel of a chain with
    that kernel's pointer types and constants; no GPU needed to check the plumbing."""
    model = Galerkin(16, "einsum")
    qkv = torch.randn(1, 37, 3 * HEADS * 16, dtype=torch.float16, device=DEVICE)
    fused, _, _ = run(model.to(torch.float16), qkv)
    (kernel,) = [k for k in fused.kernels() if k.source.layout == "attention_chain"]
    calls, stages = warmup_calls(kernel)
    assert [c[0] for c in calls] == [s["name"] for s in stages]
    for (name, args, kwargs), stage in zip(calls, stages):
        assert len(args) == len(stage["pointers"]) and kwargs["num_warps"] == kernel.launch_args["num_warps"]
        assert {k: kwargs[k] for k in stage["constexprs"]} == stage["constexprs"]
        for arg, pointer in zip(args, stage["pointers"]):
            # the model's tensors (parameters included) are fp16; the chain's scratch buffers fp32
            assert arg == (torch.float16 if pointer.startswith("in") or pointer == "out0" else torch.float32)


def test_galerkin_chains_differing_only_in_their_batch_are_two_kernels(tmp_path):
    """Two shapes whose chains differ only in the launcher (the batch entries it launches
    over) get two kernel names: a process reuses a loaded module by its name."""
    model = Galerkin(16, "einsum").to(DEVICE).eval()
    fused = autofuser.fuse(
        model, progress=False, tune=False, verify_speed=False, cache_dir=str(tmp_path), dynamic=False
    )
    names = set()
    for batch in (3, 5):
        qkv = torch.randn(batch, 37, 3 * HEADS * 16, device=DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(fused(qkv), model(qkv), **TOLERANCES[F32])
        (group,) = linear_groups(fused)  # fused: not refused as a mismatch
        names.add(group.kernel)
    assert len(names) == 2


def warmup_calls(kernel):
    """Each stage's ``warmup`` call as a chain kernel's ``warmup`` makes it (stage name, its
    positional arguments, its keyword arguments), recorded instead of compiled; and the stages."""
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def warmup(self, *args, grid, **kwargs):
            calls.append((self.name, args, kwargs))

    module = __import__("sys").modules[type(kernel.kernel).__module__]
    stages = kernel.kernel.stages(kernel.launch_args)
    saved = {s["name"]: getattr(module, s["name"]) for s in stages}
    try:
        for name in saved:
            setattr(module, name, Recorder(name))
        dtypes = [*kernel.kernel_dtypes, *[dtype for _, _, dtype in kernel.output_layout]]
        kernel.kernel.warmup(*dtypes, grid=(1,), **kernel.launch_args)
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
    return calls, stages
