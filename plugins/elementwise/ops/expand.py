"""``x.expand(*sizes)``, ``x.expand_as(y)``, ``torch.broadcast_to(x, shape)``: a view
that repeats size-1 dims, read in a kernel through a zero stride.

Lowered so that a chain reaching through an expand (``(x * s).expand(B, -1, -1) + y``)
is one kernel, not two around an eager view: the value has the expanded shape and
reads its operand broadcast, so a reduction over a repeated dim sums every copy.
Eager's expand costs nothing and its result aliases its input, so a group whose
expand's result leaves the kernel (written as a copy, every repeat stored) is
vetoed (``expand_result_leaves``, through this plugin's ``autofuser_veto_fusion``).
"""

import torch

from autofuser import LoweringSpec, Sample, Value

from ._common import FLOAT_DTYPES, lowering, randn


@lowering
def lower_expand(ctx, input, *sizes):
    if ctx.out_shape is None or ctx.out_dtype not in (*FLOAT_DTYPES, torch.bool):
        ctx.refuse("unsupported_dtype", f"expand of dtype {ctx.out_dtype} (kernels read fp32/fp16/bf16, bool)")
    value = ctx.tensor(input)
    return Value("pointwise", ctx.out_shape, is_bool=value.is_bool, args=(value,), template="{0}")


EXPAND_TARGETS = ("expand", "expand_as", torch.broadcast_to)


def expand_result_leaves(nodes) -> str | None:
    """Why a group of ``nodes`` (fx nodes) must not be kept: an expand whose result is read
    outside it; ``None`` if there is none. Eager's expand is a free view of its input; a
    kernel would store every repeat, and a later in-place change of the input would no
    longer reach the copy."""
    members = set(nodes)
    for node in nodes:
        is_expand = (node.op == "call_method" and node.target in EXPAND_TARGETS) or (
            node.op == "call_function" and node.target is torch.broadcast_to
        )
        if is_expand and any(user not in members for user in node.users):
            return (
                f"{node.name} (an expand) is read outside the group: eager's view costs nothing and "
                "aliases its input, a kernel would write every repeat"
            )
    return None


def _samples(dtype):
    # (x, y): x expanded to y's shape, y read too, so the expand sits inside a chain.
    return [
        Sample(args=(randn((1, 37), dtype), randn((5, 37), dtype)), note="(1, 37) -> (5, 37)"),
        Sample(args=(randn((3, 1, 7), dtype), randn((2, 3, 6, 7), dtype)), note="(3, 1, 7) -> (2, 3, 6, 7)"),
        Sample(args=(randn((1, 1), dtype), randn((1, 129), dtype)), note="batch 1"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.expand",
        description="a view repeating size-1 dims (read through a zero stride)",
        targets=EXPAND_TARGETS,
        kind="pointwise",  # a broadcast of its operand: strategies take it wherever they take pointwise ops
        lower=lower_expand,
        samples=_samples,
        references=(
            lambda x, y: x.expand_as(y) * y,
            lambda x, y: torch.broadcast_to(x * 2, y.shape) - y,
            # a sum over a repeated dim adds every copy
            lambda x, y: (x + 1).expand_as(y).sum(0) + y[0],
        ),
    ),
]
