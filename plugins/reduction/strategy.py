"""The row-reduction strategy: reductions over one set of dims, with the
pointwise ops before and after them, as one kernel in which every program holds
``BLOCK_M`` whole rows in registers (``BLOCK_R`` covers the reduced dims), so
softmax, layer norm and residual-add + norm read their input once."""

from __future__ import annotations

import math

from autofuser import StrategySpec
from autofuser.kernel import next_power_of_2, write_kernel

#: Elements one program may hold per live value before registers spill.
MAX_TILE = 16384
ROW_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8, 16)


def propose(view):
    # Groups with a product belong to the matmul and mlp strategies.
    return [
        group for group in view.space_groups() if "reduction" in view.kinds(group) and "matmul" not in view.kinds(group)
    ]


def accepts(program):
    if program.reduced_numel > MAX_TILE:
        return (
            "row_too_long",
            f"rows of {program.reduced_numel} elements exceed the single-pass limit of {MAX_TILE}",
        )
    return None


def _block_r(program):
    return next_power_of_2(program.reduced_numel)


#: What the config list puts first: about this many elements per thread per live value
#: (enough loads in flight to cover memory latency, few enough to keep registers), in
#: tiles of about this many elements.
PER_THREAD, TILE = 8, 2048


def _tile(program, config) -> tuple[int, float]:
    """A program's tile (elements per live value) and its elements per thread."""
    tile = config["BLOCK_M"] * _block_r(program)
    return tile, tile / (32 * config["num_warps"])


def configs(program):
    """Every row block and warp count, the most promising first: a re-planning round
    tunes only the first few (``tuning.LATER_ROUND_CONFIGS``), and one row per program
    on one warp (the old head of the list) left a wide layer norm well short of a copy
    of its bytes (BENCHMARKS.md, "Measurements behind rules in the code")."""

    def distance(config):
        tile, per_thread = _tile(program, config)
        return abs(math.log2(per_thread / PER_THREAD)), abs(math.log2(tile / TILE))

    return sorted(({"BLOCK_M": m, "num_warps": w} for m in ROW_BLOCKS for w in WARPS), key=distance)


def tile_refusal(program, block_m: int, block_r: int, num_warps: int, limit: int):
    """Why a ``block_m`` x ``block_r`` tile on ``num_warps`` warps does not suit ``program``
    (too large, too few or too many elements per thread, more rows than there are), or None."""
    tile = block_m * block_r
    per_thread = tile / (32 * num_warps)
    if tile > limit:
        return f"a {block_m} x {block_r} tile exceeds {limit} elements"
    if per_thread < 1:
        return "more threads than elements"
    if per_thread > 64:
        return f"{per_thread:.0f} elements per thread would spill registers"
    if block_m > 1 and block_m // 2 >= program.outer_numel:
        return "more rows per program than there are rows"
    return None


def is_valid(program, config):
    return tile_refusal(program, config["BLOCK_M"], _block_r(program), config["num_warps"], MAX_TILE)


def default_config(program):
    block_r = _block_r(program)
    block_m = max(1, min(64, 4096 // block_r, next_power_of_2(program.outer_numel)))
    tile = block_m * block_r
    warps = 1 if tile <= 256 else 2 if tile <= 1024 else 4 if tile <= 4096 else 8
    return {"BLOCK_M": block_m, "num_warps": warps}


def generate(program, helpers):
    return write_kernel(program, "rows", "row_reduction", helpers)


ROW_REDUCTION_STRATEGY = StrategySpec(
    name="row_reduction",
    description="Reductions over one set of dims with their pointwise prologue and epilogue, whole rows in registers.",
    block_params=("BLOCK_M",),
    propose=propose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    default_config=default_config,
    generate=generate,
    dynamic_sizes=True,  # write_kernel takes dynamic sizes at run time; BLOCK_R from their bucket
)
