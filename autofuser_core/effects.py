"""What a call does besides computing its result: draw random numbers, or write into a
tensor it was given (an argument, or a module's own parameter or buffer); and so which
nodes are barriers the planner keeps where they are (``barrier_reason``).

Read from torch's own records, never from a list of ops: the tag
``torch.Tag.nondeterministic_seeded`` on an aten op, and the op's schema as
``torch._C._SchemaInfo`` reads it with the call's argument values (which knows, for
example, that a batch norm in training writes into its running statistics although its
schema does not mark them written).

- A call whose name is an aten op's (``torch.dropout``, ``x.add_``, ``F.batch_norm``,
  whose arguments are named as the op's) is judged from that op and its arguments,
  without running it.
- Another Python function of torch's (``_META_MODULES``: ``F.dropout2d``,
  ``F.fractional_max_pool2d``) whose code names an aten op that draws or may write runs
  once on meta tensors of the recorded shapes, and the aten ops it dispatches are judged.
- A module of torch's that the capture keeps whole (``nn.Dropout``, ``nn.BatchNorm2d``,
  ``nn.TransformerEncoderLayer``) is judged by the calls of its forward, traced; where
  that can't decide, it runs once on meta tensors as a function does, on a meta copy: the
  module is left as it is. A module whose code names no such op (``nn.Linear``) has
  none; one that holds code of the model's own (a hook, a submodule, a function) is
  opaque rather than run to be judged.

Running on meta tensors imports sympy (torch's meta kernels check shapes with it), which
a model that needs no run does not pay for. A call that can't be read is taken to have
the effect it may have.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import operator
import types
import warnings
from typing import Any, Callable, Mapping, Optional, cast

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .ir import tensor_meta
from .registry import describe_target

logger = logging.getLogger("autofuser.plan")

#: torch's own tag on the aten ops that draw random numbers.
_SEEDED = torch.Tag.nondeterministic_seeded
#: Node metadata: ``call_effect``'s verdict on the node, computed once for its target,
#: arguments and module.
_EFFECT_KEY = "autofuser_effect"
#: The modules of torch's Python-level functions that may run on meta tensors to see the ops
#: they dispatch: functions of their arguments, which touch no state outside them.
_META_MODULES = {"torch.nn.functional", "torch.nn.init"}
#: Where ``nn.Module``'s own machinery is written (``parameters()``, ``requires_grad_()``,
#: the containers): not part of what a module computes.
_MODULE_MACHINERY = {"torch.nn.modules.module", "torch.nn.modules.container"}
#: How many levels of the helpers a function calls are read for the aten ops they name, and
#: whose helpers are read: torch.nn's code and the model's own (not the rest of torch's,
#: ``torch.overrides``' dispatch to ``__torch_function__``, which names list methods that
#: are aten ops' names too).
_HELPER_DEPTH = 2
_FOLLOWED = "torch.nn"

#: Python's operators that write into their first operand.
_MUTATING_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}

#: An effect: its kind ("random", "mutation" or "opaque") and a sentence for the report.
Effect = tuple[str, str]


class _NeedsRun(LookupError):
    """A call in a module's traced forward that only a run on meta tensors can judge."""


#: Set while a module's traced forward is judged: a call that would run on meta tensors
#: raises ``_NeedsRun`` (its arguments have no recorded shapes there) for the module to run.
_IN_MODULE: contextvars.ContextVar[bool] = contextvars.ContextVar("autofuser_in_module", default=False)


def call_arguments(node: torch.fx.Node, packet: Optional[torch._ops.OpOverloadPacket] = None) -> dict[str, Any]:
    """The arguments of the call ``node`` by name, defaults included: bound by the Python
    function's signature, else (a builtin, a Tensor method: self first) by the schema of
    ``packet``'s first overload that takes them; else its keyword arguments alone."""
    return _bound(node, packet)[0]


