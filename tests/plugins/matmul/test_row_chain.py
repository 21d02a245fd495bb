"""The row-tiled chain strategy (``autofuser_plugins.matmul.mlp.chain``): several
products, norms and softmaxes over one block of rows in one kernel.

Every case runs the whole pipeline under Triton's interpreter and compares
with eager on fresh random inputs: a transformer block's post-attention part
(residual, layer norm, MLP, residual, layer norm, next qkv projection), a
softmax between two products, three projections of one normalised input; at
widths that are not powers of two, batch 1 and 3, fp32/fp16/bf16, with and
without bias. The rest checks the strategy's limits and the fallback when a
chain kernel is not kept.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.group import STRICT_FP32
from autofuser_core.planner import plan_fusion_groups

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=4e-2),
}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def _randomise(model: nn.Module) -> nn.Module:
    """Layer norms with random affine parameters (not the identity they start as)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.3 * torch.randn_like(m.bias))
    return model.eval()


def _run(model, *inputs, **options):
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, **options)
        got = fused(*inputs)
        expected = model(*inputs)
    return fused, got, expected


def _chains(report):
    return [g for g in report.groups if g.strategy == "row_chain"]


def _assert_close(got, expected):
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g.float(), e.float(), **TOLERANCES[e.dtype])


class BlockTail(nn.Module):
    """``x + proj(attn) -> LN -> fc1 -> GELU -> fc2 -> + residual -> LN -> qkv``:
    a pre-norm transformer block after its attention, into the next block's qkv."""

    def __init__(self, attn_width=96, width=80, bias=True):
        super().__init__()
        self.proj = nn.Linear(attn_width, width, bias=bias)
        self.norm1 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width, bias=bias)
        self.fc2 = nn.Linear(2 * width, width, bias=bias)
        self.norm2 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=bias)

    def forward(self, x, attn):
        x = x + self.proj(attn)
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return x, self.qkv(self.norm2(x))


@pytest.mark.parametrize(
    "dtype,bias,shape",
    [
        (torch.float32, True, (1, 1127)),  # 36 row blocks, the last one partly filled
        (torch.float32, False, (3, 37)),
        (torch.float16, True, (3, 37)),
        (torch.float16, False, (1, 45)),
        (torch.bfloat16, True, (1, 45)),
        (torch.bfloat16, False, (3, 37)),
    ],
    ids=str,
)
def test_transformer_block_tail_is_one_chain_kernel(dtype, bias, shape):
    model = _randomise(BlockTail(bias=bias)).to(dtype)
    x, attn = torch.randn(*shape, 80, dtype=dtype), torch.randn(*shape, 96, dtype=dtype)
    fused, got, expected = _run(model, x, attn)
    _assert_close(got, expected)
    report = fused.report()
    [chain] = _chains(report)
    assert chain.fused and chain.reason_code == "fused", str(report)
    assert [g.strategy for g in report.fused] == ["row_chain"], str(report)
    # The report says how each product runs: proj streams its input from memory, fc1's
    # hidden chunks feed fc2 at once, qkv is stored chunk by chunk.
    assert (
        "4 products (streamed 96->80, hidden 80->160, accumulated 160->80, tail 80->240), 4 row reductions"
    ) in chain.reason


