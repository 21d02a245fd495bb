"""Helpers for plugins that keep one op per file.

``collect_specs(package)`` imports every module of ``package`` and gathers the
``SPECS`` list each defines, so adding an op is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from .specs import Spec


def collect_specs(package: ModuleType) -> list[Spec]:
    specs: list[Spec] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        specs.extend(getattr(module, "SPECS", ()))
    return specs
