"""Helpers several test files share: a plugin built in a test, a small fused model
for cache tests, tuning as on a GPU with a stand-in timer, a fused model checked
against eager (its output, its one fused group, a few training steps), and the
scripts of ``benchmarks/`` imported as modules."""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import types
from pathlib import Path
from typing import Any, Iterator

import torch

import autofuser
from autofuser_core.specs import DEFAULT_TOLERANCES
from autofuser_core.timing import Timer

#: The benchmark scripts' folder.
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_scripts(*names: str) -> Iterator[Any]:
    """The scripts ``names`` of ``benchmarks/`` imported as modules (one name: the module;
    more: {name: module}), with ``benchmarks/`` on ``sys.path`` meanwhile: the scripts import
    each other, and processes they spawn import them by name."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        modules = {name: importlib.import_module(name) for name in names}
        yield modules[names[0]] if len(names) == 1 else modules
    finally:
        sys.path.remove(str(BENCHMARKS))


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


class StandInTimer(Timer):
    """Tuning as on a GPU on any device, with a stand-in clock (``timing.using``, or the
    ``use_timer`` and ``stand_in_timer`` fixtures). Each measurement's callable is kept in
    ``timed``; ``bench(fn, *args)`` gives its milliseconds (by default 1.0 and up,
    different from one launch to the next, so a winner is picked). ``tune``/``time``:
    whether configs are tuned (where ``options.tune``) and groups timed against eager
    (where ``options.verify_speed``). ``forward``: where given, whole forwards are timed
    on any device, ``forward(fn)`` ms a call of ``fn``, each timed forward kept in
    ``forwards`` (it runs once, as a real measurement runs it; one call is queued in no
    time); else whole forwards are timed as the GPU's ``Timer`` times them. ``in_use``:
    where given, training steps in use are timed on any device (``in_use(fused)`` ms a
    call of the fused model or the original). ``graph``: where given, groups (with their
    backward, in training) are timed as captured CUDA graphs on any device (``graph(fn)`` ms a replay of
    ``fn``, or None: not capturable), each kept in ``graphed``; else as the GPU's ``Timer``
    does (never on a CPU)."""

    def __init__(self, bench=None, tune: bool = True, time: bool = False, forward=None, in_use=None, graph=None):
        self.timed: list = []
        self._graph, self.graphed = graph, []
        self.forwards: list = []
        self._ms, self._tune, self._time, self._forward = bench, tune, time, forward
        # in_use(fused): ms of one call of a training step in use, as the user calls it; each
        # mark's runner (True: fused) in ``marks``.
        self._in_use, self.marks = in_use, []

    def bench(self, fn, *args, rep_ms: float = 20) -> float:
        self.timed.append(fn)
        if self._ms is not None:
            return self._ms(fn, *args)
        return 1.0 + (0.1 * len(self.timed)) % 0.7

    def graph_ms(self, fn, *args, rep_ms: float = 20):
        if self._graph is None:
            return super().graph_ms(fn, *args, rep_ms=rep_ms)
        self.graphed.append(fn)
        return self._graph(fn)

    def can_tune(self, device, options) -> bool:
        return self._tune and options.tune

    def can_time(self, device, options) -> bool:
        return self._time and options.verify_speed

    def forward_ms(self, fn, args, once_ms=None) -> float:
        if self._forward is None:
            return super().forward_ms(fn, args, once_ms)
        self.forwards.append(fn)
        fn(*args)
        return self._forward(fn)

    def forward_once_ms(self, fn, args) -> tuple[float, float]:
        if self._forward is None:
            return super().forward_once_ms(fn, args)
        return 0.0, self.forward_ms(fn, args)

    def can_time_forward(self, device) -> bool:
        return self._forward is not None or super().can_time_forward(device)

    def can_time_in_use(self, device) -> bool:
        return self._in_use is not None

    def mark(self, device, fused: bool) -> int:
        self.marks.append(fused)
        return len(self.marks) - 1

    def between_ms(self, start: int, end: int) -> float:
        return sum(self._in_use(fused) for fused in self.marks[start:end])


def stand_in_timer_by_kernel(use_timer, kernel_ms):
    """Time groups as on a GPU by a stand-in (``use_timer``, the fixture): a kernel takes
    ``kernel_ms(layout, normed)`` ms (its source's layout; whether its ops include a layer
    norm), every eager group 1 ms. Configs are not tuned."""

    def bench(fn, *args):
        kernel = getattr(fn, "__self__", None)
        if kernel is None:
            return 1.0
        called = [
            kernel.eager.get_submodule(n.target) if n.op == "call_module" else n.target
            for n in kernel.eager.graph.nodes
        ]
        normed = any("norm" in (type(c).__name__ if isinstance(c, torch.nn.Module) else str(c)).lower() for c in called)
        return kernel_ms(kernel.source.layout, normed)

    use_timer(StandInTimer(bench, tune=False, time=True))


def fuse_and_compare(model, *inputs):
    """The fused model's output against eager's; returns the report."""
    with torch.no_grad():
        expected = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tol = DEFAULT_TOLERANCES[str(expected.dtype).removeprefix("torch.")]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol.atol, rtol=tol.rtol)
    return fused.report()


def one_group_with(report, *ops):
    """The report's only fused group, which must hold ``ops``."""
    assert len(report.fused) == 1, f"expected one fused group:\n{report}"
    group = report.fused[0]
    assert all(op in group.ops for op in ops), f"{ops} not all in {group.ops}:\n{report}"
    return group


def trains_like_eager(model, *inputs, steps: int = 3):
    """A few SGD steps of the fused model and of a copy of ``model`` in eager give the same
    losses, input gradients and parameters."""
    eager = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    weights = None
    for _ in range(steps):
        results = []
        for net in (fused, eager):
            leaves = [x.detach().requires_grad_() for x in inputs]
            out = net(*leaves)
            if weights is None:
                weights = torch.randn(out.shape)
            loss = (out * weights).sum()
            loss.backward()
            results.append((loss.detach(), [x.grad for x in leaves]))
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        (loss_f, grads_f), (loss_e, grads_e) = results
        torch.testing.assert_close(loss_f, loss_e, atol=1e-4, rtol=1e-4)
        for ours, theirs in zip(grads_f, grads_e):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    report = fused.report()
    assert report.fused, str(report)
    return report


def lock_is_free(path) -> bool:
    """Whether no process holds the ``flock`` on the file at ``path``."""
    import fcntl

    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def reference_path_only(monkeypatch, module, references, kernels_module, kernels) -> list[str]:
    """Spy on ``module``'s torch-ops ``references`` (the names of those called, in order, go
    into the returned list) and make ``kernels_module``'s ``kernels`` raise: a test of an
    operator's path on a CPU without Triton sees that path, and only it, run. The caller
    turns its module's Triton switch off."""
    calls: list[str] = []

    def spy(function):
        def called(*args):
            calls.append(function.__name__)
            return function(*args)

        return called

    def no_kernel(*args):
        raise AssertionError("a kernel ran where the reference should")

    for name in references:
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    for name in kernels:
        monkeypatch.setattr(kernels_module, name, no_kernel)
    return calls
