"""The Triton kernels of batch norm in training mode with the activation after it
(``batch_norm_train.py`` holds the autograd functions that launch them).

The input is read as ``[N, C, S]`` (``S`` the spatial dims together): x in place
where that view is dense (row-major, channels-last), else a row-major copy; each
``(n, s)`` is a row, and channel ``c``'s ``L = N * S`` values are a column. The
statistics kernels walk tiles of ``BLOCK_R`` rows by ``BLOCK_C`` channels: a run
of channels where channels are innermost in memory (channels-last: each row's
channels are one load), else one channel (its values are runs of ``S``). A
channel's rows are split among several programs (``SPLITS``), so a wide image with
few channels still keeps the whole GPU busy:

forward
  1. ``_stats_kernel``, grid ``(channel tiles, SPLITS)``: each program takes its
     chunk of rows twice - the sums, then the sums of squares about the chunk's own
     means (exact: no difference of large sums; the second read mostly hits L2) -
     and stores each channel's count, mean and squared deviations for the chunk;
  2. ``_combine_kernel``, grid ``(C,)``: the chunks' parts joined (Chan's formula:
     ``M2 = sum M2_i + sum n_i (mean_i - mean)^2``) into the channel's mean and
     biased variance, fp32; the running statistics updated as eager updates them
     (``(1 - momentum) * running + momentum * batch``, the variance unbiased) and
     the batch count added to, where given;
  3. ``_apply_kernel``, one program per ``BLOCK`` values in memory order (the
     channel of each from the channel stride): ``act((x - mean) * rsqrt(var + eps)
     * w + b)``, stored in x's dtype and layout.

backward (``dout``: the gradient of the activation's output)
  1. ``_grad_stats_kernel``, grid ``(channel tiles, SPLITS)``: recomputes ``x_hat``
     and the activation's input ``y`` from x, and sums ``g = dout * act'(y)`` and
     ``g * x_hat`` over the chunk;
  2. ``_sums_kernel``, grid ``(C,)``: the chunks' sums added (they are the bias's
     and the weight's gradients);
  3. ``_grad_apply_kernel``: ``dx = w * rstd * (g - sum(g) / L - x_hat * sum(g
     x_hat) / L)``.

Every sum is taken in fp32; 16-bit values are loaded and stored in their dtype.
Offsets are int32 unless an index may pass ``INT32_LIMIT`` (then int64 from the
program id on); one channel's values are counted in int32 (``batch_norm_train``
sends larger channels to its torch path).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from autofuser.kernel import INT32_LIMIT, interpreting, next_power_of_2, round_bf16, triton_cdiv

#: Activations the kernels apply after the norm (``ACT`` below numbers them).
ACTIVATIONS = ("none", "relu", "leaky_relu", "gelu", "silu")
#: Values one program reads per step of its loop (stats) or stores (apply).
BLOCK = 1024
#: Programs the statistics kernels aim for, per streaming multiprocessor.
PROGRAMS_PER_SM = 4
#: Channels-last: the most channels one statistics tile holds (a row of them per load).
MAX_TILE_CHANNELS = 64


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
def _flat_index(BLOCK: tl.constexpr, WIDE: tl.constexpr):
    # This program's BLOCK flat indices; int64 from the program id on where they pass int32.
    start = tl.program_id(0)
    if WIDE:
        start = start.to(tl.int64)
    return start * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _normalised_block(
    x,
    mean,
    var,
    weight,
    bias,
    C,
    stride_c,
    total,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
):
    # This program's values of x (dense: memory order walks each once) normalised: their
    # indices, mask and channels, each channel's rstd and weight, x_hat and y = x_hat * w + b.
    i = _flat_index(BLOCK, WIDE)
    inside = i < total
    c = (i // stride_c) % C
    rstd = tl.math.rsqrt(tl.load(var + c, mask=inside, other=1.0) + eps)
    x_hat = (tl.load(x + i, mask=inside, other=0.0).to(tl.float32) - tl.load(mean + c, mask=inside, other=0.0)) * rstd
    if HAS_WEIGHT:
        w = tl.load(weight + c, mask=inside, other=1.0).to(tl.float32)
    else:
        w = tl.full([BLOCK], 1.0, tl.float32)
    y = x_hat * w
    if HAS_BIAS:
        y = y + tl.load(bias + c, mask=inside, other=0.0).to(tl.float32)
    return i, inside, c, rstd, w, x_hat, y


@triton.jit
def _tile_offsets(rows, channels, S, stride_n, stride_c, stride_s, WIDE: tl.constexpr):
    # Offsets of a [rows, channels] tile; row r is (n, s) = (r // S, r % S).
    if WIDE:
        rows = rows.to(tl.int64)
        channels = channels.to(tl.int64)
    n = rows // S
    return (n * stride_n + (rows - n * S) * stride_s)[:, None] + (channels * stride_c)[None, :]


@triton.jit
def _per_channel(ptr, channels, mask, HAS: tl.constexpr, default, BLOCK_C: tl.constexpr):
    # A per-channel parameter as a [1, BLOCK_C] row (fp32), ``default`` without one.
    if HAS:
        return tl.load(ptr + channels, mask=mask, other=default).to(tl.float32)[None, :]
    else:
        return tl.full([1, BLOCK_C], default, tl.float32)


@triton.jit
def _stats_kernel(
    x,
    counts,
    means,
    m2s,
    C,
    S,
    L,
    CHUNK,
    SPLITS,
    stride_n,
    stride_c,
    stride_s,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WIDE: tl.constexpr,
):
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, L)
    known = channels < C
    total = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for first in range(start, end, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & known[None, :]
        offsets = _tile_offsets(rows, channels, S, stride_n, stride_c, stride_s, WIDE)
        total += tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    count = (end - start).to(tl.float32)
    mean = tl.sum(total, axis=0) / count
    squares = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for first in range(start, end, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & known[None, :]
        offsets = _tile_offsets(rows, channels, S, stride_n, stride_c, stride_s, WIDE)
        v = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, v - mean[None, :], 0.0)
        squares += d * d
    part = channels * SPLITS + split
    tl.store(counts + part, tl.full([BLOCK_C], 1.0, tl.float32) * count, mask=known)
    tl.store(means + part, mean, mask=known)
    tl.store(m2s + part, tl.sum(squares, axis=0), mask=known)


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
    stride_c,
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
    i, inside, c, rstd, w, x_hat, y = _normalised_block(
        x, mean, var, weight, bias, C, stride_c, total, eps, HAS_WEIGHT, HAS_BIAS, BLOCK, WIDE
    )
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
    stride_n,
    stride_c,
    stride_s,
    eps,
    slope,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WIDE: tl.constexpr,
):
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, L)
    known = channels < C
    m = tl.load(mean + channels, mask=known, other=0.0)[None, :]
    rstd = tl.math.rsqrt(tl.load(var + channels, mask=known, other=1.0) + eps)[None, :]
    w = _per_channel(weight, channels, known, HAS_WEIGHT, 1.0, BLOCK_C)
    b = _per_channel(bias, channels, known, HAS_BIAS, 0.0, BLOCK_C)
    acc_g = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    acc_gx = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for first in range(start, end, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & known[None, :]
        offsets = _tile_offsets(rows, channels, S, stride_n, stride_c, stride_s, WIDE)
        x_hat = (tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32) - m) * rstd
        g = tl.load(dout + offsets, mask=mask, other=0.0).to(tl.float32)
        if ACT != 0:
            g = g * _activation_grad(x_hat * w + b, ACT, slope)
        g = tl.where(mask, g, 0.0)
        acc_g += g
        acc_gx += g * x_hat
    part = channels * SPLITS + split
    tl.store(sum_g + part, tl.sum(acc_g, axis=0), mask=known)
    tl.store(sum_gx + part, tl.sum(acc_gx, axis=0), mask=known)


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
    stride_c,
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
    i, inside, c, rstd, w, x_hat, y = _normalised_block(
        x, mean, var, weight, bias, C, stride_c, total, eps, HAS_WEIGHT, HAS_BIAS, BLOCK, WIDE
    )
    g = tl.load(dout + i, mask=inside, other=0.0).to(tl.float32)
    if ACT != 0:
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


def _splits(x: torch.Tensor, channel_blocks: int, per_channel: int, block: int) -> tuple[int, int]:
    """(chunk, splits): each channel's ``per_channel`` values in ``splits`` chunks of ``chunk``
    (a multiple of ``block``), about ``PROGRAMS_PER_SM`` programs per multiprocessor in all."""
    wanted = max(1, triton_cdiv(PROGRAMS_PER_SM * _multiprocessors(x.device), channel_blocks))
    splits = max(1, min(wanted, triton_cdiv(per_channel, block)))
    chunk = triton_cdiv(triton_cdiv(per_channel, splits), block) * block
    return chunk, triton_cdiv(per_channel, chunk)


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` fills its memory exactly once (any
    order of its dims)."""
    expected = 1
    for size, step in sorted((d for d in zip(shape, stride) if d[0] != 1), key=lambda d: d[1]):
        if step != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class _Layout:
    """x as ``[N, C, S]`` (a view where its spatial dims merge: row-major and
    channels-last alike; a row-major copy otherwise), and how the statistics
    kernels walk it: tiles of ``block_r`` rows (each an ``(n, s)``) by ``block_c``
    channels - a run of channels where they are innermost in memory, else one -
    over ``splits`` chunks of ``chunk`` rows."""

    x: torch.Tensor
    channels: int
    spatial: int
    per_channel: int
    block_r: int
    block_c: int
    chunk: int
    splits: int
    wide: bool

    @property
    def strides(self) -> tuple[int, int, int]:
        return tuple(self.x.stride())  # type: ignore[return-value]

    @property
    def grid(self) -> tuple[int, int]:
        return triton_cdiv(self.channels, self.block_c), self.splits


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(x.shape[0], x.shape[1], -1)
    return rows if _dense(rows.shape, rows.stride()) else rows.contiguous()


