"""``batch_norm_act(...)``: batch norm in training mode (the batch's statistics,
the running statistics updated) with the activation after it, as one call a graph
can hold, whose forward and backward are this plugin's own kernels.

Eager spends four passes over the activation in forward (cuDNN's batch norm reads
it twice and writes it; the activation reads and writes it again) and six in
backward. Here forward reads x twice (the statistics; the normalisation with the
activation) and writes once; backward reads x and the output's gradient twice
(the per-channel sums; the input's gradient) and writes once, recomputing the
normalised values and the activation's derivative from x
(``batch_norm_kernels.py``). ``batch_norm_pass.py`` puts the call in a captured
graph.

Three operators of the ``autofuser_conv`` library:

- ``bn_act_forward(x, weight, bias, eps, activation, slope)`` -> ``(out, mean,
  var)``: the activation of the normalised x in x's dtype, and each channel's mean
  and biased variance in fp32 (not differentiable);
- ``bn_act_backward(dout, x, weight, bias, mean, var, eps, activation, slope)`` ->
  ``(dx, dweight, dbias)``, the latter two per-channel fp32 sums;
- ``update_running_stats(running_mean, running_var, mean, var, momentum, count)``
  writes ``(1 - momentum) * running + momentum * batch`` into the running
  statistics, the variance unbiased (``var * count / (count - 1)``), as eager's
  batch norm does.

As operators they are single nodes in a traced graph (a fused group's backward,
``make_fx``). Where Triton runs (CUDA, or CPU tensors under the interpreter) they are
the kernels; on CPU otherwise the same maths in torch ops (``reference_*``). The
gradients of the backward (``create_graph=True``) are those of the batch norm and
activation written out in torch ops, recomputed from x.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from autofuser.kernel import INT32_LIMIT, interpreting

from . import batch_norm_kernels as kernels
from .batch_norm_kernels import ACTIVATIONS

LIBRARY = "autofuser_conv"


def _triton_runs(x: Tensor) -> bool:
    # The kernels index one channel's values in int32 (a tensor's offsets in int64 where needed).
    return (x.is_cuda or (x.device.type == "cpu" and interpreting())) and x.numel() // x.shape[1] < INT32_LIMIT


def _no_autocast(x: Tensor):
    return torch.autocast(x.device.type, enabled=False)


def _channel_view(t: Tensor, rank: int) -> Tensor:
    return t.reshape((1, -1) + (1,) * (rank - 2))


def _reduced_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def activate(y: Tensor, activation: str, slope: float) -> Tensor:
    """The activation in torch ops (fp32 in, as the kernels compute it)."""
    if activation == "relu":
        return F.relu(y)
    if activation == "leaky_relu":
        return F.leaky_relu(y, slope)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "silu":
        return F.silu(y)
    return y


def _normalised(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, var: Tensor, eps: float):
    """``(x_hat, y)``: x normalised, and with the affine parameters (fp32)."""
    x_hat = (x.float() - _channel_view(mean, x.dim())) * _channel_view(torch.rsqrt(var + eps), x.dim())
    y = x_hat
    if weight is not None:
        y = y * _channel_view(weight.float(), x.dim())
    if bias is not None:
        y = y + _channel_view(bias.float(), x.dim())
    return x_hat, y


def reference_forward(x, weight, bias, eps: float, activation: str, slope: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, var)`` as the kernels compute them, in fp32 torch ops."""
    var, mean = torch.var_mean(x.float(), _reduced_dims(x), correction=0)
    _, y = _normalised(x, weight, bias, mean, var, eps)
    return activate(y, activation, slope).to(x.dtype), mean, var


def reference_backward(dout, x, weight, bias, mean, var, eps: float, activation: str, slope: float):
    """``(dx, dweight, dbias)`` as the kernels compute them, in fp32 torch ops."""
    x_hat, y = _normalised(x, weight, bias, mean, var, eps)
    g = dout.float()
    if activation != "none":
        with torch.enable_grad():
            leaf = y.detach().requires_grad_()
            (g,) = torch.autograd.grad(activate(leaf, activation, slope), leaf, g)
    dims = _reduced_dims(x)
    sum_g, sum_gx = g.sum(dims), (g * x_hat).sum(dims)
    count = x.numel() // x.shape[1]
    scale = torch.rsqrt(var + eps) * (weight.float() if weight is not None else 1.0)
    dx = _channel_view(scale, x.dim()) * (
        g - _channel_view(sum_g / count, x.dim()) - x_hat * _channel_view(sum_gx / count, x.dim())
    )
    return dx.to(x.dtype), sum_gx, sum_g


def _written_out(x: Tensor, weight, bias, eps: float, activation: str, slope: float) -> Tensor:
    """The batch norm and activation in differentiable torch ops (fp32): second derivatives."""
    var, mean = torch.var_mean(x.float(), _reduced_dims(x), correction=0)
    _, y = _normalised(x, weight, bias, mean, var, eps)
    return activate(y, activation, slope)


# ---------------------------------------------------------------------------
# The operators
# ---------------------------------------------------------------------------


@torch.library.custom_op(f"{LIBRARY}::bn_act_forward", mutates_args=())
def bn_act_forward(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, activation: str, slope: float
) -> tuple[Tensor, Tensor, Tensor]:
    if _triton_runs(x):
        return kernels.forward(x, weight, bias, eps, activation, slope)
    with _no_autocast(x):  # an operator's body runs under the caller's autocast
        out, mean, var = reference_forward(x, weight, bias, eps, activation, slope)
    return out.contiguous(), mean, var


