"""The MLP strategy: ``linear -> pointwise -> linear`` (with a layer norm before,
bias/residual/norm after) as one kernel in which the hidden activation is made
``BLOCK_H`` columns at a time and consumed by the second product at once, so
it never reaches memory. Its groups are those the generic composition lays out
as MLPs (``mlp_layout``, registered as the layout of two-product groups); the
kernel is ``mlp_kernel.write_mlp_kernel``."""

from __future__ import annotations

from autofuser import GroupRefused, StrategySpec, device_limits
from autofuser.kernel import all_values, dot_block, triton_cdiv

from ..layout import multiprocessors
from ..split import FEWER_PRODUCTS, FEWER_PRODUCTS_NORM_APART, NORM_APART
from .mlp_kernel import write_mlp_kernel
from .mlp_layout import PERSISTENT_BLOCK_H, MlpLayout

#: One program holds a whole row of the second product: its width is bounded.
MAX_OUT_WIDTH = 256
REGS_PER_THREAD = 192  # fp32 values (acc2, acc1, resident rows of A) per thread before spills

CONFIGS = [
    # (BLOCK_M, BLOCK_H, BLOCK_K, num_warps, num_stages); BLOCK_K is fixed to K when A's rows stay on chip
    (64, 64, 64, 8, 2),
    (64, 32, 32, 4, 2),
    (128, 64, 32, 8, 2),
    (32, 64, 32, 4, 2),
    (64, 64, 32, 8, 3),
    (128, 32, 32, 8, 2),
    (32, 32, 32, 4, 3),
    (64, 128, 64, 8, 2),
    (32, 128, 64, 8, 2),
    # Taller row blocks: every program reads both weight matrices once, so at narrow
    # widths (where the weights, not the activations, are most of each program's
    # reads) more rows per program means proportionally less weight traffic.
    (128, 64, 64, 8, 3),
    (128, 128, 64, 8, 2),
    (128, 64, 32, 4, 3),
    (256, 32, 32, 8, 2),
]


#: The persistent form's configs, (BLOCK_M, num_warps, num_stages), listed first where it
#: exists: its best beat the best of CONFIGS where it was measured (BENCHMARKS.md,
#: "Measurements behind rules in the code").
PERSISTENT_CONFIGS = [(128, 8, 3), (128, 8, 2), (64, 4, 3), (64, 4, 2), (128, 8, 1)]
#: What a config of the streamed form adds where the kernel also has the persistent one.
STREAMED = {"PERSISTENT": 0, "PROGRAMS": 1, "SPLIT_TAIL": 0}


#: The fewest rows of a half block: below 64, a warp group's products are no longer
#: ``wgmma`` (64 rows at least) but the older form, which wants the weights laid out
#: otherwise in shared memory - a second copy of both, more than a multiprocessor has (the
#: sizes Triton 3.6 compiled for an H200: BENCHMARKS.md, "Measurements behind rules in the
#: code").
SPLIT_MIN_ROWS = 64


def split_tail(rows: int, block_m: int, programs: int) -> bool:
    """Whether the persistent form's last round is shorter as half row blocks.

    The form's programs walk row blocks ``tile, tile + PROGRAMS, ...``. Where the blocks
    are not a multiple of the programs, the last round keeps some programs busy for a
    whole block while the others are done: at 90168 rows, 705 blocks of 128 on 132
    programs take 6 rounds, the 6th with 45 blocks. Split, the programs first walk the
    whole rounds (5), then the rest as half blocks (89 of 64 rows): one round of half
    length (BENCHMARKS.md, "Measurements behind rules in the code": Split tail). Split
    where the half blocks take a single round (more would take as long as a whole round,
    with smaller products), there are whole rounds, and the half blocks have
    ``SPLIT_MIN_ROWS``."""
    half = block_m // 2
    whole = rows // block_m // programs * programs
    rest = rows - whole * block_m
    return half >= SPLIT_MIN_ROWS and whole > 0 and 0 < triton_cdiv(rest, half) <= programs


def propose(view):
    found = []
    for group in view.space_groups():
        if "matmul" not in view.kinds(group):
            continue
        try:
            program = view.compose(group)
        except GroupRefused:
            continue
        if isinstance(program.product_layout, MlpLayout):
            found.append(group)
    return found


def accepts(program):
    layout = program.product_layout
    if not isinstance(layout, MlpLayout):
        return ("not_an_mlp", "the group is not two products with pointwise ops between them")
    if layout.n > MAX_OUT_WIDTH:
        return ("too_wide", f"the second product is {layout.n} wide; one program holds at most {MAX_OUT_WIDTH}")
    return None


