"""The plugin system: loading (``autofuser_core.plugins``), validation and
conflicts (``autofuser_core.registry``, ``autofuser_core.specs``).

Plugins here are throwaway modules built in the test (``plugin_module``), the
way a third party writes one: a module with ``autofuser_*`` functions. The
third-party ``trunc`` plugin is also run end to end through ``fuse()``.
"""

from __future__ import annotations

import importlib.metadata
import sys
import zlib

import pytest
import torch
import torch.fx
from pydantic import ValidationError

import autofuser
from autofuser import LoweringSpec, PluginError, Sample, SpecError, StrategySpec
from autofuser_core.plugins import AUTOLOAD_ENV, ENTRY_POINT_GROUP, installed_entry_points

from _helpers import plugin_module

BUNDLED = ["attention", "conv", "elementwise", "matmul", "mxint8", "reduction"]
KNOWN_HOOKS = (
    "autofuser_register_lowerings",
    "autofuser_register_strategies",
    "autofuser_register_quantizers",
    "autofuser_register_product_layouts",
    "autofuser_transform_graph",
    "autofuser_veto_fusion",
)
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=1e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-2, rtol=4e-2),
}


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def registering(**fields):
    """An ``autofuser_register_lowerings`` that registers one spec given as keywords."""

    def autofuser_register_lowerings(register):
        register(**fields)

    return autofuser_register_lowerings


def node_calling(target) -> torch.fx.Node:
    """The fx node of ``target`` in a one-op traced graph (for ``registry.lowering_for``)."""

    class OneOp(torch.nn.Module):
        def forward(self, x):
            return target(x)

    gm = torch.fx.symbolic_trace(OneOp())
    return next(n for n in gm.graph.nodes if n.op == "call_function")


# ---------------------------------------------------------------------------
# A valid third-party plugin: torch.trunc, which no bundled plugin lowers
# ---------------------------------------------------------------------------


def lower_trunc(ctx, input, *, out=None):
    if out is not None:
        ctx.refuse("out_argument", "trunc(out=...) writes into a caller's tensor")
    return ctx.pointwise("tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))", input)


def trunc_samples(dtype):
    return [
        Sample(args=((torch.randn(3, 37) * 2).to(dtype),), note="(3, 37)"),
        Sample(args=(torch.randn(2, 5, 7).to(dtype),), note="(2, 5, 7)"),
    ]


def trunc_method(x):
    return x.trunc()


def trunc_fields(**changes):
    fields = dict(
        name="truncplugin.trunc",
        description="rounding toward zero",
        targets=(torch.trunc, torch.fix, "trunc"),
        kind="pointwise",
        lower=lower_trunc,
        samples=trunc_samples,
        references=(torch.trunc, torch.fix, trunc_method),
    )
    fields.update(changes)
    return fields


@autofuser.hookimpl
def _register_trunc(register):
    register(LoweringSpec(**trunc_fields()))


TRUNC_PLUGIN = plugin_module("truncplugin", autofuser_register_lowerings=_register_trunc)


class TruncChain(torch.nn.Module):
    """Every form of trunc in one pointwise chain, with a broadcast operand."""

    def forward(self, x, y):
        a = torch.trunc(x * 7.0 + y)
        b = torch.fix(a * x)
        return b.trunc() - y


def test_no_bundled_plugin_lowers_trunc():
    """The premise of the third-party tests: trunc is not already taken."""
    bundled = autofuser.load_plugins(None)
    for spec in bundled.registry.lowerings.values():
        assert not {torch.trunc, torch.fix, "trunc"} & set(spec.targets), spec.name


