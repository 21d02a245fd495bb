"""Softmax attention as one online-softmax kernel (the ``attention`` plugin).

Every form - ``F.scaled_dot_product_attention`` without a mask, with a bool
mask, with an additive float mask broadcast over heads, causal; written out
with a scale and a bias, with ``masked_fill(-inf)``, with ``einsum`` products,
timm-style with the scale on q and dropout in eval - is fused into one group
of the ``softmax_attention`` strategy and matches eager on awkward shapes
(37 queries, 53 keys, head widths 16/24/64, batch 1 and 3, 2 heads; once
1127 queries in fp32), in fp32, fp16 and bf16, with q/k/v arriving as
rearranged or transposed views (read through their strides, no copies).

The kernel never writes the N x M scores: its source has one store, the
output's, and a recording dispatch mode sees no N x M tensor allocated in a
fused forward (while eager, the positive control, allocates several).
Refusals carry their reasons: dropout, grouped-query heads, wide heads,
float64, and a chain whose scores are also used elsewhere.
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

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=4e-2),
}
HEADS = 2


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


# ---------------------------------------------------------------------------
# The forms, each a module taking q, k, v in one of three memory layouts
# ---------------------------------------------------------------------------


def heads(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The model's input -> [B, H, L, D], as a view (never a copy)."""
    if layout == "rearranged":  # [B, L, H * D], as a fused qkv projection leaves it
        return rearrange(x, "b l (h d) -> b h l d", h=HEADS)
    if layout == "transposed":  # [B, L, H, D]
        return x.transpose(1, 2)
    return x  # [B, H, L, D]


def make_input(batch, length, width, layout, dtype):
    if layout == "rearranged":
        shape = (batch, length, HEADS * width)
    elif layout == "transposed":
        shape = (batch, length, HEADS, width)
    else:
        shape = (batch, HEADS, length, width)
    return torch.randn(shape, dtype=dtype, device=DEVICE)


class Attention(nn.Module):
    """One attention form; ``extras`` are the mask or bias tensors it reads."""

    def __init__(self, form: str, layout: str):
        super().__init__()
        self.form = form
        self.layout = layout
        self.drop = nn.Dropout(0.1)

    def forward(self, q, k, v, *extras):
        q, k, v = (heads(t, self.layout) for t in (q, k, v))
        scale = q.shape[-1] ** -0.5
        form = self.form
        if form == "sdpa":
            return F.scaled_dot_product_attention(q, k, v)
        if form in ("sdpa_bool_mask", "sdpa_float_mask"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=extras[0])
        if form == "sdpa_causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if form == "written_scale_bias":
            scores = torch.matmul(q, k.transpose(-2, -1)) * scale + extras[0]
            return torch.matmul(torch.softmax(scores, dim=-1), v)
        if form == "written_masked_fill":
            scores = (q @ k.mT) / math.sqrt(q.shape[-1])
            return scores.masked_fill(extras[0], float("-inf")).softmax(dim=-1) @ v
        if form == "einsum":
            scores = torch.einsum("bhnd,bhmd->bhnm", q, k) * scale
            return torch.einsum("bhnm,bhmd->bhnd", scores.softmax(-1), v)
        if form == "timm":  # timm's Attention: the scale on q, dropout (eval) on the probabilities
            q = q * scale
            attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            return self.drop(attn) @ v
        raise ValueError(form)


FORMS = [
    "sdpa",
    "sdpa_bool_mask",
    "sdpa_float_mask",
    "sdpa_causal",
    "written_scale_bias",
    "written_masked_fill",
    "einsum",
    "timm",
]


def eager_zeroes_keyless_rows(dtype) -> bool:
    """Whether eager SDPA gives 0 for a query row whose bool mask admits no key, as torch
    documents. Its default CUDA backend doesn't in fp16/bf16 (torch 2.11 on an H200;
    its math backend does: BENCHMARKS.md, "Measurements behind rules in the code"), and the fused
    model follows eager as the user runs it (test_keyless_query_row_in_half_precision...)."""
    return DEVICE.type == "cpu" or dtype == torch.float32


