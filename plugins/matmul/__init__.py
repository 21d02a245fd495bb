"""Matrix products (nn.Linear, F.linear, matmul, @, mm, bmm, addmm, baddbmm, einsum of two real operands)
and the strategies that fuse them with what comes before and after: matmul,
linear + epilogue, layer norm + linear; the layout of a group with one product
(``layout.py``) and its kernel writer (``kernel.py``); whole MLP blocks and
chains of products (``mlp/``). A graph pass writes each einsum that is no plain
matrix product as views around ``torch.matmul`` (``einsum_rewrite.py``)."""

from autofuser import collect_specs, hookimpl

from . import ops
from .autocast import make_autocast_casts_explicit
from .einsum_rewrite import rewrite_einsums_as_products
from .layout import PRODUCT_LAYOUT
from .mlp import CHAIN_STRATEGY, MLP_LAYOUT, MLP_STRATEGY
from .reshape_fold import fold_double_permutes, fold_flattened_products
from .strategy import STRATEGIES


@hookimpl
def autofuser_transform_graph(gm, options):
    rewrite_einsums_as_products(gm)
    fold_double_permutes(gm)
    fold_flattened_products(gm)
    make_autocast_casts_explicit(gm)


@hookimpl
def autofuser_register_lowerings(register):
    for spec in collect_specs(ops):
        register(spec)


@hookimpl
def autofuser_register_product_layouts(register):
    register(PRODUCT_LAYOUT)
    register(MLP_LAYOUT)


@hookimpl
def autofuser_register_strategies(register):
    for strategy in (*STRATEGIES, MLP_STRATEGY, CHAIN_STRATEGY):
        register(strategy)