def test_third_party_plugin_loads_and_is_stamped():
    plugin_set = autofuser.load_plugins([TRUNC_PLUGIN])
    assert plugin_set.names == ["truncplugin"]
    spec = plugin_set.registry.lowerings["truncplugin.trunc"]
    assert spec.plugin == "truncplugin"
    assert list(plugin_set.registry.lowerings) == ["truncplugin.trunc"]
    assert plugin_set.registry.lowering_for(node_calling(torch.trunc)) is spec
    assert plugin_set.registry.lowering_for(node_calling(torch.fix)) is spec
    assert plugin_set.registry.lowering_for(node_calling(torch.sigmoid)) is None


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_third_party_plugin_fuses_an_trunc_chain(dtype, batch):
    model = TruncChain()
    x = torch.randn(batch, 5, 37, dtype=dtype)
    y = torch.randn(37, dtype=dtype)
    with torch.no_grad():
        expected = model(x, y)
        fused = autofuser.fuse(model, plugins=["elementwise", TRUNC_PLUGIN], progress=False)
        got = fused(x, y)

    report = fused.report()
    assert report.plugins == ["elementwise", "truncplugin"]
    assert len(report.groups) == 1, str(report)
    group = report.groups[0]
    assert group.strategy == "elementwise"
    assert group.fused, group
    assert group.ops == [
        "elementwise.mul",
        "elementwise.add",
        "truncplugin.trunc",
        "elementwise.mul",
        "truncplugin.trunc",
        "truncplugin.trunc",
        "elementwise.sub",
    ]
    assert report.unfused_nodes == []
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


def test_without_the_plugin_trunc_stays_eager():
    """Control for the test above: the trunc nodes fuse because of the plugin."""
    model = TruncChain()
    x, y = torch.randn(3, 5, 37), torch.randn(37)
    with torch.no_grad():
        fused = autofuser.fuse(model, plugins=["elementwise"], progress=False)
        torch.testing.assert_close(fused(x, y), model(x, y), atol=1e-5, rtol=1e-4)
    report = fused.report()
    eager_truncs = [n for n in report.unfused_nodes if n.reason_code == "no_lowering"]
    assert len(eager_truncs) == 3, str(report)
    assert all("trunc" not in op for group in report.groups for op in group.ops)


def test_third_party_plugin_samples_match_its_references():
    """The plugin's own samples and references (what the conformance test runs)
    agree with the fused kernel."""
    spec = autofuser.load_plugins([TRUNC_PLUGIN]).registry.lowerings["truncplugin.trunc"]

    class Reference(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)

    for dtype in (torch.float32, torch.bfloat16):
        for sample in spec.samples(dtype):
            for reference in spec.references:
                model = Reference(reference)
                with torch.no_grad():
                    # elementwise brings the strategy; the trunc plugin only lowers.
                    fused = autofuser.fuse(model, plugins=["elementwise", TRUNC_PLUGIN], progress=False)
                    got = fused(*sample.args)
                    expected = model(*sample.args)
                assert [g.ops for g in fused.report().fused] == [["truncplugin.trunc"]]
                tol = spec.tolerance(dtype)
                torch.testing.assert_close(got.float(), expected.float(), atol=tol.atol, rtol=tol.rtol)


# ---------------------------------------------------------------------------
# Invalid specs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field, detail",
    [
        pytest.param({"tolerance": {}}, "tolerance", "Extra inputs", id="typo-field"),
        pytest.param({"kind": "pointwize"}, "kind", "pointwise", id="wrong-kind"),
        pytest.param({"targets": (42,)}, "targets", "42", id="target-not-callable"),
        pytest.param({"targets": (int,)}, "targets", "not an nn.Module subclass", id="class-not-a-module"),
        pytest.param({"targets": ("not a method",)}, "targets", "not a method name", id="bad-method-name"),
        pytest.param({"targets": ()}, "targets", "at least 1", id="no-targets"),
        pytest.param({"dtypes": ("float33",)}, "dtypes", "float33", id="unknown-dtype"),
        pytest.param({"tolerances": {"fp16": {"atol": 1, "rtol": 1}}}, "tolerances", "fp16", id="tolerance-dtype"),
        pytest.param({"references": ()}, "references", "no references", id="samples-without-references"),
    ],
)
def test_invalid_spec_is_a_spec_error_naming_plugin_and_field(changes, field, detail):
    bad = plugin_module("badplugin", autofuser_register_lowerings=registering(**trunc_fields(**changes)))
    with pytest.raises(SpecError) as caught:
        autofuser.load_plugins([bad])
    message = str(caught.value)
    assert "'badplugin'" in message
    assert field in message
    assert detail in message
    assert "truncplugin.trunc" in message  # the spec's name, so the author finds it


def test_invalid_spec_object_built_inside_the_hook_names_plugin_and_field():
    """A plugin that builds the spec object itself fails in its own hook: the
    error still names the plugin, the hook and the field."""

    def autofuser_register_lowerings(register):
        register(LoweringSpec(**trunc_fields(tolerance={})))

    bad = plugin_module("objplugin", autofuser_register_lowerings=autofuser_register_lowerings)
    with pytest.raises(PluginError) as caught:
        autofuser.load_plugins([bad])
    message = str(caught.value)
    assert "'objplugin'" in message and "autofuser_register_lowerings" in message and "tolerance" in message


