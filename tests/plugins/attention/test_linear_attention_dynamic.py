"""Linear attention with a point count that varies (docs/dynamic.md, docs/attention.md).

The ``linear_attention`` strategy takes the point count N at run time: a Galerkin
block called on many odd counts gives eager's outputs every time, writes one chain
source for all the counts of a size bucket (the ``/ n`` and the splits' share of
the points read at launch), and never runs the original model for lack of
signatures; its training step gives eager's gradients; with ``dynamic=False`` (or
on a first call) its source is what it always was. A Fourier chain as written runs
the online kernel, which stays specialised, and its report entry says so.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
from einops import rearrange
from test_attention import TOLERANCES  # the softmax attention tests' tolerances
from test_linear_attention import Fourier, _fourier_inputs, warmup_calls

import autofuser
from autofuser_core.dynamic import bucket

HEADS, WIDTH = 2, 16
#: Odd point counts over four size buckets (64, 128, 256, 512), none a divisor of a
#: static size of the block below.
POINT_COUNTS = (37, 45, 59, 77, 101, 155, 211, 301)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class GalerkinBlock(nn.Module):
    """A Galerkin Transformer's attention: the qkv projection, ``q @ (LN(k)^T @ LN(v)) / n``
    over ``HEADS`` heads (einsum, or matmul with ``* (1.0 / n)``), the output projection."""

    def __init__(self, channels: int = 20, style: str = "einsum"):
        super().__init__()
        self.style = style
        self.to_qkv = nn.Linear(channels, 3 * HEADS * WIDTH)
        self.norm_k, self.norm_v = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        for p in (*self.norm_k.parameters(), *self.norm_v.parameters()):
            nn.init.normal_(p)  # a lowering that dropped them would show
        self.out = nn.Linear(HEADS * WIDTH, channels)

    def forward(self, x):
        n = x.shape[1]
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=HEADS) for t in self.to_qkv(x).chunk(3, dim=-1))
        k, v = self.norm_k(k), self.norm_v(v)
        if self.style == "einsum":
            context = torch.einsum("bhnd,bhne->bhde", k, v) / n
            z = torch.einsum("bhnd,bhde->bhne", q, context)
        else:
            z = torch.matmul(q, torch.matmul(k.transpose(-2, -1), v) * (1.0 / n))
        return self.out(rearrange(z, "b h n d -> b n (h d)")) + x


def _attention(fused):
    (group,) = [g for g in fused.report().groups if g.strategy == "linear_attention"]
    return group


def _fuse(model, tmp_path, **options):
    return autofuser.fuse(model, progress=False, verify_speed=False, cache_dir=str(tmp_path), **options)


@pytest.mark.parametrize("style,precision", [("einsum", "fp32"), ("einsum", "bf16"), ("matmul", "fp32")])
def test_galerkin_block_on_many_point_counts_writes_one_source_per_bucket(tmp_path, original_runs, style, precision):
    model = GalerkinBlock(style=style).eval()
    fused = _fuse(model, tmp_path)  # dynamic=None: the second count makes the points dynamic
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    by_class: dict[tuple[int, int], set[str]] = {}  # (batch, size bucket) -> chain sources
    # The matmul form differs only in its scale (``* (1.0 / n)``), bf16 only in its rounding
    # (which counts share a source is the same): fewer counts suffice, one per bucket but
    # the first's, where a second count shares the source of the first dynamic one.
    few = ((3, (37, 45, 59, 101, 301)), (1, (77,)))
    calls = ((3, POINT_COUNTS), (1, POINT_COUNTS[::3])) if (style, precision) == ("einsum", "fp32") else few
    for batch, counts in calls:
        for number, points in enumerate(counts):
            x = torch.randn(batch, points, 20) * 2.0 + 0.5
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                got, want = fused(x), model(x)
            assert got.dtype == want.dtype
            # bf16 products round to bf16 steps of the outputs' size (about 20 here; the
            # residual adds small values to them): the absolute tolerance scales with it.
            scale = want.abs().max().item() if precision == "bf16" else 1.0
            tol = TOLERANCES[dtype]
            torch.testing.assert_close(
                got.float(),
                want.float(),
                atol=tol["atol"] * scale,
                rtol=tol["rtol"],
                msg=f"batch {batch}, {points} points",
            )
            group = _attention(fused)
            assert group.fused, group.reason
            if batch == 3 and number == 0:
                assert not group.run_time_sizes, "the first call is specialised on its shape"
                continue
            # The point count, and what derives from it, reach the chain at run time.
            assert points in group.run_time_sizes.values(), group.run_time_sizes
            assert group.specialised is None
            by_class.setdefault((batch, bucket(points)), set()).add(group.kernel)
    # Batch 1 is a shape class of its own (size-1 dims are specialised, as in torch).
    assert set(by_class) == {(b, bucket(p)) for b, counts in calls for p in counts if (b, p) != (3, 37)}
    assert all(len(names) == 1 for names in by_class.values()), by_class
    assert original_runs == []


def test_galerkin_training_step_gives_eager_gradients_at_two_counts(tmp_path):
    model = GalerkinBlock().train()
    fused = _fuse(model, tmp_path, dynamic=True)
    kernels = set()
    for points in (37, 101):
        x = torch.randn(2, points, 20, requires_grad=True)
        fused(x).square().mean().backward()
        got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        x.grad = None
        model(x).square().mean().backward()
        want = [x.grad] + [p.grad for p in model.parameters()]
        for name, g, w in zip(["x"] + [n for n, _ in model.named_parameters()], got, want):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"{points} points: gradient of {name}")
        model.zero_grad()
        group = _attention(fused)
        assert group.fused and points in group.run_time_sizes.values(), (group.reason, group.run_time_sizes)
        kernels.add(group.kernel)
    assert len(kernels) == 1


def test_sources_of_an_unchanging_shape_are_those_of_dynamic_false(tmp_path):
    x = torch.randn(3, 37, 20)
    sources = []
    for dynamic in (None, False):
        torch.manual_seed(0)
        fused = _fuse(GalerkinBlock().eval(), tmp_path / str(dynamic), dynamic=dynamic)
        with torch.no_grad():
            fused(x)
            fused(x)
        sources.append(_attention(fused).kernel_source)
    assert sources[0] and sources[0] == sources[1]
    assert "sz0" not in sources[0] and "/ 37" in sources[0]
    # ... while a dynamic compile of the same shape reads the count at run time.
    torch.manual_seed(0)
    fused = _fuse(GalerkinBlock().eval(), tmp_path / "true", dynamic=True)
    with torch.no_grad():
        fused(x)
    source = _attention(fused).kernel_source
    assert "/ 37" not in source and "sz0" in source


def test_fourier_reassociated_takes_the_count_at_run_time_as_written_stays_specialised(tmp_path, original_runs):
    names: dict[bool, set[str]] = {True: set(), False: set()}
    for reassociate in (True, False):
        fused = _fuse(Fourier("none").eval(), tmp_path / str(reassociate), reassociate_products=reassociate)
        for points in (37, 45, 53):
            inputs = _fourier_inputs(1, points, 16, torch.float32)
            with torch.no_grad():
                torch.testing.assert_close(fused(*inputs), Fourier("none")(*inputs), **TOLERANCES[torch.float32])
            group = _attention(fused)
            assert group.fused, group.reason
            if points != 37:
                names[reassociate].add(group.kernel)
                if reassociate:
                    assert points in group.run_time_sizes.values()
                else:
                    assert not group.run_time_sizes and "written for each shape" in group.specialised
                    assert "don't take run-time sizes): linear_attention." in str(fused.report())
    assert len(names[True]) == 1 and len(names[False]) == 2
    assert original_runs == []


def test_chain_warmup_passes_each_stage_its_run_time_sizes(tmp_path):
    """``warmup`` (the parallel compiler's entry point) gives each kernel of the chain the
    run-time sizes it takes, after its pointers, as a launch would."""
    fused = _fuse(GalerkinBlock().eval(), tmp_path, dynamic=True)
    with torch.no_grad():
        fused(torch.randn(3, 45, 20))
    (kernel,) = [k for k in fused.kernels() if k.source.layout == "attention_chain"]
    calls, stages = warmup_calls(kernel)
    assert [name for name, _, _ in calls] == [s["name"] for s in stages]
    assert all(s.get("sizes") for s in stages), "every stage reads the point count"
    for (_, args, _), stage in zip(calls, stages):
        sizes = args[len(stage["pointers"]) :]
        assert list(sizes) == [kernel.launch_args[s] for s in stage["sizes"]]
        assert 45 in sizes  # the point count, which every stage reads