def extras_for(form, batch, n, m, dtype):
    if form == "sdpa_bool_mask":
        mask = torch.rand(n, m, device=DEVICE) > 0.3  # True: attend
        mask[:, 0] = True
        if eager_zeroes_keyless_rows(dtype):
            mask[3] = False  # a query with no key at all: torch gives 0
        return (mask,)
    if form == "sdpa_float_mask":
        return (torch.randn(batch, 1, n, m, dtype=dtype, device=DEVICE),)  # broadcast over heads
    if form == "written_scale_bias":
        return (torch.randn(HEADS, n, m, dtype=dtype, device=DEVICE),)  # a relative-position bias per head
    if form == "written_masked_fill":
        mask = torch.rand(batch, 1, n, m, device=DEVICE) > 0.7  # True: masked out
        mask[..., 0] = False
        return (mask,)
    return ()


def run_fused(model, *inputs):
    model = model.eval()
    with torch.no_grad():
        expected = model(*inputs)
        # A correctness check: no tuning, and no dropping groups that are slower than eager.
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
    return fused, got, expected


def assert_one_attention_group(fused, form):
    report = fused.report()
    groups = [g for g in report.fused if g.strategy == "softmax_attention"]
    assert len(groups) == 1, str(report)
    recognised = "form softmax (sdpa)" if form.startswith("sdpa") else "form softmax (written out)"
    assert recognised in groups[0].reason, groups[0].reason
    if form.startswith("sdpa"):
        assert groups[0].ops == ["attention.sdpa"]
    else:
        # Every op of the chain is inside the one group: nothing else of it was fused.
        assert groups[0].ops[-1].startswith("matmul.") and len(groups[0].ops) >= 3
        assert not [g for g in report.fused if g is not groups[0] and "reduction.softmax" in g.ops], str(report)
    (kernel,) = [k for k in fused.kernels() if k.source.layout in ("attention", "attention_chain")]
    source = attention_function(kernel.source.source)
    # The scores are never written: the one store is the output's.
    assert source.count("tl.store(") == 1 and "tl.store(out_base" in source, source
    return groups[0]


def attention_function(source: str) -> str:
    """The online-softmax kernel of a kernel module: the module itself, or in a chain
    (passes over k and v first, ``plugins/attention/prepass.py``) its last kernel."""
    return source.split("@triton.jit")[-1].split("\nclass _Chain")[0]


def check(form, layout, dtype, batch, n, m, d):
    q = make_input(batch, n, d, layout, dtype)
    k = make_input(batch, m, d, layout, dtype)
    v = make_input(batch, m, d, layout, dtype)
    assert not heads(q, layout).is_contiguous() or layout == "contiguous"
    extras = extras_for(form, batch, n, m, dtype)
    fused, got, expected = run_fused(Attention(form, layout), q, k, v, *extras)
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
    torch.testing.assert_close(got.float(), expected.float(), equal_nan=True, **TOLERANCES[dtype])
    assert_one_attention_group(fused, form)
    return fused


# ---------------------------------------------------------------------------
# Every form x every dtype: cross attention (37 queries, 53 keys), batch 3,
# head width 24, q/k/v rearranged from [B, L, H * D]
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_every_form_matches_eager_in_every_dtype(form, dtype):
    check(form, "rearranged", dtype, batch=3, n=37, m=53, d=24)


