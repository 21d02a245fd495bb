"""The signature guard and the wrapper (``autofuser_core.fuse``): a compiled graph is
never reused after a change it baked in - hooks, replaced submodules and parameters,
plain attributes, non-tensor arguments - and the wrapper saves, loads and reads
attributes like the model. Also the strictness of ``fuse()``'s options.

Each test compiles a small model on its first call, makes the change, and compares the
next call with eager PyTorch on fresh random inputs. docs/guard.md lists what the guard
sees.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import sys
import types
import warnings
import zlib
from typing import NamedTuple

import pytest
import torch
import torch.nn.modules.module as module_hooks

import autofuser
from autofuser import LoweringSpec, Sample

TOLERANCE = dict(atol=1e-5, rtol=1e-4)
#: Where the models run: the GPU where there is one, else the CPU under Triton's interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class Scale(torch.nn.Module):
    """A part that fuses into its neighbours' kernel."""

    def forward(self, x):
        return torch.sigmoid(x) * 3


class Net(torch.nn.Module):
    """Linear -> pointwise submodule -> pointwise tail, scaled by a plain attribute."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(13, 7)
        self.act = Scale()
        self.temperature = 1.0

    def forward(self, x):
        return torch.tanh(self.act(self.fc(x)) + 1) * self.temperature


def _randn(*shape, **kwargs):
    return torch.randn(*shape, device=DEVICE, **kwargs)


def _fused(model, *inputs, **options):
    model.to(DEVICE)
    fused = autofuser.fuse(model, progress=False, **options)
    with torch.no_grad():
        torch.testing.assert_close(fused(*inputs), model(*inputs), **TOLERANCE)
    assert fused.report().fused, "the premise: something fuses"
    return fused


def _same_as_eager(fused, model, *shape):
    x = _randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), **TOLERANCE)


# ---------------------------------------------------------------------------
# Hooks registered after the first call
# ---------------------------------------------------------------------------


def _double(module, inputs, output):
    return output * 2


@pytest.mark.parametrize("where", ["act", "fc", "root"])
def test_a_forward_hook_registered_after_the_first_call_runs(where):
    model = Net()
    fused = _fused(model, _randn(1, 13))
    target = model if where == "root" else getattr(model, where)
    handle = target.register_forward_hook(_double)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "AutoFuser could not trace")  # the hooked root runs whole
        _same_as_eager(fused, model, 1, 13)
    handle.remove()
    _same_as_eager(fused, model, 1, 13)


def test_a_forward_pre_hook_registered_after_the_first_call_runs():
    model = Net()
    fused = _fused(model, _randn(5, 13))
    model.act.register_forward_pre_hook(lambda module, args: (args[0] - 1,))
    _same_as_eager(fused, model, 5, 13)


def test_a_global_module_hook_runs_on_every_module_and_not_on_the_wrapper():
    model = Net()
    fused = _fused(model, _randn(3, 13))
    calls = []

    def double_and_count(module, inputs, output):
        calls.append(type(module).__name__)
        return output * 2

    handle = module_hooks.register_module_forward_hook(double_and_count)
    try:
        x = _randn(3, 13)
        with torch.no_grad():
            expected = model(x)
            eager_calls, calls[:] = list(calls), []
            with pytest.warns(UserWarning, match="global module hook") as record:
                got = fused(x)
                fused(x)
        torch.testing.assert_close(got, expected, **TOLERANCE)
        assert calls[: len(eager_calls)] == eager_calls == ["Linear", "Scale", "Net"]
        assert len([w for w in record if "global module hook" in str(w.message)]) == 1
    finally:
        handle.remove()
    _same_as_eager(fused, model, 3, 13)  # fused again
    assert fused.report().fused


def test_a_backward_hook_runs_when_gradients_are_enabled():
    model = Net()
    fused = _fused(model, _randn(4, 13))
    seen = []
    model.act.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0].shape))
    x = _randn(4, 13, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the original model, no warning
        fused(x).sum().backward()
    fused_grad, x.grad = x.grad, None
    assert seen == [torch.Size([4, 7])]
    # The hooked module runs as it is; the rest of the model still fuses.
    assert "act" in fused.report().opaque and fused.report().fused, str(fused.report())
    model(x).sum().backward()
    torch.testing.assert_close(fused_grad, x.grad, **TOLERANCE)
    _same_as_eager(fused, model, 4, 13)  # under no_grad the backward hook changes nothing: it fuses
    assert fused.report().fused


# ---------------------------------------------------------------------------
# The model's own state: submodules, parameters, attributes
# ---------------------------------------------------------------------------


def test_a_replaced_submodule_is_seen():
    model = Net()
    fused = _fused(model, _randn(6, 13))
    model.fc = torch.nn.Linear(13, 7, device=DEVICE)
    _same_as_eager(fused, model, 6, 13)


def test_a_replaced_parameter_is_seen():
    class Gain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.randn(7))

        def forward(self, x):
            return torch.sigmoid(x * self.gain) + 1

    model = Gain()
    fused = _fused(model, _randn(6, 7))
    model.gain = torch.nn.Parameter(_randn(7))
    _same_as_eager(fused, model, 6, 7)


def test_a_changed_plain_attribute_is_seen_and_each_value_compiles_once():
    model = Net()
    fused = _fused(model, _randn(2, 13))
    model.temperature = 0.5
    _same_as_eager(fused, model, 2, 13)
    model.temperature = 1.0
    _same_as_eager(fused, model, 2, 13)
    model.temperature = float("0.5")  # a new object, the same value
    _same_as_eager(fused, model, 2, 13)
    assert len(fused.reports()) == 2


def test_a_changed_attribute_of_a_fused_submodule_is_seen():
    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(9, 9)
            self.act = torch.nn.LeakyReLU(0.1)

        def forward(self, x):
            return self.act(self.fc(x) * 2)

    model = Leaky()
    fused = _fused(model, _randn(3, 9))
    model.act.negative_slope = 0.7
    _same_as_eager(fused, model, 3, 9)


def test_state_a_forward_updates_itself_compiles_once():
    class Counting(torch.nn.Module):
        """Counts its calls in a plain attribute; value-dependent, so it runs unchanged."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * 2 if x.sum() > 0 else x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.count = Counting()

        def forward(self, x):
            return torch.tanh(self.count(torch.sigmoid(x) + 1) * 3)

    model = Outer().to(DEVICE)
    twin = copy.deepcopy(model)  # eager calls of the model itself would be changes between calls
    fused = autofuser.fuse(model, progress=False)
    with torch.no_grad():
        for _ in range(3):
            x = _randn(4, 6)
            torch.testing.assert_close(fused(x), twin(x), **TOLERANCE)
    assert fused.report().fused and len(fused.reports()) == 1
    assert model.count.calls == twin.count.calls == 3  # capture's and verification's runs left no count


