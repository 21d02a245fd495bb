"""Capture a whole ``nn.Module`` as ONE ``torch.fx.GraphModule`` specialised on real shapes.

Plain ``torch.fx.symbolic_trace`` fails on most real models, because their
forward code asks tensors for their shape (``B, N, C = x.shape``) and branches
on it.  Capture traces with *concrete* proxies instead:

1. Bind the example inputs to the forward signature (keyword inputs become
   positional placeholders) and check that the call is well formed.
2. Trace the root with ``_ConcreteTracer``, a ``torch.fx.Tracer``.  Every node it
   records is also *executed* on real values as it is recorded (placeholders
   get clones of the inputs, get_attr reads the real attribute).  The proxies
   (``ConcreteProxy``) answer metadata questions (``.shape``, ``.dim()``,
   ``.dtype``, ``len()`` ...) with those real values, so shape-dependent Python
   just runs.  Truth tests of proxies still raise (``to_bool``), so
   value-dependent control flow is never silently baked into the graph; shape
   questions about data-dependent shapes (``nonzero()``, ``x[mask]``) raise too.
   Non-tensor inputs (None, flags) are specialised to their example values and
   buffers are proxied, so in-place buffer updates become nodes.
3. While tracing, tensor factories (``torch.zeros``, ``torch.randn`` ...) are
   patched to record nodes (a ``randn`` in forward must draw fresh numbers per
   call), einops gets a backend that lowers rearrange/reduce/repeat to plain
   torch ops on proxies, and ``proxy[idx] = v`` / ``proxy += v`` record the
   in-place operator so aliasing behaves exactly as in eager mode.
4. If tracing raises inside a user function the module's code calls (a helper
   with ``if torch.isnan(x).any():``, a jitter loop), that function becomes a
   leaf: one ``call_function`` node (a ``LeafCall``) that runs it as it is, and
   the trace is retried, so the module around it is still inlined
   (``_function_leaf_for`` says which functions qualify).  Otherwise the
   innermost module whose forward was running is marked opaque (a
   ``call_module`` leaf, run eagerly) and the trace is retried.  If the culprit
   is the root itself, the result is one ``call_module`` of the unchanged model
   and a ``UserWarning`` says so.
5. Tracing and the final shape pass run on copies of the inputs with the
   inputs' own strides (an expanded or sliced input stays so, and the graph
   records the strides kernels will be launched with), with the RNG state, the
   contents of buffers and every attribute of every module saved and restored
   (``_ModuleAttributes``: ``self.cache = ...`` or ``register_buffer`` in forward
   leaves no proxy behind), so capture leaves the model and inputs as they were;
   real values are dropped from ``node.meta`` to bound memory.
6. Captures serialize on one process-wide lock, and every patch they make is
   thread-aware (it acts for the capturing thread only), so other threads'
   ``torch.zeros`` or ``module(x)`` run as always while a capture runs.
7. An exception the model raises when run whole on the example inputs is
   raised as it is (with a note), not wrapped.

Limits: ``isinstance(proxy, torch.Tensor)`` is False while tracing (as in fx);
factories are patched on the ``torch`` module for the duration of a trace, so
``from torch import zeros`` aliases are not recorded; non-tensor inputs get no
runtime guard.

Results: ``gm.meta["autofuser_opaque"]`` maps each opaque module path ("" for
the root) and each leaf function (``package.module:Qualified.name``, whose nodes
carry ``node.meta["autofuser_opaque_function"]``) to its reason,
``gm.meta["autofuser_input_names"]`` lists the placeholders in call order, and
every tensor-valued node has ``node.meta["tensor_meta"]``. For the report: each
call node records the line of the user's code that made it (``autofuser_source``:
file, line, function) and, where its result re-reads an input's memory (a view),
``autofuser_free``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import os
import sys
import sysconfig
import threading
import types
import warnings
import weakref
from typing import Any, Optional, cast

import torch
import torch.fx
from torch.fx import _symbolic_trace as _fx_trace
from torch.fx.node import map_aggregate, map_arg
from torch.fx.proxy import TraceError
from torch.utils import _pytree as pytree

from autofuser_core.errors import CaptureError
from autofuser_core.ir import FREE_KEY, describe_tensor

try:  # einops is optional: without it there is simply nothing to lower.
    from einops import _backends as _einops_backends
except ImportError:  # pragma: no cover
    _einops_backends = None  # type: ignore[assignment]

log = logging.getLogger("autofuser.capture")

OPAQUE_KEY = "autofuser_opaque"
OPAQUE_REASON_KEY = "autofuser_opaque_reason"
INPUT_NAMES_KEY = "autofuser_input_names"
ROOT_ATTR = "opaque_model"  # attribute holding the model when the root is opaque

SOURCE_KEY = "autofuser_source"  # (file, line, function) of the user's code that made a node
CAPTURED_OUTPUT_KEY = "autofuser_captured_output"  # a module call's output structure, shapes and dtypes

_REAL = "_autofuser_real_value"  # private node.meta keys, deleted after tracing
_HOLD = "_autofuser_real_hold"
_DYN = "_autofuser_data_dependent"
MAX_FUNCTION_RETRIES = 32  # user functions made leaves (or patched again) in one capture

# Factories are recorded (not baked as constants) so random draws stay fresh.
_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
)
# Ops whose output shape (or value, for item/tolist) depends on tensor data.
_DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "unique",
    "unique_consecutive",
    "masked_select",
    "bincount",
    "repeat_interleave",
    "item",
    "tolist",
    "histc",
}
# Arithmetic keeps its tensor operand's shape even when the other operand is a
# data-dependent Python number (``x * s.item()``).
_ARITHMETIC = {
    "add",
    "sub",
    "mul",
    "truediv",
    "div",
    "floordiv",
    "mod",
    "pow",
    "neg",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "clamp",
    "clip",
    "masked_fill",
    "iadd",
    "isub",
    "imul",
    "itruediv",
    "add_",
    "sub_",
    "mul_",
    "div_",
    "fill_",
}
_METADATA_TYPES = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))
_METADATA_FUNCTIONS = {
    torch.numel,
    torch.is_complex,
    torch.is_floating_point,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.element_size,
    torch.Tensor.is_complex,
    torch.Tensor.is_floating_point,
}


def _target_name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _reason(exc: BaseException) -> str:
    """Exception type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def clone_with_strides(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``tensor`` with ``tensor``'s own strides.

    ``clone()`` keeps the strides of a dense tensor (a transpose) but makes an
    expanded (stride 0) or sliced (``x[:, ::2]``) one contiguous: a graph traced and
    measured on such a copy records strides the real input doesn't have, and a kernel
    generated from them would read the real input out of bounds. So the memory the
    tensor spans is copied and viewed with the same strides.
    """
    copy = tensor.detach().clone()
    if tensor.layout != torch.strided or copy.stride() == tensor.stride() or tensor.numel() == 0:
        return copy
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    region = tensor.detach().as_strided((span,), (1,), tensor.storage_offset()).clone()
    return region.as_strided(tensor.shape, tensor.stride(), 0)


def _clone_tree(values: Any) -> Any:
    """Fresh copies of every tensor (same strides), so neither tracing nor the shape
    pass touches user inputs."""

    def clone(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return clone_with_strides(v).requires_grad_(v.requires_grad)
        return v

    return pytree.tree_map(clone, values)


class _Held:
    """A node's real value, owned by the node's proxies.

    The node itself keeps only a weak reference: once the traced code drops every
    proxy of a node, its value is freed, so tracing needs about as much memory as
    running the model (a model whose activations fit once would not fit if every
    intermediate value stayed alive until the end of the trace).
    """

    __slots__ = ("value", "__weakref__")

    def __init__(self, value: Any) -> None:
        self.value = value


def _real_value(node: torch.fx.Node) -> Any:
    held = node.meta.get(_HOLD) or node.meta[_REAL]()
    if held is None:  # cannot happen while a proxy of the node is alive
        raise TraceError(f"the value of {node.name} was freed before a later use")
    return held.value


class ConcreteProxy(torch.fx.Proxy):
    """An fx Proxy that knows the real value of its node and answers metadata with it."""

    _held: _Held

    def _real(self) -> Any:
        return self._held.value

    def _is_data_dependent(self) -> bool:
        return bool(self.node.meta.get(_DYN))

    def _static(self, what: str) -> Any:
        # Shapes of e.g. nonzero() outputs differ per input: refuse to specialise on them.
        if self._is_data_dependent():
            raise TraceError(f"{what} of {self} depends on tensor data")
        return self._real()

    # Metadata answers come from the real value.  Shape-like answers go through
    # _static, which refuses them for data-dependent shapes.
    shape = property(lambda self: self._static("shape").shape)
    ndim = property(lambda self: self._real().ndim)
    dtype = property(lambda self: self._real().dtype)
    device = property(lambda self: self._real().device)
    is_cuda = property(lambda self: self._real().is_cuda)
    layout = property(lambda self: self._real().layout)
    requires_grad = property(lambda self: self._real().requires_grad)

    def __len__(self) -> int:
        return len(self._static("len()"))

    def __iter__(self) -> Any:
        # Lengths are static (shapes are concrete), so iteration unrolls into getitems.
        value = self._static("iteration")
        if isinstance(value, (torch.Tensor, tuple, list)):
            return (self[i] for i in range(len(value)))  # type: ignore[index]  # fx adds Proxy.__getitem__ at import
        if isinstance(value, dict):
            return iter(list(value))
        return self.tracer.iter(self)

    def __getattr__(self, k: str) -> Any:
        if k in ("node", "tracer", "root", "attr", "_node"):
            raise AttributeError(k)  # half-initialised proxy: avoid recursion
        value = self._real()
        if not hasattr(value, k):  # keeps hasattr() honest
            raise AttributeError(f"{type(value).__name__!s} object has no attribute {k!r}")
        attr = getattr(value, k)
        if isinstance(value, torch.Tensor) and isinstance(attr, _METADATA_TYPES):
            if isinstance(attr, int) and not isinstance(attr, bool):
                self._static(k)
            return attr  # static metadata such as .is_sparse, .itemsize
        return ConcreteAttribute(self, k)

    def __setitem__(self, index: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})

    @classmethod
    def __torch_function__(cls, orig_method, types, args=(), kwargs=None):  # type: ignore[override]
        if orig_method in _METADATA_FUNCTIONS:
            args = pytree.tree_map(
                lambda a: a._static(orig_method.__name__) if isinstance(a, ConcreteProxy) else a, tuple(args)
            )
            return orig_method(*args, **(kwargs or {}))
        return super().__torch_function__(orig_method, types, args, kwargs)


def _define_metadata_method(name: str, shape_like: bool) -> None:
    def method(self: ConcreteProxy, *args: Any, **kwargs: Any) -> Any:
        value = self._static(f"{name}()") if shape_like else self._real()
        return getattr(value, name)(*args, **kwargs)

    method.__name__ = name
    setattr(ConcreteProxy, name, method)


for _name in ("size", "stride", "numel", "nelement", "is_contiguous"):
    _define_metadata_method(_name, shape_like=True)
for _name in ("dim", "ndimension", "is_complex", "is_floating_point", "element_size"):
    _define_metadata_method(_name, shape_like=False)


def _define_inplace(name: str) -> None:
    op = getattr(operator, f"i{name}")

    def inplace(self: ConcreteProxy, other: Any) -> ConcreteProxy:
        # The tracer is a _ConcreteTracer: its proxies are ConcreteProxies.
        return cast(ConcreteProxy, self.tracer.create_proxy("call_function", op, (self, other), {}))

    setattr(ConcreteProxy, f"__i{name}__", inplace)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    _define_inplace(_name)


class ConcreteAttribute(ConcreteProxy):
    """``proxy.attr``: a method call if called, else a lazily recorded getattr node."""

    def __init__(self, root: ConcreteProxy, attr: str) -> None:
        self.root, self.attr, self.tracer = root, attr, root.tracer
        self._node: Optional[torch.fx.Node] = None

    @property
    def node(self) -> torch.fx.Node:  # type: ignore[override]
        if self._node is None:
            # Keep the proxy: it owns the node's value (see _Held) for as long as this attribute lives.
            self._proxy = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {})
            self._node = self._proxy.node
        return self._node

    def _real(self) -> Any:
        return getattr(self.root._real(), self.attr)

    def _is_data_dependent(self) -> bool:
        return self.root._is_data_dependent()

    def __call__(self, *args: Any, **kwargs: Any) -> ConcreteProxy:
        return cast(ConcreteProxy, self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs))


class _ConcreteTracer(torch.fx.Tracer):
    """Tracer that executes every recorded node on real values (see module docstring)."""

    proxy_buffer_attributes = True  # buffer reads/updates become graph nodes, not constants

    def __init__(self, inputs: dict[str, Any], opaque: dict[str, str]) -> None:
        super().__init__()
        self.inputs, self.opaque = inputs, opaque
        self.leaf_paths: set[str] = set()
        self.executing = 0

    def proxy(self, node: torch.fx.Node) -> ConcreteProxy:
        proxy = ConcreteProxy(node, self)
        # The proxy takes over the node's value (see _Held); nodes that never get a
        # proxy (parameters fx reads for an argument) keep theirs until the end.
        held = node.meta.pop(_HOLD, None) or node.meta[_REAL]()
        if held is None:
            raise TraceError(f"the value of {node.name} was freed before a later use")
        proxy._held = held
        return proxy

    def is_leaf_module(self, m: torch.nn.Module, path: str) -> bool:
        # A module with hooks stays one call, so its hooks run (tracing through would skip them);
        # backward hooks matter only where gradients are recorded (the signature keys grad mode).
        hooked = bool(m._forward_hooks or m._forward_pre_hooks or _backward_hooked(m))
        return path in self.opaque or hooked or super().is_leaf_module(m, path)

    def call_module(self, m, forward, args, kwargs):  # type: ignore[override]
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            self.leaf_paths.add(path)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            # The first module the exception passes through is the innermost culprit.
            if not hasattr(exc, "_autofuser_culprit"):
                with contextlib.suppress(Exception):
                    exc._autofuser_culprit = path  # type: ignore[attr-defined]
            raise

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):  # type: ignore[override]
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        # Non-tensor inputs (None, flags, sizes) are specialised to their example
        # value, so `if mask is not None:` takes the branch eager mode takes.
        def specialise(a: Any) -> Any:
            if isinstance(a, ConcreteProxy):
                leaves = pytree.tree_leaves(a._real())
                if not any(isinstance(v, torch.Tensor) for v in leaves):
                    return a._real()
            return a

        @functools.wraps(fn)
        def traced_root(*args: Any) -> Any:
            # trace() calls this once its patches are in place: make them this thread's.
            _thread_aware_fx_patches()
            return fn(*args)

        return traced_root, [specialise(a) for a in args]

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):  # type: ignore[override]
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "output":
            return node
        if kind.startswith("call_"):
            where = _user_frame()
            if where is not None:
                node.meta[SOURCE_KEY] = where
        if kind == "placeholder":
            value = _clone_tree(self.inputs[str(target).lstrip("*")])
        else:
            value = self._execute(node)
        held = _Held(value)
        node.meta[_HOLD], node.meta[_REAL] = held, weakref.ref(held)
        if kind != "placeholder" and self._data_dependent(node, value):
            node.meta[_DYN] = True
        return node

    @contextlib.contextmanager
    def running_eagerly(self):
        """Run real computations with fx's patches (Module.__call__/__getattr__) undone."""
        flag = _fx_trace._is_fx_tracing_flag
        self.executing += 1
        try:
            with _fx_trace._maybe_revert_all_patches():
                _fx_trace._is_fx_tracing_flag = False  # some modules pick slower paths when tracing
                yield
        finally:
            _fx_trace._is_fx_tracing_flag = flag
            self.executing -= 1

    def _execute(self, node: torch.fx.Node) -> Any:
        args = map_arg(node.args, _real_value)
        kwargs = map_arg(node.kwargs, _real_value)
        with self.running_eagerly():
            if node.op == "call_function":
                assert callable(node.target)  # fx: a call_function's target is the function
                return node.target(*args, **kwargs)
            assert isinstance(node.target, str)  # the other ops' targets are names and paths
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            if node.op == "call_module":
                return self.root.get_submodule(node.target)(*args, **kwargs)
            value = self.root  # get_attr
            for atom in str(node.target).split("."):
                value = getattr(value, atom)
            return value

    @staticmethod
    def _data_dependent(node: torch.fx.Node, value: Any) -> bool:
        name = _target_name(node.target)
        if name in _DATA_DEPENDENT or (name == "where" and len(node.args) == 1):
            return True
        if node.target is operator.getitem:  # boolean-mask indexing
            index = map_arg(node.args[1], _real_value)
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in pytree.tree_leaves(index)
            ):
                return True
        dynamic = [n for n in node.all_input_nodes if n.meta.get(_DYN)]
        if not dynamic:
            return False
        scalars_only = not any(isinstance(_real_value(n), torch.Tensor) for n in dynamic)
        return not (name in _ARITHMETIC and scalars_only and isinstance(value, torch.Tensor))


