"""Trusting what runs: verification on synthetic inputs (``verify.synthetic_mismatch``),
a graph whose generated code computes what its nodes do (``compile._spell_negative_bases``),
the comparison's rules for NaN and infinity (``verify.max_error``), plugin code that
raises while a graph compiles (``registry.Registry.guarded``, ``compile._veto``,
``compile._transform_graph``), plugins that implement no hook, and the ``report``
command's output paths. docs/verification.md says what verification checks.
"""

from __future__ import annotations

import copy
import types
import warnings
import zlib

import pytest
import torch

import autofuser
from autofuser import LoweringSpec, PluginError, StrategySpec
from autofuser.cli import main as cli_main
from autofuser_core import verify as verify_module
from autofuser_core.specs import DEFAULT_TOLERANCES
from autofuser_core.verify import max_error

from _helpers import plugin_module


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class AbsChain(torch.nn.Module):
    def forward(self, x):
        return torch.abs(x) * 2.0 + 0.5


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=4e-2)}


# ---------------------------------------------------------------------------
# Synthetic inputs: a lowering wrong only where the first batch never went
# ---------------------------------------------------------------------------


def _positive_only_abs(ctx, input):
    return ctx.pointwise("{0}", input)  # |x| for x >= 0 only: the planted bug


def _register_positive_only_abs(register):
    register(
        LoweringSpec(
            name="positiveabs.abs", targets=(torch.abs,), kind="pointwise", lower=_positive_only_abs, priority=1
        )
    )


POSITIVE_ONLY_ABS = plugin_module("positiveabs", autofuser_register_lowerings=_register_positive_only_abs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 37), (3, 5, 129)])
def test_a_lowering_wrong_for_negatives_is_refused_on_an_all_positive_first_batch(dtype, shape):
    model = AbsChain()
    fused = autofuser.fuse(model, plugins=["elementwise", POSITIVE_ONLY_ABS], progress=False)
    first = torch.rand(shape, dtype=dtype) + 0.01  # every value positive: the bug can't show on it
    torch.testing.assert_close(fused(first), model(first), **TOLERANCE[dtype])
    report = fused.report()
    group = next(g for g in report.groups if "positiveabs.abs" in g.ops)
    assert not group.fused and group.reason_code == "mismatch", str(report)
    assert "synthetic" in group.reason and "verification.md" in group.reason
    assert "mismatch" in str(report)
    second = torch.randn(shape, dtype=dtype)  # same signature: the verdict above is reused
    assert (second < 0).any()
    torch.testing.assert_close(fused(second), model(second), **TOLERANCE[dtype])
    assert len(fused.reports()) == 1


@pytest.mark.parametrize("op", [torch.abs, torch.log, torch.sqrt], ids=["abs", "log", "sqrt"])
def test_correct_lowerings_still_fuse_on_an_all_positive_first_batch(op):
    """Negative synthetic values make log and sqrt NaN on both sides: NaN where eager
    has NaN is agreement, not a mismatch."""

    class Chain(torch.nn.Module):
        def forward(self, x):
            return op(x) * 3.0 - 1.0

    model = Chain()
    fused = autofuser.fuse(model, plugins=["elementwise"], progress=False)
    x = torch.rand(4, 33) + 0.01
    torch.testing.assert_close(fused(x), model(x))
    report = fused.report()
    assert report.fused and not report.skipped, str(report)


def test_weights_and_integer_or_bool_inputs_keep_their_real_values(monkeypatch):
    """Only floating activations are drawn: the linear's weight and bias, and the bool
    mask, reach the synthetic run as they are."""
    drawn = []
    original = verify_module._synthetic_like

    def recording(real, generator):
        drawn.append(real)
        return original(real, generator)

    monkeypatch.setattr(verify_module, "_synthetic_like", recording)

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(12, 7)

        def forward(self, x, mask):
            y = self.proj(x)
            return torch.where(mask, torch.relu(y), y * 0.5)

    model = Masked()
    x, mask = torch.randn(5, 12), torch.randn(5, 7) > 0
    fused = autofuser.fuse(model, plugins=["elementwise", "matmul"], progress=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, mask), model(x, mask), atol=1e-4, rtol=1e-4)
    assert fused.report().fused, str(fused.report())
    assert drawn and all(t.is_floating_point() for t in drawn)
    parameters = {p.data_ptr() for p in model.parameters()}
    assert not any(t.data_ptr() in parameters for t in drawn)
    assert not any(t.dtype == torch.bool for t in drawn)


