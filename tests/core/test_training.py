"""Training through a fused model (``autofuser_core.launch.RecomputeForBackward``
and the grad-mode rules of ``autofuser_core.compile``).

With gradients on, every fused group runs its kernel forward and recomputes
its original ops for backward. These tests train fused and eager copies of the
same models side by side and require the same losses, gradients and weights,
with the optimiser acting on parameters the fused module shares with the model,
and with no recompilation after optimiser steps.
"""

from __future__ import annotations

import copy
import functools
import gc
import operator
import re
import weakref
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser.zoo import airfoil
from autofuser.zoo.models import MESHES, MODELS

from _models import FeedForward

FP32 = dict(atol=1e-5, rtol=1e-4)
BF16 = dict(atol=2e-2, rtol=4e-2)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def autograd_nodes(tensor: torch.Tensor) -> set[str]:
    """Names of every autograd node ``tensor``'s backward would run."""
    seen, names, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], scaled: bool = False) -> None:
    """Each tensor within fp32 tolerance; ``scaled``: the absolute part relative to the
    tensor's largest entry (gradients summed over a batch cancel to ~0 in places)."""
    assert list(got) == list(expected)
    for name, value in got.items():
        atol = FP32["atol"] * max(1.0, float(expected[name].abs().max())) if scaled else FP32["atol"]
        torch.testing.assert_close(value, expected[name], atol=atol, rtol=FP32["rtol"], msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------
# Reproducibility: fuse() leaves the random stream alone
# ---------------------------------------------------------------------------


class DrawsWhenRegistering:
    """A plugin that builds a module (and so draws random numbers) when it loads,
    as a plugin building sample modules at import does."""

    @staticmethod
    def autofuser_register_lowerings(register):
        nn.Linear(3, 3)


def test_fusing_does_not_move_the_random_stream():
    model = FeedForward(width=29, hidden=45)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    autofuser.fuse(model, plugins=["elementwise", DrawsWhenRegistering()], progress=False)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Zoo models: a few Adam steps, fused vs eager
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["galerkin", "fno", "unet"])
def test_zoo_model_trains_like_eager(name):
    """Three Adam steps, backward through the groups' fused backward graphs: the same
    losses, the same weights within tolerance, and the same gradients where the weights are
    still the same (after that, Adam's normalised steps turn gradient noise of
    entries that cancel to ~0 into lr-sized weight differences, in eager too
    from one summation order to another)."""
    entry, mesh = MODELS[name], MESHES["tiny"]
    model = entry.make("tiny").train()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False)
    coords, target = airfoil.make_dataset(6, 3, mesh)

    def train(module: nn.Module, weights: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
        optimiser = torch.optim.Adam(module.parameters(), lr=3e-3)
        losses, first_gradients = [], {}
        for step in range(3):
            batch = torch.arange(2 * step, 2 * step + 2)
            prediction = entry.as_grid(module(entry.inputs(coords[batch])), mesh)
            loss = airfoil.relative_l2(prediction, target[batch])
            if module is fused:
                assert "RecomputeForBackwardBackward" in autograd_nodes(loss)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            if step == 0:
                first_gradients = {n: p.grad.clone() for n, p in weights.named_parameters()}
            optimiser.step()
            losses.append(loss.item())
        return losses, first_gradients

    expected, expected_gradients = train(reference, reference)
    got, got_gradients = train(fused, model)
    report = fused.report()
    assert len([g for g in report.fused if g.phase == "forward"]) >= 3, str(report)
    if name == "unet":  # its batch norms and activations: the conv plugin's own kernels, backward too
        assert sum("batch_norm_act" in n.target for n in report.unfused_nodes) >= 2, str(report)
    else:
        assert len([g for g in report.fused if g.phase == "backward"]) >= 3, str(report)
    # The backward graphs' compile steps, summed over them: each was traced, planned and verified.
    assert {"trace", "plan", "verify"} <= set(report.backward_phases), report.backward_phases
    assert report.phases["backward"] >= report.backward_phases["trace"] > 0
    assert len(fused.reports()) == 1  # one compilation: optimiser steps don't invalidate it
    assert got[0] != got[-1]  # it did learn something
    assert_same_tensors(got_gradients, expected_gradients, scaled=True)
    torch.testing.assert_close(got, expected, **FP32)
    for (key, weight), twin in zip(model.named_parameters(), reference.parameters()):
        # Adam's steps are lr-sized (3e-3) whatever the gradient's size: a gradient of the
        # wrong sign or size moves a weight by about that, noise of ~0 gradients by less.
        torch.testing.assert_close(weight, twin, atol=1e-3, rtol=0, msg=lambda m: f"{key}: {m}")


# ---------------------------------------------------------------------------
# Parameters are the model's: an optimiser on either, no recompilation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("optimise", ["fused", "model"])
def test_an_optimiser_on_either_updates_both_without_recompiling(optimise):
    model = FeedForward(width=29, hidden=45)
    fused = autofuser.fuse(model, progress=False)
    assert [id(p) for p in fused.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in model.named_parameters()]
    optimiser = torch.optim.Adam((fused if optimise == "fused" else model).parameters(), lr=1e-2)
    x = torch.randn(1, 7, 29)  # batch 1, odd sizes

    before = None
    for _ in range(3):
        loss = fused(x).square().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        got, expected = fused(x), model(x)  # same signature as training: grad on, train mode
        torch.testing.assert_close(got, expected, **FP32)
        if before is not None:
            assert not torch.allclose(got, before)  # the new weights are used
        before = got.detach()
    assert len(fused.reports()) == 1
    assert [g.ops for g in fused.report().fused]  # the kernels ran, not a fallback
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------------------
# Random ops, in-place writes, BatchNorm in training
# ---------------------------------------------------------------------------


class Unruly(nn.Module):
    """Everything that must keep its place: dropout, in-place activations and
    additions, BatchNorm updating its statistics, and an in-place write into a
    fused group's input after the group (eager's own ops don't need the old
    values; a recomputing backward would)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(13) + 0.5)
        self.lin = nn.Linear(13, 24)
        self.ln = nn.LayerNorm(24)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(24)
        self.out = nn.Linear(24, 5)

    def forward(self, x):
        a = torch.cumsum(x * self.scale, -1)
        b = torch.sigmoid(a) * 3 + 1
        a.mul_(2)
        h = self.act(self.ln(self.lin(a + b.tanh())))
        h = self.bn(self.drop(h) * 2)
        h += 1
        return self.out(F.gelu(h))


def test_random_and_in_place_ops_train_like_eager():
    model = Unruly().train()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(7, 13)

    def train(module: nn.Module) -> list[float]:
        torch.manual_seed(5)  # the same dropout masks
        # SGD, not Adam: weight differences stay proportional to gradient differences.
        optimiser = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for _ in range(3):
            loss = module(x).square().mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        return losses

    expected, got = train(reference), train(fused)
    torch.testing.assert_close(got, expected, **FP32)
    assert_same_tensors(dict(model.named_parameters()), dict(reference.named_parameters()))
    assert_same_tensors(dict(model.named_buffers()), dict(reference.named_buffers()))  # BatchNorm's statistics

    groups = {tuple(g.ops): g for g in fused.report().groups}
    overwritten = groups[("elementwise.sigmoid", "elementwise.mul", "elementwise.add")]
    assert not overwritten.fused and overwritten.reason_code == "overwritten_before_backward"
    assert "mul_" in overwritten.reason
    assert len(fused.report().fused) >= 2

    # Without gradients nothing is recomputed later, so the same group fuses.
    with torch.no_grad():
        fused.eval()
        torch.testing.assert_close(fused(x), model(x), **FP32)
    groups = {tuple(g.ops): g for g in fused.report().groups}
    assert groups[("elementwise.sigmoid", "elementwise.mul", "elementwise.add")].fused


# ---------------------------------------------------------------------------
# Gradients of gradients, autocast
# ---------------------------------------------------------------------------


class Field(nn.Module):
    """u(x) for a physics-informed loss."""

    def __init__(self):
        super().__init__()
        self.lift = nn.Linear(2, 24)
        self.norm = nn.LayerNorm(24)
        self.proj = nn.Linear(24, 1)

    def forward(self, x):
        return self.proj(torch.tanh(self.norm(self.lift(x))))


def test_gradients_of_gradients_match_eager():
    """A physics-informed loss differentiates u with respect to x, then trains on it:
    backward runs through the fused groups' backward (``create_graph=True``)."""
    model = Field()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False)
    points = torch.randn(11, 2)

    def residual_loss(module: nn.Module):
        x = points.clone().requires_grad_()
        u = module(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        loss = du.square().mean() + u.square().mean()
        loss.backward()
        return loss, x.grad

    expected_loss, expected_x_grad = residual_loss(reference)
    got_loss, got_x_grad = residual_loss(fused)
    assert fused.report().fused
    torch.testing.assert_close(got_loss, expected_loss, **FP32)
    torch.testing.assert_close(got_x_grad, expected_x_grad, **FP32)
    for got, expected in zip(model.parameters(), reference.parameters()):
        assert got.grad is not None and got.grad.abs().sum() > 0
        torch.testing.assert_close(got.grad, expected.grad, **FP32)


def test_backward_under_autocast_matches_eager():
    """The recomputation runs under the forward's autocast state, as eager's backward
    uses the dtypes eager's forward chose (here a bf16 product feeds a fused group
    holding an fp32 layer norm and another product)."""
    model = Field()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(3, 17, 2)
    for module in (reference, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
    assert fused.report().fused
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, **BF16)


def test_backward_called_inside_autocast_runs_as_the_forward_ran():
    """A forward in fp32 whose backward() is called inside an autocast region: the fused
    backward runs in the dtypes the forward ran in, not that autocast's. (Eager's own
    backward picks up an autocast around backward() on the CPU, in bf16, so float64 is
    the judge: the fused gradients are fp32-accurate, and no further from it than eager's.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    reference, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(8, 32)
    for module in (reference, fused):
        out = module(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out.square().sum().backward()
    exact(x.double()).square().sum().backward()
    assert fused.report().fused
    for got, eager, judge in zip(model.parameters(), reference.parameters(), exact.parameters()):
        torch.testing.assert_close(got.grad, judge.grad.float(), rtol=1e-4, atol=1e-4)
        assert (got.grad - judge.grad).abs().max() <= (eager.grad - judge.grad).abs().max() + 1e-5


class _DoublesInPlace(nn.Module):
    def forward(self, h):
        if h.sum() > -1e30:  # value-dependent: this module stays opaque
            h.mul_(2)
        return h


class _OpaqueWriter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.doubler = _DoublesInPlace()

    def forward(self, x):
        h = torch.cumsum(self.lin(x), -1)  # cumsum: no lowering, so h is a group's input
        y = torch.tanh(h) * 3 + h  # a fused group reading h, which its backward would recompute from
        self.doubler(h)  # an opaque part writes into h afterwards
        return y + h


def test_an_opaque_part_writing_into_a_groups_input_keeps_that_group_eager_in_training():
    torch.manual_seed(3)
    model = _OpaqueWriter()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(5, 16)
    for module in (reference, fused):
        module(x).square().mean().backward()
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6)
    report = fused.report()
    assert "doubler" in report.opaque, str(report)
    assert any(g.reason_code == "overwritten_before_backward" for g in report.groups), str(report)


# ---------------------------------------------------------------------------
# Never slower with gradients on: each group and the whole step timed with backward
# ---------------------------------------------------------------------------


class _NormChain(nn.Module):
    """A layer norm between pointwise ops, and a residual: groups with a parameter."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(23)

    def forward(self, x):
        return F.gelu(self.ln(x * 1.5 - 0.25)) + x


def _step_timer(use_timer, group_ms, step_ms, in_use_ms=None):
    """Groups and whole steps timed by a stand-in clock: ``group_ms(fused)`` per group
    measurement, ``step_ms(fused)`` per whole-step or whole-forward measurement
    (``fused``: whether it is the fused side), ``in_use_ms(fused)`` per call of a
    training step in use (None: not timed in use)."""
    from _helpers import StandInTimer

    timer = StandInTimer(
        tune=False,
        time=True,
        bench=lambda fn, *args: group_ms(getattr(fn, "fused", False)),
        forward=lambda fn: step_ms(getattr(fn, "fused", isinstance(fn, torch.fx.GraphModule))),
        in_use=in_use_ms,
    )
    return use_timer(timer)


def _train_once(fused, model, x):
    """One forward and backward of each; their gradients must be equal."""
    model.zero_grad()
    fused(x).square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).square().sum().backward()
    assert_same_tensors(got, {n: p.grad for n, p in model.named_parameters()}, scaled=True)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_a_model_that_lost_launched_is_compiled_again_with_groups_timed_launched(tmp_path, use_timer, training):
    """Groups timed as CUDA graphs win there and are kept; but the step or forward does not
    replay (here: a CPU, never captured) and, launched, loses to the original. The signature
    is compiled again with its groups timed launched, where they lose and stay eager, and the
    report says why; the model computes as the original."""
    timer = _graph_wins_timer(use_timer)
    model, x = _NormChain(), torch.randn(3, 5, 23)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    if training:
        _train_once(fused, model, x)
    else:
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x))
    report = fused.report()
    assert timer.graphed, "the first compile timed its groups as graphs"
    assert "groups timed launched, not as CUDA graphs: the fused model did not replay" in str(report)
    timed = [g for g in report.groups if g.time_fused_ms is not None and g.phase == "forward"]
    assert timed and all(not g.timed_in_graph and g.reason_code == "slower" for g in timed), str(report)
    assert len(fused.reports()) == 1


