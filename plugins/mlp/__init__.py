"""Whole MLP blocks: ``linear -> activation -> linear`` (+ the layer norm before
and the bias, residual and norm after) in one kernel, the hidden activation
never written to memory."""

from autofuser import hookimpl

from .strategy import MLP_STRATEGY


@hookimpl
def autofuser_register_strategies(register):
    register(MLP_STRATEGY)
