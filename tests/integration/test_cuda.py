"""GPU-only behaviour: real kernels, tuning and CUDA-graph replay.

Skipped without a CUDA device (CI has none); `benchmarks/gpu_run.sh` runs them.
"""

import warnings

import pytest
import torch

import autofuser

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class ResidualNorm(torch.nn.Module):
    def __init__(self, width=37):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        torch.nn.init.normal_(self.norm.weight)
        torch.nn.init.normal_(self.norm.bias)

    def forward(self, x, r):
        return torch.nn.functional.gelu(self.norm(x + r)) * 0.5


def _inputs(batch=3):
    return torch.randn(batch, 221, 37, device="cuda"), torch.randn(batch, 221, 37, device="cuda")


class Deep(torch.nn.Module):
    """Many small kernels with eager ops between them: launch-bound, where a graph pays."""

    def __init__(self, width=37, depth=8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ResidualNorm(width) for _ in range(depth))
        self.norm = self.blocks[0].norm

    def forward(self, x, r):
        for block in self.blocks:
            x = block(x, r).flip(1)
        return x


def test_cuda_graph_replay_is_right_and_never_overwrites_results():
    torch.manual_seed(0)
    model = Deep().cuda().eval()
    fused = autofuser.fuse(model, progress=False, verify_speed=False)
    with torch.no_grad():
        x, r = _inputs()
        first = fused(x, r)
        assert any("replays as one CUDA graph" in note for note in fused.report().notes), fused.report()
        # the kernels inside the captured forward are still listed
        assert {k.__name__ for k in fused.kernels()} == {g.kernel for g in fused.report().fused}, fused.report()
        keep = first.clone()
        x2, r2 = _inputs()
        second = fused(x2, r2)
        torch.testing.assert_close(first, keep, atol=0, rtol=0)  # the first result was not overwritten
        torch.testing.assert_close(second, model(x2, r2), atol=1e-5, rtol=1e-4)
        # an in-place weight update is seen by the replay, without recompiling
        model.norm.weight.mul_(-2)
        torch.testing.assert_close(fused(x2, r2), model(x2, r2), atol=1e-5, rtol=1e-4)
        # a replaced parameter is not baked in: the call runs uncaptured and is right
        model.norm.weight = torch.nn.Parameter(torch.randn(37, device="cuda"))
        torch.testing.assert_close(fused(x2, r2), model(x2, r2), atol=1e-5, rtol=1e-4)
    assert len(fused.reports()) == 1


class CastsAWeight(torch.nn.Module):
    """A fused norm, then a product AutoFuser leaves eager, whose weight autocast casts to bf16
    (and caches the cast while its region lasts)."""

    def __init__(self, width=37):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mix = torch.nn.Parameter(torch.randn(width) / width**0.5)

    def forward(self, x, r):
        y = torch.nn.functional.gelu(self.norm(x + r))
        return y * torch.mv(y.flatten(0, 1), self.mix).view(*y.shape[:2], 1)


