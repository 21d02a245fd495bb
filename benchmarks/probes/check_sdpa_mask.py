"""GPU check: scaled_dot_product_attention with a bool mask whose query row 3 admits no
key, in fp32, fp16 and bf16, on tests/test_attention.py's shapes: the kernel's own output
(the verification's verdict recorded but not acted on), eager's default backend and its
math backend, each against a float64 reference, row by row.

    python3 benchmarks/probes/check_sdpa_mask.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import autofuser  # noqa: E402
import autofuser_core.compile as compile_module  # noqa: E402
from test_attention import Attention, heads, make_input  # noqa: E402

verdicts = []
original = compile_module._max_error


def record(fused, eager, tol):
    ok, err = original(fused, eager, tol)
    verdicts.append((ok, err))
    return True, err


compile_module._max_error = record


def reference(q, k, v, mask):
    """float64 softmax attention, ``mask`` True where a key is attended; a row with no
    key gives 0, as torch documents."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def rows_off(got, want, tol):
    """Query rows where any head or batch entry differs by more than ``tol``."""
    diff = (got.double() - want).abs().nan_to_num(float("inf"))
    per_row = diff.amax(dim=(0, 1, 3))
    return [int(r) for r in torch.nonzero(per_row > tol).flatten()], float(per_row.max())


form = "sdpa_bool_mask"
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    torch.manual_seed(0)
    q, k, v = (make_input(3, n, 24, "rearranged", dtype) for n in (37, 53, 53))
    mask = torch.rand(37, 53, device=q.device) > 0.3  # True: attend
    mask[:, 0] = True
    mask[3] = False  # no key at all
    extras = (mask,)
    model = Attention(form, "rearranged").eval()
    verdicts.clear()
    with torch.no_grad():
        eager = model(q, k, v, *extras)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            math = model(q, k, v, *extras)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(q, k, v, *extras)
    want = reference(*(heads(t, "rearranged") for t in (q, k, v)), extras[0])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    print(f"{form} {dtype}: verdicts {verdicts}; groups {[g.strategy for g in fused.report().fused]}")
    for name, out in (("kernel", got), ("eager", eager), ("eager math", math)):
        print(f"  {name:10s} rows off float64 by > {tol}: {rows_off(out, want, tol)}")
    print(f"  row 3 (no key): kernel {got[0, 0, 3, :4].tolist()} eager {eager[0, 0, 3, :4].tolist()}", flush=True)
