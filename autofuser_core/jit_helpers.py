"""``@triton.jit`` helpers for hand-written kernels (plugins' own, through
``autofuser.kernel``). A module of its own: importing it imports Triton, which the
interpreter's switch (``interpreter.arrange_interpreter``) must not do before it ran."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """``rounding``'s bf16 rounding for hand-written kernels: an fp32 value rounded to the
    nearest bf16 (ties to even, NaN passing), held in fp32, so that converting it to bf16
    is exact interpreted or not (the interpreter's own conversion truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
