"""Dynamic dimensions (autofuser_core/dynamic.py, the shape-class guard in fuse.py):
a model called with many point counts shares one kernel source per group across
them, gives eager's outputs, and never runs the original for lack of signatures;
``dynamic=False`` specialises per shape as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofuser
from autofuser_core.codegen import KernelSource
from autofuser_core.dynamic import SizeRule, bucket, collecting_sizes, size_rule, sized
from autofuser_core.fuse import fused_kernels
from autofuser_core.tuning import _tuning_key

#: Odd point counts, none a divisor of a static size of the model below: twelve of them,
#: over four size buckets (64, 128, 256, 512).
POINT_COUNTS = (37, 45, 59, 77, 93, 101, 127, 155, 189, 211, 255, 301)


class PointCloudBlock(nn.Module):
    """A point-cloud layer: Linear, GELU, LayerNorm, a softmax over channels, a mean
    over the points and a residual, on ``[batch, points, channels]``."""

    def __init__(self, channels: int = 12, width: int = 20):
        super().__init__()
        self.lift = nn.Linear(channels, width)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)

    def forward(self, x):
        h = self.norm(F.gelu(self.lift(x)))
        h = h + torch.softmax(h, dim=-1)
        pooled = h.mean(dim=1, keepdim=True)  # over the points: a reduced dim that varies
        return self.mix(h - pooled) + h


def _model() -> PointCloudBlock:
    torch.manual_seed(0)
    return PointCloudBlock().eval()


def _check(fused, model, batch: int, points: int) -> None:
    x = torch.randn(batch, points, 12) * 2.0 + 0.5
    with torch.no_grad():
        got, want = fused(x), model(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"batch {batch}, {points} points")


def _sources(fused) -> dict[str, str]:
    """Kernel name -> source of the most recently called signature's fused groups."""
    return {g.kernel: g.kernel_source for g in fused.report().fused if g.kernel and g.kernel_source}


def _kernel_files(cache: Path) -> set[str]:
    return {p.stem for p in (cache / "kernels").glob("*.py")}


def test_twelve_point_counts_share_kernels_and_match_eager(tmp_path, original_runs):
    model = _model()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path))  # dynamic=None: specialise first
    _check(fused, model, 3, POINT_COUNTS[0])
    first = _sources(fused)
    assert first and not any("sz0" in source for source in first.values()), "the first call stays specialised"
    assert fused.report().dynamic_dims == []
    names_per_shape = []
    for points in POINT_COUNTS[1:]:
        _check(fused, model, 3, points)
        report = fused.report()
        assert report.dynamic_dims and report.dynamic_dims[0].startswith(f"x dim 1 (size {points},")
        assert all(g.run_time_sizes for g in report.fused), "every bundled strategy here takes run-time sizes"
        names_per_shape.append(set(_sources(fused)))
    # One source per group for all eleven later counts, across four size buckets.
    assert all(names == names_per_shape[0] for names in names_per_shape)
    assert len(names_per_shape[0]) == len(first)
    assert _kernel_files(tmp_path) == set(first) | names_per_shape[0]
    # ... loaded once: every compiled shape of the class launches the same kernel object.
    loaded: dict[str, set[int]] = {}
    for runner, _ in fused._compiled.values():
        for kernel in fused_kernels(runner):
            loaded.setdefault(kernel.source.name, set()).add(id(kernel.kernel))
    assert set(loaded) == set(first) | names_per_shape[0]
    assert all(len(ids) == 1 for ids in loaded.values())
    # Batch 1 is a class of its own (size-1 dims are specialised), sharing its sources too.
    for points in POINT_COUNTS[:4]:
        _check(fused, model, 1, points)
    assert len(_kernel_files(tmp_path)) <= 3 * len(first)
    assert original_runs == []
    text = str(fused.report())
    assert "Dynamic dims: x dim 1" in text and "take their sizes at run time" in text
    assert "Dynamic dims: x dim 1" in fused.report().to_html()


def test_a_later_shape_of_a_class_is_checked_on_its_real_inputs_only(tmp_path):
    model = _model()
    x = torch.randn(3, 37, 12)
    autofuser.mark_dynamic(x, 1)
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path))
    with torch.no_grad():
        fused(x)
        assert not any(g.class_checked for g in fused.report().fused)
        assert all(g.max_error is not None for g in fused.report().fused)
        fused(torch.randn(3, 45, 12))  # same bucket (64): same class
    later = fused.report()
    assert later.fused and all(g.class_checked and g.max_error is not None for g in later.fused)
    assert "checked on synthetic inputs for an earlier shape of this class" in str(later)


