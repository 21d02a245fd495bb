"""GPU probe 6: the layer norm's own kernel over every config of the row-reduction list.

Layer norm + linear at width 256 with TF32 runs as the norm's kernel (fp32 out) and
cuBLAS's linear; the norm took 0.050 ms against a 0.044 ms copy of its bytes
(BENCHMARKS.md, runs 15-16). Is a better config in the list, past the four a
re-planning round tunes? For 90168 rows of 128 and 256, writing fp32 and bf16 (the
autocast case, the norm's output converted in its kernel): every (BLOCK_M, num_warps)
of the list that its validity rule accepts, in the list's order, timed, with a clone of the input
(its read and write) beside.

    python3 benchmarks/probes/explore6.py OUT_DIR
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import autofuser  # noqa: E402
from _parts import ms, results_file, run_parts  # noqa: E402
from matmul import M  # noqa: E402

from autofuser_core.launch import cast_inputs  # noqa: E402
from autofuser_core.planner import plan_fusion_groups  # noqa: E402
from autofuser_plugins.reduction import strategy as rows  # noqa: E402

R, save = results_file("explore6.json")


class NormTo(torch.nn.Module):
    def __init__(self, width, dtype):
        super().__init__()
        self.norm, self.dtype = torch.nn.LayerNorm(width), dtype

    def forward(self, x):
        return self.norm(x).to(self.dtype)


def part(width, dtype):
    res = R.setdefault(f"w{width} {dtype}", {})
    torch.manual_seed(0)
    model = NormTo(width, dtype).cuda().eval()
    x = torch.randn(M, width, device="cuda")
    with torch.no_grad():
        expected = model(x)
        res["eager_ms"] = ms(lambda: model(x))
        res["copy_ms"] = ms(lambda: x.clone())
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, cuda_graphs=False)
        fused(x)
        (kernel,) = fused.kernels()
        plan = plan_fusion_groups(autofuser.capture(model, x), autofuser.load_plugins().registry)
        (program,) = [c.program for c in plan.kept if c.strategy.name == "row_reduction"]
        inputs = cast_inputs(kernel.with_live_attrs([x]), kernel.casts)
        out = torch.empty_strided(*kernel.output_layout[0][:2], dtype=kernel.output_layout[0][2], device="cuda")
        args = [*inputs, out]
        listed = [c for c in rows.configs(program) if rows.is_valid(program, c) is None]
        res["tuned_first"] = [f"{c['BLOCK_M']},{c['num_warps']}" for c in listed[:4]]
        for rank, cfg in enumerate(listed):
            key = f"{rank:02d} {cfg['BLOCK_M']},{cfg['num_warps']}"
            try:
                launch = kernel.kernel[kernel.source.grid(cfg)]
                out.fill_(float("nan"))
                run = lambda: launch(*args, **kernel.source.launch_args(cfg))
                run()
                torch.cuda.synchronize()
                err = float((out.float() - expected.float()).abs().max())
                res[key] = {"ms": ms(run), "max_err": err}
            except Exception as e:  # a config the compiler refuses must not end the rest
                res[key] = repr(e)[:200]
            print(width, dtype, key, res[key], flush=True)


run_parts([lambda w=w, d=d: part(w, d) for w in (256, 128) for d in (torch.float32, torch.bfloat16)], R, save)
