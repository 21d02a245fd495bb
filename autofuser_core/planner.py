"""Planning: lower every node, let strategies propose groups, keep a legal set.

``plan_fusion_groups`` works in four steps:

1. **Lower.** Each ``call_function``/``call_method``/``call_module`` node is
   matched to a registered lowering. Nodes that mutate memory, draw random
   numbers or are opaque (untraceable) parts are *barriers*: never lowered,
   and no group may straddle one (a group's ops run at one point in the
   program, so nothing that changes memory or RNG state may sit between its
   first and last node). Nodes no plugin lowers, or whose lowering refuses,
   stay eager with a recorded reason.
2. **Propose.** Each strategy's ``propose(view)`` returns candidate node lists;
   ``PlanningView.space_groups()`` is the shared helper that grows groups
   along producer-consumer edges while they compose into one iteration domain.
3. **Choose.** Candidates are taken by strategy priority (higher first),
   then largest first. One is kept only if it composes (its strategy's own
   ``compose``, else ``compose_group``), its strategy accepts it, it overlaps no kept
   group, it straddles no barrier, contracting it with the kept groups leaves
   the graph acyclic, and no plugin vetoes it. Every refusal is a
   ``Decision`` with a reason code and a sentence. Nodes a refusal leaves in no
   group are proposed again: beside a kept group that overlapped them, and, where
   a strategy refused a group by its own rules (a row too wide for one program),
   with its products and reductions apart (each product with its pointwise
   epilogue, then each norm with the pointwise ops around it).
4. The kept candidates go on to code generation (``autofuser_core.compile``).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, cast

import torch
import torch.fx

from .effects import barrier_reason
from .group import SAVED_FOR_BACKWARD, GroupProgram, GroupRefused, compose_group, layout_settings, product_count
from .ir import LoweringContext, LoweringRefused, Value, tensor_meta
from .registry import Registry, describe_target
from .specs import LoweringSpec, SplitRule, StrategySpec, dtype_name

logger = logging.getLogger("autofuser.plan")

#: A proposed group that would make a cycle (a path leaves it and comes back) is tried again
#: as its members before the path comes back and those after (``PlanView.reentered``); the
#: later part may make a cycle of its own, split again, up to this many times.
MAX_CYCLE_SPLITS = 3


@dataclass(frozen=True)
class Split:
    """While a kept group is timed against a split of its nodes (``compile``), the
    limits on every group grown or proposed over ``nodes``: it stays inside them,
    holds at most ``max_products`` products, and ``rule`` (its strategy's
    ``SplitRule``) refuses what it refuses."""

    nodes: frozenset
    max_products: int
    rule: SplitRule

    def refusal(self, nodes, program: GroupProgram) -> Optional[GroupRefused]:
        if self.nodes.isdisjoint(nodes):
            return None
        if not self.nodes.issuperset(nodes):
            return GroupRefused("split_boundary", "a group being split is timed on its own nodes only")
        if product_count(program) > self.max_products:
            return GroupRefused("split_products", f"split into groups of at most {self.max_products} product(s)")
        refused = self.rule.refuse(program) if self.rule.refuse is not None else None
        if refused is not None:
            return GroupRefused(*refused)
        return None


#: The ``Split``s of the planning round in progress.
SPLIT_RULES: contextvars.ContextVar[tuple] = contextvars.ContextVar("autofuser_split_rules", default=())


@dataclass
class Decision:
    """The planner's verdict on one candidate."""

    strategy: str
    nodes: list[torch.fx.Node]
    fused: bool
    reason_code: str = "fused"
    reason: str = ""
    program: Optional[GroupProgram] = None


@dataclass
class Candidate:
    strategy: StrategySpec
    nodes: list[torch.fx.Node]
    program: Optional[GroupProgram] = None
    # With gradients on: its products whose results its program does not store for its
    # backward (``compile._save_products``), by node name.
    products_recomputed: list[str] = field(default_factory=list)


@dataclass
class SkippedNode:
    node: str
    target: str
    reason_code: str
    reason: str


