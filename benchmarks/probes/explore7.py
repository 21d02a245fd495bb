"""GPU probe 7: the width-128 MLP kernel's persistent form (bf16 autocast, 90168 rows)
with more warps than its config list has: 16 warps (four warp groups) on 128-row blocks,
against the list's 8. More warps per program give the scheduler other warps' products to
run while one warp group computes its GELU.

    python3 benchmarks/probes/explore7.py OUT_DIR
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import mlp_case, results_file, run_parts, time_variants  # noqa: E402

R, save = results_file("explore7.json")
# (BLOCK_M, num_warps, num_stages): the list's best first, then 16 warps
PERSISTENT = [(128, 8, 1), (128, 8, 2), (128, 8, 3), (128, 16, 1), (128, 16, 2), (128, 16, 3), (64, 8, 2),
              (64, 8, 3), (256, 16, 1)]


def autocast():
    res = R.setdefault("w128 autocast", {})
    case = mlp_case("autocast", 128)
    res["eager_ms"] = case["eager_ms"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [{"BLOCK_M": m, "BLOCK_H": 64, "BLOCK_K": 64, "num_warps": w, "num_stages": s, "PERSISTENT": 1,
                "PROGRAMS": sms} for m, w, s in PERSISTENT]
    time_variants(case, {"as_generated": case["kernel"].source.source}, configs, res, "autocast", save)


run_parts([autocast], R, save)
