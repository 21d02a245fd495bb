"""Helpers several test files share: a plugin built in a test, a small fused model
for cache tests, and tuning as on a GPU with a stand-in timer."""

from __future__ import annotations

import types

import torch


def plugin_module(name: str, **hooks) -> types.ModuleType:
    """A plugin as a third party writes one: a module named ``name`` with ``hooks``."""
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, function)
    return module


class NormGelu(torch.nn.Module):
    """One row-reduction group with a transposed output: a kernel worth tuning."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(37)

    def forward(self, x):
        return torch.nn.functional.gelu(self.ln(x * 2 + 1)).transpose(1, 2) * 3


def stand_in_tuning(monkeypatch) -> list:
    """Tuning as on a GPU, with a stand-in timer; returns the list of timed launches."""
    import autofuser_core.compile as compile_module

    timed = []

    def bench(fn, *args, **timing):
        timed.append(fn)
        return 1.0 + (0.1 * len(timed)) % 0.7  # configs differ, so a winner is picked

    monkeypatch.setattr(compile_module, "_can_tune", lambda device, options: options.tune)
    monkeypatch.setattr(compile_module, "_bench", bench)
    return timed