def test_changes_past_the_limit_run_the_original_with_one_warning(monkeypatch):
    from autofuser_core import fuse as fuse_module

    monkeypatch.setattr(fuse_module, "STATE_CHANGE_LIMIT", 1)
    model = Net()
    fused = _fused(model, _randn(2, 13))
    model.fc = torch.nn.Linear(13, 7, device=DEVICE)
    _same_as_eager(fused, model, 2, 13)
    model.fc = torch.nn.Linear(13, 7, device=DEVICE)
    with pytest.warns(UserWarning, match=r"changed between calls 2 times.*submodule 'fc' replaced"):
        _same_as_eager(fused, model, 2, 13)
    fused.reset()
    _same_as_eager(fused, model, 2, 13)
    assert fused.report().fused


# ---------------------------------------------------------------------------
# Non-tensor arguments
# ---------------------------------------------------------------------------


class Scaled(torch.nn.Module):
    def forward(self, x, s):
        return torch.sigmoid(x) * s.scale + s.shift


class Config:
    def __init__(self, scale, shift):
        self.scale, self.shift = scale, shift


@dataclasses.dataclass(frozen=True)
class FrozenConfig:
    scale: float
    shift: float


class TupleConfig(NamedTuple):
    scale: float
    shift: float


def test_a_mutable_object_argument_runs_the_original_with_one_warning():
    model, x = Scaled(), _randn(3, 11)
    fused = autofuser.fuse(model, progress=False)
    cfg = Config(2.0, 1.0)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"argument 's'.*Config.*frozen dataclass") as record:
        torch.testing.assert_close(fused(x, cfg), model(x, cfg))
        cfg.scale = 5.0
        torch.testing.assert_close(fused(x, cfg), model(x, cfg))
    assert len([w for w in record if "can't be guarded" in str(w.message)]) == 1


@pytest.mark.parametrize("kind", [FrozenConfig, TupleConfig])
def test_a_frozen_dataclass_or_named_tuple_argument_fuses_per_value(kind):
    model, x = Scaled(), _randn(3, 11)
    fused = _fused(model, x, kind(2.0, 1.0))
    with torch.no_grad():
        torch.testing.assert_close(fused(x, kind(5.0, 1.0)), model(x, kind(5.0, 1.0)), **TOLERANCE)
        torch.testing.assert_close(fused(x, kind(2.0, 1.0)), model(x, kind(2.0, 1.0)), **TOLERANCE)
    assert len(fused.reports()) == 2


class Signed(torch.nn.Module):
    def forward(self, x, s):
        sign = math.copysign(1.0, s)  # tells -0.0 from 0.0
        return torch.sigmoid(x) * sign + (0.0 if math.isnan(s) else s)


def test_a_nan_argument_compiles_once_and_minus_zero_is_not_zero():
    model, x = Signed(), _randn(1, 7)
    fused = _fused(model, x, float("nan"))
    with torch.no_grad():
        fused(x, float("nan"))
        assert len(fused.reports()) == 1
        for s in (0.0, -0.0):
            torch.testing.assert_close(fused(x, s), model(x, s), **TOLERANCE)
    assert len(fused.reports()) == 3