def test_a_replayed_forward_under_autocast_stays_right_after_its_region_ends():
    """A graph captured under autocast must not read a cast autocast cached: the cache is
    freed when the region ends, and a later replay would read whatever took its memory."""
    torch.manual_seed(2)
    model = CastsAWeight().cuda().eval()
    fused = autofuser.fuse(model, progress=False, verify_speed=False)
    held: list = []
    for _ in range(4):
        x, r = _inputs(2)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            got = fused(x, r)
            want = model(x, r)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=4e-2)
        # Take what the region freed, and hold it through the next call, as a loop's next
        # allocations would.
        held[:] = [torch.full((n,), float("nan"), device="cuda") for n in (37, 64, 256, 4096) for _ in range(16)]
    assert any("replays as one CUDA graph" in note for note in fused.report().notes), fused.report()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_model_on_another_gpu_than_the_current_one_runs_its_kernels_there():
    """Triton launches on the current device; a model moved to the second GPU without
    torch.cuda.set_device must still compute right, forward and backward."""
    torch.manual_seed(3)
    assert torch.cuda.current_device() == 0
    model = ResidualNorm().to("cuda:1")
    fused = autofuser.fuse(model, progress=False, verify_speed=False)
    x, r = (t.to("cuda:1").requires_grad_() for t in _inputs(2))
    got = fused(x, r)
    assert got.device == torch.device("cuda:1") and fused.report().fused, fused.report()
    torch.testing.assert_close(got, model(x, r), atol=1e-5, rtol=1e-4)
    (grad,) = torch.autograd.grad(got.square().sum(), [x])
    (want,) = torch.autograd.grad(model(x, r).square().sum(), [x])
    torch.testing.assert_close(grad, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(fused(x, r), model(x, r), atol=1e-5, rtol=1e-4)


def test_tuning_caches_and_reuses_configs(tmp_path):
    torch.manual_seed(0)
    model = ResidualNorm().cuda().eval()
    x, r = _inputs()
    with torch.no_grad():
        first = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), verify_speed=False)
        first(x, r)
        second = autofuser.fuse(model, progress=False, cache_dir=str(tmp_path), verify_speed=False)
        torch.testing.assert_close(second(x, r), model(x, r), atol=1e-5, rtol=1e-4)
    assert first.report().fused and not any(g.cache_hit for g in first.report().fused)
    assert all(g.cache_hit for g in second.report().fused)
    assert list((tmp_path / "tuning").glob("*.json"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bf16_autocast_and_dtypes_on_gpu(dtype):
    torch.manual_seed(1)
    model = ResidualNorm().cuda().eval().to(dtype)
    x, r = (t.to(dtype) for t in _inputs(1))
    tol = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-2), torch.bfloat16: (1e-2, 4e-2)}[dtype]
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, verify_speed=False)
        torch.testing.assert_close(fused(x, r), model(x, r), atol=tol[0], rtol=tol[1])


def test_tuning_configs_compile_in_parallel_worker_processes(tmp_path):
    """Every config tuning times is compiled up front by the worker pool, not one by one."""
    torch.manual_seed(0)
    model = ResidualNorm().cuda()
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), tune=True, tune_budget_s=5.0)
    x, r = _inputs()
    torch.testing.assert_close(fused(x, r), model(x, r), rtol=1e-5, atol=1e-5)
    report = fused.report()
    notes = [n for n in report.notes if "in parallel before timing" in n]
    assert notes, report.notes
    compiled, wanted = (int(w) for w in notes[0].split()[1:4:2])
    assert compiled == wanted > 1, notes[0]
    assert report.phases["parallel_compile"] > 0


# ---------------------------------------------------------------------------
# Training and several processes on a real GPU
# ---------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Layer norm, an MLP and a residual: groups with products, reductions and pointwise ops."""

    def __init__(self, width=48, hidden=96):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return self.head(torch.tanh(x))


@pytest.mark.parametrize("autocast", [False, True])
def test_training_on_gpu_matches_eager(autocast):
    """Real kernels forward, recomputed eager ops backward: the same losses and first gradients."""
    import copy

    torch.manual_seed(3)
    model = Block().cuda().train()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, verify_speed=False)
    x, y = torch.randn(4, 211, 48, device="cuda"), torch.randn(4, 211, 1, device="cuda")

    def train(module, weights):
        optimiser = torch.optim.Adam(module.parameters(), lr=1e-3)
        losses, first = [], {}
        for step in range(4):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.mse_loss(module(x).float(), y)
            optimiser.zero_grad()
            loss.backward()
            if step == 0:
                first = {n: p.grad.clone() for n, p in weights.named_parameters()}
            optimiser.step()
            losses.append(loss.item())
        return losses, first

    expected, expected_grads = train(reference, reference)
    got, got_grads = train(fused, model)
    assert fused.report().fused and len(fused.reports()) == 1
    tol = dict(atol=2e-2, rtol=4e-2) if autocast else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, expected, **tol)
    for name, grad in got_grads.items():
        scale = max(1.0, float(expected_grads[name].abs().max()))
        torch.testing.assert_close(grad, expected_grads[name], atol=tol["atol"] * scale, rtol=tol["rtol"], msg=name)


