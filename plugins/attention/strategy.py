"""The ``softmax_attention`` strategy: ``softmax(q k^T * scale + mask) v`` -
``scaled_dot_product_attention`` or written out - as one online-softmax kernel
that never writes the N x M scores (``kernel.py``).

It composes its groups itself (``match.compose_attention``): an SDPA node is
an extern op the generic composition can't express, and a written-out chain
would otherwise be laid out as two products with the scores in memory. Its
priority is 1, so a chain is considered before the generic groups that would
split it (the scores' product with its softmax, the second product alone);
when it is refused - the scores are used elsewhere, a head is too wide - the
report says why and those generic groups take the nodes instead.
"""

from __future__ import annotations

from typing import Optional

from autofuser import StrategySpec, device_limits
from autofuser.kernel import MAX_GRID_YZ, dot_block, literal_sizes, next_power_of_2

from .kernel import write_attention_kernel
from .layout import AttentionProgram
from .linear import compose_linear_attention, find_linear_attention
from .linear_kernel import write_linear_attention
from .match import compose_attention, find_attention
from .prepass import pass_modes
from .slice import compose_slice_attention, find_slice_attention
from .slice_kernel import write_slice_attention

#: fp32 values (accumulator, scores tile, q's tile) per thread before registers spill.
REGS_PER_THREAD = 192

CONFIGS = [
    # (BLOCK_M, BLOCK_N, num_warps, num_stages), most promising first: tuning stops at its budget
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 32, 8, 3),
    (64, 128, 4, 2),
    (64, 32, 4, 3),
    (64, 64, 8, 2),
    (64, 32, 8, 2),
    (32, 64, 4, 3),
    (32, 32, 4, 2),
    (16, 64, 4, 2),
    (16, 32, 2, 2),
]


def propose(view):
    return find_attention(view)


def accepts(program):
    if not isinstance(program, AttentionProgram) or program.attention is None:
        return ("not_attention", "the group was not composed by the attention strategy")
    return _batch_refusal(program.attention)


def _batch_refusal(layout):
    """The refusal of a layout whose batch entries would not fit the grid's second axis, or ``None``."""
    if layout.batch_numel > MAX_GRID_YZ:
        return ("batch_too_large", f"{layout.batch_numel} batch entries exceed the grid's second axis ({MAX_GRID_YZ})")
    return None


def _element(dtype) -> int:
    return 4 if dtype is None else 2


def _miscomputed(L, warps: int, stages: int) -> bool:
    """On an H200 with Triton 3.6 the 3xFP16 kernel gave wrong results at head width 64 with
    8 warps and 2 stages, and right results under the interpreter and with 3 stages
    (BENCHMARKS.md, "Measurements behind rules in the code")."""
    return pass_modes(L)["v"] == "split" and warps == 8 and stages == 2


def is_valid(program, config):
    L = program.attention
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    block_d, block_dv = dot_block(L.d), dot_block(L.dv)
    if block_m > 16 and block_m // 2 >= L.n:
        return "more query rows per program than there are queries"
    if block_n > 16 and block_n // 2 >= L.m:
        return "a key block longer than the keys"
    if _miscomputed(L, config["num_warps"], config.get("num_stages", 2)):
        return "8 warps with 2 pipeline stages miscompute the 3xFP16 kernel (Triton 3.6)"
    threads = 32 * config["num_warps"]
    held = block_m * (block_dv + block_n + block_d * _element(L.qk_dtype) / 4)
    if held / threads > REGS_PER_THREAD:
        return f"{held / threads:.0f} values per thread (accumulator, scores, q) would spill registers"
    smem = block_n * (block_d * _element(L.qk_dtype) + block_dv * _element(L.pv_dtype)) * config.get("num_stages", 2)
    limit = device_limits().shared_memory_per_block
    if smem > limit:
        return f"{smem // 1024} KiB of shared memory for the pipelined k and v tiles exceeds {limit // 1024} KiB"
    return None


#: Tuning times the first this many valid CONFIGS: on the zoo's attention kernels (fp32 and
#: bf16, ``benchmarks/tuning_stats.py``; BENCHMARKS.md, Tuning lists) the winner was always
#: one of the first three. These are the largest kernels AutoFuser compiles.
MAX_TUNED_CONFIGS = 3


def configs(program):
    return [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages} for m, n, warps, stages in CONFIGS]


def default_config(program):
    """Blocks of up to 64 x 64 (fewer, larger steps also keep the interpreter quick), shrunk until valid."""
    L = program.attention
    block_m = min(64, max(16, next_power_of_2(L.n)))
    block_n = min(64, max(16, next_power_of_2(L.m)))
    warps = 8 if max(L.d, L.dv) > 64 else 4
    stages = 3 if _miscomputed(L, warps, 2) else 2
    for m, n in ((block_m, block_n), (block_m, 32), (min(block_m, 32), 16), (16, 16)):
        config = {"BLOCK_M": m, "BLOCK_N": min(n, block_n), "num_warps": warps, "num_stages": stages}
        if is_valid(program, config) is None:
            return config
    return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": warps, "num_stages": 1}  # the smallest tiles there are