def test_synthetic_draws_cover_both_signs_and_the_real_scale():
    real = torch.rand(3, 200) * 50 + 10  # positive, away from zero
    generator = torch.Generator().manual_seed(0)
    drawn = verify_module._synthetic_like(real, generator)
    assert drawn.shape == real.shape and drawn.stride() == real.stride() and drawn.dtype == real.dtype
    assert (drawn < 0).any() and (drawn > 0).any() and (drawn == 0).any()
    assert drawn.abs().max() >= 1.5 * real.abs().max()  # a few large values
    assert (drawn.abs() < 1e-3).sum() >= 4  # and tiny ones
    expanded = torch.randn(1, 9).expand(4, 9)  # a broadcast (1, C) operand keeps its strides
    again = verify_module._synthetic_like(expanded, generator)
    assert again.stride() == expanded.stride() and torch.equal(again[0], again[3])
    assert verify_module._synthetic_like(torch.zeros(64), generator).abs().max() > 0  # never only zeros


@pytest.mark.parametrize("plugins", [["reduction"], None], ids=["pow-eager", "pow-fused"])
@pytest.mark.parametrize("base", [-2.0, -3, -0.5])
def test_a_negative_number_base_keeps_its_sign_in_the_rewritten_graph(plugins, base):
    """fx writes ``operator.pow(-2.0, y)`` as ``-2.0 ** y``, which Python reads as
    ``-(2.0 ** y)``: the rewritten graph, where the power runs eager, would compute that."""

    class NegativeBase(torch.nn.Module):
        def forward(self, x):
            return base**x + x.sum(-1, keepdim=True)

    model = NegativeBase()
    x = torch.randn(3, 17) * 2
    x[0, :4] = torch.tensor([2.0, 3.0, 0.5, -1.0])  # integer exponents: finite, of either sign
    fused = autofuser.fuse(model, plugins=plugins, progress=False)
    torch.testing.assert_close(fused(x), model(x), equal_nan=True, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------
# The comparison: NaN where eager has NaN, the same infinity where it has one
# ---------------------------------------------------------------------------

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "fused, eager, ok",
    [
        ([1.0, 2.0], [1.0, 2.0], True),
        ([1.0, INF], [1.0, INF], True),
        ([1.0, NAN], [1.0, NAN], True),
        ([1.0, 3.0e38], [1.0, INF], False),  # finite where eager overflows
        ([1.0, -INF], [1.0, INF], False),  # the other infinity
        ([1.0, INF], [1.0, 3.0e38], False),
        ([1.0, 0.0], [1.0, NAN], False),
        ([1.0, NAN], [1.0, INF], False),
    ],
    ids=[
        "equal",
        "same-inf",
        "same-nan",
        "finite-for-inf",
        "wrong-inf",
        "inf-for-finite",
        "finite-for-nan",
        "nan-for-inf",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_values_must_match_exactly(fused, eager, ok, dtype):
    tol = DEFAULT_TOLERANCES["float32" if dtype == torch.float32 else "bfloat16"]
    a = torch.tensor([fused, fused], dtype=torch.float32).to(dtype)
    b = torch.tensor([eager, eager], dtype=torch.float32).to(dtype)
    assert max_error(a, b, tol)[0] is ok


# ---------------------------------------------------------------------------
# Plugin code that raises while a graph compiles
# ---------------------------------------------------------------------------


def _check_contained(fused, model, plugin: str, hook: str, caught, calls: list, shape=(3, 41)):
    """The model computed right, the fault named in a warning and in the report, and
    a second call with the same signature calling the plugin no more."""
    messages = [str(w.message) for w in caught if plugin in str(w.message)]
    assert messages and hook in messages[0], [str(w.message) for w in caught]
    report = fused.report()
    assert any(plugin in note and hook in note for note in report.notes), report.notes
    assert calls, "the plugin's code was never called"
    before = len(calls)
    x = torch.randn(shape)
    torch.testing.assert_close(fused(x), model(x))
    assert len(calls) == before, "the plugin was called again on a compiled signature"
    return report


def test_a_lowering_that_raises_leaves_its_node_eager_and_names_plugin_and_hook():
    calls = []

    def lower(ctx, input):
        calls.append(1)
        raise ValueError("lowering bug")

    def register(register):
        register(LoweringSpec(name="brokenabs.abs", targets=(torch.abs,), kind="pointwise", lower=lower, priority=1))

    model = AbsChain()
    fused = autofuser.fuse(
        model,
        plugins=["elementwise", plugin_module("brokenabs", autofuser_register_lowerings=register)],
        progress=False,
    )
    caught = _run_recording_warnings(fused, model)
    report = _check_contained(fused, model, "'brokenabs'", "LoweringSpec.lower", caught, calls)
    node = next(n for n in report.unfused_nodes if n.target.endswith("abs"))
    assert node.reason_code == "plugin_failed" and "'brokenabs'" in node.reason and "lowering bug" in node.reason
    assert report.fused  # the ops around it still fuse


def _run_recording_warnings(fused, model) -> list:
    """Call ``fused`` once on fresh inputs, checking it against ``model``; the warnings given."""
    x = torch.randn(3, 41)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(fused(x), model(x))
    return caught


def _strategy_plugin(name: str, failing: str, calls: list) -> types.ModuleType:
    """A strategy taking every pointwise chain (like the bundled one, at a higher
    priority) whose ``failing`` hook raises; ``calls`` counts that hook's calls."""
    from autofuser_plugins.elementwise.strategy import ELEMENTWISE_STRATEGY as bundled

    hooks = dict(
        propose=bundled.propose,
        accepts=bundled.accepts,
        configs=bundled.configs,
        default_config=bundled.default_config,
        is_valid=bundled.is_valid,
        generate=bundled.generate,
    )

    def raising(*args, **kwargs):
        calls.append(1)
        raise RuntimeError(f"{failing} bug")

    hooks[failing] = raising

    def register(register):
        register(StrategySpec(name=f"{name}.pointwise", priority=1, block_params=bundled.block_params, **hooks))

    return plugin_module(name, autofuser_register_strategies=register)


@pytest.mark.parametrize("failing", ["propose", "compose", "accepts", "default_config", "generate"])
def test_a_strategy_hook_that_raises_leaves_its_groups_eager_and_names_plugin_and_hook(failing):
    calls = []
    plugin = _strategy_plugin("brokenstrategy", failing, calls)
    model = AbsChain()
    fused = autofuser.fuse(model, plugins=["elementwise", plugin], progress=False)
    caught = _run_recording_warnings(fused, model)
    report = _check_contained(fused, model, "'brokenstrategy'", f"StrategySpec.{failing}", caught, calls)
    mine = [g for g in report.groups if g.strategy == "brokenstrategy.pointwise"]
    assert not any(g.fused for g in mine), str(report)
    if failing != "propose":
        assert mine and all("'brokenstrategy'" in g.reason and failing in g.reason for g in mine), str(report)
    if failing in ("accepts", "default_config", "generate"):
        assert mine[0].reason_code == "plugin_failed"
    # The bundled strategy fuses the chain instead, in the same or a later round.
    assert any(g.fused and g.strategy != "brokenstrategy.pointwise" for g in report.groups), str(report)


def test_a_veto_hook_that_raises_keeps_groups_eager_and_names_plugin_and_hook():
    calls = []

    def autofuser_veto_fusion(group, options):
        calls.append(1)
        raise KeyError("veto bug")

    model = AbsChain()
    fused = autofuser.fuse(
        model,
        plugins=["elementwise", plugin_module("brokenveto", autofuser_veto_fusion=autofuser_veto_fusion)],
        progress=False,
    )
    caught = _run_recording_warnings(fused, model)
    report = _check_contained(fused, model, "'brokenveto'", "autofuser_veto_fusion", caught, calls)
    assert not report.fused
    assert all(g.reason_code == "vetoed" and "'brokenveto'" in g.reason for g in report.groups), str(report)


def test_a_graph_pass_that_raises_halfway_is_undone():
    """The pass changes the graph (every add becomes a sub), then raises: the graph
    it left would compute something else, so it is restored."""
    calls = []

    def autofuser_transform_graph(gm, options):
        calls.append(1)
        for node in gm.graph.nodes:
            if node.op == "call_function" and "add" in str(node.target):
                node.target = torch.sub
        raise RuntimeError("pass bug")

    model = AbsChain()
    plugin = plugin_module("brokenpass", autofuser_transform_graph=autofuser_transform_graph)
    fused = autofuser.fuse(model, plugins=["elementwise", plugin], progress=False)
    caught = _run_recording_warnings(fused, model)
    report = _check_contained(fused, model, "'brokenpass'", "autofuser_transform_graph", caught, calls)
    assert report.fused, str(report)


# ---------------------------------------------------------------------------
# Loading: a module that implements no hook is no plugin
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("item", ["os.path", types.ModuleType("emptyplugin")], ids=["name", "module"])
def test_a_module_implementing_no_hook_is_refused(item):
    with pytest.raises(PluginError) as caught:
        autofuser.load_plugins([item])
    message = str(caught.value)
    assert "not a plugin" in message and "autofuser_*" in message and "docs/writing-a-plugin.md" in message
    assert ("os.path" if isinstance(item, str) else "emptyplugin") in message
    with pytest.raises(PluginError, match="not a plugin"):
        autofuser.fuse(AbsChain(), plugins=["elementwise", item])


# ---------------------------------------------------------------------------
# The report command checks where it writes before compiling
# ---------------------------------------------------------------------------

FACTORY = """
import pathlib
import torch


def make():
    pathlib.Path(__file__).with_name("factory-ran").write_text("yes")
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU()).eval(), torch.randn(3, 6)
"""


def test_report_makes_missing_folders_for_its_outputs(tmp_path):
    (tmp_path / "small_factory.py").write_text(FACTORY)
    out, as_json = tmp_path / "new" / "deeper" / "report.html", tmp_path / "other" / "report.json"
    assert (
        cli_main(
            [
                "report",
                f"{tmp_path / 'small_factory.py'}:make",
                "--out",
                str(out),
                "--json",
                str(as_json),
                "--plugins",
                "elementwise,matmul",
            ]
        )
        == 0
    )
    assert "</html>" in out.read_text() and as_json.read_text().startswith("{")


@pytest.mark.parametrize("where", ["folder", "under-a-file", "json-folder"])
def test_report_refuses_an_unwritable_output_before_compiling(tmp_path, where):
    (tmp_path / "small_factory.py").write_text(FACTORY)
    (tmp_path / "a-file").write_text("")
    out = {"folder": tmp_path, "under-a-file": tmp_path / "a-file" / "report.html"}.get(where, tmp_path / "r.html")
    argv = ["report", f"{tmp_path / 'small_factory.py'}:make", "--out", str(out), "--plugins", "elementwise"]
    if where == "json-folder":
        argv += ["--json", str(tmp_path)]
    with pytest.raises(SystemExit) as caught:
        cli_main(argv)
    message = str(caught.value)
    assert ("is a folder" if where != "under-a-file" else "can't make the folder") in message
    assert "--json" in message if where == "json-folder" else "--out" in message
    assert not (tmp_path / "factory-ran").exists()  # refused before the model was even built


# ---------------------------------------------------------------------------
# Float64 as the judge: both sides round, and a long sum rounds differently in each order
# ---------------------------------------------------------------------------


class LongSum(torch.nn.Module):
    def forward(self, x):
        return (x * 3.0).sum(dim=-1) + 1.0


def _no_tolerance(monkeypatch):
    """A tolerance of zero: any rounding difference from eager's is a miss of the plain check."""
    import autofuser_core.compile as compile_module

    monkeypatch.setattr(compile_module, "tolerance", lambda candidate, view: verify_module.Tolerance(atol=0, rtol=0))


@pytest.mark.parametrize("shape", [(5, 3001), (1, 2047)])
def test_a_kernel_as_close_to_float64_as_eager_is_kept_where_it_misses_eager(monkeypatch, shape):
    """Values with a large common part that cancels: eager's fp32 sum and the kernel's,
    summed in another order, differ in their last bits (a miss of a zero tolerance); the
    group's ops in float64 are the judge, and the kernel is no farther from them than
    FLOAT64_FACTOR times eager, so it is kept, and the report says how it was judged."""
    _no_tolerance(monkeypatch)
    model = LongSum()
    x = torch.randn(shape) * 100.0 + 250.0
    x = x - x.mean(dim=-1, keepdim=True)
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction"], progress=False)
    out = fused(x)
    exact = (x.double() * 3.0).sum(dim=-1) + 1.0
    assert (out.double() - exact).abs().max() <= 4 * (model(x).double() - exact).abs().max() + 1e-9
    report = fused.report()
    (group,) = [g for g in report.groups if "reduction.sum" in g.ops]
    assert group.fused and group.float64_judged, str(report)
    assert group.max_error is not None and group.max_error > 0  # it did miss eager's bits


def test_without_the_float64_judge_the_same_kernel_is_a_mismatch(monkeypatch):
    """The same group with the judge allowing no error beyond eager's zero-width bound: a
    mismatch, as before, so the test above is the judge at work."""
    _no_tolerance(monkeypatch)
    monkeypatch.setattr(verify_module, "FLOAT64_FACTOR", 0.0)
    x = torch.randn(3, 3001) * 100.0 + 250.0
    x = x - x.mean(dim=-1, keepdim=True)
    fused = autofuser.fuse(LongSum(), plugins=["elementwise", "reduction"], progress=False)
    torch.testing.assert_close(fused(x), LongSum()(x))
    (group,) = [g for g in fused.report().groups if "reduction.sum" in g.ops]
    assert not group.fused and group.reason_code == "mismatch", str(fused.report())
    assert "float64" in group.reason
    # Where it missed, with both values and the output's scale: a rounding of a large sum
    # reads differently from a wrong value.
    assert " at [" in group.reason and "against eager's" in group.reason and "largest magnitude" in group.reason


@pytest.mark.parametrize(
    "fused_off, eager_off, ok",
    [
        (2e-3, 1e-3, True),  # twice eager's own error from the exact value
        (5e-3, 1e-3, False),  # five times: more than FLOAT64_FACTOR
        (1e-3, 0.0, False),  # eager exact, the kernel not: the plain tolerance is all it gets
    ],
)
def test_the_float64_judge_weighs_the_kernel_against_eager_s_own_error(fused_off, eager_off, ok):
    exact = torch.randn(4, 9, dtype=torch.float64) * 10
    eager = (exact + eager_off * torch.sign(torch.randn_like(exact))).float()
    fused = (exact + fused_off * torch.sign(torch.randn_like(exact))).float()
    tol = verify_module.Tolerance(atol=1e-6, rtol=0.0)
    # fp32 rounding of values near 10 is about 1e-6: the offsets chosen dwarf it.
    found, error = verify_module.closer_than_eager(fused, eager, exact, tol)
    assert found is ok and error == pytest.approx(fused_off, rel=0.01)


def test_the_float64_judge_keeps_the_non_finite_rule():
    exact = torch.tensor([[1.0, 2.0, float("nan")]], dtype=torch.float64)
    eager = torch.tensor([[1.0, 2.0, float("nan")]])
    assert verify_module.closer_than_eager(eager.clone(), eager, exact, verify_module.Tolerance(atol=1e-6, rtol=0))[0]
    wrong = torch.tensor([[1.0, float("nan"), 3.0]])
    assert not verify_module.closer_than_eager(wrong, eager, exact, verify_module.Tolerance(atol=1e-6, rtol=0))[0]


def test_one_large_element_does_not_lift_the_bound_of_its_row():
    """A column sum whose one channel is far from the others: eager's error there is large,
    elsewhere small. A kernel wrong by far more than eager on every other element is refused
    (each element's bound is its own eager error or its row's 90th percentile of them)."""
    exact = torch.randn(512, dtype=torch.float64) * 348
    eager_error = torch.randn(512, dtype=torch.float64) * 0.01
    eager_error[0] = 0.28
    eager = (exact + eager_error).float()
    tol = verify_module.Tolerance(atol=1e-5, rtol=1e-4)
    wrong = (exact + 0.9 * torch.sign(torch.randn(512, dtype=torch.float64))).float()
    assert not verify_module.closer_than_eager(wrong, eager, exact, tol)[0]
    rounded_otherwise = (exact + torch.randn(512, dtype=torch.float64) * 0.01).float()
    assert verify_module.closer_than_eager(rounded_otherwise, eager, exact, tol)[0]


def test_the_float64_judge_refuses_what_it_cannot_weigh():
    tol = verify_module.Tolerance(atol=1e-6, rtol=0.0)
    eager = torch.tensor([[3e38, 1.0, 2.0]])
    exact = torch.tensor([[float("inf"), 1.0, 2.0]], dtype=torch.float64)  # eager finite, exact not
    assert not verify_module.closer_than_eager(torch.tensor([[3e38, -777.0, 1e6]]), eager, exact, tol)[0]
    # A comparison that fails (here shapes that don't broadcast; on a GPU, memory) is no verdict of fit.
    assert verify_module.closer_than_eager(eager, eager, torch.zeros(2, 2, dtype=torch.float64), tol) == (
        False,
        pytest.approx(float("nan"), nan_ok=True),
    )


def test_the_float64_judge_computes_in_float64_under_autocast():
    """Under autocast the reference is still the ops' exact arithmetic (autocast off inside):
    eager's bf16 roundings are part of its error, not of the reference."""

    class Product(torch.nn.Module):
        def forward(self, a, b):
            return a @ b

    graph = torch.fx.symbolic_trace(Product())
    a, b = torch.randn(5, 300), torch.randn(300, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (exact,) = verify_module.float64_outputs(graph, [a, b], 1)
        eager = Product()(a, b)
    assert exact.dtype == torch.float64 and eager.dtype == torch.bfloat16
    torch.testing.assert_close(exact, a.double() @ b.double())


def test_the_float64_judge_widens_the_weights_a_group_reads_and_leaves_the_models_alone():
    """A group calling a norm module and reading a weight as an attribute runs in float64
    too (before, its float32 weights met float64 inputs and the judge never ran); the
    model's parameters and a batch norm's running statistics stay as they were."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(13)
            self.bn = torch.nn.BatchNorm1d(5)
            self.scale = torch.nn.Parameter(torch.randn(13))

        def forward(self, x):
            return self.bn(self.norm(x) * self.scale)

    block = Block().train()
    with torch.no_grad():
        block.norm.weight.normal_()
        block.norm.bias.normal_()
    graph = torch.fx.symbolic_trace(block)
    before = {name: (t, t.detach().clone()) for name, t in (*block.named_parameters(), *block.named_buffers())}
    x = torch.randn(3, 5, 13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = verify_module.float64_outputs(graph, [x], 1)
    assert found is not None
    (exact,) = found
    wide = copy.deepcopy(block).double()
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact, wide(x.double()))
    for name, (tensor, value) in before.items():
        now = dict((*block.named_parameters(), *block.named_buffers()))[name]
        assert now is tensor and now.dtype == value.dtype, name
        torch.testing.assert_close(now, value, rtol=0, atol=0)
