"""``batch_norm_act(...)``: batch norm in training mode (the batch's statistics,
the running statistics updated) with the activation after it, as one call a graph
can hold, whose forward and backward are this plugin's own kernels.

Eager moves the activation's size five times in forward (cuDNN's batch norm reads
it twice and writes it; the activation reads and writes it again) and eight times
in backward (the activation's derivative reads two tensors and writes one; cuDNN's
backward reads two tensors twice and writes one). Here forward reads x twice (the statistics; the normalisation with the
activation) and writes once; backward reads x and the output's gradient twice
(the per-channel sums; the input's gradient) and writes once, recomputing the
normalised values and the activation's derivative from x
(``batch_norm_kernels.py``). ``batch_norm_pass.py`` puts the call in a captured
graph.

Two autograd functions: ``BatchNormAct`` (forward: the kernels, which also update
the running statistics as eager does - ``(1 - momentum) * running + momentum *
batch``, the variance unbiased - and count ``num_batches_tracked`` up) and
``BatchNormActBackward`` (x's gradient and the per-channel sums that are the
weight's and the bias's). The call is never inside a fused group (its lowering,
``ops/batch_norm_act.py``, refuses), so nothing traces into it. Where Triton runs
(CUDA, or CPU tensors under the interpreter) they are the kernels; on CPU otherwise
the same maths in torch ops (``reference_*``). The gradients of the backward
(``create_graph=True``) are those of the batch norm and activation written out in
torch ops, recomputed from x.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from autofuser.kernel import INT32_LIMIT, interpreting

from . import batch_norm_kernels as kernels
from .batch_norm_kernels import ACTIVATIONS


def _triton_runs(x: Tensor) -> bool:
    # The kernels index one channel's values in int32 (a tensor's offsets in int64 where needed).
    return (x.is_cuda or (x.device.type == "cpu" and interpreting())) and (
        x.numel() // x.shape[1] + kernels.BLOCK < INT32_LIMIT
    )


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


def activation_derivative(y: Tensor, activation: str, slope: float) -> Tensor:
    """d act / d y at y in torch ops, as eager's backward takes it (relu's is 0 at 0,
    leaky relu's the slope there)."""
    if activation == "relu":
        return (y > 0).float()
    if activation == "leaky_relu":
        return torch.where(y > 0, 1.0, slope)
    if activation == "gelu":
        return 0.5 * (1 + torch.erf(y * 0.7071067811865476)) + y * torch.exp(-0.5 * y * y) * 0.3989422804014327
    if activation == "silu":
        s = torch.sigmoid(y)
        return s * (1 + y * (1 - s))
    return torch.ones_like(y)


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
    out, mean, var = _written_out(x, weight, bias, eps, activation, slope)
    return out.to(x.dtype), mean, var


def reference_backward(dout, x, weight, bias, mean, var, eps: float, activation: str, slope: float):
    """``(dx, dweight, dbias)`` as the kernels compute them, in fp32 torch ops."""
    x_hat, y = _normalised(x, weight, bias, mean, var, eps)
    g = dout.float() * activation_derivative(y, activation, slope)
    dims = _reduced_dims(x)
    sum_g, sum_gx = g.sum(dims), (g * x_hat).sum(dims)
    count = x.numel() // x.shape[1]
    scale = torch.rsqrt(var + eps) * (weight.float() if weight is not None else 1.0)
    dx = _channel_view(scale, x.dim()) * (
        g - _channel_view(sum_g / count, x.dim()) - x_hat * _channel_view(sum_gx / count, x.dim())
    )
    return dx.to(x.dtype), sum_gx, sum_g