def test_only_a_model_that_did_not_replay_is_compiled_again_launched():
    """A step or forward that replayed as CUDA graphs and lost was timed as it ran: no second
    compile; nor where the fused model runs or no group was timed as a graph."""
    from autofuser_core.fuse import _relaunch
    from autofuser_core.report import FusionReport, GroupEntry

    graphed = GroupEntry(nodes=["a"], ops=["add"], strategy="s", fused=True, reason_code="fused", timed_in_graph=True)
    launched = GroupEntry(nodes=["b"], ops=["add"], strategy="s", fused=True, reason_code="fused")
    report, plain = FusionReport(groups=[graphed]), FusionReport(groups=[launched])
    assert "did not replay" in _relaunch(None, False, report)
    assert _relaunch(None, True, report) is None
    assert _relaunch(object(), False, report) is None
    assert _relaunch(None, False, plain) is None


class _Noisy(_NormChain):
    """``_NormChain`` then dropout (training mode) or added noise (eval mode): random draws."""

    def forward(self, x):
        y = super().forward(x)
        return F.dropout(y, 0.25, True) if self.training else y + 0.01 * torch.randn_like(y)


@pytest.mark.parametrize(
    "case, why",
    [
        ("dropout", "the training step draws random numbers"),
        ("noise", "the forward draws random numbers"),
        ("no grad in training mode", "the forward runs in training mode with gradients off"),
    ],
)
def test_groups_are_timed_launched_where_the_model_never_replays(tmp_path, use_timer, case, why):
    """A step or forward that never replays as CUDA graphs (its runs differ, or its mode is
    never captured) runs its groups launched: they are timed launched, not as graphs, and
    the report says why."""
    timer = _graph_wins_timer(use_timer)
    model, x = (_Noisy() if case != "no grad in training mode" else _NormChain()), torch.randn(3, 5, 23)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    if case == "dropout":
        fused(x.requires_grad_()).square().sum().backward()
    else:
        model.train(case != "noise")
        with torch.no_grad():
            fused(x)
    report = fused.report()
    timed = [g for g in report.groups if g.time_fused_ms is not None and g.phase == "forward"]
    assert timed and not timer.graphed, str(report)
    assert all(not g.timed_in_graph and g.reason_code == "slower" for g in timed), str(report)
    assert f"groups timed launched, not as CUDA graphs: {why}" in str(report)


@pytest.mark.parametrize("x_shape", [(1, 5, 23), (3, 23)])
def test_a_group_slower_with_its_backward_stays_eager_in_training(tmp_path, use_timer, x_shape):
    """With gradients on, a group is timed with its backward on both sides; one whose
    fused forward and backward is slower than eager's stays eager, reason said."""
    timer = _step_timer(use_timer, lambda fused: 2.0 if fused else 1.0, lambda fused: 1.0)
    model, x = _NormChain(), torch.randn(*x_shape)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    _train_once(fused, model, x)
    report = fused.report()
    assert report.groups and not report.fused, str(report)
    timed = [g for g in report.groups if g.time_fused_ms is not None and g.phase == "forward"]
    assert timed and all(g.timed == "forward+backward" and g.reason_code == "slower" for g in timed), str(report)
    backward = [g for g in report.groups if g.phase == "backward"]
    assert backward and all(g.timed == "forward" for g in backward), str(report)  # each backward graph's own groups
    assert "while gradients are on" in timed[0].reason and "f+b" in str(report)
    assert any(isinstance(fn, __import__("autofuser_core.timing").timing.TrainingStep) for fn in timer.timed)


def _fused_side(fn) -> bool:
    """Whether a timed callable is a group's fused side: a training step's, or a kernel's launch."""
    from autofuser_core.launch import FusedKernel

    return getattr(fn, "fused", False) or isinstance(getattr(fn, "__self__", None), FusedKernel)


