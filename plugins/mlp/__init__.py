"""Whole MLP blocks: ``linear -> activation -> linear`` (+ the layer norm before
and the bias, residual and norm after) in one kernel, the hidden activation
never written to memory; and row-tiled chains of several products, norms and
softmaxes (``chain.py``) at the narrow widths PDE transformers use."""

from autofuser import hookimpl

from .chain import CHAIN_STRATEGY
from .mlp_layout import MLP_LAYOUT
from .strategy import MLP_STRATEGY


@hookimpl
def autofuser_register_product_layouts(register):
    register(MLP_LAYOUT)


@hookimpl
def autofuser_register_strategies(register):
    register(MLP_STRATEGY)
    register(CHAIN_STRATEGY)
