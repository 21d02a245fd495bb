"""Every kernel the zoo's models fuse into, and every form of the attention
kernel, must also compile for a real GPU.

CI has no GPU: the interpreter runs the kernels, but it accepts programs the
GPU compiler refuses (``tl.dot`` needs every tile dim >= 16, for one). Here each
kernel is compiled ahead of time for an H100/H200 (sm_90) with the config it
would launch with, which needs no device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser.zoo.models import MODELS
from autofuser.zoo.models.transolver import PhysicsAttention
from autofuser_core.planner import plan_fusion_groups

from _sm90 import _chain_jobs, _compile_for_sm90, _job, _jobs_of


@pytest.mark.parametrize("model_name", ["galerkin", "transolver", "transformer", "fno", "unet", "lsm"])
def test_fused_kernels_compile_for_sm90(model_name, tmp_path):
    entry = MODELS[model_name]
    torch.manual_seed(0)
    model = entry.make("tiny").eval()
    x = entry.inputs(torch.rand(1, 17, 9, 2))
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(x)
    kernels = fused.kernels()
    assert kernels, str(fused.report())
    if model_name in ("transformer", "lsm"):  # softmax attention, written out
        assert any(k.source.layout == "attention" for k in kernels), str(fused.report())
    if model_name in ("galerkin", "transolver"):  # linear and slice attention: chains of kernels
        assert any(k.source.layout == "attention_chain" for k in kernels), str(fused.report())
    jobs = [job for k in kernels for job in _jobs_of(tmp_path, k)]
    _compile_for_sm90(jobs, tmp_path)


class _PointBlocks(nn.Module):
    """Blocks over points whose kernels take the point count at run time: ``kind``
    "mlp" (a pre-norm MLP), "chain" (a row-tiled chain), "epilogue" (a linear with its
    epilogue, then a mean over the points), "flat" (pointwise ops) or "shifted" (a pad
    and a roll of the channels)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.ln, self.n1 = nn.LayerNorm(16), nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        if self.kind == "mlp":
            return x + self.mlp(self.ln(x))
        if self.kind == "chain":
            h = self.n1(x + self.a(x))
            return self.ln(h + self.c(F.gelu(self.b(h))))
        if self.kind == "epilogue":
            h = F.gelu(self.b(x))
            return h - h.mean(dim=1, keepdim=True)
        if self.kind == "shifted":
            h = F.pad(x, (1, 2))
            return torch.sigmoid(h) + torch.roll(h, 1, dims=2)
        return torch.sigmoid(x) * x.transpose(0, 1).contiguous().transpose(0, 1) + 1.0


@pytest.mark.parametrize(
    ("kind", "strategies"),
    [
        ("mlp", {"mlp"}),
        ("chain", {"row_chain"}),
        ("epilogue", {"linear_epilogue", "row_reduction"}),
        ("flat", {"elementwise"}),
        ("shifted", {"elementwise"}),
    ],
)
def test_kernels_with_run_time_sizes_compile_for_sm90(kind, strategies, tmp_path):
    """Dynamic dims (docs/dynamic.md): kernels that take sizes at run time - the core's
    flat and rows layouts, the product, MLP and row-chain kernels - compile for a GPU."""
    torch.manual_seed(0)
    model = _PointBlocks(kind).eval()
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, dynamic=True)
    with torch.no_grad():
        fused(torch.randn(2, 37, 16))
    kernels = fused.kernels()
    assert kernels and all(k.source.sizes for k in kernels), str(fused.report())
    assert strategies <= {k.strategy for k in kernels}, str(fused.report())
    _compile_for_sm90([job for k in kernels for job in _jobs_of(tmp_path, k)], tmp_path)


def _kept(gm, strategies: tuple[str, ...], count: int):
    """The plan of ``gm`` and its kept candidates of ``strategies`` (``count`` of them)."""
    plan = plan_fusion_groups(gm, autofuser.load_plugins().registry)
    kept = [c for c in plan.kept if c.strategy.name in strategies]
    assert len(kept) == count, [(c.strategy.name, [n.name for n in c.nodes]) for c in plan.kept]
    return plan, kept


