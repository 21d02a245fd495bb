"""``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
scale, enable_gqa)``: ``softmax(q @ k^T * scale + mask) @ v``.

The lowering only checks that the call is one the ``softmax_attention``
strategy serves and marks the node extern (``ctx.extern()``): the strategy's
own compose reads the arguments from the node and writes the whole op as one
online-softmax kernel. Served: any leading (batch, head) dims that broadcast,
head widths up to 256 (the value's may differ from the query's), a boolean
(True: attend) or additive float mask broadcasting to ``[..., N, M]``,
``is_causal`` (top-left aligned, as torch defines it), any ``scale``. Refused,
with a reason: ``dropout_p > 0`` (a random mask on every call), ``enable_gqa``,
head widths above 256, float64 (by ``dtypes``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample, Tolerance, broadcast_shapes

from ..flash_op import flash_attention

#: Widest head the kernel keeps in registers (q's rows and the accumulator).
MAX_HEAD_WIDTH = 256

# Products accumulate in another order than eager (and, in fp16/bf16, the
# probabilities are rounded before they are normalised, as in every flash kernel).
ATTENTION_TOLERANCES = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "float16": Tolerance(atol=2e-3, rtol=1e-2),
    "bfloat16": Tolerance(atol=2e-2, rtol=4e-2),
}


def sdpa_arguments(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False, precision=None
) -> dict:
    """The call's arguments by name, bound as torch binds them (``TypeError`` otherwise);
    ``precision``, ``flash_attention``'s own, is the compile's fp32 product precision,
    which the kernel takes anyway: not among them."""
    return dict(
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


#: The calls this lowering serves: torch's, and the one ``written_out.py`` writes.
SDPA_FUNCTIONS = (F.scaled_dot_product_attention, flash_attention)


def lower_sdpa(ctx, *args, **kwargs):
    try:
        a = sdpa_arguments(*args, **kwargs)
    except TypeError as err:
        ctx.refuse("unsupported_argument", f"scaled_dot_product_attention: {err}")
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    for name in ("query", "key", "value"):
        if not ctx.is_tensor(a[name]):
            ctx.refuse("not_a_tensor", f"{name} is not a tensor")
    if not isinstance(a["dropout_p"], (int, float)) or a["dropout_p"] != 0:
        ctx.refuse("random", f"dropout_p={a['dropout_p']!r} draws a random mask on every call; left to eager")
    if a["enable_gqa"] is not False:
        ctx.refuse("unsupported_argument", "enable_gqa (grouped-query attention) is not served; left to eager")
    if not isinstance(a["is_causal"], bool):
        ctx.refuse("unsupported_argument", f"is_causal={a['is_causal']!r} is not a Python bool")
    if a["scale"] is not None and (isinstance(a["scale"], bool) or not isinstance(a["scale"], (int, float))):
        ctx.refuse("unsupported_argument", f"scale={a['scale']!r} is not a Python number")
    q_shape, k_shape, v_shape = ctx.shape(q), ctx.shape(k), ctx.shape(v)
    if min(len(q_shape), len(k_shape), len(v_shape)) < 2:
        ctx.refuse("unsupported_shape", "query, key and value need a sequence dim and a head dim")
    if q_shape[-1] > MAX_HEAD_WIDTH or v_shape[-1] > MAX_HEAD_WIDTH:
        ctx.refuse(
            "head_too_wide",
            f"head widths {q_shape[-1]} (query/key) and {v_shape[-1]} (value): the kernel "
            f"keeps at most {MAX_HEAD_WIDTH} in registers",
        )
    if 0 in q_shape or 0 in k_shape or 0 in v_shape:
        ctx.refuse("unsupported_shape", "an empty query, key or value")
    if mask is not None:
        if not ctx.is_tensor(mask):
            ctx.refuse("unsupported_argument", f"attn_mask={mask!r} is not a tensor")
        if ctx.dtype(mask) not in (torch.bool, ctx.dtype(q)):
            ctx.refuse("unsupported_dtype", f"attn_mask of dtype {ctx.dtype(mask)} with {ctx.dtype(q)} queries")
        scores = tuple(ctx.out_shape[:-2]) + (q_shape[-2], k_shape[-2])
        try:
            fits = tuple(broadcast_shapes(ctx.shape(mask), scores)) == scores
        except RuntimeError:
            fits = False
        if not fits:
            ctx.refuse(
                "shape_mismatch", f"attn_mask {list(ctx.shape(mask))} does not broadcast to the scores {list(scores)}"
            )
    return ctx.extern()


def _qkv(batch, n, m, d, dv, dtype):
    return (
        torch.randn(*batch, n, d, dtype=dtype),
        torch.randn(*batch, m, d, dtype=dtype),
        torch.randn(*batch, m, dv, dtype=dtype),
    )


def _samples(dtype):
    bool_mask = torch.rand(37, 53) > 0.4
    bool_mask[:, 0] = True  # no row without a key
    return [
        Sample(args=_qkv((2, 3), 29, 31, 16, 16, dtype), note="no mask"),
        Sample(args=_qkv((1, 2), 37, 53, 24, 24, dtype), kwargs={"attn_mask": bool_mask}, note="bool mask, N != M"),
        Sample(
            args=_qkv((2, 2), 37, 37, 64, 64, dtype),
            kwargs={"attn_mask": torch.randn(2, 1, 37, 37, dtype=dtype)},
            note="additive float mask broadcast over heads",
        ),
        Sample(args=_qkv((3,), 17, 40, 40, 24, dtype), note="3-d, value head width differs"),
    ]


SPECS = [
    LoweringSpec(
        name="attention.sdpa",
        description="F.scaled_dot_product_attention without dropout: one online-softmax kernel",
        targets=SDPA_FUNCTIONS,
        kind="opaque",  # extern: only the attention strategies, with their own compose, take it
        lower=lower_sdpa,
        samples=_samples,
        references=(
            F.scaled_dot_product_attention,
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3),
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.2),
        ),
        tolerances=ATTENTION_TOLERANCES,
    ),
]