_EinopsBackendBase: Any = _einops_backends.TorchBackend if _einops_backends else object  # einops is optional


class _ProxyEinopsBackend(_EinopsBackendBase):
    """einops backend for proxies: torch's backend (reshape/permute/expand/sum ...) as is.

    The framework name is not an importable module, so einops never picks this
    class up by itself; it is registered for proxy types only while tracing.
    """

    framework_name = "autofuser.capture.ConcreteProxy"

    def is_appropriate_type(self, tensor: Any) -> bool:
        return isinstance(tensor, ConcreteProxy)

    def shape(self, x: ConcreteProxy) -> tuple[int, ...]:
        return tuple(x.shape)


# Capture patches process-wide names (torch's factories, grad-mode switches, and fx's
# own nn.Module.__call__/__getattr__ patches) for the length of a trace. Each patched
# name is thread-aware: it acts for the capturing thread only and is the original for
# every other thread; and captures serialize on one lock, so two capturing threads never
# patch at once (fx's patches of module globals such as ``math.sqrt`` only act on
# proxies, so other threads never see them act).
_CAPTURE_LOCK = threading.RLock()  # re-entrant: a forward run eagerly during capture may capture
_THIS_THREAD = threading.local()  # .tracer: the tracer of the capture running in this thread
_ORIGINAL = "_autofuser_original"  # marks a thread-aware patch, naming what it replaces


