"""The planner's memo of composed groups (``PlanningView.compose``): each group is
composed once per planning, a refusal is raised again as it was, other layout
settings compose afresh, a later round reuses the first round's lowering, and a
zoo model's plans, round after round, are the same as with everything lowered and
composed anew. Planning runs with the cyclic garbage collector paused. Groups with
products are laid out only by a loaded plugin's ``ProductLayoutSpec``."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

import autofuser
import autofuser_core.planner as planner
from autofuser import SpecError
from autofuser.zoo.models import MODELS
from autofuser_core.capture import capture
from autofuser_core.group import MAX_PRODUCTS, GroupRefused, compose_group
from autofuser_core.planner import PlanningView, plan_fusion_groups
from autofuser_plugins.matmul.layout import MatmulLayout
from autofuser_plugins.matmul.mlp.mlp_layout import MlpLayout

from _helpers import plugin_module
from _models import FeedForward, tiny_input


def _view(model: nn.Module, x: torch.Tensor) -> PlanningView:
    return PlanningView(autofuser.capture(model, x), autofuser.load_plugins().registry)


def _nodes(view: PlanningView, *names: str) -> list[torch.fx.Node]:
    by_name = {n.name: n for n in view.nodes}
    return [by_name[name] for name in names]


def _depth(traceback) -> int:
    depth = 0
    while traceback is not None:
        depth, traceback = depth + 1, traceback.tb_next
    return depth


@pytest.fixture
def compose_calls(monkeypatch):
    """Every ``compose_group`` call the planner makes, as (node names, lay_out)."""
    calls = []

    def counted(nodes, *args, **kwargs):
        calls.append(([n.name for n in nodes], args[3] if len(args) > 3 else kwargs.get("lay_out")))
        return compose_group(nodes, *args, **kwargs)

    monkeypatch.setattr(planner, "compose_group", counted)
    return calls


def test_a_group_is_composed_once_per_view_in_any_node_order(compose_calls):
    view = _view(FeedForward().eval(), torch.randn(2, 7, 24))
    fc1, gelu = _nodes(view, "fc1", "gelu")
    program = view.compose([fc1, gelu])
    assert isinstance(program.product_layout, MatmulLayout) and [n.name for n in program.nodes] == ["fc1", "gelu"]
    assert view.compose([gelu, fc1]) is program
    assert compose_calls == [(["fc1", "gelu"], None)]


def test_a_refusal_is_raised_again_without_composing_again(compose_calls):
    view = _view(FeedForward().eval(), torch.randn(2, 7, 24))
    norm, fc2 = _nodes(view, "norm", "fc2")  # not connected: nothing of the group is computed from the other
    codes = []
    for _ in range(3):
        with pytest.raises(GroupRefused) as refused:
            view.compose([norm, fc2])
        codes.append((refused.value.code, refused.value.reason))
        assert _depth(refused.value.__traceback__) <= 2  # this frame and compose's: none piled up from earlier raises
    assert len(set(codes)) == 1
    assert len(compose_calls) == 1


def test_another_layout_of_the_same_nodes_is_composed_on_its_own(compose_calls):
    view = _view(FeedForward().eval(), torch.randn(2, 7, 24))
    nodes = _nodes(view, "fc1", "gelu")
    seen = []

    def lay_out(program, values):
        seen.append(sorted(v.op for v in values.values() if v.op == "dot"))
        program.domain = (1,)

    generic = view.compose(nodes)
    own = view.compose(nodes, lay_out=lay_out)
    assert own is not generic and own.domain == (1,) and generic.domain != (1,)
    assert view.compose(nodes, lay_out=lay_out) is own
    assert seen == [["dot"]] and len(compose_calls) == 2


def test_a_new_view_composes_again_under_the_current_settings(compose_calls):
    """A later planning round runs with fewer products per group: what an earlier
    round composed under other settings is not reused."""
    gm = autofuser.capture(FeedForward().eval(), torch.randn(2, 7, 24))
    registry = autofuser.load_plugins().registry
    mlp_nodes = ["fc1", "gelu", "fc2"]
    first = PlanningView(gm, registry)
    assert isinstance(first.compose(_nodes(first, *mlp_nodes)).product_layout, MlpLayout)
    token = MAX_PRODUCTS.set(1)
    try:
        for second in (PlanningView(gm, registry), PlanningView(gm, registry, earlier=first)):
            with pytest.raises(GroupRefused) as refused:
                second.compose(_nodes(second, *mlp_nodes))
            assert refused.value.code == "several_products"
    finally:
        MAX_PRODUCTS.reset(token)
    assert [names for names, _ in compose_calls] == [mlp_nodes, mlp_nodes, mlp_nodes]


def _one_product_plugin():
    """The matmul plugin without its MLP and chain parts: its lowerings, its
    one-product layout and its one-product strategies, as a plugin of its own."""
    from autofuser_plugins import matmul

    plugin = types.ModuleType("one_product")
    plugin.autofuser_transform_graph = matmul.autofuser_transform_graph
    plugin.autofuser_register_lowerings = matmul.autofuser_register_lowerings
    plugin.autofuser_register_product_layouts = lambda register: register(matmul.PRODUCT_LAYOUT)
    plugin.autofuser_register_strategies = lambda register: [register(s) for s in matmul.STRATEGIES]
    return plugin


WITHOUT_MLP = ["elementwise", "reduction", _one_product_plugin()]


@pytest.mark.parametrize("batch", [1, 3])
def test_without_a_two_product_layout_two_products_are_refused_and_fuse_one_at_a_time(batch):
    """Two products in one group are laid out only by a plugin's ``ProductLayoutSpec``
    (the matmul plugin's MLP layout): without it, the group is refused as with
    ``MAX_PRODUCTS`` 1, and the model still fuses, one product per kernel, and computes
    as eager does."""
    model = FeedForward(width=24, hidden=37).eval()
    x = torch.randn(batch, 11, 24)
    gm = autofuser.capture(model, x)
    plugin_set = autofuser.load_plugins(WITHOUT_MLP)
    assert list(plugin_set.registry.product_layouts()) == [1]  # the matmul plugin's, for one product
    view = PlanningView(gm, plugin_set.registry)
    with pytest.raises(GroupRefused) as refused:
        view.compose(_nodes(view, "fc1", "gelu", "fc2"))
    assert refused.value.code == "several_products" and "2 matrix products in one group" in refused.value.reason
    assert isinstance(view.compose(_nodes(view, "fc1", "gelu")).product_layout, MatmulLayout)
    # With the whole matmul plugin the same group is an MLP.
    with_mlp = PlanningView(gm, autofuser.load_plugins(["elementwise", "reduction", "matmul"]).registry)
    assert isinstance(with_mlp.compose(_nodes(with_mlp, "fc1", "gelu", "fc2")).product_layout, MlpLayout)

    with torch.no_grad():
        fused = autofuser.fuse(model, plugins=WITHOUT_MLP, progress=False)
        torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
    report = fused.report()
    assert report.fused and all(g.strategy not in ("mlp", "row_chain") for g in report.groups), str(report)
    for group in report.fused:
        assert sum(node in ("fc1", "fc2") for node in group.nodes) <= 1, str(report)
    assert {"fc1", "fc2"} <= {n for g in report.fused for n in g.nodes}, str(report)


def test_without_a_product_layout_a_group_with_a_product_is_refused_with_a_reason():
    """The core lays out no product itself: with a plugin lowering ``@`` but no plugin
    laying out one product (the matmul plugin's layout), the group is refused with its
    reason and the model runs its products eager."""
    products = types.ModuleType("products_only")
    products.autofuser_register_lowerings = lambda register: register(
        name="mine.matmul", targets=(torch.matmul,), kind="matmul", lower=lambda ctx, a, b: ctx.matmul(a, b)
    )

    class ProductRelu(nn.Module):
        def forward(self, a, b):
            return torch.relu(torch.matmul(a, b))

    a, b = torch.randn(7, 24), torch.randn(24, 5)
    gm = autofuser.capture(ProductRelu(), a, b)
    plugin_set = autofuser.load_plugins(["elementwise", products])
    assert plugin_set.registry.product_layouts() == {}
    view = PlanningView(gm, plugin_set.registry)
    for nodes in (list(view.lowered), [n for n in view.lowered if view.lowered[n].op == "dot"]):
        with pytest.raises(GroupRefused) as refused:
            view.compose(nodes)
        assert refused.value.code == "no_product_layout" and "matmul plugin" in refused.value.reason
    fused = autofuser.fuse(ProductRelu(), plugins=["elementwise", products], progress=False)
    torch.testing.assert_close(fused(a, b), torch.relu(a @ b))
    assert not any("mine.matmul" in group.ops for group in fused.report().fused), str(fused.report())


def test_a_plugins_product_layout_lays_out_groups_of_its_count_only():
    """A third-party ``ProductLayoutSpec`` takes the groups with its number of products:
    it is called with the composed values, its refusal is the group's, and a higher
    priority wins over the bundled MLP layout."""
    seen = []

    def refuse_all(program, values):
        seen.append(sorted(v.op for v in values.values() if v.op == "dot"))
        raise GroupRefused("mine", "my layout takes no group")

    mine = types.ModuleType("mylayout")
    mine.autofuser_register_product_layouts = lambda register: register(
        name="mine.two", products=2, lay_out=refuse_all, priority=1
    )
    gm = autofuser.capture(FeedForward().eval(), torch.randn(2, 5, 24))
    view = PlanningView(gm, autofuser.load_plugins(["elementwise", "reduction", "matmul", mine]).registry)
    with pytest.raises(GroupRefused) as refused:
        view.compose(_nodes(view, "fc1", "gelu", "fc2"))
    assert refused.value.code == "mine" and seen == [["dot", "dot"]]
    view.compose(_nodes(view, "fc1", "gelu"))  # one product: the matmul plugin's layout
    assert seen == [["dot", "dot"]]


def test_product_layout_specs_are_validated_and_ties_refused():
    def lay_out(program, values):
        raise GroupRefused("unused", "never called")

    none = types.ModuleType("noproduct")
    none.autofuser_register_product_layouts = lambda register: register(name="none", products=0, lay_out=lay_out)
    with pytest.raises(SpecError, match="products"):
        autofuser.load_plugins([none])
    tied = types.ModuleType("tied")
    tied.autofuser_register_product_layouts = lambda register: register(name="tied.two", products=2, lay_out=lay_out)
    with pytest.raises(SpecError) as caught:
        autofuser.load_plugins(["matmul", tied])
    message = str(caught.value)
    assert "groups of 2 products" in message and "'matmul'" in message and "'tied'" in message and "priority" in message


def test_a_later_round_reuses_the_lowering_and_the_groups_composed_under_the_same_settings(compose_calls):
    gm = autofuser.capture(FeedForward().eval(), torch.randn(2, 7, 24))
    registry = autofuser.load_plugins().registry
    first = PlanningView(gm, registry)
    program = first.compose(_nodes(first, "fc1", "gelu", "fc2"))
    later = PlanningView(gm, registry, earlier=first)
    assert later.lowered is first.lowered and later.skipped is first.skipped and later.helpers is first.helpers
    assert later.compose(_nodes(later, "fc1", "gelu", "fc2")) is program
    later.compose(_nodes(later, "fc2"))
    assert [names for names, _ in compose_calls] == [["fc1", "gelu", "fc2"], ["fc2"]]

    other = autofuser.capture(FeedForward().eval(), torch.randn(2, 7, 24))
    with pytest.raises(ValueError, match="same graph"):
        PlanningView(other, registry, earlier=first)


class WeightNormLinear(nn.Module):
    """A linear layer whose weight is computed each time it is read (a parametrisation)."""

    def __init__(self, width=20):
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(width, width))

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2.0 + 1.0


def test_a_parametrised_weight_is_described_once_per_view(monkeypatch):
    model = WeightNormLinear().eval()
    view = _view(model, torch.randn(3, 20))
    computed = []
    real = torch._weight_norm
    monkeypatch.setattr(torch, "_weight_norm", lambda *a, **k: computed.append(1) or real(*a, **k))
    fc, relu, mul, add = _nodes(view, "fc", "relu", "mul", "add")
    for group in ([fc], [fc, relu], [fc, relu, mul], [fc, relu, mul, add]):
        program = view.compose(group)
        weight = next(t for t in program.inputs if t.name == "fc.weight")
        assert weight.shape == (20, 20) and weight.dtype == torch.float32
    assert len(computed) == 1

    # A new view (the next planning round, or the next compile after a parameter was
    # replaced) reads the parameters again.
    fresh = PlanningView(view.gm, view.registry)
    computed.clear()
    fresh.compose(_nodes(fresh, "fc", "relu"))
    fresh.compose(_nodes(fresh, "fc"))
    assert len(computed) == 1


# ---------------------------------------------------------------------------
# Zoo models: the same plan with and without the memo
# ---------------------------------------------------------------------------


def _zoo_graph(name: str, dtype: str):
    x = tiny_input(name)
    torch.manual_seed(0)
    model = MODELS[name].make("tiny").eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        return autofuser.capture(model, x), x


def _plan_signature(plan) -> list:
    """Everything the plan decided, by value: kept groups with their programs'
    layout, refusals with their reasons, and the nodes that stay eager."""

    def program(p):
        if p is None:
            return None
        tensors = [(t.name, t.shape, str(t.dtype), t.stride, t.domain_stride, t.read) for t in (*p.inputs, *p.outputs)]
        return (p.domain, p.reduced_dims, tensors, type(p.product_layout).__name__, p.summary, p.precision)

    kept = [(c.strategy.name, [n.name for n in c.nodes], program(c.program)) for c in plan.kept]
    refused = [(d.strategy, [n.name for n in d.nodes], d.reason_code, d.reason) for d in plan.decisions]
    eager = [(s.node, s.reason_code, s.reason) for s in plan.view.skipped]
    return [kept, refused, eager]


@pytest.mark.parametrize("name,dtype", [("gnot", "bf16"), ("factformer", "fp32"), ("transolver", "bf16")])
def test_a_zoo_plan_is_the_same_as_with_every_group_composed_anew(monkeypatch, name, dtype):
    gm, _ = _zoo_graph(name, dtype)
    registry = autofuser.load_plugins().registry
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        memoised = plan_fusion_groups(gm, registry)

        def compose_anew(self, nodes, lay_out=None):
            ordered = sorted(nodes, key=self.order.__getitem__)
            return compose_group(
                ordered,
                self.lowered,
                self.gm,
                {n: self.lowering_of[n].name for n in ordered},
                lay_out,
                product_layouts=self.product_layouts,
            )

        monkeypatch.setattr(PlanningView, "compose", compose_anew)
        anew = plan_fusion_groups(gm, registry)

    assert _plan_signature(memoised) == _plan_signature(anew)
    # The invariants the planner promises, on the memoised plan.
    assert len(memoised.kept) >= 5 and memoised.decisions and any(len(c.nodes) > 3 for c in memoised.kept)
    covered = [n for c in memoised.kept for n in c.nodes]
    assert len(covered) == len(set(covered))  # no overlap
    for candidate in memoised.kept:
        assert candidate.program.nodes == candidate.nodes  # composed from its own nodes, in graph order
        assert not memoised.view.straddles_barrier(candidate.nodes)


def test_replanning_rounds_decide_as_with_every_round_planned_anew(monkeypatch):
    """Later rounds reuse the first round's lowering and composed groups: with groups
    made to lose verification, every round decides exactly as when each round
    lowers and composes everything again."""
    import autofuser_core.compile as compile_module

    gm, x = _zoo_graph("gnot", "bf16")
    fused = autofuser.fuse(nn.Identity(), progress=False)
    rounds = []

    def verify_round(gm, plan, inputs, device, options, progress, report, backward=False):
        rounds.append(len(plan.kept))
        jobs = []
        for k, candidate in enumerate(plan.kept):
            entry = compile_module._entry(
                candidate.strategy.name, candidate.nodes, plan.view, True, "fused", "", candidate.program
            )
            if len(candidate.nodes) > 1 and (compile_module.product_count(candidate.program) > 1 or k % 3 == 0):
                entry.fused, entry.reason_code, entry.reason = False, "slower", "made to lose"
            report.groups.append(entry)
            jobs.append(compile_module._Job(candidate, entry))
        return jobs

    monkeypatch.setattr(compile_module, "_verify_round", verify_round)
    monkeypatch.setattr(compile_module, "rewrite_graph", lambda gm, groups: gm)

    def decisions():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            _, report = compile_module.compile_graph(gm, (x,), fused._plugin_set, fused._options, lambda m: None)
        return (
            [(g.strategy, g.nodes, g.fused, g.reason_code, g.reason, g.bytes_after) for g in report.groups],
            [(n.node, n.reason_code, n.reason) for n in report.unfused_nodes],
        )

    reused = decisions()
    assert len(rounds) >= 3
    real_view = PlanningView.__init__
    monkeypatch.setattr(
        PlanningView,
        "__init__",
        lambda self, gm, registry, options=None, earlier=None: real_view(self, gm, registry, options),
    )
    rounds.clear()
    assert decisions() == reused and len(rounds) >= 3


# ---------------------------------------------------------------------------
# The cyclic garbage collector is paused while planning, and restored
# ---------------------------------------------------------------------------


def test_planning_runs_with_the_cyclic_collector_paused_and_restores_it(monkeypatch):
    import gc

    import autofuser_core.compile as compile_module

    seen = []
    real_plan = compile_module.plan_fusion_groups

    def plan(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(compile_module, "plan_fusion_groups", plan)
    model, x = FeedForward().eval(), torch.randn(2, 7, 24)
    assert gc.isenabled()
    with torch.no_grad():
        torch.testing.assert_close(autofuser.fuse(model, progress=False)(x), model(x), atol=1e-4, rtol=1e-4)
    assert seen == [False] and gc.isenabled()

    gc.disable()  # a caller that turned it off keeps it off
    try:
        with torch.no_grad():
            autofuser.fuse(model, progress=False)(x)
        assert not gc.isenabled()
    finally:
        gc.enable()

    with pytest.raises(RuntimeError), compile_module.gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a planning error")
    assert gc.isenabled()


class _NormBetweenProducts(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_in, self.lin1, self.lin2 = nn.LayerNorm(24), nn.Linear(24, 40), nn.Linear(40, 24)
        self.ln_mid, self.lin3 = nn.LayerNorm(24), nn.Linear(24, 16)

    def forward(self, x):
        return self.lin3(self.ln_mid(self.lin2(torch.nn.functional.gelu(self.lin1(self.ln_in(x))))))


def test_reduction_prologue_is_a_row_reduction_that_no_product_precedes():
    """``reduction_prologue`` (the matmul plugin's split rules use it): a norm in front
    of a group's first product is one; a norm between products (one precedes it) is not."""
    from autofuser_plugins.matmul.mlp.chain_layout import lay_out_chain
    from autofuser_plugins.matmul.split import reduction_prologue

    view = _view(_NormBetweenProducts(), torch.randn(3, 5, 24))
    chain = [n.name for n in view.nodes if n.op in ("call_module", "call_function")]
    assert chain == ["ln_in", "lin1", "gelu", "lin2", "ln_mid", "lin3"], chain
    # Several products with a norm between them: laid out as a row-tiled chain.
    assert reduction_prologue(view.compose(_nodes(view, *chain), lay_out=lay_out_chain))
    assert not reduction_prologue(view.compose(_nodes(view, *chain[1:]), lay_out=lay_out_chain))
    assert reduction_prologue(view.compose(_nodes(view, "ln_mid", "lin3")))
    assert not reduction_prologue(view.compose(_nodes(view, "lin2", "ln_mid")))
    assert not reduction_prologue(view.compose(_nodes(view, "lin1")))
    assert not reduction_prologue(None)


def test_split_rules_are_declared_by_the_strategies_and_validated():
    """The splits a kept group is timed against are its strategy's ``split_rules``: the
    matmul strategies split a norm from their product, the mlp plugin's also their
    products apart; a rule is validated like a spec."""
    from autofuser_core.specs import SplitRule
    from autofuser_plugins.matmul.split import FEWER_PRODUCTS, FEWER_PRODUCTS_NORM_APART, NORM_APART

    strategies = autofuser.load_plugins().registry.strategies
    for name in ("matmul", "linear_epilogue", "layernorm_linear"):
        assert strategies[name].split_rules == (NORM_APART,)
    for name in ("mlp", "row_chain"):
        assert strategies[name].split_rules == (FEWER_PRODUCTS, FEWER_PRODUCTS_NORM_APART, NORM_APART)
    assert not strategies["elementwise"].split_rules and not strategies["softmax_attention"].split_rules
    with pytest.raises(ValueError, match="fewer_product"):
        SplitRule(description="by one", applies=lambda program: True, fewer_product=1)


def test_a_split_rule_that_raises_is_answered_the_safe_way():
    """A plugin's split rule runs while a graph compiles: an ``applies`` that raises times
    the group against no such split, a ``refuse`` that raises refuses the group asked
    about; both name the plugin and the rule."""
    from autofuser_core.specs import SplitRule

    def broken(program):
        raise RuntimeError("bug")

    rule = SplitRule(description="by a broken rule", applies=broken, refuse=broken)
    mine = types.ModuleType("brokensplit")
    mine.autofuser_register_strategies = lambda register: register(
        name="mine.split",
        propose=lambda view: [],
        configs=lambda program: [{}],
        default_config=lambda program: {},
        generate=lambda program, helpers: None,
        split_rules=(rule,),
    )
    (guarded,) = autofuser.load_plugins([mine]).registry.guarded().strategies["mine.split"].split_rules
    with pytest.warns(UserWarning, match="brokensplit.*split rule 'by a broken rule'"):
        assert guarded.applies(None) is False
    with pytest.warns(UserWarning, match="SplitRule.refuse"):
        code, sentence = guarded.refuse(None)
    assert code == "plugin_failed" and "brokensplit" in sentence


class OutAndBack(nn.Module):
    """``a`` leaves through a product and comes back at ``b``: {a, b, c} is no group."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 24))

    def forward(self, x):
        a = x.exp()
        m = a @ self.w
        b = a + m
        c = b * 2
        d = x.neg()  # before the path comes back too: no member reads m
        return c, d


def test_a_group_a_path_leaves_and_reenters_splits_where_it_comes_back():
    view = _view(OutAndBack(), torch.randn(3, 24))
    a, b, c, d = _nodes(view, "exp", "add", "mul", "neg")
    members = {a, b, c, d}
    assert view.creates_cycle(members)
    late = view.reentered(members)
    assert late == {b, c}
    assert not view.creates_cycle(members - late) and not view.creates_cycle(late)
    # No path out and back: nothing counts.
    assert view.reentered({a, d}) == set() and not view.creates_cycle({a, d})


def _greedy_pointwise_plugin():
    """A strategy proposing the pointwise ops exp, add and mul of ``OutAndBack`` as one group
    (the bundled hooks otherwise): a group a path leaves and re-enters."""
    from autofuser_plugins.elementwise.strategy import ELEMENTWISE_STRATEGY as bundled

    def propose(view):
        return [[n for n in view.nodes if n.name in ("exp", "add", "mul")]]

    def register(register):
        register(
            autofuser.StrategySpec(
                name="greedy.pointwise",
                priority=bundled.priority + 1,
                block_params=bundled.block_params,
                propose=propose,
                accepts=bundled.accepts,
                configs=bundled.configs,
                default_config=bundled.default_config,
                is_valid=bundled.is_valid,
                generate=bundled.generate,
            )
        )

    return plugin_module("greedy", autofuser_register_strategies=register)


def test_a_proposed_group_that_would_make_a_cycle_fuses_as_two_groups(tmp_path):
    model = OutAndBack()
    fused = autofuser.fuse(
        model, plugins=["elementwise", _greedy_pointwise_plugin()], cache_dir=tmp_path, progress=False
    )
    x = torch.randn(5, 24)
    got, expected = fused(x), model(x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    report = fused.report()
    mine = [g for g in report.groups if g.strategy == "greedy.pointwise"]
    refused = [g for g in mine if g.reason_code == "cycle"]
    assert len(refused) == 1 and "tried again as two groups, 1 ops before" in refused[0].reason, str(report)
    parts = sorted(tuple(g.nodes) for g in mine if g.fused)
    assert ("exp",) in parts and ("add", "mul") in parts, str(report)


class _WideBlock(nn.Module):
    """A pre-norm transformer block's MLP half at a width past the products' epilogue
    norms (``MAX_ROW_N``, 256) and the two-product MLP's limit: the groups the strategies
    propose first (the whole chain, the MLP, a product with its norm) are all refused."""

    def __init__(self, width: int = 264, hidden: int = 280):
        super().__init__()
        self.norm_in = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, 7)

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(self.norm_in(x))))
        return self.head(self.norm_out(h))


def test_a_group_refused_as_too_wide_is_proposed_again_as_its_products_and_norms():
    """Refused as wholes, the block's parts are proposed apart: each product with its
    pointwise epilogue (the GELU, the residual add), each norm on its own; none of its
    ops is left to no group, and the fused block computes eager's output."""
    torch.manual_seed(0)
    model = _WideBlock().eval()
    x = torch.randn(2, 3, 264)
    with torch.no_grad():
        gm = capture(model, x)
        ShapeProp(gm).propagate(x)
        plan = plan_fusion_groups(gm, autofuser.load_plugins().registry)
    kept = {tuple(n.name for n in c.nodes): c.strategy.name for c in plan.kept}
    refused = {d.reason_code for d in plan.decisions}
    assert "too_wide" in refused, refused
    assert kept.get(("up", "gelu")) == "linear_epilogue", kept
    assert kept.get(("down", "add")) == "linear_epilogue", kept
    assert kept.get(("norm_in",)) == "row_reduction" and kept.get(("norm_out",)) == "row_reduction", kept
    fused = autofuser.fuse(model, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=2e-5, rtol=2e-5)
    assert len(fused.report().fused) >= 4, fused.report()


def test_a_block_planned_apart_trains_with_eagers_gradients():
    """The wide block's parts planned apart (products with their epilogues, norms on their
    own) with gradients on: one step's output and every gradient equal eager's, on fresh
    inputs of an awkward batch."""
    torch.manual_seed(1)
    model = _WideBlock()
    reference = _WideBlock()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(1, 5, 264)
    fused = autofuser.fuse(model, progress=False)
    got = fused(x.clone().requires_grad_())
    got.square().mean().backward()
    expected = reference(x.clone().requires_grad_())
    expected.square().mean().backward()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=5e-5, rtol=5e-5, msg=name)
    backward = [g for g in fused.report().fused if g.phase == "backward"]
    assert len(fused.report().fused) >= 4 and backward, fused.report()
