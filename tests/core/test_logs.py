"""Tests of autofuser_core.logs: ``AUTOFUSER_LOG`` parsed as ``TORCH_LOGS`` is, and the
``AUTOFUSER_DISABLE`` off switch (the fused module runs the original, nothing compiles)."""

from __future__ import annotations

import logging

import pytest
import torch

import autofuser
from autofuser_core import fuse as fuse_module
from autofuser_core import logs
from autofuser_core.errors import AutoFuserError


def test_log_settings_follow_torch_logs_prefixes():
    levels = logs.parse_log_settings("+plan, tune,-cache")
    assert levels == {"autofuser.plan": logging.DEBUG, "autofuser.tune": logging.INFO, "autofuser.cache": logging.ERROR}
    everything = logs.parse_log_settings("+all,-verify")
    assert set(everything) == {f"autofuser.{c}" for c in logs.COMPONENTS}
    assert everything["autofuser.verify"] == logging.ERROR and everything["autofuser.plan"] == logging.DEBUG
    assert logs.parse_log_settings("") == {}


@pytest.mark.parametrize("bad", ["planner", "+plan,tunning", "++plan", "plan;tune"])
def test_a_bad_log_setting_names_the_entry_and_the_components(bad):
    with pytest.raises(AutoFuserError, match=r"AUTOFUSER_LOG=.*is not a component.*capture, plan, tune"):
        logs.parse_log_settings(bad)


def test_log_setting_applies_to_the_component_loggers(monkeypatch):
    monkeypatch.setenv("AUTOFUSER_LOG", "+plan")
    try:
        logs.configure_from_env()
        assert logging.getLogger("autofuser.plan").getEffectiveLevel() == logging.DEBUG
        assert logging.getLogger("autofuser.tune").level == logging.NOTSET
        assert logs._installed is not None and logs._installed[0] in logging.getLogger("autofuser").handlers
        monkeypatch.setenv("AUTOFUSER_LOG", "nonsense")
        with pytest.raises(AutoFuserError, match="'nonsense' is not a component"):
            autofuser.fuse(torch.nn.Linear(3, 3))
    finally:
        monkeypatch.delenv("AUTOFUSER_LOG")
        logs.configure_from_env()
    assert logs._installed is None and logging.getLogger("autofuser.plan").level == logging.NOTSET
    assert logging.getLogger("autofuser").propagate


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(13)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(x)) * 2 + 1


def test_off_switch_runs_the_original_and_compiles_nothing(monkeypatch):
    monkeypatch.setenv("AUTOFUSER_DISABLE", "1")

    def no_compile(*args, **kwargs):
        raise AssertionError("AUTOFUSER_DISABLE=1 must compile nothing")

    monkeypatch.setattr(fuse_module, "capture", no_compile)
    monkeypatch.setattr(fuse_module, "compile_graph", no_compile)
    torch.manual_seed(0)
    model = Small().eval()
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(module))
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction"], progress=False)
    x = torch.randn(1, 7, 13)
    with torch.no_grad():
        got = fused(x)
    assert calls == [model]  # the model itself ran, hooks and all
    torch.testing.assert_close(got, Small.forward(model, x), rtol=0, atol=0)
    assert fused.kernels() == [] and "AUTOFUSER_DISABLE" in fused.report().notes[0]


def test_off_switch_refuses_a_value_that_is_neither_on_nor_off(monkeypatch):
    monkeypatch.setenv("AUTOFUSER_DISABLE", "maybe")
    with pytest.raises(AutoFuserError, match=r"AUTOFUSER_DISABLE='maybe' is neither on nor off: set it to 1"):
        autofuser.fuse(Small())
    monkeypatch.setenv("AUTOFUSER_DISABLE", "0")
    assert not autofuser.fuse(Small(), plugins=["elementwise"])._disabled