def _graph_wins_timer(use_timer, capturable: bool = True, whole_fused_ms: float = 1.0):
    """A stand-in timer under which a group's fused side loses launched (2 ms against 1) and
    wins as a CUDA graph (0.5 against 1), its fused side not capturable unless ``capturable``;
    a whole fused step or forward takes ``whole_fused_ms`` against the original's 1."""
    from _helpers import StandInTimer

    def graph(fn):
        if not capturable and _fused_side(fn):
            return None
        return 0.5 if _fused_side(fn) else 1.0

    return use_timer(
        StandInTimer(
            tune=False,
            time=True,
            bench=lambda fn, *args: 2.0 if _fused_side(fn) else 1.0,
            forward=lambda fn: whole_fused_ms if getattr(fn, "fused", isinstance(fn, torch.fx.GraphModule)) else 1.0,
            graph=graph,
        )
    )


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("capturable", [True, False], ids=["captured", "not capturable"])
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "no graphs"])
def test_a_group_is_timed_as_a_cuda_graph_where_the_model_replays_as_one(
    tmp_path, use_timer, cuda_graphs, capturable, training
):
    """A short group's launches can cost the host more than its kernels cost the GPU; in a
    step or forward replayed as CUDA graphs the host pays none of them. So where it may
    replay as graphs, each group (with its backward, in training) is timed captured as one
    graph on both sides; launched where graphs are off or a side can't be captured."""
    timer = _graph_wins_timer(use_timer, capturable, whole_fused_ms=0.5)  # the whole model wins: no second compile
    model, x = _NormChain(), torch.randn(3, 5, 23)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False, cuda_graphs=cuda_graphs)
    if training:
        _train_once(fused, model, x)
    else:
        model.eval()  # a forward replays as a graph only in eval mode
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x))
    report = fused.report()
    timed = [g for g in report.groups if g.time_fused_ms is not None and g.phase == "forward"]
    assert timed, str(report)
    assert "groups timed launched" not in str(report)
    in_graph = cuda_graphs and capturable
    for g in timed:
        assert g.timed == ("forward+backward" if training else "forward"), str(report)
        assert g.timed_in_graph is in_graph, str(report)
        assert (g.time_fused_ms, g.time_eager_ms) == ((0.5, 1.0) if in_graph else (2.0, 1.0))
        assert (g.reason_code == "fused") is in_graph, str(report)
    assert bool(timer.graphed) is cuda_graphs  # asked only where the step may replay as graphs
    if in_graph:
        assert "each as one CUDA graph" in str(report) or not training
    else:
        assert "kept eager for speed" in timed[0].reason


def test_the_whole_training_step_decides_and_its_verdict_is_cached(tmp_path, use_timer):
    """Groups faster on their own, but the whole fused step not faster than the original's:
    the original runs for that signature, and gradients are eager's. A second fused
    module on the same cache reads the verdict instead of timing again; a faster fused
    step keeps the fused graph."""
    timer = _step_timer(use_timer, lambda fused: 0.5 if fused else 1.0, lambda fused: 1.0 if fused else 1.005)
    model, x = _NormChain(), torch.randn(4, 7, 23)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    _train_once(fused, model, x)
    notes = " ".join(fused.report().notes)
    assert fused.report().fused, str(fused.report())
    assert "the fused training step, forward and backward (1.000 ms), was not at least 2% faster" in notes, notes
    assert fused._compiled[next(iter(fused._compiled))][0] is None  # the original runs
    timed = len(timer.forwards)
    assert timed and all(
        isinstance(fn, __import__("autofuser_core.timing").timing.TrainingStep) for fn in timer.forwards
    )

    again = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    _train_once(again, model, x)
    assert len(timer.forwards) == timed, "a warm cache must not time the step again"
    assert "(read from the cache)" in " ".join(again.report().notes)

    _step_timer(use_timer, lambda fused: 0.5 if fused else 1.0, lambda fused: 0.5 if fused else 1.0)
    faster = autofuser.fuse(model, cache_dir=str(tmp_path / "other"), progress=False)
    _train_once(faster, model, x)
    assert "training step, forward and backward: 0.500 ms fused vs 1.000 ms eager" in faster.report().notes
    assert faster._compiled[next(iter(faster._compiled))][0] is not None


# ---------------------------------------------------------------------------
# The training step checked in use (autofuser_core/in_use.py)
# ---------------------------------------------------------------------------


def _train_beside_eager(fused, model, reference, x, steps: int, original_runs: list):
    """``steps`` SGD steps of the fused model and of an eager copy on ``x``; returns, per
    step, whether the fused module ran the original (from ``original_runs``, which a
    patched ``_run_original`` appends to). Parameters stay equal to the copy's."""
    step, reference_step = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference))
    ran = []
    for _ in range(steps):
        before = len(original_runs)
        for module, optimiser in ((fused, step), (reference, reference_step)):
            optimiser.zero_grad()
            module(x).square().mean().backward()
            optimiser.step()
        ran.append(len(original_runs) > before)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return ran


@pytest.mark.parametrize("in_use_faster", [False, True])
def test_a_fused_step_that_won_at_compile_is_settled_by_its_first_calls_in_use(
    tmp_path, use_timer, original_runs, in_use_faster
):
    """Faster back to back at compile time; in use (the stand-in clock) slower, or faster:
    the calls follow the plan - the original once, blocks of fused, original, original,
    fused - and the call after it settles for good, with the user's results eager's all
    along. The verdict measured in use is cached: a second module on the cache reads it
    and neither times nor goes on probation again."""
    from autofuser_core import in_use

    in_use_ms = (lambda fused: 0.5 if fused else 1.0) if in_use_faster else (lambda fused: 1.5 if fused else 1.0)
    timer = _step_timer(use_timer, lambda fused: 0.5 if fused else 1.0, lambda fused: 0.5 if fused else 1.0, in_use_ms)
    model, x = _NormChain(), torch.randn(3, 5, 23)
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    steps = 1 + len(in_use.PLAN) + 4  # the compiling call, the plan, the settling call and three more
    ran = _train_beside_eager(fused, model, reference, x, steps, original_runs)
    plan_runs = [runner == "original" for runner in in_use.PLAN]
    assert ran[0] is False  # the compiling call runs what it compiled
    assert ran[1 : 1 + len(plan_runs)] == plan_runs
    assert timer.marks == [runner == "fused" for runner in in_use.PLAN] + [False]  # and the settling call's
    assert ran[1 + len(plan_runs) :] == [not in_use_faster] * 4
    notes = " ".join(fused.report().notes)
    ms = "0.500 ms fused vs 1.000 ms original" if in_use_faster else "1.500 ms fused vs 1.000 ms original"
    verdict = "the fused model runs" if in_use_faster else "the original runs"
    assert (
        f"training step in use, 2 blocks of 4 calls on each side: {ms} per call, blocks spread 0.0%: {verdict}" in notes
    ), notes
    assert (fused._compiled[next(iter(fused._compiled))][0] is None) is not in_use_faster

    marks, forwards = len(timer.marks), len(timer.forwards)
    again = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    ran = _train_beside_eager(again, model, reference, x, 4, original_runs)
    assert ran == [not in_use_faster] * 4
    assert len(timer.marks) == marks and len(timer.forwards) == forwards
    assert "(measured in use, read from the cache)" in " ".join(again.report().notes)


def test_calls_of_other_inputs_restart_the_check_in_use_and_at_last_give_it_up(tmp_path, use_timer, original_runs):
    """Spans between two calls of the plan must be one step of its own inputs: a call of
    other inputs in between starts the plan again; after MAX_RESTARTS restarts the plan is
    given up, the compile's verdict (fused) stands and the report says so."""
    from autofuser_core import in_use

    timer = _step_timer(
        use_timer, lambda fused: 0.5 if fused else 1.0, lambda fused: 0.5 if fused else 1.0, lambda f: 9.0 if f else 1.0
    )
    model, x, other = _NormChain(), torch.randn(3, 5, 23), torch.randn(2, 23)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False, max_signatures=4)
    with torch.no_grad():
        fused(other)  # compiled without gradients: no probation of its own
    fused(x).sum().backward()  # compiles, fused won: on probation
    for _ in range(in_use.MAX_RESTARTS + 1):
        for _ in range(3):
            fused(x).sum().backward()
        with torch.no_grad():
            fused(other)
    first = len(original_runs)
    fused(x).sum().backward()  # given up: fused
    assert len(original_runs) == first
    notes = " ".join(r for report in fused.reports() for r in report.notes)
    assert f"calls of other inputs came between its calls {in_use.MAX_RESTARTS + 1} times" in notes, notes
    assert "training step in use" not in notes
    assert len(timer.marks) == 3 * (in_use.MAX_RESTARTS + 1)


# ---------------------------------------------------------------------------
# Groups alike share one backward
# ---------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.ln = nn.LayerNorm(19, eps=eps)

    def forward(self, x):
        # The flip, which no plugin lowers, ends the block's group: one group per block.
        return torch.flip(torch.sigmoid(self.ln(x * 0.5 + 0.125)) * x, [-1])


