"""GPU probe 3: the width-128 MLP kernel (w -> 2w -> w, GELU, residual) under autocast to
bf16, as a bf16 model and in TF32: a sweep of configs (more programs per multiprocessor
with one pipeline stage, shorter hidden slices), the GELU taken out (a bound, not a
result), and two edits of the persistent form: the next row block's activations loaded
into registers while this one computes, and the residual read from the rows already
loaded instead of from memory again.

    python3 benchmarks/probes/explore3.py OUT_DIR [autocast] [bf16_model] [tf32]"""
import json, os, re, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _parts import edit, mlp_case, run_parts, time_variants
from matmul import M

OUT = sys.argv[1]
R = {}
STREAMED = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 1), (64, 32, 4, 1), (64, 128, 4, 1),
            (64, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 1), (128, 32, 4, 1)]
PERSISTENT = [(128, 8, 1), (64, 4, 1), (64, 8, 1), (64, 4, 2), (64, 4, 3), (128, 8, 2)]


def save():
    with open(os.path.join(OUT, "explore3.json"), "w") as f:
        json.dump(R, f, indent=1)


def prefetch(source, rows, k):
    """The persistent loop with the next row block's A loaded at the top of each iteration."""
    first = re.search(r"\n( +)x0_v1 = tl\.load\(in0 \+ r0 \* (\d+) \+ ks, mask=row_mask & k_mask, other=0\)(\.to\(tl\.float32\))",
                      source)
    if first is None or "for tile in range(" not in source:
        raise ValueError("unexpected persistent loop")
    indent, stride, cast = first.group(1), first.group(2), first.group(3)
    loop = re.search(r"\n( +)for tile in range\(", source)
    head = (f"\n{loop.group(1)}ks_p = tl.arange(0, BLOCK_K)[None, :]"
            f"\n{loop.group(1)}rows_p = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]"
            f"\n{loop.group(1)}x_next = tl.load(in0 + rows_p * {stride} + ks_p, mask=(rows_p < {rows}) & (ks_p < {k}), other=0)")
    source = source[:loop.start()] + head + source[loop.start():]
    first = re.search(r"\n( +)x0_v1 = tl\.load\(in0 \+ r0 \* (\d+) \+ ks, mask=row_mask & k_mask, other=0\)(\.to\(tl\.float32\))",
                      source)
    body = (f"\n{indent}x0_v1 = x_next{cast}"
            f"\n{indent}rows_n = rows + PROGRAMS * BLOCK_M"
            f"\n{indent}x_next = tl.load(in0 + rows_n * {stride} + ks, mask=(rows_n < {rows}) & k_mask, other=0)")
    return source[:first.start()] + body + source[first.end():]


def reuse_residual(source):
    """The persistent loop's residual read from the A rows in registers (K == N only)."""
    out, n = re.subn(r"(\n {12})(x0_v\d+) = tl\.load\(in0 \+ r0 \* \d+ \+ cols, mask=row_mask & col_mask, other=0\)\.to\(tl\.float32\)",
                     r"\1\2 = x0_v1", source, count=1)
    if n != 1:
        raise ValueError("no residual load found in the persistent loop")
    return out


def setup_case(setup):
    case = mlp_case(setup)
    res = R.setdefault(setup, {})
    res["eager_ms"] = case["eager_ms"]
    base = res["source"] = case["kernel"].source.source
    gelu = r"(?<!def )elementwise_gelu\((\w+)\)"
    variants = {"as_generated": base, "no_gelu": edit(gelu, r"(\1)", base)}
    persistent = "PERSISTENT: tl.constexpr" in base
    if persistent:
        variants["prefetch"] = prefetch(base, M, 128)
        variants["prefetch_reuse"] = reuse_residual(variants["prefetch"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [{"BLOCK_M": m, "BLOCK_H": h, "BLOCK_K": 64, "num_warps": w, "num_stages": s,
                **({"PERSISTENT": 0, "PROGRAMS": 1} if persistent else {})} for m, h, w, s in STREAMED]
    if persistent:
        configs += [{"BLOCK_M": m, "BLOCK_H": 64, "BLOCK_K": 64, "num_warps": w, "num_stages": s, "PERSISTENT": 1,
                     "PROGRAMS": sms} for m, w, s in PERSISTENT]
    time_variants(case, variants, configs, res, setup, save,
                  skip=lambda tag, cfg: tag.startswith("prefetch") and not cfg.get("PERSISTENT"))


def autocast():
    setup_case("autocast")


def bf16_model():
    setup_case("bf16_model")


def tf32():
    setup_case("tf32")


run_parts([globals()[name] for name in (sys.argv[2:] or ["autocast", "bf16_model", "tf32"])], R, save)
