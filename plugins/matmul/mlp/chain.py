"""The row-tiled chain strategy: for the narrow widths transformer PDE solvers
use (64-256), one kernel keeps a block of rows on chip through a sequence of
linear, layer norm, softmax, pointwise and MLP steps - a transformer block's
post-attention part (``x + proj(attn) -> LN -> MLP -> + residual -> LN ->
next qkv``) in one pass over memory.

It claims the groups of two or more products that the MLP strategy can't lay
out (a norm or a softmax between products, three products or more); the
layout is ``chain_layout``, the kernel ``chain_kernel``.

Block sizes: ``BLOCK_M`` rows per program, and per product step ``i`` that
runs in chunks a chunk size ``BLOCK_S{i}`` (columns of a hidden or tail step,
K of a streamed one). The grid is one program per ``BLOCK_M`` rows.

Refused, with the reason in the report: a value held whole wider than
``MAX_ROW_WIDTH``; more than ``MAX_STEPS`` products (the chain is split into
shorter ones instead); shapes no config fits (registers, shared memory).
"""

from __future__ import annotations

import itertools

from autofuser import GroupRefused, StrategySpec, device_limits
from autofuser.kernel import MAX_PRODUCTS

from ..split import FEWER_PRODUCTS, FEWER_PRODUCTS_NORM_APART, NORM_APART
from .chain_kernel import write_chain_kernel
from .chain_layout import ChainLayout, lay_out_chain, padded
from .strategy import propose as propose_mlps

#: Widest value a program holds as a whole-row tile (a layer norm's row, a residual).
MAX_ROW_WIDTH = 256
#: Widest product made chunk by chunk (a hidden or tail step).
MAX_CHUNKED_WIDTH = 4096
#: Most products one chain kernel runs; longer sequences are split into chains of this many.
MAX_STEPS = 6
#: fp32 values per thread (whole-row tiles, accumulators, operands) before registers spill.
REGS_PER_THREAD = 160
CHUNKS = (64, 32, 128)
#: Triton 3.6 on sm_90 (H100): a chain with 16-bit products whose later product takes a
#: row operand computed in the kernel (the earlier product's result, held in registers)
#: read shared memory out of bounds with ``BLOCK_M`` 64 over 4 warps, one warp group of
#: 64 rows, with chunks of 32 and 64 and with 1 and 2 pipeline stages. An illegal memory
#: access leaves the CUDA context unusable, so the process can't even fall back to eager.
#: Every other ``BLOCK_M`` x ``num_warps`` of the same kernels ran
#: (``benchmarks/chain_fault_probe.py``; BENCHMARKS.md, "Measurements behind rules in the
#: code"). Such configs are not offered.
FAULTING_16BIT_BLOCK = (64, 4)  # (BLOCK_M, num_warps)


def _product_nodes(view, nodes) -> int:
    return sum(1 for n in nodes if n in view.lowering_of and view.lowering_of[n].kind == "matmul")


def _grow_chains(view, allowed, max_products: int) -> list[list]:
    """Groups grown (``PlanningView.grow_groups``) while the union still lays out as a
    chain with at most ``max_products`` products."""

    def compose_chain(union):
        if _product_nodes(view, union) > max_products:
            raise GroupRefused("too_many_steps", f"more than {max_products} products")
        view.compose(union, lay_out=lay_out_chain)

    return view.grow_groups(allowed, compose_chain)


def _packed(view, node) -> bool:
    """Whether ``node`` is lowered to a quantised weight (``ctx.packed_weight``)."""
    value = view.lowered.get(node)
    return value is not None and value.op == "load" and getattr(value, "packed", None) is not None


