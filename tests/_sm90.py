"""Compiling generated kernels ahead of time for an H100/H200 (sm_90), without a device:
the jobs (one per kernel, with its argument types and compile-time constants) and the
fresh process that compiles them. Shared by ``integration/test_gpu_compile.py`` and the
FFT plugin's tests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import torch

POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.bool: "*i1",
    torch.int8: "*i8",
    torch.uint8: "*u8",
}


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
    signature = {**job["pointers"], **job.get("scalars", {}), **{k: "constexpr" for k in job["constexprs"]}}
    triton.compile(ASTSource(fn, signature, constexprs=job["constexprs"]), target=GPUTarget("cuda", 90, 32),
                   options=job.get("options"))
    print("compiled", job["name"])
"""


def _job(tmp_path, source, input_dtypes, output_dtypes, launch_args) -> dict:
    """One kernel's job; a kernel with dynamic dims takes its run-time sizes
    (``KernelSource.sizes``) as integer arguments, typed as Triton types them."""
    path = tmp_path / f"{source.name}.py"
    path.write_text(source.source)
    names = [f"in{k}" for k in range(len(input_dtypes))] + [f"out{k}" for k in range(len(output_dtypes))]
    dtypes = list(input_dtypes) + list(output_dtypes)
    constexprs = {k: v for k, v in launch_args.items() if k.isupper() or k.startswith("BLOCK")}
    return {
        "name": source.name,
        "path": str(path),
        "constexprs": constexprs,
        "pointers": {n: POINTER_TYPES[d] for n, d in zip(names, dtypes)},
        "scalars": {n: "i32" if v < 2**31 else "i64" for n, v in getattr(source, "sizes", {}).items()},
    }


def _chain_jobs(tmp_path, source, launch_args, chain=None) -> list[dict]:
    """One job per kernel of a chain (``autofuser_core/chain.py``): its ``stages``
    give each kernel's argument types and compile-time constants."""
    path = tmp_path / f"{source.name}.py"
    path.write_text(source.source)
    if chain is None:
        spec = importlib.util.spec_from_file_location(source.name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        chain = getattr(module, source.name)
    return [
        {
            "name": s["name"],
            "path": str(path),
            "constexprs": s["constexprs"],
            "pointers": s["pointers"],
            # run-time sizes (dynamic dims) after the pointers, as the stage takes them
            "scalars": {n: "i32" if launch_args[n] < 2**31 else "i64" for n in s.get("sizes", ())},
        }
        for s in chain.stages(launch_args)
    ]


def _jobs_of(tmp_path, kernel) -> list[dict]:
    if kernel.source.layout.endswith("_chain"):  # attention_chain, reduction_chain
        return _chain_jobs(tmp_path, kernel.source, kernel.launch_args, kernel.kernel)
    return [
        _job(
            tmp_path,
            kernel.source,
            kernel.kernel_dtypes,
            # what the kernel writes: fp32 partial rows for a cross sum (``KernelSource.partial_outputs``)
            [
                torch.float32 if k in kernel.source.partial_outputs else d
                for k, (_, _, d) in enumerate(kernel.output_layout)
            ],
            kernel.launch_args,
        )
    ]


def _compile_for_sm90(jobs, tmp_path) -> None:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "compile.py").write_text(COMPILER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "compile.py"), str(tmp_path / "jobs.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == len(jobs)