@pytest.mark.parametrize(
    "call, detail",
    [
        pytest.param(lambda register: register(42), "registered a int", id="not-a-spec"),
        pytest.param(
            lambda register: register(
                StrategySpec(
                    name="s",
                    propose=lambda view: [],
                    configs=lambda p: [],
                    default_config=lambda p: {},
                    generate=lambda p, h: None,
                )
            ),
            "registered a StrategySpec",
            id="wrong-spec-type",
        ),
        pytest.param(lambda register: register(LoweringSpec(**trunc_fields()), name="x"), "not both", id="both-forms"),
        pytest.param(
            lambda register: register(**trunc_fields(plugin="elementwise")), "leave `plugin` unset", id="sets-plugin"
        ),
    ],
)
def test_misused_register_callback_is_a_spec_error(call, detail):
    bad = plugin_module("misuse", autofuser_register_lowerings=call)
    with pytest.raises(SpecError, match="'misuse'") as caught:
        autofuser.load_plugins([bad])
    assert detail in str(caught.value)


def test_specs_are_frozen():
    spec = autofuser.load_plugins([TRUNC_PLUGIN]).registry.lowerings["truncplugin.trunc"]
    with pytest.raises(ValidationError):
        spec.priority = 5
    with pytest.raises(ValidationError):
        spec.plugin = "someone_else"
    assert spec.priority == 0 and spec.plugin == "truncplugin"


def test_spec_as_keywords_equals_spec_object():
    by_keywords = plugin_module("bykw", autofuser_register_lowerings=registering(**trunc_fields()))
    by_object = TRUNC_PLUGIN
    a = autofuser.load_plugins([by_keywords]).registry.lowerings["truncplugin.trunc"]
    b = autofuser.load_plugins([by_object]).registry.lowerings["truncplugin.trunc"]
    assert a.plugin == "bykw" and b.plugin == "truncplugin"
    assert a.model_dump(exclude={"plugin"}) == b.model_dump(exclude={"plugin"})

    model = TruncChain()
    x, y = torch.randn(3, 5, 37), torch.randn(37)
    with torch.no_grad():
        fused = autofuser.fuse(model, plugins=["elementwise", by_keywords], progress=False)
        torch.testing.assert_close(fused(x, y), model(x, y), atol=1e-5, rtol=1e-4)
    assert "truncplugin.trunc" in fused.report().fused[0].ops


# ---------------------------------------------------------------------------
# Conflicts between plugins
# ---------------------------------------------------------------------------


def test_duplicate_spec_name_names_both_plugins():
    first = plugin_module("first", autofuser_register_lowerings=registering(**trunc_fields(name="shared.op")))
    second = plugin_module(
        "second",
        autofuser_register_lowerings=registering(
            **trunc_fields(name="shared.op", targets=(torch.frac,), samples=None, references=())
        ),
    )
    with pytest.raises(SpecError) as caught:
        autofuser.load_plugins([first, second])
    message = str(caught.value)
    assert "duplicate" in message and "'shared.op'" in message
    assert "'first'" in message and "'second'" in message


def test_tie_on_a_target_names_both_plugins_and_suggests_priority():
    first = plugin_module("first", autofuser_register_lowerings=registering(**trunc_fields(name="first.trunc")))
    second = plugin_module("second", autofuser_register_lowerings=registering(**trunc_fields(name="second.trunc")))
    with pytest.raises(SpecError) as caught:
        autofuser.load_plugins([first, second])
    message = str(caught.value)
    assert "tie" in message and "priority" in message
    assert "'first'" in message and "'second'" in message


def test_tie_with_a_bundled_lowering_names_the_bundled_plugin():
    mine = plugin_module(
        "mysigmoid",
        autofuser_register_lowerings=registering(
            name="mine.sigmoid",
            targets=(torch.sigmoid,),
            kind="pointwise",
            lower=lambda ctx, x: ctx.pointwise("1.0 / (1.0 + tl.exp(-{0}))", x),
        ),
    )
    with pytest.raises(SpecError) as caught:
        autofuser.load_plugins(["elementwise", mine])
    message = str(caught.value)
    assert "'elementwise'" in message and "'mysigmoid'" in message and "priority" in message


