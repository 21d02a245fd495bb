"""``torch.cat`` after an upsampling: lowered as an extern op that only the
``upsample_fused`` strategy generates, selecting each output element's input
by its coordinate along the cat's dim (``strategy.py``). A ``cat`` that no
upsampling feeds stays eager (a copy either way)."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample


def lower_cat(ctx, tensors, dim=0, **kwargs):
    if kwargs:
        ctx.refuse("unsupported_argument", f"cat: keyword arguments {sorted(kwargs)}")
    if not isinstance(tensors, (tuple, list)) or not all(ctx.is_tensor(t) for t in tensors):
        ctx.refuse("unsupported_argument", "cat: the tensors must be a list of graph values")
    if not isinstance(dim, int) or isinstance(dim, bool):
        ctx.refuse("unsupported_argument", f"cat: dim={dim!r} is not an int")
    rank = len(ctx.out_shape)
    if any(len(ctx.shape(t)) != rank for t in tensors):
        ctx.refuse("shape_mismatch", "cat: inputs of different ranks (legacy empty tensors)")
    if any(ctx.dtype(t) != ctx.out_dtype for t in tensors):
        ctx.refuse("unsupported_dtype", "cat: inputs of mixed dtypes")
    return ctx.extern()


def _samples(dtype):
    return [
        Sample(args=(torch.randn(2, 3, 9, 5, dtype=dtype), torch.randn(2, 4, 18, 10, dtype=dtype)), note="skip after"),
        Sample(args=(torch.randn(1, 2, 7, 4, dtype=dtype), torch.randn(1, 5, 14, 8, dtype=dtype)), note="batch 1"),
    ]


SPECS = [
    LoweringSpec(
        name="conv.cat",
        description="torch.cat of an upsampling and other tensors",
        targets=(torch.cat, torch.concat, torch.concatenate),
        kind="layout",
        lower=lower_cat,
        samples=_samples,
        references=(
            lambda low, skip: torch.cat((skip, F.interpolate(low, scale_factor=2, mode="bilinear")), dim=1),
            lambda low, skip: torch.cat([F.interpolate(low, size=skip.shape[-2:]), skip], 1) * 2.0,
            lambda low, skip: F.gelu(
                torch.cat((skip[:, :2], F.interpolate(low, scale_factor=2.0), skip[:, 2:]), dim=-3)
            ),
        ),
    ),
]
