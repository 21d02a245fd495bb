"""``layer_norm``: F.layer_norm and torch.layer_norm (nn.LayerNorm lives in
``layer_norm_module.py``; its samples need the module's fixed shape).

Over the last ``len(normalized_shape)`` dims: the mean, then the biased
variance of the deviations (two passes, as eager computes it, never
E[x^2] - E[x]^2), then ``(x - mean) * rsqrt(var + eps)``, times ``weight``
and plus ``bias`` where given.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import bind, count, float_input


def normalized_dims(ctx, op, normalized_shape, shape):
    """The trailing dims ``normalized_shape`` names, checked against the input's shape."""
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    if not isinstance(normalized_shape, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in normalized_shape
    ):
        ctx.refuse("unsupported_argument", f"{op}: normalized_shape={normalized_shape!r} is not a tuple of ints")
    normalized_shape = tuple(normalized_shape)
    rank = len(shape)
    trailing = tuple(shape[rank - len(normalized_shape) :])
    if not normalized_shape or len(normalized_shape) > rank or trailing != normalized_shape:
        ctx.refuse("shape_mismatch", f"{op}: normalized_shape {normalized_shape} is not the trailing shape of {shape}")
    return tuple(range(rank - len(normalized_shape), rank)), normalized_shape


def number(ctx, op, name, value):
    """A Python float argument such as ``eps``; fx nodes and other types are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        ctx.refuse("unsupported_argument", f"{op}: {name}={value!r} is not a number")
    return float(value)


def affine_operand(ctx, op, name, arg, normalized_shape):
    """A ``weight``/``bias`` argument: ``None`` or a tensor of exactly ``normalized_shape``."""
    if arg is None:
        return None
    if not ctx.is_tensor(arg):
        ctx.refuse("not_a_tensor", f"{op}: {name}={arg!r} is not a tensor")
    if ctx.shape(arg) != normalized_shape:
        ctx.refuse("shape_mismatch", f"{op}: {name} of shape {ctx.shape(arg)}, expected {normalized_shape}")
    return ctx.tensor(arg)


def lower_layer_norm(ctx, *args, **kwargs):
    op = "layer_norm"
    b = bind(
        ctx,
        op,
        args,
        kwargs,
        ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"),
        defaults={"weight": None, "bias": None, "eps": 1e-5},
    )
    if "normalized_shape" not in b:
        ctx.refuse("unsupported_argument", f"{op}: normalized_shape missing")
    x, shape = float_input(ctx, op, b["input"])
    dims, normalized_shape = normalized_dims(ctx, op, b["normalized_shape"], shape)
    weight = affine_operand(ctx, op, "weight", b["weight"], normalized_shape)
    bias = affine_operand(ctx, op, "bias", b["bias"], normalized_shape)
    eps = number(ctx, op, "eps", b["eps"])
    return ctx.normalize(x, dims, count(shape, dims), eps, weight, bias)


def _samples(dtype):
    # Every sample ends in (6, 37) so one reference can normalise the last dim
    # and another the last two; each carries weights and biases for both.
    return [
        Sample(
            args=(
                torch.randn(shape, dtype=dtype),
                torch.randn(37, dtype=dtype),
                torch.randn(37, dtype=dtype),
                torch.randn(6, 37, dtype=dtype),
                torch.randn(6, 37, dtype=dtype),
            ),
            note=f"input {shape}; weight, bias (37,); weight, bias (6, 37)",
        )
        for shape in ((6, 37), (2, 6, 37), (1, 3, 6, 37))
    ]


SPECS = [
    LoweringSpec(
        name="reduction.layer_norm",
        description="Layer norm over the trailing dims, weight and bias optional.",
        targets=(F.layer_norm, torch.layer_norm),
        kind="reduction",
        lower=lower_layer_norm,
        samples=_samples,
        references=(
            lambda x, w1, b1, w2, b2: F.layer_norm(x, (37,), w1, b1),
            lambda x, w1, b1, w2, b2: F.layer_norm(x, [6, 37], w2, b2, eps=1e-3),
            lambda x, w1, b1, w2, b2: F.layer_norm(x, (37,)),
            lambda x, w1, b1, w2, b2: F.layer_norm(x, (6, 37), weight=w2),
            lambda x, w1, b1, w2, b2: torch.layer_norm(x, (37,), w1, b1, 1e-5),
        ),
    )
]
