"""``amax``: torch.amax and Tensor.amax (the max values only; torch.max(x, dim),
which also returns indices, is not claimed). ``amin.py`` is its mirror, made by
``extreme_spec`` here."""

import torch

from autofuser import LoweringSpec

from ._common import bind, float_input, reduction_dims, reduction_samples


def extreme_spec(op: str) -> LoweringSpec:
    """The spec of ``amax`` or ``amin`` (``op``): the max or min over dims (an int, a
    tuple, or ``()``, amax's and amin's default, for every dim), keepdim either way."""
    combine = op[1:]  # "max" or "min"

    def lower(ctx, *args, **kwargs):
        b = bind(ctx, op, args, kwargs, ("input", "dim", "keepdim"), ("out",), {"dim": (), "keepdim": False})
        x, shape = float_input(ctx, op, b["input"])
        dims = reduction_dims(ctx, op, b["dim"], len(shape), empty_means_all=True)
        return ctx.reduce(combine, x, dims, keepdim=bool(b["keepdim"]))

    function = getattr(torch, op)
    return LoweringSpec(
        name=f"reduction.{op}",
        description=f"The {combine} over dims (an int, a tuple, or () for all), keepdim either way.",
        targets=(function, op),
        kind="reduction",
        lower=lower,
        samples=reduction_samples,
        references=(
            lambda x: getattr(x, op)(-1),
            lambda x: function(x, 1, keepdim=True),
            lambda x: function(x, dim=(0, -1)),
            lambda x: getattr(x, op)(dim=[0], keepdim=True),
            lambda x: function(x),
            lambda x: getattr(x, op)(dim=()),
        ),
    )


SPECS = [extreme_spec("amax")]