# ---------------------------------------------------------------------------
# Head widths 16 and 64, batch 1, transposed views, self attention (fp32)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("form", FORMS)
def test_head_widths_and_transposed_views(form, d):
    check(form, "transposed", torch.float32, batch=1, n=37, m=37, d=d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_contiguous_inputs_and_wide_heads_in_half_precision(dtype):
    check("sdpa_causal", "contiguous", dtype, batch=1, n=37, m=53, d=64)
    check("written_masked_fill", "contiguous", dtype, batch=3, n=37, m=53, d=16)


def test_long_sequence_fp32():
    """1127 queries and keys: 18 query blocks x 18 key blocks per head."""
    check("written_scale_bias", "rearranged", torch.float32, batch=1, n=1127, m=1127, d=16)


def test_value_head_width_may_differ():
    q, k = torch.randn(2, 2, 37, 24, device=DEVICE), torch.randn(2, 2, 53, 24, device=DEVICE)
    v = torch.randn(2, 2, 53, 40, device=DEVICE).transpose(-2, -1).contiguous().transpose(-2, -1)
    model = Attention("sdpa_causal", "contiguous")
    fused, got, expected = run_fused(model, q, k, v)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    assert_one_attention_group(fused, "sdpa_causal")


def test_fully_masked_rows_follow_eager():
    """SDPA gives 0 for a query whose keys are all masked; a written-out softmax gives NaN."""
    q, k, v = (torch.randn(1, 2, 37, 16, device=DEVICE) for _ in range(3))
    keep = torch.ones(37, 37, dtype=torch.bool, device=DEVICE)
    keep[5] = False
    fused, got, expected = run_fused(Attention("sdpa_bool_mask", "contiguous"), q, k, v, keep)
    assert (got[:, :, 5] == 0).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    fused, got, expected = run_fused(Attention("written_masked_fill", "contiguous"), q, k, v, ~keep)
    assert torch.isnan(got[:, :, 5]).all() and torch.isnan(expected[:, :, 5]).all()
    torch.testing.assert_close(got, expected, equal_nan=True, **TOLERANCES[torch.float32])
    assert_one_attention_group(fused, "written_masked_fill")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_keyless_query_row_in_half_precision_follows_eager_whatever_it_gives(dtype):
    """A query whose bool mask admits no key, in fp16/bf16. The kernel gives 0 for it, as
    torch documents and as eager does on the CPU; eager's default CUDA backend gives other
    values. The fused model must equal the eager model either way: fused where eager
    gives 0, and where it doesn't, kept eager with the mismatch reported."""
    q, k, v = (make_input(3, n, 24, "rearranged", dtype) for n in (37, 53, 53))
    mask = torch.rand(37, 53, device=DEVICE) > 0.3
    mask[:, 0] = True
    mask[3] = False
    fused, got, expected = run_fused(Attention("sdpa_bool_mask", "rearranged"), q, k, v, mask)
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    if bool((expected[:, :, 3] == 0).all()):
        assert_one_attention_group(fused, "sdpa_bool_mask")
    else:
        (group,) = [g for g in fused.report().groups if g.strategy == "softmax_attention"]
        assert not group.fused and group.reason_code == "mismatch", str(fused.report())


# ---------------------------------------------------------------------------
# No N x M tensor is ever allocated
# ---------------------------------------------------------------------------


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_no_scores_tensor_is_allocated():
    n, m = 37, 53
    q, k, v = (make_input(3, length, 24, "rearranged", torch.float32) for length in (n, m, m))
    (mask,) = extras_for("written_masked_fill", 3, n, m, torch.float32)
    model = Attention("written_masked_fill", "rearranged").eval()
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(q, k, v, mask)  # compiles
        with ShapeRecorder() as fused_run:
            fused(q, k, v, mask)
        with ShapeRecorder() as eager_run:
            model(q, k, v, mask)
    # [3, 1, 37, 53] is the mask (an input, seen as the interpreter reads it); the scores are [3, 2, 37, 53].
    scores = (3, HEADS, n, m)
    assert scores in eager_run.shapes, "the recorder must see eager's scores"  # the check below can fail
    assert not [s for s in fused_run.shapes if s[-2:] == (n, m) and s != tuple(mask.shape)], fused_run.shapes


# ---------------------------------------------------------------------------
# Gradients: kernel forward, eager backward
# ---------------------------------------------------------------------------


def test_gradients_through_fused_attention_match_eager():
    model = Attention("written_scale_bias", "transposed")
    q, k, v = (make_input(2, 37, 16, "transposed", torch.float32).requires_grad_() for _ in range(3))
    (bias,) = extras_for("written_scale_bias", 2, 37, 37, torch.float32)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    got = fused(q, k, v, bias)
    (got * got).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = model(q, k, v, bias)
    (expected * expected).sum().backward()
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, **TOLERANCES[torch.float32])
    assert any(g.strategy == "softmax_attention" for g in fused.report().fused)


