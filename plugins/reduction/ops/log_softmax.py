"""``log_softmax`` in its five forms: F.log_softmax, torch.log_softmax,
torch.special.log_softmax, Tensor.log_softmax and nn.LogSoftmax; also ATen's
``_log_softmax``, which a backward graph recomputes its forward with.

x - max - log(sum(exp(x - max))): never takes the log of a softmax, which
underflows to log(0) = -inf for entries far below the max.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from .softmax import softmax_operands


def lower_log_softmax(ctx, *args, **kwargs):
    x, dim = softmax_operands(ctx, "log_softmax", torch.nn.LogSoftmax, args, kwargs)
    shifted = ctx.pointwise("{0} - {1}", x, ctx.reduce("max", x, dim, keepdim=True))
    exp_sum = ctx.reduce("sum", ctx.pointwise("tl.exp({0})", shifted), dim, keepdim=True)
    return ctx.pointwise("{0} - tl.log({1})", shifted, exp_sum)


def _samples(dtype):
    return [
        Sample(args=(torch.randn(shape, dtype=dtype),), note=f"shape {shape}")
        for shape in ((3, 37), (1, 129), (2, 5, 17), (4, 6, 9))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.log_softmax",
        description="Log-softmax over one dim (max-subtracted), optional dtype= upcast.",
        targets=(
            F.log_softmax,
            torch.log_softmax,
            torch.special.log_softmax,
            "log_softmax",
            torch.nn.LogSoftmax,
            torch.ops.aten._log_softmax.default,
        ),
        kind="reduction",
        lower=lower_log_softmax,
        samples=_samples,
        references=(
            lambda x: x.log_softmax(-1),
            lambda x: torch.log_softmax(x, 1),
            lambda x: F.log_softmax(x, dim=-1),
            lambda x: F.log_softmax(x, 1, _stacklevel=5),
            lambda x: torch.special.log_softmax(x, 0),
            lambda x: x.log_softmax(-1, dtype=torch.float32),
            torch.nn.LogSoftmax(dim=1),
            torch.nn.LogSoftmax(dim=-1),
            lambda x: torch.ops.aten._log_softmax.default(x, 0, False),
        ),
    )
]
