"""Batch norm by the batch's statistics, with the activation after it, made one
``batch_norm_train.batch_norm_act`` call (this plugin's own kernels).

In training mode (or without running statistics) batch norm normalises by the
batch's own per-channel statistics and updates its running statistics in place:
no fused group may hold it, so eager ran it as cuDNN's batch norm followed by the
activation's own pass. This pass rewrites

- ``nn.BatchNorm1d/2d/3d`` (exactly those classes, no hooks, no parametrizations)
  called in training mode with a float momentum, or without running statistics;
- ``F.batch_norm(..., training=True)`` whose running statistics, if any, are the
  model's buffers;

together with the activation that is their only reader, if it is one the kernels
apply (``ReLU``, ``LeakyReLU``, exact ``GELU``, ``SiLU``, as modules, functions or
methods, in place or not: the batch norm's result is a fresh tensor nobody else
reads), into one call. That call updates the running statistics and counts
``num_batches_tracked`` as the module would. It leaves a batch norm alone when in
doubt:

- a cumulative average (``momentum=None``): its factor reads the batch count on the
  host;
- an input not of fp32, fp16 or bf16, of a rank the module refuses, with one value
  per channel (eager raises), or whose result is laid out otherwise than the call
  lays out its own (x's layout where x is dense: row-major, channels-last);
- parameters or statistics of another dtype than the input's or fp32;
- the module's running statistics read anywhere else in the graph, or the module
  called from elsewhere in it (a parent running as it is): the update's place in
  the order of the graph would matter.

``fuse(..., batch_norm_kernels=False)`` turns the pass off (``options.py``).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from autofuser import annotate_node
from autofuser.kernel import tensor_meta

from .batch_norm_kernels import result_strides
from .batch_norm_train import batch_norm_act
from .ops._common import FLOAT_DTYPES

MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: Ranks each module accepts (others raise in eager: left to it).
RANKS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}

#: Activation modules -> their name in ``batch_norm_kernels.ACTIVATIONS`` (LeakyReLU brings its slope).
ACTIVATION_MODULES = {nn.ReLU: "relu", nn.LeakyReLU: "leaky_relu", nn.GELU: "gelu", nn.SiLU: "silu"}
#: Activation functions and methods (``inplace=`` allowed, ``x.relu_()`` too).
ACTIVATION_FUNCTIONS = {
    F.relu: "relu",
    torch.relu: "relu",
    F.relu_: "relu",
    torch.relu_: "relu",
    F.leaky_relu: "leaky_relu",
    F.leaky_relu_: "leaky_relu",
    F.gelu: "gelu",
    F.silu: "silu",
}
ACTIVATION_METHODS = {"relu": "relu", "relu_": "relu"}
#: Parameters, with defaults, of the functions above that ``inspect`` can't read (builtins).
BUILTIN_PARAMETERS: dict[Any, tuple[tuple[str, Any], ...]] = {
    F.gelu: (("input", None), ("approximate", "none")),
    torch.relu: (("input", None),),
    torch.relu_: (("input", None),),
    F.relu_: (("input", None),),
    F.leaky_relu_: (("input", None), ("negative_slope", 0.01)),
}


def _bound(target: Any, node: torch.fx.Node) -> Optional[dict]:
    """``node``'s arguments by parameter name, defaults filled in; None where they don't bind."""
    if target in BUILTIN_PARAMETERS:
        parameters = BUILTIN_PARAMETERS[target]
        names = [name for name, _ in parameters]
        if len(node.args) > len(names) or any(k not in names[len(node.args) :] for k in node.kwargs):
            return None
        return {**dict(parameters), **dict(zip(names, node.args)), **node.kwargs}
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _activation(gm: torch.fx.GraphModule, node: torch.fx.Node, x: torch.fx.Node) -> Optional[tuple[str, float]]:
    """``(activation, slope)`` when ``node`` applies one the kernels know to ``x`` alone."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        name = ACTIVATION_MODULES.get(type(module))
        if name is None or node.args != (x,) or node.kwargs or hooked(module):
            return None
        if isinstance(module, nn.GELU) and module.approximate != "none":
            return None
        slope = float(module.negative_slope) if isinstance(module, nn.LeakyReLU) else 0.0
        if isinstance(module, nn.LeakyReLU) and module.inplace and slope < 0:
            return None  # eager's backward refuses an in-place leaky ReLU of negative slope: left to it
        return name, slope
    if node.op == "call_method" and node.target in ACTIVATION_METHODS:
        return (ACTIVATION_METHODS[str(node.target)], 0.0) if node.args == (x,) and not node.kwargs else None
    if node.op != "call_function" or node.target not in ACTIVATION_FUNCTIONS:
        return None
    bound = _bound(node.target, node)
    if bound is None or next(iter(bound.values()), None) is not x:
        return None
    if bound.get("approximate", "none") != "none":
        return None
    slope = bound.get("negative_slope", 0.0)
    if not _number(slope):
        return None
    if node.target is F.leaky_relu_ or (node.target is F.leaky_relu and bound.get("inplace")):
        if slope < 0:
            return None  # eager's backward refuses an in-place leaky ReLU of negative slope: left to it
    return ACTIVATION_FUNCTIONS[node.target], float(slope)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own, which a rewrite replacing its call would skip."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def _input_fits(x: Any, out: torch.fx.Node, ranks: tuple[int, ...]) -> bool:
    meta, out_meta = tensor_meta(x), tensor_meta(out)
    if meta is None or out_meta is None or meta.dtype not in FLOAT_DTYPES or len(meta.shape) not in ranks:
        return False
    per_channel = math.prod(meta.shape) // max(1, meta.shape[1])
    if per_channel < 2 or out_meta.dtype != meta.dtype:
        return False
    # The call's result must be laid out as the batch norm's was (later kernels read it so;
    # a dim of size 1 is never stepped along, whatever its stride).
    ours = result_strides(tuple(meta.shape), tuple(meta.stride))
    return all(a == b for a, b, size in zip(out_meta.stride, ours, meta.shape) if size != 1)


