"""Which slice-attention configurations fault with plain-TF32 products on this GPU.

The bundled ``slice_attention`` strategy refuses, with plain-TF32 products,
the configurations that faulted on an H200 (8 warps with a pipelined loop).
This diagnostic registers a copy of the strategy without any validity rule,
restricted to one configuration at a time, and compiles, runs and checks the
attention of ``benchmarks/attention.py`` for each configuration in a child
process: a fault ends only that child, and the parent starts a new one at the
next configuration.

    python benchmarks/slice_tf32_probe.py [--n 11271] [--width 16] [--stages 1,2]

Prints one JSON line per configuration: ``ok`` (output checked against eager),
``wrong`` (it ran, the check failed), ``fault`` (the child died after starting
that configuration: rc and the last lines of its stderr) or ``timeout``. Run a
single configuration under ``compute-sanitizer`` with ``--only 'M,N,S,W,STAGES'``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _configs(stages):
    from autofuser_plugins.attention.strategy import SLICE_CONFIGS

    return [(m, n, s, w, st) for st in stages for (m, n, s, w) in SLICE_CONFIGS]


def _child(configs, n, width, mode, device):
    import torch

    sys.path.insert(0, HERE)
    import autofuser
    from autofuser_plugins.attention import strategy as S

    from attention import BATCH, HEADS, Slice
    from matmul import precision

    class Probe:
        def __init__(self, config):
            self.config = config

        @autofuser.hookimpl
        def autofuser_register_strategies(self, register):
            config = self.config
            register(
                S.SLICE_STRATEGY.model_copy(
                    update={
                        "name": "slice_probe",
                        "priority": 5,
                        "plugin": None,
                        "accepts": lambda program: (
                            None
                            if getattr(program, "slices", None) is not None
                            else ("not_attention", "not a slice-attention program")
                        ),
                        "configs": lambda program: [config],
                        "default_config": lambda program: config,
                        "is_valid": lambda program, c: None,  # probe every configuration, the refused ones too
                    }
                )
            )

    device = torch.device(device)
    torch.manual_seed(0)
    model = Slice(width).to(device).eval()
    inputs = [torch.randn(BATCH, HEADS, n, width, device=device) for _ in range(2)]
    for m, bn, splits, warps, stages in configs:
        config = {"BLOCK_M": m, "BLOCK_N": bn, "SPLITS": splits, "num_warps": warps, "num_stages": stages}
        row = {"config": [m, bn, splits, warps, stages], "n": n, "width": width, "mode": mode}
        print(json.dumps({"starting": row["config"]}), file=sys.stderr, flush=True)
        with precision(mode), torch.no_grad(), tempfile.TemporaryDirectory() as cache:
            fused = autofuser.fuse(
                model,
                plugins=["elementwise", "reduction", "matmul", "attention", Probe(config)],
                cache_dir=cache,
                verify_speed=False,
                cuda_graphs=False,
                tune_budget_s=2.0,
            )
            expected = model(*inputs)
            got = fused(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            groups = [g for g in fused.report().groups if g.fused]
            row["strategies"] = sorted({g.strategy for g in groups})
            row["ran"] = [g.config for g in groups if g.strategy == "slice_probe"]  # the configuration launched
            err = float((got - expected).norm() / expected.norm())
            row["rel_err"] = err
            row["status"] = (
                "ok"
                if "slice_probe" in row["strategies"] and err < 1e-2
                else ("wrong" if "slice_probe" in row["strategies"] else "not_fused")
            )
            if row["status"] == "not_fused":
                row["why"] = [f"{g.strategy or '-'}: {g.reason}" for g in fused.report().groups if not g.fused][:3]
        print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=221 * 51)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--mode", default="tf32")
    parser.add_argument("--stages", default="2,1")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke run)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one child process")
    parser.add_argument("--only", help="one configuration 'M,N,SPLITS,WARPS,STAGES', run in this process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.only or args.child:
        text = args.only or args.child
        configs = [tuple(int(x) for x in c.split(",")) for c in text.split(";")]
        _child(configs, args.n, args.width, args.mode, args.device)
        return 0
    todo = _configs([int(s) for s in args.stages.split(",")])
    while todo:
        spec = ";".join(",".join(map(str, c)) for c in todo)
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    spec,
                    "--n",
                    str(args.n),
                    "--width",
                    str(args.width),
                    "--mode",
                    args.mode,
                    "--device",
                    args.device,
                ],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
        except subprocess.TimeoutExpired as err:
            out = err.stdout or ""
            out = out.decode() if isinstance(out, bytes) else out
            done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            for row in done:
                print(json.dumps(row), flush=True)
            todo = todo[len(done) :]
            if todo:
                print(json.dumps({"config": list(todo[0]), "status": "timeout", "seconds": args.timeout}), flush=True)
                todo = todo[1:]
            continue
        done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        for row in done:
            print(json.dumps(row), flush=True)
        todo = todo[len(done) :]
        if proc.returncode != 0 and todo:
            tail = [line for line in proc.stderr.splitlines() if line.strip()][-6:]
            print(
                json.dumps({"config": list(todo[0]), "status": "fault", "rc": proc.returncode, "stderr": tail}),
                flush=True,
            )
            todo = todo[1:]
        elif proc.returncode != 0:
            print(
                json.dumps({"status": "child_failed", "rc": proc.returncode, "stderr": proc.stderr.splitlines()[-6:]}),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
