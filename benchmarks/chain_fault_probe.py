"""Which row-chain blocks fault with 16-bit products on this GPU and Triton.

The bundled ``row_chain`` strategy never offers 16-bit chains a block of
``chain.FAULTING_16BIT_BLOCK`` (64 rows over 4 warps): on an H100 with Triton 3.6
it read shared memory out of bounds. This diagnostic lifts that rule and, in one
child process per ``BLOCK_M`` x ``num_warps``, trains a transformer MLP block of
an awkward width through ``fuse()`` under bf16 autocast with a copy of the strategy
offering only that block's configs, and checks outputs and gradients against eager. A
fault ends only its child.

    python benchmarks/chain_fault_probe.py [--width 37] [--points 211] [--jobs 8]

Prints one line per block: ``ok`` (a backward chain ran with it, and outputs and
gradients matched eager), ``wrong`` (it ran, a check failed), ``fault`` (an
illegal memory access, which leaves the child's CUDA context unusable), ``no
backward chain`` or ``no chain`` (no chain kernel, or only forward ones, ran
with that block), then a JSON summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

BLOCKS = list(itertools.product((16, 32, 64, 128), (4, 8)))


def _child(block_m: int, warps: int, width: int, points: int) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import autofuser
    from autofuser_plugins.matmul.mlp import chain

    chain.FAULTING_16BIT_BLOCK = (0, 0)  # the rule under test, lifted

    class Probe:  # the chain strategy, ahead of the bundled one, offering only this block
        @autofuser.hookimpl
        def autofuser_register_strategies(self, register):
            def configs(program):
                mine = [c for c in chain.configs(program) if (c["BLOCK_M"], c["num_warps"]) == (block_m, warps)]
                return mine or [{**chain.default_config(program), "BLOCK_M": block_m, "num_warps": warps}]

            register(
                chain.CHAIN_STRATEGY.model_copy(
                    update={"name": "row_chain_probe", "priority": chain.CHAIN_STRATEGY.priority + 1, "plugin": None}
                    | {"configs": configs, "default_config": lambda program: configs(program)[0]}
                )
            )

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 3 * width)
            self.down = nn.Linear(3 * width, width)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model, twin = Block().cuda(), Block().cuda()
    twin.load_state_dict(model.state_dict())
    with tempfile.TemporaryDirectory() as cache:
        fused = autofuser.fuse(
            model,
            plugins=["elementwise", "reduction", "matmul", "attention", Probe()],
            cache_dir=cache,
            progress=False,
            cuda_graphs=False,
            verify_speed=False,
        )
        for _ in range(2):
            x, target = torch.randn(4, points, width, device="cuda"), torch.randn(4, points, width, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out, ref = fused(x), twin(x)
            F.mse_loss(out.float(), target).backward()
            F.mse_loss(ref.float(), target).backward()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float(), ref.float(), rtol=4e-2, atol=4e-2)
            for p, q in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=4e-2, atol=4e-2)
                p.grad = q.grad = None
        # The fault was found in a backward chain: a block is "ok" where one of those ran with it.
        phases = {g.phase for g in fused.report().groups if g.strategy == "row_chain_probe" and g.fused}
        print("RESULT", "ok" if "backward" in phases else "no backward chain" if phases else "no chain", flush=True)


def _probe(block, args) -> dict:
    block_m, warps = block
    cmd = [sys.executable, __file__, "--child", f"{block_m},{warps}", "--width", str(args.width)]
    cmd += ["--points", str(args.points)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"BLOCK_M": block_m, "num_warps": warps, "result": "timeout"}
    text = done.stdout + done.stderr
    if "illegal memory access" in text:
        result = "fault"
    elif "RESULT" in done.stdout:
        result = done.stdout.split("RESULT", 1)[1].strip().splitlines()[0]
    else:
        result = "wrong" if "AssertionError" in text else f"error rc={done.returncode}: {text.strip()[-200:]}"
    return {"BLOCK_M": block_m, "num_warps": warps, "result": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=37)
    parser.add_argument("--points", type=int, default=211)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout-s", type=int, default=300)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        block_m, warps = map(int, args.child.split(","))
        _child(block_m, warps, args.width, args.points)
        return
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda b: _probe(b, args), BLOCKS))
    for row in rows:
        print(f"BLOCK_M {row['BLOCK_M']:>3} num_warps {row['num_warps']}: {row['result']}")
    print(json.dumps({"width": args.width, "points": args.points, "blocks": rows}))


if __name__ == "__main__":
    main()
