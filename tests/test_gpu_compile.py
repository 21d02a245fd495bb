"""Every kernel the zoo's models fuse into must also compile for a real GPU.

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

import autofuser
from autofuser_core.launch import FusedKernel
from autofuser_zoo.models import MODELS


POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.bool: "*i1"}


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


@pytest.mark.parametrize("model_name", ["galerkin", "transolver", "fno", "unet"])
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
    jobs = []
    for kernel in kernels:
        path = tmp_path / f"{kernel.source.name}.py"
        path.write_text(kernel.source.source)
        names = [f"in{k}" for k in range(len(kernel.input_dtypes))] + [f"out{k}" for k in range(len(kernel.output_layout))]
        dtypes = kernel.input_dtypes + [dtype for _, _, dtype in kernel.output_layout]
        constexprs = {k: v for k, v in kernel.launch_args.items() if k.isupper() or k.startswith("BLOCK")}
        jobs.append({"name": kernel.source.name, "path": str(path), "constexprs": constexprs,
                     "pointers": {n: POINTER_TYPES[d] for n, d in zip(names, dtypes)}})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "compile.py").write_text(COMPILER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(tmp_path / "compile.py"), str(tmp_path / "jobs.json")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == len(jobs)