def _bound(
    node: torch.fx.Node, packet: Optional[torch._ops.OpOverloadPacket]
) -> tuple[dict[str, Any], Optional[torch.FunctionSchema]]:
    """``call_arguments``, with the schema it bound them by (``None`` where it bound none)."""
    try:
        bound = inspect.signature(cast(Any, node.target)).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        return dict(bound.arguments), None
    except (TypeError, ValueError):
        pass
    for overload in packet.overloads() if packet is not None else ():
        schema = getattr(packet, overload)._schema
        names = [a.name for a in schema.arguments]
        if len(node.args) <= len(names) and set(node.kwargs) <= set(names):
            values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
            return {**values, **dict(zip(names, node.args)), **node.kwargs}, schema
    return dict(node.kwargs), None


def _packet(target: Any) -> Optional[torch._ops.OpOverloadPacket]:
    """The aten op of ``target``: itself (an op overload or its packet), or the aten op of its
    name (a function of torch's, a Tensor method); ``None`` where no aten op has the name."""
    packet = getattr(target, "overloadpacket", target)
    if isinstance(packet, torch._ops.OpOverloadPacket):
        return packet
    if not isinstance(target, str) and not torchs_own(getattr(target, "__module__", None)):
        return None  # not torch's: operator.getitem, a wrapped leaf of the model's
    name = target if isinstance(target, str) else getattr(target, "__name__", None)
    packet = getattr(torch.ops.aten, name, None) if isinstance(name, str) and name.isidentifier() else None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _tagged(packet: Optional[torch._ops.OpOverloadPacket]) -> bool:
    return packet is not None and any(_SEEDED in getattr(packet, o).tags for o in packet.overloads())


def _written(schema: torch.FunctionSchema, values: Mapping[str, Any], outs: bool = False) -> list[str]:
    """The names of ``schema``'s arguments its op writes into, given the argument ``values``
    known (the others may be anything), as torch's ``SchemaInfo`` reads them; ``out=``
    arguments only with ``outs`` (a call that passes one is a barrier by that alone); tensor
    arguments only (TorchScript's list ops, ``aten::pop``, write into lists)."""
    info = torch._C._SchemaInfo(schema)
    names = {a.name for a in schema.arguments}
    known: dict[str, object] = {
        k: v
        for k, v in values.items()
        if k in names and (v is None or isinstance(v, (bool, int, float, str, torch.Tensor)))
    }
    try:
        info.add_argument_values(known)
    except (RuntimeError, TypeError) as err:  # a value it can't take: judged without values
        logger.debug("schema %s took no argument values (%s)", schema.name, err)
        info = torch._C._SchemaInfo(schema)
    input_ = torch._C._SchemaArgType.input
    return [
        a.name
        for i, a in enumerate(schema.arguments)
        if (outs or not a.is_out) and _takes_tensor(a) and info.is_mutable(torch._C._SchemaArgument(input_, i))
    ]


def _may_write(packet: Optional[torch._ops.OpOverloadPacket]) -> bool:
    """Whether some overload of ``packet`` writes into an argument for some argument values."""
    return packet is not None and any(_written(getattr(packet, o)._schema, {}) for o in packet.overloads())


def _switched_off(arguments: dict[str, Any]) -> bool:
    """Whether a call of a tagged op has its drawing switched off by its arguments, as torch
    names them: a training flag (``train``, ``training``) of ``False``; or a dropout rate of
    0, where the op is a dropout's (it has a training flag beside its rate ``p``, or names
    the rate ``dropout_p`` or ``dropout``: ``F.scaled_dot_product_attention``). A ``p`` of an
    op with no training flag (``torch.bernoulli(x, p=0.0)``) still draws: it moves the
    generator on."""
    flags = [arguments[k] for k in ("train", "training") if k in arguments]
    names = ("p", "dropout_p", "dropout") if flags else ("dropout_p", "dropout")
    rates = [arguments[k] for k in names if k in arguments]
    zero = bool(rates) and all(isinstance(rate, (int, float)) and rate == 0 for rate in rates)
    return any(flag is False for flag in flags) or zero


