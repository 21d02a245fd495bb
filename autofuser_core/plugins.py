"""Loading plugins: one pluggy manager and one registry per ``fuse()`` call.

``load_plugins(None)`` loads every plugin installed in the ``autofuser``
entry-point group (only the bundled ones when the environment variable
``AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD`` is set to a non-empty value other than
``0``). ``load_plugins([...])`` loads exactly what it is given: modules,
objects carrying hook implementations, or entry-point names.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any, Iterable, Optional, Sequence

import pluggy

from . import hookspecs
from .errors import PluginError, SpecError
from .interpreter import arrange_interpreter
from .registry import Registry

ENTRY_POINT_GROUP = "autofuser"
AUTOLOAD_ENV = "AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD"
BUNDLED_PREFIX = "autofuser_plugins."
HOOK_PREFIX = "autofuser_"

_REGISTRATION_HOOKS = {
    "autofuser_register_lowerings": "register_lowering",
    "autofuser_register_strategies": "register_strategy",
    "autofuser_register_quantizers": "register_quantizer",
    "autofuser_register_product_layouts": "register_product_layout",
    "autofuser_register_options": "register_options",
}


class _PluginManager(pluggy.PluginManager):
    """Treats every ``autofuser_*`` function as a hook implementation, marked or
    not (as pytest does for ``pytest_*``), so a misspelled hook name reaches
    ``check_pending`` and fails instead of being ignored."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(HOOK_PREFIX):
            method = getattr(plugin, name, None)
            if inspect.isroutine(method):
                return {}
        return opts


@dataclass
class PluginSet:
    """The plugins of one ``fuse()`` call and everything they registered."""

    manager: pluggy.PluginManager
    registry: Registry
    names: list[str] = field(default_factory=list)


def installed_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "") not in ("", "0")


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> Any:
    try:
        return ep.load()
    except Exception as err:  # a broken third-party install must name itself
        raise PluginError(
            f"plugin {ep.name!r} (entry point {ep.value!r} in group {ENTRY_POINT_GROUP!r}) failed to "
            f"import: {type(err).__name__}: {err}. Reinstall or uninstall that package."
        ) from err


def _resolve(item: Any, available: dict[str, importlib.metadata.EntryPoint]) -> tuple[str, Any]:
    """One element of ``plugins=[...]`` -> (name, plugin object)."""
    if isinstance(item, str):
        if item in available:
            return item, _load_entry_point(available[item])
        if "." in item:
            try:
                return item, importlib.import_module(item)
            except ImportError:
                pass
        raise PluginError(
            f"unknown plugin {item!r}: it is neither an installed plugin of the {ENTRY_POINT_GROUP!r} "
            f"entry-point group ({', '.join(sorted(available)) or 'none installed'}) nor an importable "
            "module. Check the spelling, or pass the plugin module itself."
        )
    if isinstance(item, ModuleType):
        return item.__name__, item
    return getattr(item, "__name__", None) or type(item).__name__, item


def _not_a_plugin(name: str, plugin: Any) -> PluginError:
    what = f"module {plugin.__name__!r}" if isinstance(plugin, ModuleType) else repr(plugin)
    return PluginError(
        f"{name!r} is not a plugin: {what} has no {HOOK_PREFIX}* hook implementations (functions named after "
        f"the hooks in autofuser_core/hookspecs.py, such as autofuser_register_lowerings). Pass the module "
        "that implements the hooks, or an installed plugin's entry-point name; docs/writing-a-plugin.md "
        "shows how to write a plugin."
    )


def load_plugins(plugins: Optional[Sequence[Any]] = None) -> PluginSet:
    """Load a plugin set and run its registration hooks.

    :param plugins: ``None`` for every installed plugin, else a list of
        modules, hook-carrying objects or entry-point names.
    :raises PluginError: an unknown name, a module or object implementing no
        hook, a misspelled hook, a hook with the wrong arguments, or a plugin
        whose registration hook failed.
    :raises SpecError: an invalid, duplicate or tied spec.
    """
    # Before any plugin is imported: Triton reads TRITON_INTERPRET when it decorates their kernels.
    arrange_interpreter()
    available = installed_entry_points()
    if plugins is None:
        chosen = [
            (name, _load_entry_point(ep))
            for name, ep in sorted(available.items())
            if not _autoload_disabled() or ep.value.startswith(BUNDLED_PREFIX)
        ]
    elif isinstance(plugins, (str, ModuleType)) or not isinstance(plugins, Iterable):
        raise PluginError(f"plugins= takes a list (or None for all installed plugins), not {plugins!r}.")
    else:
        chosen = [_resolve(item, available) for item in plugins]

    manager = _PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    names: list[str] = []
    for name, plugin in chosen:
        if name in names or manager.is_registered(plugin):
            continue  # the same plugin named twice is loaded once
        try:
            manager.register(plugin, name=name)
        except pluggy.PluginValidationError as err:
            raise PluginError(f"plugin {name!r} has a hook that doesn't match its spec: {err}") from None
        names.append(name)
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as err:
        known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith(HOOK_PREFIX)))
        raise PluginError(f"{err}. Known hooks: {known}. Rename the function to one of them.") from None
    for name in names:
        # An importable module that is no plugin (plugins=["os.path"]) would otherwise load
        # and do nothing, silently.
        plugin = manager.get_plugin(name)
        if not manager.get_hookcallers(plugin):
            raise _not_a_plugin(name, plugin)

    registry = Registry()
    for hook_name, method in _REGISTRATION_HOOKS.items():
        caller = getattr(manager.hook, hook_name)
        for impl in caller.get_hookimpls():
            register = partial(getattr(registry, method), impl.plugin_name)
            try:
                impl.function(*[{"register": register}[arg] for arg in impl.argnames])
            except (SpecError, PluginError):
                raise
            except Exception as err:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} failed in {hook_name}: {type(err).__name__}: {err}"
                ) from err
    registry.check_ties()
    return PluginSet(manager=manager, registry=registry, names=names)
