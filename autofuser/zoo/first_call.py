"""One system's first call on one zoo model, in a process of its own.

``autofuser bench --fresh-first-calls`` runs this once for AutoFuser (cold cache)
and once for torch.compile, each as a new Python process with its own empty
AutoFuser, Triton and Inductor caches: what a user's first run of a script
costs. In the harness's own process the systems run one after another, so the
first to compile also pays for what the second then finds loaded (Triton's
runtime, its launcher stubs, shared imports).

The process builds the model (seed 0, untrained: weights don't change what is
compiled), runs eager once (as the harness does before either system: cuDNN,
cuBLAS and the CUDA context are warm), then times the system's first call, and
prints one JSON line: ``{"first_call_s": ...}`` or ``{"error": ...}``.

    python -m autofuser.zoo.first_call --model fno --system autofuser --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

SYSTEMS = ("autofuser", "torch.compile")


def measure_in_fresh_process(
    name: str,
    system: str,
    *,
    device: str,
    dtype: str,
    config: str,
    batch: int,
    compile_mode: str = "default",
    fuse_options: Optional[dict] = None,
    timeout_s: float = 900,
) -> dict:
    """Run this module for one (model, system) in a new process with empty caches; its
    answer (``first_call_s``, or ``error``)."""
    with tempfile.TemporaryDirectory(prefix="autofuser-first-call-") as scratch:
        env = dict(
            os.environ,
            TRITON_CACHE_DIR=str(Path(scratch) / "triton"),
            TORCHINDUCTOR_CACHE_DIR=str(Path(scratch) / "inductor"),
            AUTOFUSER_CACHE_DIR=str(Path(scratch) / "autofuser"),
        )
        command = [
            sys.executable,
            "-m",
            "autofuser.zoo.first_call",
            "--model",
            name,
            "--system",
            system,
            "--device",
            device,
            "--dtype",
            dtype,
            "--config",
            config,
            "--batch",
            str(batch),
            "--compile-mode",
            compile_mode,
        ]
        if fuse_options:
            command += ["--fuse-options", json.dumps(fuse_options)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"TimeoutExpired: no first call within {timeout_s:g} s"}
    for line in reversed(done.stdout.strip().splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and ("first_call_s" in answer or "error" in answer):
            return answer
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"the process exited with code {done.returncode}: {tail}"}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--config", default="airfoil")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--fuse-options", type=json.loads, default={}, help="fuse()'s options, as a JSON object")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated
    try:
        print(json.dumps({"first_call_s": _first_call(args)}), flush=True)
    except Exception as err:  # the harness records it as the cell's error
        from .harness import describe_error

        print(json.dumps({"error": describe_error(err)}), flush=True)
    return 0


def _first_call(args: argparse.Namespace) -> float:
    import torch

    from autofuser.zoo.models import MODELS

    from .harness import build, first_call_s, forward_call

    device = torch.device(args.device)
    model, x, _ = build(MODELS[args.model], args.config, args.batch, device)
    model.eval()
    first_call_s(forward_call(model, x, device, args.dtype), device)  # eager once, as in the harness
    if args.system == "autofuser":
        import autofuser

        system = autofuser.fuse(model, progress=False, **args.fuse_options)  # cache: AUTOFUSER_CACHE_DIR, empty
    else:
        system = torch.compile(model, mode=args.compile_mode)
    return first_call_s(forward_call(system, x, device, args.dtype), device)[1]


if __name__ == "__main__":
    sys.exit(main())