def _names_effectful_op(function: Any, depth: int = _HELPER_DEPTH) -> bool:
    """Whether a Python function names, among the globals its code calls (and theirs and
    those of the functions it closes over, ``depth`` levels down, where ``_followed``), an
    aten op that draws random numbers or may write into an argument."""
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    names = set(code.co_names)
    if any(_effectful_name(name) for name in names):
        return True
    globals_ = getattr(function, "__globals__", {})
    helpers = [globals_.get(name) for name in names]
    # ``F.relu`` names ``F`` and ``relu``: the functions of torch's modules it reads.
    modules = [v for v in globals_.values() if isinstance(v, types.ModuleType) and v.__name__ in _META_MODULES]
    helpers += [getattr(m, name, None) for m in modules for name in names]
    for cell in getattr(function, "__closure__", None) or ():
        try:
            helpers.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    helpers = [h for h in helpers if inspect.isfunction(h) and _followed(h.__module__ or "")]
    return depth > 0 and any(_names_effectful_op(h, depth - 1) for h in helpers)


def torchs_own(module: Optional[str]) -> bool:
    """Whether a Python module's name (a class's or function's ``__module__``) is torch or one
    of its submodules: code of torch's, not the model's (nor torchvision's)."""
    return module is not None and (module == "torch" or module.startswith("torch."))


def _followed(module: str) -> bool:
    """Whether the helpers of a function of this module are read: torch.nn's and the
    model's own code, not the rest of torch's (``_FOLLOWED``)."""
    return module.startswith(_FOLLOWED) or not torchs_own(module)


@functools.lru_cache(maxsize=None)
def _effectful_name(name: str) -> bool:
    """Whether the aten op of this name draws random numbers or may write into an argument."""
    packet = _packet(name)
    return _tagged(packet) or _may_write(packet)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _on_meta(value: Any) -> Any:
    """A node's arguments with each node as a meta tensor of its recorded metadata;
    ``LookupError`` where a node has none (its value is only known at run time)."""

    def meta_of(node: torch.fx.Node) -> torch.Tensor:
        meta = tensor_meta(node)
        if meta is None:
            raise LookupError(node.name)
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")

    return torch.fx.node.map_arg(value, meta_of)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


class _Effects(TorchDispatchMode):
    """Notes, for the aten ops run under it, the first that draws random numbers and every
    tensor one writes into (by storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.seeded: Optional[str] = None
        self.writes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.seeded is None and _SEEDED in func.tags:
            self.seeded = str(func)
        schema = func._schema
        values = {**{a.name: v for a, v in zip(schema.arguments, args)}, **kwargs}
        for name in _written(schema, values, outs=True):
            self.writes.extend((str(func), _storage(t)) for t in _tensors(values.get(name)))
        return func(*args, **kwargs)


def _run_on_meta(call: Callable[[], Any]) -> _Effects:
    mode = _Effects()
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()
    return mode


def _meta_module(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` whose parameters, buffers, tensor attributes and
    submodules are meta tensors (``_meta_tensor``, modules) of the same shapes; ``module``
    is left as it is."""
    # Not copy.copy: a module may refuse to be pickled (a parametrised one does).
    clone = object.__new__(type(module))
    clone.__dict__.update(vars(module))
    clone._parameters = {
        k: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for k, p in module._parameters.items()
    }
    clone._buffers = {k: None if b is None else _meta_tensor(b) for k, b in module._buffers.items()}
    clone._modules = {k: None if m is None else _meta_module(m) for k, m in module._modules.items()}
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            clone.__dict__[name] = _meta_tensor(value)
    return clone


def _meta_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s shape; a 0-d one (a step count, which a forward may read
    as a number: ``1 / float(num_batches_tracked)``) copied to the CPU with its value."""
    if tensor.dim() == 0:
        return tensor.detach().to("cpu", copy=True)
    return torch.empty_like(tensor, device="meta")


def _own_tensors(module: torch.nn.Module) -> dict[int, str]:
    """The storages of a module's parameters, buffers and tensor attributes, by name."""
    own = {_storage(t): name for name, t in module.named_parameters()}
    own.update({_storage(t): name for name, t in module.named_buffers()})
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor):
            own.setdefault(_storage(value), name)
    return own


