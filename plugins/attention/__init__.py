"""Softmax attention without the N x N scores: ``F.scaled_dot_product_attention``
and the same computation written out (``softmax(q @ k^T * scale + mask) @ v``,
``einsum`` products too) as one online-softmax Triton kernel.

- ``ops/``: one lowering per op (``attention.sdpa``);
- ``match.py``: finding both forms in a graph and reading them into an
  ``AttentionLayout`` (``layout.py``), or refusing with a reason;
- ``strategy.py``: the ``softmax_attention`` strategy (its own compose,
  configs, validity rule);
- ``kernel.py``: the kernel writer.
"""

from autofuser import hookimpl
from autofuser_core.oplib import collect_specs

from . import ops
from .strategy import ATTENTION_STRATEGY, LINEAR_STRATEGY, SLICE_STRATEGY


@hookimpl
def autofuser_register_lowerings(register):
    for spec in collect_specs(ops):
        register(spec)


@hookimpl
def autofuser_register_strategies(register):
    register(ATTENTION_STRATEGY)
    register(LINEAR_STRATEGY)
    register(SLICE_STRATEGY)
