"""``flash_attention(q, k, v, scale=...)``: softmax attention whose backward is this
plugin's own flash-style kernels (``flash.py``), as a call a graph can hold.

``softmax(scale * q @ k^T) @ v`` with torch's SDPA signature (no mask, no dropout, no
grouped-query attention: those raise ``ValueError``); 4-d ``[B, H, N, D]`` operands of
one dtype (fp32, fp16 or bf16), any strides; ``is_causal`` top-left aligned, as torch
defines it. Under autocast, the operands are cast to autocast's dtype, as autocast
casts SDPA's.

Two operators of the ``autofuser_attention`` library make it: ``forward`` returns the
result and each query's log-sum-exp of its scaled scores (fp32); ``backward`` takes
both with the result's gradient and recomputes the scores tile by tile, so no
``[..., N, M]`` tensor is ever held, forward or backward. As operators they are single
nodes in a traced graph: a fused group's backward, traced by ``make_fx``
(docs/training.md), holds the forward's recompute and one ``backward`` call, never the
scores. Where Triton runs (CUDA, or CPU tensors under the interpreter) they are the
kernels of ``flash.py``; on CPU otherwise the same algorithm in torch ops, a block of
queries at a time (``reference_forward`` / ``reference_backward``).

The gradients of ``backward`` itself (``create_graph=True``, as a physics-informed
loss takes) are those of the attention written out in torch ops, recomputed from
q, k, v and the result's gradient: a second derivative holds the scores, as eager's
written-out chain does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from autofuser.kernel import interpreting

from . import flash

LIBRARY = "autofuser_attention"
#: Most scores ``[..., queries, M]`` the CPU reference holds at once (fp32 entries).
REFERENCE_BLOCK_SCORES = 1 << 24


def _triton_runs(t: Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def _no_autocast(t: Tensor):
    """Autocast off on ``t``'s device: the torch-ops paths compute in fp32 as the kernels do."""
    return torch.autocast(t.device.type, enabled=False)


# ---------------------------------------------------------------------------
# The algorithm in torch ops: CPU without Triton, and second derivatives
# ---------------------------------------------------------------------------


