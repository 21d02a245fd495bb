"""The MXINT8 format (OCP Microscaling Formats v1.0) and its plain-torch reference.

Encoding, exactly as this plugin stores it:

- A weight ``[N, K]`` (``K``, the reduction dim, last) is cut along ``K`` into
  blocks of 32 elements; ``K`` is padded with zeros to a multiple of 32, so
  the last block of a row holds ``K % 32`` real elements and zeros (zeros
  change neither the block's scale nor the product).
- Each block shares one E8M0 scale: a ``uint8`` code ``c``, the power of two
  ``2**(c - 127)``; code 255 is NaN in the spec and is never written (the
  decoder turns it into NaN).
- Each element is an ``int8`` ``q`` (two's complement) read as the fixed-point
  number ``q * 2**-6`` (1 sign bit, 1 integer bit, 6 fraction bits), so an
  element is worth ``q * 2**(c - 127 - 6)``.
- Shared exponent, as the spec's conversion: ``e = floor(log2(max|x|)) -
  emax_elem`` with ``emax_elem = 0`` for INT8, clamped to the scale's range
  ``[-127, 127]``; an all-zero block gets ``e = -127`` (code 0).
- Elements: ``x / 2**e`` rounded to the nearest multiple of ``2**-6``, ties
  to even, then saturated to ``[-127, 127] * 2**-6``. The spec's INT8 range
  is ``[-2, 127/64]`` (``q = -128`` is a valid code and decodes to -2); the
  quantiser saturates symmetrically to ``+-127/64`` so that ``-x`` encodes
  as the negation of ``x``, as the MX reference library does. Since
  ``max|x| / 2**e`` lies in ``[1, 2)``, only values rounding up to 128
  saturate (to 127).
- Finite weights only: NaN or infinity is an error (the spec would make the
  whole block NaN).

All arithmetic in ``quantize_mxint8`` and ``dequantize_mxint8`` is exact
(float64 with power-of-two factors): the only rounding is the one to the
element grid. Dequantised values are exact in fp32 (at most 8 significant
bits, magnitudes between ``2**-133`` and ``127 * 2**121``) and in bf16; fp16
holds them only within its narrower exponent range.
"""

from __future__ import annotations

import torch

#: Elements per shared scale along the reduction dim.
BLOCK = 32
#: Scale code of 2**0.
SCALE_BIAS = 127
#: Fraction bits of an INT8 element: q * 2**-6.
FRACTION_BITS = 6
#: Largest magnitude of a quantised element code (symmetric saturation).
MAX_CODE = 127


def padded(k: int) -> int:
    """``k`` rounded up to a whole number of blocks."""
    return -(-k // BLOCK) * BLOCK


def quantize_mxint8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[N, K]`` float weight -> ``{"data": int8 [N, K padded], "scales": uint8 [N, K padded / 32]}``.

    :raises ValueError: the weight is not a matrix or holds NaN / infinity.
    """
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(
            f"MXINT8 quantises float matrices [N, K], not a {weight.dtype} tensor of shape {list(weight.shape)}"
        )
    bad = ~torch.isfinite(weight)
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"the weight holds {int(bad.sum())} NaN/infinite value(s) (the first at {first}); "
            "MXINT8 encodes finite numbers only"
        )
    n, k = weight.shape
    full = torch.zeros(n, padded(k), dtype=torch.float64, device=weight.device)
    full[:, :k] = weight.detach().to(torch.float64)
    blocks = full.view(n, -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # amax = m * 2**p with m in [0.5, 1): floor(log2(amax)) = p - 1, exactly, subnormals included.
    _, power = torch.frexp(amax)
    shared = torch.where(amax > 0, power - 1, torch.full_like(power, -SCALE_BIAS)).clamp(-SCALE_BIAS, SCALE_BIAS)
    step = torch.ldexp(torch.ones_like(amax), (FRACTION_BITS - shared))  # 2**(6 - e): exact in float64
    codes = torch.round(blocks * step[..., None]).clamp(-MAX_CODE, MAX_CODE)  # round half to even
    return {"data": codes.to(torch.int8).view(n, -1), "scales": (shared + SCALE_BIAS).to(torch.uint8)}


def dequantize_mxint8(
    data: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The reference decoder: ``[N, K]`` in ``dtype`` from the packed tensors (padding dropped)."""
    codes = scales.to(torch.int64)
    value = torch.ldexp(
        torch.ones(codes.shape, dtype=torch.float64, device=scales.device), codes - SCALE_BIAS - FRACTION_BITS
    )
    value = torch.where(codes == 255, torch.full_like(value, float("nan")), value)
    weight = data.to(torch.float64) * value.repeat_interleave(BLOCK, dim=-1)
    return weight[..., :k].to(torch.float32).to(dtype)
