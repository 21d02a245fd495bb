"""What the attention kernel needs to know about one group.

Every form (``scaled_dot_product_attention`` or written out) becomes one
``AttentionLayout``: the sizes (``batch`` dims, ``n`` queries, ``m`` keys, head
widths ``d`` and ``dv``), how each tensor is addressed (``Operand``: its
strides over the batch dims and over its two matrix dims, read through the
tensor's real strides, so transposed and rearranged views need no copy), and
what happens to each tile of scores before the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx

from autofuser import GroupProgram, Value


@dataclass
class Operand:
    """A tensor the kernel reads or writes, as a matrix per batch entry.

    ``row_stride``/``col_stride`` step along the matrix the kernel sees: q and
    the output are [N, D], k is [M, D] (however it is stored: a ``k^T`` view
    swaps its strides back), v is [M, Dv], masks and biases are [N, M]. A
    stride is 0 where the tensor broadcasts.
    """

    index: int  # kernel argument ``in{index}`` (``out{index}`` for the output)
    dtype: torch.dtype
    batch_strides: tuple[int, ...]  # one per dim of ``AttentionLayout.batch``
    row_stride: int
    col_stride: int

    def extent(self, batch: tuple[int, ...], rows: int, cols: int) -> int:
        """Elements spanned, to choose 32- or 64-bit offsets."""
        span = sum((s - 1) * abs(st) for s, st in zip(batch, self.batch_strides))
        return span + (rows - 1) * abs(self.row_stride) + (cols - 1) * abs(self.col_stride) + 1


@dataclass
class Step:
    """One written-out pointwise node applied to a tile (q's, or the scores'):
    its lowered value, evaluated with the previous step's result for the load
    of the node before it, then rounded to ``dtype`` as eager rounds."""

    node: torch.fx.Node
    value: Value
    dtype: torch.dtype


@dataclass
class AttentionLayout:
    form: str  # "sdpa" | "written_out" (softmax) | "fourier" ((q @ k^T) @ v as written, no softmax)
    batch: tuple[int, ...]  # the output's leading dims, walked by grid axis 1
    n: int  # queries
    m: int  # keys
    d: int  # head width of q and k
    dv: int  # head width of v and the output
    q: Operand
    k: Operand
    v: Operand
    out: Operand
    qk_dtype: Optional[torch.dtype]  # operands of q @ k^T: None for fp32 (``precision``)
    pv_dtype: Optional[torch.dtype]  # operands of p @ v
    precision: str  # fp32 products: "tf32" where torch allows it, else "tf32x3" or "ieee"
    scale: Optional[float] = None  # sdpa: scores = q @ k^T * scale
    mask: Optional[Operand] = None  # sdpa: attn_mask as [N, M] tiles
    causal: bool = False  # sdpa: key j attends query i only if j <= i
    empty_rows_zero: bool = False  # sdpa gives 0 for a row whose keys are all masked (a softmax: NaN)
    scores_dtype: Optional[torch.dtype] = None  # written out: the product's eager dtype
    q_steps: list[Step] = field(default_factory=list)  # written out: pointwise ops on q before the product
    score_steps: list[Step] = field(default_factory=list)  # written out: scale, bias, mask between product and softmax
    tiles: dict[torch.fx.Node, Operand] = field(default_factory=dict)  # tensors the score steps read as [N, M]
    out_steps: list[Step] = field(default_factory=list)  # fourier: ops by constants on the output (``/ n``)

    @property
    def batch_numel(self) -> int:
        return math.prod(self.batch)


@dataclass
class RowNorm:
    """A layer norm over the head width of k or v, fused into the kernel that reads them."""

    node: torch.fx.Node
    eps: float
    dtype: torch.dtype  # of its result in eager
    weight: Optional[int] = None  # kernel argument ``in{weight}``, or ``None`` (no affine weight)
    bias: Optional[int] = None


@dataclass
class LinearAttentionLayout:
    """``q @ (k^T @ v)`` with the context ``k^T @ v`` (a d x dv matrix per batch entry)
    summed over the m points in splits, then applied to every query.

    ``form`` "galerkin": written as ``q @ (k^T @ v) / n``; "fourier": written as
    ``(q @ k^T) @ v / n`` and reassociated (the user allowed it).
    """

    form: str
    batch: tuple[int, ...]
    n: int  # queries
    m: int  # points summed over in k^T @ v
    d: int
    dv: int
    q: Operand  # [n, d]
    k: Operand  # [m, d]
    v: Operand  # [m, dv]
    out: Operand  # [n, dv]
    ctx_dtype: torch.dtype  # eager dtype of k^T @ v (its operands round to it unless fp32)
    out_dtype: torch.dtype  # eager dtype of q @ context
    precision: str
    k_norm: Optional[RowNorm] = None
    v_norm: Optional[RowNorm] = None
    ctx_steps: list[Step] = field(default_factory=list)  # ops by constants on the context (``/ n``)
    out_steps: list[Step] = field(default_factory=list)  # ops by constants on the output

    @property
    def batch_numel(self) -> int:
        return math.prod(self.batch)


@dataclass
class LinearMap:
    """An ``nn.Linear`` inside a chain: ``x @ weight^T + bias``, rounded to ``dtype``."""

    node: torch.fx.Node
    weight: int  # kernel argument ``in{weight}``, [out, in] contiguous
    bias: Optional[int]
    dtype: torch.dtype
    width_in: int
    width_out: int


@dataclass
class SliceLayout:
    """Transolver's slice attention, per batch entry (sample and head).

    Points ``x`` [n, dx] decide the slice weights ``w = softmax(steps(x @ Ws^T + bs))``
    over ``g`` slices; points ``fx`` [n, df] are aggregated into slice tokens
    ``t = (w^T @ fx) / steps(sum_n w)``; the tokens attend to each other
    (``q, k, v`` by linear maps of ``t``); ``out = w @ t'`` [n, dv].
    """

    batch: tuple[int, ...]
    n: int
    g: int
    dx: int
    df: int
    dq: int
    dv: int
    x: Operand
    fx: Operand
    out: Operand
    to_slice: LinearMap
    logit_steps: list[Step]
    logit_tiles: dict  # tensors the logit steps read, as [n, g] tiles
    weights_dtype: torch.dtype  # the softmax's
    sum_dtype: torch.dtype
    sum_steps: list[Step]  # on the weights' sums (``+ 1e-5``)
    agg_dtype: torch.dtype  # w^T @ fx
    tokens_dtype: torch.dtype  # after the division
    to_q: LinearMap
    to_k: LinearMap
    to_v: LinearMap
    scores_dtype: torch.dtype
    score_steps: list[Step]  # by constants (the scale)
    probs_dtype: torch.dtype
    mixed_dtype: torch.dtype  # p @ v
    out_dtype: torch.dtype  # w @ t'
    precision: str

    @property
    def batch_numel(self) -> int:
        return math.prod(self.batch)


@dataclass
class AttentionProgram(GroupProgram):
    """A ``GroupProgram`` with its attention layout (built by the strategy's compose)."""

    attention: Optional[AttentionLayout] = None
    linear: Optional[LinearAttentionLayout] = None
    slices: Optional["SliceLayout"] = None  # noqa: F821 (slice.py)