def _written_for_gpu(plan, kept, monkeypatch):
    """Each candidate with its source as a GPU gets it (without the interpreter's workarounds)."""
    with monkeypatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")
        written = [(c, c.strategy.generate(c.program, plan.view.helpers)) for c in kept]
    for _, source in written:
        assert "_af_round_bf16" not in source.source
    return written


class AttentionForms(nn.Module):
    """Softmax attention in its forms and sizes, side by side in one graph."""

    def forward(self, q, k, v, bool_mask, bias, wide_q, wide_kv):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        c = F.scaled_dot_product_attention(q, k[..., :20, :], v[..., :20, :16], is_causal=True)  # Dv != D
        d = torch.softmax((q @ k.transpose(-2, -1)) * 0.2 + bias, dim=-1) @ v
        e = torch.einsum("bhnd,bhmd->bhnm", q, k).masked_fill(~bool_mask, float("-inf")).softmax(-1)
        e = torch.einsum("bhnm,bhmd->bhnd", e, v)
        wide = F.scaled_dot_product_attention(wide_q, wide_kv, wide_kv)  # head width 256
        return a + b + d + e, c, wide


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_attention_kernels_compile_for_sm90_as_a_gpu_writes_them(dtype, tmp_path, monkeypatch):
    """The attention kernels written without the interpreter's workarounds (bf16
    loaded and fed to ``tl.dot`` as is, rounding by conversion), for every
    form, with each group's default config."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 24, dtype=dtype) for _ in range(3))
    bool_mask = torch.rand(37, 37) > 0.3
    bias = torch.randn(2, 1, 37, 37, dtype=dtype)
    wide_q, wide_kv = torch.randn(1, 2, 19, 256, dtype=dtype), torch.randn(1, 2, 23, 256, dtype=dtype)
    gm = autofuser.capture(AttentionForms(), q, k, v, bool_mask, bias, wide_q, wide_kv)
    plan, kept = _kept(gm, ("softmax_attention",), 6)
    jobs = []
    for candidate, source in _written_for_gpu(plan, kept, monkeypatch):
        program = candidate.program
        config = {**candidate.strategy.default_config(program), **source.constexprs}
        jobs.append(
            _job(tmp_path, source, [t.dtype for t in program.inputs], [t.dtype for t in program.outputs], config)
        )
    _compile_for_sm90(jobs, tmp_path)


class LongAttention(nn.Module):
    """Softmax attention with enough queries for passes over k and v (``prepass.py``): SDPA
    with a mask, written out with a bias, and a causal SDPA whose v is narrower than k."""

    def forward(self, q, k, v, bias):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        b = torch.softmax((q @ k.transpose(-2, -1)) * 0.2 + bias, dim=-1) @ v
        c = F.scaled_dot_product_attention(q, k, v[..., :16], is_causal=True)
        return a + b, c


@pytest.mark.parametrize("mode", ["split", "copy"])
def test_attention_chains_after_passes_compile_for_sm90(mode, tmp_path, monkeypatch):
    """Strict fp32 (k and v split into fp16 parts) and autocast over fp32 inputs (k and v
    copied as bf16): every kernel of each chain, written as for a GPU, with the default
    config and with the first tuning config."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 24) for _ in range(3))
    bias = torch.randn(1, 1, 300, 300)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "copy"):
        gm = autofuser.capture(LongAttention(), q, k, v, bias)
        plan, kept = _kept(gm, ("softmax_attention",), 3)
        jobs = []
        for candidate, source in _written_for_gpu(plan, kept, monkeypatch):
            program, strategy = candidate.program, candidate.strategy
            assert source.layout == "attention_chain" and f"{mode} pass over k" in source.source
            valid = [c for c in strategy.configs(program) if strategy.is_valid(program, c) is None]
            for config in (strategy.default_config(program), valid[0]):
                jobs += _chain_jobs(tmp_path, source, {**config, **source.constexprs})
    _compile_for_sm90(jobs, tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "autocast"], ids=str)
