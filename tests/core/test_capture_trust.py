"""Capture leaves the user's model, inputs and other threads as they were, and what it
records is what kernels are launched with (``autofuser_core.capture``; the training
case at the end is ``autofuser_core.launch.RecomputeForBackward``).

- a forward assigning to ``self`` (a lazy cache, a stored activation, a counter,
  ``register_buffer``) leaves no proxy behind: every module attribute is as before;
- a model's own error on the example inputs keeps its type;
- other threads' factories, module calls and grad-mode switches are untouched while
  a capture runs, and two threads capturing at once both get eager's results;
- expanded, transposed and sliced inputs fuse, through their real strides;
- parametrized weights (``weight_norm``, ``register_parametrization``) train with
  eager's gradients, in a model and in a deep copy of one, and are not written in
  backward.
"""

from __future__ import annotations

import copy
import io
import threading
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import autofuser
from autofuser_core.capture import capture

FP32 = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def proxies_in(model: nn.Module) -> list[str]:
    """Every attribute (one level into containers) of every module that holds an fx proxy."""
    found = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, set)) else [value]
            if any(isinstance(v, torch.fx.Proxy) for v in values):
                found.append(f"{path}.{name}" if path else name)
    return found


# ---------------------------------------------------------------------------
# Attributes a forward assigns to self
# ---------------------------------------------------------------------------


class RegistersScale(nn.Module):
    """Registers a buffer on its first call (tracing can't: the buffer would be a proxy)."""

    def forward(self, x):
        if "scale" not in self._buffers:
            self.register_buffer("scale", torch.full((x.shape[-1],), 1.5, device=x.device))
        return x * self.scale


