"""With gradients on, the bias of a convolution cuDNN runs as an add after it.

Eager's convolution backward sums the output's gradient over batch and space for
the bias's gradient: a reduction of its own per convolution, over a
channels-last gradient a strided one (in bf16 under autocast). Added after the
convolution, the bias joins the group of pointwise ops around the result, and
that group's fused backward takes the bias's gradient as a column sum beside
the gradients it reads the same values for; cuDNN runs the product alone.

Rewritten, in a graph compiled with gradients on (``GRADIENTS_KEY``):
``nn.Conv1d/2d/3d`` (torch's own forward, no hooks, no parametrizations, zero
padding) and ``F.conv1d/2d/3d`` with a bias that requires a gradient, which the
implicit-GEMM strategy leaves to cuDNN (``implicit_gemm_takes`` false) and which
are not 1x1 products (those the matmul strategies fuse with their bias). The
new ``F.conv*d`` reads the same weight without bias; the bias is cast to the
result's dtype, as autocast's convolution casts it, viewed per channel and
added. Under 16-bit autocast the result is then rounded twice (the product,
then the sum) where cuDNN rounds once: within one unit of the last place.

``fuse(..., conv_bias_apart=False)`` turns the pass off (``options.py``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.nn.utils import parametrize

from autofuser import annotate_node
from autofuser.kernel import tensor_meta

from .batch_norm_pass import hooked, read_tensor
from .convolution import FUNCTIONS, MODULES, AttrRef, implicit_gemm_takes, parse_conv
from .ops.conv import FUNCTIONS as BY_RANK


def _hooked(module: torch.nn.Module) -> bool:
    """Its own hooks (``batch_norm_pass.hooked``) or global forward hooks, which a call of
    ``F.conv*d`` in the module's place would skip."""
    hooks = torch.nn.modules.module
    return hooked(module) or bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _bias_wants_gradient(gm: torch.fx.GraphModule, bias: Any) -> bool:
    if isinstance(bias, AttrRef):
        return bool(gm.get_parameter(bias.path).requires_grad)
    meta = tensor_meta(bias)
    return meta is not None and bool(meta.requires_grad)


def _apart(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite one convolution as the module docstring says; whether it did."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if type(module) not in MODULES or _hooked(module) or parametrize.is_parametrized(module):
            return False
        if module.padding_mode != "zeros":
            return False
    elif node.op != "call_function" or node.target not in FUNCTIONS:
        return False
    conv = parse_conv(node, gm)
    meta = tensor_meta(node)
    if isinstance(conv, str) or conv.bias is None or meta is None or implicit_gemm_takes(conv):
        return False
    if all(k == 1 for k in conv.kernel) and all(s == 1 for s in conv.stride) and not any(conv.padding):
        return False  # a product: the matmul strategies fuse its bias already
    if not _bias_wants_gradient(gm, conv.bias):
        return False
    weight, bias = (
        read_tensor(gm, ref.path if isinstance(ref, AttrRef) else ref, node) for ref in (conv.weight, conv.bias)
    )
    bias_meta = tensor_meta(bias)
    if bias_meta is None or len(bias_meta.shape) != 1:
        return False
    rank = len(conv.kernel)
    graph = gm.graph
    with graph.inserting_before(node):
        product = graph.call_function(
            BY_RANK[rank], (conv.x, weight, None, conv.stride, conv.padding, conv.dilation, 1)
        )
        cast = graph.call_method("to", (bias, meta.dtype)) if bias_meta.dtype != meta.dtype else bias
        channels = (1, bias_meta.shape[0], *(1,) * rank)
        per_channel = graph.call_method("view", (cast, channels))
        total = graph.call_function(operator.add, (product, per_channel))
    result = torch.empty_strided(tuple(meta.shape), tuple(meta.stride), dtype=meta.dtype, device="meta")
    annotate_node(product, result.requires_grad_(bool(meta.requires_grad)))
    cast_value = torch.empty(tuple(bias_meta.shape), dtype=meta.dtype, device="meta").requires_grad_()
    if cast is not bias:
        annotate_node(cast, cast_value)
    annotate_node(per_channel, cast_value.view(channels), [cast_value])
    total.meta = {**node.meta, "tensor_meta": node.meta["tensor_meta"]}
    node.replace_all_uses_with(total)
    graph.erase_node(node)
    return True


def convolution_biases_apart(gm: torch.fx.GraphModule) -> int:
    """The rewrite of the module docstring over ``gm``; how many convolutions it rewrote."""
    return sum(_apart(gm, node) for node in list(gm.graph.nodes))