def test_groups_alike_share_one_backward_and_train_like_eager(tmp_path, monkeypatch):
    """The layers of a stack get one backward graph, traced and compiled once, and still
    the gradients of each; a layer with other settings (a layer norm's eps) gets its own."""
    from autofuser_core import backward

    traced = []
    trace = backward.trace_backward

    def counted(fused, *args):
        traced.append(fused.source.name)
        return trace(fused, *args)

    monkeypatch.setattr(backward, "trace_backward", counted)

    def builds(blocks, x):
        model = nn.Sequential(*blocks)
        reference = copy.deepcopy(model)
        traced.clear()
        fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
        x_fused, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        fused(x_fused).square().sum().backward()
        reference(x_eager).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(x_fused.grad, x_eager.grad, atol=1e-5, rtol=1e-5)
        report = fused.report()
        forward = [g for g in report.fused if g.phase == "forward"]
        return len(traced), forward, [g for g in report.fused if g.phase == "backward"]

    x = torch.randn(2, 7, 19)
    one, forward_one, backward_one = builds([_Block()], x)
    assert one >= 1 and backward_one
    three, forward_three, backward_three = builds([_Block() for _ in range(3)], x)
    assert len(forward_three) > len(forward_one)  # each layer's groups are fused
    assert three == one  # and traced once
    assert len(backward_three) == 3 * len(backward_one)  # listed for each layer
    other, _, _ = builds([_Block(), _Block(), _Block(eps=1e-3)], x)
    assert other > one


class _TwoOutputs(nn.Module):
    """One group, two outputs, each with a weight of its own."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(23)), nn.Parameter(torch.randn(23))

    def forward(self, x):
        h = torch.sigmoid(x * 1.5 - 0.25)
        return h * self.w1, torch.tanh(h) * self.w2


@pytest.mark.parametrize("used", [0, 1])
def test_an_output_the_loss_does_not_use_gives_its_weight_no_gradient_as_in_eager(tmp_path, used):
    """Eager leaves ``.grad`` None for a weight that only feeds an output the loss does not
    use, and AdamW then skips it; zeros would decay it. So fused: the backward graph, and
    gradients of gradients (the recomputing path) alike."""
    model, x = _TwoOutputs(), torch.randn(5, 23)
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    optimisers = [torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.5) for m in (model, reference)]
    unused = "w2" if used == 0 else "w1"
    for _ in range(3):
        for module, optimiser, owner in zip((fused, reference), optimisers, (model, reference)):
            optimiser.zero_grad(set_to_none=True)
            module(x)[used].square().sum().backward()
            assert getattr(owner, unused).grad is None
            optimiser.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert any(g.phase == "backward" for g in fused.report().fused), str(fused.report())
    found = torch.autograd.grad(fused(x)[used].sum(), [model.w1, model.w2], create_graph=True, allow_unused=True)
    assert (found[0] is None, found[1] is None) == ((False, True) if used == 0 else (True, False))


def test_a_lead_inside_the_spread_of_the_calls_is_measured_again_and_then_not_trusted(
    tmp_path, use_timer, original_runs
):
    """Blocks of one side that differ by more than the fused step's lead: the plan runs a
    second time, and where the lead is still inside the spread, the original runs."""
    from autofuser_core import in_use

    fused_calls = iter([0.6] * 4 + [1.0] * 4 + [0.6] * 4 + [1.0] * 4)  # its blocks: 0.6 and 1.0 ms

    def in_use_ms(fused: bool) -> float:
        return next(fused_calls, 1.0) if fused else 1.0

    _step_timer(use_timer, lambda fused: 0.5 if fused else 1.0, lambda fused: 0.5 if fused else 1.0, in_use_ms)
    model, x = _NormChain(), torch.randn(3, 5, 23)
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    plans = in_use.MAX_ROUNDS * len(in_use.PLAN)
    ran = _train_beside_eager(fused, model, reference, x, 1 + plans + 2, original_runs)
    assert ran[1 : 1 + plans] == [runner == "original" for runner in in_use.PLAN] * in_use.MAX_ROUNDS
    assert ran[1 + plans :] == [True, True]
    notes = " ".join(fused.report().notes)
    expected = (
        "training step in use, 4 blocks of 4 calls on each side: 0.600 ms fused vs 1.000 ms original per call, "
        "blocks spread 66.7%: its lead (40.0%) is inside that spread: the original runs"
    )
    assert expected in notes, notes


def test_a_checkpointed_forward_recomputes_with_the_runner_its_first_pass_ran(tmp_path, use_timer, original_runs):
    """Activation checkpointing calls forward again inside backward: during the check in
    use, that call runs what the first pass ran and does not move the plan, so the saved
    values match and the gradients are eager's; and the module pickles after calls. The
    compile in the first checkpointed call saves nothing the checkpoint counts."""
    import pickle

    from torch.utils.checkpoint import checkpoint

    from autofuser_core import in_use

    _step_timer(use_timer, lambda f: 0.5 if f else 1.0, lambda f: 0.5 if f else 1.0, lambda f: 0.5 if f else 1.0)
    model, x = _NormChain(), torch.randn(3, 5, 23)
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    for step in range(1 + len(in_use.PLAN) + 2):
        for module, optimiser in zip((fused, reference), optimisers):
            optimiser.zero_grad()
            run = functools.partial(checkpoint, module, use_reentrant=False)
            run(x.clone().requires_grad_()).square().mean().backward()  # compiled inside one too
            optimiser.step()
    assert not fused.checking_in_use
    assert "training step in use, 2 blocks of 4 calls" in " ".join(fused.report().notes)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert pickle.loads(pickle.dumps(fused))._last_key is None


class _SavesItsOutputs(nn.Module):
    """Softmax and tanh: ops whose backward reads their own output, which autograd saves."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(19, 19)

    def forward(self, x):
        return torch.tanh(self.mix(torch.softmax(x * 2.0, dim=-1))) + x


def _record_compile_values(monkeypatch) -> list:
    """Weak references to every tensor with a ``grad_fn`` that capture's runs make: the
    trace on real values and the shape recording."""
    from autofuser_core import capture

    made: list = []

    def recording(original):
        def run(self, node):
            value = original(self, node)
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                made.append(weakref.ref(value))
            return value

        return run

    monkeypatch.setattr(capture._ConcreteTracer, "_execute", recording(capture._ConcreteTracer._execute))
    monkeypatch.setattr(capture._ShapeRecorder, "run_node", recording(capture._ShapeRecorder.run_node))
    return made


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_compiling_a_training_model_keeps_none_of_its_own_runs_activations(tmp_path, monkeypatch, checkpointed):
    """The compile runs the model with gradients on (tracing, shape recording, checks):
    once the step is done, none of what those runs saved for a backward stays alive, in a
    plain call and inside a checkpoint (whose saved-tensor hooks the compile shields its
    own from). A saved output packed as itself held its grad_fn in a cycle the collector
    can't see, which kept a whole forward's activations alive for good."""
    from torch.utils.checkpoint import checkpoint

    made = _record_compile_values(monkeypatch)
    model, x = _SavesItsOutputs().train(), torch.randn(3, 7, 19)
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False, verify_speed=False)
    run = functools.partial(checkpoint, fused, use_reentrant=False) if checkpointed else fused
    inputs = x.clone().requires_grad_()
    run(inputs).square().mean().backward()
    expected = x.clone().requires_grad_()
    reference(expected).square().mean().backward()
    gc.collect()
    assert made, "the trace made no tensor with a grad_fn: the check watches nothing"
    alive = sum(ref() is not None for ref in made)
    assert alive == 0, f"{alive} of {len(made)} values of the compile's runs are still alive"
    torch.testing.assert_close(inputs.grad, expected.grad, **FP32)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **FP32, msg=lambda m: f"{name}: {m}")


def test_the_compiles_shield_leaves_autograd_alone_where_the_caller_has_no_hooks():
    """No saved-tensor hooks of the caller's: the compile installs none either, so autograd
    keeps its check that a saved tensor was not written in place (any hook turns it off)."""
    from autofuser_core.fuse import _own_saved_tensors

    w = torch.randn(5, 5, requires_grad=True)
    with _own_saved_tensors():
        y = torch.exp(torch.randn(2, 5) @ w)
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class _TanhBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(23)

    def forward(self, x):
        return torch.tanh(self.ln(x) * 1.5) + x


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_graph_pass_that_breaks_gradients_leaves_the_original_running(tmp_path, autocast):
    """A plugin's graph pass that keeps the forward but cuts a gradient path (the tanh's
    input detached): every group still verifies against the rewritten graph, but the whole
    step's gradients are far off the original model's, so the original runs and the
    report says why; the user's gradients are eager's."""
    from _helpers import plugin_module

    def autofuser_transform_graph(gm, options):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.tanh:
                with gm.graph.inserting_before(node):
                    cut = gm.graph.call_method("detach", (node.args[0],))
                cut.meta = dict(node.args[0].meta)
                node.args = (cut, *node.args[1:])

    model, x = _TanhBetween(), torch.randn(3, 5, 23)
    reference = copy.deepcopy(model)
    plugin = plugin_module("cutsgradients", autofuser_transform_graph=autofuser_transform_graph)
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction", plugin], cache_dir=str(tmp_path), progress=False)
    grads = []
    for module in (fused, reference):
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(inputs)
        out.float().square().mean().backward()
        grads.append([inputs.grad, *(p.grad for p in module.parameters())])
    notes = " ".join(fused.report().notes)
    assert "gradients are off the original model's" in notes and "the original runs" in notes, notes
    assert fused.report().runs_original
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a backward this graph pass broke")