@pytest.mark.parametrize("order", ["low-first", "high-first"])
def test_higher_priority_wins_whatever_the_load_order(order):
    low = plugin_module("low", autofuser_register_lowerings=registering(**trunc_fields(name="low.trunc")))
    high = plugin_module(
        "high", autofuser_register_lowerings=registering(**trunc_fields(name="high.trunc", priority=5))
    )
    plugins = [low, high] if order == "low-first" else [high, low]
    registry = autofuser.load_plugins(plugins).registry
    for target in (torch.trunc, torch.fix):
        winner = registry.lowering_for(node_calling(target))
        assert winner is not None and winner.name == "high.trunc" and winner.plugin == "high"
    assert set(registry.lowerings) == {"low.trunc", "high.trunc"}  # the loser stays registered, unused


def test_higher_priority_override_of_a_bundled_lowering_wins():
    mine = plugin_module(
        "mysigmoid",
        autofuser_register_lowerings=registering(
            name="mine.sigmoid",
            targets=(torch.sigmoid,),
            kind="pointwise",
            priority=1,
            lower=lambda ctx, x: ctx.pointwise("1.0 / (1.0 + tl.exp(-{0}))", x),
        ),
    )
    registry = autofuser.load_plugins(["elementwise", mine]).registry
    assert registry.lowering_for(node_calling(torch.sigmoid)).name == "mine.sigmoid"
    # Forms it didn't claim keep the bundled lowering.
    assert registry.lowering_for(node_calling(torch.special.expit)).name == "elementwise.sigmoid"


# ---------------------------------------------------------------------------
# Hooks: misspelled names, wrong arguments, failures
# ---------------------------------------------------------------------------


def _misspelled(register):
    pass


@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "hookimpl"])
def test_unknown_hook_lists_known_hooks(marked):
    function = autofuser.hookimpl(_misspelled) if marked else _misspelled
    bad = plugin_module("typo_plugin", autofuser_register_lowering=function)
    with pytest.raises(PluginError) as caught:
        autofuser.load_plugins([bad])
    message = str(caught.value)
    assert "autofuser_register_lowering'" in message and "typo_plugin" in message
    for hook in KNOWN_HOOKS:
        assert hook in message


def test_marked_hook_without_the_prefix_is_also_unknown():
    bad = plugin_module("unprefixed", register_lowerings=autofuser.hookimpl(_misspelled))
    with pytest.raises(PluginError, match="register_lowerings") as caught:
        autofuser.load_plugins([bad])
    assert "autofuser_register_lowerings" in str(caught.value)  # listed as a known hook


def test_hook_with_a_wrong_argument_name():
    def autofuser_register_lowerings(regster):
        pass

    bad = plugin_module("argplugin", autofuser_register_lowerings=autofuser_register_lowerings)
    with pytest.raises(PluginError) as caught:
        autofuser.load_plugins([bad])
    message = str(caught.value)
    assert "'argplugin'" in message and "regster" in message


def test_failing_registration_hook_names_plugin_and_hook():
    def autofuser_register_strategies(register):
        raise RuntimeError("kaboom")

    bad = plugin_module("boomplugin", autofuser_register_strategies=autofuser_register_strategies)
    with pytest.raises(PluginError) as caught:
        autofuser.load_plugins([bad])
    message = str(caught.value)
    assert "'boomplugin'" in message and "autofuser_register_strategies" in message and "kaboom" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_object_without_hooks_is_not_a_plugin():
    with pytest.raises(PluginError, match="not a plugin"):
        autofuser.load_plugins([object()])


# ---------------------------------------------------------------------------
# Choosing plugins
# ---------------------------------------------------------------------------


def test_select_by_entry_point_name_loads_only_that_plugin():
    plugin_set = autofuser.load_plugins(["reduction"])
    assert plugin_set.names == ["reduction"]
    assert set(plugin_set.registry.strategies) == {"row_reduction", "split_reduction"}
    assert plugin_set.registry.lowerings
    assert {spec.plugin for spec in plugin_set.registry.lowerings.values()} == {"reduction"}
    assert plugin_set.registry.lowering_for(node_calling(torch.sigmoid)) is None