def test_mark_dynamic_takes_sizes_at_run_time_from_the_first_call(tmp_path, original_runs):
    model = _model()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), max_signatures=1)
    sources = []
    for points in (53, 101, 211):
        x = torch.randn(3, points, 12)
        autofuser.mark_dynamic(x, 1)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
        assert fused.report().dynamic_dims
        sources.append(_sources(fused))
    assert all("sz0" in source for source in sources[0].values())
    assert set(sources[0]) == set(sources[1]) == set(sources[2])  # one kernel name (its code digest) each
    # Three size buckets, three shape classes: together one signature (max_signatures=1).
    assert original_runs == []
    other = torch.randn(3, 53, 12).requires_grad_()  # another signature: past max_signatures
    with pytest.warns(UserWarning, match="max_signatures"), torch.no_grad():
        fused(other)
    assert original_runs == [True]


def test_a_class_keeps_its_most_recent_shapes(tmp_path, monkeypatch, original_runs):
    from autofuser_core import fuse as fuse_module

    monkeypatch.setattr(fuse_module, "MAX_SHAPES_PER_CLASS", 2)
    model = _model()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), dynamic=True)
    for points in (37, 41, 45, 41):  # one bucket (64): one class
        _check(fused, model, 3, points)
    assert [r.signature for r in fused.reports()] == ["(float32[3, 45, 12])", "(float32[3, 41, 12])"]
    assert original_runs == []


class PerPointScale(nn.Module):
    """Inputs that broadcast against the points: a per-point weight ``[B, N, 1]``, and a
    position table ``[1, N, C]`` read through a permuted (channels-first) view."""

    def forward(self, x, weight, table):
        h = F.gelu(x * weight + table.transpose(1, 2).transpose(1, 2))
        return torch.softmax(h, dim=-1) - h.amax(dim=1, keepdim=True)


def test_broadcast_and_permuted_inputs_with_a_dynamic_dim(tmp_path, original_runs):
    model = PerPointScale()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path))
    names = []
    for points in (29, 37, 53):
        x, weight = torch.randn(2, points, 6), torch.rand(2, points, 1) + 0.5
        table = torch.randn(1, 6, points).transpose(1, 2)  # [1, N, C], channels-first in memory
        for t in (x, weight, table):
            autofuser.mark_dynamic(t, 1)
        with torch.no_grad():
            torch.testing.assert_close(fused(x, weight, table), model(x, weight, table), atol=1e-5, rtol=1e-5)
        names.append(set(_sources(fused)))
    assert names[0] and names[0] == names[1] == names[2]
    assert original_runs == []


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-2), (torch.bfloat16, 8e-2)])
def test_half_precision_with_a_dynamic_dim(tmp_path, dtype, tol):
    model = _model().to(dtype)
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), dynamic=True)
    for points in (37, 77):
        x = torch.randn(3, points, 12, dtype=dtype)
        with torch.no_grad():
            got, want = fused(x), model(x)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert fused.report().fused and all(g.run_time_sizes for g in fused.report().fused)


def test_training_with_a_dynamic_dim_gives_eager_gradients(tmp_path):
    model = PointCloudBlock().train()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), dynamic=True, verify_speed=False)
    for points in (37, 45):
        x = torch.randn(2, points, 12)
        fused(x).square().mean().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).square().mean().backward()
        for g, want in zip(got, (p.grad for p in model.parameters())):
            torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4)
        model.zero_grad()
    report = fused.report()
    assert report.dynamic_dims and report.fused and all(g.run_time_sizes for g in report.fused)


class PointStatistics(nn.Module):
    """Statistics over the points, a reduced dim that varies: mean, variance (N - 1),
    standard deviation and RMS."""

    def forward(self, x):
        centred = (x - x.mean(1, keepdim=True)) / (x.var(1, keepdim=True) + 1e-5).sqrt()
        return centred + x.std(1, keepdim=True, correction=0) * x.pow(2).mean(1, keepdim=True).sqrt()


def test_statistics_over_a_dynamic_reduced_dim_share_kernels(tmp_path, original_runs):
    model = PointStatistics()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), dynamic=True)
    names = []
    for points in (37, 101, 301):  # three buckets: BLOCK_R 64, 128, 512
        x = torch.randn(3, points, 7) * 3.0 + 1.0
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
        names.append(set(_sources(fused)))
        assert all(g.run_time_sizes for g in fused.report().fused)
    assert names[0] and names[0] == names[1] == names[2]
    assert original_runs == []


def test_sources_of_unchanging_shapes_are_those_of_dynamic_false(tmp_path):
    x = torch.randn(3, 37, 12)
    bodies = []
    for dynamic in (None, False):
        fused = autofuser.fuse(_model(), progress=False, cache_dir=str(tmp_path / str(dynamic)), dynamic=dynamic)
        with torch.no_grad():
            fused(x)
            fused(x)
        bodies.append({name: source.split("@triton.jit", 1)[1] for name, source in _sources(fused).items()})
    assert bodies[0] and bodies[0] == bodies[1]
    assert not any("sz0" in body for body in bodies[0].values())