# ---------------------------------------------------------------------------
# Refusals, each with its reason
# ---------------------------------------------------------------------------


class Sdpa(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


@pytest.mark.parametrize(
    "kwargs, shapes, dtype, code",
    [
        pytest.param({"dropout_p": 0.1}, ((1, 2, 9, 16),) * 3, torch.float32, "random", id="dropout"),
        pytest.param(
            {"enable_gqa": True},
            ((1, 4, 9, 16), (1, 2, 9, 16), (1, 2, 9, 16)),
            torch.float32,
            "unsupported_argument",
            id="gqa",
        ),
        pytest.param({}, ((1, 1, 9, 264),) * 3, torch.float32, "head_too_wide", id="head-264"),
        pytest.param({}, ((1, 2, 9, 16),) * 3, torch.float64, "unsupported_dtype", id="float64"),
    ],
)
def test_unserved_sdpa_stays_eager_with_its_reason(kwargs, shapes, dtype, code):
    q, k, v = (torch.randn(s, dtype=dtype, device=DEVICE) for s in shapes)
    model = Sdpa(**kwargs).eval()
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(q, k, v)
    assert got.shape == model(q, k, v).shape
    report = fused.report()
    assert not report.fused
    (entry,) = [n for n in report.unfused_nodes if "scaled_dot_product_attention" in n.target]
    assert entry.reason_code == code, entry


class ScoresAlsoReturned(nn.Module):
    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) * 0.25
        return torch.softmax(scores, dim=-1) @ v, scores.amax(dim=-1)


def test_chain_whose_scores_are_used_elsewhere_is_refused_with_the_user_named():
    q, k, v = (torch.randn(2, 2, 37, 16, device=DEVICE) for _ in range(3))
    fused, got, expected = run_fused(ScoresAlsoReturned(), q, k, v)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOLERANCES[torch.float32])
    report = fused.report()
    (refused,) = [g for g in report.skipped if g.strategy == "softmax_attention"]
    assert refused.reason_code == "scores_used_elsewhere"
    assert "amax" in refused.reason and "mul" in refused.reason, refused.reason
    # The pieces still fuse the ordinary way, the scores written once.
    assert not [g for g in report.fused if g.strategy == "softmax_attention"]
    assert any("reduction.softmax" in g.ops for g in report.fused), str(report)


class SoftmaxOverQueries(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v


def test_softmax_over_queries_is_not_attention():
    q, k, v = (torch.randn(1, 2, 37, 16, device=DEVICE) for _ in range(3))
    fused, got, expected = run_fused(SoftmaxOverQueries(), q, k, v)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    (refused,) = [g for g in fused.report().skipped if g.strategy == "softmax_attention"]
    assert refused.reason_code == "softmax_not_over_keys", refused


# ---------------------------------------------------------------------------
# Autocast: products in bf16, the softmax in fp32, as eager runs them
# ---------------------------------------------------------------------------


class ProjectedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(24, 72)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 37, 3, HEADS, 12).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v
        return a, b


def test_autocast_bf16_matches_eager_under_autocast():
    model = ProjectedAttention().to(DEVICE).eval()
    x = torch.randn(2, 37, 24, device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(x)
        expected = model(x)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e.float(), **TOLERANCES[torch.bfloat16])
    report = fused.report()
    assert sorted(g.reason.split(":")[0] for g in report.fused if g.strategy == "softmax_attention") == [
        "form softmax (sdpa)",
        "form softmax (written out)",
    ], str(report)


# ---------------------------------------------------------------------------
# The core hooks the plugin relies on: extern ops, a strategy's own compose,
# strategy priority
# ---------------------------------------------------------------------------


