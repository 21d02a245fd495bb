"""Batch norm by the batch's statistics through a fused model (``plugins/conv/
batch_norm_pass.py``): each rewritten into one ``batch_norm_act`` call with the
activation that is its only reader, or left to eager where in doubt.

Each model trains three AdamW steps through ``autofuser.fuse`` beside an eager
copy on the same fresh random inputs (odd sizes, batch 1 where the module allows
it): losses, parameters, running statistics and batch counts must agree, and the
report must show what was rewritten (the call, with the activation gone from the
graph) or why not (the module still there, with its reason).
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.report_html import coverage

#: fp32 losses and weights after three steps: Adam divides by the gradients' running
#: magnitude, so a tiny gradient difference moves a weight by up to about lr * 1e-4.
FP32 = dict(atol=2e-5, rtol=2e-4)
#: The running variance is a lerp of batch variances of values of order 10-100 here.
STATISTICS = dict(atol=1e-4, rtol=1e-4)
CALL = "batch_norm_act"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def train_both(model: nn.Module, make_input, steps: int = 3, **options):
    """Train ``model`` fused and an eager copy side by side; compare everything; return the fused one."""
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, **options)
    optimisers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for _ in range(steps):
        x = make_input()
        target = None
        losses = []
        for module, optimiser in zip((fused, reference), optimisers):
            out = module(x.clone())
            if target is None:
                target = torch.randn_like(out)
            loss = (out - target).square().mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], **FP32)
    for (name, got), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        tolerance = STATISTICS if "running" in name else FP32
        torch.testing.assert_close(got, expected, **tolerance, msg=lambda m, n=name: f"{n}: {m}")
    assert not fused.report().runs_original, str(fused.report())  # the fused model, not the original, ran
    return fused


def calls(fused) -> list:
    return [n for n in fused.report().unfused_nodes if CALL in n.target]


def kept_modules(fused, kind: str) -> list:
    """The forward graph's nodes (after the graph passes) of module class ``kind``."""
    return [n for n in fused.report().graph if n.op == "call_module" and n.target.endswith(f"({kind})")]


class ConvBlock(nn.Module):
    """Convolution, batch norm, activation, and a residual the second norm's result feeds."""

    def __init__(self, norm: type, conv: type, activation: nn.Module, channels: int = 6):
        super().__init__()
        # No bias before a batch norm (as in U-Net): its gradient is zero but for rounding,
        # which Adam scales up to whole steps of noise on either side.
        self.conv = conv(3, channels, 3, padding=1, bias=False)
        self.bn = norm(channels)
        self.act = activation
        self.conv2 = conv(channels, channels, 1, bias=False)
        self.bn2 = norm(channels)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x)))
        return self.bn2(self.conv2(h)) + h


@pytest.mark.parametrize(
    "norm,conv,shape,activation,ops_gone",
    [
        (nn.BatchNorm2d, nn.Conv2d, (2, 3, 13, 7), nn.GELU(), "GELU"),
        (nn.BatchNorm2d, nn.Conv2d, (1, 3, 9, 5), nn.ReLU(inplace=True), "ReLU"),
        (nn.BatchNorm1d, nn.Conv1d, (3, 3, 37), nn.LeakyReLU(0.1), "LeakyReLU"),
        (nn.BatchNorm3d, nn.Conv3d, (2, 3, 5, 4, 3), nn.SiLU(), "SiLU"),
    ],
    ids=["2d-gelu", "2d-batch1-relu-inplace", "1d-leaky", "3d-silu"],
)
def test_batch_norm_and_activation_train_as_one_call(norm, conv, shape, activation, ops_gone):
    fused = train_both(ConvBlock(norm, conv, activation).train(), lambda: torch.randn(shape) * 3 + 2)
    report = fused.report()
    assert len(calls(fused)) == 2, str(report)
    assert all(c.reason_code == "own_kernels" for c in calls(fused))
    assert not kept_modules(fused, norm.__name__) and not kept_modules(fused, ops_gone), str(report)
    counts = coverage(report)
    assert counts.eager == 0 and counts.library >= 2, counts


