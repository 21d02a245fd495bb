"""Weight quantisation before fusing: ``fuse(model, quantize=...)``.

The chosen quantiser (a ``QuantizerSpec`` a plugin registered) replaces the
selected layers of a copy of the model with its quantised layers; the user's
model is left as it was, and shares no tensor with the copy. What was quantised, and the weight bytes
before and after, go into every ``FusionReport``.
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Any, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import AutoFuserError
from .registry import Registry


class QuantizeOptions(BaseModel):
    """Which layers to quantise, and to what.

    ``fuse(model, quantize="mxint8")`` is ``QuantizeOptions(format="mxint8")``;
    a dict (``{"format": "mxint8", "include": ["blocks.*"], "min_numel":
    4096}``) or an instance selects layers: a layer is quantised when its
    qualified name matches one of ``include`` and none of ``exclude``
    (``fnmatch`` patterns) and its weight has at least ``min_numel`` elements.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: str = Field(min_length=1, description="A registered quantiser's format, e.g. 'mxint8'.")
    include: tuple[str, ...] = Field(("*",), description="fnmatch patterns of layer names to quantise.")
    exclude: tuple[str, ...] = Field((), description="fnmatch patterns of layer names to leave in floating point.")
    min_numel: int = Field(0, ge=0, description="Smallest weight (in elements) worth quantising.")


class QuantizedLayer(BaseModel):
    """One layer that was quantised."""

    model_config = ConfigDict(extra="forbid")
    name: str
    format: str
    shape: list[int]
    bytes_before: int
    bytes_after: int


def parse_quantize(value: Union[None, str, dict, QuantizeOptions]) -> Optional[QuantizeOptions]:
    """The ``quantize=`` argument of ``fuse()`` as options (``None``: no quantisation)."""
    if value is None or isinstance(value, QuantizeOptions):
        return value
    try:
        if isinstance(value, str):
            return QuantizeOptions(format=value)
        if isinstance(value, dict):
            return QuantizeOptions(**value)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise AutoFuserError(
            f"invalid quantize= setting: {problems}. Known keys: {', '.join(QuantizeOptions.model_fields)}."
        ) from None
    raise AutoFuserError(f"quantize= takes a format name, a dict or QuantizeOptions, not {type(value).__name__}.")


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


#: Module names an error about an unmatched pattern lists, at most.
_NAMES_SHOWN = 8


def _check_patterns_match(model: torch.nn.Module, options: QuantizeOptions, module_types: Any) -> None:
    """Refuse an ``include`` or ``exclude`` pattern that matches no module of ``model``: a
    misspelt name would otherwise quantise nothing (or everything) without a word.

    :raises AutoFuserError: naming the pattern and some of the model's module names,
        those the quantiser can replace first.
    """
    names = [name or "<model>" for name, _ in model.named_modules()]
    for key in ("include", "exclude"):
        for pattern in getattr(options, key):
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                continue
            layers = [name or "<model>" for name, m in model.named_modules() if type(m) in module_types]
            shown = (layers or names)[:_NAMES_SHOWN]
            kind = "layers it can quantise" if layers else "modules"
            more = ", ..." if len(layers or names) > len(shown) else ""
            raise AutoFuserError(
                f"quantize {key} pattern {pattern!r} matches no module of {type(model).__name__}. Patterns are "
                f"fnmatch patterns over qualified module names ('<model>' for the model itself); its "
                f"{kind}: {', '.join(shown)}{more}. Fix the pattern, or drop it."
            )


def quantize_model(
    model: torch.nn.Module, options: QuantizeOptions, registry: Registry
) -> tuple[torch.nn.Module, list[QuantizedLayer]]:
    """A copy of ``model`` with the selected layers replaced by ``options.format``'s quantised layers.

    :raises AutoFuserError: no loaded plugin provides the format, an ``include`` or
        ``exclude`` pattern matches no module, or a layer's weight can't be encoded
        (the message names the layer).
    """
    spec = next((q for q in registry.quantizers.values() if q.format == options.format), None)
    if spec is None:
        known = sorted(q.format for q in registry.quantizers.values())
        raise AutoFuserError(
            f"no loaded plugin provides the weight format {options.format!r} "
            f"(available: {', '.join(known) or 'none'}); load the plugin that registers it."
        )
    _check_patterns_match(model, options, spec.module_types)
    selected = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) in spec.module_types
            and isinstance(weight, torch.Tensor)
            and weight.numel() >= options.min_numel
            and any(fnmatch.fnmatchcase(name or "<model>", p) for p in options.include)
            and not any(fnmatch.fnmatchcase(name or "<model>", p) for p in options.exclude)
        ):
            selected[name] = module
    # A full copy, except the float weights about to be replaced: those are only read. A
    # weight another (unselected) module also holds - tied weights - is copied too.
    kept = {id(p) for name, m in model.named_modules() if name not in selected for p in m.parameters(recurse=False)}
    copied = copy.deepcopy(model, {id(m.weight): m.weight for m in selected.values() if id(m.weight) not in kept})
    layers: list[QuantizedLayer] = []
    for name in selected:
        module = copied.get_submodule(name) if name else copied
        weight = module.weight
        assert isinstance(weight, torch.Tensor)  # how the layer was selected
        try:
            replacement = spec.replace(module)
        except ValueError as err:
            raise AutoFuserError(
                f"cannot quantise layer {name or '<model>'!r} ({type(module).__name__}, weight "
                f"{list(weight.shape)}) to {options.format}: {err}. Fix the weights, or leave "
                f"the layer in floating point with quantize={{'format': {options.format!r}, "
                f"'exclude': [{name or '<model>'!r}]}}."
            ) from None
        owner, _, attr = name.rpartition(".")
        if not name:
            copied = replacement  # the model is one layer
        else:
            setattr(copied.get_submodule(owner) if owner else copied, attr, replacement)
        layers.append(
            QuantizedLayer(
                name=name or "<model>",
                format=options.format,
                shape=list(weight.shape),
                bytes_before=_nbytes([weight]),
                bytes_after=_nbytes(replacement.buffers(recurse=False)),
            )
        )  # the packed tensors
    return copied, layers
