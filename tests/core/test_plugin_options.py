"""Plugin-owned ``fuse()`` options (``autofuser_register_options``) and the
device-limits helper (``autofuser.device_limits``).

The plugin here is a throwaway module, the way a third party writes one: it
registers one option and a strategy that records what its ``view.options`` says.
"""

from __future__ import annotations

import io
import pickle
import zlib

import pytest
import torch
from pydantic import Field

import autofuser
from autofuser import AutoFuserError, SpecError
from autofuser_core.fuse import FuseOptions
from autofuser_plugins.elementwise.strategy import ELEMENTWISE_STRATEGY

from _helpers import plugin_module


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class GeluTanh(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(torch.nn.functional.gelu(x) * 1.5)


def recording_plugin(seen: list):
    """A plugin owning ``chunk_rows`` (an int, default 64) whose strategy records it."""

    def propose(view):
        seen.append(getattr(view.options, "chunk_rows", None))
        return []  # the elementwise strategy fuses; this one only looks

    def autofuser_register_options(register):
        register(chunk_rows=(int, Field(64, ge=1, strict=True, description="Rows a program takes.")))

    def autofuser_register_strategies(register):
        register(ELEMENTWISE_STRATEGY.model_copy(update={"name": "recording", "propose": propose}))

    return plugin_module(
        "chunky",
        autofuser_register_options=autofuser_register_options,
        autofuser_register_strategies=autofuser_register_strategies,
    )


def run(plugin, **options):
    fused = autofuser.fuse(GeluTanh(), plugins=["elementwise", plugin], progress=False, **options)
    x = torch.randn(37, 123)
    torch.testing.assert_close(fused(x), GeluTanh()(x), atol=1e-5, rtol=1e-4)
    return fused


def test_the_strategy_sees_the_option_given_to_fuse():
    seen: list = []
    fused = run(recording_plugin(seen), chunk_rows=96)
    assert seen and set(seen) == {96}
    assert fused._options.chunk_rows == 96
    assert fused._options.plugin_options() == {"chunk_rows": ("chunky", 96)}


def test_the_strategy_sees_the_default_when_not_given():
    seen: list = []
    run(recording_plugin(seen))
    assert seen and set(seen) == {64}


@pytest.mark.parametrize("value", ["96", 96.0, True, 0])
def test_an_invalid_value_names_the_option_and_its_plugin(value):
    with pytest.raises(AutoFuserError, match=r"chunk_rows=.*\(an option of plugin 'chunky'\)") as caught:
        autofuser.fuse(GeluTanh(), plugins=["elementwise", recording_plugin([])], chunk_rows=value)
    assert "Known options:" in str(caught.value)


def test_an_unknown_option_lists_the_plugin_options_and_their_owners():
    with pytest.raises(AutoFuserError, match="chunk_row=") as caught:
        autofuser.fuse(GeluTanh(), plugins=["elementwise", recording_plugin([])], chunk_row=8)
    message = str(caught.value)
    assert "chunk_rows (plugin 'chunky')" in message
    assert "max_signatures" in message  # the core's too


def test_a_plugin_option_of_no_loaded_plugin_is_unknown():
    with pytest.raises(AutoFuserError, match="chunk_rows=8"):
        autofuser.fuse(GeluTanh(), plugins=["elementwise"], chunk_rows=8)


def test_reassociate_products_is_the_attention_plugins_and_keeps_its_validation():
    assert "reassociate_products" not in FuseOptions.model_fields
    assert autofuser.fuse(GeluTanh(), progress=False)._options.reassociate_products is False
    fused = autofuser.fuse(GeluTanh(), progress=False, reassociate_products=True)
    assert fused._options.reassociate_products is True
    with pytest.raises(AutoFuserError, match=r"reassociate_products=1 \(int\) \(an option of plugin 'attention'\)"):
        autofuser.fuse(GeluTanh(), reassociate_products=1)


def test_plugin_options_survive_pickling_and_torch_save():
    fused = autofuser.fuse(GeluTanh(), progress=False, reassociate_products=True)
    assert pickle.loads(pickle.dumps(fused._options)) == fused._options
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._options.reassociate_products is True
    x = torch.randn(5, 37)
    torch.testing.assert_close(loaded(x), GeluTanh()(x), atol=1e-5, rtol=1e-4)


def _options_plugin(name, register_with):
    return plugin_module(name, autofuser_register_options=register_with)


@pytest.mark.parametrize(
    "fields, problem",
    [
        (dict(tune=(bool, Field(True, description="clashes"))), "core fuse\\(\\) option"),
        (dict(reassociate_products=(bool, Field(False, description="clashes"))), "already plugin 'attention'"),
        (dict(width=(int, Field(description="no default"))), "has no default"),
        (dict(width=(int, Field(4))), "has no description"),
    ],
)
def test_invalid_option_registrations_fail_when_the_plugin_loads(fields, problem):
    bad = _options_plugin("badopts", lambda register: register(**fields))
    with pytest.raises(SpecError, match=problem) as caught:
        autofuser.load_plugins(["attention", bad])
    assert "badopts" in str(caught.value)


def test_a_non_model_is_refused():
    bad = _options_plugin("notamodel", lambda register: register(dict))
    with pytest.raises(SpecError, match="not a pydantic model class"):
        autofuser.load_plugins([bad])


def test_device_limits_on_the_cpu_are_the_numbers_plans_used_before():
    limits = autofuser.device_limits("cpu")
    assert limits == autofuser.DeviceLimits(
        shared_memory_per_block=200 * 1024, shared_memory_per_block_max=227 * 1024, multiprocessors=132
    )
    assert autofuser.device_limits(torch.device("cpu")) is limits  # cached
    if not torch.cuda.is_available():
        assert autofuser.device_limits() is limits
