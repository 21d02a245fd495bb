"""MXINT8 weight quantisation (OCP Microscaling v1.0), decoded inside the fused products.

``autofuser.fuse(model, quantize="mxint8")`` replaces the model's
``nn.Linear`` layers (those selected, see ``QuantizeOptions``) with
``MXInt8Linear``: int8 elements and one E8M0 scale per 32 weights along the
reduction dim (the exact encoding: ``format``). The lowering of its weight
lets the matmul, linear + epilogue, layer norm + linear and MLP kernels read
the int8 tiles and scales and dequantise them in registers; activations keep
their dtype.
"""

import torch

from autofuser import QuantizerSpec, hookimpl

from .format import BLOCK, dequantize_mxint8, quantize_mxint8
from .layer import MXInt8Linear, mxint8_weight
from .lowering import SPECS

__all__ = ["MXInt8Linear", "dequantize_mxint8", "mxint8_weight", "quantize_mxint8"]

QUANTIZER = QuantizerSpec(
    name="mxint8",
    description="OCP MX v1.0 MXINT8: int8 elements (q * 2**-6), one E8M0 scale per 32 along K",
    format="mxint8",
    block_size=BLOCK,
    quantize=quantize_mxint8,
    dequantize=dequantize_mxint8,
    module_types=(torch.nn.Linear,),
    replace=MXInt8Linear.from_linear,
)


@hookimpl
def autofuser_register_lowerings(register):
    for spec in SPECS:
        register(spec)


@hookimpl
def autofuser_register_quantizers(register):
    register(QUANTIZER)