def test_extern_ops_are_refused_by_the_generic_composition():
    from autofuser_core.group import GroupRefused
    from autofuser_core.planner import PlanningView

    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    gm = autofuser.capture(Sdpa(), q, k, v)
    view = PlanningView(gm, autofuser.load_plugins().registry)
    (node,) = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert view.lowered[node].op == "extern"
    with pytest.raises(GroupRefused) as refused:
        view.compose([node])
    assert refused.value.code == "extern_op" and node.name in refused.value.reason


class Chain(nn.Module):
    def forward(self, x, y):
        a = x * 2
        b = a + y
        return torch.tanh(b), a


def _grabbing_plugin(refuse: bool):
    """A third-party strategy at priority 2 that composes its groups itself."""
    from autofuser import StrategySpec
    from autofuser_core.group import GroupRefused, program_from_nodes

    def compose(view, nodes):
        if refuse:
            raise GroupRefused("not_today", "this strategy declines")
        return program_from_nodes(nodes, summary="grabbed")

    class Plugin:
        @staticmethod
        def autofuser_register_strategies(register):
            register(
                StrategySpec(
                    name="grab",
                    priority=2,
                    compose=compose,
                    propose=lambda view: [[n for n in view.nodes if n in view.lowered]],
                    configs=lambda program: [{}],
                    default_config=lambda program: {},
                    generate=lambda program, helpers: None,
                )
            )

    return Plugin()


def test_a_strategy_with_its_own_compose_and_priority_takes_its_candidates():
    from autofuser_core.planner import plan_fusion_groups

    x, y = torch.randn(3, 7), torch.randn(7)
    gm = autofuser.capture(Chain(), x, y)
    plan = plan_fusion_groups(gm, autofuser.load_plugins(["elementwise", _grabbing_plugin(False)]).registry)
    (kept,) = plan.kept
    assert kept.strategy.name == "grab"  # the same nodes as the elementwise group: priority decides
    program = kept.program
    assert program.summary == "grabbed" and not program.output_values
    assert [t.name for t in program.inputs] == ["x", "y"]  # order of first use
    assert [t.name for t in program.outputs] == ["mul", "tanh"]  # used outside, in graph order
    assert program.outputs[0].shape == (3, 7) and program.outputs[0].stride == (7, 1)
    assert [d.reason_code for d in plan.decisions] == ["overlap"]


def test_a_refusing_compose_leaves_its_nodes_to_the_generic_strategies():
    from autofuser_core.planner import plan_fusion_groups

    x, y = torch.randn(3, 7), torch.randn(7)
    gm = autofuser.capture(Chain(), x, y)
    plan = plan_fusion_groups(gm, autofuser.load_plugins(["elementwise", _grabbing_plugin(True)]).registry)
    assert [c.strategy.name for c in plan.kept] == ["elementwise"]
    assert [(d.strategy, d.reason_code, d.reason) for d in plan.decisions] == [
        ("grab", "not_today", "this strategy declines")
    ]


def test_chains_differing_only_in_their_batch_are_two_kernels(tmp_path):
    """A softmax chain (passes over k and v first: 256 queries or more in strict fp32) whose
    programs differ only in the batch entries its launcher covers gets a kernel name per
    batch: a process reuses a loaded module by its name, and one launcher's grid and
    scratch would be wrong for the other batch."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    model = Attend()
    fused = autofuser.fuse(
        model, progress=False, tune=False, verify_speed=False, cache_dir=str(tmp_path), dynamic=False
    )
    names = set()
    for batch in (1, 3):
        q, k, v = (torch.randn(batch, 2, 260, 8, device=DEVICE) for _ in range(3))
        with torch.no_grad():
            torch.testing.assert_close(fused(q, k, v), model(q, k, v), atol=1e-4, rtol=1e-4)
        groups = [g for g in fused.report().fused if g.strategy == "softmax_attention"]
        assert len(groups) == 1, str(fused.report())  # fused: not refused as a mismatch
        names.add(groups[0].kernel)
    layouts = {k.source.layout for k in fused.kernels() if k.source.layout.startswith("attention")}
    assert layouts == {"attention_chain"}
    assert len(names) == 2
