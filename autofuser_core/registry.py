"""The registry: validated specs from every loaded plugin, and the look-ups the
planner needs (which lowering handles this fx node).

Rules, each enforced when a spec is registered:

1. A spec is validated by its pydantic model; failure is a ``SpecError``
   naming the plugin, the hook and what was wrong.
2. The registry stamps ``spec.plugin`` with the registering plugin's name.
3. Two specs of one kind with the same name are a duplicate: refused.
4. Two lowerings claiming the same target at its highest priority are a tie,
   refused (once all plugins have registered) naming both plugins. A plugin
   that means to replace a bundled lowering registers with a higher
   ``priority``. The same holds for two product layouts for one number of
   products.

While a graph compiles, the core plans with ``Registry.guarded()``: the same
specs, with the plugin code they carry wrapped so that an exception names its
plugin and hook and is answered the safe way (the node or group stays eager)
instead of reaching the user bare; see ``PluginFault``.
"""

from __future__ import annotations

import contextvars
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Type, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from .errors import PluginError, SpecError
from .group import GroupRefused
from .ir import LoweringRefused
from .specs import LoweringSpec, ProductLayoutSpec, QuantizerSpec, Spec, SplitRule, StrategySpec

SpecT = TypeVar("SpecT", bound=Spec)


def describe_target(target: Any) -> str:
    """A readable name for a lowering target: ``torch.nn.functional.gelu``, ``Tensor.add``."""
    if isinstance(target, str):
        return f"Tensor.{target}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module else name


def _target_key(target: Any) -> tuple[str, Any]:
    if isinstance(target, str):
        return ("call_method", target)
    if isinstance(target, type):
        return ("call_module", target)
    return ("call_function", target)