class PlanningView:
    """What strategies see: the graph, each node's lowering, and the barriers."""

    def __init__(
        self, gm: torch.fx.GraphModule, registry: Registry, options=None, earlier: Optional["PlanningView"] = None
    ):
        """``earlier``: the view of an earlier planning round of the same graph and
        plugins; its lowering and the groups it composed are reused."""
        self.gm = gm
        self.registry = registry
        self.options = options  # the ``FuseOptions`` of this ``fuse()`` call (``None`` outside one)
        self.nodes: list[torch.fx.Node] = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self._space_groups: Optional[list[list[torch.fx.Node]]] = None
        # Nodes that groups grow around, not into: the planner's second pass sets them to
        # the nodes already kept (``plan_fusion_groups``).
        self.excluded: frozenset[torch.fx.Node] = frozenset()
        self.product_layouts = registry.product_layouts()  # compose_group's layouts of groups with products
        if earlier is not None and (
            earlier.gm is not gm or earlier.registry is not registry or earlier.nodes != self.nodes
        ):
            raise ValueError("a planning view can reuse only the view of the same graph and plugins")
        self.lowered: dict[torch.fx.Node, Value]
        self.lowering_of: dict[torch.fx.Node, LoweringSpec]
        self.barriers: dict[torch.fx.Node, tuple[str, str]]
        self.skipped: list[SkippedNode]
        self.helpers: dict[str, str]
        # compose() results (a program, or the exception it raised) by nodes, lay_out and
        # layout settings: strategies ask about the same groups again and again while
        # proposing, the planner once more for each candidate, and a later round again.
        self._composed: dict[tuple, Any]
        self._attr_cache: dict[str, tuple]  # compose_group's parameter descriptions
        if earlier is not None:
            # Everything below depends on the graph, the plugins and the parameters alone,
            # none of which change between the planning rounds of one compile.
            self.lowered, self.lowering_of, self.barriers = earlier.lowered, earlier.lowering_of, earlier.barriers
            self.skipped, self.helpers = earlier.skipped, earlier.helpers
            self._composed, self._attr_cache = earlier._composed, earlier._attr_cache
        else:
            self.lowered = {}
            self.lowering_of = {}
            self.barriers = {}
            self.skipped = []
            self.helpers = {}
            self._composed = {}
            self._attr_cache = {}
            self._lower_all()
        self._barrier_positions = sorted(self.order[n] for n in self.barriers)

    # -- step 1 ---------------------------------------------------------------

    def _lower_all(self) -> None:
        self._lower_nodes()
        for entry in self.skipped:
            logger.debug("%s (%s) stays eager: [%s] %s", entry.node, entry.target, entry.reason_code, entry.reason)

    def _lower_nodes(self) -> None:
        for node in self.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            target = node.target if node.op != "call_module" else type(self.gm.get_submodule(cast(str, node.target)))
            barrier = barrier_reason(node, self.gm)
            if barrier is not None:
                self.barriers[node] = barrier
                self.skipped.append(SkippedNode(node.name, describe_target(target), *barrier))
                continue
            spec = self.registry.lowering_for(node, self.gm)
            if spec is None:
                self.skipped.append(
                    SkippedNode(
                        node.name,
                        describe_target(target),
                        "no_lowering",
                        "no loaded plugin can fuse this op; it runs as in eager PyTorch",
                    )
                )
                continue
            meta = tensor_meta(node)
            if meta is None:
                self.skipped.append(
                    SkippedNode(node.name, describe_target(target), "not_a_tensor", "its result is not a single tensor")
                )
                continue
            dtypes = {dtype_name(m.dtype) for m in [meta, *map(tensor_meta, node.all_input_nodes)] if m is not None}
            foreign = sorted(d for d in dtypes if d not in spec.dtypes and d != "bool")
            if foreign:
                self.skipped.append(
                    SkippedNode(
                        node.name,
                        describe_target(target),
                        "unsupported_dtype",
                        f"{spec.name} handles {', '.join(spec.dtypes)}, not {', '.join(foreign)}",
                    )
                )
                continue
            try:
                value = spec.lower(LoweringContext(node, self.gm, self.helpers), *node.args, **node.kwargs)
            except LoweringRefused as refusal:
                self.skipped.append(
                    SkippedNode(node.name, describe_target(target), refusal.code, f"{spec.name}: {refusal.reason}")
                )
                continue
            except Exception as err:  # a plugin bug must not break the user's model
                self.skipped.append(
                    SkippedNode(
                        node.name,
                        describe_target(target),
                        "lowering_failed",
                        f"{spec.name} (plugin {spec.plugin}) raised {type(err).__name__}: {err}",
                    )
                )
                logger.warning("lowering %s of plugin %s failed on %s: %s", spec.name, spec.plugin, node.name, err)
                continue
            if (
                not isinstance(value, Value)
                or tuple(value.shape) != tuple(meta.shape)
                or value.is_bool != (meta.dtype == torch.bool)
            ):
                got = getattr(value, "shape", type(value).__name__)
                self.skipped.append(
                    SkippedNode(
                        node.name,
                        describe_target(target),
                        "lowering_mismatch",
                        f"{spec.name} produced {got}, but eager gives {list(meta.shape)} {meta.dtype}",
                    )
                )
                continue
            self.lowered[node] = value
            self.lowering_of[node] = spec

    # -- legality helpers -------------------------------------------------------

    def straddles_barrier(self, nodes: list[torch.fx.Node]) -> bool:
        first = min(self.order[n] for n in nodes)
        last = max(self.order[n] for n in nodes)
        return any(first < p < last for p in self._barrier_positions)

    def creates_cycle(
        self,
        nodes: set[torch.fx.Node],
        kept: Optional[dict[torch.fx.Node, int]] = None,
        kept_groups: Optional[dict[int, set[torch.fx.Node]]] = None,
    ) -> bool:
        """Would contracting ``nodes`` (with the ``kept`` groups already contracted) make a cycle?"""
        return next(self._reentries(nodes, kept or {}, kept_groups or {}), None) is not None

    def reentered(
        self,
        nodes: set[torch.fx.Node],
        kept: Optional[dict[torch.fx.Node, int]] = None,
        kept_groups: Optional[dict[int, set[torch.fx.Node]]] = None,
    ) -> set[torch.fx.Node]:
        """The members of ``nodes`` that a path leaving them reaches again (with the ``kept``
        groups contracted), and every member after those: the ones that make contracting
        ``nodes`` a cycle (``creates_cycle``). The others, taken alone, make none: a path
        from them out and back would land on a member counted here."""
        return set(self._reentries(nodes, kept or {}, kept_groups or {}))

    def _reentries(
        self, nodes: set[torch.fx.Node], kept: dict[torch.fx.Node, int], kept_groups: dict[int, set[torch.fx.Node]]
    ) -> Iterator[torch.fx.Node]:
        """Each member of ``nodes`` that a path leaving them reaches, as the walk from their
        outside users finds it, and the members after it; a contracted group reached counts
        as all its members reached."""
        # Edges go forward in graph order, so a path back into ``nodes`` must stay at or
        # before their last node - except through a contracted group reaching back.
        last = max(self.order[n] for n in nodes)
        group_first: dict[int, int] = {}
        seen: set[torch.fx.Node] = set()
        stack = [u for n in nodes for u in n.users if u not in nodes]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in nodes:
                yield node
                stack.extend(u for u in node.users if u not in seen)
                continue
            gid = kept.get(node, -1)
            if self.order[node] > last:
                if gid not in kept_groups:
                    continue
                if gid not in group_first:
                    group_first[gid] = min(self.order[m] for m in kept_groups[gid])
                if group_first[gid] > last:
                    continue
            for member in kept_groups.get(gid, {node}):
                seen.add(member)
                stack.extend(u for u in member.users if u not in seen)

    def compose(self, nodes: list[torch.fx.Node], lay_out=None) -> GroupProgram:
        """``nodes`` composed into one program (``compose_group``; ``lay_out``: a
        strategy's own layout of the composed values instead of the generic one;
        see ``ProductLayoutSpec`` for groups with products).

        Composed once per planning (and ``layout_settings()``): asked again, it
        returns the same program (don't change it) or raises the same refusal.
        The round's ``SPLIT_RULES`` are applied to the composed program each time."""
        ordered = tuple(sorted(nodes, key=self.order.__getitem__))
        key = (ordered, lay_out, layout_settings(), SAVED_FOR_BACKWARD.get())
        known = self._composed.get(key)
        if known is None:
            try:
                known = compose_group(
                    ordered,
                    self.lowered,
                    self.gm,
                    {n: self.lowering_of[n].name for n in ordered},
                    lay_out,
                    self._attr_cache,
                    self.product_layouts,
                )
            except Exception as err:
                known = err.with_traceback(None)  # kept without the frames of the compose that raised
            self._composed[key] = known
        if isinstance(known, Exception):
            try:
                raise known.with_traceback(None)  # without the tracebacks of earlier raises
            finally:
                known = None  # no reference cycle through this frame
        for rule in SPLIT_RULES.get():
            refusal = rule.refusal(ordered, known)
            if refusal is not None:
                raise refusal
        return known

    def compose_for(self, strategy: StrategySpec, nodes: list[torch.fx.Node]) -> GroupProgram:
        """``nodes`` composed for ``strategy``: by its own ``compose`` if it has one."""
        if strategy.compose is None:
            return self.compose(nodes)
        program = strategy.compose(self, sorted(nodes, key=self.order.__getitem__))
        if not isinstance(program, GroupProgram):
            raise TypeError(
                f"strategy {strategy.name} (plugin {strategy.plugin}) composed a "
                f"{type(program).__name__}, not a GroupProgram"
            )
        return program

    # -- step 2 helper ------------------------------------------------------------

    def space_groups(self) -> list[list[torch.fx.Node]]:
        """Cached result of ``grow_groups()`` (several strategies ask)."""
        if self._space_groups is None:
            self._space_groups = self.grow_groups()
        return [list(g) for g in self._space_groups]

    def kinds(self, nodes: list[torch.fx.Node]) -> set[str]:
        """The lowering kinds (``pointwise``, ``reduction``, ...) among ``nodes``."""
        return {self.lowering_of[n].kind for n in nodes if n in self.lowering_of}

    def grow_groups(self, nodes: Optional[set[torch.fx.Node]] = None, compose=None) -> list[list[torch.fx.Node]]:
        """Grow groups along producer -> consumer edges, in graph order, while the
        union still composes, straddles no barrier and makes no cycle. Every node
        of ``nodes`` (default: every lowered node) ends in exactly one group.

        ``compose(union)`` (default ``self.compose``: one domain) decides whether a
        union composes; it refuses by raising ``GroupRefused``. A strategy with
        its own layout grows its candidates through it (the row-chain strategy)."""
        compose = compose or self.compose
        group_of: dict[torch.fx.Node, int] = {}
        members: dict[int, list[torch.fx.Node]] = {}
        fresh_ids = itertools.count()
        for node in self.nodes:
            if node not in self.lowered or (nodes is not None and node not in nodes) or node in self.excluded:
                continue
            gid = next(fresh_ids)  # not len(members): merges delete ids, and a reused id would collide
            group_of[node] = gid
            members[gid] = [node]
            for producer in node.all_input_nodes:
                if producer not in group_of:
                    continue
                a, b = group_of[producer], group_of[node]
                if a == b:
                    continue
                union = sorted(members[a] + members[b], key=self.order.__getitem__)
                if self.straddles_barrier(union) or self.creates_cycle(set(union)):
                    continue
                try:
                    compose(union)
                except GroupRefused:
                    continue
                except Exception as err:  # a lowering's IR the core can't lay out: don't merge
                    logger.debug("composing %s failed: %s", [n.name for n in union], err)
                    continue
                for n in members[b]:
                    group_of[n] = a
                members[a] = union
                del members[b]
        self._join_siblings(group_of, members, compose)
        return list(members.values())

    def _only_leaves(self, node: torch.fx.Node) -> bool:
        """Whether ``node``'s result reaches nothing but the graph's output (through ops no
        plugin lowers, such as views)."""
        stack, seen = list(node.users), set()
        while stack:
            user = stack.pop()
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            if user in self.lowered:
                return False
            stack.extend(user.users)
        return True

    def _join_siblings(self, group_of: dict, members: dict, compose) -> None:
        """A lone op whose result only leaves the graph, and that reads a tensor a group also
        reads, joins that group where the union composes: the tensor is read once, and an op
        too small to pay for a kernel of its own (a backward's sum of a gradient beside the
        norm that reads it) is fused at all. Only what leaves the graph joins: an op whose
        result other groups read could close a cycle through them."""
        for node in self.nodes:
            gid = group_of.get(node)
            if gid is None or len(members[gid]) != 1 or not self._only_leaves(node):
                continue
            other = self._sibling_group(node, gid, group_of, members, compose)
            if other is not None:
                group_of[node] = other
                members[other] = sorted(members[other] + [node], key=self.order.__getitem__)
                del members[gid]

    def _sibling_group(self, node: torch.fx.Node, gid: int, group_of: dict, members: dict, compose) -> Optional[int]:
        """The first group reading one of ``node``'s inputs that ``node`` (alone in group
        ``gid``) can join: the union composes, straddles no barrier and closes no cycle."""
        for source in node.all_input_nodes:
            for sibling in source.users:
                other = group_of.get(sibling)
                if other is None or other == gid:
                    continue
                union = sorted(members[other] + [node], key=self.order.__getitem__)
                if self.straddles_barrier(union):
                    continue
                try:
                    compose(union)
                except Exception:  # noqa: BLE001 - GroupRefused, or an IR the core can't lay out
                    continue
                # A cycle can run through another group (one member reads the target group,
                # another feeds the lone op): the other groups count as contracted.
                kept = {n: g for n, g in group_of.items() if g not in (other, gid)}
                kept_groups = {g: set(m) for g, m in members.items() if g not in (other, gid)}
                if not self.creates_cycle(set(union), kept, kept_groups):
                    return other
        return None


