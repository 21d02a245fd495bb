"""``fuse()``: the user's entry point, and the module it returns.

``FusedModule`` compiles lazily: the first forward with a new *signature*
(input shapes, dtypes, devices and strides; non-tensor arguments by value; grad
mode; autocast state; the train/eval flags of every submodule; torch's fp32
matmul and cuDNN TF32 settings; the values of the model's plain attributes)
captures the model on those inputs, plans, generates, tunes, verifies and
rewrites it, and keeps the result. Later forwards with the same signature reuse
it. A submodule, parameter, buffer or other attribute object replaced, or a
hook registered, drops every compiled version (``_ModelState``). Up to
``max_signatures`` compiled versions are kept; past that, new signatures run
the original model, with one warning. docs/guard.md lists what the guard sees.

Dimensions that vary between calls (``dynamic=``, ``mark_dynamic``) make shape
classes: a new size of a dynamic dim compiles its exact shape again (cheap: the
kernels, taking that size at run time, are the class's), and the classes of one
signature that differ only in their size buckets count once against
``max_signatures`` (docs/dynamic.md).

The wrapper owns no parameters of its own: it shares the original model's,
so ``state_dict``, ``load_state_dict``, ``.to()``, ``eval()`` and optimisers
act on the model itself, and updated weights take effect without recompiling.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import hashlib
import importlib
import inspect
import json
import logging
import math
import operator
import os
import pickle
import sys
import time
import warnings
from collections import OrderedDict, defaultdict
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from . import logs, precompile, timing
from .cache import Verdict, cache_dir, make_record, read_verdict, write_verdict
from .capture import LeafCall, bind_inputs, capture, preserved_state
from .compile import _device_of, compile_graph, replaying
from .cudagraphs import CudaGraphRunner, TrainingGraph, try_cuda_graph, try_training_graph
from .dynamic import SizeRule, bucket, checked_key, class_checked, marked_dims, size_rule
from .effects import barrier_reason, torchs_own
from .errors import AutoFuserError, CaptureError, CompileFailedWarning, OpaquePartError, PluginError
from .in_use import BLOCK_CALLS, MAX_RESTARTS, MAX_ROUNDS, InUseCheck, end_turn, take_turn
from .launch import FusedKernel
from .plugins import PluginSet, load_plugins
from .progress import Progress, short_inputs
from .quantize import QuantizedLayer, QuantizeOptions, parse_quantize, quantize_model
from .report import FusionReport
from .tf32 import fp32_settings, strict_fp32
from .timing import FORWARD_BUDGET_MS
from .tuning import device_key
from .verify import no_autocast, snapshot

logger = logging.getLogger("autofuser.compile")


class FuseOptions(BaseModel):
    """Options of ``fuse()``; unknown names are refused. A plugin's own options
    (``autofuser_register_options``) are attributes too (``options.reassociate_products``),
    set by ``FuseOptions.parse``.

    Flags and counts are strict: ``tune="yes"``, ``verify_speed=1`` or
    ``max_signatures="8"`` are refused rather than read as something the caller may
    not have meant. Durations take any number (``tune_budget_s=5``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    cache_dir: Optional[str] = Field(
        None, strict=True, description="Cache folder; default $AUTOFUSER_CACHE_DIR, else your user cache folder."
    )
    max_signatures: int = Field(
        8,
        ge=1,
        strict=True,
        description="Compiled signatures kept; later new ones run eager. The shape classes of one signature "
        "with dynamic dims count once, however many sizes compile (docs/dynamic.md).",
    )
    tune: bool = Field(True, strict=True, description="Benchmark each kernel's configs on a GPU (cached).")
    tune_budget_s: float = Field(20.0, gt=0, strict=True, description="Tuning time per group, seconds.")
    tune_all_configs: bool = Field(
        False,
        strict=True,
        description="Tune every valid config, also past the few that strategies with large kernels tune "
        "(their max_tuned_configs): longer cold compiles, for gathering tuning statistics "
        "(benchmarks/tuning_stats.py). Cached apart from capped tuning.",
    )
    verify_speed: bool = Field(
        True,
        strict=True,
        description="On a GPU, time each group fused vs eager and keep the faster; "
        "run the original model unless the whole fused forward is at "
        "least FORWARD_MARGIN (2%) faster.",
    )
    progress: bool = Field(True, strict=True, description="Print progress lines to stderr while compiling.")
    cuda_graphs: bool = Field(
        True,
        strict=True,
        description="On CUDA, replay each compiled forward as a CUDA graph for inference "
        "where that is measured to be faster, and a training step's forward and backward "
        "as two CUDA graphs where they capture and replay exactly (docs/training.md).",
    )
    quantize: Optional[QuantizeOptions] = Field(
        None,
        description="Quantise weights first: a format name ('mxint8'), or a dict / QuantizeOptions "
        "naming the format and which layers (include, exclude, min_numel).",
    )
    fullgraph: bool = Field(
        False,
        strict=True,
        description="Strict capture, as torch.compile's fullgraph=True: raise OpaquePartError, naming the "
        "part, where a module or function of the model can't be traced and would run as it is.",
    )
    dynamic: Optional[bool] = Field(
        None,
        strict=True,
        description="Dimensions whose size varies between calls, as torch.compile's dynamic=: None "
        "specialises first, and a later call that differs only in some dimensions' sizes makes those "
        "dimensions dynamic from then on; True makes every dimension of the inputs dynamic from the "
        "start; False specialises on every shape (and ignores mark_dynamic). A dynamic dimension's size "
        "reaches the kernels at run time, so its sizes share kernels (docs/dynamic.md).",
    )
    strict_fp32_products: Literal["tf32x3", "ieee"] = Field(
        "tf32x3",
        description="fp32 products where torch disallows TF32: 3xTF32 (fp32-level error, tensor cores) "
        "or plain fp32 FMAs.",
    )
    #: Plugin-owned options (``autofuser_register_options``), validated by their plugin's
    #: model: value by name, and the plugin owning each name. Plain values, so a pickled
    #: FusedModule needs no plugin's options class to load.
    _plugin_values: dict[str, Any] = PrivateAttr(default_factory=dict)
    _plugin_owners: dict[str, str] = PrivateAttr(default_factory=dict)

    if not TYPE_CHECKING:  # mypy then still flags misspelled core options

        def __getattr__(self, name: str) -> Any:
            """A plugin option by name (``options.reassociate_products``)."""
            if not name.startswith("_"):
                private = object.__getattribute__(self, "__pydantic_private__") or {}
                values = private.get("_plugin_values", {})
                if name in values:
                    return values[name]
            return super().__getattr__(name)

    def plugin_options(self) -> dict[str, tuple[str, Any]]:
        """Every plugin option of this ``fuse()`` call: ``{name: (plugin, value)}``."""
        return {name: (self._plugin_owners[name], value) for name, value in self._plugin_values.items()}

    @classmethod
    def parse(cls, options: dict[str, Any], plugin_models: Optional[dict[str, type[BaseModel]]] = None) -> FuseOptions:
        """``fuse()``'s keyword options, the core's and those of the loaded plugins
        (``plugin_models``: each plugin's options model, by plugin name).

        :raises AutoFuserError: an unknown name (the message lists every known option and
            which plugin owns each) or an invalid value (naming the option, and its plugin).
        """
        plugin_models = plugin_models or {}
        owners = {name: plugin for plugin, model in plugin_models.items() for name in model.model_fields}
        core = {k: v for k, v in options.items() if k not in owners}
        problems = []
        try:
            parsed = cls(**core)
        except ValidationError as err:
            problems.append(_option_problems(err))
        values: dict[str, Any] = {}
        for plugin, model in plugin_models.items():
            given = {k: v for k, v in options.items() if owners.get(k) == plugin}
            try:
                values.update(dict(model(**given)))
            except ValidationError as err:
                problems.append(_option_problems(err, plugin))
        if problems:
            known = ", ".join(cls.model_fields)
            if owners:
                known += "; plugin options: " + ", ".join(f"{name} (plugin {p!r})" for name, p in owners.items())
            raise AutoFuserError(f"invalid fuse() option(s): {'; '.join(problems)}. Known options: {known}.")
        parsed._plugin_values = values
        parsed._plugin_owners = {name: owners[name] for name in values}
        return parsed

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _folder_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("quantize", mode="before")
    @classmethod
    def _parse_quantize(cls, value: Any) -> Optional[QuantizeOptions]:
        return parse_quantize(value)


#: What a refused option value should have been, by pydantic's error type.
_ALLOWED_VALUES = {
    "bool_type": "give True or False",
    "int_type": "give an int (not a str, float or bool)",
    "float_type": "give a number (int or float)",
    "string_type": "give a str (a folder path) or None",
}


#: Options whose allowed values the type's hint alone would not say.
_ALLOWED_HINTS = {"dynamic": "give None (specialise first, then what varies), True or False"}


def _option_problems(err: ValidationError, plugin: Optional[str] = None) -> str:
    """Each refused option as ``name=value (type): what is wrong; what is allowed``, and
    the plugin owning it where ``plugin`` is given."""
    owner = f" (an option of plugin {plugin!r})" if plugin is not None else ""
    problems = []
    for e in err.errors():
        name = ".".join(map(str, e["loc"]))
        given = e.get("input")
        hint = _ALLOWED_HINTS.get(name) or _ALLOWED_VALUES.get(e["type"])
        problems.append(f"{name}={given!r} ({type(given).__name__}){owner}: {e['msg']}" + (f"; {hint}" if hint else ""))
    return "; ".join(problems)


class _Unguardable(Exception):
    """A call argument the signature guard can't compare; the message says why and what to pass instead."""


# -- the signature guard: call arguments --------------------------------------------

#: Values compared by value whose type is part of the key: ``1 == True == 1.0``, but code may
#: tell them apart.
_PLAIN_TYPES = (bool, int, str, bytes, torch.dtype, torch.device, torch.memory_format, torch.layout, enum.Enum)


def _constant_key(x: Any) -> Any:
    """A hashable key that two values share only when no code reading them can tell them
    apart: equal plain values of one type (a float by its bits, so NaN matches NaN and
    -0.0 is not 0.0), and tuples, lists, sets, dicts, NamedTuples and frozen dataclasses of
    them, by content. Recomputed on every call, so a list changed in place changes it.

    :raises _Unguardable: ``x`` is (or holds) anything else - an object whose attributes may
        change between calls unseen (one that compares by identity, or by a value it may
        change), or a tensor inside a container that capture keeps whole (a set, a dataclass).
    """
    if x is None or x is Ellipsis:
        return x
    kind = type(x)
    if isinstance(x, float):
        return kind, x.hex()
    if isinstance(x, complex):
        return kind, x.real.hex(), x.imag.hex()
    if isinstance(x, _PLAIN_TYPES):
        return kind, x
    if isinstance(x, (tuple, list)):  # torch.Size and NamedTuples too
        return kind, tuple(map(_constant_key, x))
    if isinstance(x, (set, frozenset)):
        return kind, frozenset(map(_constant_key, x))
    if isinstance(x, dict):
        return kind, tuple((_constant_key(k), _constant_key(v)) for k, v in x.items())
    if kind is slice:
        return kind, _constant_key(x.start), _constant_key(x.stop), _constant_key(x.step)
    if kind is range:
        return kind, x.start, x.stop, x.step
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and kind.__dataclass_params__.frozen:
        return kind, tuple(_constant_key(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, torch.Tensor):
        raise _Unguardable(
            "a tensor inside a container capture keeps whole is read as a constant; pass "
            "the tensor as an argument of its own, or in a tuple, list or dict"
        )
    try:
        hash(x)
    except Exception:
        raise _Unguardable(
            f"a {kind.__name__} can't be hashed, so a compiled graph can't tell when it "
            "changes; pass a tensor or plain numbers instead"
        ) from None
    raise _Unguardable(
        f"a {kind.__name__} object is neither a plain value nor a frozen container of them: a compiled graph "
        "would keep what forward read from it on the first call, and a later change inside it "
        "(obj.scale = 5.0) would go unseen. To fuse, pass the values themselves (numbers, strings, tuples), "
        "or a frozen dataclass or NamedTuple of them"
    )


def _argument_key(x: Any) -> Any:
    """The signature key of one call argument: a tensor by shape, dtype, device, strides and
    ``requires_grad`` (it is a graph input), containers capture flattens by their items,
    anything else by ``_constant_key`` (capture reads it as a constant)."""
    if isinstance(x, torch.Tensor):
        return "T", tuple(x.shape), x.dtype, x.device, x.stride(), x.requires_grad
    kind = type(x)
    if kind is tuple or kind is list or (isinstance(x, tuple) and hasattr(kind, "_fields")):
        return kind, tuple(map(_argument_key, x))
    if kind in _FLATTENED_DICTS:
        return kind, tuple((_constant_key(k), _argument_key(v)) for k, v in x.items())
    return _constant_key(x)


#: Dicts whose tensors capture takes as inputs (torch's pytree flattens them).
_FLATTENED_DICTS = (dict, OrderedDict, defaultdict)


# -- the shape-class guard: dynamic dimensions (docs/dynamic.md) ---------------------


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The call's tensor arguments in the order ``_argument_key`` walks them: a tensor's
    place in this list is its *position*, by which dynamic dims are remembered."""
    found: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
            return
        kind = type(x)
        if kind is tuple or kind is list or (isinstance(x, tuple) and hasattr(kind, "_fields")):
            for item in x:
                walk(item)
        elif kind in _FLATTENED_DICTS:
            for item in x.values():
                walk(item)

    for x in args:
        walk(x)
    for x in kwargs.values():
        walk(x)
    return found


def _layout_class(tensor: torch.Tensor) -> Any:
    """A tensor's strides as far as they don't depend on its sizes: ``("dense", order)``
    for one that covers its memory without gaps in some order of its dims (contiguous,
    a permute of a contiguous one), else its exact strides."""
    sizes, strides = tensor.shape, tensor.stride()
    order = sorted((d for d in range(tensor.dim()) if sizes[d] != 1), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if strides[d] != expected:
            return ("strided", tuple(strides))
        expected *= sizes[d]
    return ("dense", tuple(order))


def _class_tensor_key(tensor: torch.Tensor, dims: frozenset[int], buckets: bool) -> Any:
    """A tensor's key in a shape class: each dim of ``dims`` of size 2 or more by its size
    bucket (``buckets``) or as any size; sizes 0 and 1 stay specialised, as torch's do."""
    shape = tuple(
        (("*", bucket(size)) if buckets else "*") if d in dims and size >= 2 else size
        for d, size in enumerate(tensor.shape)
    )
    general = any(isinstance(s, tuple) or s == "*" for s in shape)
    stride = _layout_class(tensor) if general else tensor.stride()
    return "T", shape, tensor.dtype, tensor.device, stride, tensor.requires_grad


def _class_argument_key(x: Any, tensor_key) -> Any:
    """``_argument_key`` with each tensor keyed by ``tensor_key(tensor)``."""
    if isinstance(x, torch.Tensor):
        return tensor_key(x)
    kind = type(x)
    if kind is tuple or kind is list or (isinstance(x, tuple) and hasattr(kind, "_fields")):
        return kind, tuple(_class_argument_key(item, tensor_key) for item in x)
    if kind in _FLATTENED_DICTS:
        return kind, tuple((_constant_key(k), _class_argument_key(v, tensor_key)) for k, v in x.items())
    return _constant_key(x)


def _class_key(key: tuple, args: tuple, kwargs: dict, dims: Sequence[frozenset[int]], buckets: bool = True) -> tuple:
    """The signature ``key`` of this call with each tensor's dims of ``dims`` (by position)
    generalised (``_class_tensor_key``): what every call of one shape class shares."""
    position = iter(range(len(dims)))

    def tensor_key(tensor: torch.Tensor) -> Any:
        return _class_tensor_key(tensor, dims[next(position)], buckets)

    arguments = tuple(_class_argument_key(x, tensor_key) for x in args)
    keywords = tuple((name, _class_argument_key(v, tensor_key)) for name, v in kwargs.items()) if kwargs else ()
    return (arguments, keywords, *key[2:])


#: Compiled shapes kept per shape class; the least recently called goes first past it
#: (its next call compiles again, finding every kernel in the class's cache).
MAX_SHAPES_PER_CLASS = 32


@dataclasses.dataclass
class _ShapeClass:
    """One shape class of a fused model: calls that differ only in the sizes of their
    dynamic dims, within the same size buckets (docs/dynamic.md). ``dims``: the dynamic
    dims of each tensor argument, by position; ``described``: those dims for the report;
    ``family``: its key without size buckets, which counts once against ``max_signatures``;
    ``verified``: the kernels (``checked_key``: source digest and config) whose checks
    passed for this class (a later shape of it checks them on its real inputs only);
    ``shapes``: how many of its shapes compiled; ``first_report``: the first one's report,
    whose whole-forward verdict (measured on a GPU) its later shapes follow, as they follow
    its training step's gradient check (``gradients_wrong``)."""

    dims: tuple[frozenset[int], ...]
    described: list[str]
    family: Any  # the class key without buckets: the classes of one family share a signature slot
    verified: set[str] = dataclasses.field(default_factory=set)
    shapes: int = 0
    first_report: Optional[FusionReport] = None
    gradients_wrong: bool = False  # the first shape's fused training step failed its gradient check


# -- the signature guard: the model's own state -------------------------------------

#: nn.Module's bookkeeping in every module's ``__dict__`` (the parameter, buffer, submodule
#: and hook dicts; the train/eval flag): watched through those dicts and the signature.
_MODULE_BOOKKEEPING = frozenset(torch.nn.Module().__dict__)

#: Names of torch's process-wide module hooks (``register_module_forward_hook`` and kin),
#: which fire on every module called.
_GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
_GLOBAL_HOOKS = tuple(
    getattr(torch.nn.modules.module, name) for name in _GLOBAL_HOOK_DICTS if hasattr(torch.nn.modules.module, name)
)


def _global_module_hooks() -> bool:
    """Whether any process-wide module hook is registered."""
    return any(_GLOBAL_HOOKS)


def _hook_dicts(module: torch.nn.Module) -> tuple:
    return (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)


def _hook_count() -> int:
    """Every hook torch registers (on a module, a tensor or globally) takes its handle's id
    from one counter: a new value means some hook was registered since."""
    return RemovableHandle.next_id


#: Changes of the model's state between calls (other than plain attribute values) that
#: each recompile; past this many, calls run the original model (``reset()`` restarts).
STATE_CHANGE_LIMIT = 8


class _ModelState:
    """The model's own state that a compiled graph may have baked in, and a cheap test of
    whether it changed since it was last taken. docs/guard.md lists what is seen.

    Taken for every module of the model: which submodules, parameters and buffers it
    holds and every attribute in its ``__dict__`` but nn.Module's bookkeeping (the objects
    themselves), how many entries each of those four dicts has, the hooks of each module,
    and the counter that every hook registered anywhere counts up. ``unchanged`` compares
    the objects by identity, the counts and the counter, in passes that run in C (it runs
    on every call); a hook removed alone is not seen by it (the module it was on keeps
    running unchanged, which is right, until the next change). ``take`` looks closer: it
    tells an attribute given a new but equal plain value (no change) from one given
    another value (the ``constants`` key changes: the signature differs, and each value
    compiles on its own) from everything else (``take`` returns it: compiled graphs hold
    the old objects, so they must go).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._entries: Optional[dict] = None
        self.take()

    def unchanged(self) -> bool:
        if _hook_count() != self._hooks_counted:
            return False
        try:
            if not all(map(operator.is_, map(operator.getitem, self._dicts, self._keys), self._values)):
                return False
        except KeyError:  # an entry was deleted
            return False
        return tuple(map(len, self._sized)) == self._lens

    def count_hooks(self) -> None:
        """Note the hooks registered so far as seen: after a call, whose own hooks (on
        tensors, inside parts that run unchanged) need no recompile."""
        self._hooks_counted = _hook_count()

    def absorb(self) -> None:
        """Take the state anew without calling anything a change: after a call, whose
        opaque parts (run unchanged, reading their state live) may have updated it."""
        self.count_hooks()
        if not self.unchanged():
            self.take()

    def take(self) -> list[str]:
        """Take the state anew. Returns the changes since the last take that compiled
        graphs can't follow (a submodule, parameter, buffer or non-constant attribute
        replaced, added or removed; hooks added or removed), one phrase each."""
        entries: dict[tuple[str, str, str], Any] = {}
        dicts, keys, sized, hooks = [], [], [], {}
        named = list(self.model.named_modules())
        self.modules = [module for _, module in named]
        for path, module in named:
            for kind, table in (
                ("attribute", module.__dict__),
                ("submodule", module._modules),
                ("parameter", module._parameters),
                ("buffer", module._buffers),
            ):
                for name in table:
                    if kind == "attribute" and name in _MODULE_BOOKKEEPING:
                        continue
                    entries[(path, kind, name)] = table[name]
                    dicts.append(table)
                    keys.append(name)
                sized.append(table)
            hooks[path] = tuple(tuple(d) for d in _hook_dicts(module))
        changes = self._changes(entries, hooks) if self._entries is not None else []
        self._entries, self._hooks = entries, hooks
        self._dicts, self._keys, self._sized = dicts, keys, sized
        self._values = tuple(map(operator.getitem, dicts, keys))
        self._lens = tuple(map(len, sized))
        self._hooks_counted = _hook_count()
        constants = []
        for (path, kind, name), value in entries.items():
            if kind == "attribute":
                with contextlib.suppress(_Unguardable, RecursionError):  # a list holding itself
                    constants.append((path, name, _constant_key(value)))
        self.constants = tuple(constants)
        self.backward_hooked = [path or "<model>" for path, (_, _, pre, post) in hooks.items() if pre or post]
        return changes

    def _changes(self, entries: dict, hooks: dict) -> list[str]:
        assert self._entries is not None  # called only once there is a snapshot to compare with
        changes = []
        for where in [*self._entries, *(w for w in entries if w not in self._entries)]:
            before, now = self._entries.get(where, _MISSING), entries.get(where, _MISSING)
            if before is now or (where[1] == "attribute" and _both_constants(before, now)):
                continue
            path, kind, name = where
            qualified = f"{path}.{name}" if path else name
            what = f"{kind} {qualified!r}"
            changes.append(
                f"{what} added" if before is _MISSING else f"{what} removed" if now is _MISSING else f"{what} replaced"
            )
        for path in hooks.keys() | self._hooks.keys():
            if hooks.get(path) != self._hooks.get(path):
                changes.append(f"hooks of {path or '<model>'!r} added or removed")
        return changes


_MISSING = object()


def _both_constants(a: Any, b: Any) -> bool:
    """Whether both are plain constants (their values go into the signature, not a recompile)."""
    try:
        _constant_key(a), _constant_key(b)
    except (_Unguardable, RecursionError):
        return False
    return True


class FusedModule(torch.nn.Module):
    """Behaves like the wrapped model; runs fused kernels. See module doc."""

    def __init__(
        self,
        model: torch.nn.Module,
        plugins: Optional[Sequence[Any]],
        options: FuseOptions,
        plugin_set: Optional[PluginSet] = None,
    ):
        super().__init__()
        self._plugins = plugins
        self._plugin_set = plugin_set if plugin_set is not None else _load_plugins_quietly(plugins)
        self._quantized: list[QuantizedLayer] = []
        if options.quantize is not None:
            # A quantised copy; the caller's model keeps its float weights.
            model, self._quantized = quantize_model(model, options.quantize, self._plugin_set.registry)
        # Not a registered submodule: state_dict keys stay those of the model.
        object.__setattr__(self, "_model", model)
        self._options = options
        self._compiled: "OrderedDict[Any, _Compiled]" = OrderedDict()
        self._classes: dict[Any, _ShapeClass] = {}  # shape classes by class key (docs/dynamic.md)
        # dynamic=None: the dims, by tensor position, that changed between two calls.
        self._learned_dims: dict[int, frozenset[int]] = {}
        self._last_key: Any = None
        self._last_report: Optional[FusionReport] = None
        self._warned: set[str] = set()
        # AUTOFUSER_DISABLE, read once here: every call runs the model itself, nothing compiles.
        self._disabled = logs.disabled()
        self._watch_state()
        self._forward_signature = inspect.signature(model.forward)
        forward_parameters = self._forward_signature.parameters.values()
        # Calls that pass exactly the positional parameters need no binding.
        self._positional_count = (
            -1
            if any(p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in forward_parameters)
            else len(forward_parameters)
        )

    # -- nn.Module plumbing: everything that holds state is the model's ------

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def state_dict(self, *args, **kwargs):
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._model.load_state_dict(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._model.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._model.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._model.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._model.named_buffers(*args, **kwargs)

    def children(self):
        return self._model.children()

    def named_children(self):
        return self._model.named_children()

    def modules(self):
        return self._model.modules()

    def named_modules(self, *args, **kwargs):
        # DistributedDataParallel finds the parameters module by module through this.
        return self._model.named_modules(*args, **kwargs)

    def train(self, mode: bool = True):
        self._model.train(mode)
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda()/.half() move the model; compiled graphs hold its tensors, so drop them.
        self._model._apply(fn, *args, **kwargs)
        self._compiled.clear()
        self._classes.clear()
        self._state.take()  # parameters may be new objects now; nothing compiled holds the old ones
        self._state_key = _StateKey(self._state.constants)
        return self

    def __repr__(self) -> str:
        return f"FusedModule({self._model!r})"

    # -- attributes: reads fall through to the model ----------------------------

    def __getattr__(self, name: str) -> Any:
        # Only reached where normal lookup failed: the wrapper has no such attribute.
        try:
            return super().__getattr__(name)  # the wrapper's own parameters, buffers, submodules (none)
        except AttributeError:
            pass
        model = self.__dict__.get("_model")  # absent while unpickling: no recursion
        if model is None:
            raise AttributeError(f"'FusedModule' object has no attribute {name!r}")
        if name.startswith("_"):
            # Private names stay the wrapper's: torch and other libraries probe them on the
            # module they were given, and must not find the model's bookkeeping there.
            raise AttributeError(
                f"'FusedModule' object has no attribute {name!r}; the wrapped model's "
                f"attributes are at fused.model.{name}"
            )
        return getattr(model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        model = self.__dict__.get("_model")
        if (
            model is not None
            and not name.startswith("_")
            and name not in self.__dict__
            and not hasattr(type(self), name)
            and hasattr(model, name)
        ):
            # Set on the wrapper, it would shadow the model's attribute for reads through
            # the wrapper, and forward would never see it.
            raise AttributeError(
                f"fused.{name} = ... would set an attribute of the FusedModule wrapper, not of "
                f"the {type(model).__name__} it runs; set fused.model.{name} instead (the "
                "guard sees the change)."
            )
        super().__setattr__(name, value)

    # -- copying and saving: compiled kernels and loaded plugins are per process ---

    _PER_PROCESS = (
        "_plugin_set",
        "_compiled",
        "_classes",
        "_last_report",
        "_last_key",
        "_forward_signature",
        "_state",
        "_state_key",
    )

    def __deepcopy__(self, memo):
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        shared = ("_model", "_plugins")  # the model is copied below; plugin modules can't be, nor need be
        state = {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS and k not in shared}
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone._plugins = self._plugins
        object.__setattr__(clone, "_model", copy.deepcopy(self._model, memo))
        clone._plugin_set, clone._compiled, clone._last_report = self._plugin_set, OrderedDict(), None
        clone._classes = {}
        clone._last_key = None
        clone._watch_state()
        clone._forward_signature = inspect.signature(clone._model.forward)
        return clone

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}
        state["_plugins"] = _plugins_to_save(self._plugins, self._plugin_set.names)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._plugins = _plugins_to_load(self._plugins)
        self._plugin_set = _load_plugins_quietly(self._plugins)
        self._compiled, self._last_report, self._last_key = OrderedDict(), None, None
        self._classes = {}
        self._learned_dims = dict(state.get("_learned_dims", {}))
        self._warned = set(state.get("_warned", ()))
        self._disabled = logs.disabled()  # this process's switch, not the saving one's
        self._watch_state()
        self._forward_signature = inspect.signature(self._model.forward)

    # -- signatures -----------------------------------------------------------

    def _watch_state(self) -> None:
        """Start watching the model's own state afresh (docs/guard.md)."""
        self._state = _ModelState(self._model)
        self._state_key = _StateKey(self._state.constants)
        self._state_changes = 0  # changes that recompiled

    def _signature(self, args: tuple, kwargs: dict) -> Any:
        autocast = tuple(
            (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")
        )
        modes = tuple(map(_training, self._state.modules))
        precision = fp32_settings()
        arguments = tuple(map(_argument_key, args))
        keywords = tuple((name, _argument_key(value)) for name, value in kwargs.items()) if kwargs else ()
        return (arguments, keywords, torch.is_grad_enabled(), autocast, modes, precision, self._state_key)

    def _state_changed(self) -> None:
        """The model's state is not what it was at the last call: see what changed."""
        changes = self._state.take()
        self._state_key = _StateKey(self._state.constants)
        if not changes or not self._compiled:
            return  # plain attribute values only (they are in the signature), or nothing to drop
        self._compiled.clear()  # compiled graphs hold the old objects
        self._classes.clear()
        self._last_report = None
        self._state_changes += 1
        shown = "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else "")
        logger.info("the model changed between calls (%s): compiling again", shown)
        if self._state_changes > STATE_CHANGE_LIMIT:
            self._warn_once(
                "state",
                (
                    f"AutoFuser: the model changed between calls {self._state_changes} times in ways that each "
                    f"need a recompile (the last: {shown}); calls now run the original model. After a change "
                    "meant to last, call fused.reset(); values that change from call to call belong in "
                    "forward's arguments."
                ),
            )

    def _why_original(self) -> Optional[tuple[str, str]]:
        """Why this call must run the original model - (kind, warning) - or ``None``."""
        if _global_module_hooks():
            # They fire on every module called; traced or fused modules are never called.
            return (
                "global",
                "AutoFuser: a global module hook is registered (register_module_forward_hook "
                "or kin), which must see every module called; while one is, calls run the "
                "original model.",
            )
        if self._state_changes > STATE_CHANGE_LIMIT:
            return ("state", "")
        return None

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned and message:
            warnings.warn(message)
            self._warned.add(kind)

    def _run_original(self, args: tuple, kwargs: dict):
        try:
            return self._model(*args, **kwargs)
        finally:
            self._state.absorb()

    # -- forward ----------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if _global_module_hooks() and not any(_hook_dicts(self)):
            # nn.Module.__call__ would fire the global hooks on this wrapper too, a module eager
            # doesn't have; forward runs the model, whose own call fires them on each module.
            return self.forward(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if self._disabled:
            return self._model(*args, **kwargs)
        # The signature of the call before, for a probation (``in_use``) to see calls of other
        # inputs in between; None after a call that ran the original for another reason.
        last_key, self._last_key = self._last_key, None
        if not self._state.unchanged():
            self._state_changed()
        why = self._why_original()
        if why is not None:
            self._warn_once(*why)
            return self._run_original(args, kwargs)
        try:
            key = self._signature(args, kwargs)
        except _Unguardable as err:
            # The graph bakes in non-tensor arguments; one that can't be compared can't be guarded.
            where = self._unguardable_argument(args, kwargs)
            self._warn_once(
                "argument",
                f"AutoFuser: argument {where} can't be guarded: {err}. Calls "
                "passing such an argument run the original model.",
            )
            return self._run_original(args, kwargs)
        entry = self._compiled.get(key)
        if entry is None:
            shape_class = self._shape_class(key, args, kwargs) if self._options.dynamic is not False else None
            new_slot = shape_class is None or shape_class[3] not in {c.family for c in self._classes.values()}
            if new_slot and self._signatures_held() >= self._options.max_signatures:
                self._warn_once(
                    "full",
                    (
                        f"AutoFuser: {self._options.max_signatures} signatures are already compiled "
                        "(max_signatures); new ones - new input shapes, dtypes or non-tensor arguments, or new "
                        "values of the model's plain attributes - run the original model. Raise max_signatures "
                        "to compile more; sizes that vary from call to call (point counts) compile once per "
                        "shape class with autofuser.mark_dynamic(x, dim) or fuse(..., dynamic=True) "
                        "(docs/dynamic.md)."
                    ),
                )
                return self._run_original(args, kwargs)
            try:
                # Compiling runs the model and autograd a few times of its own: tensors it
                # saves are not the caller's, whose saved-tensor hooks (a checkpoint
                # counting what its region saves, offloading) must not see them.
                with _own_saved_tensors():
                    entry = self._compile(args, kwargs, key, shape_class)
            finally:
                self._state.absorb()  # capture and verification ran the forward a few times
            compiled_now = True
        else:
            self._compiled.move_to_end(key)
            compiled_now = False
        graph_module, report = entry
        self._last_report = report
        self._last_key = key
        if entry.in_use is not None and not compiled_now:  # the compiling call runs what it compiled
            graph_module = self._in_use_runner(key, entry, last_key)
        if graph_module is None:
            return self._run_original(args, kwargs)
        try:
            return graph_module(*self._flatten(args, kwargs))
        finally:
            if entry.runs_model_code:
                self._state.absorb()  # parts that run unchanged may update the state they read live
            else:
                self._state.count_hooks()  # kernels may register hooks on tensors: no change

    def _in_use_runner(self, key: Any, entry: "_Compiled", last_key: Any):
        """What runs for this call of a signature on probation (``in_use``): the fused
        runner, or ``None`` for the original; the call after the plan settles on one of
        them for good, says so in the report and files the verdict in the cache."""
        check, (current, report) = entry.in_use, entry
        assert check is not None
        filing: _Filing = check.filing
        # The fused runner the plan times: what runs now, unless the compile's verdict was
        # provisional and the original runs meanwhile.
        fused = check.candidate if check.candidate is not None else current
        if _inside_backward() or _capturing():
            # A forward recomputed in backward (activation checkpointing) must run what its
            # first pass ran; a CUDA graph captured now replays without calling forward.
            # Neither is a call of the loop: the plan neither moves nor marks.
            self._last_key = last_key
            return None if check.last == "original" else fused
        if not take_turn(check):
            return current  # another module's plan is under way: the compile's verdict until then
        interrupted = last_key != key or check.turn_lost
        check.turn_lost = False
        if check.calls and interrupted and check.interrupted():
            report.notes.append(
                f"{filing.what} not checked in use: calls of other inputs came between its calls "
                f"{MAX_RESTARTS + 1} times; the compile's verdict stands"
            )
            entry.in_use = None
            end_turn(check)
            return current
        planned = check.runner()
        if planned is None:
            settled = check.settle(FORWARD_MARGIN)
            if settled is None:  # a verdict inside the noise: the plan again, from this call
                planned = check.runner()
        if planned is not None:
            return fused if planned == "fused" else None
        assert settled is not None
        entry.in_use = None
        end_turn(check)
        faster = settled.runner == "fused"
        verdict = "the fused model runs" if faster else "the original runs"
        lead = 1.0 - settled.fused_ms / settled.original_ms
        if settled.provisional:
            verdict = f"its lead ({100 * lead:.1f}%) is inside that spread: the original runs, provisionally"
        if not faster and current is not None:
            verdict += " (switched back from the fused model, which won at compile time)"
        report.notes.append(
            f"{filing.what} in use, {settled.blocks} blocks of {BLOCK_CALLS} calls on each side: "
            f"{settled.fused_ms:.3f} ms fused vs {settled.original_ms:.3f} ms original per call, "
            f"blocks spread {100 * settled.spread:.1f}%: {verdict}"
        )
        self._progress(
            f"{filing.what} in use: {settled.fused_ms:.3f} ms fused vs {settled.original_ms:.3f} ms original: {verdict}"
        )
        if filing.key is not None:
            # Filed beside the entry's other decisions; a provisional one is not final.
            known = read_verdict(filing.root, filing.key)
            times, records = dict(known.times), dict(known.records)
            times[filing.fused_time], times[filing.original_time] = settled.fused_ms, settled.original_ms
            records[filing.decision] = make_record(
                IN_USE_TIMING, settled.spread, settled.blocks, settled.provisional, in_use=True
            )
            write_verdict(filing.root, filing.key, times, records)
        report.whole = "training step" if filing.what == "training step" else "forward"
        report.whole_eager_ms, report.whole_fused_ms = settled.original_ms, settled.fused_ms
        if faster:
            if current is not fused:
                self._compiled[key] = _Compiled((fused, report), filing.runs_model_code, like=entry)
            report.runs_original = False
            return fused
        report.runs_original = True
        self._compiled[key] = _Compiled((None, report), True, like=entry)
        return None

    # -- shape classes (docs/dynamic.md) -------------------------------------------

    def _signatures_held(self) -> int:
        """Compiled signatures counted against ``max_signatures``: the shape classes that
        differ only in their size buckets count once together, however many of their shapes
        compiled (a bucket is a power of two: a few cover any range of sizes)."""
        specialised = sum(1 for entry in self._compiled.values() if entry.shape_class is None)
        return specialised + len({klass.family for klass in self._classes.values()})

    def _dynamic_dims(self, tensors: Sequence[torch.Tensor]) -> list[frozenset[int]]:
        """The dynamic dims of each tensor argument: marked (``mark_dynamic``), every dim
        (``dynamic=True``), or seen to change (``dynamic=None``)."""
        every = self._options.dynamic is True
        dims = []
        for position, tensor in enumerate(tensors):
            found = marked_dims(tensor) | self._learned_dims.get(position, frozenset())
            if every:
                found = frozenset(range(tensor.dim()))
            dims.append(frozenset(d for d in found if d < tensor.dim()))
        return dims

    def _learn_dims(self, key: tuple, args: tuple, kwargs: dict, tensors: Sequence[torch.Tensor]) -> None:
        """``dynamic=None``: where this call differs from a compiled specialised one only in
        some dims' sizes (same ranks, dtypes, layouts, other arguments and state), those
        dims are dynamic from now on."""
        every = [frozenset(range(t.dim())) for t in tensors]
        shape_free = _class_key(key, args, kwargs, every, buckets=False)
        shapes = [tuple(t.shape) for t in tensors]
        for entry in self._compiled.values():
            if entry.shape_class is not None or entry.shape_free != shape_free:
                continue
            for position, (old, new) in enumerate(zip(entry.shapes, shapes)):
                changed = frozenset(d for d, (a, b) in enumerate(zip(old, new)) if a != b)
                if changed:
                    self._learned_dims[position] = self._learned_dims.get(position, frozenset()) | changed
            logger.info("sizes changed between calls: dims %s are dynamic from now on", self._learned_dims)
            return

    def _shape_class(self, key: tuple, args: tuple, kwargs: dict) -> Optional[tuple]:
        """This call's shape class - ``(class key, dims by position, description, the class
        key without buckets)`` - or ``None`` where it has no dynamic dim (it compiles
        specialised, as ever)."""
        tensors = _tensors_in(args, kwargs)
        dims = self._dynamic_dims(tensors)
        if self._options.dynamic is None and not any(self._generalised(tensors, dims)):
            self._learn_dims(key, args, kwargs, tensors)
            dims = self._dynamic_dims(tensors)
        if not any(self._generalised(tensors, dims)):
            return None
        for position, found in enumerate(dims):
            if found:  # a dim marked once stays dynamic at its position, marked again or not
                self._learned_dims[position] = self._learned_dims.get(position, frozenset()) | found
        names = self._argument_names(args, kwargs)
        described = [
            f"{names[p] if p < len(names) else f'tensor {p}'} dim {d} (size {t.shape[d]}, bucket {bucket(t.shape[d])})"
            for p, (t, ds) in enumerate(zip(tensors, dims))
            for d in sorted(ds)
            if t.shape[d] >= 2
        ]
        family = _class_key(key, args, kwargs, dims, buckets=False)
        return _class_key(key, args, kwargs, dims), tuple(dims), described, family

    @staticmethod
    def _generalised(tensors: Sequence[torch.Tensor], dims: Sequence[frozenset[int]]) -> list[bool]:
        """Per tensor, whether a dynamic dim of it is generalised (sizes 0 and 1 stay specialised)."""
        return [any(t.shape[d] >= 2 for d in ds) for t, ds in zip(tensors, dims)]

    def _argument_names(self, args: tuple, kwargs: dict) -> list[str]:
        """A name per tensor argument, by position, for the report (``x``, ``inputs[1]``)."""
        params = [p.name for p in self._forward_signature.parameters.values()]
        names: list[str] = []

        def walk(x: Any, name: str) -> None:
            if isinstance(x, torch.Tensor):
                names.append(name)
                return
            kind = type(x)
            if kind is tuple or kind is list or (isinstance(x, tuple) and hasattr(kind, "_fields")):
                for i, item in enumerate(x):
                    walk(item, f"{name}[{i}]")
            elif kind in _FLATTENED_DICTS:
                for k, item in x.items():
                    walk(item, f"{name}[{k!r}]")

        for i, x in enumerate(args):
            walk(x, params[i] if i < len(params) else f"argument {i + 1}")
        for k, x in kwargs.items():
            walk(x, k)
        return names

    def _size_rule(self, tensors: Sequence[torch.Tensor], dims: Sequence[frozenset[int]]) -> SizeRule:
        """Which sizes of this call's compile are dynamic: its dynamic dims' sizes; static,
        every other size of its inputs and of the model's parameters and buffers."""
        dynamic = {t.shape[d] for t, ds in zip(tensors, dims) for d in ds if t.shape[d] >= 2}
        static = {size for t, ds in zip(tensors, dims) for d, size in enumerate(t.shape) if d not in ds}
        for tensor in [*self._model.parameters(), *self._model.buffers()]:
            static.update(tensor.shape)
        return SizeRule(frozenset(dynamic), frozenset(static - dynamic))

    def _unguardable_argument(self, args: tuple, kwargs: dict) -> str:
        """Which argument the guard refused, for the warning: its parameter name."""
        names = [
            p.name
            for p in self._forward_signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        for index, value in enumerate(args):
            try:
                _argument_key(value)
            except _Unguardable:
                return repr(names[index]) if index < len(names) else f"number {index + 1}"
        for name, value in kwargs.items():
            try:
                _argument_key(value)
            except _Unguardable:
                return repr(name)
        return "?"

    def _flatten(self, args: tuple, kwargs: dict) -> tuple:
        """The call's inputs in the captured graph's placeholder order, defaults filled in."""
        if not kwargs and len(args) == self._positional_count:
            return args  # the common case, kept cheap: it runs on every call
        return tuple(bind_inputs(self._model, args, kwargs, self._forward_signature)[2])

    def _progress(self, message: str) -> None:
        """One line about this model outside a compile (a training step settled in use)."""
        Progress(self.display_name, self._options.progress).finish(message)

    @property
    def display_name(self) -> str:
        """The model's name in progress lines and reports: its class, or what the
        ``torch.compile`` backend named one of Dynamo's graphs."""
        return self.__dict__.get("_display_name") or type(self._model).__name__

    def _compile(
        self,
        args: tuple,
        kwargs: dict,
        key: Any,
        shape_class: Optional[tuple] = None,
        launched: Optional[str] = None,
        started: Optional[float] = None,
    ):
        """Capture, compile and check one signature; its ``_Compiled`` entry. ``launched``: why
        this compile times its groups launched whatever the captured graph shows (a second
        compile, ``_relaunch``); ``started``: when the first compile of this signature began."""
        start = time.perf_counter() if started is None else started
        name = self.display_name
        # A call with dynamic dims: its kernels take those sizes at run time (size_rule), and
        # a later shape of a class already compiled checks its kernels on its inputs only.
        tensors = _tensors_in(args, kwargs)
        rule: Optional[SizeRule] = None
        klass: Optional[_ShapeClass] = None
        if shape_class is not None:
            class_key, dims, described, family = shape_class
            klass = self._classes.get(class_key)
            if klass is None:
                klass = self._classes[class_key] = _ShapeClass(dims, described, family)
            rule = self._size_rule(tensors, dims)
        later_in_class = klass is not None and klass.shapes > 0
        checked_sources: set[str] = set()  # the kernels this compile checked, for its class
        progress = Progress(name, self._options.progress)
        progress.step("capture", detail=short_inputs(_input_parts(args)))
        with warnings.catch_warnings():
            # Tracing through a module with backward hooks (they do nothing without gradients)
            # makes torch warn that its output is no tensor: it is a proxy.
            warnings.filterwarnings("ignore", "For backward hooks to be called")
            gm = capture(self._model, *args, **kwargs)
        captured_s = time.perf_counter() - start
        opaque = gm.meta.get("autofuser_opaque", {})
        if self._options.fullgraph and opaque:
            raise OpaquePartError(_opaque_message(name, opaque))
        flat = self._flatten(args, kwargs)
        if list(gm.meta.get("autofuser_opaque", {})) == [""]:
            report = FusionReport(
                plugins=self._plugin_set.names,
                opaque=dict(gm.meta["autofuser_opaque"]),
                notes=["the model could not be traced at all; it runs unchanged"],
            )
            entry: tuple[_Runner, FusionReport] = (None, report)
            runs_model_code, in_use = True, None
        else:
            grad = torch.is_grad_enabled()
            # Graph capture and timing run the forward many times: only for inference
            # (eval mode, no grad), and leaving buffers and RNG state as they were.
            inference = not grad and not any(m.training for m in self._state.modules)
            try:
                # Read before the graph passes change the graph: what the model itself does.
                kinds = _barrier_kinds(gm)
                never_replays = launched or (
                    _never_replays(gm, grad, inference, kinds) if self._options.cuda_graphs else None
                )
                captured_random = grad and _may_draw_random(gm, kinds)
                # Verifying runs the graph, and with it the model's own code in opaque parts; a
                # leaf method's module (the root's own) is no part of the graph module, whose
                # state that run restores: restore the model's too.
                with (
                    torch.no_grad(),
                    preserved_state(self._model),
                    size_rule(rule),
                    class_checked(klass.verified if klass is not None else None),
                    replaying(never_replays is None),
                ):
                    fused_gm, report = compile_graph(gm, flat, self._plugin_set, self._options, progress, backward=grad)
            except Exception as err:  # noqa: BLE001 - a fault of ours must not cost the user's call
                progress.finish("compiling failed; the original model runs (see the warning)")
                return self._compile_failed(key, args, flat, start, err, shape_class)
            checked_sources = {checked_key(k.source.source_hash, k.config) for k in fused_kernels(fused_gm)}
            progress.step("checking the whole forward")
            report.phases = {"capture": captured_s, **report.phases}
            if never_replays is not None and any(g.time_fused_ms is not None for g in report.groups):
                report.notes.append(f"groups timed launched, not as CUDA graphs: {never_replays}")
            runner: _Runner = fused_gm
            step = time.perf_counter()
            device = _device_of(flat)
            cuda = device.type == "cuda"
            # A forward that writes into its inputs can't replay as a graph: the replay would
            # write into its own static copies instead. Writes into tensors the forward makes
            # itself (FNO's `out_ft[..., :m] = ...`) or into parameters and buffers (the same
            # addresses on every replay) are fine.
            no_graph = False
            if later_in_class:
                # The class's first shape measured the whole forward; its later shapes run
                # what it chose, without timing each shape again (docs/dynamic.md).
                assert klass is not None and klass.first_report is not None
                if klass.first_report.runs_original and klass.first_report.whole_fused_ms is not None:
                    runner = None
                    report.notes.append(
                        "this shape class's first shape ran the original model (the fused forward was not "
                        "faster): so does this shape"
                    )
                elif klass.gradients_wrong and grad:
                    runner = None
                    report.notes.append(
                        "this shape class's first shape ran the original model (its fused training step's "
                        "gradients were wrong): so does this shape"
                    )
            elif self._options.cuda_graphs and inference and cuda:
                # A forward that never replays (it draws random numbers) is not captured to be refused.
                why_not = never_replays or self._why_no_graph(fused_gm, flat)
                no_graph = why_not is not None
                if no_graph:
                    report.notes.append(f"no CUDA graph: {why_not}")
            timer = timing.current()
            measured = (
                self._options.verify_speed and inference and timer.can_time_forward(device) and not later_in_class
            )
            vkey = _verdict_key(fused_gm, bool(report.fused), kwargs, flat) if measured else None
            root = cache_dir(self._options.cache_dir)
            known = read_verdict(root, vkey) if vkey is not None else Verdict({}, {})
            times, records = dict(known.times), dict(known.records)
            # Only a decision whose record says it was clear is reused: one provisional, or
            # with no record of how it was measured (an older cache), is measured again.
            trusted = {name for name, record in known.records.items() if not record["provisional"]}
            if known.times and not trusted:
                report.notes.append(
                    "cached whole-forward times are provisional, or carry no record of how they were "
                    "measured (an older cache): measured again"
                )
            if self._options.cuda_graphs and inference and not no_graph and cuda and not later_in_class:
                graph, why = None, None
                graph_known = "cuda_graph" in trusted and {"graph_ms", "plain_ms"} <= times.keys()
                slower_before = graph_known and times["graph_ms"] >= times["plain_ms"]
                if not slower_before:
                    with torch.no_grad(), preserved_state(self._model):
                        bound = None if graph_known else _gpu_bound(timer, fused_gm, flat)
                        if bound is not None:
                            why = bound
                        else:
                            graph, why = try_cuda_graph(fused_gm, flat, self._model)
                if graph is not None:
                    # Replays copy the inputs in and clone the outputs: worth it when launches, not
                    # bytes, dominate. Measured, not guessed; inside the noise, launching (the safe side).
                    graph_unclear: Optional[timing.Rounds] = None
                    if graph_known:
                        replays = times["graph_ms"] < times["plain_ms"]
                    else:
                        with torch.no_grad(), preserved_state(self._model):
                            found, verdict = _measure_decision(timer, graph, fused_gm, flat, 0.0)
                        times["graph_ms"], times["plain_ms"] = found.candidate_ms, found.baseline_ms
                        records["cuda_graph"] = make_record(GRAPH_TIMING, found.spread, found.rounds, verdict is None)
                        replays = bool(verdict)
                        graph_unclear = found if verdict is None else None
                    plain_ms, graph_ms = times["plain_ms"], times["graph_ms"]
                    if replays:
                        runner = graph
                        report.notes.append(
                            f"the compiled forward replays as one CUDA graph "
                            f"({graph_ms:.3f} ms vs {plain_ms:.3f} ms launched op by op)"
                        )
                    elif graph_unclear is not None:
                        report.notes.append(
                            "no CUDA graph, provisionally: "
                            + _unclear_note("replaying against launching", graph_unclear, 0.0)
                        )
                    else:
                        report.notes.append(
                            f"no CUDA graph: replaying it ({graph_ms:.3f} ms, with input copies and "
                            f"output clones) is not faster than launching ({plain_ms:.3f} ms)"
                        )
                elif slower_before:
                    report.notes.append(
                        f"no CUDA graph: replaying it ({times['graph_ms']:.3f} ms) was measured "
                        f"not faster than launching ({times['plain_ms']:.3f} ms)"
                    )
                else:
                    report.notes.append(f"no CUDA graph ({why}); kernels launch one by one")
            report.add_phase("cuda_graph", time.perf_counter() - step)
            step = time.perf_counter()
            candidate = runner  # the fused forward, as it runs: replayed as a graph or launched
            replayed = candidate is not fused_gm  # the fused model timed against the original replayed
            forward_unclear: Optional[timing.Rounds] = None
            confirmed_in_use = False
            decision = "forward_" + ("graph" if runner is not fused_gm else "plain")
            fused_time = decision.removeprefix("forward_") + "_fused_ms"
            if measured:
                # The last word at compile time on "never slower than eager": the whole forward,
                # as the user calls it; the first calls in use may still overrule it.
                if decision in trusted and {fused_time, "eager_ms"} <= times.keys():
                    fused_ms, eager_ms = times[fused_time], times["eager_ms"]
                    faster = fused_ms < eager_ms * (1.0 - FORWARD_MARGIN)
                    confirmed_in_use = records[decision]["in_use"]
                    report.notes.append(
                        "whole-forward times read from the cache (measured "
                        + ("in use)" if confirmed_in_use else "when first compiled)")
                    )
                else:
                    with torch.no_grad(), preserved_state(self._model):
                        found, verdict = _measure_decision(
                            timer, runner, lambda *a: self._model(*args, **kwargs), flat, FORWARD_MARGIN
                        )
                    fused_ms, eager_ms = times[fused_time], times["eager_ms"] = found.candidate_ms, found.baseline_ms
                    records[decision] = make_record(FORWARD_TIMING, found.spread, found.rounds, verdict is None)
                    faster = bool(verdict)
                    forward_unclear = found if verdict is None else None
                report.whole_eager_ms, report.whole_fused_ms = eager_ms, fused_ms
                if forward_unclear is not None:
                    report.notes.append(
                        _unclear_note("the fused forward against the original", forward_unclear, FORWARD_MARGIN)
                        + ": the original runs, a provisional verdict (not cached as final)"
                    )
                    runner = None
                elif not faster:
                    report.notes.append(
                        f"the fused forward ({fused_ms:.3f} ms) was not at least "
                        f"{100 * FORWARD_MARGIN:.0f}% faster than the original ({eager_ms:.3f} ms) "
                        "for these inputs: the original runs"
                    )
                    runner = None
                else:
                    report.notes.append(f"forward: {fused_ms:.3f} ms fused vs {eager_ms:.3f} ms eager")
                if (times != known.times or records != known.records) and vkey is not None:
                    write_verdict(root, vkey, times, records)  # vkey None: nothing fused, never cached
            in_use = None
            wrong: Optional[str] = None
            if grad and runner is fused_gm and report.fused and not later_in_class:
                progress.step("checking the training step's gradients")
                wrong = self._wrong_step_gradients(captured_random, fused_gm, args, kwargs, report.notes)
                if wrong is not None:
                    report.notes.append(wrong)
                    runner = None
                    if klass is not None:
                        klass.gradients_wrong = True
            if grad and runner is fused_gm and report.fused and self._options.verify_speed and not later_in_class:
                if timer.can_time_forward(device):
                    runner, in_use, replayed = self._check_step(
                        timer, fused_gm, args, kwargs, flat, report, root, never_replays
                    )
            elif (
                measured
                and vkey is not None
                and (runner is not None or forward_unclear is not None)
                and not confirmed_in_use
                and timer.can_time_in_use(device)
            ):
                # The fused forward won (or was inside the noise) back to back: its first calls
                # in use, beside the original, have the last word.
                filing = _Filing("forward", root, vkey, decision, fused_time, "eager_ms", _calls_model_code(fused_gm))
                ran = "fused" if runner is not None else "original"
                in_use = InUseCheck(timer, device, filing, candidate=candidate, compiled_ran=ran)
                report.notes.append("the forward is checked again in its first calls in use")
            report.add_phase("forward_check", time.perf_counter() - step)
            relaunch = (
                None
                if never_replays is not None or wrong is not None or in_use is not None or later_in_class
                else _relaunch(runner, replayed, report)
            )
            if relaunch is not None:
                progress.finish(f"{relaunch}: compiling again with groups timed launched")
                return self._compile(args, kwargs, key, shape_class, launched=relaunch, started=start)
            entry = (runner, report)
            runs_model_code = runner is None or _calls_model_code(fused_gm)
        report.quantized = list(self._quantized)
        report.signature = _describe_inputs(args)
        report.device = str(_device_of(flat))
        report.model = name
        report.runs_original = entry[0] is None
        report.compile_s = time.perf_counter() - start
        entry = self._compiled[key] = _Compiled(entry, runs_model_code, in_use)
        self._file_shape(entry, key, args, kwargs, tensors, shape_class, report)
        if klass is not None and not report.runs_original:
            klass.verified.update(checked_sources)
        runs = "the original model runs" if report.runs_original else f"{len(report.fused)} fused kernel(s)"
        if report.fused and not report.runs_original and _device_of(flat).type != "cuda":
            runs += " (on CPU under Triton's interpreter: each call is slow)"
        progress.finish(f"compiled in {report.compile_s:.1f} s: {runs}; fused.report() says why")
        return entry

    def _backward_hooked(self) -> list[str]:
        """The modules and parameters of the model with backward hooks, by name."""
        return self._state.backward_hooked + [
            name for name, p in self._model.named_parameters() if getattr(p, "_backward_hooks", None)
        ]

    def _step_on_copies(self, fused_gm, args: tuple, kwargs: dict, seed: Optional[int] = None) -> tuple[list, list]:
        """One step's outputs and gradients (``TrainingStep.outputs_and_gradients``, output
        weights from ``STEP_GRADIENT_SEED``) on the CPU: of ``fused_gm``, or of the original
        model where it is None, on its own copy of the inputs (a forward may write into
        them), the random streams seeded with ``seed`` (default ``STEP_GRADIENT_SEED``),
        the model's state restored after."""
        seed = STEP_GRADIENT_SEED if seed is None else seed
        params = [p for p in self._model.parameters() if p.requires_grad]
        own_args, own_kwargs = pytree.tree_map(_own_copy, (args, kwargs))
        flat = self._flatten(own_args, own_kwargs)
        forward = fused_gm if fused_gm is not None else (lambda *a: self._model(*own_args, **own_kwargs))
        with preserved_state(self._model), torch.random.fork_rng(devices=_rng_devices(_device_of(flat))):
            _seed_random(_device_of(flat), seed)
            found = timing.TrainingStep(forward, params).outputs_and_gradients(*flat, seed=STEP_GRADIENT_SEED)
        # Off the device while another step runs (its steps need the room).
        return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, found)

    def _original_step_varies(self, args: tuple, kwargs: dict, original: tuple[list, list], limit: float) -> bool:
        """Whether the original model's step draws random numbers: ``original`` (its step from
        ``STEP_GRADIENT_SEED``'s streams) and a step from other streams differ by more than
        ``STEP_RANDOM_SHARE`` of ``limit``; ``True`` where that step can't run."""
        try:
            other = self._step_on_copies(None, args, kwargs, seed=STEP_GRADIENT_SEED + 1)
        except Exception as err:  # noqa: BLE001 - unknown: as if it drew them
            logger.debug("the original's step from other random streams did not run (%s)", err)
            return True
        if len(other[0]) != len(original[0]) or len(other[1]) != len(original[1]):
            return True
        return _distance([*other[0], *other[1]], [*original[0], *original[1]], STEP_RANDOM_SHARE * limit) is not None

    def _wrong_step_gradients(
        self, captured_random: bool, fused_gm, args: tuple, kwargs: dict, notes: list
    ) -> Optional[str]:
        """Why the fused training step is wrong, or ``None``: one step of each side on its
        own copy of the inputs (a forward may write into them), from the same random state
        (the same dropout masks), outputs weighted alike; the outputs and every parameter's
        and input's gradient compared with the original model's, all together and each
        tensor on its own. Each group was verified on its own; this guards the whole (a
        graph pass computing another function than the model), so its limit is far above
        rounding (``STEP_GRADIENT_LIMIT``). Where the fused step misses the original's,
        the model's step in float64 judges (``_reference_step``): a fused step as near it as
        the original's is (the original rounding more, as TF32 convolutions do) stands,
        and ``notes`` says so. ``captured_random``: the captured graph, before any graph
        pass, may draw random numbers (``_may_draw_random``)."""
        if self._backward_hooked():
            return None  # the user's hooks would run for each checked backward
        sides: list[tuple[list, list]] = []
        for fused_side in (False, True):
            try:
                sides.append(self._step_on_copies(fused_gm if fused_side else None, args, kwargs))
            except torch.OutOfMemoryError:
                return None  # no room for both sides' steps: no verdict
            except Exception as err:  # noqa: BLE001 - a step that raises is judged, not passed on
                if not fused_side:
                    return None  # the original's own step refuses these inputs: nothing to judge by
                return (
                    f"the fused training step raised {type(err).__name__} where the original's did not: "
                    "the original runs"
                )
        (eager_out, eager_grads), (fused_out, fused_grads) = sides
        sixteen_bit = torch.is_autocast_enabled(_device_of(self._flatten(args, kwargs)).type) or any(
            t is not None and t.dtype in (torch.float16, torch.bfloat16) for t in eager_out + eager_grads
        )
        limit = STEP_GRADIENT_LIMIT["16-bit" if sixteen_bit else "fp32"]
        judge: Optional[tuple[str, Optional[tuple[list, list]]]] = None  # taken at the first miss
        random: Optional[bool] = None  # whether the step may draw random numbers, found at the first miss
        stands = []
        for what, got, expected in (("outputs", fused_out, eager_out), ("gradients", fused_grads, eager_grads)):
            if len(got) != len(expected):
                return f"the fused training step gives {len(got)} {what} where the original gives {len(expected)}"
            off = _distance(got, expected, limit)
            if off is None:
                continue
            judge = judge or self._reference_step(args, kwargs)
            name, taken = judge
            reference = None if taken is None else taken[what == "gradients"]
            if reference is not None and random is None:
                # Whether the original's distance from the reference may be other draws: the
                # graphs say where they may, and else the original's step, its random
                # streams seeded otherwise, must come out as it did.
                random = (
                    captured_random
                    or _may_draw_random(fused_gm)
                    or self._original_step_varies(args, kwargs, sides[0], limit)
                )
            farther = (
                f"no {name} step" if reference is None else _farther_from(got, expected, reference, limit, bool(random))
            )
            farther = farther if farther is None or reference is None else f"{farther} in {name}"
            if farther is not None:
                return (
                    f"the fused training step's {what} are off the original model's ({off}; limit {limit:g}; "
                    f"{farther}): the original runs. Please report this (fused.report())"
                )
            stands.append(
                f"the fused training step's {what} are off the original model's ({off}) but nearer the model's "
                f"step in {name} than {STEP_REFERENCE_FACTOR:g} times the original's distance: the fused step stands"
            )
        notes.extend(stands)  # only once both outputs and gradients stand
        return None

    def _reference_step(self, args: tuple, kwargs: dict) -> tuple[str, Optional[tuple[list, list]]]:
        """One step of the original model in exact arithmetic, as ``_wrong_step_gradients``
        runs each side (same random state, same output weights), autocast off, on copies
        of the model and the inputs: in float64 (complex tensors in complex128, a spectral
        weight), or where that does not run (a model that makes a complex64 tensor of its
        own, as FNO's reference code does), in fp32 without TF32 (``tf32.strict_fp32``): the
        judge where eager rounds more (TF32 convolutions, bf16 autocast). Returns its name
        and its outputs and gradients on the CPU, ``None`` for them where neither runs."""
        for name, widen, strict in (
            ("float64", _widened, contextlib.nullcontext),
            ("strict fp32", _fp32, strict_fp32),
        ):
            model = None
            try:
                model = copy.deepcopy(self._model)
                model.zero_grad(set_to_none=True)  # the copy's gradients would only take room
                model._apply(widen)
                # Copies of the inputs, as each checked side takes (a forward may write into them).
                wide_args, wide_kwargs = pytree.tree_map(lambda v: widen(_own_copy(v)), (args, kwargs))
                flat = self._flatten(wide_args, wide_kwargs)
                params = [p for p in model.parameters() if p.requires_grad]
                with no_autocast(), strict(), torch.random.fork_rng(devices=_rng_devices(_device_of(flat))):
                    _seed_random(_device_of(flat))
                    step = timing.TrainingStep(lambda *a: model(*wide_args, **wide_kwargs), params)
                    found = step.outputs_and_gradients(*flat, seed=STEP_GRADIENT_SEED)
            except Exception as err:  # noqa: BLE001 - no judge of this kind: the next, or the miss stands
                logger.debug("the model's step in %s did not run (%s)", name, err)
                del model  # before the next copy is made
                continue
            return name, pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, found)
        return "float64 or strict fp32", None

    def _check_step(
        self, timer, fused_gm, args: tuple, kwargs: dict, flat: tuple, report, root, never: Optional[str] = None
    ):
        """The compile's word on "never slower than eager" with gradients on: the forward
        and its backward, fused against the original, in alternating rounds as the
        whole-forward check times them, measured again where the lead is inside their
        spread. Returns what runs - ``fused_gm``, or ``None`` (the original: slower, or
        still inside the noise, a provisional verdict) - and, where the fused one won or
        the verdict is provisional, the probation that has the last word (``in_use``; None
        where the verdict was itself measured in use, or can't be), and whether the fused
        step timed was replayed as CUDA graphs (not where ``never``, ``_never_replays``' or
        ``_relaunch``'s reason, says it never is)."""
        hooked = self._backward_hooked()
        if hooked:
            report.notes.append(
                f"training step not timed: backward hooks ({', '.join(hooked[:3])}) would run for "
                "each timed backward; the groups' own checks decided"
            )
            return fused_gm, None, False
        candidate = self._training_graph(fused_gm, flat, report, never)
        graphed = candidate is not fused_gm
        vkey = _verdict_key(fused_gm, True, kwargs, flat, STEP_TIMING + ("+graph" if graphed else ""))
        known = read_verdict(root, vkey) if vkey is not None else Verdict({}, {})
        times, records = dict(known.times), dict(known.records)
        record = known.records.get("step")
        # Reused only where its record says it was clear; else (provisional, or an older
        # cache that kept no record) measured again.
        trusted = record is not None and not record["provisional"] and {"step_fused_ms", "step_eager_ms"} <= set(times)
        unclear: Optional[timing.Rounds] = None
        if trusted:
            assert record is not None
            fused_ms, eager_ms = times["step_fused_ms"], times["step_eager_ms"]
            faster = fused_ms < eager_ms * (1.0 - FORWARD_MARGIN)
            confirmed_in_use = record["in_use"]
            cached = " (measured in use, read from the cache)" if confirmed_in_use else " (read from the cache)"
        else:
            params = [p for p in self._model.parameters() if p.requires_grad]
            fused_step = timing.TrainingStep(candidate, params, fused=True)
            eager_step = timing.TrainingStep(lambda *a: self._model(*args, **kwargs), params)
            with preserved_state(self._model):
                found, verdict = _measure_decision(timer, fused_step, eager_step, flat, FORWARD_MARGIN)
            fused_ms, eager_ms = times["step_fused_ms"], times["step_eager_ms"] = found.candidate_ms, found.baseline_ms
            records["step"] = make_record(STEP_TIMING, found.spread, found.rounds, verdict is None)
            faster, confirmed_in_use, cached = bool(verdict), False, ""
            unclear = found if verdict is None else None
        report.whole, report.whole_eager_ms, report.whole_fused_ms = "training step", eager_ms, fused_ms
        if (times != known.times or records != known.records) and vkey is not None:
            write_verdict(root, vkey, times, records)
        checkable = vkey is not None and not confirmed_in_use and timer.can_time_in_use(_device_of(flat))
        filing = _Filing(
            "training step", root, vkey, "step", "step_fused_ms", "step_eager_ms", _calls_model_code(fused_gm)
        )
        if unclear is not None:
            note = (
                _unclear_note(
                    "the fused training step, forward and backward, against the original's", unclear, FORWARD_MARGIN
                )
                + ": the original runs, a provisional verdict (not cached as final)"
            )
            if not checkable:
                report.notes.append(note)
                return None, None, graphed
            report.notes.append(note + "; its first calls in use decide")
            in_use = InUseCheck(timer, _device_of(flat), filing, candidate=candidate, compiled_ran="original")
            return None, in_use, graphed
        if not faster:
            report.notes.append(
                f"the fused training step, forward and backward ({fused_ms:.3f} ms), was not at least "
                f"{100 * FORWARD_MARGIN:.0f}% faster than the original's ({eager_ms:.3f} ms) for these "
                f"inputs{cached}: the original runs"
            )
            return None, None, graphed
        report.notes.append(
            f"training step, forward and backward: {fused_ms:.3f} ms fused"
            + (" (replayed as two CUDA graphs)" if graphed else "")
            + f" vs {eager_ms:.3f} ms eager{cached}"
        )
        return candidate, InUseCheck(timer, _device_of(flat), filing) if checkable else None, graphed

    def _training_graph(
        self, fused_gm, flat: tuple, report, never: Optional[str] = None
    ) -> "torch.fx.GraphModule | TrainingGraph":
        """The fused training step as it will run: its forward and backward captured as two
        CUDA graphs (``cudagraphs.TrainingGraph``) where that is possible and checked, else
        ``fused_gm`` launching kernel by kernel. Not where the model's own code runs in the
        forward (an opaque part may keep state a replay would skip), it writes into its
        inputs, or a kernel reads a host scalar (a copy from host memory can't be captured)."""
        if not self._options.cuda_graphs or _device_of(flat).type != "cuda":
            return fused_gm
        why = never or ("parts of the model's own code run in it" if _calls_model_code(fused_gm) else None)
        # Its runs differ (or may, an opaque part's): a replay's check would refuse it.
        why = why or ("it draws random numbers" if _may_draw_random(fused_gm) else None)
        why = why or self._why_no_graph(fused_gm, flat)
        if why is None:
            with preserved_state(self._model):
                graph, why = try_training_graph(fused_gm, flat, self._model)
            if graph is not None:
                return graph
        report.notes.append(f"no CUDA graph for the training step ({why}); kernels launch one by one")
        return fused_gm

    def _why_no_graph(self, fused_gm, flat: tuple) -> Optional[str]:
        """Why ``fused_gm`` can't replay as a CUDA graph whatever capture would say, or ``None``:
        it writes into its inputs (a replay would write into its own static copies), or a
        kernel reads a host scalar (a copy from host memory can't be captured: capture would
        fail, and torch warn)."""
        with preserved_state(self._model):
            if writes_into_inputs(fused_gm, flat):
                return "the forward writes into its inputs in place"
        if any(kernel.host_scalars for kernel in fused_kernels(fused_gm)):
            return (
                "a kernel reads a one-element tensor the forward makes in host memory "
                "(torch.tensor(2.5)), copied to the GPU on every call"
            )
        return None

    def _file_shape(
        self,
        entry: "_Compiled",
        key: Any,
        args: tuple,
        kwargs: dict,
        tensors: Sequence[torch.Tensor],
        shape_class: Optional[tuple],
        report: FusionReport,
    ) -> None:
        """Note what the guard needs of a compiled ``entry``: its shape class (and the class's
        shapes past MAX_SHAPES_PER_CLASS dropped, least recently called first), or, where
        ``dynamic=None`` may yet make dims dynamic, its key without sizes."""
        if self._options.dynamic is not False:
            entry.shape_free = _class_key(key, args, kwargs, [frozenset(range(t.dim())) for t in tensors], False)
            entry.shapes = tuple(tuple(t.shape) for t in tensors)
        if shape_class is None:
            return
        class_key, _, described, _ = shape_class
        klass = self._classes[class_key]
        entry.shape_class = class_key
        report.dynamic_dims = list(described)
        klass.shapes += 1
        if klass.first_report is None:
            klass.first_report = report
        else:
            report.notes.append(
                f"shape {klass.shapes} of its shape class (the first: {klass.first_report.signature}): kernels "
                "the class had checked already were checked on these inputs only, not on synthetic ones again"
            )
        members = [k for k, e in self._compiled.items() if e.shape_class == class_key]
        for old in members[: max(0, len(members) - MAX_SHAPES_PER_CLASS)]:
            del self._compiled[old]

    def _compile_failed(
        self, key: Any, args: tuple, flat: tuple, start: float, err: Exception, shape_class: Optional[tuple] = None
    ):
        """Keep a signature whose compile raised as one that runs the original model: one
        warning with the error, and no second attempt on every later call."""
        name = self.display_name
        why = f"{type(err).__name__}: {err}"
        logger.debug("compiling %s failed", name, exc_info=err)
        warnings.warn(
            f"AutoFuser: compiling {name} for {_describe_inputs(args)} failed ({why}); these inputs run "
            "the original model. This is a bug in AutoFuser or one of its plugins: please report it "
            "with the traceback (logging.getLogger('autofuser') at DEBUG shows it).",
            CompileFailedWarning,
            stacklevel=4,
        )
        report = FusionReport(
            plugins=self._plugin_set.names, notes=[f"compiling failed ({why}); the original model runs"]
        )
        report.quantized = list(self._quantized)
        report.signature = _describe_inputs(args)
        report.device = str(_device_of(flat))
        report.model, report.runs_original = name, True
        report.compile_s = time.perf_counter() - start
        entry = self._compiled[key] = _Compiled((None, report), True)
        if shape_class is not None:
            entry.shape_class = shape_class[0]
        return entry

    def reset(self) -> None:
        """Forget every compiled signature; the next call compiles again.

        Needed after changes the guard doesn't see (docs/guard.md): a value
        changed inside an object that ``forward`` reads (``self.cfg.scale = 2``,
        a list attribute changed in place), a class attribute or a global.
        Also starts the count of model changes afresh, after which calls ran
        the original model, and forgets which dims ``dynamic=None`` saw change.
        """
        self._compiled.clear()
        self._classes.clear()
        self._learned_dims.clear()  # dynamic=None learns again which dims vary
        self._last_report = None
        self._watch_state()
        self._warned.discard("state")

    def report(self) -> FusionReport:
        """The report of the most recently used compiled signature."""
        if self._disabled:
            return FusionReport(
                plugins=self._plugin_set.names,
                notes=["AUTOFUSER_DISABLE is set: nothing was compiled, every call runs the original model"],
            )
        if self._last_report is None:
            raise AutoFuserError("nothing compiled yet: call the fused model on real inputs first, then .report().")
        return self._last_report

    @property
    def checking_in_use(self) -> bool:
        """Whether a signature's fused training step or inference forward is still
        checked in its first calls as the user makes them (docs/training.md, "Checked
        again in use"; docs/verification.md, "Noise"): until it settles, some calls run
        the original model (or, after a provisional verdict, the fused one)."""
        return any(entry.in_use is not None for entry in self._compiled.values())

    def reports(self) -> list[FusionReport]:
        """Reports of every compiled signature, the least recently called first."""
        return [report for _, report in self._compiled.values()]

    def kernels(self) -> list[FusedKernel]:
        """The fused kernels the compiled signatures run, the least recently called
        signature first: inside a forward replayed as one CUDA graph too, none of a
        signature that runs the original model because fusing it was not faster. One per
        generated source: of two identical layers, only the first's kernel is listed
        (each kernel reads its own layer's parameters when called)."""
        found: dict[str, FusedKernel] = {}
        for runner, _ in self._compiled.values():
            graph_module = runner.forward if isinstance(runner, (CudaGraphRunner, TrainingGraph)) else runner
            if graph_module is None:
                continue
            assert isinstance(graph_module, torch.fx.GraphModule)  # a compiled forward, or the one a graph replays
            for kernel in fused_kernels(graph_module):
                found.setdefault(kernel.source.name, kernel)
        return list(found.values())


class _Compiled(tuple):
    """``(runner, report)`` of one compiled signature. ``runs_model_code``: whether calling
    the runner runs some of the model's own Python - the whole model, or a part kept
    opaque - which may update the state the guard watches (a counter, a cache).
    ``shape_class``: the key of the shape class it belongs to (``None``: specialised);
    ``shape_free`` and ``shapes``: its signature without sizes and its tensors' shapes,
    for ``dynamic=None`` to see which dims a later call changes. ``like``: an entry
    this one replaces, whose guard attributes it keeps."""

    runs_model_code: bool
    in_use: Optional[InUseCheck]  # the probation of a fused step or forward, until it settles
    shape_class: Any
    shape_free: Any
    shapes: tuple

    def __new__(
        cls,
        entry: tuple,
        runs_model_code: bool,
        in_use: Optional[InUseCheck] = None,
        like: Optional["_Compiled"] = None,
    ):
        made = super().__new__(cls, entry)
        made.runs_model_code, made.in_use = runs_model_code, in_use
        made.shape_class = like.shape_class if like is not None else None
        made.shape_free = like.shape_free if like is not None else None
        made.shapes = like.shapes if like is not None else ()
        return made


#: Relative L2 distance of a whole training step's gradients (every parameter's and input's)
#: from the original model's, past which the fused step is wrong rather than rounded
#: otherwise: a guard against gross errors, far above the rounding measured on the zoo
#: (fp32 at most 3e-3, LSM; bf16 at most 7e-3, Galerkin; BENCHMARKS.md, Training).
STEP_GRADIENT_LIMIT = {"fp32": 0.05, "16-bit": 0.25}
#: Seed of that check's random state and output weights.
STEP_GRADIENT_SEED = 20261206


#: In that check, a tensor's own distance is taken against at least this share of all
#: its kind's norm: a small result (a bias's gradient) that is wrong shows, and one whose
#: terms nearly cancel is not judged by its own tiny norm.
STEP_TENSOR_FLOOR = 1e-2


def _own_copy(value: Any) -> Any:
    """A tensor copied for a check's step of its own (a leaf needing gradients as it did)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def _seed_random(device: torch.device, seed: int = STEP_GRADIENT_SEED) -> None:
    """Seed the CPU's random stream and ``device``'s (not every CUDA device's, which
    ``torch.manual_seed`` would queue even where CUDA is not started)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def _wide(tensor: torch.Tensor) -> torch.dtype:
    """float64, or complex128 for a complex tensor (a spectral weight's gradient)."""
    return torch.complex128 if tensor.is_complex() else torch.float64


def _cast_floating(value: Any, real: torch.dtype, complex_: torch.dtype) -> Any:
    """A floating tensor as ``real`` (complex as ``complex_``), keeping whether it needs
    gradients; anything else as it is."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.detach().to(complex_ if value.is_complex() else real).requires_grad_(value.requires_grad)
    return value


def _widened(value: Any) -> Any:
    return _cast_floating(value, torch.float64, torch.complex128)


def _fp32(value: Any) -> Any:
    return _cast_floating(value, torch.float32, torch.complex64)


#: The judge of a whole step that missed the original's (``_farther_from``): each tensor
#: of the fused step may be this many times as far from the reference step as the
#: original's, plus ``STEP_REFERENCE_SLACK`` of the step's limit. In a step that may draw
#: random numbers, the reference judges only where the original is within the limit of
#: it, all tensors together: such a step draws other numbers in float64, so a far
#: original says nothing. A step that draws none is judged up to ``STEP_REFERENCE_CAP``
#: times the limit: that distance is then the model's own rounding (a batch norm over
#: channels of nearly constant values amplifies fp32's rounding a thousandfold), and past
#: the limit the fused step's tensors together must be no farther than
#: ``STEP_REFERENCE_FAR_FACTOR`` times the original's (plus the slack), and each tensor no
#: farther than ``STEP_REFERENCE_FACTOR`` times: one tensor's rounding is one draw of
#: amplified noise, which two roundings' of it differ by more than all tensors' together.
STEP_REFERENCE_FACTOR = 2.0
STEP_REFERENCE_SLACK = 0.1
STEP_REFERENCE_CAP = 4.0
STEP_REFERENCE_FAR_FACTOR = 1.25
#: Whether a step draws random numbers, found where no graph says so (``_original_step_varies``):
#: the original's step from other random streams differs from its first by more than this
#: share of the step's limit (an atomic sum's rounding differs far less, a draw far more).
STEP_RANDOM_SHARE = 0.1


def _barrier_kinds(gm: Any) -> Optional[set[str]]:
    """The kinds of barrier among ``gm``'s nodes (``effects.barrier_reason``: "random",
    "opaque", "mutation"), or ``None`` where they can't be read (not a graph module, or a
    node its reader refuses)."""
    if not isinstance(gm, torch.fx.GraphModule):
        return None
    try:
        reasons = [barrier_reason(node, gm) for node in gm.graph.nodes]
    except Exception as err:  # noqa: BLE001 - a node it can't read: nothing known
        logger.debug("could not read the graph's barriers (%s)", err)
        return None
    return {reason[0] for reason in reasons if reason is not None}


def _may_draw_random(gm: Any, kinds: Optional[set[str]] = None) -> bool:
    """Whether a step of ``gm`` may draw random numbers: a node of its graph draws them, or
    runs as an opaque part, which may; a graph whose barriers can't be read may too.
    ``kinds``: ``_barrier_kinds(gm)``, where the caller has them."""
    kinds = _barrier_kinds(gm) if kinds is None else kinds
    return kinds is None or bool(kinds & {"random", "opaque"})


def _farther_from(
    got: Sequence[Any], original: Sequence[Any], exact: Sequence[Any], limit: float, random: bool = True
) -> Optional[str]:
    """Where ``got`` (the fused step's tensors) is farther from ``exact`` (the reference
    step's, ``_reference_step``) than ``STEP_REFERENCE_FACTOR`` times ``original``'s distance plus
    ``STEP_REFERENCE_SLACK * limit`` - all tensors together, and each against at least
    ``STEP_TENSOR_FLOOR`` of all of them, relative L2 - in words; else ``None``. An original
    past ``limit`` of ``exact`` leaves it unjudged (in words) where the step may draw
    random numbers (``random``) or the original is past ``STEP_REFERENCE_CAP`` times the
    limit; else the fused step's tensors together are held to ``STEP_REFERENCE_FAR_FACTOR``
    times its distance, each still to ``STEP_REFERENCE_FACTOR`` times."""
    if not len(got) == len(original) == len(exact):
        return f"the reference step gives {len(exact)} tensors"
    rows: list[tuple[str, float, float, float]] = []
    for k, (g, o, x) in enumerate(zip(got, original, exact)):
        if x is None and g is None and o is None:
            continue
        if x is None:
            return f"tensor {k} is None in the reference step"
        x64 = x.to(_wide(x))
        if not bool(torch.isfinite(x64).all()):
            return f"tensor {k} is not finite in the reference step"
        g64, o64 = (torch.zeros_like(x64) if t is None else t.to(x64.dtype) for t in (g, o))
        if g64.shape != x64.shape or o64.shape != x64.shape:
            return f"tensor {k} has shape {list(g64.shape)} where the reference step's has {list(x64.shape)}"
        rows.append((f"tensor {k}", float((g64 - x64).norm()), float((o64 - x64).norm()), float(x64.norm())))
    total = math.sqrt(sum(row[3] ** 2 for row in rows))
    fused_total = math.sqrt(sum(row[1] ** 2 for row in rows))
    original_total = math.sqrt(sum(row[2] ** 2 for row in rows))
    within = original_total <= limit * max(total, 1e-30)
    if not within and (random or not original_total <= STEP_REFERENCE_CAP * limit * max(total, 1e-30)):
        return (
            f"the original is {original_total / max(total, 1e-30):.3g} off the reference step, past the limit: "
            "not comparable"
        )
    whole = ("all of them", fused_total, original_total, total)
    for where, fused_off, original_off, norm in [whole, *rows]:
        factor = STEP_REFERENCE_FAR_FACTOR if where == "all of them" and not within else STEP_REFERENCE_FACTOR
        scale = max(norm, STEP_TENSOR_FLOOR * total, 1e-30)
        if not fused_off <= factor * original_off + STEP_REFERENCE_SLACK * limit * scale:
            return f"{where}: {fused_off / scale:.3g} off the reference step, the original {original_off / scale:.3g}"
    return None


def _distance(got: Sequence[Any], expected: Sequence[Any], limit: float) -> Optional[str]:
    """Where ``got`` is farther from ``expected`` than ``limit`` (relative L2, in float64),
    all tensors together and each on its own against at least ``STEP_TENSOR_FLOOR`` of all
    of them, in words; else ``None``. A tensor missing on one side counts as zeros; one
    not finite on the expected side is not judged."""
    pairs = []
    for k, (g, e) in enumerate(zip(got, expected)):
        if g is None and e is None:
            continue
        e64 = torch.zeros(g.shape, dtype=_wide(g)) if e is None else e.to(_wide(e))
        g64 = torch.zeros(e64.shape, dtype=_wide(e64)) if g is None else g.to(_wide(g))
        if g64.shape != e64.shape:
            return f"tensor {k} has shape {list(g64.shape)} where the original's has {list(e64.shape)}"
        if not bool(torch.isfinite(e64).all()):
            continue
        pairs.append((k, float((g64 - e64).norm()), float(e64.norm())))
    total_off = math.sqrt(sum(off**2 for _, off, _ in pairs))
    total = math.sqrt(sum(norm**2 for _, _, norm in pairs))
    if not total_off <= limit * max(total, 1e-30):  # a NaN fails too
        return f"relative L2 {total_off / max(total, 1e-30):.3g} over all of them"
    for k, off, norm in pairs:
        scale = max(norm, STEP_TENSOR_FLOOR * total, 1e-30)
        if not off <= limit * scale:
            return f"tensor {k}: relative L2 {off / scale:.3g}"
    return None


def _rng_devices(device: torch.device) -> list:
    """The CUDA devices whose random state a check forks (none on CPU)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


#: ``() -> the innermost saved-tensor hooks in force, or None``; torch's own, private (an older
#: torch without it: assume hooks may be in force).
_top_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


@contextlib.contextmanager
def _own_saved_tensors():
    """Tensors autograd saves inside are kept as they are, past any saved-tensor hooks of
    the caller's; where the caller has none, or hooks are disabled altogether, autograd
    saves as it always does.

    Hooks of its own only where the caller has some: any hook costs autograd its in-place
    check of saved tensors. And the packed form is a detached alias: a saved output packed
    as itself holds its own ``grad_fn``, a cycle through autograd's C++ that Python's
    collector can't see, which kept every activation the compile's runs saved alive
    (docs/training.md, "Finding where memory stays")."""
    if _top_saved_tensor_hooks is not None and _top_saved_tensor_hooks(False) is None:
        yield
        return
    hooks = torch.autograd.graph.saved_tensors_hooks(_detached, _kept)
    try:
        hooks.__enter__()
    except RuntimeError:  # torch.autograd.graph.disable_saved_tensors_hooks is in force
        yield
        return
    try:
        yield
    finally:
        hooks.__exit__(None, None, None)


def _inside_backward() -> bool:
    """Whether this call runs inside a backward pass (a recomputing checkpoint)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


#: What runs a compiled signature: its fused graph module, that forward replayed as a CUDA
#: graph (inference) or with its backward as two (training), or ``None``: the original model.
_Runner = Union[torch.fx.GraphModule, CudaGraphRunner, TrainingGraph, None]


def _relaunch(runner: "_Runner", replayed: bool, report: FusionReport) -> Optional[str]:
    """Why a signature is compiled again with its groups timed launched, or ``None``: its
    groups were timed as CUDA graphs, as a replayed step or forward runs them, and some were
    kept for it; but the step or forward did not replay (``replayed``: capture was refused,
    or did not pay) and, launched, lost to the original, which now runs. A group kept for its
    graph time may be what lost it, and launched, its own times say whether it pays. One
    that replayed and lost was timed as it ran: no second compile."""
    if runner is not None or replayed or not any(g.timed_in_graph for g in report.fused):
        return None
    return "the fused model did not replay as CUDA graphs and, launched, lost to the original"


def _never_replays(gm: torch.fx.GraphModule, grad: bool, inference: bool, kinds: Optional[set[str]]) -> Optional[str]:
    """Why the captured ``gm`` will never run as a CUDA graph, whatever its kernels: a forward
    with gradients off in training mode is never captured; a training step that draws random
    numbers (its runs differ) or runs the model's own code (``_calls_model_code``) is not,
    nor a forward that draws them (``kinds``: ``_barrier_kinds(gm)``; None, unreadable, counts
    as drawing). ``None``: it may replay."""
    if not grad and not inference:
        return "the forward runs in training mode with gradients off, which is never replayed"
    if grad and _calls_model_code(gm):
        return "the training step runs parts of the model's own code, which is never replayed"
    what = "training step" if grad else "forward"
    if kinds is None:
        return f"the {what}'s graph can't be read for random draws, so it is never replayed"
    if "random" in kinds:
        return f"the {what} draws random numbers, so it is never replayed"
    return None


def _calls_model_code(graph_module: torch.fx.GraphModule) -> bool:
    """Whether the rewritten graph calls a module holding one whose class is not torch's own
    (torch's modules leave the attributes the guard watches alone), or one of the user's
    functions that capture kept as a leaf (a method may set ``self.x``)."""
    nodes = graph_module.graph.nodes
    return any(isinstance(node.target, LeafCall) for node in nodes) or any(
        not torchs_own(type(inner).__module__)
        for node in nodes
        if node.op == "call_module"
        for inner in graph_module.get_submodule(node.target).modules()
    )


_training = operator.attrgetter("training")


class _StateKey:
    """The model's plain attribute values in a signature, hashed once (a signature is
    hashed on every call)."""

    __slots__ = ("constants", "_hash")

    def __init__(self, constants: tuple) -> None:
        self.constants, self._hash = constants, hash(constants)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return self is other or (
            isinstance(other, _StateKey) and self._hash == other._hash and self.constants == other.constants
        )


# -- saving: plugins given as modules or objects -------------------------------------


@dataclasses.dataclass(frozen=True)
class _SavedPluginModule:
    """A plugin given as a module object, saved by the name it imports under."""

    name: str


def _plugins_to_save(plugins: Optional[Sequence[Any]], loaded_names: Sequence[str]) -> list:
    """``plugins=`` in a form another process can load: names as they are, modules by
    their import name, objects as themselves (pickled by their class).

    :raises AutoFuserError: a plugin module that can't be imported by name, or an object
        that can't be pickled; the message says how to give the plugin instead.
    """
    if plugins is None:
        return list(loaded_names)  # every plugin installed here, by entry-point name
    saved: list[Any] = []
    for item in plugins:
        if isinstance(item, str):
            saved.append(item)
        elif isinstance(item, ModuleType):
            spec = getattr(item, "__spec__", None)
            name = spec.name if spec is not None else None
            if name is None or sys.modules.get(name) is not item:
                raise AutoFuserError(
                    f"can't save this FusedModule: its plugin module {item.__name__!r} was not imported from a "
                    "file, so loading could not import it again. Put the plugin in an importable module and "
                    "give it by name (plugins=['package.plugin']) or as that imported module."
                )
            saved.append(_SavedPluginModule(name))
        else:
            try:
                pickle.dumps(item)
            except Exception as err:
                raise AutoFuserError(
                    f"can't save this FusedModule: its plugin object {item!r} can't be pickled "
                    f"({type(err).__name__}: {err}). Define the plugin's class at the top level of an importable "
                    "module, or give the plugin as a module or by name (plugins=['package.plugin'])."
                ) from None
            saved.append(item)
    return saved


def _plugins_to_load(saved: Optional[Sequence[Any]]) -> Optional[list]:
    """The inverse of ``_plugins_to_save``, in the loading process."""
    if saved is None:
        return None
    plugins = []
    for item in saved:
        if isinstance(item, _SavedPluginModule):
            try:
                item = importlib.import_module(item.name)
            except ImportError as err:
                raise PluginError(
                    f"the saved FusedModule's plugin module {item.name!r} can't be imported here "
                    f"({err}); install or add to sys.path the package that holds it."
                ) from None
        plugins.append(item)
    return plugins


def fused_kernels(graph_module: torch.fx.GraphModule) -> list[FusedKernel]:
    """The ``FusedKernel`` each call of a rewritten graph runs, in graph order."""
    return [
        node.target
        for node in graph_module.graph.nodes
        if node.op == "call_function" and isinstance(node.target, FusedKernel)
    ]


def _load_plugins_quietly(plugins):
    """``load_plugins`` leaving the CPU random stream as it was: a plugin may build
    sample modules when it is first imported, and ``fuse()`` must not change what
    the user's next ``torch.randn`` draws."""
    with torch.random.fork_rng(devices=[]):
        return load_plugins(plugins)


#: The whole-forward check: alternating rounds of eager and fused timing, and the
#: share by which the fused forward must beat the original to replace it (when in
#: doubt, the original runs). How long each side is timed for is timing.py's
#: ``FORWARD_BUDGET_MS``. A lead within the rounds' spread of the margin
#: (``timing.inside_spread``) is measured again, FORWARD_ROUNDS more rounds; still
#: inside, the safe side runs and the verdict is provisional (not cached as final).
FORWARD_ROUNDS = 2
FORWARD_MARGIN = 0.02
#: A fused forward this much faster than eager in the first round needs no second one: a
#: slow moment of the GPU moves a median of several calls by a few percent, not by this.
CLEAR_GAP = 0.2
#: A fused forward over FORWARD_BUDGET_MS that is more than this share faster than one
#: eager call is kept without timing eager further: the eager calls of a long forward cost
#: seconds (softmax attention over every mesh point: the zoo's Transformer, BENCHMARKS.md,
#: Model zoo), and no slow moment of the GPU doubles a forward that long.
WIDE_GAP = 0.5
FORWARD_TIMING = (
    f"back-to-back events, fused first, best of {FORWARD_ROUNDS} rounds "
    f"(one past a {CLEAR_GAP:.0%} gap), 3 calls for a forward over {FORWARD_BUDGET_MS:g} ms, "
    f"one eager call over that past a {WIDE_GAP:.0%} gap; a lead inside the rounds' spread "
    f"measured again over {FORWARD_ROUNDS} more rounds, then provisional"
)

#: The whole-step check (gradients on) times forward and backward the same way.
STEP_TIMING = "forward and backward (torch.autograd.grad), " + FORWARD_TIMING
#: The CUDA graph's check: replaying against launching, timed as the whole forward.
GRAPH_TIMING = "CUDA graph replay against launching, " + FORWARD_TIMING
#: A verdict settled in the first calls as the user makes them (in_use.py).
IN_USE_TIMING = (
    f"in use: the start of each call marked in stream order, blocks of {BLOCK_CALLS} calls of each side "
    f"(fused, original, original, fused), the faster block's mean, up to {MAX_ROUNDS} plans"
)


@dataclasses.dataclass
class _Filing:
    """What a check in use (in_use.py) settles, and where its verdict goes: ``what`` it
    checks for the report ("training step", "forward"), the verdict entry (``root``,
    ``key``), the decision's record name in it and the names of each side's time;
    ``runs_model_code`` of the fused runner, where it takes over from the original."""

    what: str
    root: Any
    key: Optional[dict]
    decision: str
    fused_time: str
    original_time: str
    runs_model_code: bool = True


def writes_into_inputs(forward, flat: Sequence[Any]) -> bool:
    """Whether ``forward`` writes into the memory of one of its tensor inputs, through any
    view or any call (an opaque part included): it runs once on copies of the inputs (the
    caller's tensors are left alone), and an in-place write shows in a copy's version counter."""
    copies = [snapshot(x) for x in flat]
    before = [(c, c._version) for c in copies if isinstance(c, torch.Tensor)]
    with torch.no_grad():
        forward(*copies)
    return any(c._version != version for c, version in before)


#: A forward over FORWARD_BUDGET_MS that the host queues in under this share of its time
#: is GPU-bound: every launch is queued while the GPU still runs earlier work, so a CUDA
#: graph replay has no launch time left to save.
HOST_SHARE_GPU_BOUND = 0.5


def _forward_times(timer: timing.Timer, fused, eager, flat: Sequence[Any], into: Optional[timing.Rounds] = None):
    """``timing.Rounds`` of fused and eager for the whole-forward check, measured by
    ``timer``. Alternating rounds, the best of each side: a slow moment of the GPU (clocks,
    another process) then can't decide the verdict by landing on one side only, and the
    rounds' spread says how much the times moved. The fused side goes first in each
    round: a GPU still ramping its clocks after the compile slows it, not eager, so any
    bias favours the original. A fused forward more than CLEAR_GAP ahead after one round
    needs no second; one more than WIDE_GAP ahead of a single eager call over
    FORWARD_BUDGET_MS needs no more eager calls. ``into``: rounds measured before, whose
    verdict was inside their spread: FORWARD_ROUNDS more rounds are added, no shortcut."""
    again = into is not None
    found = into if into is not None else timing.Rounds()
    for round_ in range(FORWARD_ROUNDS):
        found.candidate.append(timer.forward_ms(fused, flat))
        once = None
        if round_ == 0 and not again:
            _, once = timer.forward_once_ms(eager, flat)  # eager ran in capture and verification: no warm-up
            if once > FORWARD_BUDGET_MS and found.candidate[-1] < once * (1.0 - WIDE_GAP):
                found.baseline.append(once)
                return found
        found.baseline.append(timer.forward_ms(eager, flat, once))
        if not again and found.candidate_ms < found.baseline_ms * (1.0 - CLEAR_GAP):
            break
    return found


def _measure_decision(
    timer: timing.Timer, fused, eager, flat: Sequence[Any], margin: float
) -> tuple[timing.Rounds, Optional[bool]]:
    """Time ``fused`` against ``eager`` (``_forward_times``) and say whether ``fused``
    is more than ``margin`` faster: ``True``/``False``, or ``None`` where the lead is
    still inside the rounds' spread after measuring again (the caller takes the safe
    side, and the verdict is provisional)."""
    found = _forward_times(timer, fused, eager, flat)
    verdict = found.verdict(margin)
    if verdict is None:
        _forward_times(timer, fused, eager, flat, into=found)
        verdict = found.verdict(margin)
    return found, verdict


def _unclear_note(what: str, found: timing.Rounds, margin: float) -> str:
    """A report note on a decision left provisional: its times, lead and spread."""
    return (
        f"{what}: {found.candidate_ms:.3f} ms against {found.baseline_ms:.3f} ms, a lead of "
        f"{100 * found.lead:.1f}% within the timings' spread ({100 * found.spread:.1f}%, {found.rounds} rounds "
        f"of each, measured twice) of the {100 * margin:.0f}% it must beat"
    )


def _gpu_bound(timer: timing.Timer, forward: torch.fx.GraphModule, flat: Sequence[Any]) -> Optional[str]:
    """Why a CUDA graph can't pay for this forward, or ``None`` (try one): a forward over
    FORWARD_BUDGET_MS that the host queues in under HOST_SHARE_GPU_BOUND of its time, one
    call measured by ``timer``. The caller ran the forward just before
    (``writes_into_inputs``), so its kernels are loaded."""
    queued_ms, total_ms = timer.forward_once_ms(forward, flat)
    if total_ms > FORWARD_BUDGET_MS and queued_ms < HOST_SHARE_GPU_BOUND * total_ms:
        return (
            f"the forward is GPU-bound: the host queues it in {queued_ms:.1f} of its {total_ms:.1f} ms, "
            "so a replay would save no launch time"
        )
    return None


def _verdict_key(
    fused_gm: torch.fx.GraphModule, fused: bool, kwargs: dict, flat: tuple, method: str = FORWARD_TIMING
) -> Optional[dict]:
    """What the whole-forward timings depend on: the rewritten graph, each kernel and
    config, the inputs' shapes, dtypes and strides, the GPU and the versions.
    ``None`` (never cached) when nothing was fused."""
    if not fused:
        return None
    kernels = [[k.source.name, k.source.source_hash, sorted(k.config.items())] for k in fused_kernels(fused_gm)]
    inputs = [[str(x.dtype), list(x.shape), list(x.stride())] if isinstance(x, torch.Tensor) else repr(x) for x in flat]
    precision = fp32_settings()  # they change eager's own time
    # The timing method is part of the key: verdicts timed another way are not reused.
    text = json.dumps([fused_gm.code, kernels, inputs, sorted(kwargs), precision, method], default=str)
    return {"forward": hashlib.sha256(text.encode()).hexdigest(), **device_key(_device_of(flat))}


def _opaque_message(name: str, opaque: dict[str, str]) -> str:
    """The strict-capture error: each part that stayed opaque, why, and the ways out."""
    parts = "; ".join(f"{name}.{path}: {why}" if path else f"the whole {name}: {why}" for path, why in opaque.items())
    return (
        f"fullgraph=True, but {len(opaque)} part(s) of {name} could not be traced and would run as they are: "
        f"{parts}. Make that code traceable (no branch on a tensor's values, no hooks on the module), "
        "or fuse without fullgraph=True to run those parts unfused and fuse the rest."
    )


def _describe_inputs(args: tuple) -> str:
    return "(" + ", ".join(_input_parts(args)) + ")"


def _input_parts(args: tuple) -> list[str]:
    parts = []
    for x in args:
        if isinstance(x, torch.Tensor):
            parts.append(f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
        else:
            parts.append(type(x).__name__)
    return parts


def fuse(model: torch.nn.Module, plugins: Optional[Sequence[Any]] = None, **options: Any) -> FusedModule:
    """Wrap ``model`` so that it runs fused Triton kernels.

    :param model: an ``nn.Module`` instance.
    :param plugins: ``None`` for every installed plugin, or a list of plugin
        modules, hook-carrying objects or entry-point names.
    :param options: see ``FuseOptions`` (``cache_dir``, ``max_signatures``,
        ``tune``, ``tune_budget_s``, ``verify_speed``, ``progress``, ``fullgraph``,
        ``cuda_graphs``, ``strict_fp32_products``, ``quantize``, ``dynamic``), and those
        the loaded plugins register (``autofuser_register_options``; the
        attention plugin's ``reassociate_products``). With ``quantize``, the fused module wraps a quantised
        copy of ``model`` (``fused.model``); ``model`` itself is left unchanged.
    :raises CaptureError: ``model`` is not a module instance; on the first call, with
        ``fullgraph=True``, ``OpaquePartError`` where a part of the model can't be traced.
    :raises AutoFuserError: ``AUTOFUSER_LOG`` or ``AUTOFUSER_DISABLE`` holds a value it can't read.
    With ``AUTOFUSER_DISABLE=1`` the returned module runs ``model`` itself and compiles nothing.
    :raises AutoFuserError: an unknown option, or an invalid value (the message says which, and its owner).
    :raises PluginError, SpecError: a plugin could not be loaded or is invalid.
    """
    if not isinstance(model, torch.nn.Module):
        hint = " - it is a class; instantiate it first" if isinstance(model, type) else ""
        raise CaptureError(f"fuse() takes an nn.Module instance, got {type(model).__name__}{hint}.")
    precompile.workers()  # a malformed AUTOFUSER_COMPILE_WORKERS is an error now, not in a compile
    logs.configure_from_env()
    plugin_set = _load_plugins_quietly(plugins)  # the plugins' own options are known once they are loaded
    parsed = FuseOptions.parse(options, plugin_set.registry.options)
    return FusedModule(model, plugins, parsed, plugin_set)