class Registry:
    """Specs of one plugin set. Built fresh for every ``fuse()`` call."""

    def __init__(self) -> None:
        self.lowerings: dict[str, LoweringSpec] = {}
        self.strategies: dict[str, StrategySpec] = {}
        self.quantizers: dict[str, QuantizerSpec] = {}
        self.product_layout_specs: dict[str, ProductLayoutSpec] = {}
        self._by_target: dict[tuple[str, Any], LoweringSpec] = {}
        self._claims: dict[tuple[str, Any], list[LoweringSpec]] = {}
        self._guarded: Optional[Registry] = None
        #: Each plugin's options model, by plugin name (``autofuser_register_options``).
        self.options: dict[str, type[BaseModel]] = {}

    # -- registration -------------------------------------------------------

    def _validate(self, spec_type: Type[SpecT], plugin: str, hook: str, spec: Any, fields: Mapping) -> SpecT:
        if spec is not None and fields:
            raise SpecError(
                f"plugin {plugin!r} ({hook}): pass either a {spec_type.__name__} or its fields "
                "as keywords to register(), not both."
            )
        raw = spec if spec is not None else dict(fields)
        if isinstance(raw, spec_type):
            raw = {name: getattr(raw, name) for name in raw.model_fields_set | {"name"}}
        elif not isinstance(raw, Mapping):
            raise SpecError(
                f"plugin {plugin!r} ({hook}) registered a {type(raw).__name__}; "
                f"register a {spec_type.__name__} or its fields as keywords."
            )
        if raw.get("plugin") not in (None, plugin):
            raise SpecError(
                f"plugin {plugin!r} ({hook}) set plugin={raw['plugin']!r} on spec "
                f"{raw.get('name')!r}; leave `plugin` unset, the registry fills it in."
            )
        try:
            return spec_type.model_validate({**raw, "plugin": plugin})
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(spec)'}: {e['msg']}" for e in err.errors())
            raise SpecError(
                f"plugin {plugin!r} registered an invalid {spec_type.__name__} "
                f"{raw.get('name', '<unnamed>')!r} from {hook}: {problems}. "
                f"Fix the spec in plugin {plugin!r}."
            ) from None

    def _add_unique(self, table: dict[str, SpecT], spec: SpecT, what: str) -> None:
        existing = table.get(spec.name)
        if existing is not None:
            raise SpecError(
                f"duplicate {what} {spec.name!r}: registered by plugin {existing.plugin!r} and again "
                f"by plugin {spec.plugin!r}. Rename one of them, or load only one of the two plugins."
            )
        table[spec.name] = spec

    # `plugin` is positional-only, so a spec's own `plugin=` keyword reaches validation (rule 2).
    def register_lowering(self, plugin: str, /, spec: Any = None, **fields: Any) -> LoweringSpec:
        lowering = self._validate(LoweringSpec, plugin, "autofuser_register_lowerings", spec, fields)
        self._add_unique(self.lowerings, lowering, "lowering")
        for target in lowering.targets:
            claims = self._claims.setdefault(_target_key(target), [])
            claims.append(lowering)
            self._by_target[_target_key(target)] = max(claims, key=lambda s: s.priority)
        return lowering

    def check_ties(self) -> None:
        """Refuse two lowerings claiming one target at its highest priority.

        Called once every plugin has registered, so the outcome doesn't depend on
        the order plugins load in (a low-priority tie under a clear winner is fine).
        """
        for (_, target), claims in self._claims.items():
            _check_tie(claims, "lowering", f"target {describe_target(target)}")
        for count in sorted({s.products for s in self.product_layout_specs.values()}):
            _check_tie(
                [s for s in self.product_layout_specs.values() if s.products == count],
                "product layout",
                f"groups of {count} products",
            )

    def register_strategy(self, plugin: str, /, spec: Any = None, **fields: Any) -> StrategySpec:
        strategy = self._validate(StrategySpec, plugin, "autofuser_register_strategies", spec, fields)
        self._add_unique(self.strategies, strategy, "strategy")
        return strategy

    def register_product_layout(self, plugin: str, /, spec: Any = None, **fields: Any) -> ProductLayoutSpec:
        layout = self._validate(ProductLayoutSpec, plugin, "autofuser_register_product_layouts", spec, fields)
        self._add_unique(self.product_layout_specs, layout, "product layout")
        return layout

    def register_quantizer(self, plugin: str, /, spec: Any = None, **fields: Any) -> QuantizerSpec:
        quantizer = self._validate(QuantizerSpec, plugin, "autofuser_register_quantizers", spec, fields)
        self._add_unique(self.quantizers, quantizer, "quantizer")
        return quantizer

    def register_options(self, plugin: str, /, model: Any = None, **fields: Any) -> type[BaseModel]:
        """A plugin's ``fuse()`` options: a pydantic model class, or fields as
        ``name=(type, Field(default, strict=True, description=...))`` made into one.

        :raises SpecError: a field without a default or a description, a name the core's
            ``FuseOptions`` or another plugin already has, or options registered twice.
        """
        from .fuse import FuseOptions  # fuse imports this module

        hook = "autofuser_register_options"
        if model is not None and fields:
            raise SpecError(f"plugin {plugin!r}, {hook}: give an options model or named fields, not both.")
        if model is None:
            try:
                model = create_model(f"{plugin}_options", __config__=_PLUGIN_OPTIONS_CONFIG, **fields)
            except Exception as err:
                raise SpecError(
                    f"plugin {plugin!r}, {hook}: the fields {sorted(fields)} don't make an options model "
                    f"({type(err).__name__}: {err}); give each as name=(type, Field(default, description=...))."
                ) from None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise SpecError(f"plugin {plugin!r}, {hook}: {model!r} is not a pydantic model class.")
        if plugin in self.options:
            raise SpecError(f"plugin {plugin!r}, {hook}: options registered twice; register one model.")
        for name, info in model.model_fields.items():
            if info.is_required():
                raise SpecError(f"plugin {plugin!r}, {hook}: option {name!r} has no default; give it one.")
            if not info.description:
                raise SpecError(f"plugin {plugin!r}, {hook}: option {name!r} has no description; give it one.")
            if name in FuseOptions.model_fields:
                raise SpecError(f"plugin {plugin!r}, {hook}: option {name!r} is a core fuse() option; rename it.")
            owner = next((other for other, m in self.options.items() if name in m.model_fields), None)
            if owner is not None:
                raise SpecError(f"plugin {plugin!r}, {hook}: option {name!r} is already plugin {owner!r}'s; rename it.")
        self.options[plugin] = model
        return model

    def option_owner(self, name: str) -> Optional[str]:
        """The plugin whose options model has the field ``name``, or ``None``."""
        return next((plugin for plugin, model in self.options.items() if name in model.model_fields), None)

    # -- compiling with plugin faults contained ------------------------------

    def guarded(self) -> "Registry":
        """This registry with every spec's compile-time plugin code guarded
        (``_GUARDED_FIELDS``): made once, after registration, and planned with by
        every compile of this plugin set. An exception a guarded function raises
        is recorded (``PluginFault``, warned once per compile) and answered as
        ``_answer_fault`` says; a hook's own refusals (``ctx.refuse``,
        ``GroupRefused``) pass through unchanged."""
        if self._guarded is not None:
            return self._guarded
        guarded = Registry()
        copies = {id(spec): _guarded_spec(spec) for spec in self.lowerings.values()}  # claims, targets: lowerings
        guarded.lowerings = {name: copies[id(spec)] for name, spec in self.lowerings.items()}
        guarded.strategies = {name: _guarded_spec(spec) for name, spec in self.strategies.items()}
        guarded.product_layout_specs = {name: _guarded_spec(spec) for name, spec in self.product_layout_specs.items()}
        guarded.quantizers = dict(self.quantizers)  # used before compiling, by ``fuse()``
        guarded.options = dict(self.options)
        guarded._claims = {key: [copies[id(s)] for s in claims] for key, claims in self._claims.items()}
        guarded._by_target = {key: copies[id(spec)] for key, spec in self._by_target.items()}
        guarded._guarded = guarded
        self._guarded = guarded
        return guarded

    # -- look-ups ------------------------------------------------------------

    def lowering_for(self, node: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> Optional[LoweringSpec]:
        """The lowering that handles ``node``, or ``None`` if no plugin does."""
        if node.op == "call_function":
            return self._by_target.get(("call_function", node.target))
        if node.op == "call_method":
            return self._by_target.get(("call_method", node.target))
        if node.op == "call_module" and root is not None:
            assert isinstance(node.target, str)  # fx: a call_module's target is the module's path
            module_type = type(root.get_submodule(node.target))
            # An exact type match first, then the nearest registered base class.
            for klass in module_type.__mro__:
                found = self._by_target.get(("call_module", klass))
                if found is not None:
                    return found
        return None

    def strategies_by_priority(self) -> list[StrategySpec]:
        return sorted(self.strategies.values(), key=lambda s: (-s.priority, s.name))

    def product_layouts(self) -> dict[int, Any]:
        """The layout function for each number of products some plugin lays out
        (``compose_group``'s ``product_layouts``): the highest priority wins."""
        best: dict[int, ProductLayoutSpec] = {}
        for spec in self.product_layout_specs.values():
            if spec.products not in best or spec.priority > best[spec.products].priority:
                best[spec.products] = spec
        return {count: spec.lay_out for count, spec in best.items()}


#: Options models made from named fields are, like ``FuseOptions``, frozen and refuse unknown names.
_PLUGIN_OPTIONS_CONFIG = ConfigDict(frozen=True, extra="forbid")


def _check_tie(claims: list, what: str, claimed: str) -> None:
    """Refuse two specs claiming one thing at its highest priority."""
    top = max(s.priority for s in claims)
    tied = [s for s in claims if s.priority == top]
    if len(tied) > 1:
        a, b = tied[0], tied[1]
        raise SpecError(
            f"tie on {claimed}: {what} {b.name!r} of plugin {b.plugin!r} and "
            f"{what} {a.name!r} of plugin {a.plugin!r} both claim it at priority {top}. Give the one "
            "that should win a higher `priority`, or load only one of the two plugins."
        )


# ---------------------------------------------------------------------------
# Plugin faults while a graph compiles
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginFault:
    """Plugin code that raised while a graph compiled: which plugin, which hook
    (``where``: a spec's field such as ``lowering 'x.abs' (LoweringSpec.lower)``,
    or a hook name such as ``autofuser_veto_fusion``), and the sentence the report
    and the warning show."""

    plugin: str
    where: str
    sentence: str
    spec: Optional[str] = None  # the name of the spec whose code raised, if a spec's


#: The faults of the compile in progress (``compile_graph`` sets a fresh list); one
#: entry per plugin and hook, in the order they first happened.
PLUGIN_FAULTS: contextvars.ContextVar[Optional[list[PluginFault]]] = contextvars.ContextVar(
    "autofuser_plugin_faults", default=None
)


class PluginHookError(PluginError):
    """Plugin code raised while a graph compiled. The message names the plugin and
    the hook; ``__cause__`` is the plugin's own exception."""

    def __init__(self, fault: PluginFault):
        super().__init__(fault.sentence)
        self.fault = fault


def record_fault(plugin: str, where: str, err: BaseException, outcome: str, spec: Optional[str] = None) -> PluginFault:
    """Note that ``plugin``'s ``where`` raised ``err`` (``outcome``: what the core
    does instead, e.g. "the node runs eager"), and warn the first time this plugin
    and hook fail in the compile in progress."""
    message = str(err).splitlines()[0] if str(err) else ""
    fault = PluginFault(
        plugin,
        where,
        (
            f"plugin {plugin!r} raised {type(err).__name__}{': ' + message if message else ''} in {where}; "
            f"{outcome}. Fix the plugin, or leave it out of plugins=[...]"
        ),
        spec,
    )
    faults = PLUGIN_FAULTS.get()
    if faults is not None and any(f.plugin == plugin and f.where == where for f in faults):
        return fault
    if faults is not None:
        faults.append(fault)
    warnings.warn(f"AutoFuser: {fault.sentence}", stacklevel=2)
    return fault


def _faulted(spec: Spec) -> bool:
    """Whether code of ``spec`` has already raised in the compile in progress."""
    faults = PLUGIN_FAULTS.get() or ()
    return any(f.plugin == spec.plugin and f.spec == spec.name for f in faults)


#: The plugin code of each spec type that compiling a graph calls, and what the core does
#: when it raises: "refuse_node" (the node stays eager, ``LoweringRefused``), "no_groups"
#: (the strategy proposes nothing), "refuse_group" (``accepts`` answers a refusal), or
#: "raise" (a ``PluginHookError``, which the planner and the verifier turn into a group
#: that stays eager with the message as its reason).
_GUARDED_FIELDS: dict[type, dict[str, str]] = {
    LoweringSpec: {"lower": "refuse_node"},
    StrategySpec: {
        "propose": "no_groups",
        "compose": "raise",
        "accepts": "refuse_group",
        "configs": "raise",
        "default_config": "raise",
        "is_valid": "raise",
        "generate": "raise",
    },
    ProductLayoutSpec: {"lay_out": "raise"},
}
_KINDS = {LoweringSpec: "lowering", StrategySpec: "strategy", ProductLayoutSpec: "product layout"}
_OUTCOMES = {
    "refuse_node": "the node runs eager",
    "no_groups": "the strategy proposes no groups for this graph",
    "refuse_group": "the group runs eager",
    "raise": "the group runs eager",
    "not_applied": "the group is not timed against this split",
}


def _guarded_spec(spec: SpecT) -> SpecT:
    fields = (
        _GUARDED_FIELDS[type(spec)]
        if type(spec) in _GUARDED_FIELDS
        else next(fields for base, fields in _GUARDED_FIELDS.items() if isinstance(spec, base))
    )
    kind = next(name for base, name in _KINDS.items() if isinstance(spec, base))
    update: dict[str, Any] = {}
    for name, answer in fields.items():
        function = getattr(spec, name)
        if function is not None:
            update[name] = _guard(spec, f"{kind} {spec.name!r} ({type(spec).__name__}.{name})", function, answer)
    if isinstance(spec, StrategySpec) and spec.split_rules:
        # A split rule's applies() that raises times the group against no such split; its
        # refuse() that raises refuses the group it was asked about.
        update["split_rules"] = tuple(_guarded_split_rule(spec, rule) for rule in spec.split_rules)
    return spec.model_copy(update=update)


def _guarded_split_rule(spec: StrategySpec, rule: SplitRule) -> SplitRule:
    where = f"strategy {spec.name!r} (split rule {rule.description!r}, SplitRule."
    update = {"applies": _guard(spec, where + "applies)", rule.applies, "not_applied")}
    if rule.refuse is not None:
        update["refuse"] = _guard(spec, where + "refuse)", rule.refuse, "refuse_group")
    return rule.model_copy(update=update)


def _guard(spec: Spec, where: str, function: Callable[..., Any], answer: str) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if answer == "no_groups" and _faulted(spec):
            return []  # a strategy that failed once in this compile proposes nothing more
        try:
            return function(*args, **kwargs)
        except (LoweringRefused, GroupRefused):
            raise  # the hook's own answer
        except Exception as err:
            fault = record_fault(spec.plugin or "?", where, err, _OUTCOMES[answer], spec.name)
            if answer == "refuse_node":
                raise LoweringRefused("plugin_failed", fault.sentence) from err
            if answer == "no_groups":
                return []
            if answer == "refuse_group":
                return "plugin_failed", fault.sentence
            if answer == "not_applied":
                return False
            raise PluginHookError(fault) from err

    setattr(guarded, "__wrapped__", function)  # a function takes attributes; mypy has no way to say so
    guarded.__name__ = getattr(function, "__name__", "guarded")
    return guarded
