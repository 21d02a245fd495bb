"""Attention without its big intermediates, in four forms (``docs/attention.md``):

- softmax attention - ``F.scaled_dot_product_attention`` and the same written
  out (``softmax(q @ k^T * scale + mask) @ v``, einsum products too) - as one
  online-softmax Triton kernel that never writes the N x M scores;
- Galerkin-type linear attention ``q @ (LN(k)^T @ LN(v)) / n`` as a chain of
  split-N kernels, and Fourier-type ``(q @ k^T) @ v / n`` as written (or
  reassociated, with ``reassociate_products=True``);
- Transolver's slice attention as a chain of three kernels.

- ``ops/``: one lowering per op (``attention.sdpa``; the views inside slice
  attention);
- ``match.py``, ``linear.py``, ``slice.py``: finding each form in a graph and
  reading it into a layout (``layout.py``), or refusing with a reason;
- ``strategy.py``: the ``softmax_attention``, ``linear_attention`` and
  ``slice_attention`` strategies (their own compose, configs, validity rules);
- ``kernel.py``, ``linear_kernel.py``, ``slice_kernel.py``: the kernel writers
  (a chain of kernels is launched through ``autofuser.kernel.chain_module``);
- ``written_out.py``: a graph pass writing an exact written-out softmax
  attention as one ``flash_op.flash_attention`` call, whose traced backward
  never holds the scores;
- ``flash_op.py``, ``flash.py``: ``flash_attention``, two operators (the result
  with its log-sum-exp; the backward from them) and their flash kernels;
- ``options.py``: the plugin's ``fuse()`` option ``reassociate_products``.
"""

from autofuser import GRADIENTS_KEY, collect_specs, hookimpl

from . import ops
from .options import AttentionOptions
from .strategy import ATTENTION_STRATEGY, LINEAR_STRATEGY, SLICE_STRATEGY
from .written_out import rewrite_written_out_attention


@hookimpl
def autofuser_transform_graph(gm, options):
    rewrite_written_out_attention(gm, gradients=bool(gm.meta.get(GRADIENTS_KEY, False)))


@hookimpl
def autofuser_register_lowerings(register):
    for spec in collect_specs(ops):
        register(spec)


@hookimpl
def autofuser_register_options(register):
    register(AttentionOptions)


@hookimpl
def autofuser_register_strategies(register):
    register(ATTENTION_STRATEGY)
    register(LINEAR_STRATEGY)
    register(SLICE_STRATEGY)
