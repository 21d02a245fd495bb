"""``torch.cat`` / ``torch.concat`` / ``torch.concatenate``: each input read from its
slice of the output.

Lowered as a chain of shifted reads (``ctx.read_shifted``) along the cat's dim:
input ``k``, starting at ``start_k``, is read at ``i - start_k`` and, outside its
own range, reads the next input's read instead (its ``fill``). Inside a group the
inputs are computed where their slice is read, so a cat of two computed tensors
followed by pointwise ops is one kernel and the cat is never written. After an
upsampling the ``upsample_fused`` strategy takes the cat by this lowering's name
and selects each output element's input itself (``strategy.py``).
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import tensor_list


def lower_cat(ctx, tensors, dim=0, **kwargs):
    tensors = tensor_list(ctx, "cat", tensors, dim, kwargs)
    rank = len(ctx.out_shape)
    if any(len(ctx.shape(t)) != rank for t in tensors):
        ctx.refuse("shape_mismatch", "cat: inputs of different ranks (legacy empty tensors)")
    dim %= rank
    starts, start = [], 0
    for t in tensors:
        starts.append(start)
        start += ctx.shape(t)[dim]
    value = ctx.const(0.0)  # never read: the inputs cover the output
    for t, begin in reversed(list(zip(tensors, starts))):
        if ctx.shape(t)[dim] == 0:
            continue
        offsets = [-begin if d == dim else 0 for d in range(rank)]
        value = ctx.read_shifted(t, ctx.out_shape, offsets, fill=value)
    return value


def _samples(dtype):
    return [
        Sample(args=(torch.randn(2, 3, 9, 5, dtype=dtype), torch.randn(2, 4, 18, 10, dtype=dtype)), note="skip after"),
        Sample(args=(torch.randn(1, 2, 7, 4, dtype=dtype), torch.randn(1, 5, 14, 8, dtype=dtype)), note="batch 1"),
    ]


SPECS = [
    LoweringSpec(
        name="conv.cat",
        description="torch.cat: each input read from its slice of the output (a chain of shifted reads)",
        targets=(torch.cat, torch.concat, torch.concatenate),
        kind="pointwise",
        lower=lower_cat,
        samples=_samples,
        references=(
            lambda low, skip: torch.cat((skip, F.interpolate(low, scale_factor=2, mode="bilinear")), dim=1),
            lambda low, skip: torch.cat([F.interpolate(low, size=skip.shape[-2:]), skip], 1) * 2.0,
            lambda low, skip: F.gelu(
                torch.cat((skip[:, :2], F.interpolate(low, scale_factor=2.0), skip[:, 2:]), dim=-3)
            ),
            # no upsampling: computed inputs along the last dim, one of them empty
            lambda low, skip: F.gelu(torch.cat([skip * 2, skip[..., :0], torch.tanh(skip[..., :3])], dim=-1)),
            lambda low, skip: torch.concat((low.sigmoid(), low - 1), dim=0) + 1,
        ),
    ),
]
