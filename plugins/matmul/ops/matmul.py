"""matmul, ``@``, mm and bmm: matrix products over the last two dims, leading dims broadcast."""

import operator

import torch

from autofuser import PRODUCT_TOLERANCES, LoweringSpec, Sample


def lower_matmul(ctx, a, b, *, out=None):
    if out is not None:
        ctx.refuse("out_argument", "out= writes into an existing tensor")
    return ctx.matmul(a, b)


def _samples(dtype):
    return [
        Sample(args=(torch.randn(37, 24, dtype=dtype), torch.randn(24, 45, dtype=dtype) * 0.2)),
        Sample(args=(torch.randn(3, 19, 40, dtype=dtype), torch.randn(3, 40, 21, dtype=dtype) * 0.2)),
        Sample(args=(torch.randn(1, 17, 33, dtype=dtype), torch.randn(1, 33, 18, dtype=dtype) * 0.2)),
    ]


def _batched_transposed(dtype):
    # k.transpose(-2, -1) feeding the product is read through its strides, no copy
    return [Sample(args=(torch.randn(2, 3, 29, 16, dtype=dtype), torch.randn(2, 3, 31, 16, dtype=dtype)))]


SPECS = [
    LoweringSpec(
        name="matmul.matmul",
        description="torch.matmul, the @ operator, Tensor.matmul",
        targets=(torch.matmul, operator.matmul, "matmul"),
        kind="matmul",
        lower=lower_matmul,
        samples=_samples,
        references=(torch.matmul, lambda a, b: a @ b, lambda a, b: a.matmul(b)),
        tolerances=PRODUCT_TOLERANCES,
    ),
    LoweringSpec(
        name="matmul.bmm",
        description="torch.bmm, torch.mm and their methods",
        targets=(torch.bmm, "bmm", torch.mm, "mm"),
        kind="matmul",
        lower=lower_matmul,
        samples=lambda dtype: _samples(dtype)[1:],
        references=(torch.bmm, lambda a, b: a.bmm(b)),
        tolerances=PRODUCT_TOLERANCES,
    ),
]