class LazyState(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.child = RegistersScale()
        self.calls = 0
        self.seen: list = []

    def forward(self, x):
        if not hasattr(self, "pos"):  # a lazy cache, made on the first call
            self.pos = torch.arange(x.shape[-1], dtype=x.dtype, device=x.device) * 0.1
        y = torch.relu(self.proj(x) + self.pos)
        self.last = y.detach()  # a stored activation
        self.calls += 1
        self.seen.append(y)
        return self.child(y) - 0.25


def attribute_state(model: nn.Module) -> list:
    """Each module's attributes (name and object) and its containers' contents."""
    state = []
    for module in model.modules():
        for name, value in vars(module).items():
            if isinstance(value, dict):
                contents = [(key, id(item)) for key, item in value.items()]
            elif isinstance(value, (list, set)):
                contents = [id(item) for item in value]
            else:
                contents = None
            state.append((id(module), name, id(value), contents))
    return state


@pytest.mark.parametrize("cache", ["absent", "present"])
def test_capture_leaves_every_module_attribute_as_it_was(cache, device):
    model = LazyState(19).eval().to(device)
    x = torch.randn(1, 7, 19, device=device)
    if cache == "present":
        with torch.no_grad():
            model(x)
    before = attribute_state(model)
    gm = capture(model, x)
    assert attribute_state(model) == before
    assert proxies_in(model) == []
    expected = copy.deepcopy(model)(x)
    torch.testing.assert_close(gm(x), expected, **FP32)


def test_a_fused_model_assigning_to_self_still_works_eagerly(device):
    model = LazyState(19).eval().to(device)
    reference = copy.deepcopy(model)
    x = torch.randn(1, 7, 19, device=device)
    fused = autofuser.fuse(model)
    with torch.no_grad():
        first, second = fused(x), fused(x)
        expected = reference(x)
    assert fused.report().fused, fused.report()
    torch.testing.assert_close(first, expected, **FP32)
    torch.testing.assert_close(second, expected, **FP32)
    assert proxies_in(model) == []
    # Capture, verification and (on a GPU) timing ran the forward: none of it stayed on the model.
    assert not hasattr(model, "pos") and not hasattr(model, "last") and model.calls == 0 and model.seen == []
    with torch.no_grad():  # eager makes the cache where it is missing, as without AutoFuser
        torch.testing.assert_close(model(x), expected, **FP32)
    assert isinstance(model.pos, torch.Tensor) and isinstance(model.last, torch.Tensor)
    torch.save(model.state_dict(), io.BytesIO())
    twin = copy.deepcopy(model)
    with torch.no_grad():  # the cache now present: the fused forward reads it, still eager's result
        torch.testing.assert_close(fused(x), twin(x), **FP32)


# ---------------------------------------------------------------------------
# The model's own errors
# ---------------------------------------------------------------------------


class PicksByBatch(nn.Module):
    def forward(self, x):
        factor = [1.0, 2.0, 3.0][x.shape[0]]  # IndexError from batch 3 on
        return x * factor


class Wraps(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = PicksByBatch()

    def forward(self, x):
        return torch.relu(self.inner(x)) + 1


@pytest.mark.parametrize("make", [PicksByBatch, Wraps])
def test_the_models_own_error_keeps_its_type(make):
    x = torch.randn(5, 6)
    with pytest.raises(IndexError, match="list index out of range"):
        capture(make(), x)
    with pytest.raises(IndexError):
        autofuser.fuse(make())(x)


# ---------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------


def test_other_threads_see_plain_torch_while_a_capture_traces(device):
    """The traced forward pauses mid-trace until another thread has used torch's factories,
    a module and no_grad: each must act as always, not record into the trace."""
    in_trace, checked, done = threading.Event(), threading.Event(), threading.Event()
    layer = nn.Linear(4, 3)

    class PausesInTrace(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(23)

        def forward(self, x):
            if isinstance(x, torch.fx.Proxy) and not in_trace.is_set():
                in_trace.set()
                checked.wait(timeout=60)
            shift = torch.zeros(x.shape[-1], device=x.device) + torch.arange(x.shape[-1], device=x.device) * 0.1
            return torch.relu(self.norm(x) + shift)

    seen, errors = [], []

    def use_torch():
        results = {
            "zeros": (torch.zeros(3), [0.0] * 3),
            "ones": (torch.ones(2), [1.0] * 2),
            "arange": (torch.arange(4), [0, 1, 2, 3]),
            "full": (torch.full((2,), 7.0), [7.0] * 2),
            "empty": (torch.empty(2).fill_(5.0), [5.0] * 2),
            "eye": (torch.eye(2).flatten(), [1.0, 0.0, 0.0, 1.0]),
            "zeros_like": (torch.zeros_like(torch.ones(2)), [0.0] * 2),
            "randn": (torch.randn(3) * 0, [0.0] * 3),
        }
        with torch.no_grad():
            out = layer(torch.ones(1, 4))
        with torch.enable_grad():
            grad_on = torch.is_grad_enabled()
        for name, (value, expected) in results.items():
            if type(value) is not torch.Tensor or value.tolist() != expected:
                errors.append(f"{name} gave {value!r}")
        if type(out) is not torch.Tensor or out.requires_grad or not grad_on:
            errors.append(f"the module call gave {out!r}, grad mode {grad_on}")
        if torch.fx._symbolic_trace.is_fx_tracing():
            errors.append("fx reports tracing in a thread that isn't")

    def other_thread():
        try:
            if not in_trace.wait(timeout=60):
                errors.append("the capture never traced")
            use_torch()  # in the middle of the trace
            checked.set()
            while not done.is_set():  # and all through the rest of the compile and the calls
                use_torch()
                seen.append(1)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(repr(exc))
        finally:
            checked.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        model = PausesInTrace().eval().to(device)
        x = torch.randn(3, 5, 23, device=device)
        fused = autofuser.fuse(model)
        with torch.no_grad():
            got = fused(x)
            expected = model(x)
    finally:
        done.set()
        worker.join(timeout=60)
    assert errors == []
    assert seen, "the other thread never ran during the compile"
    assert fused.report().fused
    torch.testing.assert_close(got, expected, **FP32)


class Chain(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return F.gelu(self.norm(x) * 2 + torch.ones(x.shape[-1], device=x.device))


def test_two_threads_fusing_their_own_models_both_get_eager_results(device):
    widths = (29, 37)
    models = [Chain(w).eval().to(device) for w in widths]
    inputs = [torch.randn(3, w, device=device) for w in widths]
    start = threading.Barrier(len(models))
    results: dict = {}

    def compile_and_call(i):
        try:
            fused = autofuser.fuse(models[i])
            start.wait(timeout=60)
            with torch.no_grad():
                results[i] = (fused(inputs[i]), fused.report())
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=compile_and_call, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, model in enumerate(models):
        assert not isinstance(results[i], Exception), results[i]
        got, report = results[i]
        assert report.fused, report
        with torch.no_grad():
            torch.testing.assert_close(got, model(inputs[i]), **FP32)


# ---------------------------------------------------------------------------
# Inputs that aren't contiguous
# ---------------------------------------------------------------------------

LAYOUTS = {
    "expanded_rows": lambda device: torch.randn(1, 48, device=device).expand(203, 48),  # stride 0 on the row dim
    "transposed": lambda device: torch.randn(48, 37, device=device).t(),
    "every_other_column": lambda device: torch.randn(37, 96, device=device)[:, ::2],
    "expanded_middle": lambda device: torch.randn(3, 1, 48, device=device).expand(3, 29, 48),
}


class Elementwise(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x * 1.5 - 0.5) * x


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x * 2.0, dim=-1) + 1


class LayerNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(48)

    def forward(self, x):
        return torch.relu(self.norm(x))


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(48, 24)

    def forward(self, x):
        return F.gelu(self.proj(x))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("make", [Elementwise, Softmax, LayerNormed, Linear])
def test_inputs_that_arent_contiguous_fuse_through_their_strides(make, layout, device):
    model = make().eval().to(device)
    x = LAYOUTS[layout](device)
    assert not x.is_contiguous()
    gm = capture(model, x)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert tuple(placeholder.meta["tensor_meta"].stride) == x.stride()
    fused = autofuser.fuse(model)
    with torch.no_grad():
        got = fused(x)
        expected = model(x)
    assert fused.report().fused, fused.report()
    torch.testing.assert_close(got, expected, **FP32)


# ---------------------------------------------------------------------------
# Training a parametrized layer
# ---------------------------------------------------------------------------


class Symmetric(nn.Module):
    def forward(self, weight):
        return weight.triu() + weight.triu(1).transpose(-1, -2)


class Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        self.normed = weight_norm(nn.Linear(24, 20))
        self.symmetric = nn.Linear(20, 20)
        parametrize.register_parametrization(self.symmetric, "weight", Symmetric())

    def forward(self, x):
        h = torch.tanh(self.normed(torch.relu(x)) * 2)
        return torch.sigmoid(self.symmetric(h)) - 0.5


@pytest.mark.parametrize("fuse_a_copy", [False, True])
def test_parametrized_weights_train_with_eagers_gradients(fuse_a_copy, device):
    # A deep copy shares its parametrized class, and so the key of parametrize's cache, with
    # the module it was copied from: substituting through that cache gave the copy's
    # originals no gradient.
    reference = Parametrized().train().to(device)
    model = copy.deepcopy(reference)
    if not fuse_a_copy:
        model, reference = reference, model
    fused = autofuser.fuse(model)
    step = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_step = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):  # a second step: the originals must still be the ones the optimiser holds
        x = torch.randn(7, 24, device=device)
        x_fused, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        held = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
        fused(x_fused).square().sum().backward()
        reference(x_eager).square().sum().backward()
        for name, p in model.named_parameters():  # backward wrote none of them
            assert p.data_ptr() == held[name][0] and torch.equal(p.detach(), held[name][1]), name
        got = {name: p.grad for name, p in model.named_parameters()}
        expected = {name: p.grad for name, p in reference.named_parameters()}
        assert "normed.parametrizations.weight.original0" in got and "symmetric.parametrizations.weight.original" in got
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(x_fused.grad, x_eager.grad, atol=1e-6, rtol=1e-5)
        step.step(), reference_step.step()
        step.zero_grad(), reference_step.zero_grad()
    assert fused.report().fused, fused.report()
