"""``torch.select(x, dim, index)`` / ``x.select(dim, index)``, and ``torch.unbind`` /
``x.unbind(dim)`` (whose parts a graph pass turns into selects, ``unbind.py``): one
slice of ``x`` along ``dim``, that dim gone.

Lowered as a shifted read whose operand has a dim the result lacks, read at one
index (``ctx.read_shifted(..., fixed_dims={dim: index})``), so the components a
solver unbinds (``u, v = x.unbind(-1)``) are read in place by the kernel that
uses them, computed there if ``x`` is. Eager's select is a free view of its
input, so a group whose select's result leaves the kernel (written as a copy,
which a later in-place change of the input would no longer reach) is vetoed
(``select_result_leaves``, through this plugin's ``autofuser_veto_fusion``).
"""

import torch

from autofuser import LoweringSpec, Sample

from ._common import lowering, randn, require_float_output


@lowering
def lower_select(ctx, input, dim, index):
    require_float_output(ctx)
    shape = ctx.shape(input)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, index)) or not shape:
        ctx.refuse("unsupported_argument", f"select: dim={dim!r}, index={index!r} on a {len(shape)}-d tensor")
    dim %= len(shape)
    index = index + shape[dim] if index < 0 else index
    rank = len(ctx.out_shape)
    return ctx.read_shifted(input, ctx.out_shape, (0,) * rank, fixed_dims={dim: index})


SELECT_TARGETS = (torch.select, "select")


def select_result_leaves(nodes) -> str | None:
    """Why a group of ``nodes`` (fx nodes) must not be kept: a select whose result is read
    outside it; ``None`` if there is none."""
    members = set(nodes)
    for node in nodes:
        is_select = (node.op == "call_method" and node.target == "select") or (
            node.op == "call_function" and node.target is torch.select
        )
        if is_select and any(user not in members for user in node.users):
            return (
                f"{node.name} (a select or unbind) is read outside the group: eager's view costs nothing "
                "and aliases its input, a kernel would write a copy"
            )
    return None


def _samples(dtype):
    return [
        Sample(args=(randn((3, 4, 37), dtype),), note="(3, 4, 37)"),
        Sample(args=(randn((1, 9, 2), dtype),), note="batch 1, two components"),
        Sample(args=(randn((5, 3, 7, 3), dtype),), note="rank 4"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.select",
        description="one slice along a dim, the dim gone (select, and unbind's parts)",
        targets=SELECT_TARGETS,
        kind="pointwise",
        lower=lower_select,
        samples=_samples,
        references=(
            lambda x: torch.select(x * 2, 1, 1) + 1,
            lambda x: x.select(-2, -1).sigmoid() * x.select(-2, 0),
            # the components of a vector field, unbound (a graph pass reads them as selects)
            lambda x: torch.unbind(torch.tanh(x), -1)[1] ** 2 + x.select(-1, 0),
            lambda x: (x.unbind(0)[0] - x.unbind(0)[-1]) * x.select(0, -1),
        ),
    ),
]