def configs(program):
    listed = [
        {"BLOCK_M": m, "BLOCK_H": h, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}
        for m, h, k, warps, stages in CONFIGS
    ]
    if not program.product_layout.persistent:
        return listed
    # one program per multiprocessor; 4 on a CPU, so the interpreter walks several row blocks
    programs = multiprocessors(without_gpu=4)
    # (BLOCK_K is a placeholder: the persistent form keeps A's rows on chip, and the kernel's
    # own BLOCK_K, the whole padded K, replaces it at launch)
    rows = program.product_layout.rows
    persistent = []
    for m, warps, stages in PERSISTENT_CONFIGS:
        config = {
            "BLOCK_M": m,
            "BLOCK_H": PERSISTENT_BLOCK_H,
            "BLOCK_K": 64,
            "num_warps": warps,
            "num_stages": stages,
            "PERSISTENT": 1,
            "PROGRAMS": programs,
            "SPLIT_TAIL": 1,
        }
        # Split where it shortens the last round and still fits (else the config as it was).
        if not split_tail(rows, m, programs) or is_valid(program, config) is not None:
            config["SPLIT_TAIL"] = 0
        persistent.append(config)
    return persistent + [{**config, **STREAMED} for config in listed]


def is_valid(program, config):
    layout = program.product_layout
    block_n = dot_block(layout.n)
    threads = 32 * config["num_warps"]
    resident = layout.resident
    block_k = layout.block_k or config["BLOCK_K"]
    for packed, block, name in (
        (layout.w1_packed, block_k, "BLOCK_K"),
        (layout.w2_packed, config["BLOCK_H"], "BLOCK_H"),
    ):
        if packed is not None and block % packed.block:
            return f"{name} {block} is not a multiple of the quantised weight's block of {packed.block}"
    held = config["BLOCK_M"] * (block_n + config["BLOCK_H"] + (block_k if resident else 0))
    if held / threads > REGS_PER_THREAD:
        return "too many values held per thread (accumulators and resident rows)"
    if config.get("PERSISTENT"):
        # A's row blocks are pipelined as stored: fp32 activations under autocast take twice the room.
        smem = layout.weight_bytes + config["BLOCK_M"] * block_k * _a_bytes(program) * config["num_stages"]
        if config.get("SPLIT_TAIL") and config["BLOCK_M"] // 2 < SPLIT_MIN_ROWS:
            return (
                f"half row blocks of {config['BLOCK_M'] // 2} rows run their products in another "
                "instruction form, which holds both weights again"
            )
        block_limit = device_limits().shared_memory_per_block_max
        if smem > block_limit:
            return (
                f"{smem // 1024} KiB of shared memory (both weights, pipelined rows) exceeds {block_limit // 1024} KiB"
            )
        return None
    element = 2 if layout.operand_dtypes[0] is not None else 4
    smem = (config["BLOCK_M"] + config["BLOCK_H"]) * block_k * element * config["num_stages"]
    smem += config["BLOCK_H"] * block_n * element + config["BLOCK_M"] * config["BLOCK_H"] * element
    limit = device_limits().shared_memory_per_block
    if smem > limit:
        return f"{smem // 1024} KiB of shared memory exceeds {limit // 1024} KiB"
    return None


def _a_bytes(program) -> int:
    """Bytes per element of the tensors the first product's rows are read from."""
    layout = program.product_layout
    loads = [
        program.inputs[program.input_of_load[v.uid]].dtype
        for v in all_values(program)
        if v.op == "load" and v.uid in layout.prologue
    ]
    return max((d.itemsize for d in loads), default=2)


def default_config(program):
    layout = program.product_layout

    def block(size, packed):
        return max(32 if size >= 32 else 16, packed.block if packed is not None else 0)

    config = {
        "BLOCK_M": 32,
        "BLOCK_H": block(layout.h, layout.w2_packed),
        "BLOCK_K": block(layout.k, layout.w1_packed),
        "num_warps": 4,
    }
    return {**config, **STREAMED} if layout.persistent else config


def generate(program, helpers):
    return write_mlp_kernel(program, "mlp", helpers)


MLP_STRATEGY = StrategySpec(
    name="mlp",
    description="linear -> pointwise -> linear with the hidden activation kept on chip, norms and residuals around it.",
    block_params=("BLOCK_M", "BLOCK_H", "BLOCK_K"),
    propose=propose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    default_config=default_config,
    generate=generate,
    # Timed against its products apart, then also its norm apart, then only its norm apart.
    split_rules=(FEWER_PRODUCTS, FEWER_PRODUCTS_NORM_APART, NORM_APART),
    dynamic_sizes=True,  # the rows may vary: a run-time size
    # Its outputs are the second product's epilogue values, that product's own result (saved
    # for backward) included; the hidden activation is never an output (``lay_out_mlp``).
    writes_saved_outputs=True,
)