class Functional(nn.Module):
    """``F.batch_norm(training=True)`` on the model's own buffers, then without statistics."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 11, bias=False)
        self.weight = nn.Parameter(torch.randn(11))
        self.bias = nn.Parameter(torch.randn(11))
        self.register_buffer("mean", torch.randn(11))
        self.register_buffer("var", torch.rand(11) + 0.5)

    def forward(self, x):
        h = F.batch_norm(self.lin(x), self.mean, self.var, self.weight, self.bias, True, 0.3, 1e-3)
        h = F.silu(h)
        return F.batch_norm(h * 2, None, None, training=True) + h


def test_functional_batch_norm_on_buffers_and_without_statistics():
    fused = train_both(Functional(), lambda: torch.randn(9, 5))
    assert len(calls(fused)) == 2, str(fused.report())


class Unchanged(nn.Module):
    """A batch norm the pass must leave alone, with the reason ``why``."""

    def __init__(self, why: str):
        super().__init__()
        self.why = why
        self.lin = nn.Linear(4, 6, bias=False)
        self.bn = nn.BatchNorm1d(6, momentum=None if why == "cumulative" else 0.1)
        if why == "hooked":
            self.bn.register_forward_hook(lambda module, args, out: out * 2)

    def forward(self, x):
        h = self.bn(self.lin(x))
        if self.why == "statistics read":
            h = h + self.bn.running_mean
        return F.relu(h)


@pytest.mark.parametrize("why", ["cumulative", "hooked", "statistics read"])
def test_batch_norms_the_pass_leaves_alone_train_as_eager(why):
    fused = train_both(Unchanged(why).train(), lambda: torch.randn(7, 4))
    assert not calls(fused), str(fused.report())


def test_the_option_turns_the_pass_off():
    fused = train_both(
        ConvBlock(nn.BatchNorm2d, nn.Conv2d, nn.GELU()).train(),
        lambda: torch.randn(2, 3, 5, 7),
        batch_norm_kernels=False,
    )
    assert not calls(fused) and kept_modules(fused, "BatchNorm2d"), str(fused.report())


def test_an_activation_with_another_reader_stays_and_the_norm_is_rewritten_alone():
    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            h = self.bn(x)
            return F.gelu(h) * h

    fused = train_both(TwoReaders().train(), lambda: torch.randn(3, 4, 5, 6))
    (call,) = calls(fused)
    report = fused.report()
    assert any("gelu" in op for g in report.fused for op in g.ops), str(report)


def test_one_value_per_channel_raises_as_eager_does():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    fused = autofuser.fuse(copy.deepcopy(model), progress=False)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model(torch.randn(1, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        fused(torch.randn(1, 3))


def test_eval_mode_after_training_folds_the_running_statistics():
    model = ConvBlock(nn.BatchNorm2d, nn.Conv2d, nn.GELU()).train()
    fused = train_both(model, lambda: torch.randn(2, 3, 6, 5))
    model.eval()
    x = torch.randn(2, 3, 6, 5)
    with torch.no_grad():
        got = fused(x)
        expected = copy.deepcopy(model)(x)
    torch.testing.assert_close(got, expected, **FP32)
    report = fused.report()
    assert not calls(fused) and any("conv.batch_norm_module" in g.ops for g in report.fused), str(report)


def test_bf16_autocast_trains_close_to_eager():
    model = ConvBlock(nn.BatchNorm2d, nn.Conv2d, nn.ReLU()).train()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(2, 3, 11, 6)
    grads = []
    for module in (fused, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    assert len(calls(fused)) == 2, str(fused.report())
    for got, expected in zip(*grads):
        error = (got - expected).norm() / expected.norm()
        assert error < 3e-2, error
    for got, expected in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


class Chained(nn.Module):
    """Batch norms in a row, their activations as functions (builtins among them), the
    second norm's input the first one's rewritten call, and a weight and bias that are
    views of one parameter for the functional one (rows of it: eager's CPU backward gives
    x a wrong gradient for a strided weight, torch 2.13, so columns can't be compared)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 8, bias=False)
        self.bn1 = nn.BatchNorm1d(8)
        self.bn2 = nn.BatchNorm1d(8)
        self.affine = nn.Parameter(torch.randn(2, 8))

    def forward(self, x):
        h = torch.relu(self.bn1(self.lin(x)))
        h = F.gelu(self.bn2(h))
        h = F.batch_norm(h * 2, None, None, self.affine[0], self.affine[1], training=True)
        return F.leaky_relu(h, 0.2)


def test_chained_batch_norms_with_function_activations_and_parameter_views():
    fused = train_both(Chained().train(), lambda: torch.randn(11, 5))
    report = fused.report()
    assert len(calls(fused)) == 3, str(report)
    targets = [n.target for n in report.graph]
    assert not any(t.endswith(("relu", "gelu", "leaky_relu")) for t in targets), targets


class InPlaceLeaky(nn.Module):
    def __init__(self, slope: float):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.act = nn.LeakyReLU(slope, inplace=True)

    def forward(self, x):
        return self.act(self.bn(x))


def test_an_in_place_leaky_relu_of_negative_slope_stays_eager_as_its_backward_refuses():
    """Eager's backward raises for it; the norm is rewritten alone and the activation
    left as it is, so the fused model raises too (not a gradient eager would not give)."""
    model = InPlaceLeaky(-0.1).train()
    fused = autofuser.fuse(copy.deepcopy(model), progress=False)
    x = torch.randn(2, 3, 5, 4)
    for module in (model, fused):
        with pytest.raises(RuntimeError, match="negative slope"):
            module(x.clone().requires_grad_()).sum().backward()
    fused = train_both(InPlaceLeaky(0.1).train(), lambda: torch.randn(2, 3, 5, 4))
    assert not kept_modules(fused, "LeakyReLU"), str(fused.report())