def test_persistent_mlp_compiles_for_sm90(dtype, tmp_path, monkeypatch):
    """The MLP kernel's persistent form (both weights in shared memory) at width 128, with
    each of its configs that the validity rule keeps, split tail or not; and the streamed
    form beside it. Under autocast, the persistent configs take the fp32 weights, the
    streamed one weights the launcher converted."""
    from autofuser_plugins.matmul.mlp import mlp_layout
    from autofuser_plugins.matmul.mlp import strategy as mlp

    monkeypatch.setattr(mlp_layout, "PERSISTENT_MIN_ROWS", 1)  # offered from 67584 rows; compiled here on 663
    autocast = dtype == "autocast"
    model = nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    model = model if autocast else model.to(dtype)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # planned too as for a GPU: the rounding between ops is planned
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        gm = autofuser.capture(model, torch.randn(3, 221, 128, dtype=torch.float32 if autocast else dtype))
        plan, kept = _kept(gm, ("mlp",), 1)
        ((candidate, source),) = _written_for_gpu(plan, kept, monkeypatch)
    program = candidate.program
    configs = [c for c in mlp.configs(program) if mlp.is_valid(program, c) is None]
    persistent = [c for c in configs if c["PERSISTENT"]]
    assert len(persistent) >= 3, configs
    flipped = [{**c, "SPLIT_TAIL": 1 - c["SPLIT_TAIL"]} for c in persistent]
    flipped = [c for c in flipped if mlp.is_valid(program, c) is None]
    assert any(c["SPLIT_TAIL"] for c in persistent + flipped), "a split config must be compiled"
    streamed = next(c for c in configs if not c["PERSISTENT"])
    jobs = []
    for config in persistent + flipped + [streamed]:
        dtypes = source.input_dtypes(program, config)
        weights = {dtypes[slot] for slot, t in enumerate(program.inputs) if t.cast_from is not None}
        if autocast:  # fc1's and fc2's weights
            assert weights == {torch.float32 if config["PERSISTENT"] else torch.bfloat16}, (config, dtypes)
        else:
            assert not weights
        job = _job(tmp_path, source, dtypes, [t.dtype for t in program.outputs], {**config, **source.constexprs})
        # As launched: the persistent form needs nearly all of a block's shared memory.
        job["options"] = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        jobs.append(job)
    _compile_for_sm90(jobs, tmp_path)


class QuantisedProducts(nn.Module):
    """Every product strategy over MXINT8 weights: alone, with an epilogue, after a
    layer norm (rows on chip and statistics in passes over K), and an MLP."""

    def __init__(self):
        super().__init__()
        self.alone = nn.Linear(50, 37, bias=False)
        self.epilogue = nn.Linear(50, 50)
        self.ln = nn.LayerNorm(300)
        self.normed = nn.Linear(300, 45)
        self.ln2 = nn.LayerNorm(50)
        self.normed_small = nn.Linear(50, 20)
        self.fc1 = nn.Linear(50, 72)
        self.fc2 = nn.Linear(72, 50)

    def forward(self, x, y):
        b = F.gelu(self.epilogue(x)) + x
        return (
            self.alone(x),
            self.normed(self.ln(y)),
            self.normed_small(self.ln2(x)),
            self.fc2(F.gelu(self.fc1(self.ln2(b)))),
        )


def test_mxint8_kernels_compile_for_sm90(tmp_path):
    jobs = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = QuantisedProducts().eval().to(dtype)
        x, y = torch.randn(2, 9, 50, dtype=dtype), torch.randn(2, 9, 300, dtype=dtype)
        with torch.no_grad():
            fused = autofuser.fuse(model, quantize="mxint8", progress=False, tune=False, verify_speed=False)
            fused(x, y)
        kernels = [k for k in fused.kernels() if "mxint8_decode" in k.source.source]
        strategies = {g.strategy for g in fused.report().fused}
        assert len(kernels) == 5 and strategies == {"matmul", "linear_epilogue", "layernorm_linear", "mlp"}, str(
            fused.report()
        )
        jobs += [
            _job(tmp_path, k.source, k.kernel_dtypes, [d for _, _, d in k.output_layout], k.launch_args)
            for k in kernels
        ]
    _compile_for_sm90(jobs, tmp_path)