class SoftmaxBetweenProducts(nn.Module):
    """``LN(x + lin2(softmax(lin1(x) * scale)))``: a softmax over one product's columns feeding another."""

    def __init__(self, width=96, inner=80, bias=True):
        super().__init__()
        self.lin1 = nn.Linear(width, inner, bias=bias)
        self.lin2 = nn.Linear(inner, width, bias=bias)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.lin2(torch.softmax(self.lin1(x) * 0.7, dim=-1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_softmax_between_two_products(dtype, batch):
    model = _randomise(SoftmaxBetweenProducts(bias=batch == 1)).to(dtype)
    x = torch.randn(batch, 29, 96, dtype=dtype)
    fused, got, expected = _run(model, x)
    _assert_close(got, expected)
    [chain] = _chains(fused.report())
    assert chain.fused, str(fused.report())
    assert "streamed 96->80, whole 80->96" in chain.reason


class NormThenThreeProjections(nn.Module):
    """Three projections of one normalised, transposed input, each with its own epilogue."""

    def __init__(self, width=48, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q = nn.Linear(width, 80, bias=bias)
        self.k = nn.Linear(width, 80, bias=bias)
        self.v = nn.Linear(width, 40, bias=bias)

    def forward(self, x):
        h = self.norm(x.transpose(1, 2))
        return self.q(h) * 0.5, torch.tanh(self.k(h)), self.v(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_three_projections_of_one_norm_store_chunk_by_chunk(dtype):
    model = _randomise(NormThenThreeProjections(bias=dtype == torch.float32)).to(dtype)
    x = torch.randn(3, 48, 23, dtype=dtype)  # read transposed: rows walk the last dim
    fused, got, expected = _run(model, x)
    _assert_close(got, expected)
    [chain] = _chains(fused.report())
    assert chain.fused and "tail 48->80, tail 48->80, tail 48->40" in chain.reason, str(fused.report())


class RowScaledHidden(nn.Module):
    """A per-row scale (an RMS statistic of the input) read inside the hidden and the tail chunks."""

    def __init__(self, width=48):
        super().__init__()
        self.fc1 = nn.Linear(width, 80)
        self.fc2 = nn.Linear(80, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 40)

    def forward(self, x):
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)
        y = x + self.fc2(F.silu(self.fc1(x)) * scale)
        return self.out(self.norm(y)) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_per_row_scalars_are_read_inside_chunk_loops(dtype):
    model = _randomise(RowScaledHidden()).to(dtype)
    x = torch.randn(3, 21, 48, dtype=dtype)
    fused, got, expected = _run(model, x)
    _assert_close(got, expected)
    [chain] = _chains(fused.report())
    assert chain.fused and "(hidden 48->80, accumulated 80->48, tail 48->40), 3 row reductions" in chain.reason


def test_chain_kernel_source_names_its_steps_and_precision(tmp_path):
    model = _randomise(BlockTail(attn_width=32, width=32))
    x, attn = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    fused, got, expected = _run(model, x, attn, cache_dir=str(tmp_path))
    _assert_close(got, expected)
    [chain] = _chains(fused.report())
    source = (tmp_path / "kernels" / f"{chain.kernel}.py").read_text()
    assert (
        "# row-tiled chain: rows 10; steps: streamed 32->32, hidden 32->64, accumulated 64->32, tail 32->96"
    ) in source
    assert "operands ['tf32x3', 'tf32x3', 'tf32x3', 'tf32x3']" in source  # strict fp32: torch's default
    assert {"BLOCK_M", "BLOCK_S0", "BLOCK_S1", "BLOCK_S3"} == set(k for k in chain.config if k.startswith("BLOCK"))


def test_tf32_only_where_torch_allows_it():
    model = _randomise(SoftmaxBetweenProducts(width=32, inner=32))
    x = torch.randn(1, 7, 32)
    gm = autofuser.capture(model, x)
    registry = autofuser.load_plugins().registry

    def precision():
        [chain] = [c for c in plan_fusion_groups(gm, registry).kept if c.strategy.name == "row_chain"]
        return chain.program.precision

    assert precision() == "tf32x3"
    token = STRICT_FP32.set("ieee")  # what the strict_fp32_products="ieee" option sets
    try:
        assert precision() == "ieee"
    finally:
        STRICT_FP32.reset(token)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert precision() == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert precision() == "tf32x3"


def test_a_chain_that_fails_verification_is_replanned_in_smaller_groups(monkeypatch):
    import autofuser_core.compile as compile_module
    from autofuser_core.specs import Tolerance
    from autofuser_plugins.matmul.mlp.chain_layout import ChainLayout

    real_tolerance = compile_module.tolerance

    def impossible_for_chains(candidate, view):
        if isinstance(candidate.program.product_layout, ChainLayout):
            return Tolerance.model_construct(atol=-1.0, rtol=0.0)  # nothing passes
        return real_tolerance(candidate, view)

    monkeypatch.setattr(compile_module, "tolerance", impossible_for_chains)
    model = _randomise(BlockTail(attn_width=24, width=24))
    x, attn = torch.randn(3, 11, 24), torch.randn(3, 11, 24)
    fused, got, expected = _run(model, x, attn)
    _assert_close(got, expected)
    report = fused.report()
    chains = _chains(report)
    assert chains and not any(g.fused for g in chains)
    assert {g.reason_code for g in chains} == {"mismatch"}
    # Not all eager: the MLP and single products still fuse, covering every product.
    assert "mlp" in {g.strategy for g in report.fused}, str(report)
    covered = {n for g in report.fused for n in g.nodes}
    assert {"proj", "fc1", "fc2", "qkv"} <= covered, str(report)


class WideRows(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin1 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.lin2 = nn.Linear(width, width)

    def forward(self, x):
        return self.lin2(self.norm(self.lin1(x)))


def test_rows_too_wide_to_hold_are_refused_with_a_reason():
    model = _randomise(WideRows(288))
    x = torch.randn(1, 5, 288)
    fused, got, expected = _run(model, x)
    _assert_close(got, expected)
    [chain] = _chains(fused.report())
    assert not chain.fused and chain.reason_code == "too_wide"
    assert "288" in chain.reason and "256" in chain.reason
    # The other strategies still get the nodes (lin2 alone; lin1's norm over 288 is too long for them too).
    assert ["lin2"] in [g.nodes for g in fused.report().fused], str(fused.report())


class LongChain(nn.Module):
    """Seven products separated by layer norms."""

    def __init__(self, width=16, steps=7):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(steps))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(steps))

    def forward(self, x):
        for lin, norm in zip(self.lins, self.norms):
            x = norm(lin(x))
        return x


def test_too_many_steps_are_refused_and_split_into_shorter_chains():
    model = _randomise(LongChain())
    x = torch.randn(2, 9, 16)
    fused, got, expected = _run(model, x)
    _assert_close(got, expected)
    chains = _chains(fused.report())
    refused = [g for g in chains if g.reason_code == "too_many_steps"]
    assert refused and "7 products" in refused[0].reason and "at most 6" in refused[0].reason
    assert any(g.fused for g in chains), str(fused.report())
    covered = {n for g in fused.report().fused for n in g.nodes}
    assert {f"lins_{i}" for i in range(7)} <= covered


def test_validity_rule_bounds_registers_and_shared_memory():
    from autofuser_plugins.matmul.mlp import chain

    model = _randomise(BlockTail(attn_width=256, width=256))
    x, attn = torch.randn(1, 4, 256), torch.randn(1, 4, 256)
    gm = autofuser.capture(model, x, attn)
    [candidate] = [
        c for c in plan_fusion_groups(gm, autofuser.load_plugins().registry).kept if c.strategy.name == "row_chain"
    ]
    program = candidate.program
    assert chain.is_valid(program, chain.default_config(program)) is None
    valid = [c for c in chain.configs(program) if chain.is_valid(program, c) is None]
    assert valid and len(valid) < len(chain.configs(program))
    too_many_rows = {**chain.default_config(program), "BLOCK_M": 128, "num_warps": 4}
    assert "registers" in chain.is_valid(program, too_many_rows)
    bad_chunk = {**chain.default_config(program), "BLOCK_S1": 48}
    assert "power of two" in chain.is_valid(program, bad_chunk)
    big_tiles = {**chain.default_config(program), "BLOCK_M": 16, "BLOCK_S1": 512, "num_warps": 8}
    assert chain.is_valid(program, big_tiles) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_of_64_rows_over_4_warps_is_never_offered_to_16_bit_chains(dtype):
    """That block read shared memory out of bounds on sm_90 (chain.FAULTING_16BIT_BLOCK);
    fp32 chains, which did not fault, keep it, and 16-bit chains keep every other block."""
    from autofuser_plugins.matmul.mlp import chain

    model = _randomise(BlockTail(attn_width=37, width=37)).to(dtype)
    x, attn = torch.randn(3, 5, 37, dtype=dtype), torch.randn(3, 5, 37, dtype=dtype)
    gm = autofuser.capture(model, x, attn)
    [candidate] = [
        c for c in plan_fusion_groups(gm, autofuser.load_plugins().registry).kept if c.strategy.name == "row_chain"
    ]
    program = candidate.program
    assert any(s.operand_dtype is not None for s in program.product_layout.steps) == (dtype != torch.float32)
    offered = chain.configs(program)
    faulting = [c for c in offered if (c["BLOCK_M"], c["num_warps"]) == (64, 4)]
    assert faulting
    verdicts = [chain.is_valid(program, c) for c in faulting]
    if dtype == torch.float32:
        assert verdicts == [None] * len(faulting)
    else:
        assert all(v is not None and "out of bounds" in v for v in verdicts)
        others = [c for c in offered if c not in faulting and chain.is_valid(program, c) is None]
        assert {(c["BLOCK_M"], c["num_warps"]) for c in others} >= {(64, 8), (32, 4), (128, 8)}


def test_zoo_transformer_fuses_each_block_tail_into_one_chain():
    from autofuser.zoo.models import MODELS

    entry = MODELS["transformer"]
    model = entry.make("tiny").eval()
    x = entry.inputs(torch.rand(1, 17, 9, 2))
    fused, got, expected = _run(model, x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    chains = [g for g in fused.report().fused if g.strategy == "row_chain"]
    tail = [g for g in chains if "blocks_0_attention_to_out" in g.nodes]
    assert tail and {"blocks_0_feed_forward_0", "blocks_0_feed_forward_2", "blocks_1_attention_to_qkv"} <= set(
        tail[0].nodes
    )


def test_products_over_quantised_weights_stay_with_the_product_strategies():
    """A chain kernel doesn't decode MXINT8 weights: those products go to the strategies that do."""
    model = _randomise(BlockTail(attn_width=64, width=64))
    x, attn = torch.randn(1, 9, 64), torch.randn(1, 9, 64)
    fused, got, _ = _run(model, x, attn, quantize="mxint8")
    with torch.no_grad():
        expected = fused.model(x, attn)  # the quantised model, eager
    _assert_close(got, expected)
    report = fused.report()
    assert not any(g.fused for g in _chains(report)), str(report)
    products = [g for g in report.fused if any(op.startswith("matmul.") for op in g.ops)]
    assert len(products) >= 2 and all("mxint8.weight" in g.ops for g in products), str(report)