def _written_out(x: Tensor, weight, bias, eps: float, activation: str, slope: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, var)``: the batch norm and activation in differentiable fp32 torch ops
    (the reference path, and the second derivatives)."""
    var, mean = torch.var_mean(x.float(), _reduced_dims(x), correction=0)
    _, y = _normalised(x, weight, bias, mean, var, eps)
    return activate(y, activation, slope), mean, var


# ---------------------------------------------------------------------------
# The autograd functions
# ---------------------------------------------------------------------------


def _forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation, slope):
    if _triton_runs(x):
        return kernels.forward(
            x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation, slope
        )
    with _no_autocast(x), torch.no_grad():  # the caller's autocast would recast the fp32 maths
        out, mean, var = reference_forward(x, weight, bias, eps, activation, slope)
        if running_mean is not None:
            count = x.numel() // x.shape[1]
            running_mean.copy_((1 - momentum) * running_mean + momentum * mean)
            running_var.copy_((1 - momentum) * running_var + momentum * (var * (count / (count - 1))))
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
    return kernels.empty_result(x, out.dtype).copy_(out), mean, var


def _backward(dout, x, weight, bias, mean, var, eps, activation, slope):
    if _triton_runs(x):
        return kernels.backward(dout, x, weight, bias, mean, var, eps, activation, slope)
    with _no_autocast(x):
        dx, dweight, dbias = reference_backward(dout, x, weight, bias, mean, var, eps, activation, slope)
    return kernels.empty_result(x, dx.dtype).copy_(dx), dweight, dbias


class BatchNormAct(torch.autograd.Function):
    """The forward (kernels, updating the running statistics in place: a custom
    operator that mutates can't have a derivative, so this is an autograd function)
    and its derivative, ``BatchNormActBackward``."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation, slope):
        out, mean, var = _forward(
            x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation, slope
        )
        ctx.save_for_backward(x, weight, bias, mean, var)
        ctx.settings = eps, activation, slope
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, mean, var = ctx.saved_tensors
        dx, dweight, dbias = BatchNormActBackward.apply(dout, x, weight, bias, mean, var, *ctx.settings)
        dweight = dweight.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        dbias = dbias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None, None, None, None


class BatchNormActBackward(torch.autograd.Function):
    """``(dx, dweight, dbias)`` from the output's gradient; its own derivative
    (``create_graph=True``) is the written-out batch norm's, recomputed from x."""

    @staticmethod
    def forward(ctx, dout, x, weight, bias, mean, var, eps, activation, slope):
        ctx.save_for_backward(dout, x, weight, bias)
        ctx.settings = eps, activation, slope
        return _backward(dout, x, weight, bias, mean, var, eps, activation, slope)

    @staticmethod
    def backward(ctx, ddx, ddweight, ddbias):
        # (dx, dweight, dbias) depend on dout, x, weight and bias alone (mean and var are
        # x's functions): differentiate the written-out first derivative there.
        dout, x, weight, bias = ctx.saved_tensors
        tensors = (dout, x, weight, bias)
        leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
        ldout, lx, lweight, lbias = leaves
        with torch.enable_grad(), _no_autocast(x):
            out = _written_out(lx, lweight, lbias, *ctx.settings)[0]
            wrt = [t for t in (lx, lweight, lbias) if t is not None]
            first = torch.autograd.grad(out, wrt, ldout.float(), create_graph=True, allow_unused=True)
            given = [g for t, g in zip((lx, lweight, lbias), (ddx, ddweight, ddbias)) if t is not None]
            pairs = [(f, g) for f, g in zip(first, given) if f is not None and g is not None]
            found = (
                torch.autograd.grad(
                    [f for f, _ in pairs],
                    [t for t in leaves if t is not None],
                    [g.float() for _, g in pairs],
                    allow_unused=True,
                    create_graph=True,
                )
                if pairs
                else [None] * sum(t is not None for t in leaves)
            )
        present = iter(found)
        grads = [None if t is None else next(present, None) for t in leaves]
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors)]
        return grads[0], grads[1], grads[2], grads[3], None, None, None, None, None


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
    with the running statistics (as ``nn.BatchNorm*d`` in training mode does with a
    float momentum); ``act`` one of
    ``ACTIVATIONS`` (``slope``: leaky ReLU's). A channels-first ``[N, C, *]`` x of fp32,
    fp16 or bf16 with more than one value per channel; the result has x's memory layout
    where x is dense (row-major, channels-last), else it is row-major."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"batch_norm_act: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if x.dim() < 2 or x.numel() // max(1, x.shape[1]) < 2:
        raise ValueError(
            f"batch_norm_act: expected more than 1 value per channel when training, got input size {list(x.shape)}"
        )
    if (running_mean is None) != (running_var is None):
        raise ValueError("batch_norm_act: give both running statistics or neither")
    if running_mean is None:
        num_batches_tracked = None  # counted with the running statistics only, as the module does
    return BatchNormAct.apply(
        x, weight, bias, running_mean, running_var, num_batches_tracked, float(momentum), float(eps), activation,
        float(slope),
    )  # fmt: skip