class LinearAndSliceForms(nn.Module):
    """Galerkin (with its layer norms), Fourier as written, and slice attention in one graph."""

    def __init__(self, width: int):
        super().__init__()
        self.norm_k, self.norm_v = nn.LayerNorm(width), nn.LayerNorm(width)
        self.slices = PhysicsAttention(2 * width, 2, 32)

    def forward(self, q, k, v, x):
        context = torch.einsum("bhnd,bhne->bhde", self.norm_k(k), self.norm_v(v)) / k.shape[-2]
        galerkin = torch.einsum("bhnd,bhde->bhne", q, context)
        fourier = (torch.matmul(q, k.transpose(-2, -1)) * 0.5) @ v / k.shape[-2]
        return galerkin, fourier, self.slices(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # fp16 is written as bf16 is
def test_linear_and_slice_attention_chains_compile_for_sm90(dtype, tmp_path, monkeypatch):
    """Every kernel of the linear and slice attention chains, written as for a GPU, with the
    default config and with the first tuning config."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 24, dtype=dtype) for _ in range(3))
    model = LinearAndSliceForms(24).to(dtype)
    x = torch.randn(2, 37, 48, dtype=dtype)
    gm = autofuser.capture(model, q, k, v, x)
    plan, kept = _kept(gm, ("linear_attention", "slice_attention"), 3)
    jobs = []
    for candidate, source in _written_for_gpu(plan, kept, monkeypatch):
        program, strategy = candidate.program, candidate.strategy
        for config in (strategy.default_config(program), strategy.configs(program)[0]):
            launch = {**config, **source.constexprs}
            if source.layout == "attention_chain":
                jobs += _chain_jobs(tmp_path, source, launch)
            else:
                jobs.append(
                    _job(
                        tmp_path, source, [t.dtype for t in program.inputs], [t.dtype for t in program.outputs], launch
                    )
                )
    _compile_for_sm90(jobs, tmp_path)


class _GalerkinForm(nn.Module):
    """Galerkin attention with its layer norms and the ``/ n`` by the point count."""

    def __init__(self, width: int):
        super().__init__()
        self.norm_k, self.norm_v = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, q, k, v):
        context = torch.einsum("bhnd,bhne->bhde", self.norm_k(k), self.norm_v(v)) / k.shape[-2]
        return torch.einsum("bhnd,bhde->bhne", q, context)


def test_linear_attention_chain_with_run_time_sizes_compiles_for_sm90(tmp_path):
    """Dynamic dims (docs/dynamic.md): the Galerkin chain taking the point count at run
    time compiles for a GPU, each kernel with the run-time sizes it takes."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 24) for _ in range(3))
    fused = autofuser.fuse(_GalerkinForm(24).eval(), progress=False, tune=False, verify_speed=False, dynamic=True)
    with torch.no_grad():
        fused(q, k, v)
    (kernel,) = [k for k in fused.kernels() if k.source.layout == "attention_chain"]
    assert 37 in kernel.source.sizes.values(), str(fused.report())
    jobs = _jobs_of(tmp_path, kernel)
    assert len(jobs) == 3 and all(job["scalars"] for job in jobs)  # each stage takes the count
    _compile_for_sm90(jobs, tmp_path)


class ConvForms(nn.Module):
    """The conv plugin's kernels side by side: 1x1 convolutions in 1, 2 and 3 dims with
    batch norm, activation and residual epilogues (channels-last input, one output
    channel), 3x3 and 3x3x3 convolutions as implicit GEMM with their epilogue,
    instance / group norm as row reductions, and upsampling (interpolation, a transposed
    convolution) with a cat and pointwise ops after it."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(12, 20, kernel_size=1)
        self.conv2 = nn.Conv2d(12, 20, kernel_size=1)
        self.conv3 = nn.Conv3d(12, 20, kernel_size=1, bias=False)
        self.head = nn.Conv2d(12, 1, kernel_size=1)
        self.bn = nn.BatchNorm2d(20)
        self.instance = nn.InstanceNorm2d(12, affine=True)
        self.group = nn.GroupNorm(1, 12)
        self.conv3x3 = nn.Conv2d(12, 20, kernel_size=3, stride=2, padding=1)
        self.conv3x3x3 = nn.Conv3d(5, 8, kernel_size=3, padding=1, bias=False)  # 5 x 27 taps: within MAX_REDUCTION
        self.transposed = nn.ConvTranspose2d(3, 4, kernel_size=2, stride=2)

    def forward(self, x1, x2, x3, last, low):
        a = F.gelu(self.conv1(x1))
        b = F.relu(self.bn(self.conv2(x2))) + x2[:, :1]
        c = torch.tanh(self.conv3(x3))
        d = self.head(last)
        e = F.silu(self.instance(x2)) + self.group(x2)
        f = F.gelu(torch.cat((x2, F.interpolate(low, size=(13, 7), mode="bilinear")), dim=1))
        g = F.interpolate(low, scale_factor=2.0, mode="nearest") * 2
        h = F.gelu(self.bn(self.conv3x3(x2)))
        i = self.conv3x3x3(x3[:, :5]) + 1.0
        j = F.gelu(self.transposed(low))
        return a, b, c, d, e, f, g, h, i, j


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv_kernels_compile_for_sm90_as_a_gpu_writes_them(dtype, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = ConvForms().eval().to(dtype)
    inputs = (
        torch.randn(2, 12, 37, dtype=dtype),
        torch.randn(2, 12, 13, 7, dtype=dtype),
        torch.randn(1, 12, 5, 3, 4, dtype=dtype),
        torch.randn(2, 13, 7, 12, dtype=dtype).permute(0, 3, 1, 2),
        torch.randn(2, 3, 6, 4, dtype=dtype),
    )
    gm = autofuser.capture(model, *inputs)
    plan = plan_fusion_groups(gm, autofuser.load_plugins().registry)
    ops = [op for c in plan.kept for op in c.program.op_names]
    for name in (
        "conv.conv1d_module",
        "conv.conv2d_module",
        "conv.conv3d_module",
        "conv.batch_norm_module",
        "conv.instance_norm_module",
        "conv.group_norm_module",
        "conv.interpolate",
        "conv.cat",
        "conv.conv_transpose_module",
    ):
        assert name in ops, (name, [(c.strategy.name, c.program.op_names) for c in plan.kept])
    assert sum(c.strategy.name == "implicit_gemm" for c in plan.kept) == 2
    jobs = []
    with monkeypatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")
        for candidate in plan.kept:
            program = candidate.program
            source = candidate.strategy.generate(program, plan.view.helpers)
            config = {**candidate.strategy.default_config(program), **source.constexprs}
            jobs.append(
                _job(tmp_path, source, [t.dtype for t in program.inputs], [t.dtype for t in program.outputs], config)
            )
    _compile_for_sm90(jobs, tmp_path)


class ChainForms(nn.Module):
    """Row-tiled chains in each step mode: a transformer block's post-attention part
    (streamed, hidden, accumulated and tail steps) and a softmax between two products
    (whole steps), side by side in one graph."""

    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm1 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.norm2 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.lin1 = nn.Linear(width, 80)
        self.lin2 = nn.Linear(80, width)

    def forward(self, x, attn, y):
        x = x + self.proj(attn)
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        z = self.norm2(y + self.lin2(torch.softmax(self.lin1(y), dim=-1)))
        return x, self.qkv(self.norm2(x)), z


def test_row_chain_kernels_compile_for_sm90_as_a_gpu_writes_them(tmp_path, monkeypatch):
    """The chain kernels with their default configs: every step mode, strict fp32
    (3xTF32), TF32 where torch allows it, bf16 and fp16 operands, widths 96 to 256."""
    cases = [
        (96, torch.float32, "highest", 2),
        (256, torch.bfloat16, "highest", 1),
        (128, torch.float32, "high", 1),
        (80, torch.float16, "highest", 1),
    ]
    jobs = []
    for width, dtype, precision, kernels in cases:
        torch.manual_seed(0)
        model = ChainForms(width).to(dtype).eval()
        x, attn, y = (torch.randn(2, 37, width, dtype=dtype) for _ in range(3))
        gm = autofuser.capture(model, x, attn, y)
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            with monkeypatch.context() as env:
                env.setenv("TRITON_INTERPRET", "0")  # bf16 rounds by conversion, as on a GPU
                plan = plan_fusion_groups(gm, autofuser.load_plugins().registry)
                kept = [c for c in plan.kept if c.strategy.name == "row_chain"]
                assert len(kept) == 2, [(c.strategy.name, [n.name for n in c.nodes]) for c in plan.kept]
                for candidate in kept[:kernels]:
                    program = candidate.program
                    source = candidate.strategy.generate(program, plan.view.helpers)
                    assert "_af_round_bf16" not in source.source
                    if dtype == torch.float32:
                        assert ("'tf32'" if precision == "high" else "'tf32x3'") in source.source
                    config = {**candidate.strategy.default_config(program), **source.constexprs}
                    jobs.append(
                        _job(
                            tmp_path,
                            source,
                            [t.dtype for t in program.inputs],
                            [t.dtype for t in program.outputs],
                            config,
                        )
                    )
        finally:
            torch.set_float32_matmul_precision(before)
    _compile_for_sm90(jobs, tmp_path)


class _LongRowForms(nn.Module):
    """The split reduction's two orientations: a norm's weight and bias gradients (kept
    channels contiguous) and a mean and a max over the contiguous last dim."""

    def forward(self, g, xhat, x):
        return (g * xhat).sum((0, 1)), g.sum((0, 1)), x.mean(-1) + x.amax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_reduction_chains_compile_for_sm90(dtype, tmp_path, monkeypatch):
    from autofuser_plugins.reduction import strategy as row_strategy

    monkeypatch.setattr(row_strategy, "MAX_TILE", 64)  # these rows count as too long
    g, xhat = (torch.randn(2, 37, 12, dtype=dtype) for _ in range(2))
    x = torch.randn(3, 301, dtype=dtype)
    fused = autofuser.fuse(_LongRowForms(), progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        fused(g, xhat, x)
    kernels = [k for k in fused.kernels() if k.source.layout == "reduction_chain"]
    assert len(kernels) == 2, str(fused.report())
    jobs = [job for k in kernels for job in _jobs_of(tmp_path, k)]
    assert len(jobs) == 4
    _compile_for_sm90(jobs, tmp_path)


class _TallProducts(nn.Module):
    """Two lone products of a few tiles over a long K: a head's ``K^T V`` and a weight
    gradient's ``x^T dy``, whose kernels split K (``SPLIT_K``, partial rows)."""

    def forward(self, k, v, x, dy):
        return k.transpose(-2, -1) @ v, x.transpose(0, 1) @ dy


@pytest.mark.parametrize(("dtype", "dynamic"), [(torch.float32, False), (torch.bfloat16, True)])
def test_split_k_products_compile_for_sm90_in_every_config(dtype, dynamic, tmp_path):
    from autofuser_plugins.matmul import strategy as matmul_strategy

    k, v = torch.randn(2, 3, 1500, 16, dtype=dtype), torch.randn(2, 3, 1500, 20, dtype=dtype)
    x, dy = torch.randn(1337, 24, dtype=dtype), torch.randn(1337, 40, dtype=dtype)
    fused = autofuser.fuse(_TallProducts(), progress=False, tune=False, verify_speed=False, dynamic=dynamic or None)
    with torch.no_grad():
        fused(k, v, x, dy)
    kernels = [kernel for kernel in fused.kernels() if "SPLIT_K" in kernel.launch_args]
    assert len(kernels) == 2, str(fused.report())
    jobs = []
    for kernel in kernels:
        for m, n, block_k, warps, stages in matmul_strategy.SPLIT_CONFIGS:
            (job,) = _jobs_of(tmp_path, kernel)
            job["constexprs"].update(BLOCK_M=m, BLOCK_N=n, BLOCK_K=block_k, SPLIT_K=4)
            job["options"] = {"num_warps": warps, "num_stages": stages}
            jobs.append(job)
    _compile_for_sm90(jobs, tmp_path)


@pytest.mark.parametrize(
    "dtype, block_c, wide, activation",
    [
        (torch.float32, 1, False, 3),  # row-major channels, GELU
        (torch.bfloat16, 32, False, 2),  # channels-last tiles, leaky ReLU
        (torch.float16, 1, True, 4),  # int64 offsets, SiLU
    ],
    ids=["fp32-rows", "bf16-channels-last", "fp16-wide"],
)
def test_batch_norm_kernels_compile_for_sm90(dtype, block_c, wide, activation, tmp_path):
    """The conv plugin's hand-written batch norm kernels (``batch_norm_kernels.py``), each
    with the constants and argument types it launches with."""
    from autofuser_plugins.conv import batch_norm_kernels as kernels

    data = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    fp32, sizes = "*fp32", ("C", "S", "L", "CHUNK", "SPLITS", "stride_n", "stride_c", "stride_s")
    # A tensor past int32 (wide): its batch stride and the element count are int64 arguments.
    big = "i64" if wide else "i32"
    scalars = {name: big if name == "stride_n" else "i32" for name in sizes}
    block_r = max(1, kernels.BLOCK // block_c)
    tile = {"BLOCK_R": block_r, "BLOCK_C": block_c, "WIDE": wide}
    flags = {"HAS_WEIGHT": True, "HAS_BIAS": block_c == 1, "ACT": activation}

    names = ("_stats_kernel", "_combine_kernel", "_sums_kernel", "_apply_kernel", "_grad_stats_kernel")
    names += ("_grad_apply_kernel",)
    shim = tmp_path / "batch_norm_kernels.py"  # the compiler loads a file; this one imports the package's
    shim.write_text(f"from autofuser_plugins.conv.batch_norm_kernels import {', '.join(names)}\n")

    def job(name, pointers, scalars, constexprs):
        return {
            "name": name,
            "path": str(shim),
            "pointers": pointers,
            "scalars": scalars,
            "constexprs": constexprs,
        }

    jobs = [
        job("_stats_kernel", {"x": data, "counts": fp32, "means": fp32, "m2s": fp32}, scalars, tile),
        job(
            "_combine_kernel",
            {n: fp32 for n in ("counts", "means", "m2s", "mean_out", "var_out", "running_mean", "running_var")}
            | {"batches": "*i64"},
            {"SPLITS": "i32", "momentum": "fp32", "unbias": "fp32"},
            {"UPDATE": True, "COUNT": True, "BLOCK_S": 64},
        ),
        job(
            "_sums_kernel",
            {n: fp32 for n in ("parts_g", "parts_gx", "sum_g", "sum_gx")},
            {"SPLITS": "i32"},
            {"BLOCK_S": 16},
        ),
        job(
            "_apply_kernel",
            {"x": data, "out": data} | {n: fp32 for n in ("mean", "var", "weight", "bias")},
            {"C": "i32", "stride_c": "i32", "total": big, "eps": "fp32", "slope": "fp32"},
            flags | {"BLOCK": kernels.BLOCK, "WIDE": wide, "EMULATE_BF16": False},
        ),
        job(
            "_grad_stats_kernel",
            {"dout": data, "x": data} | {n: fp32 for n in ("mean", "var", "weight", "bias", "sum_g", "sum_gx")},
            scalars | {"eps": "fp32", "slope": "fp32"},
            flags | tile,
        ),
        job(
            "_grad_apply_kernel",
            {"dout": data, "x": data, "dx": data}
            | {n: fp32 for n in ("mean", "var", "weight", "bias", "sum_g", "sum_gx")},
            {"C": "i32", "stride_c": "i32", "total": big, "L": "i32", "eps": "fp32", "slope": "fp32"},
            flags | {"BLOCK": kernels.BLOCK, "WIDE": wide, "EMULATE_BF16": False},
        ),
    ]
    _compile_for_sm90(jobs, tmp_path)
