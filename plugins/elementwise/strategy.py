"""The elementwise strategy: a same-domain chain of pointwise ops as one flat
kernel, each program handling ``BLOCK`` consecutive elements of the domain."""

from __future__ import annotations

from autofuser import StrategySpec
from autofuser.kernel import write_kernel

#: (BLOCK, num_warps) pairs tuned. A flat kernel is bound by memory; what matters is
#: the elements per thread (2 to 8 here) and the programs in flight. These six
#: were the most frequent winners among all fifteen pairs of 256-4096 x 2/4/8 warps
#: over the zoo's elementwise kernels on an H200 (36 of 53); each pair tuned is a
#: Triton compile, so the rest were dropped to keep a cold compile short.
CONFIGS = ((256, 4), (512, 4), (1024, 4), (512, 8), (1024, 8), (2048, 8))


def propose(view):
    return [group for group in view.space_groups() if view.kinds(group) == {"pointwise"}]


def accepts(program):
    if program.reduced_dims:
        return ("needs_reduction", "the group reduces; the row-reduction strategy serves it")
    return None


def configs(program):
    return [{"BLOCK": b, "num_warps": w} for b, w in CONFIGS]


def is_valid(program, config):
    per_thread = config["BLOCK"] // (32 * config["num_warps"])
    if per_thread < 1:
        return f"BLOCK {config['BLOCK']} leaves threads idle with {config['num_warps']} warps"
    if per_thread > 32:
        return f"{per_thread} elements per thread would spill registers"
    return None


def default_config(program):
    return {"BLOCK": 1024, "num_warps": 4}


def generate(program, helpers):
    return write_kernel(program, "flat", "elementwise", helpers)


ELEMENTWISE_STRATEGY = StrategySpec(
    name="elementwise",
    description="Same-shaped chains of pointwise ops, one flat kernel.",
    block_params=("BLOCK",),
    propose=propose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    default_config=default_config,
    generate=generate,
    dynamic_sizes=True,  # write_kernel takes dynamic sizes at run time
)
