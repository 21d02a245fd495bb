"""``torch.relu``, ``F.relu``, ``x.relu()``, ``nn.ReLU``: max(x, 0) with NaN kept, as torch does."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import lowering, module_attr, refuse_inplace, require_float_output, unary_samples


@lowering
def lower_relu(ctx, input, inplace=False):
    refuse_inplace(ctx, inplace or module_attr(ctx, "inplace", False))
    require_float_output(ctx)
    # NaN < 0 is false, so NaN passes through (tl.maximum(x, 0) need not keep it).
    return ctx.pointwise("tl.where({0} < 0, 0.0, {0})", input)


SPECS = [
    LoweringSpec(
        name="elementwise.relu",
        description="max(x, 0), NaN propagating",
        targets=(torch.relu, F.relu, "relu", torch.nn.ReLU),
        kind="pointwise",
        lower=lower_relu,
        samples=lambda dtype: unary_samples(dtype, nans=True),
        references=(torch.relu, F.relu, lambda x: F.relu(x, inplace=False), lambda x: x.relu(), torch.nn.ReLU()),
    ),
]
