"""AutoFuser as a ``torch.compile`` backend::

    compiled = torch.compile(model, backend="autofuser")
    compiled = torch.compile(model, backend="autofuser", options={"plugins": [...], "tune_budget_s": 5})

torch finds the backend by name through the ``torch_dynamo_backends``
entry-point group (AutoFuser's pyproject declares it). Dynamo captures the
model's bytecode and hands over one ``GraphModule`` per graph, split where
Python code can't be captured (graph breaks); each goes through the same
pipeline as ``autofuser.fuse``: it is wrapped by ``fuse()`` and compiled on its
first call with real tensors (Dynamo's own guards decide when a graph is
reused, AutoFuser's signature guard when a graph is recompiled). ``options``
are ``fuse()``'s options plus ``plugins``.

``compiled_graphs()`` returns the ``FusedModule`` of every graph this backend
compiled in this process and that Dynamo still holds, oldest first; each has
``.report()``.
"""

from __future__ import annotations

import os
import re
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from autofuser_core.errors import AutoFuserError
from autofuser_core.fuse import FusedModule, fuse

_compiled: list[weakref.ref] = []
_graphs_named = 0  # graphs this backend was handed in this process, for their names


def autofuser_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: Optional[str] = None,
    options: Optional[dict[str, Any]] = None,
) -> Callable[..., Any]:
    """The backend function torch.compile calls with each graph Dynamo captured.

    :param gm: Dynamo's graph; its placeholders are the graph's tensor (and
        size) inputs, parameters included.
    :param example_inputs: Dynamo's example inputs; unused: the graph compiles
        on its first real call, with the real inputs, as ``fuse()`` does.
    :param mode: torch.compile's ``mode``; AutoFuser has one mode, so any other
        than ``None``/``"default"`` is ignored with a warning.
    :param options: ``fuse()`` options, and ``plugins`` (as for ``fuse()``).
    :return: a callable running the fused graph.
    """
    if mode not in (None, "default"):
        warnings.warn(
            f"AutoFuser: torch.compile mode {mode!r} has no meaning for the autofuser backend; ignored. "
            "Pass AutoFuser's options through options={...}."
        )
    if options is not None and not isinstance(options, dict):
        raise AutoFuserError(f"torch.compile(backend='autofuser', options=...) takes a dict, not {options!r}")
    options = dict(options or {})
    plugins = options.pop("plugins", None)
    # Dynamo may hand over a lazily compiled GraphModule whose forward reads as
    # (*args, **kwargs) until first called; a plain one has the graph's real signature.
    graph_module = torch.fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
    fused = fuse(graph_module, plugins=plugins, **options)
    global _graphs_named
    _graphs_named += 1
    fused._display_name = _graph_name(gm, _graphs_named)
    _compiled[:] = [ref for ref in _compiled if ref() is not None]
    _compiled.append(weakref.ref(fused))
    return fused


def _graph_name(gm: torch.fx.GraphModule, number: int) -> str:
    """A Dynamo graph's name in progress lines and reports: the user's function it was
    captured from, as Dynamo's nodes record it (``stack_trace``), and its number in this
    process; every graph is a ``GraphModule``, which says nothing."""
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        found = re.findall(r'File "([^"]+)", line \d+, in (\S+)', trace) if isinstance(trace, str) else []
        if found:
            file, function = found[0]
            return f"graph {number} of {function} ({os.path.basename(file)})"
    return f"graph {number}"


def compiled_graphs() -> list[FusedModule]:
    """The graphs this backend compiled that are still alive, oldest first."""
    return [module for module in (ref() for ref in _compiled) if module is not None]
