"""AutoFuser: fuse chains of PyTorch ops into Triton kernels.

Public API::

    model = autofuser.fuse(model)          # compiles on the first forward
    y = model(x)
    autofuser.mark_dynamic(x, 1)           # x's dim 1 varies: kernels take its size at run time
    print(model.report())                  # what was fused, what wasn't, and why

Plugins implement the hooks in ``autofuser_core.hookspecs`` with the spec
types exported here. A strategy that composes and writes its groups itself
(``StrategySpec.compose`` and ``generate``) builds on ``program_from_nodes``,
``GroupProgram``/``KernelTensor`` (what it composed), ``GroupRefused`` (a
refusal with a reason code) and ``KernelSource`` (what it wrote), and writes
its kernels with ``autofuser.kernel``. Tile sizes
and grids are checked against ``device_limits(device)`` (shared memory per
block, multiprocessors), one helper for every plugin.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type checker sees the names; at run time ``__getattr__`` imports them
    from autofuser_core.codegen import KernelSource
    from autofuser_core.device_limits import DeviceLimits, device_limits
    from autofuser_core.dynamic import mark_dynamic
    from autofuser_core.effects import first_write
    from autofuser_core.errors import (
        AutoFuserError,
        CacheError,
        CaptureError,
        CompileFailedWarning,
        NoKernelsWarning,
        OpaquePartError,
        PluginError,
        SpecError,
    )
    from autofuser_core.group import GroupProgram, GroupRefused, KernelTensor, program_from_nodes
    from autofuser_core.hookspecs import GRADIENTS_KEY, hookimpl
    from autofuser_core.ir import LoweringContext, Value, annotate_node, broadcast_shapes, describe_tensor
    from autofuser_core.oplib import collect_specs
    from autofuser_core.plugins import load_plugins
    from autofuser_core.specs import (
        DEFAULT_TOLERANCES,
        PRODUCT_TOLERANCES,
        LoweringSpec,
        ProductLayoutSpec,
        QuantizerSpec,
        Sample,
        SplitRule,
        StrategySpec,
        Tolerance,
    )

#: Where each public name lives. ``import autofuser`` imports none of them (nor torch): the
#: ``autofuser`` command's ``--help`` is answered without torch, and a name's module is
#: imported on its first use (PEP 562), as ``from autofuser import fuse`` does at once.
_LAZY_NAMES = {
    "KernelSource": "autofuser_core.codegen",
    "DeviceLimits": "autofuser_core.device_limits",
    "device_limits": "autofuser_core.device_limits",
    "mark_dynamic": "autofuser_core.dynamic",
    "first_write": "autofuser_core.effects",
    **dict.fromkeys(
        (
            "AutoFuserError",
            "CacheError",
            "CaptureError",
            "CompileFailedWarning",
            "NoKernelsWarning",
            "OpaquePartError",
            "PluginError",
            "SpecError",
        ),
        "autofuser_core.errors",
    ),
    **dict.fromkeys(("GroupProgram", "GroupRefused", "KernelTensor", "program_from_nodes"), "autofuser_core.group"),
    **dict.fromkeys(("GRADIENTS_KEY", "hookimpl"), "autofuser_core.hookspecs"),
    **dict.fromkeys(
        ("LoweringContext", "Value", "annotate_node", "broadcast_shapes", "describe_tensor"), "autofuser_core.ir"
    ),
    "collect_specs": "autofuser_core.oplib",
    "load_plugins": "autofuser_core.plugins",
    **dict.fromkeys(
        (
            "DEFAULT_TOLERANCES",
            "PRODUCT_TOLERANCES",
            "LoweringSpec",
            "ProductLayoutSpec",
            "QuantizerSpec",
            "Sample",
            "SplitRule",
            "StrategySpec",
            "Tolerance",
        ),
        "autofuser_core.specs",
    ),
}


def __getattr__(name: str):
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'autofuser' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES))


# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TOLERANCES",
    "PRODUCT_TOLERANCES",
    "AutoFuserError",
    "CacheError",
    "CaptureError",
    "CompileFailedWarning",
    "DeviceLimits",
    "GRADIENTS_KEY",
    "GroupProgram",
    "GroupRefused",
    "KernelSource",
    "KernelTensor",
    "LoweringContext",
    "LoweringSpec",
    "NoKernelsWarning",
    "OpaquePartError",
    "PluginError",
    "ProductLayoutSpec",
    "QuantizerSpec",
    "Sample",
    "SpecError",
    "SplitRule",
    "StrategySpec",
    "Tolerance",
    "Value",
    "annotate_node",
    "broadcast_shapes",
    "capture",
    "collect_specs",
    "describe_tensor",
    "device_limits",
    "first_write",
    "fuse",
    "hookimpl",
    "load_plugins",
    "mark_dynamic",
    "program_from_nodes",
]


def capture(model, *example_inputs, **example_kwargs):
    """Trace ``model`` into one shape-annotated ``torch.fx.GraphModule``
    (see ``autofuser_core.capture.capture``)."""
    from autofuser_core.capture import capture as _capture

    return _capture(model, *example_inputs, **example_kwargs)


def fuse(model, plugins=None, **options):
    """Return a module that behaves like ``model`` and runs fused Triton kernels
    (see ``autofuser_core.fuse.fuse``)."""
    from autofuser_core.interpreter import arrange_interpreter

    # Before autofuser_core.fuse imports Triton: Triton decorates its library when imported.
    arrange_interpreter()
    from autofuser_core.fuse import fuse as _fuse

    return _fuse(model, plugins=plugins, **options)
