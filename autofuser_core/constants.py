"""Values no input reaches, computed once while compiling.

A captured graph is specialised on its inputs' shapes, dtypes and device (the
guard compiles again when they change), so an op whose arguments are all
Python constants, or the results of such ops, computes the same tensor on
every call: the normalised mesh indices an FNO concatenates to its input
(``linspace``, ``meshgrid``, ``stack``), a rotary embedding's angles over a
fixed number of positions. ``fold_constants`` computes each such value once
and replaces the op by a read of the stored tensor (a non-persistent buffer of
the graph module: not in any ``state_dict``, moved by ``.to()``), so nothing
is left to run, fused or eager.

Only what cannot change between calls is folded:

1. the op and everything it is computed from are ``call_function`` /
   ``call_method`` nodes without tensor inputs of the graph, parameters or
   buffers (a parameter changes under an optimiser step; a module call may
   read any state), none a barrier (``effects.barrier_reason``: a mutation,
   random numbers, an opaque part), none an opaque function leaf, and none
   written into by a later op, itself or through a view (FNO's zero spectrum
   filled by slice assignments is not the zeros it was made as);
2. the stored value never reaches the model's output nor an op that writes
   into memory, directly or through views of it (the caller could change it,
   and the next call would read the changed value);
3. it is a tensor of at most ``FOLD_LIMIT_BYTES`` of storage (folding trades
   memory held between calls for work each call does) whose elements don't share
   memory (an ``expand`` stays the free view it is, of the value folded before it).

Folding happens before planning, so verification compares fused groups against
the folded graph and could not see a wrong fold: ``fold_checked`` therefore runs
the graph once as captured and once folded on the real inputs (copies, state
restored) and undoes the folding unless both give the same outputs. The report's
notes say how many ops were folded, or that a fold was undone.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import torch
import torch.fx
from torch.fx.node import map_arg

from .capture import FREE_KEY, LeafCall, OutputShapeCheck, preserved_state
from .effects import barrier_reason
from .verify import snapshot

logger = logging.getLogger(__name__)

#: The largest value (bytes of its storage) kept between calls.
FOLD_LIMIT_BYTES = 16 * 2**20

ATTRIBUTE_PREFIX = "_autofuser_constant_"


def _evaluate(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> Any:
    args = map_arg(node.args, values.__getitem__)
    kwargs = map_arg(node.kwargs, values.__getitem__)
    with torch.no_grad():
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)  # type: ignore[operator]


def _overlaps(value: torch.Tensor) -> bool:
    """Whether elements of ``value`` share memory (a zero stride over a dim of more than one)."""
    return any(stride == 0 and size > 1 for size, stride in zip(value.shape, value.stride()))


def _reaches(node: torch.fx.Node, gm: torch.fx.GraphModule, output: bool = True) -> bool:
    """Whether ``node``'s value reaches a writing op (or, with ``output``, the model's
    output), itself or through views of it."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        for user in current.users:
            if (output and user.op == "output") or barrier_reason(user, gm) is not None:
                return True
            if user.meta.get(FREE_KEY) and user not in seen:  # a view: its readers read this memory
                seen.add(user)
                stack.append(user)
    return False


def fold_constants(gm: torch.fx.GraphModule) -> list[str]:
    """Fold every value no input reaches (module doc); returns the names of the ops folded."""
    values: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or any(n not in values for n in node.all_input_nodes):
            continue
        if isinstance(node.target, (LeafCall, OutputShapeCheck)) or barrier_reason(node, gm) is not None:
            continue
        if _reaches(node, gm, output=False):
            continue  # written into later (a buffer filled by slice assignment): not what it was
        try:
            value = _evaluate(node, values)
        except Exception as err:  # noqa: BLE001 - it then runs as it did
            logger.debug("not folding %s: %s", node.name, err)
            continue
        if isinstance(value, torch.Tensor) and _overlaps(value):
            continue  # an expand: it stays the free view it is, of the value folded before it
        values[node] = value
    folded: list[str] = []
    stored = 0
    for node in list(values):
        value = values[node]
        if all(user in values for user in node.users) or not isinstance(value, torch.Tensor):
            continue  # read only by other constants (or not a tensor): folded with them or kept
        if value.requires_grad or _reaches(node, gm):
            continue
        try:
            size = value.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            continue
        if size > FOLD_LIMIT_BYTES:
            continue
        name = f"{ATTRIBUTE_PREFIX}{stored}"
        while hasattr(gm, name):
            stored += 1
            name = f"{ATTRIBUTE_PREFIX}{stored}"
        gm.register_buffer(name, value, persistent=False)
        stored += 1
        with gm.graph.inserting_before(node):
            read = gm.graph.get_attr(name)
        read.meta = {k: v for k, v in node.meta.items() if k != FREE_KEY}
        node.replace_all_uses_with(read)
    # The ops now read by no one: the folded ones and what they were computed from.
    for node in reversed(list(values)):
        if not node.users:
            folded.append(node.name)
            gm.graph.erase_node(node)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded[::-1]


def _run(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> list:
    with preserved_state(gm), torch.no_grad():
        out = torch.fx.Interpreter(gm).run(*[snapshot(x) for x in inputs])
    return [v for v in torch.utils._pytree.tree_leaves(out)]


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and (a == b if not isinstance(a, torch.Tensor) else True)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b) or not a.is_floating_point():
        return torch.equal(a, b)
    # the same ops on the same values; only a nondeterministic GPU op can differ, and by rounding
    scale = a.detach().abs().nan_to_num(0.0, 0.0, 0.0).max().item() if a.numel() else 0.0
    return torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6 * max(scale, 1e-30), equal_nan=True)


def fold_checked(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> tuple[list[str], str]:
    """``fold_constants`` on ``gm``, kept only where the folded graph gives the captured
    graph's outputs on ``inputs``; returns the folded ops' names and, where a fold was
    undone, why (else "")."""
    before = copy.deepcopy(gm.graph)
    folded = fold_constants(gm)
    if not folded:
        return [], ""
    original = torch.fx.GraphModule(gm, before)
    try:
        expected, got = _run(original, inputs), _run(gm, inputs)
        same = len(expected) == len(got) and all(_same(a, b) for a, b in zip(expected, got))
        why = "" if same else "the folded graph's outputs differ from the captured graph's"
    except Exception as err:  # noqa: BLE001 - then nothing is folded
        why = f"checking it raised {type(err).__name__}: {err}"
    if why:
        gm.graph = before  # recompiles
        for name in [n for n, _ in gm.named_buffers(recurse=False) if n.startswith(ATTRIBUTE_PREFIX)]:
            delattr(gm, name)
        return [], why
    return folded, ""