def generate(program, helpers):
    return write_attention_kernel(program, "softmax_attention", helpers)


ATTENTION_STRATEGY = StrategySpec(
    name="softmax_attention",
    description="Softmax attention (SDPA or written out) as one online-softmax kernel: the scores never reach memory.",
    priority=1,
    block_params=("BLOCK_M", "BLOCK_N"),
    propose=propose,
    compose=compose_attention,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    max_tuned_configs=MAX_TUNED_CONFIGS,
    default_config=default_config,
    generate=generate,
)


# ---------------------------------------------------------------------------
# linear_attention: Galerkin (a chain of three kernels) and Fourier (as written, or reassociated)
# ---------------------------------------------------------------------------

#: (BLOCK_M, BLOCK_N, SPLITS, num_warps), most promising first.
LINEAR_CONFIGS = [
    (128, 128, 16, 4),
    (128, 64, 32, 4),
    (64, 128, 8, 4),
    (128, 128, 32, 8),
    (64, 64, 64, 4),
    (128, 256, 8, 8),
    (256, 128, 16, 8),
    (64, 128, 32, 4),
]


def linear_accepts(program):
    if not isinstance(program, AttentionProgram) or (program.linear is None and program.attention is None):
        return ("not_attention", "the group was not composed by the linear attention strategy")
    return _batch_refusal(program.linear or program.attention)


def _linear_held(L, config) -> float:
    """fp32 values per thread: the context (d x dv) and the k, v or q tiles."""
    block_d, block_dv = dot_block(L.d), dot_block(L.dv)
    tiles = max(config["BLOCK_N"] * (block_d + block_dv), config["BLOCK_M"] * (block_d + block_dv))
    return (tiles + 2 * block_d * block_dv) / (32 * config["num_warps"])