class PaddedChannels(nn.Module):
    """Shifted reads (a pad and a roll) along the channels, with the points dynamic."""

    def forward(self, x):
        h = F.pad(x, (1, 2))
        return torch.sigmoid(h) * 2.0 + torch.roll(h, 1, dims=2)


def test_shifted_reads_along_a_static_dim_share_kernels(tmp_path, original_runs):
    model = PaddedChannels()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), dynamic=True)
    names = []
    for points in (37, 45, 101):
        x = torch.randn(2, points, 6)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-6)
        names.append(set(_sources(fused)))
    assert names[0] and names[0] == names[1] == names[2]
    assert original_runs == []


def test_reset_forgets_which_dims_changed(tmp_path):
    model = _model()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path))
    for points in (37, 45):
        _check(fused, model, 3, points)
    assert fused.report().dynamic_dims  # the second count made dim 1 dynamic
    fused.reset()
    _check(fused, model, 3, 53)
    assert fused.report().dynamic_dims == []  # specialised first again
    _check(fused, model, 3, 59)
    assert fused.report().dynamic_dims


def test_dynamic_true_is_dynamic_from_the_start(tmp_path, original_runs):
    model = _model()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), dynamic=True)
    for points in (41, 59):
        _check(fused, model, 3, points)
    report = fused.report()
    assert any(d.startswith("x dim 1") for d in report.dynamic_dims)
    assert all(g.run_time_sizes for g in report.fused)
    assert len(_kernel_files(tmp_path)) == len(report.fused)
    assert original_runs == []


def test_dynamic_false_specialises_every_shape_as_before(tmp_path, original_runs):
    model = _model()
    fused = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), dynamic=False, max_signatures=2)
    x = torch.randn(3, 37, 12)
    autofuser.mark_dynamic(x, 1)  # ignored: dynamic=False
    with torch.no_grad():
        fused(x)
    first = _sources(fused)
    assert not any("sz0" in source for source in first.values())
    _check(fused, model, 3, 45)
    assert set(_sources(fused)).isdisjoint(first), "each shape its own specialised kernels"
    assert len(fused.reports()) == 2 and all(not r.dynamic_dims for r in fused.reports())
    with pytest.warns(UserWarning, match="max_signatures"):
        _check(fused, model, 3, 59)
    assert original_runs == [True]


def test_bad_dynamic_input_is_refused_with_the_fix():
    x = torch.randn(2, 5, 3)
    with pytest.raises(autofuser.AutoFuserError, match=r"dim 3 is out of range.*\[-3, 2\]"):
        autofuser.mark_dynamic(x, 3)
    with pytest.raises(autofuser.AutoFuserError, match="is not an int"):
        autofuser.mark_dynamic(x, "1")
    with pytest.raises(autofuser.AutoFuserError, match="0-d tensor"):
        autofuser.mark_dynamic(torch.tensor(1.0), 0)
    with pytest.raises(autofuser.AutoFuserError, match="takes a torch.Tensor"):
        autofuser.mark_dynamic([1, 2], 0)
    with pytest.raises(autofuser.AutoFuserError, match=r"dynamic='yes'.*give None .* True or False"):
        autofuser.fuse(_model(), dynamic="yes")
    autofuser.mark_dynamic(x, -2)
    assert x._autofuser_dynamic_dims == frozenset({1})


def test_sizes_derived_from_a_dynamic_size_are_named_others_stay_literal():
    rule = SizeRule(dynamic=frozenset({37}), static=frozenset({12, 20}))
    with size_rule(rule), collecting_sizes(True) as named:
        assert sized(37) == "sz0" and sized(3 * 37) == "sz1" and sized(37) == "sz0"
        assert sized(20) == "20" and sized(12) == "12" and sized(1) == "1" and sized(38) == "38"
    assert named is not None and named.values == {"sz0": 37, "sz1": 111}
    with collecting_sizes(True) as none:  # no rule: specialised
        assert none is None and sized(37) == "37"


def test_tuning_is_keyed_by_size_bucket():
    device = torch.device("cpu")

    class Options:
        tune_all_configs = False

    def key(points):
        source = KernelSource("af_k", "x = 1", "rows", lambda c: (1,), sizes={"sz0": 3 * points})
        source.size_buckets = (bucket(points),)
        return _tuning_key(source, device, Options())

    assert key(37) == key(45)  # both in bucket 64
    assert key(37) != key(101)
    assert key(101)["size_buckets"] == [128]
    assert "size_buckets" not in _tuning_key(KernelSource("af_k", "x = 1", "rows", lambda c: (1,)), device, Options())
