"""``torch.stack(tensors, dim)``: the inputs side by side along a new dim.

Lowered as a cat along the new dim (``cat.py``): input ``k`` is read where the new
dim's coordinate is ``k`` (``ctx.read_shifted`` with ``new_dims``: the input lacks
that dim), the next input's read elsewhere. Computed inputs are computed where
their slice is read, so ``stack([f(x), g(x)]) -> pointwise`` is one kernel.
"""

import torch

from autofuser import LoweringSpec, Sample

from ._common import tensor_list


def lower_stack(ctx, tensors, dim=0, **kwargs):
    tensors = tensor_list(ctx, "stack", tensors, dim, kwargs)
    rank = len(ctx.out_shape)
    if any(tuple(ctx.shape(t)) != tuple(ctx.shape(tensors[0])) for t in tensors):
        ctx.refuse("shape_mismatch", "stack: inputs of different shapes")
    dim %= rank
    value = ctx.const(0.0)  # never read: the inputs cover the new dim
    for k in reversed(range(len(tensors))):
        offsets = [-k if d == dim else 0 for d in range(rank)]
        value = ctx.read_shifted(tensors[k], ctx.out_shape, offsets, fill=value, new_dims=(dim,))
    return value


def _samples(dtype):
    return [
        Sample(args=(torch.randn(2, 9, 5, dtype=dtype), torch.randn(2, 9, 5, dtype=dtype)), note="(2, 9, 5)"),
        Sample(args=(torch.randn(1, 7, dtype=dtype), torch.randn(1, 7, dtype=dtype)), note="batch 1"),
    ]


SPECS = [
    LoweringSpec(
        name="conv.stack",
        description="torch.stack: each input read where the new dim's coordinate is its index",
        targets=(torch.stack,),
        kind="pointwise",
        lower=lower_stack,
        samples=_samples,
        references=(
            lambda a, b: torch.stack([a * 2, torch.sin(b)], dim=1) + 1,
            lambda a, b: torch.stack((a, b, a - b), 0).relu(),
            lambda a, b: torch.nn.functional.gelu(torch.stack([b, a], dim=-1)),
        ),
    ),
]