def _through_raising(x):
    return _RaisesInBackward.apply(x)


def test_a_fused_step_whose_backward_raises_where_the_original_does_not_leaves_the_original_running(tmp_path):
    from _helpers import plugin_module

    def autofuser_transform_graph(gm, options):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.tanh:
                with gm.graph.inserting_before(node):
                    through = gm.graph.call_function(_through_raising, (node.args[0],))
                through.meta = dict(node.args[0].meta)
                node.args = (through, *node.args[1:])

    model, x = _TanhBetween(), torch.randn(3, 5, 23)
    plugin = plugin_module("raisesinbackward", autofuser_transform_graph=autofuser_transform_graph)
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction", plugin], cache_dir=str(tmp_path), progress=False)
    fused(x.clone().requires_grad_()).square().mean().backward()  # the original's backward: no error
    notes = " ".join(fused.report().notes)
    assert "step raised RuntimeError where the original's did not: the original runs" in notes, notes


def _fused_with_pass(tmp_path, model, transform, **options):
    from _helpers import plugin_module

    plugin = plugin_module("apass", autofuser_transform_graph=transform)
    return autofuser.fuse(model, plugins=["elementwise", "reduction", plugin], cache_dir=str(tmp_path), **options)


def _tanh_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.tanh]


def _after_each_tanh(op, number):
    """A graph pass putting ``op(tanh(...), number)`` where each tanh's result was read."""

    def transform(gm, options):
        for node in _tanh_nodes(gm):
            with gm.graph.inserting_after(node):
                changed = gm.graph.call_function(op, (node, number))
            node.replace_all_uses_with(changed, delete_user_cb=lambda user: user is not changed)
            changed.meta = dict(node.meta)

    return transform


def test_a_graph_pass_that_shifts_the_outputs_but_keeps_the_gradients_is_caught(tmp_path):
    shift = _after_each_tanh(operator.sub, 1.0)

    model, x = _TanhBetween(), torch.randn(3, 5, 23)
    fused = _fused_with_pass(tmp_path, model, shift, progress=False)
    got = fused(x.clone().requires_grad_())
    torch.testing.assert_close(got, model(x), atol=1e-6, rtol=1e-6)
    assert "step's outputs are off the original model's" in " ".join(fused.report().notes)


def test_a_gradient_only_the_fused_step_gives_is_caught():
    """A gradient the original leaves None and the fused step gives counts against zeros."""
    from autofuser_core.fuse import _distance

    grad = torch.randn(7, 5)
    assert _distance([grad, None], [grad.clone(), None], 0.05) is None
    assert _distance([grad, torch.ones(3)], [grad.clone(), None], 0.05) is not None
    assert _distance([None, grad], [torch.ones(3), grad.clone()], 0.05) is not None


def test_a_small_gradient_that_is_wrong_is_caught_on_its_own_and_rounding_passes():
    from autofuser_core.fuse import STEP_TENSOR_FLOOR, _distance

    weight, bias = torch.randn(128, 128), torch.randn(128) * 0.1
    assert "tensor 1" in _distance([weight, -bias], [weight.clone(), bias], 0.05)  # 2% of the whole, 200% of its own
    tiny = torch.full((4,), 1e-6)  # a sum whose terms cancel: judged against the floor, not its own norm
    rounded = tiny + 1e-3 * STEP_TENSOR_FLOOR * float(weight.norm())
    assert _distance([weight, rounded], [weight.clone(), tiny], 0.05) is None


def test_a_forward_writing_into_its_input_is_checked_on_copies(tmp_path):
    """Each side of the check steps on its own copy of the inputs: the user's input is
    written once, by the call itself, as eager writes it, and the check finds nothing."""

    class WritesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(23)

        def forward(self, x, y):
            y.mul_(2.0)
            return torch.tanh(self.ln(x) * 1.5) + y

    model = WritesInput()
    x, y = torch.randn(3, 5, 23), torch.randn(3, 5, 23)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    written = y.clone()
    fused(x.clone().requires_grad_(), written).square().mean().backward()
    torch.testing.assert_close(written, 2.0 * y, rtol=0, atol=0)
    assert not [n for n in fused.report().notes if "are off the original" in n], fused.report().notes


def test_later_shapes_of_a_class_follow_its_first_shapes_gradient_verdict(tmp_path):
    def cut(gm, options):
        for node in _tanh_nodes(gm):
            with gm.graph.inserting_before(node):
                detached = gm.graph.call_method("detach", (node.args[0],))
            detached.meta = dict(node.args[0].meta)
            node.args = (detached, *node.args[1:])

    model = _TanhBetween()
    reference = copy.deepcopy(model)
    fused = _fused_with_pass(tmp_path, model, cut, progress=False, dynamic=True)
    for points in (5, 7):  # one size bucket: the second is a later shape of the first's class
        x = torch.randn(3, points, 23)
        grads = []
        for module in (fused, reference):
            inputs = x.clone().requires_grad_()
            module(inputs).square().mean().backward()
            grads.append([inputs.grad, *(p.grad.clone() for p in module.parameters())])
            module.zero_grad()
        for got, expected in zip(*grads):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        assert fused.report().runs_original, (points, fused.report().notes)
    assert "its fused training step's gradients were wrong" in " ".join(fused.report().notes)


def test_a_correct_fused_step_passes_the_whole_step_gradient_check(tmp_path):
    """The control: the same model without the broken pass runs fused."""
    model, x = _TanhBetween(), torch.randn(3, 5, 23)
    fused = autofuser.fuse(model, plugins=["elementwise", "reduction"], cache_dir=str(tmp_path), progress=False)
    fused(x.clone().requires_grad_()).square().mean().backward()
    assert not fused.report().runs_original, fused.report().notes
    assert "gradients are off" not in " ".join(fused.report().notes)