def test_two_processes_tune_each_kernel_once(tmp_path):
    """Two processes compile the same model into one cache at once: each kernel is
    timed by one of them, and the other reads its result."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "tune.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys, time
        import torch
        import autofuser
        sys.path.insert(0, sys.argv[2])
        from test_cuda import Block

        torch.manual_seed(3)
        model = Block().cuda().eval()
        x = torch.randn(4, 211, 48, device="cuda")
        while time.time() < float(sys.argv[3]):  # start together
            time.sleep(0.01)
        with torch.no_grad():
            fused = autofuser.fuse(model, progress=False, verify_speed=False, tune_budget_s=5.0)
            torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
        json.dump([g.model_dump() for g in fused.report().fused], open(sys.argv[1], "w"))
    """)
    )
    start = __import__("time").time() + 20
    env = {**os.environ, "AUTOFUSER_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"{k}.json"), os.path.dirname(__file__), str(start)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
    runs = [{g["kernel"]: g for g in json.loads((tmp_path / f"{k}.json").read_text())} for k in range(2)]
    assert runs[0] and set(runs[0]) == set(runs[1])
    for kernel in runs[0]:
        assert sorted(run[kernel]["cache_hit"] for run in runs) == [False, True], kernel
        assert runs[0][kernel]["config"] == runs[1][kernel]["config"]


class _FreshBufferWrite(torch.nn.Module):
    """FNO's pattern: a buffer made in the forward and written into by slice assignment."""

    def forward(self, x):
        out = torch.zeros(x.shape[0], 64, 37, device=x.device)
        out[:, :40, :20] = torch.nn.functional.gelu(x[:, :40, :20] * 2)
        return out * 3 + 1


class _InputWrite(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)
        return torch.nn.functional.gelu(x) + 1


def test_writes_into_fresh_tensors_allow_a_graph_and_writes_into_inputs_forbid_it():
    fresh = autofuser.fuse(_FreshBufferWrite().eval(), progress=False, verify_speed=False)
    writer = autofuser.fuse(_InputWrite().eval(), progress=False, verify_speed=False)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 64, 37, device="cuda")
            torch.testing.assert_close(fresh(x), _FreshBufferWrite()(x), atol=1e-5, rtol=1e-4)
        assert not any("writes into its inputs" in n for n in fresh.report().notes), fresh.report()
        for _ in range(3):
            x = torch.randn(3, 64, 37, device="cuda")
            mine, theirs = x.clone(), x.clone()
            torch.testing.assert_close(writer(mine), _InputWrite()(theirs), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine, theirs, atol=0, rtol=0)  # the caller's tensor written, as in eager
        assert any("writes into its inputs" in n for n in writer.report().notes), writer.report()


def test_the_tuning_timer_agrees_with_tritons():
    """``timing.bench`` (a capped number of calls, L2 flushed before each) measures what
    Triton's ``do_bench`` does, for a memory-bound op of about 0.1 ms and a tiny one, and
    (three calls only) for a product longer than ``rep_ms``."""
    import triton.testing

    from autofuser_core.timing import bench

    for numel in (24 << 20, 1 << 12):
        x = torch.randn(numel, device="cuda")
        ours = bench(torch.mul, x, 2.0, rep_ms=20)
        theirs = float(triton.testing.do_bench(lambda: torch.mul(x, 2.0), warmup=25, rep=100, return_mode="median"))
        assert abs(ours - theirs) <= 0.15 * theirs + 0.003, (numel, ours, theirs)
    a = torch.randn(6144, 6144, device="cuda")
    calls = []

    def product(m):
        calls.append(1)
        return m @ m

    theirs = float(triton.testing.do_bench(lambda: a @ a, warmup=25, rep=100, return_mode="median"))
    ours = bench(product, a, rep_ms=theirs / 2)  # a call longer than rep_ms, whatever the precision
    assert len(calls) == 4, len(calls)  # one untimed call, three timed
    assert abs(ours - theirs) <= 0.1 * theirs, (ours, theirs)


