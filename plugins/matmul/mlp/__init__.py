"""Whole MLP blocks: ``linear -> activation -> linear`` (+ the layer norm before
and the bias, residual and norm after) in one kernel, the hidden activation
never written to memory; and row-tiled chains of several products, norms and
softmaxes (``chain.py``) at the narrow widths PDE transformers use. Registered
by the matmul plugin, whose one-product layout and writer they build on."""

from .chain import CHAIN_STRATEGY
from .mlp_layout import MLP_LAYOUT
from .strategy import MLP_STRATEGY

__all__ = ["CHAIN_STRATEGY", "MLP_LAYOUT", "MLP_STRATEGY"]
