"""``x.reshape(*shape)`` / ``torch.reshape(x, shape)`` where eager copies: no strides
express the new shape (einops' ``rearrange(x, "b h n d -> b n (h d)")`` merges dims a
permute left apart in memory).

Lowered as a reshaped read (``ctx.read_reshaped``): the result's coordinates map to the
input's row-major position by division and remainder, so the copy is read where its
readers use it, or written once as its group's output, in the node's (row-major)
strides, which are eager's. A reshape that is a view of its input moves no data: it
is refused here and its readers read it through its strides, as before.
"""

import torch
import torch.fx

from autofuser import LoweringSpec, Sample

from ._common import FLOAT_DTYPES, lowering, randn


def _is_view(meta, shape) -> bool:
    """Whether eager's reshape of a tensor laid out as ``meta`` to ``shape`` is a view
    (torch's own rule, asked of a meta tensor with the same strides)."""
    probe = torch.empty_strided(tuple(meta.shape), tuple(meta.stride), dtype=meta.dtype, device="meta")
    try:
        probe.view(shape)
    except RuntimeError:
        return False
    return True


@lowering
def lower_reshape(ctx, input, *shape):
    if ctx.out_shape is None or ctx.out_dtype not in (*FLOAT_DTYPES, torch.bool):
        ctx.refuse("unsupported_dtype", f"reshape of dtype {ctx.out_dtype} (kernels store fp32/fp16/bf16, bool)")
    meta = input.meta.get("tensor_meta") if isinstance(input, torch.fx.Node) else None
    if meta is None or not hasattr(meta, "stride"):
        ctx.refuse("not_a_tensor", "reshape of something that is not a tensor")
    if _is_view(meta, ctx.out_shape):
        ctx.refuse("no_lowering", "a reshape that is a view moves no data: its readers read it through its strides")
    return ctx.read_reshaped(input, ctx.out_shape)


def _samples(dtype):
    # (x, y): x [B, H, N, D] whose heads are merged after a permute, y [B, N, H * D] beside it.
    return [
        Sample(args=(randn((2, 3, 7, 5), dtype), randn((2, 7, 15), dtype)), note="heads 3, width 5"),
        Sample(args=(randn((1, 4, 13, 3), dtype), randn((1, 13, 12), dtype)), note="batch 1"),
    ]


def _merge_heads(x):
    b, h, n, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, n, h * d)


SPECS = [
    LoweringSpec(
        name="elementwise.reshape",
        description="a reshape eager copies (no strides express it), read by division and remainder",
        targets=("reshape", torch.reshape),
        kind="pointwise",
        lower=lower_reshape,
        samples=_samples,
        references=(
            lambda x, y: _merge_heads(x) + y,
            # a computed value merged, then split back in another order
            lambda x, y: torch.reshape(torch.sigmoid(_merge_heads(x * 2) - y).transpose(1, 2), (y.shape[0], -1)),
        ),
    ),
]