def test_a_gpu_bound_forward_runs_without_a_graph_and_is_right(tmp_path):
    """Three 8192-square products (tens of ms of GPU work in five calls): their launches
    hide behind the GPU's work, so no graph is tried, and the output still matches eager."""
    torch.manual_seed(0)
    width = 8192
    model = (
        torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.GELU(),
            torch.nn.Linear(width, width),
            torch.nn.GELU(),
            torch.nn.Linear(width, width),
        )
        .cuda()
        .eval()
    )
    x = torch.randn(width, width, device="cuda")
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False, tune=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=2e-3, rtol=2e-3)
    notes = " ".join(fused.report().notes)
    assert "no CUDA graph (the forward is GPU-bound" in notes, notes


def test_kernels_launch_directly_after_their_first_call_and_fall_back_for_other_alignments():
    """After a kernel's first launch, later calls skip Triton's argument binding
    (``DirectLaunch``); an input 4 bytes off a 16-byte boundary is one Triton compiled
    another kernel for, and goes through Triton again."""
    torch.manual_seed(0)
    model = ResidualNorm().cuda().eval()
    fused = autofuser.fuse(model, progress=False, verify_speed=False, cuda_graphs=False)
    with torch.no_grad():
        x, r = _inputs()
        torch.testing.assert_close(fused(x, r), model(x, r), atol=1e-5, rtol=1e-4)
        (kernel,) = fused.kernels()
        assert kernel.direct is not None
        direct = kernel.direct
        x2, r2 = _inputs()
        torch.testing.assert_close(fused(x2, r2), model(x2, r2), atol=1e-5, rtol=1e-4)
        assert kernel.direct is direct
        storage = torch.randn(x.numel() + 1, device="cuda")
        shifted = storage[1:].view_as(x)  # same shape and strides, 4 bytes off
        out = torch.empty_like(x)
        assert direct.values(kernel.with_live_attrs([x2, r2]) + [out]) is not None
        assert direct.values(kernel.with_live_attrs([shifted, r2]) + [out]) is None
        torch.testing.assert_close(fused(shifted, r2), model(shifted, r2), atol=1e-5, rtol=1e-4)


class FillFromHostScalar(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x.masked_fill(x > 1.0, torch.tensor(2.5))) * 3.0


def test_a_kernel_reading_a_host_scalar_runs_without_a_graph_and_without_warnings():
    """The forward makes a one-element tensor in host memory, which the kernel reads from a
    copy on the GPU: a CUDA graph can't capture that copy, so none is tried (a failed
    capture makes torch warn) and the report says why."""
    model = FillFromHostScalar().eval()
    fused = autofuser.fuse(model, progress=False, verify_speed=False)  # kept fused whatever its speed
    x = torch.randn(3, 221, 37, device="cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fused(x)
        again = fused(x)
    assert not [w for w in caught if "graph" in str(w.message).lower()], [str(w.message) for w in caught]
    assert fused.report().fused, fused.report()
    assert any("host memory" in note for note in fused.report().notes), fused.report().notes
    torch.testing.assert_close(got, model(x), atol=0, rtol=0)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_the_training_check_in_use_times_real_steps_with_cuda_events(tmp_path):
    """The compile's step check is told the fused step won (a stand-in for its clocks);
    the check in use then times the loop's own steps with CUDA events and settles, while
    the parameters stay eager's."""
    import copy

    from autofuser_core import in_use, timing

    class FusedWinsAtCompile(timing.Timer):
        def bench(self, fn, *args, rep_ms=20):
            return 0.5 if getattr(fn, "fused", False) else 1.0

        def forward_ms(self, fn, args, once_ms=None):
            return 0.5 if getattr(fn, "fused", isinstance(fn, torch.fx.GraphModule)) else 1.0

    torch.manual_seed(5)
    model = Block().cuda().train()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 211, 48, device="cuda"), torch.randn(4, 211, 1, device="cuda")
    optimisers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    with timing.using(FusedWinsAtCompile()):
        fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
        for step in range(1 + in_use.MAX_ROUNDS * len(in_use.PLAN) + 2):
            for module, optimiser in zip((fused, reference), optimisers):
                loss = torch.nn.functional.mse_loss(module(x), y)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
            if step == 0:
                assert fused.checking_in_use
    assert not fused.checking_in_use
    notes = " ".join(fused.report().notes)
    assert "training step in use" in notes and " ms original per call" in notes, notes
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4, msg=name)