def test_two_fused_modules_in_one_loop_take_turns_in_their_checks(tmp_path, use_timer, monkeypatch):
    """A generator and a critic trained in one loop: their plans run one after the other,
    not in lock step, so neither one's spans take in the other's switches; the waiting
    one runs its compile's verdict (fused) meanwhile, and both settle."""
    from autofuser_core import in_use

    order: list[int] = []
    runner = in_use.InUseCheck.runner

    def logged(self):
        order.append(id(self))
        return runner(self)

    monkeypatch.setattr(in_use.InUseCheck, "runner", logged)
    _step_timer(use_timer, lambda f: 0.5 if f else 1.0, lambda f: 0.5 if f else 1.0, lambda f: 0.5 if f else 1.0)
    models = [_NormChain(), _NormChain()]
    references = [copy.deepcopy(m) for m in models]
    fused = [autofuser.fuse(m, cache_dir=str(tmp_path / str(k)), progress=False) for k, m in enumerate(models)]
    x = torch.randn(3, 5, 23)
    pairs = list(zip(fused + references, models + references))
    optimisers = [torch.optim.SGD(owner.parameters(), lr=0.05) for _, owner in pairs]
    for _ in range(1 + 2 * (len(in_use.PLAN) + 1) + 1):
        for (module, _), optimiser in zip(pairs, optimisers):
            optimiser.zero_grad()
            module(x).square().mean().backward()
            optimiser.step()
    assert not any(f.checking_in_use for f in fused)
    first, second = dict.fromkeys(order)  # the two checks, in the order they first ran
    assert order == [first] * (len(in_use.PLAN) + 1) + [second] * (len(in_use.PLAN) + 1)
    for module, model, reference in zip(fused, models, references):
        assert "training step in use" in " ".join(module.report().notes)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_single_ops_of_a_backward_graph_stay_library_calls_but_column_sums():
    """A backward graph's lone pointwise ops and reductions over the innermost dim are no
    kernels of their own: they move what eager moves, and each kernel is compiled at the
    first step. A lone sum over the rows that keeps the innermost dim (a bias's gradient,
    here the linear layers' and the norm's, whose backward sits in a product chain) is
    planned, as a lone norm is (``test_a_lone_norm_of_a_backward_graph_is_planned``):
    libraries' column sums are slow, and the group's timing keeps the faster. Products
    and chains still fuse; gradients are eager's."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(24, 40), nn.Linear(40, 24), nn.LayerNorm(24)

        def forward(self, x):
            return self.norm(x + self.down(F.gelu(self.up(x))))

    model = Block()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    x, grad = torch.randn(3, 37, 24), torch.randn(3, 37, 24)
    got_x, expected_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused(got_x).backward(grad)
    reference(expected_x).backward(grad)
    got = {"x": got_x.grad, **{n: p.grad for n, p in model.named_parameters()}}
    expected = {"x": expected_x.grad, **{n: p.grad for n, p in reference.named_parameters()}}
    assert_same_tensors(got, expected, scaled=True)

    report = fused.report()
    backward = [g for g in report.groups if g.phase == "backward"]
    single = [g for g in backward if g.fused and len(g.ops) == 1 and not g.ops[0].startswith("matmul.")]
    # the four bias gradients: up's, down's, and the norm's weight and bias
    assert len(single) == 4 and all(g.ops == ["reduction.sum"] for g in single), str(report)
    vetoed = [g for g in backward if g.reason_code == "vetoed" and "single op" in g.reason]
    assert all(g.ops != ["reduction.sum"] for g in vetoed), str(report)
    assert any(len(g.ops) > 1 for g in backward if g.fused), str(report)


def test_a_lone_norm_of_a_backward_graph_is_planned():
    """A norm recomputed alone in a backward graph (the layer norms on K and V before a
    linear attention's products) is planned as a row kernel, not vetoed as a single op:
    libraries' norms are slow on narrow rows and the group's timing keeps the faster.
    Gradients stay eager's."""

    class NormedProducts(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_k, self.norm_v = nn.LayerNorm(6), nn.LayerNorm(6)

        def forward(self, q, k, v):
            k, v = self.norm_k(k), self.norm_v(v)
            context = torch.einsum("bhnd,bhne->bhde", k, v) / k.shape[2]
            return torch.einsum("bhnd,bhde->bhne", q, context)

    model = NormedProducts()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    shape = (3, 2, 53, 6)
    q, k, v, grad = (torch.randn(shape) for _ in range(4))
    got_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    expected_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    fused(*got_inputs).backward(grad)
    reference(*expected_inputs).backward(grad)
    got = {**{f"in{i}": t.grad for i, t in enumerate(got_inputs)}, **{n: p.grad for n, p in model.named_parameters()}}
    expected = {
        **{f"in{i}": t.grad for i, t in enumerate(expected_inputs)},
        **{n: p.grad for n, p in reference.named_parameters()},
    }
    assert_same_tensors(got, expected, scaled=True)
    backward = [g for g in fused.report().groups if g.phase == "backward"]
    norms = [g for g in backward if g.fused and len(g.ops) == 1 and "layer_norm" in g.ops[0]]
    assert norms, str(fused.report())
    assert not [g for g in backward if g.reason_code == "vetoed" and "layer_norm" in g.ops[0]], str(fused.report())


class _CrossAttention(nn.Module):
    """Queries of the points attend to a few latent tokens (UPT's decoder), through
    ``F.scaled_dot_product_attention`` on transposed head views."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(width, width, bias=False)
        self.to_kv = nn.Linear(width, 2 * width, bias=False)

    def forward(self, x, latents):
        b, n, c = x.shape
        q = self.to_q(x).reshape(b, n, self.heads, c // self.heads).transpose(1, 2)
        k, v = (
            t.reshape(b, -1, self.heads, c // self.heads).transpose(1, 2) for t in self.to_kv(latents).chunk(2, dim=-1)
        )
        return F.scaled_dot_product_attention(q, k, v)


def test_a_traced_backward_that_differs_from_eagers_is_not_used():
    """ATen's decomposition of the CPU flash attention's forward returns the probabilities
    where its backward reads the log-sum-exp: the traced backward graph computes wrong
    gradients. Each traced graph is checked against eager's backward on the compile's
    samples, and this one is dropped for the group's eager backward."""
    model = _CrossAttention()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, plugins=["attention"], progress=False, tune=False, verify_speed=False)
    x, latents = torch.randn(2, 37, 16), torch.randn(2, 8, 16)
    for net in (fused, reference):
        net(x, latents).square().sum().backward()
    assert [g.strategy for g in fused.report().fused] == ["softmax_attention"]
    (kernel,) = fused.kernels()
    assert kernel.backward is None  # the traced graph was refused, saying why
    assert any("its traced backward gives input" in note for note in fused.report().notes), fused.report().notes
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **FP32, msg=lambda m: f"{name}: {m}")


class _Product(nn.Module):
    def forward(self, x, w):
        return x @ w


def test_a_traced_backward_off_eagers_but_as_near_float64_is_used():
    """Under bf16 autocast a weight's gradient sums over every row through bf16 operands:
    where its terms cancel, eager's own gradient is far from exact, and a traced backward
    that sums in another order misses eager's by more than bf16's tolerance. The group's
    backward run in float64 judges then, as it judges forward kernels: a traced gradient
    as near it as eager's is used, one farther off is not."""
    from types import SimpleNamespace

    from autofuser_core.backward import _differs_from_eager
    from autofuser_core.specs import PRODUCT_TOLERANCES
    from autofuser_core.verify import max_error

    fused = SimpleNamespace(eager=torch.fx.symbolic_trace(_Product()), live_attrs=[], attr_inputs={}, nodes=[])
    x, w = torch.randn(3001, 5) * 3 + 1, torch.randn(5, 7)
    wide = x.double()
    g = torch.randn(3001, 7, dtype=torch.float64)
    g = (g - wide @ torch.linalg.lstsq(wide, g).solution).bfloat16()  # nearly orthogonal to x's columns
    exact = [g.double() @ w.double().T, wide.T @ g.double()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_dw = torch.autograd.grad(x @ w.requires_grad_(), w, g)[0]
        near = (exact[0].bfloat16(), exact[1].float())
        assert not max_error(near[1], eager_dw, PRODUCT_TOLERANCES["bfloat16"], scale_rows=True)[0]
        assert _differs_from_eager(fused, [x, w.detach()], [g], [0, 1], near) is None
        off = (near[0], near[1] + 3 * (eager_dw - exact[1].float()).abs().max())
        found = _differs_from_eager(fused, [x, w.detach()], [g], [0, 1], off)
    assert found is not None and found.startswith("gives input 1 a gradient off eager's"), found
    # The note says how far each side is from float64: the traced one about 4x eager's largest miss.
    far, eager_far = (float(v) for v in re.findall(r"largest errors ([0-9.e+-]+) and ([0-9.e+-]+)\)", found)[0])
    assert far > 3 * eager_far > 0, found


def _single_precision_product(x, w):
    if x.dtype == torch.float64:
        raise RuntimeError("no float64 kernel")  # as a library op without one
    return x @ w


torch.fx.wrap("_single_precision_product")


class _SinglePrecisionProduct(nn.Module):
    def forward(self, x, w):
        return _single_precision_product(x, w)


def test_a_traced_backward_off_eagers_without_a_float64_judge_is_not_used():
    """Where the group's backward doesn't run in float64 there is no judge: a traced
    gradient off eager's is refused, and the note says there was no judge."""
    from types import SimpleNamespace

    from autofuser_core.backward import _differs_from_eager

    fused = SimpleNamespace(
        eager=torch.fx.symbolic_trace(_SinglePrecisionProduct()), live_attrs=[], attr_inputs={}, nodes=[]
    )
    x, w, g = torch.randn(33, 5), torch.randn(5, 7), torch.randn(33, 7)
    right = (g @ w.T, x.T @ g)
    assert _differs_from_eager(fused, [x, w], [g], [0, 1], right) is None
    found = _differs_from_eager(fused, [x, w], [g], [0, 1], (right[0], right[1] + 1.0))
    assert found is not None and found.startswith("gives input 1 a gradient off eager's"), found
    assert found.endswith("(no float64 judge: the group's backward doesn't run in float64)"), found


class _Cancels(nn.Module):
    """Two outputs: ``20 * tanh(x * w)``, and a small one through ``(x * w + 8e6) - 8e6``,
    which rounds x * w to a whole number in fp32: eager's small output is some 14% off
    exact arithmetic (which keeps x * w), its step as a whole well within the limit."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(23))

    def forward(self, x):
        h = x * self.w
        return torch.tanh(h) * 20, torch.tanh(((h + 8e6) - 8e6) * 0.25)


def _without_the_cancelling_add(gm, options):
    """A graph pass computing ``_Cancels`` in exact arithmetic: ``tanh(x * w * 0.25)``."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.sub and node.args[1] == 8e6:
            added = node.args[0]
            node.replace_all_uses_with(added.args[0])
            gm.graph.erase_node(node)
            gm.graph.erase_node(added)
            break


def test_a_fused_step_off_the_originals_but_nearer_float64_stands(tmp_path):
    """A graph pass that drops the cancelling add and subtract computes the model's exact
    arithmetic: its small output is far off the original's (which rounds), and the model's
    step in float64 judges: the fused step is the nearer, so it runs, and the report says
    why."""
    model, x = _Cancels(), torch.randn(3, 5, 23)
    fused = _fused_with_pass(tmp_path, model, _without_the_cancelling_add, progress=False, verify_speed=False)
    big, small = fused(x.clone().requires_grad_())
    notes = " ".join(fused.report().notes)
    assert "nearer the model's step in float64 than 2 times the original's distance: the fused step stands" in notes
    assert not fused.report().runs_original, notes
    torch.testing.assert_close(small, torch.tanh(x * model.w * 0.25), atol=1e-6, rtol=1e-5)


class _DrawsNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(23))

    def forward(self, x):
        return x + torch.tanh(x * self.w) * torch.randn_like(x)