def propose(view):
    # Products over quantised weights stay with the product strategies, which decode them.
    allowed = {
        n
        for n in view.lowered
        if view.lowering_of[n].kind in ("pointwise", "reduction", "matmul", "layout")
        and not any(_packed(view, arg) for arg in n.all_input_nodes)
    }
    # A two-product chain that overlaps an MLP is left to the MLP strategy: its kernel keeps
    # the hidden activation on chip, where a chain cut at two products would write it out.
    in_mlps = {n for group in propose_mlps(view) for n in group}
    found = []
    for group in _grow_chains(view, allowed, MAX_PRODUCTS.get()):
        products = _product_nodes(view, group)
        if products < 2 or (products == 2 and in_mlps.intersection(group)):
            continue
        try:
            view.compose(group)
            continue  # one product, or an MLP: the matmul and mlp strategies' groups
        except Exception:  # refused (GroupRefused) or not one domain: a chain candidate
            pass
        found.append(group)
        if products > MAX_STEPS:
            # Refused as a whole (the report says why); its shorter chains are candidates.
            found.extend(g for g in _grow_chains(view, set(group), MAX_STEPS) if _product_nodes(view, g) >= 2)
    return found


def compose(view, nodes):
    program = view.compose(nodes, lay_out=lay_out_chain)
    layout: ChainLayout = program.product_layout
    steps = ", ".join(f"{s.mode if s.fed_by is None else 'accumulated'} {s.k}->{s.n}" for s in layout.steps)
    program.summary = f"row-tiled chain of {len(layout.steps)} products ({steps}), {layout.reductions} row reductions"
    return program


def accepts(program):
    layout = program.product_layout
    if not isinstance(layout, ChainLayout) or len(layout.steps) < 2:
        return ("not_a_chain", "the group does not have two or more products in row space")
    if len(layout.steps) > MAX_STEPS:
        return ("too_many_steps", f"{len(layout.steps)} products in one chain; one kernel runs at most {MAX_STEPS}")
    wide = [w for w in layout.row_widths if w > MAX_ROW_WIDTH]
    wide += [s.n for s in layout.steps if s.mode in ("whole", "streamed") and s.n > MAX_ROW_WIDTH]
    wide += [s.k for s in layout.steps if s.mode != "streamed" and s.fed_by is None and s.k > MAX_ROW_WIDTH]
    if wide:
        return (
            "too_wide",
            f"a row of {max(wide)} values would be held whole in one program "
            f"(limit {MAX_ROW_WIDTH}); only hidden and tail products may be wider",
        )
    chunked = [s.chunked_width for s in layout.steps if s.chunked and s.chunked_width > MAX_CHUNKED_WIDTH]
    if chunked:
        return ("too_wide", f"a product of width {max(chunked)} (limit {MAX_CHUNKED_WIDTH})")
    if not any(is_valid(program, c) is None for c in configs(program)):
        return ("no_config", f"no block sizes fit: {is_valid(program, default_config(program))}")
    return None


def _chunk_sizes(layout: ChainLayout, chunk: int, widest_step=None) -> dict[str, int]:
    return {
        f"BLOCK_S{s.index}": padded(s.chunked_width) if s.index == widest_step else min(chunk, padded(s.chunked_width))
        for s in layout.steps
        if s.chunked
    }


#: (BLOCK_M, chunk, num_warps) in the order tuning tries them: the configs that won most
#: often on the zoo's row chains (fp32 and bf16, H200; benchmarks/tuning_stats.py) first,
#: then the rest of BLOCK_M x num_warps x CHUNKS.
FIRST_CONFIGS = (
    (32, 64, 4),
    (64, 32, 4),
    (16, 64, 4),
    (32, 128, 8),
    (64, 64, 4),
    (32, 32, 4),
    (128, 64, 8),
    (128, 32, 8),
)
#: Chain kernels are large and slow to compile: tuning times the first this many valid
#: configs. Every winner the zoo's chains recorded is in FIRST_CONFIGS, and even the earlier
#: order lost little at this cap (BENCHMARKS.md, "Measurements behind rules in the code").
MAX_TUNED_CONFIGS = 8


def configs(program):
    layout: ChainLayout = program.product_layout
    out = []
    rest = ((m, c, w) for m, w, c in itertools.product((64, 32, 128, 16), (4, 8), CHUNKS))
    for block_m, chunk, warps in (*FIRST_CONFIGS, *rest):
        config = {"BLOCK_M": block_m, **_chunk_sizes(layout, chunk), "num_warps": warps, "num_stages": 2}
        if config not in out:
            out.append(config)
    # Each chunked step once over its whole width, the others at 64.
    for s in layout.steps:
        if s.chunked:
            for block_m in (64, 32):
                config = {"BLOCK_M": block_m, **_chunk_sizes(layout, 64, s.index), "num_warps": 8, "num_stages": 2}
                if config not in out:
                    out.append(config)
    return out


