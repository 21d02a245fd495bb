"""Patterns of real solver code around the elementwise lowerings, end to end: each
small model is fused, compared with eager on fresh random inputs at awkward shapes in
fp32, fp16 and bf16 (the conformance test's default tolerances), and its report must
show the pattern inside one fused group."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.specs import DEFAULT_TOLERANCES

from _helpers import fuse_and_compare

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def fused_group_with(report, *ops):
    group = next((g for g in report.fused if all(op in g.ops for op in ops)), None)
    assert group is not None, f"no fused group holds {ops}:\n{report}"
    return group


class TimeEmbedding(nn.Module):
    """A diffusion / neural-operator time embedding, sin and cos of t times frequencies,
    mixed into the features."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("freqs", torch.exp(-torch.arange(width) * (9.2 / width)))

    def forward(self, x, t):
        phase = t[:, None] * self.freqs * 100.0
        return x * torch.sin(phase) + phase.cos() * 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 5])
def test_sinusoidal_embedding_is_one_kernel(dtype, batch):
    width = 37
    model = TimeEmbedding(width).to(dtype)
    x = torch.randn(batch, width, dtype=dtype)
    t = torch.rand(batch, dtype=dtype)
    report = fuse_and_compare(model, x, t)
    fused_group_with(report, "elementwise.sin", "elementwise.cos", "elementwise.mul", "elementwise.add")


class InPlaceActivations(nn.Module):
    """Every in-place activation form the pass rewrites, each on a fresh value read by nothing else."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)
        self.silu = nn.SiLU(inplace=True)
        self.leaky = nn.LeakyReLU(0.3, inplace=True)

    def forward(self, x):
        h = self.act(self.fc(x))
        h = F.relu(h * 2 - 1, inplace=True)
        h = F.silu(h - 0.5, True)
        h = torch.relu_(h * 3 - 1).sigmoid_()
        h = (h - 0.5).relu_()
        h = self.leaky(h * 2 - 0.1)
        h = torch.tanh_(F.elu(h - 0.2, 0.7, inplace=True) * 2)
        return self.silu(h + x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 13])
def test_inplace_activations_on_fresh_values_fuse_as_functional_ops(dtype, rows):
    model = InPlaceActivations(37).to(dtype).eval()
    x = torch.randn(rows, 37, dtype=dtype)
    x_before = x.clone()
    report = fuse_and_compare(model, x)
    assert torch.equal(x, x_before)
    assert not [e for e in report.unfused_nodes if e.reason_code == "mutation"], str(report)
    group = fused_group_with(report, "elementwise.relu", "elementwise.sigmoid", "elementwise.silu", "elementwise.tanh")
    assert {"elementwise.leaky_relu", "elementwise.elu"} <= set(group.ops)
    # The user's modules keep their flag: the rewrite is of the captured graph only.
    assert model.act.inplace and model.silu.inplace and model.leaky.inplace


class ReadAgain(nn.Module):
    """In-place activations whose write someone sees: they must stay mutations."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc(x)
        y = h.relu_() * 2  # h is read again below: it holds relu(h) there
        a = y + h
        v = self.fc(a)[:, 1:]  # a view: the write reaches the linear's whole output
        w = self.act(v) + 1
        return x.sigmoid_() + a + w.sum()  # the caller's input is overwritten too


def test_inplace_activations_someone_reads_stay_mutations_and_compute_as_eager():
    model = ReadAgain(9).eval()
    x = torch.randn(4, 9)
    x_fused = x.clone()
    with torch.no_grad():
        expected = model(x)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(x_fused)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x_fused, x)  # both overwrote their input the same way
    mutations = [e for e in fused.report().unfused_nodes if e.reason_code == "mutation"]
    assert len(mutations) == 3, str(fused.report())


def test_inplace_activation_trains_like_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(11, 23), nn.ReLU(inplace=True), nn.Linear(23, 5), nn.SiLU(inplace=True))
    x = torch.randn(7, 11)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    got = fused(x)
    got.square().sum().backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x)
    expected.square().sum().backward()
    torch.testing.assert_close(got, expected)
    for ours, theirs in zip(fused_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    assert not [e for e in fused.report().unfused_nodes if e.reason_code == "mutation"], str(fused.report())


class BroadcastLatent(nn.Module):
    """A computed per-sample latent broadcast over the mesh points (``expand``) and mixed in."""

    def forward(self, z, x):
        latent = torch.tanh(z * 2).expand(-1, x.shape[1], -1)
        return (x + latent).sum(1) * 0.5, x * latent.sigmoid() + latent


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_expand_inside_a_chain_is_read_through_a_zero_stride(dtype, batch):
    model = BroadcastLatent()
    z = torch.randn(batch, 1, 19, dtype=dtype)
    x = torch.randn(batch, 45, 19, dtype=dtype)
    with torch.no_grad():
        expected = model(z, x)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(z, x)
    tol = DEFAULT_TOLERANCES[str(dtype).removeprefix("torch.")]
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=tol.atol, rtol=tol.rtol)
    fused_group_with(fused.report(), "elementwise.tanh", "elementwise.expand", "elementwise.sigmoid")


def test_an_expand_read_outside_its_group_is_vetoed_and_stays_a_view():
    class Leaks(nn.Module):
        def forward(self, x):
            e = (x * 2).expand(4, -1)
            return e + 1, e

    x = torch.randn(1, 33)
    with torch.no_grad():
        fused = autofuser.fuse(Leaks(), progress=False, tune=False, verify_speed=False)
        plus, e = fused(x)
    torch.testing.assert_close(plus, (x * 2 + 1).expand(4, -1))
    assert e.stride(0) == 0  # eager's view, not a copy
    report = fused.report()
    assert not [g for g in report.fused if "elementwise.expand" in g.ops], str(report)
    assert any(g.reason_code == "vetoed" and "elementwise.expand" in g.ops for g in report.skipped), str(report)


class Accumulate(nn.Module):
    """A sum over terms started from a fresh zero tensor, and a running maximum from -inf."""

    def forward(self, x, y):
        acc = x.new_zeros(x.shape)
        for k in range(3):
            acc = acc + torch.sin(x * (k + 1)) * y
        peak = torch.maximum(torch.full_like(x, float("-inf")), acc * 2)
        return peak - torch.ones_like(y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fresh_constant_tensors_fuse_with_the_arithmetic_they_start(dtype):
    x = torch.randn(1, 7, 45, dtype=dtype)
    y = torch.randn(7, 1, dtype=dtype)  # broadcast against x
    report = fuse_and_compare(Accumulate(), x, y)
    group = fused_group_with(report, "elementwise.new_zeros", "elementwise.full_like", "elementwise.ones_like")
    assert "elementwise.sin" in group.ops
    assert not report.unfused_nodes, str(report)
