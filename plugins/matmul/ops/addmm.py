"""addmm and baddbmm: ``beta * input + alpha * (mat1 @ mat2)``, the product with its bias
added in the same op (what ATen spells a linear layer as, and what models call directly)."""

import torch

from autofuser import PRODUCT_TOLERANCES, LoweringSpec, Sample


def lower_addmm(ctx, bias, a, b, *, beta=1, alpha=1, out=None):
    if out is not None:
        ctx.refuse("out_argument", "out= writes into an existing tensor")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in (beta, alpha)):
        ctx.refuse("unsupported_argument", "beta and alpha must be plain numbers")
    product = ctx.matmul(a, b)
    if alpha != 1:
        product = ctx.pointwise(f"{{0}} * {float(alpha)!r}", product)
    if beta == 0:
        return product  # torch ignores input then, NaN and infinity included
    if beta != 1:
        return ctx.pointwise(f"{{0}} + {float(beta)!r} * {{1}}", product, bias)
    return ctx.pointwise("{0} + {1}", product, bias)


def _addmm_samples(dtype):
    return [
        Sample(args=(torch.randn(45, dtype=dtype), torch.randn(37, 24, dtype=dtype), torch.randn(24, 45, dtype=dtype))),
        Sample(
            args=(torch.randn(17, 1, dtype=dtype), torch.randn(17, 33, dtype=dtype), torch.randn(33, 19, dtype=dtype)),
            kwargs={"beta": 0.5, "alpha": 2.0},
        ),
    ]


def _baddbmm_samples(dtype):
    return [
        Sample(
            args=(
                torch.randn(3, 1, 21, dtype=dtype),
                torch.randn(3, 19, 40, dtype=dtype),
                torch.randn(3, 40, 21, dtype=dtype) * 0.2,
            )
        ),
    ]


SPECS = [
    LoweringSpec(
        name="matmul.addmm",
        description="torch.addmm(input, mat1, mat2, beta=, alpha=) and Tensor.addmm",
        targets=(torch.addmm, "addmm"),
        kind="matmul",
        lower=lower_addmm,
        samples=_addmm_samples,
        references=(torch.addmm,),
        tolerances=PRODUCT_TOLERANCES,
    ),
    LoweringSpec(
        name="matmul.baddbmm",
        description="torch.baddbmm(input, batch1, batch2, beta=, alpha=) and Tensor.baddbmm",
        targets=(torch.baddbmm, "baddbmm"),
        kind="matmul",
        lower=lower_addmm,
        samples=_baddbmm_samples,
        references=(torch.baddbmm,),
        tolerances=PRODUCT_TOLERANCES,
    ),
]
