"""Every kernel the zoo's models fuse into, and every form of the attention
kernel, must also compile for a real GPU.

CI has no GPU: the interpreter runs the kernels, but it accepts programs the
GPU compiler refuses (``tl.dot`` needs every tile dim >= 16, for one). Here each
kernel is compiled ahead of time for an H100/H200 (sm_90) with the config it
would launch with, which needs no device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.launch import FusedKernel
from autofuser_core.planner import plan_fusion_groups
from autofuser_zoo.models import MODELS


POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.bool: "*i1",
                 torch.int8: "*i8", torch.uint8: "*u8"}


# Runs in a fresh process: once interpreted kernels have run, Triton's language module
# is patched for the interpreter and can't compile for a GPU in the same process.
COMPILER = """
import importlib.util, json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for job in json.load(open(sys.argv[1])):
    spec = importlib.util.spec_from_file_location(job["name"], job["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, job["name"])
    signature = {**job["pointers"], **{k: "constexpr" for k in job["constexprs"]}}
    triton.compile(ASTSource(fn, signature, constexprs=job["constexprs"]), target=GPUTarget("cuda", 90, 32))
    print("compiled", job["name"])
"""


def _fused_kernels(fused_module):
    found = {}
    for graph_module, _ in fused_module._compiled.values():
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, FusedKernel):
                found[node.target.source.name] = node.target
    return list(found.values())


def _job(tmp_path, source, input_dtypes, output_dtypes, launch_args) -> dict:
    path = tmp_path / f"{source.name}.py"
    path.write_text(source.source)
    names = [f"in{k}" for k in range(len(input_dtypes))] + [f"out{k}" for k in range(len(output_dtypes))]
    dtypes = list(input_dtypes) + list(output_dtypes)
    constexprs = {k: v for k, v in launch_args.items() if k.isupper() or k.startswith("BLOCK")}
    return {"name": source.name, "path": str(path), "constexprs": constexprs,
            "pointers": {n: POINTER_TYPES[d] for n, d in zip(names, dtypes)}}


def _compile_for_sm90(jobs, tmp_path) -> None:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "compile.py").write_text(COMPILER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(tmp_path / "compile.py"), str(tmp_path / "jobs.json")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == len(jobs)


@pytest.mark.parametrize("model_name", ["galerkin", "transolver", "transformer", "fno", "unet"])
def test_fused_kernels_compile_for_sm90(model_name, tmp_path):
    entry = MODELS[model_name]
    torch.manual_seed(0)
    model = entry.make("tiny").eval()
    x = entry.inputs(torch.rand(1, 17, 9, 2))
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(x)
    kernels = _fused_kernels(fused)
    assert kernels, str(fused.report())
    if model_name in ("transformer", "transolver"):  # softmax attention, written out
        assert any(k.source.layout == "attention" for k in kernels), str(fused.report())
    jobs = [_job(tmp_path, k.source, k.input_dtypes, [dtype for _, _, dtype in k.output_layout], k.launch_args)
            for k in kernels]
    _compile_for_sm90(jobs, tmp_path)


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
    plan = plan_fusion_groups(gm, autofuser.load_plugins().registry)
    kept = [c for c in plan.kept if c.strategy.name == "softmax_attention"]
    assert len(kept) == 6, [(c.strategy.name, [n.name for n in c.nodes]) for c in plan.kept]
    jobs = []
    with monkeypatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")
        for candidate in kept:
            program = candidate.program
            source = candidate.strategy.generate(program, plan.view.helpers)
            assert "_af_round_bf16" not in source.source
            config = {**candidate.strategy.default_config(program), **source.constexprs}
            jobs.append(_job(tmp_path, source, [t.dtype for t in program.inputs], [t.dtype for t in program.outputs],
                             config))
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
        return (self.alone(x), self.normed(self.ln(y)), self.normed_small(self.ln2(x)),
                self.fc2(F.gelu(self.fc1(self.ln2(b)))))


def test_mxint8_kernels_compile_for_sm90(tmp_path):
    jobs = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = QuantisedProducts().eval().to(dtype)
        x, y = torch.randn(2, 9, 50, dtype=dtype), torch.randn(2, 9, 300, dtype=dtype)
        with torch.no_grad():
            fused = autofuser.fuse(model, quantize="mxint8", progress=False, tune=False, verify_speed=False)
            fused(x, y)
        kernels = [k for k in _fused_kernels(fused) if "mxint8_decode" in k.source.source]
        strategies = {g.strategy for g in fused.report().fused}
        assert len(kernels) == 5 and strategies == {"matmul", "linear_epilogue", "layernorm_linear", "mlp"}, \
            str(fused.report())
        jobs += [_job(tmp_path, k.source, k.input_dtypes, [d for _, _, d in k.output_layout], k.launch_args)
                 for k in kernels]
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
    cases = [(96, torch.float32, "highest", 2), (256, torch.bfloat16, "highest", 1),
             (128, torch.float32, "high", 1), (80, torch.float16, "highest", 1)]
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
                    jobs.append(_job(tmp_path, source, [t.dtype for t in program.inputs],
                                     [t.dtype for t in program.outputs], config))
        finally:
            torch.set_float32_matmul_precision(before)
    _compile_for_sm90(jobs, tmp_path)
