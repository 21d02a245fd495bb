"""Batch norm in eval mode (``nn.BatchNorm1d``/``2d``/``3d``, ``F.batch_norm``
with ``training=False``): a per-channel scale and shift from the running
statistics, ``(x - running_mean) * rsqrt(running_var + eps) * weight + bias``.

As a pointwise op it joins whatever group surrounds it: after a convolution
or linear layer it lands in the product's epilogue (the batch norm folded into
the product, reading the live statistics and affine parameters at call time,
so a later ``load_state_dict`` or parameter update is honoured), after a
convolution that stays with cuDNN it fuses with the activation that follows.
In training mode, or without running statistics, batch norm normalises by
the batch's own statistics (and updates its buffers): it stays eager.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample, Tolerance

from ._common import float_tensor, module_forward_is, per_channel

MODULES = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
# rsqrt and a different order of the scale and shift than eager's kernel. In fp16,
# eager's CPU kernel folds the statistics into a scale and a shift in half precision
# (GPUs compute in fp32, as the kernel does): an output near zero, the difference of
# two large terms, then differs by a step of those terms (about 4e-3 at 4).
TOLERANCES = {"float32": Tolerance(atol=2e-5, rtol=1e-4), "float16": Tolerance(atol=1e-2, rtol=1e-2)}


def normalize_by_statistics(ctx, op, x, mean, var, weight, bias, eps):
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` with every parameter per channel (dim 1)."""
    shape = float_tensor(ctx, op, x)
    if len(shape) < 2:
        ctx.refuse("shape_mismatch", f"{op}: a {len(shape)}-d input has no channel dim")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        ctx.refuse("unsupported_argument", f"{op}: eps={eps!r} is not a number")
    channels, spatial = shape[1], len(shape) - 2

    def channel(arg, name):
        return per_channel(ctx, arg, channels, spatial, op, name)

    out = ctx.pointwise(
        "({0} - {1}) * tl.rsqrt({2} + %r)" % float(eps), x, channel(mean, "running_mean"), channel(var, "running_var")
    )
    if weight is not None:
        out = ctx.pointwise("{0} * {1}", out, channel(weight, "weight"))
    if bias is not None:
        out = ctx.pointwise("{0} + {1}", out, channel(bias, "bias"))
    return out


def lower_batch_norm_function(
    ctx, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5
):
    if training is not False:
        ctx.refuse("batch_statistics", "batch_norm: training=True normalises by the batch's statistics")
    if running_mean is None or running_var is None:
        ctx.refuse("batch_statistics", "batch_norm: no running statistics")
    return normalize_by_statistics(ctx, "batch_norm", input, running_mean, running_var, weight, bias, eps)


def lower_batch_norm_module(ctx, input):
    module = ctx.module
    module_forward_is(ctx, next(k for k in type(module).__mro__ if k in MODULES))
    name = type(module).__name__
    if module.training:
        ctx.refuse("batch_statistics", f"{name} in training mode normalises by the batch's statistics")
    if module.running_mean is None or module.running_var is None:
        ctx.refuse("batch_statistics", f"{name} without running statistics normalises by the batch's statistics")
    expected = {torch.nn.BatchNorm1d: (2, 3), torch.nn.BatchNorm2d: (4,), torch.nn.BatchNorm3d: (5,)}
    rank = len(ctx.shape(input))
    if not any(isinstance(module, k) and rank in dims for k, dims in expected.items()):
        ctx.refuse("shape_mismatch", f"{name}: a {rank}-d input (eager raises)")
    weight = ctx.attr("weight") if module.weight is not None else None
    bias = ctx.attr("bias") if module.bias is not None else None
    return normalize_by_statistics(
        ctx, name, input, ctx.attr("running_mean"), ctx.attr("running_var"), weight, bias, module.eps
    )


def _function_samples(dtype):
    def stats(c):
        return (
            torch.randn(c, dtype=dtype),
            torch.rand(c, dtype=dtype) + 0.5,
            torch.randn(c, dtype=dtype),
            torch.randn(c, dtype=dtype),
        )

    return [
        Sample(args=(torch.randn(2, 6, 13, 7, dtype=dtype), *stats(6)), note="2-d"),
        Sample(args=(torch.randn(5, 11, dtype=dtype), *stats(11)), note="[B, C]"),
        Sample(args=(torch.randn(1, 3, 5, 4, 3, dtype=dtype), *stats(3)), note="3-d, batch 1"),
    ]


def _trained(module, seed: int = 0):
    """Non-trivial running statistics and affine parameters, so a lowering that drops one shows.
    Drawn from their own seeded generator: not from the global one, whose state depends on
    what ran before this module was imported."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.running_mean.normal_(generator=generator)
        module.running_var.uniform_(0.5, 2.0, generator=generator)
        if module.affine:
            module.weight.normal_(generator=generator)
            module.bias.normal_(generator=generator)
    return module.eval()


def _module_samples(dtype):
    return [
        Sample(args=(torch.randn(2, 6, 13, 7, dtype=dtype),)),
        Sample(args=(torch.randn(1, 6, 37, 3, dtype=dtype).transpose(2, 3),), note="transposed"),
    ]


SPECS = [
    LoweringSpec(
        name="conv.batch_norm",
        description="F.batch_norm(training=False) with running statistics",
        targets=(F.batch_norm,),
        kind="pointwise",
        lower=lower_batch_norm_function,
        samples=_function_samples,
        references=(
            lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, False, 0.1, 1e-3),
            lambda x, m, v, w, b: F.batch_norm(x, m, v),
        ),
        tolerances=TOLERANCES,
    ),
    LoweringSpec(
        name="conv.batch_norm_module",
        description="nn.BatchNorm1d/2d/3d in eval mode",
        targets=MODULES,
        kind="pointwise",
        lower=lower_batch_norm_module,
        samples=_module_samples,
        references=(
            _trained(torch.nn.BatchNorm2d(6)),
            _trained(torch.nn.BatchNorm2d(6, affine=False, eps=1e-2), seed=1),
        ),
        tolerances=TOLERANCES,
    ),
]