# ---------------------------------------------------------------------------
# Saving and loading with plugins given as modules or objects
# ---------------------------------------------------------------------------


class Erf(torch.nn.Module):
    def forward(self, x):
        return torch.trunc(x * 7.0 + 1) * 2


def _lower_trunc(ctx, x, *, out=None):
    if out is not None:
        ctx.refuse("out_argument", "trunc(out=...) writes into a caller's tensor")
    return ctx.pointwise("tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))", x)


def _trunc_spec(plugin: str) -> LoweringSpec:
    return LoweringSpec(
        name=f"{plugin}.trunc",
        description="the error function",
        targets=(torch.trunc,),
        kind="pointwise",
        lower=_lower_trunc,
        references=(torch.trunc,),
        samples=lambda dtype: [Sample(args=(torch.randn(3, 37).to(dtype),))],
    )


def autofuser_register_lowerings(register):
    """This test module is itself a plugin module: it lowers trunc."""
    register(_trunc_spec("guardmodule"))


class ErfPlugin:
    """A plugin given as an object of an importable class."""

    def autofuser_register_lowerings(self, register):
        register(_trunc_spec("guardobject"))


@pytest.mark.parametrize("plugin", ["module", "object"])
def test_a_fused_model_with_a_module_or_object_plugin_saves_and_loads(plugin, tmp_path):
    given = sys.modules[__name__] if plugin == "module" else ErfPlugin()
    model, x = Erf(), _randn(5, 9)
    fused = _fused(model, x, plugins=["elementwise", given])
    torch.save(fused, tmp_path / "fused.pt")
    loaded = torch.load(tmp_path / "fused.pt", weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), **TOLERANCE)
    assert f"guard{plugin}.trunc" in [op for group in loaded.report().fused for op in group.ops]


def test_saving_refuses_plugins_another_process_could_not_load(tmp_path):
    class Local:
        def autofuser_register_lowerings(self, register):
            register(_trunc_spec("local"))

    throwaway = types.ModuleType("throwaway")
    throwaway.autofuser_register_lowerings = lambda register: register(_trunc_spec("throwaway"))
    for given, fix in ((throwaway, "importable module"), (Local(), "top level of an importable module")):
        fused = autofuser.fuse(Erf(), plugins=["elementwise", given], progress=False)
        with pytest.raises(autofuser.AutoFuserError, match=f"can't save this FusedModule.*{fix}"):
            torch.save(fused, tmp_path / "fused.pt")


# ---------------------------------------------------------------------------
# The wrapper's attributes
# ---------------------------------------------------------------------------


def test_attribute_reads_fall_through_to_the_model():
    model = Net()
    fused = _fused(model, _randn(2, 13))
    assert fused.fc is model.fc and fused.temperature == 1.0
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        fused.nope
    with pytest.raises(AttributeError, match="fused.model._private"):
        fused._private
    with pytest.raises(AttributeError, match="set fused.model.temperature"):
        fused.temperature = 0.5
    for twin in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert isinstance(twin.fc, torch.nn.Linear) and twin.fc is not model.fc
        _same_as_eager(twin, twin.model, 2, 13)


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value, allowed",
    [
        ("tune", "yes", "True or False"),
        ("verify_speed", 1, "True or False"),
        ("max_signatures", "8", "an int"),
        ("tune_budget_s", "5", "a number"),
    ],
)
def test_options_of_the_wrong_type_are_refused(option, value, allowed):
    with pytest.raises(autofuser.AutoFuserError) as caught:
        autofuser.fuse(Net(), **{option: value})
    assert f"{option}={value!r}" in str(caught.value) and allowed in str(caught.value)


def test_an_int_is_a_number_of_seconds():
    assert autofuser.fuse(Net(), tune_budget_s=5, progress=False)._options.tune_budget_s == 5.0


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64)
        self.fc2 = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("key", ["include", "exclude"])
def test_a_quantize_pattern_matching_no_module_is_refused(key):
    with pytest.raises(autofuser.AutoFuserError, match=rf"{key} pattern 'nope' matches no module.*fc1, fc2"):
        autofuser.fuse(TwoLayers(), quantize={"format": "mxint8", key: ["nope"]}, progress=False)


def test_a_compile_that_fails_inside_autofuser_runs_the_model_once_warned_and_is_not_retried(monkeypatch):
    import autofuser_core.fuse as fuse_module

    calls = []

    def broken_compile(*args, **kwargs):
        calls.append(1)
        raise IndexError("planted fault in the compiler")

    monkeypatch.setattr(fuse_module, "compile_graph", broken_compile)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.GELU())
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(3, 13)
    with pytest.warns(autofuser.CompileFailedWarning, match="IndexError: planted fault"):
        got = fused(x)
    torch.testing.assert_close(got, model(x))
    y = torch.randn(3, 13)
    torch.testing.assert_close(fused(y), model(y))
    assert len(calls) == 1
    assert any("compiling failed" in note for note in fused.report().notes)
