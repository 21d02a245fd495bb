"""Instance norm (``nn.InstanceNorm1d``/``2d``/``3d``, ``F.instance_norm``): each
channel of each sample normalised over its spatial dims - a row reduction over
dims ``2..`` with the mean and biased variance computed as layer norm computes
them, then the per-channel affine parameters. It joins the row-reduction
strategy with the pointwise ops around it (the activation after it, a residual).

With running statistics and ``use_input_stats=False`` (a module in eval mode
that tracks them) it is the batch-norm scale and shift instead. Updating
running statistics (``use_input_stats=True`` with running buffers) writes
into them: it stays eager.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import float_tensor, module_forward_is, per_channel
from .batch_norm import normalize_by_statistics

MODULES = (torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d)


def normalize_over_space(ctx, op, x, weight, bias, eps):
    """Each ``[b, c]`` of a channels-first ``x`` normalised over its spatial dims."""
    shape = float_tensor(ctx, op, x)
    if len(shape) < 3:
        ctx.refuse("shape_mismatch", f"{op}: a {len(shape)}-d input has no spatial dims to normalise over")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        ctx.refuse("unsupported_argument", f"{op}: eps={eps!r} is not a number")
    spatial = len(shape) - 2
    dims = tuple(range(2, len(shape)))
    n = 1
    for d in dims:
        n *= shape[d]
    weight = per_channel(ctx, weight, shape[1], spatial, op, "weight") if weight is not None else None
    bias = per_channel(ctx, bias, shape[1], spatial, op, "bias") if bias is not None else None
    return ctx.normalize(ctx.tensor(x), dims, n, float(eps), weight, bias)


def lower_instance_norm_function(
    ctx,
    input,
    running_mean=None,
    running_var=None,
    weight=None,
    bias=None,
    use_input_stats=True,
    momentum=0.1,
    eps=1e-5,
):
    op = "instance_norm"
    if use_input_stats is not True and use_input_stats is not False:
        ctx.refuse("unsupported_argument", f"{op}: use_input_stats={use_input_stats!r}")
    if not use_input_stats:
        if running_mean is None or running_var is None:
            ctx.refuse("unsupported_argument", f"{op}: use_input_stats=False without running statistics")
        return normalize_by_statistics(ctx, op, input, running_mean, running_var, weight, bias, eps)
    if running_mean is not None or running_var is not None:
        ctx.refuse("mutation", f"{op}: use_input_stats=True with running statistics updates them in place")
    return normalize_over_space(ctx, op, input, weight, bias, eps)


def lower_instance_norm_module(ctx, input):
    module = ctx.module
    module_forward_is(ctx, next(k for k in type(module).__mro__ if k in MODULES))
    name = type(module).__name__
    rank = len(ctx.shape(input))
    if rank != module._get_no_batch_dim() + 1:
        ctx.refuse("unsupported_shape", f"{name}: a {rank}-d input (unbatched inputs stay eager)")
    if ctx.shape(input)[1] != module.num_features:
        ctx.refuse("shape_mismatch", f"{name}: {ctx.shape(input)[1]} channels, the module has {module.num_features}")
    weight = ctx.attr("weight") if module.weight is not None else None
    bias = ctx.attr("bias") if module.bias is not None else None
    if module.training or not module.track_running_stats:
        if module.running_mean is not None:
            ctx.refuse("mutation", f"{name} in training mode updates its running statistics")
        return normalize_over_space(ctx, name, input, weight, bias, module.eps)
    return normalize_by_statistics(
        ctx, name, input, ctx.attr("running_mean"), ctx.attr("running_var"), weight, bias, module.eps
    )


def _function_samples(dtype):
    return [
        Sample(
            args=(
                torch.randn(2, 5, 13, 7, dtype=dtype) * 2 + 1,
                torch.randn(5, dtype=dtype),
                torch.randn(5, dtype=dtype),
            ),
            note="2-d",
        ),
        Sample(
            args=(torch.randn(1, 3, 37, dtype=dtype), torch.randn(3, dtype=dtype), torch.randn(3, dtype=dtype)),
            note="1-d, batch 1",
        ),
        Sample(
            args=(torch.randn(2, 2, 5, 3, 4, dtype=dtype), torch.randn(2, dtype=dtype), torch.randn(2, dtype=dtype)),
            note="3-d",
        ),
    ]


def _affine(module):
    with torch.no_grad():
        for p in (module.weight, module.bias):
            if p is not None:
                p.normal_()
        if module.running_mean is not None:
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    return module.eval()


def _module_samples(dtype):
    return [
        Sample(args=(torch.randn(2, 6, 13, 7, dtype=dtype) * 3 - 1,)),
        Sample(args=(torch.randn(1, 6, 37, 3, dtype=dtype).transpose(2, 3),), note="transposed"),
    ]


SPECS = [
    LoweringSpec(
        name="conv.instance_norm",
        description="F.instance_norm over the spatial dims (or with running statistics)",
        targets=(F.instance_norm,),
        kind="reduction",
        lower=lower_instance_norm_function,
        samples=_function_samples,
        references=(lambda x, w, b: F.instance_norm(x, weight=w, bias=b, eps=1e-3), lambda x, w, b: F.instance_norm(x)),
    ),
    LoweringSpec(
        name="conv.instance_norm_module",
        description="nn.InstanceNorm1d/2d/3d",
        targets=MODULES,
        kind="reduction",
        lower=lower_instance_norm_module,
        samples=_module_samples,
        references=(_affine(torch.nn.InstanceNorm2d(6, affine=True)), torch.nn.InstanceNorm2d(6)),
    ),
]
