"""Dynamic dimensions: one kernel source for every size of a dimension that varies.

Capture stays specialised on the concrete shapes of each call (it is cheap); what is
shared across sizes is the kernels. While a signature with dynamic dimensions
compiles, a ``SizeRule`` is in force (``size_rule(...)``): it says which integers of
the group programs derive from a dynamic size (an element count, a size or a stride:
a multiple of one of the call's dynamic sizes that is no static size of the inputs
or parameters). A kernel writer of a strategy that declares
``StrategySpec.dynamic_sizes`` writes every integer of its indexing through
``sized(n)``: a literal as before, or - for a size that derives from a dynamic one -
the name of a run-time argument of the kernel (``sz0``, ``sz1``, ...), numbered by
first use, whose value this program passes at launch (``KernelSource.sizes``). The
text of the kernel then does not change with the size, nor does its name, its tuning
key (which takes the sizes' buckets instead) or Triton's compiled binary.

Which integers are named never decides correctness: every program passes its own
values, and a literal is that program's own size. A static size that happens to be a
multiple of a dynamic one is named too (and the source of that size then differs
from the class's others): that costs one more kernel, never a wrong number.
docs/dynamic.md describes the whole design.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from .errors import AutoFuserError

#: The attribute ``mark_dynamic`` sets on a tensor (``torch._dynamo.mark_dynamic``'s
#: ``_dynamo_dynamic_indices`` is read too).
MARK_ATTRIBUTE = "_autofuser_dynamic_dims"
_DYNAMO_MARK = "_dynamo_dynamic_indices"


def mark_dynamic(tensor: torch.Tensor, dim) -> None:
    """Say that dimension ``dim`` (an int, or a sequence of them; negative counts from
    the end) of ``tensor`` varies from call to call, as ``torch._dynamo.mark_dynamic``
    does: a fused model called with it compiles kernels that take that dimension's size
    at run time, from the first call on, instead of one set of kernels per size.

    :raises AutoFuserError: ``tensor`` is not a tensor, or ``dim`` is not an int or is out
        of range for the tensor's rank.
    """
    if not isinstance(tensor, torch.Tensor):
        raise AutoFuserError(
            f"mark_dynamic() takes a torch.Tensor, got {type(tensor).__name__}; "
            "mark the tensor you pass to the fused model."
        )
    dims = [dim] if not isinstance(dim, (list, tuple, range)) else list(dim)
    rank = tensor.dim()
    if rank == 0:
        raise AutoFuserError("mark_dynamic(): a 0-d tensor (a scalar) has no dims to mark; mark a tensor with dims.")
    found = set(getattr(tensor, MARK_ATTRIBUTE, ()))
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise AutoFuserError(
                f"mark_dynamic(): dim {d!r} ({type(d).__name__}) is not an int; give a dimension index "
                f"in [{-rank}, {rank - 1}] for this {rank}-d tensor."
            )
        if not -rank <= d < rank:
            raise AutoFuserError(
                f"mark_dynamic(): dim {d} is out of range for a tensor of shape {list(tensor.shape)} "
                f"({rank} dims); give a dimension index in [{-rank}, {rank - 1}]."
            )
        found.add(d % rank)
    setattr(tensor, MARK_ATTRIBUTE, frozenset(found))


def marked_dims(tensor: torch.Tensor) -> frozenset[int]:
    """The dims of ``tensor`` marked dynamic, by ``mark_dynamic`` or ``torch._dynamo.mark_dynamic``."""
    own = tensor.__dict__.get(MARK_ATTRIBUTE) if hasattr(tensor, "__dict__") else None
    dynamo = tensor.__dict__.get(_DYNAMO_MARK) if hasattr(tensor, "__dict__") else None
    if not own and not dynamo:
        return frozenset()
    rank = max(tensor.dim(), 1)
    return frozenset(own or ()) | frozenset(d % rank for d in (dynamo or ()))


def bucket(size: int) -> int:
    """The size bucket of a dynamic size: the next power of two at least ``size``.
    Tuning is cached per bucket, and calls whose dynamic sizes share buckets are one
    shape class (checked once)."""
    return 1 if size <= 1 else 1 << (size - 1).bit_length()


@dataclass(frozen=True)
class SizeRule:
    """Which integers of a compile with dynamic dimensions derive from a dynamic size:
    ``dynamic`` the call's sizes of its dynamic dims (each at least 2), ``static`` every
    other size of the inputs and of the model's parameters and buffers."""

    dynamic: frozenset[int]
    static: frozenset[int] = frozenset()

    def derived(self, n: int) -> bool:
        return n >= 2 and n not in self.static and any(n % d == 0 for d in self.dynamic)


