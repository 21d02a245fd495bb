"""``rms_norm``: F.rms_norm and torch.rms_norm (nn.RMSNorm lives in
``rms_norm_module.py``).

``x * rsqrt(mean(x^2) + eps) * weight`` over the last ``len(normalized_shape)``
dims. ``eps=None`` is the machine epsilon of the dtype torch computes in:
float32's for float32, float16 and bfloat16 inputs alike (torch upcasts half
types, see ``torch._decomp.decompositions._fused_rms_norm``; the documented
``torch.finfo(x.dtype).eps`` is off for half types and was checked against eager).
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import bind, count, float_input
from .layer_norm import affine_operand, normalized_dims, number

#: eps=None: float32's epsilon, the computation dtype of every fused input dtype.
DEFAULT_EPS = torch.finfo(torch.float32).eps


def rms_normalize(ctx, x, dims, n, eps, weight):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over ``dims`` (``n`` elements)."""
    squares = ctx.reduce("sum", ctx.pointwise("{0} * {0}", x), dims, keepdim=True)
    mean_square = ctx.pointwise("{0} / {1}", squares, ctx.count(n))
    out = ctx.pointwise("{0} * tl.rsqrt({1} + %r)" % eps, x, mean_square)
    if weight is not None:
        out = ctx.pointwise("{0} * {1}", out, weight)
    return out


def lower_rms_norm(ctx, *args, **kwargs):
    op = "rms_norm"
    b = bind(
        ctx, op, args, kwargs, ("input", "normalized_shape", "weight", "eps"), defaults={"weight": None, "eps": None}
    )
    if "normalized_shape" not in b:
        ctx.refuse("unsupported_argument", f"{op}: normalized_shape missing")
    x, shape = float_input(ctx, op, b["input"])
    dims, normalized_shape = normalized_dims(ctx, op, b["normalized_shape"], shape)
    weight = affine_operand(ctx, op, "weight", b["weight"], normalized_shape)
    eps = DEFAULT_EPS if b["eps"] is None else number(ctx, op, "eps", b["eps"])
    return rms_normalize(ctx, x, dims, count(shape, dims), eps, weight)


def _samples(dtype):
    # Every sample ends in (6, 37): one reference normalises the last dim,
    # another the last two; each sample carries a weight for both.
    return [
        Sample(
            args=(torch.randn(shape, dtype=dtype), torch.randn(37, dtype=dtype), torch.randn(6, 37, dtype=dtype)),
            note=f"input {shape}; weights (37,) and (6, 37)",
        )
        for shape in ((6, 37), (2, 6, 37), (1, 3, 6, 37))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.rms_norm",
        description="RMS norm over the trailing dims, weight optional, eps=None as torch.",
        targets=(F.rms_norm, torch.rms_norm),
        kind="reduction",
        lower=lower_rms_norm,
        samples=_samples,
        references=(
            lambda x, w1, w2: F.rms_norm(x, (37,), w1),
            lambda x, w1, w2: F.rms_norm(x, [6, 37], w2, eps=1e-6),
            lambda x, w1, w2: F.rms_norm(x, (37,)),
            lambda x, w1, w2: torch.rms_norm(x, (37,), w1, 1e-5),
        ),
    )
]