def _split_blocks_oversized(config, rows: int, points: int, row_name: str, rows_name: str) -> Optional[str]:
    """Why a split-N chain's blocks are too large for its sizes (``BLOCK_M`` over ``rows``,
    ``SPLITS`` runs of ``BLOCK_N`` over ``points``), or ``None``."""
    if config["BLOCK_M"] > 16 and config["BLOCK_M"] // 2 >= rows:
        return f"more {row_name} per program than there are {rows_name}"
    if config["BLOCK_N"] > 16 and (config["BLOCK_N"] // 2) * config["SPLITS"] >= points:
        return "splits longer than their share of the points"
    return None


def _split_default(points: int, row_blocks, warps: int, stages: int, is_valid) -> Optional[dict]:
    """The first valid split-N config with up to 64-point blocks and 4, 2 or 1 splits (a few
    steps each under the interpreter), trying the row blocks ``row_blocks`` in order."""
    for splits in (4, 2, 1):
        block_n = min(64, max(16, next_power_of_2(-(-points // splits))))
        for block_m in row_blocks:
            config = {
                "BLOCK_M": block_m,
                "BLOCK_N": block_n,
                "SPLITS": splits,
                "num_warps": warps,
                "num_stages": stages,
            }
            if is_valid(config) is None:
                return config
    return None


def linear_is_valid(program, config):
    if program.linear is None:
        return is_valid(program, config)
    L = program.linear
    oversized = _split_blocks_oversized(config, L.n, L.m, "query rows", "queries")
    if oversized:
        return oversized
    held = _linear_held(L, config)
    if held > REGS_PER_THREAD:
        return f"{held:.0f} values per thread would spill registers"
    return None


def linear_configs(program):
    if program.linear is None:
        return configs(program)
    return [
        {"BLOCK_M": m, "BLOCK_N": n, "SPLITS": s, "num_warps": warps, "num_stages": 2}
        for m, n, s, warps in LINEAR_CONFIGS
    ]


def linear_default_config(program):
    """Up to 64-point blocks and 4 splits (a few steps each under the interpreter), shrunk until valid."""
    if program.linear is None:
        return default_config(program)
    L = program.linear
    warps = 8 if max(L.d, L.dv) > 64 else 4
    block_m = min(64, max(16, next_power_of_2(L.n)))
    return _split_default(L.m, (block_m,), warps, 2, lambda c: linear_is_valid(program, c)) or {
        "BLOCK_M": 16,
        "BLOCK_N": 16,
        "SPLITS": 1,
        "num_warps": warps,
        "num_stages": 1,
    }


def linear_generate(program, helpers):
    if program.linear is None:
        # The online kernel (and its passes) is written for each shape: its sizes are literals.
        with literal_sizes(
            "a Fourier chain as written runs the online attention kernel, which is written for each shape"
        ):
            return write_attention_kernel(program, "linear_attention", helpers)
    return write_linear_attention(program, "linear_attention", helpers)


LINEAR_STRATEGY = StrategySpec(
    name="linear_attention",
    description="Linear attention without a softmax: Galerkin-type q @ (k^T @ v) with its layer norms as a chain "
    "of split-N kernels; Fourier-type (q @ k^T) @ v as written (or reassociated when allowed).",
    priority=1,
    block_params=("BLOCK_M", "BLOCK_N", "SPLITS"),
    propose=find_linear_attention,
    compose=compose_linear_attention,
    accepts=linear_accepts,
    configs=linear_configs,
    is_valid=linear_is_valid,
    default_config=linear_default_config,
    generate=linear_generate,
    dynamic_sizes=True,  # the Galerkin chain (and a reassociated Fourier one) takes the point count at run time
)


# ---------------------------------------------------------------------------
# slice_attention: Transolver's physics attention as a chain of three kernels
# ---------------------------------------------------------------------------

#: (BLOCK_M, BLOCK_N, SPLITS, num_warps), most promising first.
SLICE_CONFIGS = [
    (64, 64, 16, 4),
    (128, 64, 16, 8),
    (64, 128, 8, 8),
    (64, 64, 32, 4),
    (32, 64, 16, 4),
    (128, 128, 8, 8),
    (64, 32, 32, 4),
    (32, 32, 32, 2),
]


def slice_accepts(program):
    if not isinstance(program, AttentionProgram) or program.slices is None:
        return ("not_attention", "the group was not composed by the slice attention strategy")
    return _batch_refusal(program.slices)


#: Measured on an H200 (Triton 3.6, ``benchmarks/slice_tf32_probe.py``): with plain-TF32
#: products, every 8-warp configuration of this chain with a software-pipelined loop
#: (``num_stages`` 2) read shared memory out of bounds (an illegal memory access, which
#: leaves the CUDA context unusable); the same configurations with ``num_stages`` 1, and
#: every one with fewer warps, ran and matched eager. TF32 chains with 8 warps therefore run
#: unpipelined.
TF32_MAX_STAGES_AT_8_WARPS = 1


def slice_is_valid(program, config):
    L = program.slices
    if (
        L.precision == "tf32" and config["num_warps"] >= 8 and config.get("num_stages", 3) > TF32_MAX_STAGES_AT_8_WARPS
    ):  # Triton's default is 3
        return (
            "plain-TF32 products with 8 warps and a pipelined loop read shared memory out of bounds "
            "(Triton 3.6, sm_90); use num_stages 1"
        )
    bg, bdx, bdf, bdq, bdv = (dot_block(s) for s in (L.g, L.dx, L.df, L.dq, L.dv))
    oversized = _split_blocks_oversized(config, L.n, L.n, "points", "points")
    if oversized:
        return oversized
    threads = 32 * config["num_warps"]
    points = max(config["BLOCK_M"], config["BLOCK_N"]) * (bdx + 3 * bg + bdf) + bg * bdf + bdx * bg
    tokens = 3 * bg * bg + bg * (bdf + 2 * bdq + 2 * bdv)
    if max(points, tokens) / threads > REGS_PER_THREAD:
        return f"{max(points, tokens) / threads:.0f} values per thread would spill registers"
    return None


def _slice_stages(program, warps):
    return TF32_MAX_STAGES_AT_8_WARPS if program.slices.precision == "tf32" and warps >= 8 else 2


def slice_configs(program):
    return [
        {"BLOCK_M": m, "BLOCK_N": n, "SPLITS": s, "num_warps": warps, "num_stages": _slice_stages(program, warps)}
        for m, n, s, warps in SLICE_CONFIGS
    ]


def slice_default_config(program):
    L = program.slices
    warps = 8 if L.g > 64 else 4
    block_m = min(64, max(16, next_power_of_2(L.n)))
    return _split_default(
        L.n, (block_m, min(32, block_m), 16), warps, _slice_stages(program, warps), lambda c: slice_is_valid(program, c)
    ) or {"BLOCK_M": 16, "BLOCK_N": 16, "SPLITS": 1, "num_warps": 8, "num_stages": 1}


SLICE_STRATEGY = StrategySpec(
    name="slice_attention",
    description="Transolver's slice (physics) attention - slice weights, aggregation, attention among the slices, "
    "scatter back - as a chain of three kernels that read the point features once each.",
    priority=1,
    block_params=("BLOCK_M", "BLOCK_N", "SPLITS"),
    propose=find_slice_attention,
    compose=compose_slice_attention,
    accepts=slice_accepts,
    configs=slice_configs,
    is_valid=slice_is_valid,
    default_config=slice_default_config,
    generate=lambda program, helpers: write_slice_attention(program, "slice_attention", helpers),
)
