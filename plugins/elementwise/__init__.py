"""Pointwise ops (arithmetic, activations, casts, where, clamp, ...) and the
elementwise strategy, which fuses same-shaped chains of them into one kernel; graph
passes make in-place activations functional where no one can tell (`inplace.py`) and
read an unbind's parts as selects (`unbind.py`)."""

from autofuser import collect_specs, hookimpl

from . import ops
from .inplace import make_inplace_activations_functional
from .ops.expand import expand_result_leaves
from .ops.select import select_result_leaves
from .strategy import ELEMENTWISE_STRATEGY
from .unbind import unbind_as_selects


@hookimpl
def autofuser_register_lowerings(register):
    for spec in collect_specs(ops):
        register(spec)


@hookimpl
def autofuser_register_strategies(register):
    register(ELEMENTWISE_STRATEGY)


@hookimpl
def autofuser_transform_graph(gm, options):
    make_inplace_activations_functional(gm)
    unbind_as_selects(gm)


@hookimpl
def autofuser_veto_fusion(group, options):
    return expand_result_leaves(group.nodes) or select_result_leaves(group.nodes)