def _tracer_of_this_thread() -> Optional["_ConcreteTracer"]:
    """The tracer recording in this thread, if any and not running real computations."""
    tracer = getattr(_THIS_THREAD, "tracer", None)
    return None if tracer is None or tracer.executing else tracer


def _recording_factory(original):
    """``torch.<factory>`` that records a node when this thread traces, else ``original``."""

    @functools.wraps(original)
    def factory(*args, **kwargs):
        tracer = _tracer_of_this_thread()
        if tracer is None:
            return original(*args, **kwargs)
        return tracer.create_proxy("call_function", original, args, kwargs)

    setattr(factory, _ORIGINAL, original)
    return factory


def _refusing_switch(cls, original):
    """A grad-mode/autocast method that fails the trace when this thread traces."""

    @functools.wraps(original)
    def switch(self, *args, **kwargs):
        if _tracer_of_this_thread() is None:
            return original(self, *args, **kwargs)
        raise torch.fx.proxy.TraceError(
            f"{cls.__name__} inside forward changes grad mode or autocast, which a graph can't record"
        )

    setattr(switch, _ORIGINAL, original)
    return switch


class _TracingInThisThread:
    """fx's "is tracing" flag, true for the capturing thread only (``Tracer.trace`` sets a
    process-wide True, which other threads would see: ``torch.compile`` refuses to run
    under an fx trace)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def __bool__(self) -> bool:
        return threading.get_ident() == self.thread


def _thread_aware_fx_patches() -> None:
    """Make fx's patches of ``nn.Module.__call__``/``__getattr__`` act for this thread only.

    ``Tracer.trace`` patches both on the class while it traces, so any other thread's
    ``module(x)`` would be recorded into this trace. Called from inside ``trace``, once
    its patches are in place: each is replaced (in the patcher's own list, which undoes
    and redoes them around real computations and when the trace ends) by a method that
    calls fx's for this thread and the original for others.
    """
    patcher = getattr(_fx_trace, "CURRENT_PATCHER", None)
    set_attr = getattr(_fx_trace, "_PatchedFnSetAttr", None)
    if patcher is None or set_attr is None:  # pragma: no cover - an fx without them
        return
    thread = threading.get_ident()
    for i, patch in enumerate(patcher.patches_made):
        ours = hasattr(patch.new_fn, _ORIGINAL)
        if not isinstance(patch, set_attr) or patch.frame_dict is not torch.nn.Module or ours:
            continue
        traced, original = patch.new_fn, patch.orig_fn

        def method(*args, _traced=traced, _original=original, **kwargs):
            if threading.get_ident() == thread:
                return _traced(*args, **kwargs)
            return _original(*args, **kwargs)

        functools.update_wrapper(method, traced)
        setattr(method, _ORIGINAL, original)
        patcher.patches_made[i] = patch._replace(new_fn=method)
        patcher.patches_made[i].patch()
    if _fx_trace._is_fx_tracing_flag is True:
        # trace() restores the old value; fx declares a bool, and reads only its truth
        _fx_trace._is_fx_tracing_flag = _TracingInThisThread()  # type: ignore[assignment]


@contextlib.contextmanager
def _tracing_patches(tracer: _ConcreteTracer):
    """Record tensor factories and route einops on proxies through torch ops (for the
    capturing thread; see ``_CAPTURE_LOCK``)."""
    # Grad mode and autocast switched inside forward would not be recorded in the graph:
    # the module doing it must stay opaque, run as it is (with its own context managers).
    mode_switches = [
        (cls, name)
        for cls, name in (
            (torch.autograd.grad_mode.no_grad, "__enter__"),
            (torch.autograd.grad_mode.enable_grad, "__enter__"),
            (torch.autograd.grad_mode.set_grad_enabled, "__init__"),
            (torch.autograd.grad_mode.inference_mode, "__enter__"),
            (torch.amp.autocast_mode.autocast, "__enter__"),
        )
        if name in cls.__dict__
    ]
    # (owner, name, patched value); names already patched by an enclosing capture of this
    # thread act for its tracer, whichever is current, and are left to it.
    patches: list[tuple[Any, str, Any]] = [
        (torch, n, _recording_factory(getattr(torch, n)))
        for n in _FACTORIES
        if hasattr(torch, n) and not hasattr(getattr(torch, n), _ORIGINAL)
    ]
    patches += [
        (cls, name, _refusing_switch(cls, cls.__dict__[name]))
        for cls, name in mode_switches
        if not hasattr(cls.__dict__[name], _ORIGINAL)
    ]
    registry = _einops_backends._type2backend if _einops_backends else {}
    proxy_types = (ConcreteProxy, ConcreteAttribute) if _einops_backends else ()
    outer = getattr(_THIS_THREAD, "tracer", None)
    _THIS_THREAD.tracer = tracer
    try:
        for owner, name, patched in patches:
            setattr(owner, name, patched)
        for t in proxy_types:  # only proxies ever reach these entries
            registry[t] = _ProxyEinopsBackend()
        yield
    finally:
        for owner, name, patched in reversed(patches):
            setattr(owner, name, getattr(patched, _ORIGINAL))
        if outer is None:
            for t in proxy_types:
                registry.pop(t, None)
        _THIS_THREAD.tracer = outer


def frozen_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a forward may update in place: buffers, parameters that don't
    train (trainable ones changed in forward would break autograd anyway) and
    plain tensor attributes of modules."""
    plain = [v for m in module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return list(module.buffers()) + [p for p in module.parameters() if not p.requires_grad] + plain


_MISSING = object()


class _ModuleAttributes:
    """Every attribute of every module of a model, as it is now, to put back later.

    A forward may assign to ``self`` (a lazy ``self.pos = torch.arange(n)``, a stored
    ``self.last = y.detach()``, ``register_buffer``, a counter): while tracing, those
    values are proxies, and left there they break the model for eager use, ``torch.save``
    and ``deepcopy``. Kept per module: its ``__dict__`` entries (objects, so added ones
    are deleted and replaced or deleted ones put back) and the contents of the
    containers among them (``_parameters``, ``_buffers``, ``_modules``, hook dicts, the
    user's own dicts, lists and sets; one level deep).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved = []
        for module in model.modules():
            entries = dict(module.__dict__)
            contents: dict[str, Any] = {}
            for name, value in entries.items():
                if isinstance(value, dict):
                    contents[name] = dict(value)
                elif isinstance(value, (list, set)):
                    contents[name] = value.copy()
            self.saved.append((module, entries, contents))

    def restore(self) -> None:
        for module, entries, contents in self.saved:
            current = module.__dict__
            for name in [n for n in current if n not in entries]:
                del current[name]
            for name, value in entries.items():
                if current.get(name, _MISSING) is not value:
                    current[name] = value
            for name, saved in contents.items():
                container = entries[name]
                if isinstance(container, list):
                    container[:] = saved
                else:  # a dict or set: cleared and refilled keeps its type and order
                    container.clear()
                    container.update(saved)


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module):
    """Run code on ``model`` without leaving a trace (capture, verification and timing
    run the user's forward more than once): RNG states, every module attribute
    (``_ModuleAttributes``) and the contents of every buffer and frozen tensor are
    restored on exit (BatchNorm statistics, an EMA codebook, a lazy cache, dropout draws)."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    attributes = _ModuleAttributes(model)
    # Buffers, parameters that don't train and plain tensor attributes may be updated in
    # place in forward (an EMA codebook, a counter): restore their contents too.
    frozen = {id(t): (t, t.detach().clone()) for t in frozen_state(model)}
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        attributes.restore()
        with torch.no_grad():
            for tensor, copy in frozen.values():
                tensor.copy_(copy)


def bind_inputs(model: torch.nn.Module, args: tuple, kwargs: dict, sig: Optional[inspect.Signature] = None):
    """Map every forward parameter to its example value; also the flat call order.

    fx orders placeholders as: positional parameters, keyword-only ones, *varargs.
    ``sig``: ``model.forward``'s signature where the caller keeps it (calls on a hot path).
    """
    sig = sig or inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        required = sum(p.default is p.empty for p in params)
        count = f"{required}" if required == len(params) else f"{required} to {len(params)}"
        names = ", ".join(p.name for p in params)
        raise CaptureError(
            f"{type(model).__name__}.forward takes {count} input(s) ({names}) but "
            f"{len(args) + len(kwargs)} were given ({exc}); pass one example input per "
            "forward argument."
        ) from None
    bound.apply_defaults()
    params = list(sig.parameters.values())
    for p in params:
        if p.kind is p.VAR_KEYWORD and bound.arguments[p.name]:
            raise CaptureError(
                f"{type(model).__name__}.forward takes **{p.name}; capture "
                "cannot pass extra keyword inputs, name them in the signature."
            )
    flat = [
        bound.arguments[p.name]
        for p in sorted(params, key=lambda p: p.kind is p.KEYWORD_ONLY)
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]  # sort is stable
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            flat += list(bound.arguments[p.name])
    return sig, dict(bound.arguments), flat


def _opaque_root(model: torch.nn.Module, sig: inspect.Signature, arguments: dict) -> torch.fx.GraphModule:
    """placeholders -> call_module(the whole model) -> output, in fx's placeholder order."""
    graph = torch.fx.Graph()
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    nodes = {
        p.name: graph.placeholder(p.name, default_value=p.default)
        for p in sorted(params, key=lambda p: p.kind is p.KEYWORD_ONLY)
    }
    varargs = [
        graph.placeholder(f"{p.name}_{i}")
        for p in sig.parameters.values()
        if p.kind is p.VAR_POSITIONAL
        for i in range(len(arguments[p.name]))
    ]
    args = [nodes[p.name] for p in params if p.kind is not p.KEYWORD_ONLY] + varargs
    kwargs: dict[str, Any] = {p.name: nodes[p.name] for p in params if p.kind is p.KEYWORD_ONLY}
    graph.output(graph.call_module(ROOT_ATTR, tuple(args), kwargs))
    holder = torch.nn.Module()
    holder.add_module(ROOT_ATTR, model)
    return torch.fx.GraphModule(holder, graph, class_name=type(model).__name__)


_EXECUTE_CODE = _ConcreteTracer._execute.__code__

# ----------------------------------------------------------------- function leaves
#
# A value-dependent branch inside a plain helper function (a Cholesky with a jitter
# loop, ``if torch.isnan(x).any():``) would otherwise make the whole module that calls
# it opaque. Instead, the innermost *user* function on the failing trace's stack
# becomes a leaf: one ``call_function`` node that runs the function as it is, and the
# trace is retried, so the module around it (its linears, norms, MLP) is inlined.
#
# Which code is the user's: a frame whose module belongs to the top-level package of
# one of the model's own module classes; else any file outside the standard library
# and site-/dist-packages. Never torch, triton, einops or AutoFuser itself (the public
# ``autofuser`` package only where the model's classes live in it, as the zoo's do).
# A library's function never becomes a leaf: only the user code calling it.

_NEVER_USER = frozenset({"torch", "triton", "einops", "functorch", "autofuser_core", "autofuser_plugins"})
OPAQUE_FUNCTION_KEY = "autofuser_opaque_function"  # node.meta: the leaf function's name
_CONTROL_FLOW = "symbolically traced variables cannot be used as inputs to control flow"
_LIBRARY_DIRS = tuple(
    os.path.join(os.path.realpath(p), "")
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def function_name(function: Any) -> str:
    """``package.module:Qualified.name``: how a leaf function is named in reports."""
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"


def _user_packages(model: torch.nn.Module) -> frozenset[str]:
    tops = {type(m).__module__.partition(".")[0] for m in model.modules()}
    return frozenset(tops - _NEVER_USER)


def _is_user_frame(frame: Any, user_packages: frozenset[str]) -> bool:
    name = str(frame.f_globals.get("__name__") or "")
    top = name.partition(".")[0]
    if top in user_packages:
        return True
    if top in _NEVER_USER or top == "autofuser":
        return False
    path = frame.f_code.co_filename
    if path.startswith("<"):  # exec'd or generated code: only a script's or notebook's own
        return name == "__main__"
    parts = set(os.path.normpath(path).split(os.sep))
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not os.path.realpath(path).startswith(_LIBRARY_DIRS)


class _FunctionLeaf:
    """One user function recorded as a leaf call, and the names it is reached through.

    ``scopes``: (globals dict, name) pairs bound to the function, patched for the trace;
    ``instances``: (module, attribute) pairs, a method patched on the instance.
    """

    def __init__(self, function: Any, name: str, reason: str) -> None:
        self.function, self.name, self.reason = function, name, reason
        self.scopes: list[tuple[dict, str]] = []
        self.instances: list[tuple[torch.nn.Module, str]] = []

    def has(self, other: "_FunctionLeaf") -> bool:
        """Whether every place ``other`` patches is patched here already."""
        return all(any(s is d and n == m for d, m in self.scopes) for s, n in other.scopes) and all(
            any(i is o and n == m for o, m in self.instances) for i, n in other.instances
        )

    def merge(self, other: "_FunctionLeaf") -> None:
        self.scopes += [(s, n) for s, n in other.scopes if not any(s is d and n == m for d, m in self.scopes)]
        self.instances += [(i, n) for i, n in other.instances if not any(i is o and n == m for o, m in self.instances)]


def _failure_description(exc: BaseException, path: str, line: int) -> str:
    where = f"{os.path.basename(path)}:{line}"
    if _CONTROL_FLOW in str(exc):
        return f"function with value-dependent control flow at {where}"
    return f"function that can't be traced at {where} ({_reason(exc)})"


def _function_leaf_for(
    exc: BaseException, model: torch.nn.Module, leaves: dict[str, _FunctionLeaf]
) -> Optional[_FunctionLeaf]:
    """The innermost user function on ``exc``'s traced stack that can be made a leaf.

    Steps:
    1. Collect the traceback's frames, outermost first, up to the first real
       computation of a recorded node (``_ConcreteTracer._execute``): code below it ran
       on real values and failed there, so its caller is at fault, not it.
    2. Walk the user frames from the innermost outwards. A module's ``forward`` stops
       the walk: the module retry (``_trace``) handles it. A frame whose caller is not
       user code (a library calling back) is skipped.
    3. The frame's function is found as a method of one of the model's modules (its
       first argument) or by a global name in its caller's module or its own; that is
       where the retry patches it. A function already patched in all those places
       (``leaves``) that failed again was called some other way (through a dict): the
       walk goes on outwards, to the function calling it. None found: no function
       leaf, the module stays opaque as before.
    """
    user_packages = _user_packages(model)
    frames: list[tuple[Any, int]] = []
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _EXECUTE_CODE:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    user = [_is_user_frame(f, user_packages) for f, _ in frames]
    if not any(user):
        return None
    where_frame, where_line = next(frames[i] for i in reversed(range(len(frames))) if user[i])
    reason = _failure_description(exc, where_frame.f_code.co_filename, where_line)
    modules = list(model.modules())
    for i in reversed(range(1, len(frames))):
        if not user[i]:
            continue
        frame, caller = frames[i][0], frames[i - 1][0]
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if isinstance(owner, torch.nn.Module) and any(owner is m for m in modules):
            method = next(
                (
                    (name, value)
                    for klass in type(owner).__mro__
                    for name, value in vars(klass).items()
                    if inspect.isfunction(value) and value.__code__ is code
                ),
                None,
            )
            if method is not None:
                name, function = method
                if name == "forward":
                    return None  # a module's own code: the module retry's case
                if not user[i - 1]:
                    continue
                leaf = _FunctionLeaf(function, function_name(function), reason)
                leaf.instances.append((owner, name))
                if not _tried(leaf, leaves):
                    return leaf
                continue
        if not user[i - 1]:
            continue
        candidates = [caller.f_globals.get(code.co_name), frame.f_globals.get(code.co_name)]
        candidates += [v for v in caller.f_globals.values() if inspect.isfunction(v) and v.__code__ is code]
        found = next((c for c in candidates if inspect.isfunction(c) and c.__code__ is code), None)
        if found is None:
            continue  # a closure or lambda: no name to patch
        leaf = _FunctionLeaf(found, function_name(found), reason)
        for scope in (caller.f_globals, found.__globals__):
            for name, value in list(scope.items()):
                if value is found and not any(s is scope and n == name for s, n in leaf.scopes):
                    leaf.scopes.append((scope, name))
        if not _tried(leaf, leaves):
            return leaf
    return None


def _tried(leaf: _FunctionLeaf, leaves: dict[str, _FunctionLeaf]) -> bool:
    """Whether ``leaf`` is already patched everywhere it was found (and still failed)."""
    known = leaves.get(leaf.name)
    return known is not None and (known.function is not leaf.function or known.has(leaf))


def _describe_output(value: Any) -> tuple:
    """What code after a leaf call may have been specialised on: the output's structure
    and each tensor's shape and dtype."""
    leaves, spec = pytree.tree_flatten(value)
    return spec, [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in leaves]


class LeafCall:
    """A leaf function's call in a captured graph (the ``call_function`` target).

    The graph after the call was traced with the output the function returned on the
    example inputs: its shapes may be baked into later nodes (``h.shape[0]`` as a
    constant). A function with value-dependent control flow can return other shapes for
    other values (``x[mask]``), so every call checks that its output has the structure,
    shapes and dtypes it had at capture and raises ``CaptureError`` where it hasn't,
    rather than letting the graph compute on with the old shapes.
    """

    def __init__(self, function: Any, name: str) -> None:
        self.function, self.name = function, name
        # fx names the node and the generated code's global after these.
        self.__name__ = getattr(function, "__name__", "leaf")
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)
        self.__module__ = getattr(function, "__module__", None) or __name__
        self.expected: Optional[tuple] = None  # the first call's, made while tracing

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.function(*args, **kwargs)
        described = _describe_output(output)
        if self.expected is None:
            self.expected = described
        elif described != self.expected:
            raise CaptureError(
                f"{self.name} returned {_format_output(described)} here but "
                f"{_format_output(self.expected)} when the model was captured: its output's shape "
                "depends on tensor values, and the graph after it was specialised on the first "
                f"shapes. Make {self.name} return the same shapes for inputs of the same shape "
                "(mask or pad instead of dropping entries), or run the model without AutoFuser."
            )
        return output

    def __repr__(self) -> str:
        return f"LeafCall({self.name})"


class OutputShapeCheck:
    """The check after an opaque module's call in a captured graph (a ``call_function``
    node that returns its argument itself): the graph after an opaque module was traced
    with the output the module returned on the example inputs, so, as for a leaf
    function (``LeafCall``), each call checks that output keeps the structure, shapes and
    dtypes it had at capture, and raises ``CaptureError`` naming the module where it
    doesn't, rather than letting the graph compute on with the old shapes."""

    def __init__(self, path: str, expected: tuple) -> None:
        self.path, self.expected = path, expected
        self.__name__ = self.__qualname__ = "output_shape_check"
        self.__module__ = __name__

    def __call__(self, output: Any) -> Any:
        described = _describe_output(output)
        if described != self.expected:
            raise CaptureError(
                f"module {self.path} (run as it is: it could not be traced) returned "
                f"{_format_output(described)} here but {_format_output(self.expected)} when the model "
                "was captured: its output's shape depends on tensor values, and the graph after it was "
                f"specialised on the first shapes. Make {self.path} return the same shapes for inputs of "
                "the same shape (mask or pad instead of dropping entries), or run the model without AutoFuser."
            )
        return output

    def __repr__(self) -> str:
        return f"OutputShapeCheck({self.path})"


def _check_opaque_outputs(gm: torch.fx.GraphModule, opaque: dict[str, str]) -> None:
    """Put an ``OutputShapeCheck`` after each opaque module's call whose output the graph
    reads, with what it returned at capture (``CAPTURED_OUTPUT_KEY``)."""
    for node in list(gm.graph.nodes):
        captured = node.meta.get(CAPTURED_OUTPUT_KEY)
        if node.op != "call_module" or node.target not in opaque or not node.users or captured is None:
            continue
        with gm.graph.inserting_after(node):
            check = gm.graph.call_function(OutputShapeCheck(str(node.target), captured), (node,))
        node.replace_all_uses_with(check, delete_user_cb=lambda user: user is not check)
        check.meta = {k: v for k, v in node.meta.items() if k in ("tensor_meta", "type")}
        check.meta[FREE_KEY] = True  # it returns its argument itself: no data moves
    gm.recompile()


def _format_output(described: tuple) -> str:
    parts = [
        f"{str(d[1]).replace('torch.', '')}{list(d[0])}" if isinstance(d, tuple) else d.__name__ for d in described[1]
    ]
    return ", ".join(parts) if len(parts) != 1 else parts[0]


def _recording_leaf(original: Any, name: str) -> Any:
    """``original`` recorded as one ``call_function`` node when this thread traces, else
    ``original`` itself (a leaf run while a node executes on real values runs whole)."""

    @functools.wraps(original)
    def leaf(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracer_of_this_thread()
        if tracer is None:
            return original(*args, **kwargs)
        proxy = tracer.create_proxy("call_function", LeafCall(original, name), args, kwargs)
        proxy.node.meta[OPAQUE_FUNCTION_KEY] = name
        return proxy

    setattr(leaf, _ORIGINAL, original)
    return leaf


@contextlib.contextmanager
def _function_leaves(leaves: dict[str, _FunctionLeaf]):
    """Patch every leaf function where it is reached, for one trace; put all back after.

    The patches are thread-aware (``_recording_leaf``): another thread calling the
    function meanwhile runs it as always.
    """
    undo: list[Any] = []
    try:
        for leaf in leaves.values():
            for scope, name in leaf.scopes:
                if scope.get(name) is leaf.function:
                    scope[name] = _recording_leaf(leaf.function, leaf.name)
                    undo.append((scope, name, leaf.function))
            for module, name in leaf.instances:
                if name not in module.__dict__:  # an instance attribute of that name: not ours to shadow
                    module.__dict__[name] = _recording_leaf(getattr(module, name), leaf.name)
                    undo.append((module.__dict__, name, _MISSING))
        yield
    finally:
        for scope, name, value in reversed(undo):
            if value is _MISSING:
                scope.pop(name, None)
            else:
                scope[name] = value


def _trace_once(
    model, arguments, opaque, leaves
) -> tuple[torch.fx.GraphModule | None, str | None, str, Optional[_FunctionLeaf]]:
    """One tracing attempt: (graph module, None, "", None) or (None, culprit path,
    reason, the user function a retry could make a leaf, if any)."""
    tracer = _ConcreteTracer(arguments, opaque)
    try:
        # The graph module is built before the model's attributes are put back: it takes
        # the tensor constants fx stowed on the root (``_tensor_constant0``), which then go.
        with preserved_state(model):
            with _tracing_patches(tracer), _function_leaves(leaves):
                graph = tracer.trace(model)
            for node in graph.nodes:  # real values would keep every activation alive
                node.meta.pop(_REAL, None)
                node.meta.pop(_HOLD, None)
                node.meta.pop(_DYN, None)
            return torch.fx.GraphModule(tracer.root, graph, class_name=type(model).__name__), None, "", None
    except Exception as exc:
        culprit = getattr(exc, "_autofuser_culprit", "")
        # A leaf (or already opaque) module failing on real values means its caller is at fault.
        while culprit and (culprit in opaque or culprit in tracer.leaf_paths):
            culprit = culprit.rpartition(".")[0]
        try:
            leaf = _function_leaf_for(exc, model, leaves)
        except Exception:  # noqa: BLE001 - a frame we can't read: the module retry, as before
            log.debug("autofuser: no function leaf for %s", _reason(exc), exc_info=True)
            leaf = None
        finally:
            exc.__traceback__ = None  # its frames hold the trace's real values
        return None, culprit, _reason(exc), leaf


#: Folders whose frames are not the user's code: torch, einops, AutoFuser's core, and the
#: standard library but for its site-packages (installed models live there).
_NOT_USER = tuple(
    os.path.dirname(os.path.abspath(f)) + os.sep
    for f in (torch.__file__, __file__)
    + ((_einops_backends.__file__,) if _einops_backends is not None and _einops_backends.__file__ else ())
)
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep
_user_file: dict[str, bool] = {}


def _user_frame() -> Optional[tuple[str, int, str]]:
    """(file, line, function) of the innermost frame of the model's own code: the line of
    ``forward`` (or of a function it calls) that made the node being created."""
    frame: Optional[types.FrameType] = sys._getframe(2)
    while frame is not None:
        file = frame.f_code.co_filename
        if file.startswith("<eval_with_key>"):
            # fx's generated code (a torch.compile graph traced again): the line that made
            # the node is not the user's, and the frames above it are the caller's
            return None
        mine = _user_file.get(file)
        if mine is None:
            path = os.path.abspath(file)
            stdlib = path.startswith(_STDLIB) and "-packages" + os.sep not in path[len(_STDLIB) :]
            mine = _user_file[file] = not (path.startswith(_NOT_USER) or stdlib)
        if mine:
            return file, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


class _ShapeRecorder(torch.fx.Interpreter):
    """Runs the graph on real values and files each node's tensor metadata under
    ``node.meta["tensor_meta"]``, as ``torch.fx.passes.shape_prop.ShapeProp`` does without
    its fake-tensor support and memory-format probes (which import sympy: seconds of a
    cold first call; see ``describe_tensor``)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.extra_traceback = False  # the model's own error, as ShapeProp's cause was (KeyError stays KeyError)

    def run_node(self, n: torch.fx.Node) -> Any:
        inputs = [self.env[i] for i in n.all_input_nodes if i in self.env] if n.op.startswith("call_") else []
        versions = [t._version for t in inputs if isinstance(t, torch.Tensor)]
        result = super().run_node(n)
        if inputs and isinstance(result, torch.Tensor):
            n.meta[FREE_KEY] = _is_free(result, inputs, versions)
        elif (
            inputs and isinstance(result, (tuple, list)) and result and all(isinstance(r, torch.Tensor) for r in result)
        ):
            # chunk, split, unbind: a tuple of views moves no data either
            n.meta[FREE_KEY] = all(_is_free(r, inputs, versions) for r in result)
        if n.op == "call_module":  # what an opaque one returned, for OutputShapeCheck
            n.meta[CAPTURED_OUTPUT_KEY] = _describe_output(result)
        found = False

        def meta(value: Any) -> Any:
            nonlocal found
            if isinstance(value, torch.Tensor):
                found = True
                return describe_tensor(value)
            return value

        described = map_aggregate(result, meta)
        if found:
            n.meta["tensor_meta"] = described
        n.meta["type"] = type(result)
        return result


def _is_free(result: torch.Tensor, inputs: list, versions: list[int]) -> bool:
    """Whether ``result`` only re-reads an input's memory: a view of an input tensor (or the
    input itself), or an element of an input tuple, with no input written in place. Judged
    by what the op did, so it needs no list of view ops."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if [t._version for t in tensors] != versions:
        return False  # an in-place write: it moves data
    for value in inputs:
        if isinstance(value, (tuple, list)) and any(result is v for v in value):
            return True
    if result.numel() == 0:
        return False
    try:
        storage = result.untyped_storage().data_ptr()
        return any(t.numel() and t.untyped_storage().data_ptr() == storage for t in tensors)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts: no view to see
        return False


def record_shapes(gm: torch.fx.GraphModule, *inputs: Any) -> None:
    """Run ``gm`` on ``inputs`` and file each node's tensor metadata under
    ``node.meta["tensor_meta"]`` (what planning reads), for a graph traced elsewhere (a
    group's backward)."""
    _ShapeRecorder(gm).run(*inputs)


def _propagate_shapes(gm: torch.fx.GraphModule, model: torch.nn.Module, inputs: list) -> None:
    """node.meta["tensor_meta"] everywhere, on input clones, leaving RNG and buffers as they were."""
    with preserved_state(model):
        _ShapeRecorder(gm).run(*_clone_tree(inputs))


def _trace(
    model: torch.nn.Module, sig: inspect.Signature, arguments: dict, flat_inputs: list
) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """Trace, making culprit modules opaque one by one, then propagate shapes.

    An exception the model itself raises on the example inputs (run whole, eagerly)
    propagates as it is, with a note, so ``except IndexError`` around ``fuse`` or
    ``capture`` still sees the model's ``IndexError``.
    """
    opaque: dict[str, str] = {}
    leaves: dict[str, _FunctionLeaf] = {}
    gm, reason = None, ""  # the loop sets reason whenever no hook does
    if model._forward_hooks or model._forward_pre_hooks or _backward_hooked(model) or "forward" in model.__dict__:
        # fx traces type(model).forward itself: root hooks or an instance-level forward
        # would be silently skipped, so keep such a root whole.
        reason = "the root module has hooks or an instance-level forward"
    # Each retry makes one more user function a leaf (or reaches one through one more
    # name), or else one more module opaque; both are bounded.
    for _ in range(0 if reason else len(list(model.modules())) + 1 + MAX_FUNCTION_RETRIES):
        gm, culprit, reason, leaf = _trace_once(model, arguments, opaque, leaves)
        if gm is not None:
            break
        known = leaves.get(leaf.name) if leaf is not None else None
        if leaf is not None and known is None and len(leaves) < MAX_FUNCTION_RETRIES:
            log.debug("autofuser: function %s is opaque: %s", leaf.name, leaf.reason)
            leaves[leaf.name] = leaf
            continue
        if leaf is not None and known is not None and known.function is leaf.function and not known.has(leaf):
            known.merge(leaf)  # the same function, reached through one more name
            continue
        # No function to make a leaf, or one that still fails where it is patched (called
        # through a name the patch doesn't reach): the module around it stays opaque.
        if not culprit:
            break
        log.debug("autofuser: %s is opaque: %s", culprit, reason)
        opaque[culprit] = reason  # each retry makes one more module opaque
    if gm is None:
        gm, opaque = _opaque_root(model, sig, arguments), {"": reason}
    else:
        used = {n.meta.get(OPAQUE_FUNCTION_KEY) for n in gm.graph.nodes}
        opaque.update({name: leaf.reason for name, leaf in leaves.items() if name in used})

    try:
        _propagate_shapes(gm, model, flat_inputs)
        return gm, opaque
    except Exception as exc:
        if "" in opaque:
            _note_model_error(exc, model)
            raise
        failure = exc
    # The traced graph does not run (it should): fall back to the untouched model.
    gm, opaque = _opaque_root(model, sig, arguments), {"": _reason(failure)}
    try:
        _propagate_shapes(gm, model, flat_inputs)
    except Exception as exc:
        _note_model_error(exc, model)
        raise
    return gm, opaque


def _note_model_error(exc: BaseException, model: torch.nn.Module) -> None:
    """Say, on the model's own exception, where it came from (Python 3.11+ shows notes)."""
    if hasattr(exc, "add_note"):
        exc.add_note(
            f"AutoFuser: {type(model).__name__} raised this when run eagerly on the example "
            "inputs it was being captured with, so it fails on them without AutoFuser too: "
            "fix the model or the inputs."
        )


def _backward_hooked(module: torch.nn.Module) -> bool:
    """Whether ``module`` has backward hooks that a call now would run (gradients on)."""
    return torch.is_grad_enabled() and bool(module._backward_hooks or module._backward_pre_hooks)


def capture(model: torch.nn.Module, *example_inputs: Any, **example_kwargs: Any) -> torch.fx.GraphModule:
    """Trace ``model`` into one GraphModule specialised on the example inputs' shapes.

    Call the result with the inputs in the order of ``gm.meta["autofuser_input_names"]``.
    Submodules that cannot be traced stay opaque ``call_module`` nodes (see
    ``gm.meta["autofuser_opaque"]``); if the root cannot be traced, the model runs unchanged.
    """
    if not isinstance(model, torch.nn.Module):
        hint = (
            f" {model.__name__} is a class: instantiate it first, e.g. capture({model.__name__}(...), x)."
            if isinstance(model, type)
            else ""
        )
        raise CaptureError(
            f"capture() needs an nn.Module instance, got {type(model).__name__}: pass an nn.Module instance.{hint}"
        )
    sig, arguments, flat_inputs = bind_inputs(model, example_inputs, example_kwargs)

    with _CAPTURE_LOCK:  # see _CAPTURE_LOCK: the patches tracing makes are process-wide
        gm, opaque = _trace(model, sig, arguments, flat_inputs)

    # Only report paths that are call_module nodes (not those inside an opaque parent).
    targets = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    functions = {n.meta[OPAQUE_FUNCTION_KEY] for n in gm.graph.nodes if OPAQUE_FUNCTION_KEY in n.meta}
    opaque = {p: r for p, r in opaque.items() if p == "" or p in targets or p in functions}
    if "" not in opaque:
        for path in sorted(targets - set(opaque)):
            module = model.get_submodule(path)
            if module._forward_hooks or module._forward_pre_hooks or _backward_hooked(module):
                opaque[path] = "it has hooks, which run only when the module itself is called"
    if "" not in opaque:  # the whole model opaque: no graph after it was specialised
        _check_opaque_outputs(gm, opaque)
    for node in gm.graph.nodes:
        if node.op == "call_module" and (node.target in opaque or "" in opaque):
            node.meta[OPAQUE_REASON_KEY] = opaque.get(node.target, opaque.get(""))
        elif node.meta.get(OPAQUE_FUNCTION_KEY) in opaque:
            name = node.meta[OPAQUE_FUNCTION_KEY]
            node.meta[OPAQUE_REASON_KEY] = f"{name}: {opaque[name]}"
    gm.meta[OPAQUE_KEY] = opaque
    gm.meta[INPUT_NAMES_KEY] = [n.target for n in gm.graph.nodes if n.op == "placeholder"]

    name = type(model).__name__
    if "" in opaque:
        warnings.warn(
            f"AutoFuser could not trace {name} ({opaque['']}); it will run unchanged (eager), without fusion.",
            UserWarning,
            stacklevel=2,
        )
    elif opaque:
        log.info(
            "autofuser: %s captured; %d part(s) stay opaque (run eagerly): %s",
            name,
            len(opaque),
            "; ".join(f"{p}: {r}" for p, r in opaque.items()),
        )
    return gm
