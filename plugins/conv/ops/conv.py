"""Convolutions (``nn.Conv1d``/``2d``/``3d``, ``F.conv1d``/``2d``/``3d``).

1x1 convolutions (stride 1, no padding, one group) are matrix products over
the channel dim: ``out[b, o, *s] = sum_c weight[o, c] * x[b, c, *s] (+ bias[o])``.
The product reads ``x`` in place, channels-first or channels-last alike: the
weight ``[O, C, 1, ...]`` is read as ``[O, C]``, ``x`` ``[B, C, *spatial]`` is
the second operand with its spatial dims as the product's columns
(``column_dims``), so no copy is made and the matmul strategies fuse the bias,
a following batch norm, activation and residual add into the product's
epilogue.

Other small kernels (up to 3x3x3 taps, any stride, padding and dilation, one
group, batched input) are lowered as extern ops that the implicit-GEMM
strategy generates with their epilogue (``convolution.py``). Grouped
convolutions and larger kernels stay eager.
"""

import torch
import torch.nn.functional as F

from autofuser import PRODUCT_TOLERANCES, LoweringSpec, Sample
from autofuser.kernel import tf32_allowed

from ..convolution import conv_reason, parse_conv
from ._common import float_tensor, int_tuple, module_forward_is, per_channel

FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
MODULES = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}


def lower_conv_1x1(ctx, rank, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    op = f"conv{rank}d"
    shape = float_tensor(ctx, op, x)
    if len(shape) not in (rank + 1, rank + 2):
        ctx.refuse("shape_mismatch", f"{op}: a {len(shape)}-d input, expected {rank + 1} or {rank + 2} dims")
    w = ctx.tensor(weight)
    out_channels, in_channels, *kernel = w.shape
    if groups != 1:
        ctx.refuse("unsupported_argument", f"{op}: groups={groups!r}; grouped convolutions stay eager")
    product = (
        all(k == 1 for k in kernel)
        and int_tuple(ctx, op, "stride", stride, rank) == (1,) * rank
        and (padding in ("valid", "same") or int_tuple(ctx, op, "padding", padding, rank) == (0,) * rank)
    )
    if not product:
        # Not a plain product: the implicit-GEMM strategy's, if it takes this geometry.
        conv = parse_conv(ctx.node, ctx.root)
        if isinstance(conv, str):
            ctx.refuse("unsupported_argument", f"{op}: {conv}")
        reason = conv_reason(conv)
        if reason is not None:
            ctx.refuse("unsupported_kernel", f"{op}: {reason}")
        return ctx.extern()
    int_tuple(ctx, op, "dilation", dilation, rank)  # any dilation: a 1x1 kernel has no gaps to dilate
    channel_dim = len(shape) - rank - 1
    if shape[channel_dim] != in_channels:
        ctx.refuse("shape_mismatch", f"{op}: input has {shape[channel_dim]} channels, the weight {in_channels}")
    # cuDNN multiplies fp32 in TF32 where torch allows it for convolutions (the default).
    tf32 = "tf32" if tf32_allowed("conv") else None
    out = ctx.matmul(ctx.read_as(w, (out_channels, in_channels)), x, column_dims=rank, fp32_precision=tf32)
    if bias is not None:
        out = ctx.pointwise("{0} + {1}", out, per_channel(ctx, bias, out_channels, rank, op, "bias"))
    return out


def _function_lowering(rank):
    def lower(ctx, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        return lower_conv_1x1(ctx, rank, input, weight, bias, stride, padding, dilation, groups)

    return lower


def _module_lowering(rank):
    def lower(ctx, input):
        module = ctx.module
        module_forward_is(ctx, MODULES[rank])
        if module.padding_mode != "zeros" and any(p != 0 for p in module._reversed_padding_repeated_twice):
            ctx.refuse("unsupported_argument", f"Conv{rank}d: padding_mode={module.padding_mode!r}")
        bias = ctx.attr("bias") if module.bias is not None else None
        return lower_conv_1x1(
            ctx, rank, input, ctx.attr("weight"), bias, module.stride, module.padding, module.dilation, module.groups
        )

    return lower


SPATIAL = {1: (37,), 2: (13, 7), 3: (5, 3, 4)}  # odd sizes; 3-d kept small for the interpreter


def _function_samples(rank):
    def samples(dtype):
        s = SPATIAL[rank]
        return [
            Sample(
                args=(
                    torch.randn(2, 12, *s, dtype=dtype),
                    torch.randn(19, 12, *(1,) * rank, dtype=dtype) * 0.3,
                    torch.randn(19, dtype=dtype),
                ),
                note="bias",
            ),
            Sample(
                args=(
                    torch.randn(7, *s, dtype=dtype),
                    torch.randn(3, 7, *(1,) * rank, dtype=dtype) * 0.3,
                    torch.randn(3, dtype=dtype),
                ),
                note="unbatched",
            ),
            Sample(
                args=(torch.randn(1, 5, *s, dtype=dtype), torch.randn(9, 5, *(3,) * rank, dtype=dtype) * 0.2, None),
                note="3-tap kernel (implicit GEMM), batch 1, no bias",
            ),
        ]

    return samples


#: Input channels of the module samples: 5 x 27 taps of a 3x3x3 kernel stay within the
#: implicit-GEMM strategy's MAX_REDUCTION, so its 3-d kernel is checked too.
MODULE_CHANNELS = 5


def _module_samples(rank):
    def samples(dtype):
        s = SPATIAL[rank]
        # channels-last strides: the product walks the spatial dims with stride C.
        last = torch.randn(3, *s, MODULE_CHANNELS, dtype=dtype).movedim(-1, 1)
        return [
            Sample(args=(torch.randn(3, MODULE_CHANNELS, *s, dtype=dtype),)),
            Sample(args=(last,), note="channels-last"),
        ]

    return samples


def _conv_module(rank, bias, **geometry):
    layer = MODULES[rank](MODULE_CHANNELS, 21, bias=bias, **{"kernel_size": 1, **geometry})
    if bias:
        torch.nn.init.normal_(layer.bias)
    return layer


SPECS = []
for _rank in (1, 2, 3):
    _f = FUNCTIONS[_rank]
    SPECS += [
        LoweringSpec(
            name=f"conv.conv{_rank}d",
            description=f"F.conv{_rank}d: 1x1 as a product over the channel dim, small kernels as implicit GEMM",
            targets=(_f,),
            kind="matmul",
            lower=_function_lowering(_rank),
            samples=_function_samples(_rank),
            references=(
                (lambda f: lambda x, w, b: f(x, w, b))(_f),
                (lambda f: lambda x, w, b: f(x, w, bias=b, stride=2, padding=1))(_f),
                (lambda f: lambda x, w, b: f(x, w, b, padding="same", dilation=2))(_f),
            ),
            tolerances=PRODUCT_TOLERANCES,
        ),
        LoweringSpec(
            name=f"conv.conv{_rank}d_module",
            description=f"nn.Conv{_rank}d: 1x1 as a product over the channel dim, small kernels as implicit GEMM",
            targets=(MODULES[_rank],),
            kind="matmul",
            lower=_module_lowering(_rank),
            samples=_module_samples(_rank),
            references=(_conv_module(_rank, True), _conv_module(_rank, False, kernel_size=3, stride=2, padding=1)),
            tolerances=PRODUCT_TOLERANCES,
        ),
    ]
