"""Reductions (sum, mean, amax, var), softmax, log-softmax, layer norm and RMS
norm; the row-reduction strategy, which fuses them with the pointwise ops
before and after, and the split reduction, which takes rows too long for one
program."""

from autofuser import collect_specs, hookimpl

from . import ops
from .native_norm import decompose_native_layer_norms
from .split import SPLIT_REDUCTION_STRATEGY
from .strategy import ROW_REDUCTION_STRATEGY


@hookimpl
def autofuser_transform_graph(gm, options):
    decompose_native_layer_norms(gm)


@hookimpl
def autofuser_register_lowerings(register):
    for spec in collect_specs(ops):
        register(spec)


@hookimpl
def autofuser_register_strategies(register):
    register(ROW_REDUCTION_STRATEGY)
    register(SPLIT_REDUCTION_STRATEGY)
