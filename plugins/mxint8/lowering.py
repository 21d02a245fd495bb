"""The lowering of ``mxint8_weight``: the dequantised weight as a packed operand.

The value it returns is not computed anywhere on its own: the product that
reads it (``F.linear`` in ``MXInt8Linear.forward``, inside any of the matmul,
linear + epilogue, layer norm + linear or MLP kernels) loads the int8 element
tile and its scales and calls ``mxint8_decode`` in registers.
"""

from __future__ import annotations

from autofuser import LoweringSpec

from .format import BLOCK, FRACTION_BITS, SCALE_BIAS
from .layer import mxint8_weight

# Scale code c -> 2**(c - 133) as fp32 bits: the biased fp32 exponent is c - 6 for
# c > 6; below that the value is subnormal, 2**-149 * 2**(c + 16). Then each block's
# factor is repeated over its 32 rows and multiplies the element codes, exactly.
DECODE_SOURCE = f"""@triton.jit
def mxint8_decode(elements, scales):
    code = scales.to(tl.int32)
    bits = tl.where(code > {FRACTION_BITS}, (code - {FRACTION_BITS}) << 23,
                    1 << tl.maximum(code + {149 - SCALE_BIAS - FRACTION_BITS}, 0))
    factor = tl.where(code == 255, float("nan"), bits.to(tl.float32, bitcast=True))
    factor = tl.broadcast_to(factor[:, None, :], (scales.shape[0], {BLOCK}, scales.shape[1]))
    factor = tl.reshape(factor, (elements.shape[0], elements.shape[1]))
    return elements.to(tl.float32) * factor"""


def lower_mxint8_weight(ctx, data, scales, k, dtype):
    decode = ctx.helper("mxint8_decode", DECODE_SOURCE)
    rows = ctx.shape(data)[0]
    # Decoded values have at most 8 significant bits: exact in TF32.
    return ctx.packed_weight(
        data, scales, (rows, k), block=BLOCK, decode=decode, dtype=dtype, format="mxint8", exact_tf32=True
    )


SPECS = [
    LoweringSpec(
        name="mxint8.weight",
        description="an MXINT8 weight, decoded in registers by the product that reads it",
        targets=(mxint8_weight,),
        kind="pointwise",
        lower=lower_mxint8_weight,
        dtypes=("float32", "float16", "bfloat16", "int8", "uint8"),
    ),
]
