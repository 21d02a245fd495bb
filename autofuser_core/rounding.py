"""Rounding fp32 values to fp16/bf16 inside kernels, exactly as eager rounds.

On a GPU ``x.to(tl.bfloat16)`` rounds to nearest even. Triton's CPU
interpreter truncates instead, which would make every bf16 result checked in
CI up to one bf16 step off. Under the interpreter, kernels therefore round
through ``_af_round_bf16``: round-to-nearest-even on the fp32 bits, after
which the conversion is exact in either mode. Both paths give the same values;
the GPU keeps its single conversion instruction.
"""

from __future__ import annotations

import os

import torch

ROUND_BF16_HELPER = """@triton.jit
def _af_round_bf16(x):
    # Round-to-nearest-even from fp32 to bf16 on the bits (NaN passes through).
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))"""

#: Helpers every kernel module may use; included only where referenced.
CORE_HELPERS = {"_af_round_bf16": ROUND_BF16_HELPER}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def rounded(expr: str, dtype: torch.dtype) -> str:
    """``expr`` (fp32) rounded to ``dtype`` and back to fp32."""
    if dtype == torch.bfloat16:
        return f"_af_round_bf16({expr})" if interpreting() else f"{expr}.to(tl.bfloat16).to(tl.float32)"
    if dtype == torch.float16:
        return f"{expr}.to(tl.float16).to(tl.float32)"
    return expr


def stored(expr: str, dtype: torch.dtype, tl_dtype: str) -> str:
    """``expr`` converted for a store into a tensor of ``dtype``."""
    if dtype == torch.bfloat16 and interpreting():
        return f"_af_round_bf16({expr}).to({tl_dtype})"
    return f"{expr}.to({tl_dtype})"