def _dtypes_fit(x_dtype: torch.dtype, tensors: list[Optional[torch.Tensor]]) -> bool:
    return all(t is None or t.dtype in (x_dtype, torch.float32) for t in tensors)


class _Rewrite:
    """What replaces one batch norm node: its input, where the call reads each tensor
    (weight, bias, running_mean, running_var, num_batches_tracked: a module path, or the
    graph value ``F.batch_norm`` was given), momentum and eps."""

    def __init__(self, node: torch.fx.Node, x: torch.fx.Node, momentum: float, eps: float):
        self.node, self.x, self.momentum, self.eps = node, x, momentum, eps
        self.tensors: dict[str, Any] = {}


def _module_rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[_Rewrite]:
    module = gm.get_submodule(str(node.target))
    if type(module) not in MODULES or hooked(module) or parametrize.is_parametrized(module):
        return None
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], torch.fx.Node):
        return None
    statistics = module.running_mean is not None and module.running_var is not None
    if not module.training and statistics:
        return None  # eval mode: the running statistics, lowered as a per-channel scale and shift
    x = node.args[0]
    if not _input_fits(x, node, RANKS[type(module)]):
        return None
    updates = module.training and module.track_running_stats and statistics
    if updates and not _number(module.momentum):
        return None  # None: a cumulative average, whose factor reads the batch count on the host
    rewrite = _Rewrite(node, x, float(module.momentum or 0.0), float(module.eps))
    names = ["weight", "bias"] + (["running_mean", "running_var", "num_batches_tracked"] if updates else [])
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor):
            rewrite.tensors[name] = f"{node.target}.{name}"
    floats = [module.weight, module.bias] + ([module.running_mean, module.running_var] if updates else [])
    return rewrite if _dtypes_fit(tensor_meta(x).dtype, floats) else None


def _buffer_path(gm: torch.fx.GraphModule, value: Any) -> Optional[str]:
    """The path of a get_attr node that reads a buffer of the model, else None."""
    if not isinstance(value, torch.fx.Node) or value.op != "get_attr":
        return None
    path = str(value.target)
    owner, _, name = path.rpartition(".")
    try:
        module = gm.get_submodule(owner) if owner else gm
    except AttributeError:
        return None
    return path if name in module._buffers else None


