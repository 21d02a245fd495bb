"""``x.contiguous()`` and ``x.clone(memory_format=...)``: the values unchanged, written
in the row-major layout (``clone``: in the layout its memory format gives).

Real solver code copies its layouts this way between a permute and a reshape
(Transolver's structured-mesh model: ``permute -> contiguous -> reshape``). Lowered as
the identity on values, so the copy joins the group around it: inside a group it is
free (its readers read the operand through the operand's own strides), and as a
group's output it is that group's store, written in the node's own strides, which are
eager's (``contiguous()`` always gives row-major strides).

``contiguous()`` of a tensor that is contiguous already returns that tensor itself; it
is lowered as the operand read (a no-op), which a kernel may not write as an output
(the core refuses that alias). ``clone`` always makes a new tensor, so it is a real op
even then.
"""

import torch
import torch.fx

from autofuser import LoweringSpec, Sample

from ._common import FLOAT_DTYPES, lowering, randn


def _identity(ctx, input, copies: bool):
    if ctx.out_shape is None or ctx.out_dtype not in (*FLOAT_DTYPES, torch.bool):
        ctx.refuse(
            "unsupported_dtype", f"{ctx.node.target} of dtype {ctx.out_dtype} (kernels store fp32/fp16/bf16, bool)"
        )
    if not copies:
        return ctx.tensor(input)
    # A pointwise identity, not the load itself: a new tensor in eager, so the group may
    # write it.
    return ctx.pointwise("{0}", input, is_bool=ctx.out_dtype == torch.bool)


def _strides(node) -> tuple:
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return tuple(meta.stride) if meta is not None and hasattr(meta, "stride") else ()


@lowering
def lower_contiguous(ctx, input, memory_format=torch.contiguous_format):
    if memory_format is not torch.contiguous_format:
        ctx.refuse("unsupported_argument", f"contiguous(memory_format={memory_format}): only the row-major layout")
    # Eager returns the input itself exactly when it is contiguous already, and then the
    # result has the input's strides; otherwise a new tensor.
    return _identity(ctx, input, copies=_strides(input) != _strides(ctx.node))


@lowering
def lower_clone(ctx, input, *, memory_format=torch.preserve_format):
    # Whatever the format (preserve_format keeps a dense input's strides and makes others
    # row-major; channels_last puts channels last), eager's result is a new tensor in the
    # strides its node recorded, and a group writes every output in its node's strides.
    return _identity(ctx, input, copies=True)


def _samples(dtype):
    # (x, y): x permuted to y's shape (so the copy moves data), y read beside it.
    return [
        Sample(args=(randn((7, 5, 3), dtype), randn((3, 7, 5), dtype)), note="(7, 5, 3) permuted (2, 0, 1)"),
        Sample(args=(randn((1, 37, 2), dtype), randn((2, 1, 37), dtype)), note="batch 1"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.contiguous",
        description="x.contiguous(): the values, written row-major (the input itself when it is already)",
        targets=("contiguous",),
        kind="pointwise",
        lower=lower_contiguous,
        samples=_samples,
        references=(
            lambda x, y: x.permute(2, 0, 1).contiguous() * y,
            # a copy of a computed value, viewed afterwards as eager's strides allow
            lambda x, y: (
                (torch.tanh(x) + 1).permute(2, 0, 1).contiguous().view(y.shape[0], -1) - y.reshape(y.shape[0], -1)
            ),
        ),
    ),
    LoweringSpec(
        name="elementwise.clone",
        description="x.clone(): a copy, in the strides its memory format gives",
        targets=("clone", torch.clone),
        kind="pointwise",
        lower=lower_clone,
        samples=_samples,
        references=(
            lambda x, y: x.permute(2, 0, 1).clone(memory_format=torch.contiguous_format) + y,
            # preserve_format: the permuted strides kept, as eager keeps them
            lambda x, y: torch.clone(torch.sigmoid(x.permute(2, 0, 1))) * y,
        ),
    ),
]
