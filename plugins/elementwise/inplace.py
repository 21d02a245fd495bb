"""In-place activations on a value nothing else reads, made functional.

``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``, ``x.relu_()``,
``torch.sigmoid_(x)``... write into their input, so the planner treats them as
mutations: barriers no group may hold or straddle. Solver code uses them to
save memory, and each one splits the chain around it into two kernels.

Where the overwritten tensor is a fresh result that nothing but the in-place
op reads, no one can tell the write from a new tensor: ``y = x.relu_()`` and
``y = torch.relu(x)`` give the same values to every later reader. This pass
rewrites exactly those into the functional op, which the elementwise lowerings
fuse. It leaves the op alone when in doubt:

- the input has another reader (a residual ``x + x.relu_()``, a later use of
  ``x`` that sees the overwritten value): the write is observable;
- the input is not known to be a fresh tensor: a graph input, a parameter, a
  view or an op that may return its input itself (``x.float()`` on fp32,
  dropout in eval) - the write would reach another tensor. Only the producers
  listed in ``FRESH_*`` below count as fresh;
- the in-place module has hooks (they must run as registered).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Optional

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

#: In-place functions and methods -> their functional form (same arguments).
INPLACE_FUNCTIONS = {
    torch.relu_: torch.relu,
    F.relu_: F.relu,
    torch.sigmoid_: torch.sigmoid,
    torch.tanh_: torch.tanh,
    F.leaky_relu_: F.leaky_relu,
    F.elu_: F.elu,
}
INPLACE_METHODS = {"relu_": "relu", "sigmoid_": "sigmoid", "tanh_": "tanh"}
#: Functions with an ``inplace`` flag: the same call without it is functional.
INPLACE_FLAG_FUNCTIONS = (F.relu, F.silu, F.leaky_relu, F.elu)

#: Producers whose result is a new tensor on every call, never their input or a view of it.
FRESH_MODULES = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
FRESH_FUNCTIONS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    operator.matmul,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.matmul,
    torch.bmm,
    torch.einsum,
    F.linear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.layer_norm,
    F.group_norm,
    F.batch_norm,
    F.instance_norm,
}
FRESH_METHODS = {"add", "sub", "mul", "div", "matmul", "__add__", "__sub__", "__mul__", "__truediv__", "__matmul__"}
#: Activations are fresh too unless called with ``inplace=True`` (then they return their
#: input): so a chain of in-place ones (``relu`` then ``sigmoid_``) is rewritten in order.
FRESH_ACTIVATIONS = {torch.relu, F.relu, F.silu, F.gelu, F.leaky_relu, F.elu, torch.sigmoid, torch.tanh}
FRESH_ACTIVATION_METHODS = {"relu", "sigmoid", "tanh"}


def _module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[nn.Module]:
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def _is_fresh(gm: torch.fx.GraphModule, node: Any) -> bool:
    """Whether ``node`` computes a new tensor (see ``FRESH_*``), one with tensor metadata."""
    if not isinstance(node, torch.fx.Node) or not hasattr(node.meta.get("tensor_meta"), "shape"):
        return False
    if node.op == "call_module":
        return type(_module(gm, node)) in FRESH_MODULES
    if node.op == "call_function":
        if node.target in FRESH_ACTIVATIONS:
            return not _inplace_flag(node.target, node)
        return node.target in FRESH_FUNCTIONS
    if node.op == "call_method":
        return node.target in FRESH_METHODS or node.target in FRESH_ACTIVATION_METHODS
    return False


def _inplace_flag(target: Any, node: torch.fx.Node) -> bool:
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return True  # arguments it can't read: treated as in place, the safe side
    return bound.arguments.get("inplace") is True


def _without_inplace(target: Any, node: torch.fx.Node) -> tuple[tuple, dict]:
    bound = inspect.signature(target).bind(*node.args, **node.kwargs)
    bound.arguments.pop("inplace", None)
    return tuple(bound.args), dict(bound.kwargs)


def _functional_form(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[tuple[str, Any, tuple, dict]]:
    """``(op, target, args, kwargs)`` of the functional node replacing ``node``, or ``None``
    when ``node`` is not an in-place activation this pass knows."""
    if node.op == "call_function" and node.target in INPLACE_FUNCTIONS:
        return "call_function", INPLACE_FUNCTIONS[node.target], tuple(node.args), dict(node.kwargs)
    if node.op == "call_function" and node.target in INPLACE_FLAG_FUNCTIONS and _inplace_flag(node.target, node):
        return ("call_function", node.target, *_without_inplace(node.target, node))
    if node.op == "call_method" and node.target in INPLACE_METHODS:
        return "call_method", INPLACE_METHODS[str(node.target)], tuple(node.args), dict(node.kwargs)
    module = _module(gm, node)
    if module is None or getattr(module, "inplace", False) is not True or len(node.args) != 1 or node.kwargs:
        return None
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    x = node.args[0]
    if type(module) is nn.ReLU:
        return "call_function", F.relu, (x,), {}
    if type(module) is nn.SiLU:
        return "call_function", F.silu, (x,), {}
    if type(module) is nn.LeakyReLU:
        return "call_function", F.leaky_relu, (x, float(module.negative_slope)), {}
    if type(module) is nn.ELU:
        return "call_function", F.elu, (x, float(module.alpha)), {}
    return None


def make_inplace_activations_functional(gm: torch.fx.GraphModule) -> int:
    """Rewrite each in-place activation whose input is a fresh tensor read by nothing
    else into its functional form (module doc); returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        form = _functional_form(gm, node)
        if form is None or not node.args:
            continue
        x = node.args[0]
        if not _is_fresh(gm, x) or set(x.users) != {node}:
            continue
        op, target, args, kwargs = form
        with gm.graph.inserting_before(node):
            functional = gm.graph.create_node(op, target, args, kwargs, name=f"{node.name}_functional")
        functional.meta = dict(node.meta)
        node.replace_all_uses_with(functional)
        gm.graph.erase_node(node)
        rewritten += 1
    return rewritten