@bn_act_forward.register_fake
def _forward_meta(x, weight, bias, eps, activation, slope):
    channels = x.shape[1]
    stat = x.new_empty(channels, dtype=torch.float32)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), stat, stat.new_empty(channels)


@torch.library.custom_op(f"{LIBRARY}::bn_act_backward", mutates_args=())
def bn_act_backward(
    dout: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Tensor,
    var: Tensor,
    eps: float,
    activation: str,
    slope: float,
) -> tuple[Tensor, Tensor, Tensor]:
    if _triton_runs(x):
        return kernels.backward(dout, x, weight, bias, mean, var, eps, activation, slope)
    with _no_autocast(x):
        dx, dweight, dbias = reference_backward(dout, x, weight, bias, mean, var, eps, activation, slope)
    return dx.contiguous(), dweight, dbias


@bn_act_backward.register_fake
def _backward_meta(dout, x, weight, bias, mean, var, eps, activation, slope):
    channels = x.shape[1]
    sums = x.new_empty(channels, dtype=torch.float32)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), sums, sums.new_empty(channels)


def _forward_context(ctx, inputs, output) -> None:
    x, weight, bias, eps, activation, slope = inputs
    _out, mean, var = output
    ctx.save_for_backward(x, weight, bias, mean, var)
    ctx.eps, ctx.activation, ctx.slope = eps, activation, slope
    ctx.mark_non_differentiable(mean, var)


def _forward_gradient(ctx, dout, _dmean, _dvar):
    x, weight, bias, mean, var = ctx.saved_tensors
    dx, dweight, dbias = bn_act_backward(dout, x, weight, bias, mean, var, ctx.eps, ctx.activation, ctx.slope)
    dweight = dweight.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
    dbias = dbias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
    return dx, dweight, dbias, None, None, None


def _backward_context(ctx, inputs, output) -> None:
    dout, x, weight, bias, _mean, _var, eps, activation, slope = inputs
    ctx.save_for_backward(dout, x, weight, bias)
    ctx.eps, ctx.activation, ctx.slope = eps, activation, slope


def _backward_gradient(ctx, ddx, ddweight, ddbias):
    # (dx, dweight, dbias) depend on dout, x, weight and bias alone (mean and var are x's
    # functions): differentiate the written-out first derivative there.
    dout, x, weight, bias = ctx.saved_tensors
    tensors = (dout, x, weight, bias)
    leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
    ldout, lx, lweight, lbias = leaves
    with torch.enable_grad(), _no_autocast(x):
        out = _written_out(lx, lweight, lbias, ctx.eps, ctx.activation, ctx.slope)
        wrt = [t for t in (lx, lweight, lbias) if t is not None]
        first = torch.autograd.grad(out, wrt, ldout.float(), create_graph=True, allow_unused=True)
        pairs = [(f, g) for f, g in zip(first, (ddx, ddweight, ddbias)) if f is not None and g is not None]
        found = (
            torch.autograd.grad(
                [f for f, _ in pairs],
                [t for t in leaves if t is not None],
                [g.float() for _, g in pairs],
                allow_unused=True,
                create_graph=True,
            )
            if pairs
            else [None] * len(wrt)
        )
    present = iter(found)
    grads = [None if t is None else next(present, None) for t in leaves]
    grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors)]
    return grads[0], grads[1], grads[2], grads[3], None, None, None, None, None


bn_act_forward.register_autograd(_forward_gradient, setup_context=_forward_context)
bn_act_backward.register_autograd(_backward_gradient, setup_context=_backward_context)


@torch.library.custom_op(f"{LIBRARY}::update_running_stats", mutates_args=("running_mean", "running_var"))
def update_running_stats(
    running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, momentum: float, count: int
) -> None:
    with torch.no_grad():
        running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        running_var.lerp_((var * (count / (count - 1))).to(running_var.dtype), momentum)


@update_running_stats.register_fake
def _update_meta(running_mean, running_var, mean, var, momentum, count):
    return None


# ---------------------------------------------------------------------------
# The call a graph holds
# ---------------------------------------------------------------------------


def batch_norm_act(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    num_batches_tracked: Optional[Tensor],
    momentum: float,
    eps: float,
    activation: str = "none",
    slope: float = 0.01,
) -> Tensor:
    """``act(F.batch_norm(x, running_mean, running_var, weight, bias, training=True,
    momentum=momentum, eps=eps))``, ``num_batches_tracked`` counted up by one when given
    (as ``nn.BatchNorm*d`` in training mode does with a float momentum); ``act`` one of
    ``ACTIVATIONS`` (``slope``: leaky ReLU's). A channels-first ``[N, C, *]`` x of fp32,
    fp16 or bf16 with more than one value per channel; the result is row-major."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"batch_norm_act: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if x.dim() < 2 or x.numel() // max(1, x.shape[1]) < 2:
        raise ValueError(
            f"batch_norm_act: expected more than 1 value per channel when training, got input size {list(x.shape)}"
        )
    if (running_mean is None) != (running_var is None):
        raise ValueError("batch_norm_act: give both running statistics or neither")
    out, mean, var = bn_act_forward(x, weight, bias, float(eps), activation, float(slope))
    if running_mean is not None:
        assert running_var is not None
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        update_running_stats(running_mean, running_var, mean, var, float(momentum), x.numel() // x.shape[1])
    return out