SIZE_RULE: contextvars.ContextVar[Optional[SizeRule]] = contextvars.ContextVar("autofuser_size_rule", default=None)


@contextlib.contextmanager
def size_rule(rule: Optional[SizeRule]) -> Iterator[None]:
    """``rule`` in force while compiling (``None``: every size a literal, as without dynamic dims)."""
    token = SIZE_RULE.set(rule)
    try:
        yield
    finally:
        SIZE_RULE.reset(token)


@dataclass
class SizeArguments:
    """The run-time sizes one kernel's writer named (``sized``): name -> value, by first use."""

    values: dict[str, int] = field(default_factory=dict)
    by_value: dict[int, str] = field(default_factory=dict)
    # Why the writer wrote this kernel with literal sizes after all (``literal_sizes``).
    specialised: Optional[str] = None

    def name(self, n: int) -> str:
        if n not in self.by_value:
            name = f"sz{len(self.values)}"
            self.values[name] = n
            self.by_value[n] = name
        return self.by_value[n]


_COLLECTOR: contextvars.ContextVar[Optional[SizeArguments]] = contextvars.ContextVar(
    "autofuser_size_arguments", default=None
)


@contextlib.contextmanager
def collecting_sizes(enabled: bool) -> Iterator[Optional[SizeArguments]]:
    """While open (and ``enabled``: the strategy declares ``dynamic_sizes`` and a
    ``SizeRule`` is in force), ``sized`` names sizes derived from dynamic ones; yields
    what it named, or ``None``."""
    collector = SizeArguments() if enabled and SIZE_RULE.get() is not None else None
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)


def sized(n: int) -> str:
    """An integer of a kernel's indexing (a size, a stride, an element count) as the
    kernel's source writes it: the literal ``n``, or, while a kernel with dynamic
    dimensions is written, the name of the run-time argument holding it."""
    collector = _COLLECTOR.get()
    rule = SIZE_RULE.get()
    if collector is None or rule is None or isinstance(n, bool) or not rule.derived(int(n)):
        return str(n)
    return collector.name(int(n))


@contextlib.contextmanager
def literal_sizes(reason: str) -> Iterator[None]:
    """While open, ``sized`` writes literals even where the strategy takes run-time sizes:
    for a form of its groups its writer can't write with run-time sizes. The kernel is
    then written for each shape (correct, one compile per shape), and the report gives
    ``reason`` (a sentence saying why) as the group's ``specialised``."""
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.specialised = reason
    token = _COLLECTOR.set(None)
    try:
        yield
    finally:
        _COLLECTOR.reset(token)


def size_parameters() -> list[str]:
    """The run-time size parameters the kernel being written takes, in order: appended to
    its signature by the functions that assemble kernels (``write_kernel``,
    ``assemble_kernel``)."""
    collector = _COLLECTOR.get()
    return list(collector.values) if collector is not None else []


# A kernel's parameters, and a chain launcher's (indented: a method of its class).
_PARAMETERS = re.compile(r"^\s*def \w+\(([^)]*)\):", re.MULTILINE)


def passed_sizes(source: str, collector: Optional[SizeArguments]) -> dict[str, int]:
    """The named sizes the kernel in ``source`` takes as parameters (a kernel's, or a host-side
    launcher's that hands them on to the kernels it launches): what its launches pass."""
    if collector is None or not collector.values:
        return {}
    found = _PARAMETERS.findall(source)
    params = {p.strip().split(":")[0] for text in found for p in text.split(",")}
    return {name: value for name, value in collector.values.items() if name in params}


def checked_key(source_hash: str, config: dict) -> str:
    """What a shape class remembers of a kernel it checked: its source and its config
    (another config of one source is another binary, checked in full)."""
    return f"{source_hash}:{sorted(config.items())}"


#: While a later shape of a known shape class compiles: ``checked_key`` of each kernel
#: already checked for that class (on real and synthetic inputs). Such a kernel is
#: checked on the new shape's real inputs only (compile.py).
CLASS_CHECKED: contextvars.ContextVar[Optional[set[str]]] = contextvars.ContextVar(
    "autofuser_class_checked", default=None
)


@contextlib.contextmanager
def class_checked(checked: Optional[set[str]]) -> Iterator[None]:
    token = CLASS_CHECKED.set(checked)
    try:
        yield
    finally:
        CLASS_CHECKED.reset(token)
