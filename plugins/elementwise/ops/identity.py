"""``nn.Identity``: its input."""

import torch

from autofuser import LoweringSpec

from ._common import unary_samples


def lower_identity(ctx, input, *args, **kwargs):
    # nn.Identity ignores any further arguments, as does this.
    return ctx.tensor(input)


SPECS = [
    LoweringSpec(
        name="elementwise.identity",
        description="nn.Identity: the input itself",
        targets=(torch.nn.Identity,),
        kind="pointwise",
        lower=lower_identity,
        samples=lambda dtype: unary_samples(dtype),
        references=(torch.nn.Identity(),),
    ),
]
