"""How accurate the exact GELU's Triton helper is: every fp32 value of a range of
binades (both signs) through the helper, against float64, beside eager's fp32 GELU.

    python benchmarks/gelu_accuracy.py [--device cpu|cuda] [--lo -30] [--hi 10] [--stride 1]

On the CPU, run it under TRITON_INTERPRET=1 (the interpreter computes exp2 exactly, so
add ex2.approx's 2^-22 relative error by hand: at most 2 more units below). On a GPU it
runs the compiled helper, ex2.approx included.

The error is reported in units of 2^-24 |x| (between half an ulp and one ulp of the
input), the scale a product that consumes the GELU sees: in the negative tail, where the result is tiny,
eager's own 1 + erf cancels and its error in ulps of the result is unbounded.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

import torch

from autofuser_core.cache import module_from_source
from autofuser_plugins.elementwise.ops._common import _GELU_SOURCE, GELU


def helper_kernel():
    """A kernel that applies the helper to a flat fp32 tensor."""
    source = (
        "import triton\nimport triton.language as tl\n\n"
        + _GELU_SOURCE
        + f"""

@triton.jit
def apply(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, {GELU}(x), mask=offs < n)
"""
    )
    path = os.path.join(tempfile.mkdtemp(prefix="gelu_accuracy_"), "gelu_helper.py")
    with open(path, "w") as f:
        f.write(source)
    return module_from_source("gelu_helper", source, path).apply


def gelu_helper(x: torch.Tensor, kernel, block: int = 1 << 16) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel[(math.ceil(x.numel() / block),)](x, out, x.numel(), BLOCK=block)
    return out


def reference(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * 0.5 * torch.special.erfc(-x / math.sqrt(2.0))


def binade(exponent: int, stride: int, device) -> torch.Tensor:
    """Every ``stride``-th fp32 value in [2^exponent, 2^(exponent + 1))."""
    start = torch.tensor(2.0**exponent, dtype=torch.float32).view(torch.int32).item()
    return torch.arange(start, start + (1 << 23), stride, dtype=torch.int32, device=device).view(torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lo", type=int, default=-30, help="first binade exponent")
    parser.add_argument("--hi", type=int, default=10, help="last binade exponent (values below 2^(hi + 1))")
    parser.add_argument("--stride", type=int, default=1, help="check every stride-th value (1: all of them)")
    args = parser.parse_args()
    device = torch.device(args.device)
    kernel = helper_kernel()
    worst = {}
    for sign in (1.0, -1.0):
        for exponent in range(args.lo, args.hi + 1):
            x = binade(exponent, args.stride, device) * sign
            expected = reference(x)
            scale = x.double().abs() * 2.0**-24
            for name, got in (("helper", gelu_helper(x, kernel)), ("eager", torch.nn.functional.gelu(x))):
                units = float(((got.double() - expected).abs() / scale).max())
                key = (name, "x > 0" if sign > 0 else "x < 0")
                worst[key] = max(worst.get(key, 0.0), units)
            print(
                f"binade 2^{exponent} sign {sign:+.0f}: helper {worst[('helper', key[1])]:.3g}, "
                f"eager {worst[('eager', key[1])]:.3g} (running max, units of 2^-24 |x|)",
                flush=True,
            )
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -20.0, -1e4, 1e4], device=device)
    print("specials", specials.tolist())
    print("  helper", gelu_helper(specials, kernel).tolist())
    print("  eager ", torch.nn.functional.gelu(specials).tolist())
    for (name, side), units in sorted(worst.items()):
        print(f"{name:6s} {side}: max error {units:.3g} x 2^-24 |x|")


if __name__ == "__main__":
    main()