def test_a_reference_step_that_draws_other_random_numbers_judges_nothing(tmp_path):
    """In float64 ``randn_like`` draws other numbers from the same seed: the original is far
    from that step, which then can't vouch for a fused step (here a wrong one, its tanh
    scaled) - the miss stands."""
    scaled = _after_each_tanh(operator.mul, 1.5)
    fused = _fused_with_pass(tmp_path, _DrawsNoise(), scaled, progress=False, verify_speed=False)
    fused(torch.randn(3, 5, 23).requires_grad_())
    notes = " ".join(fused.report().notes)
    assert "off the reference step, past the limit: not comparable" in notes and "the original runs" in notes, notes
    assert fused.report().runs_original


class _OnlyCancels(nn.Module):
    """``_Cancels``' small output alone: eager's whole step is past the limit of the step in
    float64 (it rounds x * w to whole numbers), and it draws no random numbers."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(23))

    def forward(self, x):
        return torch.tanh(((x * self.w + 8e6) - 8e6) * 0.25)


def test_a_step_drawing_no_random_numbers_is_judged_however_far_the_original_rounds(tmp_path):
    """Where the original's own step is past the limit of float64's, and nothing draws random
    numbers, the distance is the model's rounding: float64 still judges. The exact pass
    stands; a wrong one (each tanh scaled) is still refused."""
    x = torch.randn(3, 5, 23)
    exact = _fused_with_pass(tmp_path / "exact", _OnlyCancels(), _without_the_cancelling_add, progress=False)
    exact(x.clone().requires_grad_())
    notes = " ".join(exact.report().notes)
    assert "nearer the model's step in float64" in notes and not exact.report().runs_original, notes
    scaled = _after_each_tanh(operator.mul, 1.5)
    wrong = _fused_with_pass(tmp_path / "wrong", _OnlyCancels(), scaled, progress=False, verify_speed=False)
    wrong(x.clone().requires_grad_())
    notes = " ".join(wrong.report().notes)
    assert "off the reference step, the original" in notes and wrong.report().runs_original, notes


class _DropsPaths(nn.Module):
    """Stochastic depth as written in many models: a mask drawn in place into a new tensor."""

    def forward(self, x):
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(0.8)
        return x * keep / 0.8


class _TorchDropout(nn.Module):
    """``torch.dropout`` itself (not the functional one), its train flag fixed."""

    def __init__(self, train: bool):
        super().__init__()
        self.train_flag = train

    def forward(self, x):
        return torch.dropout(x, 0.2, self.train_flag)


def _traced(model, shape=(3, 5, 23)):
    """``model``'s graph with each node's metadata, as a capture on real shapes files it."""
    from torch.fx.passes.shape_prop import ShapeProp

    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(torch.randn(shape))
    return gm


class _Calls(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, x):
        return self.call(x)


@pytest.mark.parametrize(
    ("call", "draws"),
    [
        (lambda x: F.dropout(x, 0.3, training=True), True),
        (lambda x: F.dropout(x, 0.3, training=False), False),
        (lambda x: F.dropout(x, 0.0), False),
        (lambda x: torch.dropout(x, 0.1, True), True),
        (lambda x: torch.dropout(x, 0.1, train=False), False),
        (lambda x: F.rrelu(x, training=True), True),
        (lambda x: F.rrelu(x), False),
        (lambda x: torch.randn_like(x) * x, True),
        (lambda x: x.exponential_(), True),
        (lambda x: x.bernoulli(0.0 + 0.5), True),
        (lambda x: torch.normal(x, 1.0), True),
        (lambda x: torch.poisson(x.abs()), True),
        (lambda x: F.dropout2d(x, 0.2, True), True),  # no aten op of its name: run on meta tensors
        (lambda x: F.dropout2d(x, 0.2, False), False),
        (lambda x: F.gumbel_softmax(x), True),
        (lambda x: F.fractional_max_pool2d(x, 2, output_size=(2, 3)), True),  # draws its regions itself
        (lambda x: F.interpolate(x, scale_factor=2.0), False),
        (lambda x: F.gelu(x) + torch.tanh(x), False),
        (lambda x: F.layer_norm(x, (23,)), False),
        (lambda x: F.scaled_dot_product_attention(x, x, x), False),
        (lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1), True),
    ],
)
def test_a_call_draws_random_numbers_where_torch_tags_an_op_it_runs(call, draws):
    """No list of ops: torch's own tag (``torch.Tag.nondeterministic_seeded``) on the aten op
    of the call's name, with its training flag and rate, or on the ops a function of no aten
    op's name dispatches on meta tensors."""
    from autofuser_core.fuse import _barrier_kinds

    assert ("random" in _barrier_kinds(_traced(_Calls(call), (2, 3, 5, 23)))) is draws


def test_a_verdict_on_drawing_does_not_travel_with_copied_metadata():
    """A graph pass that files a new node with another's metadata copies no verdict of it."""
    from autofuser_core.effects import call_effect

    gm = _traced(_Calls(lambda x: torch.tanh(torch.randn_like(x))), (2, 23))
    drawn, squashed = (n for n in gm.graph.nodes if n.op == "call_function")
    assert call_effect(drawn) is not None and call_effect(squashed) is None
    squashed.meta.update(drawn.meta)
    drawn.meta.update({k: v for k, v in squashed.meta.items() if k != "tensor_meta"})
    assert call_effect(drawn) is not None and call_effect(squashed) is None


def test_a_step_may_draw_random_numbers_where_a_node_draws_them_or_runs_opaque():
    from autofuser_core.fuse import _may_draw_random

    assert _may_draw_random(_traced(_DrawsNoise()))
    assert _may_draw_random(_traced(_DropsPaths()))
    assert _may_draw_random(_traced(nn.Sequential(nn.Linear(23, 23), nn.Dropout(0.1))))
    assert not _may_draw_random(_traced(nn.Sequential(nn.Linear(23, 23), nn.Dropout(0.1)).eval()))
    assert not _may_draw_random(_traced(nn.Sequential(nn.Linear(23, 23), nn.Dropout(0.0))))
    assert _may_draw_random(_traced(nn.Sequential(nn.Linear(23, 23), nn.RReLU())))
    assert not _may_draw_random(_traced(nn.Sequential(nn.Linear(23, 23), nn.RReLU()).eval()))
    assert _may_draw_random(_traced(nn.Sequential(nn.FractionalMaxPool2d(2, output_size=(2, 3))), (2, 5, 7, 23)))
    assert not _may_draw_random(_traced(_OnlyCancels()))
    assert _may_draw_random(_traced(_TorchDropout(True)))
    assert not _may_draw_random(_traced(_TorchDropout(False)))  # an identity
    opaque = _traced(_OnlyCancels())
    next(n for n in opaque.graph.nodes if n.op == "call_function").meta["autofuser_opaque_reason"] = "a branch"
    assert _may_draw_random(opaque)  # the model's own code: it may draw them
    assert _may_draw_random(torch.nn.Linear(2, 2))  # not a graph: nothing known


class _DrawsLittleNoise(nn.Module):
    """``tanh(x * w)`` with a little multiplicative noise: two draws' steps are some 10% apart,
    past the fp32 step limit and within ``STEP_REFERENCE_CAP`` times it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(23))

    def forward(self, x):
        h = torch.tanh(x * self.w)
        return x + h + 0.08 * h * torch.randn_like(x)


def _noise_dropped(gm, options):
    """A graph pass that drops the model's draw (its noise as zeros): wrong."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.randn_like:
            node.target = torch.zeros_like


def test_a_pass_that_drops_a_draw_leaves_the_step_unjudged(tmp_path):
    """Whether the step draws random numbers is read from the graph as captured, before any
    pass: a pass that drops the model's draw makes the fused step deterministic, but the
    original's still draws other numbers than the float64 step, so nothing judges the miss."""
    fused = _fused_with_pass(tmp_path, _DrawsLittleNoise(), _noise_dropped, progress=False, verify_speed=False)
    fused(torch.randn(3, 5, 23).requires_grad_())
    notes = " ".join(fused.report().notes)
    assert "not comparable" in notes and fused.report().runs_original, notes


