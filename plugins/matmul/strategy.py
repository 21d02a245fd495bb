"""Strategies for groups around one matrix product.

All three write the same kind of kernel (``kernel.py``:
2-D output tiles, a K loop, grouped launch order) and differ in the groups
they claim:

- ``matmul``: a product alone;
- ``linear_epilogue``: a product with what follows it - bias, any pointwise
  chain, a residual add, a norm over its columns, several outputs;
- ``layernorm_linear``: a product whose input is normalised in the kernel
  (row statistics over K computed first, the normalised tile fed to the dot),
  with any epilogue.
"""

from __future__ import annotations

import torch

from autofuser import GroupRefused, StrategySpec, device_limits
from autofuser.kernel import dot_block, next_power_of_2, rounded, triton_cdiv

from .kernel import write_matmul_kernel
from .layout import MatmulLayout, contiguous_strides, multiprocessors
from .split import NORM_APART

#: fp32 accumulators per thread before registers spill.
ACC_PER_THREAD = 128
#: Epilogue norms need a whole row of the product in one program.
MAX_ROW_N = 256

CONFIGS = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), most promising first: tuning stops at its budget
    (128, 128, 32, 8, 3),
    (128, 128, 64, 8, 3),
    (64, 128, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 256, 32, 8, 3),
    (64, 64, 32, 4, 4),
    (64, 64, 64, 4, 3),
    (64, 256, 32, 8, 3),
    (32, 64, 32, 4, 4),
    (64, 32, 32, 4, 4),
    (32, 32, 32, 4, 2),
]


def _classify(view, nodes):
    """The strategy a composed group belongs to, or None."""
    if "matmul" not in view.kinds(nodes):
        return None
    try:
        program = view.compose(nodes)
    except GroupRefused:
        return None
    layout = program.product_layout
    if not isinstance(layout, MatmulLayout):
        return None  # none, or two products: the mlp plugin's
    if layout.prologue_reduces:
        return "layernorm_linear"
    # A quantised weight's decode (a packed weight) is part of the product, not an epilogue.
    ops = [n for n in nodes if view.lowered[n].packed is None]
    return "matmul" if len(ops) == 1 else "linear_epilogue"


def accepts(program):
    layout = program.product_layout
    if not isinstance(layout, MatmulLayout):
        return ("not_one_product", "the group does not have exactly one matrix product")
    if layout.epilogue_reduces and layout.n > MAX_ROW_N:
        return (
            "row_too_long",
            f"a norm over {layout.n} product columns needs more than one program's tile (limit {MAX_ROW_N})",
        )
    return None


#: A lone product splits its K among programs (``splits_k``) where its output has fewer
#: 32 x 32 tiles than SPLIT_TILES_PER_SM times the multiprocessors and its K is at least
#: SPLIT_MIN_K long; each program then sums at least SPLIT_MIN_SHARE of K.
SPLIT_TILES_PER_SM = 0.5
SPLIT_MIN_K = 1024
SPLIT_MIN_SHARE = 256
#: Split configs aim at about this many programs per multiprocessor.
SPLIT_PROGRAMS_PER_SM = 4
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of split products: small tiles, few outputs.
SPLIT_CONFIGS = [(32, 32, 64, 4, 3), (32, 32, 32, 4, 3), (64, 64, 32, 4, 3), (16, 16, 64, 2, 3), (64, 32, 64, 4, 3)]


def splits_k(program) -> bool:
    """Whether the group is a lone product of a few output tiles over a long K, whose K its
    programs split among them (``kernel.write_matmul_kernel``'s ``split``): its only
    output is the product itself (no epilogue: the rows' sum comes after the kernel),
    written contiguous (the partial rows are in the output's element order), with no
    norm over K before it and no packed weight."""
    layout = program.product_layout
    if not isinstance(layout, MatmulLayout) or layout.prologue_reduces or layout.epilogue_reduces:
        return False
    if layout.b_packed is not None or len(program.outputs) != 1:
        return False
    out, value = program.outputs[0], program.output_values[0]
    # The product itself, or rounded to its 16-bit dtype (the launcher's sum rounds once).
    lone = value is layout.dot or (
        value.op == "pointwise" and value.args == (layout.dot,) and value.template == rounded("{0}", out.dtype)
    )
    if not lone:
        return False
    if not out.dtype.is_floating_point or out.dtype == torch.float64 or out.stride != contiguous_strides(out.shape):
        return False
    if layout.k < SPLIT_MIN_K:
        return False
    tiles = triton_cdiv(layout.rows, 32) * triton_cdiv(layout.n, 32) * layout.batch
    return tiles < SPLIT_TILES_PER_SM * multiprocessors()


