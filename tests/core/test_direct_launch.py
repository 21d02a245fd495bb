"""``DirectLaunch``: a compiled kernel launched without Triton's per-call binding, only
for calls Triton would send to that same kernel. A stand-in compiled kernel records
what it is called with (the real launch is checked on a GPU in ``test_cuda.py``)."""

from __future__ import annotations

import contextlib
import gc
import inspect
import types
import weakref

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from autofuser_core.launch import DirectLaunch


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


def _params(*names):
    return [types.SimpleNamespace(name=n) for n in names]


@pytest.fixture
def on_device_0(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stream = types.SimpleNamespace(get_current_stream=lambda device: 1234)
    monkeypatch.setattr("autofuser_core.launch.driver", types.SimpleNamespace(active=stream))


def _direct(args, launch_args=None, grid=(7,)):
    kernel = types.SimpleNamespace(params=_params("in0", "scale", "out0", "BLOCK_M", "BLOCK_N"))
    compiled = _Compiled()
    launch_args = launch_args or {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4}
    return DirectLaunch.of(kernel, compiled, args, launch_args, grid), compiled


def test_a_call_like_the_compiled_one_launches_every_argument_in_order(on_device_0):
    x, out = torch.randn(5, 3), torch.empty(5, 3)
    direct, compiled = _direct((x, 2.5, out))
    x2, out2 = torch.randn(5, 3), torch.empty(5, 3)
    values = direct.values((x2, 2.5, out2))
    assert values is not None
    direct.launch(values)
    (call,) = compiled.calls
    assert call[:7] == (7, 1, 1, 1234, "function", "metadata", None)
    assert call[7:9] == (None, None)  # no launch hooks
    assert call[9] is x2 and call[10] == 2.5 and call[11] is out2 and call[12:] == (16, 32)


def test_calls_triton_would_send_elsewhere_are_not_direct(on_device_0, monkeypatch):
    storage = torch.randn(64)
    x, out = storage[:15].view(5, 3), torch.empty(5, 3)
    assert x.data_ptr() % 16 == 0
    direct, _ = _direct((x, 2.5, out))
    assert direct.values((storage[1:16].view(5, 3), 2.5, out)) is None  # 4 bytes off: another specialisation
    assert direct.values((x.to(torch.float64), 2.5, out)) is None  # another dtype: another kernel
    assert direct.values((x, 3.5, out)) is None  # another scalar
    assert direct.values((x, 2, out)) is None  # an int where it was compiled for a float
    assert direct.values((x, out)) is None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert direct.values((x, 2.5, out)) is None  # another device's kernel


def test_it_keeps_no_tensor_of_the_call_that_made_it(on_device_0):
    """The first launch is the compile's check on copies of a group's inputs: holding them
    would keep every group's boundary values alive as long as the fused module."""
    x, out = torch.randn(5, 3), torch.empty(5, 3)
    direct, _ = _direct((x, 2.5, out))
    alive = [weakref.ref(x), weakref.ref(out)]
    del x, out
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    assert direct.values((torch.randn(5, 3), 2.5, torch.empty(5, 3))) is not None


@contextlib.contextmanager
def _launch_hook():
    """A profiler's launch hook set for the block: a function, or added to Triton's chain of
    them where this Triton has one."""
    hook = lambda metadata: None  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            yield
        finally:
            chain.remove(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
        try:
            yield
        finally:
            knobs.runtime.launch_enter_hook = chain


def test_a_launch_hook_sends_every_call_through_triton(on_device_0):
    x, out = torch.randn(5, 3), torch.empty(5, 3)
    direct, _ = _direct((x, 2.5, out))
    with _launch_hook():
        assert direct.values((x, 2.5, out)) is None
        assert _direct((x, 2.5, out))[0] is None
    assert direct.values((x, 2.5, out)) is not None


def _kernel_shape(in0, scale, out0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A generated kernel's signature: tensors and a scalar, then its block sizes."""


def test_with_the_installed_tritons_own_parameters_it_passes_what_triton_binds(on_device_0):
    """Built on a real ``JITFunction`` of this Triton (its ``params``), the arguments of a
    direct launch are Triton's bound arguments: every parameter in signature order, the
    block sizes included."""
    kernel = JITFunction(_kernel_shape)
    x, out = torch.randn(5, 3), torch.empty(5, 3)
    launch_args = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    direct = DirectLaunch.of(kernel, _Compiled(), (x, 2.5, out), launch_args, (7,))
    assert direct is not None
    bound = inspect.signature(_kernel_shape).bind(x, 2.5, out, BLOCK_M=16, BLOCK_N=32)
    values = direct.values((x, 2.5, out))
    assert len(values) == len(bound.arguments)
    assert all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(values, bound.arguments.values()))
    assert values[3:] == [16, 32]


def test_kernels_it_cannot_serve_get_none(on_device_0):
    x, out = torch.randn(5, 3), torch.empty(5, 3)
    assert _direct((x, out))[0] is None  # a parameter left to its default
    assert _direct((x, 2.5, out, 1))[0] is None  # more arguments than parameters
    assert _direct((x, 2.5, out), grid=lambda meta: (1,))[0] is None
    kernel = types.SimpleNamespace(params=_params("in0", "scale", "out0", "BLOCK_M", "BLOCK_N"))
    assert DirectLaunch.of(kernel, object(), (x, 2.5, out), {"BLOCK_M": 1, "BLOCK_N": 1}, (1,)) is None
