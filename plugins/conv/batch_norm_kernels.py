"""The Triton kernels of batch norm in training mode with the activation after it
(``batch_norm_train.py`` holds the autograd functions that launch them).

The input is read as ``[N, C, S]`` (row-major; ``S`` the spatial dims together), so
channel ``c``'s ``L = N * S`` values are ``N`` runs of ``S``. A channel is split
among several programs (``SPLITS``), so a wide image with few channels still keeps
the whole GPU busy:

forward
  1. ``_stats_kernel``, grid ``(C, SPLITS)``: each program takes its chunk of its
     channel twice - its sum, then the sum of squares about the chunk's own mean
     (exact: no difference of large sums; the second read mostly hits L2) - and
     stores the chunk's count, mean and squared deviations;
  2. ``_combine_kernel``, grid ``(C,)``: the chunks' parts joined (Chan's formula:
     ``M2 = sum M2_i + sum n_i (mean_i - mean)^2``) into the channel's mean and
     biased variance, fp32; the running statistics updated as eager updates them
     (``(1 - momentum) * running + momentum * batch``, the variance unbiased) and
     the batch count added to, where given;
  3. ``_apply_kernel``, one program per ``BLOCK`` values: ``act((x - mean) *
     rsqrt(var + eps) * w + b)``, stored in x's dtype.

backward (``dout``: the gradient of the activation's output)
  1. ``_grad_stats_kernel``, grid ``(C, SPLITS)``: recomputes ``x_hat`` and the
     activation's input ``y`` from x, and sums ``g = dout * act'(y)`` and ``g *
     x_hat`` over the chunk;
  2. ``_sums_kernel``, grid ``(C,)``: the chunks' sums added (they are the bias's
     and the weight's gradients);
  3. ``_grad_apply_kernel``: ``dx = w * rstd * (g - sum(g) / L - x_hat * sum(g
     x_hat) / L)``.

Every sum is taken in fp32; 16-bit values are loaded and stored in their dtype.
Offsets are int32 unless the tensor holds more than ``INT32_LIMIT`` elements.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from autofuser.kernel import INT32_LIMIT, interpreting, next_power_of_2, round_bf16

#: Activations the kernels apply after the norm (``ACT`` below numbers them).
ACTIVATIONS = ("none", "relu", "leaky_relu", "gelu", "silu")
#: Values one program reads per step of its loop (stats) or stores (apply).
BLOCK = 1024
#: Programs the statistics kernels aim for, per streaming multiprocessor.
PROGRAMS_PER_SM = 4


@triton.jit
def _activation(y, ACT: tl.constexpr, slope):
    if ACT == 1:
        y = tl.where(y < 0.0, 0.0, y)  # NaN passes, as torch's relu
    elif ACT == 2:
        y = tl.where(y < 0.0, y * slope, y)
    elif ACT == 3:
        y = y * 0.5 * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACT == 4:
        y = y / (1.0 + tl.exp(-y))
    return y


@triton.jit
def _activation_grad(y, ACT: tl.constexpr, slope):
    # d act / d y at y (as eager's backward: relu's is 0 at 0, leaky relu's slope at 0).
    if ACT == 1:
        d = tl.where(y > 0.0, 1.0, 0.0)
    elif ACT == 2:
        d = tl.where(y > 0.0, 1.0, slope)
    elif ACT == 3:
        cdf = 0.5 * (1.0 + tl.math.erf(y * 0.7071067811865476))
        d = cdf + y * tl.exp(-0.5 * y * y) * 0.3989422804014327
    elif ACT == 4:
        s = 1.0 / (1.0 + tl.exp(-y))
        d = s * (1.0 + y * (1.0 - s))
    else:
        d = tl.full(y.shape, 1.0, tl.float32)
    return d


@triton.jit
def _channel_offsets(j, c, C, S, WIDE: tl.constexpr):
    # Offsets in [N, C, S] of channel c's values j (j < L = N * S).
    if WIDE:
        j = j.to(tl.int64)
    n = j // S
    return n * C * S + c * S + (j - n * S)


@triton.jit
def _per_channel(ptr, c, HAS: tl.constexpr, default):
    if HAS:
        return tl.load(ptr + c).to(tl.float32)
    else:
        return default


@triton.jit
def _stats_kernel(x, counts, means, m2s, C, S, L, CHUNK, SPLITS, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    c = tl.program_id(0)
    split = tl.program_id(1)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, L)
    total = tl.zeros([BLOCK], tl.float32)
    for first in range(start, end, BLOCK):
        j = first + tl.arange(0, BLOCK)
        total += tl.load(x + _channel_offsets(j, c, C, S, WIDE), mask=j < end, other=0.0).to(tl.float32)
    count = (end - start).to(tl.float32)
    mean = tl.sum(total, axis=0) / count
    squares = tl.zeros([BLOCK], tl.float32)
    for first in range(start, end, BLOCK):
        j = first + tl.arange(0, BLOCK)
        v = tl.load(x + _channel_offsets(j, c, C, S, WIDE), mask=j < end, other=0.0).to(tl.float32)
        d = tl.where(j < end, v - mean, 0.0)
        squares += d * d
    part = c * SPLITS + split
    tl.store(counts + part, count)
    tl.store(means + part, mean)
    tl.store(m2s + part, tl.sum(squares, axis=0))


@triton.jit
def _combine_kernel(
    counts,
    means,
    m2s,
    mean_out,
    var_out,
    running_mean,
    running_var,
    batches,
    SPLITS,
    momentum,
    unbias,
    UPDATE: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    c = tl.program_id(0)
    i = tl.arange(0, BLOCK_S)
    inside = i < SPLITS
    n_i = tl.load(counts + c * SPLITS + i, mask=inside, other=0.0)
    mean_i = tl.load(means + c * SPLITS + i, mask=inside, other=0.0)
    m2_i = tl.load(m2s + c * SPLITS + i, mask=inside, other=0.0)
    n = tl.sum(n_i, axis=0)
    mean = tl.sum(n_i * mean_i, axis=0) / n
    d = mean_i - mean
    var = (tl.sum(m2_i, axis=0) + tl.sum(n_i * d * d, axis=0)) / n
    tl.store(mean_out + c, mean)
    tl.store(var_out + c, var)
    if UPDATE:  # as eager: (1 - momentum) * running + momentum * batch, the variance unbiased
        old_mean = tl.load(running_mean + c).to(tl.float32)
        old_var = tl.load(running_var + c).to(tl.float32)
        new_mean = (1.0 - momentum) * old_mean + momentum * mean
        new_var = (1.0 - momentum) * old_var + momentum * (var * unbias)
        tl.store(running_mean + c, new_mean.to(running_mean.dtype.element_ty))
        tl.store(running_var + c, new_var.to(running_var.dtype.element_ty))
    if COUNT:
        if c == 0:
            tl.store(batches, tl.load(batches) + 1)


@triton.jit
def _sums_kernel(parts_g, parts_gx, sum_g, sum_gx, SPLITS, BLOCK_S: tl.constexpr):
    c = tl.program_id(0)
    i = tl.arange(0, BLOCK_S)
    inside = i < SPLITS
    tl.store(sum_g + c, tl.sum(tl.load(parts_g + c * SPLITS + i, mask=inside, other=0.0), axis=0))
    tl.store(sum_gx + c, tl.sum(tl.load(parts_gx + c * SPLITS + i, mask=inside, other=0.0), axis=0))


@triton.jit
def _apply_kernel(
    x,
    out,
    mean,
    var,
    weight,
    bias,
    C,
    S,
    total,
    eps,
    slope,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if WIDE:
        i = i.to(tl.int64)
    inside = i < total
    c = (i // S) % C
    v = tl.load(x + i, mask=inside, other=0.0).to(tl.float32)
    m = tl.load(mean + c, mask=inside, other=0.0)
    rstd = tl.math.rsqrt(tl.load(var + c, mask=inside, other=1.0) + eps)
    y = (v - m) * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight + c, mask=inside, other=1.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias + c, mask=inside, other=0.0).to(tl.float32)
    y = _activation(y, ACT, slope)
    if EMULATE_BF16:
        y = round_bf16(y)
    tl.store(out + i, y.to(out.dtype.element_ty), mask=inside)


@triton.jit
def _grad_stats_kernel(
    dout,
    x,
    mean,
    var,
    weight,
    bias,
    sum_g,
    sum_gx,
    C,
    S,
    L,
    CHUNK,
    SPLITS,
    eps,
    slope,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
):
    c = tl.program_id(0)
    split = tl.program_id(1)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, L)
    m = tl.load(mean + c)
    rstd = tl.math.rsqrt(tl.load(var + c) + eps)
    w = _per_channel(weight, c, HAS_WEIGHT, 1.0)
    b = _per_channel(bias, c, HAS_BIAS, 0.0)
    acc_g = tl.zeros([BLOCK], tl.float32)
    acc_gx = tl.zeros([BLOCK], tl.float32)
    for first in range(start, end, BLOCK):
        j = first + tl.arange(0, BLOCK)
        inside = j < end
        offsets = _channel_offsets(j, c, C, S, WIDE)
        x_hat = (tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32) - m) * rstd
        g = tl.load(dout + offsets, mask=inside, other=0.0).to(tl.float32)
        if ACT != 0:
            g = g * _activation_grad(x_hat * w + b, ACT, slope)
        g = tl.where(inside, g, 0.0)
        acc_g += g
        acc_gx += g * x_hat
    part = c * SPLITS + split
    tl.store(sum_g + part, tl.sum(acc_g, axis=0))
    tl.store(sum_gx + part, tl.sum(acc_gx, axis=0))


@triton.jit
def _grad_apply_kernel(
    dout,
    x,
    dx,
    mean,
    var,
    weight,
    bias,
    sum_g,
    sum_gx,
    C,
    S,
    total,
    L,
    eps,
    slope,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if WIDE:
        i = i.to(tl.int64)
    inside = i < total
    c = (i // S) % C
    m = tl.load(mean + c, mask=inside, other=0.0)
    rstd = tl.math.rsqrt(tl.load(var + c, mask=inside, other=1.0) + eps)
    if HAS_WEIGHT:
        w = tl.load(weight + c, mask=inside, other=1.0).to(tl.float32)
    else:
        w = tl.full([BLOCK], 1.0, tl.float32)
    x_hat = (tl.load(x + i, mask=inside, other=0.0).to(tl.float32) - m) * rstd
    g = tl.load(dout + i, mask=inside, other=0.0).to(tl.float32)
    if ACT != 0:
        if HAS_BIAS:
            y = x_hat * w + tl.load(bias + c, mask=inside, other=0.0).to(tl.float32)
        else:
            y = x_hat * w
        g = g * _activation_grad(y, ACT, slope)
    mean_g = tl.load(sum_g + c, mask=inside, other=0.0) / L
    mean_gx = tl.load(sum_gx + c, mask=inside, other=0.0) / L
    d = w * rstd * (g - mean_g - x_hat * mean_gx)
    if EMULATE_BF16:
        d = round_bf16(d)
    tl.store(dx + i, d.to(dx.dtype.element_ty), mask=inside)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(x: torch.Tensor, channels: int, per_channel: int, block: int) -> tuple[int, int]:
    """(chunk, splits): each channel's ``per_channel`` values in ``splits`` chunks of ``chunk``
    (a multiple of ``block``), about ``PROGRAMS_PER_SM`` programs per multiprocessor in all."""
    wanted = max(1, (PROGRAMS_PER_SM * _multiprocessors(x.device) + channels - 1) // channels)
    splits = max(1, min(wanted, triton.cdiv(per_channel, block)))
    chunk = triton.cdiv(triton.cdiv(per_channel, splits), block) * block
    return chunk, triton.cdiv(per_channel, chunk)


def _block(per_channel: int) -> int:
    return max(16, min(BLOCK, next_power_of_2(per_channel)))


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x row-major, with its batch, channel and spatial sizes."""
    x = x.contiguous()
    n, c = x.shape[0], x.shape[1]
    return x, n, c, x.numel() // max(1, n * c)