def test_select_by_module_object():
    import autofuser_plugins.elementwise as elementwise

    plugin_set = autofuser.load_plugins([elementwise])
    assert plugin_set.names == ["autofuser_plugins.elementwise"]
    assert set(plugin_set.registry.strategies) == {"elementwise"}
    # The same plugin by name and by module is loaded once.
    assert autofuser.load_plugins(["elementwise", elementwise]).names == ["elementwise"]


def test_unknown_plugin_name_lists_installed_plugins():
    with pytest.raises(PluginError) as caught:
        autofuser.load_plugins(["elementwsie"])
    message = str(caught.value)
    assert "'elementwsie'" in message
    for name in BUNDLED:
        assert name in message


def test_plugins_must_be_a_list():
    with pytest.raises(PluginError, match="list"):
        autofuser.load_plugins("elementwise")


def test_none_discovers_every_bundled_plugin():
    plugin_set = autofuser.load_plugins(None)
    assert plugin_set.names == BUNDLED
    assert {"elementwise", "row_reduction"} <= set(plugin_set.registry.strategies)


@pytest.fixture
def third_party_entry_point(monkeypatch):
    """An installed third-party plugin: the trunc plugin behind an entry point."""
    module = plugin_module("af_test_thirdparty", autofuser_register_lowerings=_register_trunc)
    monkeypatch.setitem(sys.modules, "af_test_thirdparty", module)
    fake = importlib.metadata.EntryPoint(name="thirdparty", value="af_test_thirdparty", group=ENTRY_POINT_GROUP)
    real_entry_points = importlib.metadata.entry_points

    def entry_points(**params):
        found = real_entry_points(**params)
        if params.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints([*found, fake])
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return fake


def test_autoload_disabled_skips_third_party_entry_points(third_party_entry_point, monkeypatch):
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    plugin_set = autofuser.load_plugins(None)
    assert plugin_set.names == BUNDLED
    assert "truncplugin.trunc" not in plugin_set.registry.lowerings
    # Still loadable by name on purpose.
    assert autofuser.load_plugins(["thirdparty"]).names == ["thirdparty"]


@pytest.mark.parametrize("value", [None, "0", ""])
def test_autoload_enabled_loads_third_party_entry_points(third_party_entry_point, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTOLOAD_ENV, value)
    plugin_set = autofuser.load_plugins(None)
    # Every installed plugin (the CI also installs examples/autofuser-plugin-fft), in name order.
    assert plugin_set.names == sorted(installed_entry_points())
    assert set(BUNDLED + ["thirdparty"]) <= set(plugin_set.names)
    assert plugin_set.registry.lowerings["truncplugin.trunc"].plugin == "thirdparty"

    model = TruncChain()
    x, y = torch.randn(3, 5, 37), torch.randn(37)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)  # plugins=None: discovered
        torch.testing.assert_close(fused(x, y), model(x, y), atol=1e-5, rtol=1e-4)
    assert any("truncplugin.trunc" in group.ops for group in fused.report().fused)


def test_broken_entry_point_names_itself(monkeypatch):
    broken = importlib.metadata.EntryPoint(name="broken", value="af_no_such_module_xyz", group=ENTRY_POINT_GROUP)
    real_entry_points = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda **params: (
            importlib.metadata.EntryPoints([*real_entry_points(**params), broken])
            if params.get("group") == ENTRY_POINT_GROUP
            else real_entry_points(**params)
        ),
    )
    with pytest.raises(PluginError) as caught:
        autofuser.load_plugins(["broken"])
    message = str(caught.value)
    assert "'broken'" in message and "af_no_such_module_xyz" in message and "failed to import" in message


@pytest.mark.parametrize("order", ["winner-first", "winner-last"])
def test_a_tie_below_a_clear_winner_is_not_an_error_in_any_order(order):
    low_a = plugin_module("lowa", autofuser_register_lowerings=registering(**trunc_fields(name="lowa.trunc")))
    low_b = plugin_module("lowb", autofuser_register_lowerings=registering(**trunc_fields(name="lowb.trunc")))
    high = plugin_module("top", autofuser_register_lowerings=registering(**trunc_fields(name="top.trunc", priority=5)))
    plugins = [high, low_a, low_b] if order == "winner-first" else [low_a, low_b, high]
    registry = autofuser.load_plugins(plugins).registry
    node = torch.fx.symbolic_trace(lambda x: torch.trunc(x)).graph.find_nodes(op="call_function", target=torch.trunc)[0]
    assert registry.lowering_for(node).name == "top.trunc"
