"""``var``: torch.var and Tensor.var, with ``unbiased`` or ``correction``.

Two passes over the same dims - the mean, then the sum of squared deviations
from it over ``N - correction`` - rather than E[x^2] - E[x]^2, which cancels
catastrophically when the mean is large next to the spread. ``std`` reuses :func:`deviations`.
"""

import torch

from autofuser import LoweringSpec

from ._common import bind, count, float_input, reduction_dims, reduction_samples


def deviations(ctx, op, args, kwargs):
    """What an fx ``var``/``std`` node asks for: ``(x - mean, dims, N - correction, keepdim)``
    (``N - correction`` a value of the kernel, or a number).

    torch has three signatures: ``(input, dim, unbiased, keepdim)``,
    ``(input, unbiased)`` (a bool in second place), and
    ``(input, dim=None, *, correction=None, keepdim=False)``.
    """
    if len(args) >= 2 and isinstance(args[1], bool):
        positional = ("input", "unbiased")
    else:
        positional = ("input", "dim", "unbiased", "keepdim")
    b = bind(
        ctx,
        op,
        args,
        kwargs,
        positional,
        ("dim", "unbiased", "keepdim", "correction", "out"),
        {"dim": None, "keepdim": False},
    )
    x, shape = float_input(ctx, op, b["input"])
    dims = reduction_dims(ctx, op, b["dim"], len(shape))
    unbiased, correction = b.get("unbiased"), b.get("correction")
    if unbiased is not None and correction is not None:
        ctx.refuse("unsupported_argument", f"{op}: both unbiased= and correction= given")
    if unbiased is not None:
        if not isinstance(unbiased, bool):
            ctx.refuse("unsupported_argument", f"{op}: unbiased={unbiased!r} is not a bool")
        correction = 1 if unbiased else 0
    elif correction is None:
        correction = 1
    elif isinstance(correction, bool) or not isinstance(correction, (int, float)):
        ctx.refuse("unsupported_argument", f"{op}: correction={correction!r} is not a number")
    n = count(shape, dims)
    if n - correction <= 0:
        # Eager divides by max(0, N - correction): inf or nan. Not worth a kernel.
        ctx.refuse(
            "degenerate_correction", f"{op}: {n} elements with correction={correction} leave no degrees of freedom"
        )

    mean = ctx.pointwise("{0} / {1}", ctx.reduce("sum", x, dims, keepdim=True), ctx.count(n))
    # N - correction as a count: a kernel whose N varies takes N at run time (and
    # subtracts a whole correction as an integer); a fractional one stays a literal.
    whole = float(correction).is_integer()
    denominator = ctx.count(n, less=int(correction)) if whole else float(n - correction)
    return ctx.pointwise("{0} - {1}", x, mean), dims, denominator, bool(b["keepdim"])


def scaled_variance(ctx, deviation, dims, denominator, keepdim, finish):
    """``finish(m, p)`` over ``dims``, where ``m = sum(d^2) / denominator`` with
    ``d = deviation / p`` and ``p`` a power of two near the largest ``|deviation|``:
    the variance is ``m * p * p``, the standard deviation ``sqrt(m) * p``.

    Squares past ~1.8e19 overflow fp32 where the variance or the deviation may not
    (eager accumulates in double on CPU: rows of +-1e38 have a finite std). Dividing
    by a power of two is exact, so every other input rounds exactly as the unscaled
    sum would. ``p`` is 1 for a row of equal values and NaN past a NaN (whose
    deviations are NaN anyway); an infinite ``p`` gives NaN, as eager does.
    """
    largest = ctx.reduce("max", ctx.pointwise("tl.abs({0})", deviation), dims, keepdim=True)
    power = ctx.pointwise("tl.where({0} > 0.0, {0}, 1.0)", ctx.pointwise("tl.exp2(tl.floor(tl.log2({0})))", largest))
    squares = ctx.pointwise("({0} / {1}) * ({0} / {1})", deviation, power)
    mean_square = ctx.pointwise("{0} / {1}", ctx.reduce("sum", squares, dims, keepdim=True), denominator)
    result = finish(mean_square, power)
    # One value per row already: a max over the kept dims only drops them (NaN kept).
    return result if keepdim else ctx.reduce("max", result, dims, keepdim=False)


def lower_var(ctx, *args, **kwargs):
    deviation, dims, denominator, keepdim = deviations(ctx, "var", args, kwargs)
    return scaled_variance(
        ctx, deviation, dims, denominator, keepdim, lambda m, p: ctx.pointwise("{0} * {1} * {1}", m, p)
    )


SPECS = [
    LoweringSpec(
        name="reduction.var",
        description="Variance over dims, unbiased/correction, keepdim either way (two-pass).",
        targets=(torch.var, "var"),
        kind="reduction",
        lower=lower_var,
        samples=reduction_samples,
        references=(
            lambda x: x.var(-1),
            lambda x: torch.var(x, 1, keepdim=True),
            lambda x: torch.var(x, dim=(0, -1), correction=0),
            lambda x: torch.var(x, 1, False, True),
            lambda x: x.var(unbiased=False),
            lambda x: torch.var(x, False),
            lambda x: x.var(dim=-1, correction=2, keepdim=True),
        ),
    )
]