def _query_blocks(q: Tensor, m: int):
    """Slices of q's query dim whose scores (every batch and head, ``m`` keys) fit the reference's budget."""
    rows = max(1, REFERENCE_BLOCK_SCORES // max(1, q.shape[0] * q.shape[1] * m))
    return [slice(s, min(s + rows, q.shape[2])) for s in range(0, q.shape[2], rows)]


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, rows: slice) -> Tensor:
    """fp32 scaled scores of the queries ``rows``; keys after a query's own index masked out when causal."""
    s = torch.matmul(q[:, :, rows].float(), k.float().transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return s


def reference_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` as the kernels compute them, in fp32 torch ops, a block of queries at a time."""
    b, h, n, _ = q.shape
    out = torch.empty(b, h, n, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    for rows in _query_blocks(q, k.shape[2]):
        s = _scores(q, k, scale, causal, rows)
        lse[:, :, rows] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[:, :, rows, None])
        out[:, :, rows] = torch.matmul(p, v.float()).to(q.dtype)
    return out, lse


def reference_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` as the kernels compute them, in fp32 torch ops, a block of queries at a time."""
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for rows in _query_blocks(q, k.shape[2]):
        p = torch.exp(_scores(q, k, scale, causal, rows) - lse[:, :, rows, None])
        do = dout[:, :, rows].float()
        delta = (do * out[:, :, rows].float()).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta) * scale
        dq[:, :, rows] = torch.matmul(ds, kf)
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, rows].float())
        dv += torch.matmul(p.transpose(-1, -2), do)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _written_out(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tensor:
    """The attention in differentiable torch ops (fp32), whole: for second derivatives."""
    s = _scores(q, k, scale, causal, slice(0, q.shape[2]))
    return torch.matmul(torch.softmax(s, dim=-1), v.float())


# ---------------------------------------------------------------------------
# The operators
# ---------------------------------------------------------------------------


@torch.library.custom_op(f"{LIBRARY}::forward", mutates_args=())
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, precision: str
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: the result (q's dtype, row-major) and each query's log-sum-exp (fp32).
    ``precision``: fp32 products' (``flash.PRECISIONS``), or "" for the rule in force now."""
    if _triton_runs(q):
        return flash.flash_forward(q, k, v, scale, causal, precision or None)
    with _no_autocast(q):  # an operator's body runs under the caller's autocast
        return reference_forward(q, k, v, scale, causal)


@attention_forward.register_fake
def _forward_meta(q, k, v, scale, causal, precision):
    b, h, n, _ = q.shape
    return q.new_empty(b, h, n, v.shape[-1]), q.new_empty(b, h, n, dtype=torch.float32)


@torch.library.custom_op(f"{LIBRARY}::backward", mutates_args=())
def attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float, causal: bool, precision: str
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, row-major, in the dtypes of q, k and v."""
    if _triton_runs(q):
        return flash.flash_backward(q, k, v, out, lse, dout, scale, causal, precision or None)
    with _no_autocast(q):
        return reference_backward(q, k, v, out, lse, dout, scale, causal)


@attention_backward.register_fake
def _backward_meta(q, k, v, out, lse, dout, scale, causal, precision):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _forward_context(ctx, inputs, output) -> None:
    q, k, v, scale, causal, precision = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.causal, ctx.precision = scale, causal, precision
    ctx.mark_non_differentiable(lse)


def _forward_gradient(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, ctx.scale, ctx.causal, ctx.precision)
    return dq, dk, dv, None, None, None


def _backward_context(ctx, inputs, output) -> None:
    q, k, v, _out, _lse, dout, scale, causal, _precision = inputs
    ctx.save_for_backward(q, k, v, dout)
    ctx.scale, ctx.causal = scale, causal


def _backward_gradient(ctx, ddq, ddk, ddv):
    # (dq, dk, dv) depend on q, k, v and dout alone (out and lse are q's, k's and v's
    # functions): differentiate the written-out attention's first derivative there.
    q, k, v, dout = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in (q, k, v, dout)]
    with torch.enable_grad(), _no_autocast(q):
        lq, lk, lv, ldout = leaves
        out = _written_out(lq, lk, lv, ctx.scale, ctx.causal)
        first = torch.autograd.grad(out, (lq, lk, lv), ldout.float(), create_graph=True)
        pairs = [(f, g) for f, g in zip(first, (ddq, ddk, ddv)) if g is not None]
        found = torch.autograd.grad(
            [f for f, _ in pairs], leaves, [g.float() for _, g in pairs], allow_unused=True, create_graph=True
        )
    grads = [None if g is None else g.to(t.dtype) for g, t in zip(found, (q, k, v, dout))]
    return grads[0], grads[1], grads[2], None, None, grads[3], None, None, None


attention_forward.register_autograd(_forward_gradient, setup_context=_forward_context)
attention_backward.register_autograd(_backward_gradient, setup_context=_backward_context)


# ---------------------------------------------------------------------------
# The call a graph holds
# ---------------------------------------------------------------------------


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    precision: Optional[str] = None,
) -> Tensor:
    """``F.scaled_dot_product_attention``'s function and signature, backward by this
    plugin's flash kernels (see the module's doc). A mask, dropout or ``enable_gqa``
    raises ``ValueError``: use ``F.scaled_dot_product_attention`` for those.
    ``precision``: fp32 products' (``flash.PRECISIONS``: what ``written_out.py`` passes,
    the precision its compile chose); ``None``, the project's rule when it runs."""
    if attn_mask is not None or dropout_p != 0 or enable_gqa:
        raise ValueError(
            "flash_attention takes no attn_mask, dropout_p or enable_gqa; call F.scaled_dot_product_attention for those"
        )
    if not isinstance(is_causal, bool):
        raise ValueError(f"flash_attention: is_causal={is_causal!r} must be a Python bool")
    device = query.device.type
    if torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
    flash.check_inputs(query, key, value, 1.0 if scale is None else scale)  # what the kernels and the reference take
    flash.dot_precision(precision)  # a bad value raises here, not in the operator
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, _ = attention_forward(query, key, value, factor, is_causal, precision or "")
    return out