def _emulate_bf16(t: torch.Tensor) -> bool:
    # The interpreter converts fp32 to bf16 by truncation: round in the kernel instead.
    return t.dtype == torch.bfloat16 and interpreting()


def _weight_bias(x, weight, bias):
    return (weight if weight is not None else x), (bias if bias is not None else x)


def forward(
    x: torch.Tensor,
    weight,
    bias,
    running_mean,
    running_var,
    num_batches_tracked,
    momentum: float,
    eps: float,
    activation: str,
    slope: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, mean, var)``: the activation of the normalised x (x's dtype, row-major),
    and each channel's mean and biased variance (fp32); the running statistics, when
    given, updated and ``num_batches_tracked``, when given, counted up."""
    x, n, channels, spatial = _as_rows(x)
    per_channel, wide = n * spatial, x.numel() >= INT32_LIMIT
    block = _block(per_channel)
    chunk, splits = _splits(x, channels, per_channel, block)
    parts = torch.empty(3, channels, splits, dtype=torch.float32, device=x.device)
    _stats_kernel[(channels, splits)](
        x, parts[0], parts[1], parts[2], channels, spatial, per_channel, chunk, splits, BLOCK=block, WIDE=wide
    )
    mean, var = (torch.empty(channels, dtype=torch.float32, device=x.device) for _ in range(2))  # not views of one
    update, count = running_mean is not None, num_batches_tracked is not None
    _combine_kernel[(channels,)](
        parts[0], parts[1], parts[2], mean, var,
        running_mean if update else mean, running_var if update else var,
        num_batches_tracked if count else mean,
        splits, momentum, per_channel / (per_channel - 1),
        UPDATE=update, COUNT=count, BLOCK_S=next_power_of_2(splits),
    )  # fmt: skip
    out = torch.empty_like(x)
    w, b = _weight_bias(x, weight, bias)
    _apply_kernel[(triton.cdiv(x.numel(), BLOCK),)](
        x,
        out,
        mean,
        var,
        w,
        b,
        channels,
        spatial,
        x.numel(),
        eps,
        slope,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACT=ACTIVATIONS.index(activation),
        BLOCK=BLOCK,
        WIDE=wide,
        EMULATE_BF16=_emulate_bf16(x),
    )
    return out, mean, var


def backward(
    dout: torch.Tensor, x: torch.Tensor, weight, bias, mean, var, eps: float, activation: str, slope: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``: x's gradient (x's dtype, row-major) and the per-channel
    sums that are the weight's and the bias's gradients (fp32)."""
    x, n, channels, spatial = _as_rows(x)
    dout = dout.contiguous()
    per_channel, wide = n * spatial, x.numel() >= INT32_LIMIT
    block = _block(per_channel)
    chunk, splits = _splits(x, channels, per_channel, block)
    parts = torch.empty(2, channels, splits, dtype=torch.float32, device=x.device)
    w, b = _weight_bias(x, weight, bias)
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=ACTIVATIONS.index(activation))
    _grad_stats_kernel[(channels, splits)](
        dout, x, mean, var, w, b, parts[0], parts[1], channels, spatial, per_channel, chunk, splits, eps, slope,
        BLOCK=block, WIDE=wide, **flags,
    )  # fmt: skip
    sum_g, sum_gx = (torch.empty(channels, dtype=torch.float32, device=x.device) for _ in range(2))
    _sums_kernel[(channels,)](parts[0], parts[1], sum_g, sum_gx, splits, BLOCK_S=next_power_of_2(splits))
    dx = torch.empty_like(x)
    _grad_apply_kernel[(triton.cdiv(x.numel(), BLOCK),)](
        dout, x, dx, mean, var, w, b, sum_g, sum_gx, channels, spatial, x.numel(), per_channel, eps, slope,
        BLOCK=BLOCK, WIDE=wide, EMULATE_BF16=_emulate_bf16(x), **flags,
    )  # fmt: skip
    return dx, sum_gx, sum_g