def is_valid(program, config):
    """Registers: the widest whole-row tiles held across a step plus its operands and
    accumulators; shared memory: each step's weight tile and its row operand."""
    layout: ChainLayout = program.product_layout
    block_m = config["BLOCK_M"]
    threads = 32 * config["num_warps"]
    if block_m < 16:
        return "BLOCK_M below 16 (tl.dot's smallest tile)"
    if (block_m, config["num_warps"]) == FAULTING_16BIT_BLOCK and any(
        s.operand_dtype is not None for s in layout.steps
    ):
        return (
            f"BLOCK_M {block_m} over {config['num_warps']} warps with 16-bit products reads shared memory "
            "out of bounds (Triton 3.6, sm_90)"
        )
    carried = max([padded(w) for w in layout.row_widths] + [0])
    worst_regs = worst_smem = 0
    for s in layout.steps:
        if s.fed_by is not None:
            continue  # accumulated chunk by chunk: counted with the hidden step that feeds it
        element = 2 if s.operand_dtype is not None else 4
        chunk = config.get(f"BLOCK_S{s.index}")
        if s.chunked:
            if chunk is None or chunk < 16 or chunk & (chunk - 1) or chunk > padded(s.chunked_width):
                return f"BLOCK_S{s.index} must be a power of two from 16 to {padded(s.chunked_width)}"
        pk, pn = padded(s.k), padded(s.n)
        if s.mode == "whole":
            live, weight, operand = pk + pn, pk * pn, block_m * pk
        elif s.mode == "streamed":
            live, weight, operand = chunk + pn, chunk * pn, block_m * chunk
        elif s.mode == "tail":
            live, weight, operand = pk + chunk, pk * chunk, block_m * pk
        else:  # hidden: its chunk, the consumer's accumulator and the consumer's weight chunk
            consumer = padded(s.consumer.shape[-1])
            live = pk + chunk + consumer
            weight, operand = pk * chunk + chunk * consumer, block_m * (pk + chunk)
        worst_regs = max(worst_regs, block_m * (live + carried))
        worst_smem = max(worst_smem, (weight + operand) * element)
    if worst_regs / threads > REGS_PER_THREAD:
        return f"{worst_regs // threads} values per thread (limit {REGS_PER_THREAD}): registers would spill"
    limit = device_limits().shared_memory_per_block
    if worst_smem > limit:
        return f"{worst_smem // 1024} KiB of shared memory for a step's tiles exceeds {limit // 1024} KiB"
    return None


def default_config(program):
    """The first valid of a few safe choices (used without tuning: the interpreter, ``tune=False``)."""
    layout: ChainLayout = program.product_layout
    choices = [
        {"BLOCK_M": m, **_chunk_sizes(layout, c), "num_warps": warps, "num_stages": 2}
        for m, warps, c in ((32, 4, 64), (32, 8, 64), (32, 8, 32), (16, 8, 32), (16, 8, 16))
    ]
    return next((c for c in choices if is_valid(program, c) is None), choices[0])


def generate(program, helpers):
    return write_chain_kernel(program, "row_chain", helpers)


CHAIN_STRATEGY = StrategySpec(
    name="row_chain",
    description="A block of rows kept on chip through a chain of linear, norm, softmax, pointwise and MLP steps.",
    block_params=("BLOCK_M",) + tuple(f"BLOCK_S{i}" for i in range(MAX_STEPS)),
    propose=propose,
    compose=compose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    max_tuned_configs=MAX_TUNED_CONFIGS,
    default_config=default_config,
    generate=generate,
    # As the MLP strategy's: shorter chains, then also its norms apart, then only its norms apart.
    split_rules=(FEWER_PRODUCTS, FEWER_PRODUCTS_NORM_APART, NORM_APART),
    dynamic_sizes=True,  # the rows may vary: a run-time size
    # A step's result that is an output is stored whole or chunk by chunk, as any output.
    writes_saved_outputs=True,
)
