"""Rewriting the graph: each kept group becomes one call.

``rewrite_graph`` re-emits the graph in a new ``torch.fx.Graph``:

1. every group is one unit placed at its *last* node's position, every other
   node is its own unit at its own position;
2. units are emitted in dependency order, ties broken by position (Kahn's
   algorithm with a heap), so a node that sat between a group's first and last
   node and uses one of its outputs moves after the group - the planner
   guaranteed that no mutation, random or opaque node is among those;
3. a group's unit is ``call_function(FusedKernel, inputs)``; the parameters
   it reads are not graph inputs - the ``FusedKernel`` fetches them from their
   live module at each call; several outputs come out through
   ``operator.getitem``;
4. the nodes inside groups are not emitted (dead code out); the graph is
   linted and wrapped in a ``GraphModule`` sharing the original's modules and
   parameters.
"""

from __future__ import annotations

import heapq
import operator
from typing import Any, Sequence

import torch
import torch.fx

from .group import GroupProgram, KernelTensor

#: ``GraphModule.meta`` key of a group's eager module: the names of its nodes whose values
#: the kernel writes for the group's backward (``KernelTensor.saved``), in output order.
SAVED_NODES_KEY = "autofuser_saved_nodes"


def _output_node(tensor: KernelTensor) -> torch.fx.Node:
    """The node a group output stands for: only inputs can be parameters (``AttrRef``)."""
    assert isinstance(tensor.source, torch.fx.Node), tensor.source
    return tensor.source


def extract_group_module(gm: torch.fx.GraphModule, program: GroupProgram) -> torch.fx.GraphModule:
    """The group's original ops as a ``GraphModule`` taking the kernel's inputs."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for k, tensor in enumerate(program.inputs):
        placeholder = graph.placeholder(f"in{k}")
        if isinstance(tensor.source, torch.fx.Node):
            env[tensor.source] = placeholder
    for node in program.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    outs = [env[_output_node(t)] for t in program.visible_outputs]
    graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    eager = torch.fx.GraphModule(gm, graph, class_name="EagerGroup")
    # The nodes whose values the kernel also writes for the group's backward, by their
    # names in this module (``backward.trace_backward`` reads them from the forward).
    eager.meta[SAVED_NODES_KEY] = [env[_output_node(t)].name for t in program.outputs if t.saved]
    return eager


def rewrite_graph(gm: torch.fx.GraphModule, groups: Sequence[tuple[GroupProgram, Any]]) -> torch.fx.GraphModule:
    """Steps 1-4 of the module doc. ``groups`` pairs each program with its callable."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    unit_of: dict[torch.fx.Node, Any] = {}
    for gid, (program, _) in enumerate(groups):
        for node in program.nodes:
            unit_of[node] = ("group", gid)
    units: dict[Any, int] = {}
    deps: dict[Any, set] = {}
    for node in nodes:
        unit = unit_of.get(node, node)
        units[unit] = max(units.get(unit, -1), position[node])
        deps.setdefault(unit, set())
        for inp in node.all_input_nodes:
            source = unit_of.get(inp, inp)
            if source != unit:
                deps[unit].add(source)
    users: dict[Any, set] = {u: set() for u in units}
    for unit, needs in deps.items():
        for need in needs:
            users[need].add(unit)
    pending = {u: len(needs) for u, needs in deps.items()}
    heap = [(units[u], id(u), u) for u, n in pending.items() if n == 0]
    heapq.heapify(heap)

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    emitted = 0
    while heap:
        _, _, unit = heapq.heappop(heap)
        emitted += 1
        if isinstance(unit, tuple):
            program, fused = groups[unit[1]]
            # Parameters are not graph inputs: the FusedKernel reads them live.
            args = [env[t.source] for t in program.inputs if isinstance(t.source, torch.fx.Node)]
            call = graph.call_function(fused, tuple(args))
            # Outputs saved only for the group's backward stay inside its FusedKernel.
            visible = program.visible_outputs
            if len(visible) == 1:
                source = _output_node(visible[0])
                env[source] = call
                call.meta.update(source.meta)
            else:
                for k, out in enumerate(visible):
                    source = _output_node(out)
                    item = graph.call_function(operator.getitem, (call, k))
                    item.meta.update(source.meta)
                    env[source] = item
        else:
            env[unit] = graph.node_copy(unit, lambda n: env[n])
        for user in users[unit]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(heap, (units[user], id(user), user))
    if emitted != len(units):
        raise RuntimeError("internal error: the fused graph has a cycle (the planner should have refused it)")
    graph.lint()
    new_gm = torch.fx.GraphModule(gm, graph, class_name="FusedGraph")
    new_gm.meta.update(gm.meta)
    return new_gm