def _splits(layout: MatmulLayout, block_m: int, block_n: int) -> int:
    """SPLIT_K for tiles of ``block_m x block_n``: a power of two bringing the programs to
    about SPLIT_PROGRAMS_PER_SM per multiprocessor, at least 2, each share of K at least
    SPLIT_MIN_SHARE long."""
    tiles = triton_cdiv(layout.rows, block_m) * triton_cdiv(layout.n, block_n) * layout.batch
    wanted = max(2, next_power_of_2(triton_cdiv(SPLIT_PROGRAMS_PER_SM * multiprocessors(), tiles)))
    most = max(2, layout.k // SPLIT_MIN_SHARE)
    while wanted > most and wanted > 2:
        wanted //= 2
    return wanted


def _split_configs(program) -> list[dict]:
    layout = program.product_layout
    out = []
    for m, n, k, warps, stages in SPLIT_CONFIGS:
        config = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
        config["SPLIT_K"] = _splits(layout, m, n)
        out.append(config)
    return out


def configs(program):
    """CONFIGS, those that fit the product's shape first (see ``_fit``), capped at
    MAX_TUNED_CONFIGS when tuned; SPLIT_CONFIGS for a product that splits its K."""
    if splits_k(program):
        return _split_configs(program)
    fixed_n = dot_block(program.product_layout.n) if program.product_layout.epilogue_reduces else None
    out = []
    for m, n, k, warps, stages in CONFIGS:
        config = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
        if fixed_n is not None:
            config.pop("BLOCK_N")
            if fixed_n * m > 128 * 256:
                continue
        if config not in out:
            out.append(config)
    fewest = min(_columns(program.product_layout, config)[1] for config in out)
    return sorted(out, key=lambda config: _fit(program.product_layout, config, fewest))


#: Each product config tuned is a Triton compile; tuning times the first this many valid
#: configs of the sorted list, among which the zoo's product winners were (BENCHMARKS.md,
#: Tuning lists).
MAX_TUNED_CONFIGS = 6


#: Tiles computing up to this many times the fewest columns any listed tile computes are
#: equally good on that count (n=200: 224 columns in 32-wide tiles, 256 in 128-wide ones).
PADDING_SLACK = 1.25


def _columns(layout: MatmulLayout, config: dict) -> tuple[int, int]:
    """Tiles across a row of the output, and the columns they compute (padding included)."""
    block_n = config.get("BLOCK_N") or dot_block(layout.n)
    tiles = triton_cdiv(layout.n, block_n)
    return tiles, tiles * block_n


def _fit(layout: MatmulLayout, config: dict, fewest: int) -> tuple[float, int, int]:
    """Sort key, smaller first: the columns the tiles compute against the fewest any tile
    computes, past PADDING_SLACK (an output of 1 column wants 32-wide tiles, not 128); where
    the rows of A are streamed through a norm's statistics, the tiles across a row (each
    reads every row of its block once per statistics pass and once for the product, so
    fewer, wider tiles read less); then how far the tiles fall short of one per SM (a product
    of 884 rows wants small tiles: fewer tiles than multiprocessors leave part of the chip
    idle). Ties keep CONFIGS' order."""
    tiles, columns = _columns(layout, config)
    padding = columns / fewest if columns > PADDING_SLACK * fewest else 0.0
    rereads = tiles if layout.prologue_reduces and not layout.resident else 0
    programs = triton_cdiv(layout.rows, config["BLOCK_M"]) * tiles * layout.batch
    return padding, rereads, max(0, multiprocessors() - programs)


def is_valid(program, config):
    layout = program.product_layout
    block_n = config.get("BLOCK_N") or dot_block(layout.n)
    element = 2 if layout.operand_dtype is not None else 4
    resident = layout.resident
    block_k = layout.block_k or config["BLOCK_K"]
    if layout.b_packed is not None and block_k % layout.b_packed.block:
        return f"BLOCK_K {block_k} is not a multiple of the quantised weight's block of {layout.b_packed.block}"
    smem = (config["BLOCK_M"] + block_n) * block_k * element * (1 if resident else config.get("num_stages", 2))
    limit = device_limits().shared_memory_per_block
    if smem > limit:
        return f"{smem // 1024} KiB of shared memory for the pipelined tiles exceeds {limit // 1024} KiB"
    if config["BLOCK_M"] * block_n / (32 * config["num_warps"]) > ACC_PER_THREAD:
        return "too many accumulators per thread"
    if not resident and config["BLOCK_K"] > max(16, next_power_of_2(layout.k)):
        return "BLOCK_K larger than K"
    return None


def default_config(program):
    if splits_k(program):
        return _split_configs(program)[1]
    layout = program.product_layout
    block_k = 32 if layout.k >= 32 or layout.b_packed is not None else 16
    if layout.b_packed is not None:
        block_k = max(block_k, layout.b_packed.block)
    config = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": block_k, "GROUP_M": 8, "num_warps": 4}
    if layout.rows <= 16 and layout.n >= 1024:
        # A few rows by many columns (a 1x1 convolution to a few channels): wide column tiles.
        config.update(BLOCK_M=16, BLOCK_N=128)
    if layout.epilogue_reduces:
        config.pop("BLOCK_N")
    return config


def generate(program, helpers):
    return write_matmul_kernel(program, "matmul", helpers, split=splits_k(program))


def _strategy(name, description):
    def propose(view):
        return [group for group in view.space_groups() if _classify(view, group) == name]

    return StrategySpec(
        name=name,
        description=description,
        block_params=("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"),
        propose=propose,
        accepts=accepts,
        configs=configs,
        is_valid=is_valid,
        max_tuned_configs=MAX_TUNED_CONFIGS,
        default_config=default_config,
        generate=generate,
        split_rules=(NORM_APART,),  # one product: only a norm in front of it can go apart
        dynamic_sizes=True,  # the rows (M) may vary: a run-time size; K and N are weights' sizes
        # Every output is an epilogue value written from the product's tile, the product's
        # own result (saved for backward) included.
        writes_saved_outputs=True,
    )


STRATEGIES = [
    _strategy("matmul", "A matrix product alone: 2-D tiles, K loop, grouped launch order."),
    _strategy("linear_epilogue", "A product with its bias, pointwise chain, residual and column norm fused after it."),
    _strategy("layernorm_linear", "A product whose input rows are normalised in the kernel, with any epilogue."),
]
