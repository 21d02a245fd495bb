"""GPU probe: shared memory of the MLP kernel's persistent form, per config, with its
last round split into half row blocks (``SPLIT_TAIL``) and without, as the GPU's Triton
compiles it (nothing is launched). Shapes: the MLP of ``benchmarks/matmul.py`` at width
128 (90168 rows, bf16 weights, and fp32 weights under bf16 autocast) and the shapes of
``tests/test_mlp_persistent.py``.

    python3 benchmarks/probes/persistent_smem.py OUT_DIR
"""
import os
import sys

import torch
import torch.nn as nn
import triton
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(__file__))
import autofuser  # noqa: E402
from autofuser_core.planner import plan_fusion_groups  # noqa: E402
from autofuser_plugins.mlp import mlp_layout, strategy as mlp  # noqa: E402
from _parts import load_variant, results_file  # noqa: E402

R, save = results_file("persistent_smem.json")
POINTERS = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
SHAPES = [("w128 bf16", 90168, 128, 256, False, False), ("w128 autocast", 90168, 128, 256, False, True),
          ("w96 bf16 (test)", 663, 96, 200, False, False), ("w128 norm bf16 (test)", 442, 128, 256, True, False)]


def main():
    mlp_layout.PERSISTENT_MIN_ROWS = 1  # the tests' shapes have too few rows for the form
    target = triton.runtime.driver.active.get_current_target()
    for tag, rows, width, hidden, norm, autocast in SHAPES:
        layers = ([nn.LayerNorm(width)] if norm else []) + [nn.Linear(width, hidden), nn.GELU(),
                                                             nn.Linear(hidden, width)]
        model = nn.Sequential(*layers)
        model = model if autocast else model.to(torch.bfloat16)
        x = torch.randn(rows, width, dtype=torch.float32 if autocast else torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            plan = plan_fusion_groups(autofuser.capture(model, x), autofuser.load_plugins().registry)
            (c,) = [c for c in plan.kept if c.strategy.name == "mlp"]
            source = c.strategy.generate(c.program, plan.view.helpers)
        program = c.program
        fn = getattr(load_variant(source.source, f"smem_{len(R)}"), source.name)
        for m, warps, stages in mlp.PERSISTENT_CONFIGS:
            for split in (0, 1):
                config = {"BLOCK_M": m, "BLOCK_H": 64, "BLOCK_K": 64, "num_warps": warps, "num_stages": stages,
                          "PERSISTENT": 1, "PROGRAMS": 132, "SPLIT_TAIL": split}
                dtypes = [*source.input_dtypes(program, config), *(t.dtype for t in program.outputs)]
                names = [f"in{k}" for k in range(len(program.inputs))] + [f"out{k}" for k in range(len(program.outputs))]
                constexprs = {k: v for k, v in source.launch_args(config).items() if k.isupper()}
                signature = {**{n: POINTERS[d] for n, d in zip(names, dtypes)}, **{k: "constexpr" for k in constexprs}}
                key = f"{tag} {m},{warps},{stages} split={split}"
                try:
                    k = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=target,
                                       options={"num_warps": warps, "num_stages": stages})
                    R[key] = {"shared": k.metadata.shared, "valid": mlp.is_valid(program, config)}
                except Exception as e:
                    R[key] = repr(e)[:200]
                print(key, R[key], flush=True)
                save()


if __name__ == "__main__":
    main()