def test_a_draw_no_graph_shows_is_found_by_the_originals_step_from_other_streams(tmp_path, monkeypatch):
    """Where the graphs say nothing of draws (an op no list knows), the original's step from
    other random streams differs from its first: a wrong fused step is still unjudged."""
    import autofuser_core.fuse as fuse_module

    monkeypatch.setattr(fuse_module, "_may_draw_random", lambda gm, kinds=None: False)
    fused = _fused_with_pass(tmp_path, _DrawsLittleNoise(), _noise_dropped, progress=False, verify_speed=False)
    fused(torch.randn(3, 5, 23).requires_grad_())
    notes = " ".join(fused.report().notes)
    assert "not comparable" in notes and fused.report().runs_original, notes


def test_the_float64_judge_refuses_a_fused_step_farther_from_it_than_the_original():
    from autofuser_core.fuse import STEP_GRADIENT_LIMIT, _farther_from

    limit = STEP_GRADIENT_LIMIT["fp32"]
    exact = [torch.randn(40, 7, dtype=torch.float64), torch.randn(9, dtype=torch.complex128)]
    original = [t + 1e-3 * t.abs().max() * torch.randn_like(t) for t in exact]
    nearer = [t + 1e-5 * torch.randn_like(t) for t in exact]
    assert _farther_from([t.float() for t in nearer[:1]] + nearer[1:], original, exact, limit) is None
    off = [exact[0] * 1.1, nearer[1]]  # 10% off: far beyond the original's rounding
    assert _farther_from(off, original, exact, limit).startswith("all of them")
    small = [nearer[0], exact[1] * 0 + 1e-2 * exact[0].norm()]  # one tensor wrong on its own
    assert _farther_from(small, original, exact, limit) is not None
    assert "not finite" in _farther_from(nearer, original, [exact[0] * float("nan"), exact[1]], limit)
    infinite = [original[0] * float("inf"), original[1]]  # an original past every bound judges nothing
    assert "not comparable" in _farther_from(nearer, infinite, exact, limit)
    assert "not comparable" in _farther_from(nearer, infinite, exact, limit, random=False)
    noise = [torch.randn_like(t) for t in exact]
    far = [t + 0.1 * t.norm() / n.norm() * n for t, n in zip(exact, noise)]  # 0.1 off: past the limit
    assert "not comparable" in _farther_from(nearer, far, exact, limit)  # rounding, or other draws
    assert _farther_from(nearer, far, exact, limit, random=False) is None  # no draws: rounding
    # Past the limit, the fused step's tensors together are held to 1.25 times the original's
    # distance, and each on its own to 2 times (one tensor's rounding is one draw).
    assert _farther_from([t + 1.1 * (f - t) for t, f in zip(exact, far)], far, exact, limit, random=False) is None
    farther = [t + 1.5 * (f - t) for t, f in zip(exact, far)]
    assert _farther_from(farther, far, exact, limit, random=False).startswith("all of them")
    one_farther = [far[0], exact[1] + 1.5 * (far[1] - exact[1])]  # the smaller tensor: the whole barely moves
    assert _farther_from(one_farther, far, exact, limit, random=False) is None
    one_far = [far[0], exact[1] + 2.5 * (far[1] - exact[1])]
    assert _farther_from(one_far, far, exact, limit, random=False).startswith("tensor 1")
    # An original past STEP_REFERENCE_CAP times the limit judges nothing, draws or not.
    too_far = [t + 0.3 * t.norm() / n.norm() * n for t, n in zip(exact, noise)]
    assert "not comparable" in _farther_from(nearer, too_far, exact, limit, random=False)


class _CancelsNotInFloat64(_Cancels):
    """As ``_Cancels``, but refusing float64 (as FNO's reference code does, which writes its
    spectral product into a complex64 tensor of its own)."""

    def forward(self, x):
        if x.dtype == torch.float64:
            raise RuntimeError("expected scalar type ComplexFloat but found ComplexDouble")
        return super().forward(x)


def test_where_the_model_refuses_float64_strict_fp32_judges(tmp_path):
    """Strict fp32 is the reference then; it rounds as the original does on a CPU, so the
    exact-arithmetic fused step is the farther from it: the original runs, saying so."""

    model, x = _CancelsNotInFloat64(), torch.randn(3, 5, 23)
    fused = _fused_with_pass(tmp_path, model, _without_the_cancelling_add, progress=False, verify_speed=False)
    fused(x.clone().requires_grad_())
    notes = " ".join(fused.report().notes)
    assert "off the original model's" in notes, notes
    assert "off the reference step, the original 0 in strict fp32" in notes, notes  # exact, the original not
    assert fused.report().runs_original


class _WritesIntoItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(7))

    def forward(self, x, counts):
        counts.add_(1)
        return (x * self.w).tanh()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_reference_step_leaves_the_callers_inputs_as_they_were(dtype):
    """The reference step runs the model on copies, even where widening changes nothing
    (an input already float64; fp32 on the strict-fp32 path; an integer tensor)."""
    model = _WritesIntoItsInput()
    fused = autofuser.fuse(model, progress=False)
    x, counts = torch.randn(4, 7, dtype=dtype), torch.zeros(3, dtype=dtype)
    steps = torch.zeros(3, dtype=torch.int64)
    for given in (counts, steps):
        name, found = fused._reference_step((x, given), {})
        assert found is not None and name == "float64"
        assert not bool(given.any()), name


class _CastThenTanh(nn.Module):
    """A group holding a cast as a node, as autocast's are made explicit on CUDA."""

    def forward(self, x, w):
        return torch.tanh((x @ w).to(torch.bfloat16)).float()


def test_the_backward_judge_keeps_float64_through_a_groups_own_casts():
    """Weight gradients whose terms cancel: eager's, through the bf16 cast, are far from
    exact, and a traced backward computing them exactly misses eager's by more than the
    tolerance. The float64 judge runs the group's ops with its cast kept in float64
    (``verify.exact_casts``): run as written it would round there (and its fp32 output
    would take no float64 gradient), so the exact backward is used."""
    from types import SimpleNamespace

    from autofuser_core.backward import _differs_from_eager
    from autofuser_core.specs import PRODUCT_TOLERANCES
    from autofuser_core.verify import max_error

    fused = SimpleNamespace(eager=torch.fx.symbolic_trace(_CastThenTanh()), live_attrs=[], attr_inputs={}, nodes=[])
    x, w = torch.randn(2001, 5), torch.randn(5, 3) * 0.5
    wide, w64 = x.double(), w.double()
    slope = 1 - torch.tanh(wide @ w64) ** 2
    v = torch.randn(2001, 3, dtype=torch.float64)
    v = v - wide @ torch.linalg.lstsq(wide, v).solution  # x^T v = 0: the exact weight gradient cancels
    g = (v / slope).float()
    exact = [(g.double() * slope) @ w64.T, wide.T @ (g.double() * slope)]
    eager_dw = torch.autograd.grad(_CastThenTanh()(x, w.requires_grad_()), w, g)[0]
    traced = (exact[0].float(), exact[1].float())
    assert not max_error(traced[1], eager_dw, PRODUCT_TOLERANCES["bfloat16"], scale_rows=True)[0]
    assert _differs_from_eager(fused, [x, w.detach()], [g], [0, 1], traced) is None
    off = (traced[0], traced[1] + 3 * (eager_dw - traced[1]).abs().max())
    assert _differs_from_eager(fused, [x, w.detach()], [g], [0, 1], off) is not None


class _WritesIntoACast(nn.Module):
    def forward(self, x):
        h = x * 3
        y = h.to(torch.bfloat16)
        y.mul_(2)
        return h * y.float()


def test_the_backward_judges_casts_copy_as_casts_do():
    """A cast kept in float64 is still a copy: writing into its result leaves its input
    alone, so the judge's reference is eager's function, and a traced backward 50% off
    it is refused (were the cast an alias, the reference would be twice eager's gradient,
    and the wrong one nearer it than eager)."""
    from types import SimpleNamespace

    from autofuser_core.backward import _differs_from_eager
    from autofuser_core.verify import exact_casts

    fused = SimpleNamespace(eager=torch.fx.symbolic_trace(_WritesIntoACast()), live_attrs=[], attr_inputs={}, nodes=[])
    x, g = torch.randn(64, 9), torch.randn(64, 9)
    eager = torch.autograd.grad(_WritesIntoACast()(x.requires_grad_()), x, g)[0]
    assert _differs_from_eager(fused, [x.detach()], [g], [0], (eager * 1.5,)) is not None
    assert _differs_from_eager(fused, [x.detach()], [g], [0], (eager,)) is None
    wide = torch.randn(5, dtype=torch.float64)
    with exact_casts():
        assert wide.to(torch.float16).dtype == torch.float64 and wide.to(torch.float16) is not wide
        assert wide.view(torch.int64).dtype == torch.int64  # a bitcast keeps its dtype
        assert torch.zeros(3, dtype=torch.complex64).dtype == torch.complex128