def _function_effect(node: torch.fx.Node) -> Optional[Effect]:
    target = node.target
    what = describe_target(target)
    packet = _packet(target)
    if packet is not None:
        arguments, schema = _bound(node, packet)
        if _tagged(packet):
            # A drawing op (a dropout): its flag or rate decides; a write into its input is
            # named by ``inplace`` (``barrier_reason``).
            return None if _switched_off(arguments) else ("random", f"{what} draws random numbers")
        # Bound by a Python function's own signature (``F.batch_norm``): by the op's schema
        # where it names every argument the schema requires; else run below, if torch's.
        if schema is None:
            arguments, schema = _named_alike(packet, arguments)
        if schema is not None:
            for name in _written(schema, arguments):
                written = [n for n in _nodes_in(arguments.get(name))]
                if written:
                    return "mutation", f"{what} writes into {_tensor_words(written[0], name)}"
            return None
    own = inspect.isfunction(target) and getattr(target, "__module__", None) in _META_MODULES
    if not own or not _names_effectful_op(target):
        return None
    try:
        args, kwargs = _on_meta(node.args), _on_meta(node.kwargs)
    except LookupError:
        if _IN_MODULE.get():
            raise _NeedsRun(node.name) from None
        return "random", f"{what} may draw random numbers or write: its arguments are known at run time only"
    try:
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        seen = _run_on_meta(lambda: cast(Any, target)(*args, **kwargs))
    except Exception as err:  # noqa: BLE001 - it can't run on meta: it may have the effects it names
        logger.debug("could not run %s on meta tensors (%s)", node.name, err)
        return "random", f"{what} names an op that draws random numbers or writes, and could not run on meta tensors"
    if seen.seeded is not None:
        return "random", f"{what} draws random numbers ({seen.seeded})"
    into = [op for op, storage in seen.writes if storage in inputs]
    if into:
        return "mutation", f"{what} writes into a tensor it is given ({into[0]})"
    return None


def _named_alike(
    packet: torch._ops.OpOverloadPacket, arguments: dict[str, Any]
) -> tuple[dict[str, Any], Optional[torch.FunctionSchema]]:
    """A Python function's ``arguments`` under the names of ``packet``'s schema (its ``input``
    is the op's ``self``), with the schema of its first overload whose every tensor argument
    without a default is among them by name (``None`` where none is)."""
    named = dict(arguments)
    if "input" in named:
        named.setdefault("self", named["input"])
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        required = [a for a in schema.arguments if not a.has_default_value() and not a.kwarg_only]
        # A flag the function does not name (``cudnn_enabled``) is judged as any value.
        if all(a.name in named for a in required if _takes_tensor(a)):
            return named, schema
    return arguments, None


def _takes_tensor(argument: Any) -> bool:
    """Whether a schema argument takes a tensor or tensors (``Tensor``, ``Tensor?``, ``Tensor[]``)."""
    return "Tensor" in str(argument.type)


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


def _tensor_words(node: torch.fx.Node, argument: str) -> str:
    """How a report names the tensor ``node`` a call writes into through ``argument``."""
    if node.op == "get_attr":
        return str(node.target)  # a module's own tensor: its name
    return "its input" if argument in ("self", "input") else f"its argument {argument}"


def _reachable_code(module: torch.nn.Module) -> list[Any]:
    """The functions a module's forward may run of its own: its class's ``forward`` and the
    methods that names (and theirs), and functions held as attributes (an activation), for
    it and every submodule."""
    found: list[Any] = []
    for part in module.modules():
        kind = type(part)
        todo = [kind.forward, *(v for v in vars(part).values() if inspect.isfunction(v))]
        while todo:
            function = todo.pop()
            if function in found or not inspect.isfunction(function):
                continue
            found.append(function)
            for name in function.__code__.co_names:
                method = inspect.getattr_static(kind, name, None)
                if inspect.isfunction(method) and method not in found and method.__module__ not in _MODULE_MACHINERY:
                    todo.append(method)
    return found


class _ShapedProxy(torch.fx.Proxy):
    """A traced input whose shape is known, so that a forward's checks of it (``dim()``) run."""

    known: torch.Size

    def dim(self) -> int:
        return len(self.known)

    def size(self, dim: Optional[int] = None) -> Any:
        return self.known if dim is None else self.known[dim]

    @property
    def ndim(self) -> int:
        return len(self.known)

    @property
    def shape(self) -> torch.Size:
        return self.known