@dataclass
class Plan:
    view: PlanningView
    kept: list[Candidate] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)


def plan_fusion_groups(
    gm: torch.fx.GraphModule, registry: Registry, veto=None, options=None, earlier: Optional[Plan] = None
) -> Plan:
    """Steps 1-3 of the module doc. ``veto(candidate)`` returns a reason or ``None``;
    ``earlier``: the plan of an earlier round on the same graph, whose lowering and
    composed groups are reused (``PlanningView``)."""
    view = PlanningView(gm, registry, options, earlier.view if earlier is not None else None)
    plan = Plan(view)

    def propose() -> list[Candidate]:
        candidates: list[Candidate] = []
        for strategy in registry.strategies_by_priority():
            try:
                proposed = strategy.propose(view)
            except Exception as err:
                logger.warning(
                    "strategy %s (plugin %s) failed to propose groups: %s", strategy.name, strategy.plugin, err
                )
                continue
            candidates.extend(
                Candidate(strategy, sorted(nodes, key=view.order.__getitem__)) for nodes in proposed if nodes
            )
        candidates.sort(key=lambda c: (-c.strategy.priority, -len(c.nodes), view.order[c.nodes[0]]))
        return candidates

    candidates = propose()
    declined: list[Candidate] = []  # refused by their strategy's own rules (a row too wide)
    kept_of: dict[torch.fx.Node, int] = {}
    kept_groups: dict[int, set[torch.fx.Node]] = {}

    def refuse(candidate: Candidate, code: str, reason: str) -> None:
        plan.decisions.append(
            Decision(candidate.strategy.name, candidate.nodes, False, code, reason, candidate.program)
        )
        logger.debug(
            "not fusing %s with %s: [%s] %s", [n.name for n in candidate.nodes], candidate.strategy.name, code, reason
        )

    def consider(candidate: Candidate, depth: int = 0) -> None:
        nodes = candidate.nodes
        if any(n not in view.lowered for n in nodes):
            refuse(candidate, "not_lowered", "the strategy proposed nodes that have no lowering")
            return
        if any(n in kept_of for n in nodes):
            refuse(candidate, "overlap", "overlaps a group that was already kept")
            return
        if view.straddles_barrier(nodes):
            refuse(candidate, "barrier", "a mutation, random or opaque op sits between its first and last node")
            return
        try:
            candidate.program = view.compose_for(candidate.strategy, nodes)
        except GroupRefused as refusal:
            refuse(candidate, refusal.code, refusal.reason)
            declined.append(candidate)
            return
        except Exception as err:
            refuse(candidate, "compose_failed", f"{type(err).__name__}: {err}")
            return
        verdict = candidate.strategy.accepts(candidate.program)
        if verdict is not None:
            refuse(candidate, *verdict)
            declined.append(candidate)
            return
        late = view.reentered(set(nodes), kept_of, kept_groups)  # none: no cycle
        if late:
            parts = [[n for n in nodes if n not in late], [n for n in nodes if n in late]]
            parts = [part for part in parts if part]
            split = len(parts) == 2 and depth < MAX_CYCLE_SPLITS
            refuse(
                candidate,
                "cycle",
                "contracting it into one kernel would create a cycle in the graph"
                + (
                    f" (a path leaves it and comes back): tried again as two groups, {len(parts[0])} ops before "
                    f"the path comes back and {len(parts[1])} after"
                    if split
                    else ""
                ),
            )
            if split:
                for part in parts:
                    consider(Candidate(candidate.strategy, part), depth + 1)
            return
        vetoed = veto(candidate) if veto is not None else None
        if vetoed:
            refuse(candidate, "vetoed", str(vetoed))
            return
        gid = len(kept_groups)
        kept_groups[gid] = set(nodes)
        for n in nodes:
            kept_of[n] = gid
        plan.kept.append(candidate)

    for candidate in candidates:
        consider(candidate)
    # A candidate that lost to an overlapping group leaves its other nodes to no group
    # unless one was proposed without the kept nodes: a second pass proposes again with
    # the kept nodes excluded from growing (a rotary embedding's pointwise ops beside an
    # attention kernel that took the product they fed), and takes what touches them.
    left = {n for d in plan.decisions if d.reason_code == "overlap" for n in d.nodes if n not in kept_of} - set(
        view.barriers
    )
    tried = {(c.strategy.name, tuple(c.nodes)) for c in candidates}

    def propose_around(excluded: frozenset, near: set) -> None:
        """Propose again with ``excluded`` (and the kept nodes) left out of growing, and
        consider each new candidate that takes some of ``near`` and no kept node."""
        view.excluded, view._space_groups = frozenset(kept_of) | excluded, None
        try:
            for candidate in propose():
                nodes, key = set(candidate.nodes), (candidate.strategy.name, tuple(candidate.nodes))
                if key in tried or not nodes & near or not nodes.isdisjoint(kept_of):
                    continue  # tried, or refused as an overlap in the first pass already
                tried.add(key)
                consider(candidate)
        finally:
            view.excluded, view._space_groups = frozenset(), None

    if left:
        propose_around(frozenset(), left)
    # A group its strategy refused by its own rules (a norm over a row wider than one
    # program's tile, a second product too wide to stay on chip) leaves its nodes to no
    # group when nothing smaller was proposed. Its products and its reductions are
    # proposed apart (``_apart``): each product with its pointwise epilogue, a product fed
    # by another after that one, then each norm with the pointwise ops around it. Each
    # group so proposed is checked and timed as any other.
    free = {n for c in declined for n in c.nodes if n not in kept_of} - set(view.barriers)
    for step, focus in (("first products", "matmul"), ("products", "matmul"), ("reductions", "reduction")):
        apart = _apart(view, free, step)
        # Only groups holding a product (a norm) of ``free``: a lone pointwise op taken
        # here would keep a later step's product or norm from its epilogue.
        near = {n for n in free - apart if view.kinds([n]) == {focus}}
        if near:
            propose_around(apart, near)
            free -= set(kept_of)
    return plan


def _apart(view: PlanningView, free: set, step: str) -> frozenset:
    """The nodes of ``free`` left out of growing in one step of proposing a refused group's
    parts apart: "first products", its reductions and each product fed (through ``free``)
    by another; "products", its reductions; "reductions", its products."""
    kind = {n: next(iter(view.kinds([n])), None) for n in free}
    if step == "reductions":
        return frozenset(n for n in free if kind[n] == "matmul")
    out = {n for n in free if kind[n] == "reduction"}
    if step == "first products":
        for node in free:
            if kind[node] == "matmul" and _fed_by_product(node, free, kind):
                out.add(node)
    return frozenset(out)


def _fed_by_product(node: torch.fx.Node, free: set, kind: dict) -> bool:
    """Whether a product of ``free`` feeds ``node`` through nodes of ``free`` that are no
    reductions (which that step leaves out anyway)."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        source = todo.pop()
        if source in seen or source not in free or kind.get(source) == "reduction":
            continue
        seen.add(source)
        if kind.get(source) == "matmul":
            return True
        todo.extend(source.all_input_nodes)
    return False