def result_strides(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The strides of the kernels' results for an input of ``shape`` and ``stride``: the
    input's own where its spatial dims merge into one and the ``[N, C, S]`` it makes is
    dense (``_rows`` reads it in place), else row-major. Plain arithmetic: the graph pass
    asks it of captured metadata."""
    row_major = _row_major(shape, 1)
    spatial = [(size, st) for size, st in zip(shape[2:], stride[2:]) if size != 1]
    if any(outer != size * st for (_, outer), (size, st) in zip(spatial, spatial[1:])):
        return row_major  # the spatial dims don't merge: _rows copies x
    inner = spatial[-1][1] if spatial else 1
    if not _dense((shape[0], shape[1], math.prod(shape[2:])), (stride[0], stride[1], inner)):
        return row_major  # not dense: _rows copies x
    return (stride[0], stride[1], *_row_major(shape[2:], inner))[: len(shape)]


def _row_major(shape: Sequence[int], inner: int) -> tuple[int, ...]:
    """The strides of ``shape`` laid out row-major, its last dim ``inner`` apart."""
    strides = []
    for size in reversed(shape):
        strides.append(inner)
        inner *= size
    return tuple(reversed(strides))


def empty_result(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of x's shape in the memory layout the kernels give their
    results (``result_strides``). Not a view: a caller may write into it in place, which
    autograd refuses for a view made inside a function."""
    return torch.empty_strided(x.shape, result_strides(x.shape, x.stride()), dtype=dtype, device=x.device)


def _layout(x: torch.Tensor) -> _Layout:
    n, channels = x.shape[0], x.shape[1]
    rows = _rows(x)
    spatial = rows.shape[2]
    per_channel = n * spatial
    if rows.stride(1) == 1 and channels > 1:
        block_c = min(next_power_of_2(channels), MAX_TILE_CHANNELS)
        block_r = max(1, min(next_power_of_2(per_channel), BLOCK // block_c))
    else:
        block_c, block_r = 1, max(16, min(BLOCK, next_power_of_2(per_channel)))
    chunk, splits = _splits(x, triton_cdiv(channels, block_c), per_channel, block_r)
    # int64 offsets where an index may pass int32 (the last program's block overhangs by BLOCK)
    wide = x.numel() + BLOCK >= INT32_LIMIT
    return _Layout(rows, channels, spatial, per_channel, block_r, block_c, chunk, splits, wide)


def _emulate_bf16(t: torch.Tensor) -> bool:
    # The interpreter converts fp32 to bf16 by truncation: round in the kernel instead.
    return t.dtype == torch.bfloat16 and interpreting()


def _weight_bias(x, weight, bias):
    """The per-channel parameters as the kernels read them (contiguous; x where absent)."""
    return (weight.contiguous() if weight is not None else x), (bias.contiguous() if bias is not None else x)


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
    """``(out, mean, var)``: the activation of the normalised x (x's dtype, x's memory
    layout where it is dense, else row-major), and each channel's mean and biased
    variance (fp32); the running statistics, when given, updated and
    ``num_batches_tracked``, when given, counted up."""
    layout = _layout(x)
    rows, channels = layout.x, layout.channels
    parts = torch.empty(3, channels, layout.splits, dtype=torch.float32, device=x.device)
    _stats_kernel[layout.grid](
        rows, parts[0], parts[1], parts[2], channels, layout.spatial, layout.per_channel, layout.chunk,
        layout.splits, *layout.strides, BLOCK_R=layout.block_r, BLOCK_C=layout.block_c, WIDE=layout.wide,
    )  # fmt: skip
    mean, var = (torch.empty(channels, dtype=torch.float32, device=x.device) for _ in range(2))  # not views of one
    update, count = running_mean is not None, num_batches_tracked is not None
    # The kernels index per-channel tensors by channel: strided ones go through copies.
    statistics = [t.contiguous() for t in (running_mean, running_var)] if update else [mean, var]
    _combine_kernel[(channels,)](
        parts[0], parts[1], parts[2], mean, var, *statistics,
        num_batches_tracked if count else mean,
        layout.splits, momentum, layout.per_channel / (layout.per_channel - 1),
        UPDATE=update, COUNT=count, BLOCK_S=next_power_of_2(layout.splits),
    )  # fmt: skip
    for given, written in zip((running_mean, running_var), statistics) if update else ():
        if written is not given:
            given.copy_(written)
    out = empty_result(x, x.dtype)  # rows' memory order: a dense tensor's layout is kept
    w, b = _weight_bias(rows, weight, bias)
    _apply_kernel[(triton_cdiv(rows.numel(), BLOCK),)](
        rows, out, mean, var, w, b, channels, rows.stride(1), rows.numel(), eps, slope,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=ACTIVATIONS.index(activation),
        BLOCK=BLOCK, WIDE=layout.wide, EMULATE_BF16=_emulate_bf16(rows),
    )  # fmt: skip
    return out, mean, var


def backward(
    dout: torch.Tensor, x: torch.Tensor, weight, bias, mean, var, eps: float, activation: str, slope: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``: x's gradient (in the layout ``forward`` gave its
    output) and the per-channel sums that are the weight's and the bias's gradients
    (fp32)."""
    layout = _layout(x)
    rows, channels = layout.x, layout.channels
    dx = empty_result(x, x.dtype)
    if dout.stride() != dx.stride():
        dout = torch.empty_like(dx).copy_(dout)  # read with x's offsets
    parts = torch.empty(2, channels, layout.splits, dtype=torch.float32, device=x.device)
    w, b = _weight_bias(rows, weight, bias)
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACT=ACTIVATIONS.index(activation))
    _grad_stats_kernel[layout.grid](
        dout, rows, mean, var, w, b, parts[0], parts[1], channels, layout.spatial, layout.per_channel,
        layout.chunk, layout.splits, *layout.strides, eps, slope,
        BLOCK_R=layout.block_r, BLOCK_C=layout.block_c, WIDE=layout.wide, **flags,
    )  # fmt: skip
    sum_g, sum_gx = (torch.empty(channels, dtype=torch.float32, device=x.device) for _ in range(2))
    _sums_kernel[(channels,)](parts[0], parts[1], sum_g, sum_gx, layout.splits, BLOCK_S=next_power_of_2(layout.splits))
    _grad_apply_kernel[(triton_cdiv(rows.numel(), BLOCK),)](
        dout, rows, dx, mean, var, w, b, sum_g, sum_gx, channels, rows.stride(1), rows.numel(), layout.per_channel,
        eps, slope, BLOCK=BLOCK, WIDE=layout.wide, EMULATE_BF16=_emulate_bf16(rows), **flags,
    )  # fmt: skip
    return dx, sum_gx, sum_g