class _ShapedTracer(torch.fx.Tracer):
    """fx's tracer, torch's modules kept whole, whose inputs' proxies know their shapes."""

    def __init__(self, shapes: list[Optional[torch.Size]]):
        super().__init__()
        self.shapes = list(shapes)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        if node.op == "placeholder" and self.shapes:
            shape = self.shapes.pop(0)
            if shape is not None:
                proxy = _ShapedProxy(node, self)
                proxy.known = shape
                return proxy
        return super().proxy(node)


def _seen_effect(seen: _Effects, own: dict[int, str], inputs: set[int], what: str) -> Optional[Effect]:
    """The effect ``seen`` records: a draw, or a write into one of ``own`` (a module's tensors,
    by storage) or ``inputs``; writes into tensors made on the way are none."""
    if seen.seeded is not None:
        return "random", f"{what} draws random numbers ({seen.seeded})"
    for op, storage in seen.writes:
        if storage in own:
            return "mutation", f"{what} writes into its {own[storage]} ({op})"
        if storage in inputs:
            return "mutation", f"{what} writes into its input ({op})"
    return None


def _traced_effect(node: torch.fx.Node, clone: torch.nn.Module, what: str) -> Optional[Effect]:
    """The first effect of a module's forward, traced on ``clone`` (``_meta_module``) with the
    shapes of ``node``'s arguments: what the trace itself runs on the module's tensors (fx
    runs an op on a buffer, ``num_batches_tracked.add_(1)``, as it traces), then each call
    it records (torch's submodules kept whole, and judged the same way). ``_NeedsRun`` where
    a call needs a run on meta tensors, or the forward can't be traced."""
    metas = [tensor_meta(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
    tracer = _ShapedTracer([None if m is None else torch.Size(m.shape) for m in metas])
    try:
        seen = _run_on_meta(lambda: tracer.trace(clone))
        traced = torch.fx.GraphModule(clone, tracer.graph)
    except Exception as err:  # noqa: BLE001 - Python it can't trace: judged by a run instead
        raise _NeedsRun(type(clone).__name__) from err
    effect = _seen_effect(seen, _own_tensors(clone), set(), what)
    if effect is not None:
        return effect
    token = _IN_MODULE.set(True)
    try:
        for part in traced.graph.nodes:
            if part.op in ("call_function", "call_method", "call_module"):
                effect = barrier_reason(part, traced)
                if effect is not None:
                    return effect[0], f"{what}: {effect[1]}"
    finally:
        _IN_MODULE.reset(token)
    return None


def _foreign_code(module: torch.nn.Module) -> Optional[str]:
    """What in ``module`` would run code other than torch's if it were traced or run on meta
    tensors (a hook, a submodule or function of the model's own, which may keep what it is
    given), or ``None``. The check does neither where there is such code."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return "global forward hooks"
    for name, part in module.named_modules():
        if part._forward_hooks or part._forward_pre_hooks:
            return f"forward hooks on {name or 'itself'}"
        if not torchs_own(type(part).__module__):
            return f"{type(part).__name__} ({name}), a module of the model's own"
        for key, value in vars(part).items():
            if callable(value) and not isinstance(value, torch.nn.Module):
                if not torchs_own(getattr(value, "__module__", None)):
                    return f"{key}, a function of the model's own"
    return None


def _module_effect(node: torch.fx.Node, module: torch.nn.Module) -> Optional[Effect]:
    """The effect of a module of torch's the capture keeps whole, judged on a meta copy of it
    (the module docstring says how); the module is left as it is."""
    what = f"{type(module).__name__} (in {'training' if module.training else 'eval'} mode)"
    if not any(_names_effectful_op(f) for f in _reachable_code(module)):
        return None
    foreign = _foreign_code(module)
    if foreign is not None:
        return "opaque", f"{what} holds {foreign}, which a check for random draws or writes would run; it runs as it is"
    try:
        return _traced_effect(node, _meta_module(module), what)
    except Exception as err:  # noqa: BLE001 - _NeedsRun, or a copy it can't make: run on meta instead
        logger.debug("could not judge %s by its trace (%s)", node.name, err)
        if _IN_MODULE.get():
            raise _NeedsRun(node.name) from err  # no shapes here: the module around it runs on meta
    try:
        clone = _meta_module(module)
        args, kwargs = _on_meta(node.args), _on_meta(node.kwargs)
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        seen = _run_on_meta(lambda: clone(*args, **kwargs))
    except Exception as err:  # noqa: BLE001 - what it does is unknown: it runs as it is
        logger.debug("could not run %s on meta tensors (%s)", node.name, err)
        return "opaque", (
            f"{what} could not run on meta tensors ({type(err).__name__}) to show whether it draws random "
            "numbers or writes into a tensor; it runs as it is"
        )
    return _seen_effect(seen, _own_tensors(clone), inputs, what)


def call_effect(node: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> Optional[Effect]:
    """What the call ``node`` does besides computing its result, read from torch's tags and
    schemas (the module docstring says how): ``("random", why)``, ``("mutation", why)``,
    ``("opaque", why)`` for a module of torch's whose effects could not be read, or ``None``.
    ``root``: the graph's module, for a ``call_module`` node. Kept in the node's metadata."""
    module = root.get_submodule(cast(str, node.target)) if node.op == "call_module" and root is not None else None
    if node.op not in ("call_function", "call_method") and module is None:
        return None
    # Every submodule's mode: a dropout inside may be switched back to training alone.
    training = tuple(m.training for m in module.modules()) if module is not None else None
    kept = node.meta.get(_EFFECT_KEY)
    # Compared by identity: a pass that copies one node's metadata to another copies no verdict.
    if kept is not None and kept[4] == training:
        if all(a is b for a, b in zip(kept[:4], (node.target, node.args, node.kwargs, module))):
            return kept[5]
    effect = _module_effect(node, module) if module is not None else _function_effect(node)
    node.meta[_EFFECT_KEY] = (node.target, node.args, node.kwargs, module, training, effect)
    return effect


def barrier_reason(node: torch.fx.Node, root: torch.nn.Module) -> Optional[Effect]:
    """Why ``node`` must stay where it is (mutation, randomness, opaque call), or ``None``: what
    the capture found untraceable, a module's hooks, what torch's tags and schemas say the
    call does (``call_effect``), and Python's in-place forms by their names."""
    opaque = node.meta.get("autofuser_opaque_reason")
    if opaque:
        return "opaque", f"untraceable part, runs as it is: {opaque}"
    if node.kwargs.get("out") is not None:
        return "mutation", "out= writes into an existing tensor"
    if node.op == "call_module":
        module = root.get_submodule(cast(str, node.target))  # a call_module node's target is its path
        if module._forward_hooks or module._forward_pre_hooks:
            return "opaque", f"{type(module).__name__} has forward hooks, which must run as registered"
    effect = call_effect(node, root)
    if effect is not None:
        return effect
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("__"):
            return "mutation", f"Tensor.{name} writes into its input"
    elif node.op == "call_function":
        target = node.target
        if target in _MUTATING_FUNCTIONS:
            return "mutation", f"{describe_target(target)} writes into a tensor"
        if getattr(target, "__name__", "").endswith("_") and not getattr(target, "__name__", "").startswith("__"):
            return "mutation", f"{describe_target(target)} writes into its input"
        if callable(target) and call_arguments(node).get("inplace") is True:
            return "mutation", f"{describe_target(target)}(inplace=True) writes into its input"
    return None


def first_write(gm: torch.fx.GraphModule) -> Optional[str]:
    """What in ``gm`` may write into a tensor (an in-place op, ``out=``, a call torch's
    schema says writes, an opaque part, whose writes no one sees), as a sentence naming
    its node; ``None`` where nothing does. A graph pass that reads a tensor in place of a
    copy of it, or gives readers that each had a copy one tensor to share, needs
    ``None``: a write between the copy and its readers would reach them."""
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            effect = barrier_reason(node, gm)
            if effect is not None and effect[0] != "random":
                return f"{node.name}: {effect[1]}"
    return None