def _function_rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[_Rewrite]:
    bound = _bound(F.batch_norm, node)
    if bound is None or bound["training"] is not True or not isinstance(bound["input"], torch.fx.Node):
        return None
    x = bound["input"]
    if not _input_fits(x, node, (2, 3, 4, 5)) or not (_number(bound["momentum"]) and _number(bound["eps"])):
        return None
    stats = bound["running_mean"], bound["running_var"]
    if (stats[0] is None) != (stats[1] is None):
        return None
    if stats[0] is not None and not all(_buffer_path(gm, s) for s in stats):
        return None  # statistics that are not the model's buffers (an input, a computed value)
    rewrite = _Rewrite(node, x, float(bound["momentum"]), float(bound["eps"]))
    channels = tensor_meta(x).shape[1]
    for name in ("weight", "bias", "running_mean", "running_var"):
        arg = bound[name]
        if arg is None:
            continue
        meta = tensor_meta(arg)
        if meta is None or tuple(meta.shape) != (channels,) or meta.dtype not in (tensor_meta(x).dtype, torch.float32):
            return None
        rewrite.tensors[name] = arg
    return rewrite


def _read_elsewhere(gm: torch.fx.GraphModule, rewrite: _Rewrite, rewrites: list[_Rewrite]) -> bool:
    """Whether another node reads the state this call updates (its running statistics)."""
    mine = {r.node for r in rewrites}
    updated = {
        v if isinstance(v, str) else _buffer_path(gm, v)
        for k, v in rewrite.tensors.items()
        if k in ("running_mean", "running_var", "num_batches_tracked")
    }
    updated.discard(None)
    if not updated:
        return False
    for node in gm.graph.nodes:
        if node in mine:
            continue
        if node.op == "get_attr" and node.target in updated and not all(u in mine for u in node.users):
            return True
        if node.op == "call_module":
            target = str(node.target)
            if any(path == target or path.startswith(target + ".") for path in updated):
                return True
    return False


def read_tensor(gm: torch.fx.GraphModule, where: Any, before: torch.fx.Node) -> Any:
    """A graph value for ``where``: itself where it is one, else a new ``get_attr`` of the
    parameter or buffer of that path, before ``before``."""
    if not isinstance(where, str):
        return where  # a graph value already (F.batch_norm's arguments)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(where)
    annotate_node(node, gm.get_parameter(where) if _is_parameter(gm, where) else gm.get_buffer(where))
    return node


def _is_parameter(gm: torch.fx.GraphModule, path: str) -> bool:
    owner, _, name = path.rpartition(".")
    return name in gm.get_submodule(owner)._parameters


def rewrite_batch_norms(gm: torch.fx.GraphModule) -> int:
    """Rewrite each batch norm by the batch's statistics, with the activation that is its
    only reader, into one ``batch_norm_act`` call (module doc); returns how many."""
    rewrites, rewritten = [], 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), MODULES):
            rewrite = _module_rewrite(gm, node)
        elif node.op == "call_function" and node.target is F.batch_norm:
            rewrite = _function_rewrite(gm, node)
        else:
            continue
        if rewrite is not None:
            rewrites.append(rewrite)
    rewrites = [r for r in rewrites if not _read_elsewhere(gm, r, rewrites)]
    for planned in rewrites:
        # Read again now: an earlier rewrite may have replaced this one's input (its activation).
        rewrite = (_module_rewrite if planned.node.op == "call_module" else _function_rewrite)(gm, planned.node)
        if rewrite is None:
            continue
        node, last = rewrite.node, rewrite.node
        activation, slope = "none", 0.0
        users = list(node.users)
        if len(users) == 1:
            found = _activation(gm, users[0], node)
            if found is not None:
                (activation, slope), last = found, users[0]
        tensors = {name: read_tensor(gm, where, node) for name, where in rewrite.tensors.items()}
        args = (
            rewrite.x,
            *(tensors.get(name) for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")),
            rewrite.momentum,
            rewrite.eps,
            activation,
            slope,
        )
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(batch_norm_act, args)
        call.meta = dict(last.meta)
        call.meta["tensor_meta"] = last.meta.get("tensor_meta", node.meta.get("tensor_meta"))
        last.replace_all_uses_with(call)
        if last is not node:
            gm.graph.erase_node(last)
        gm.graph.erase_node(node)
        rewritten += 1
    return rewritten
