"""The MLP kernel's persistent form (``plugins/matmul/mlp/mlp_kernel.py``).

Where both weights of a 16-bit MLP fit in shared memory together, the kernel
has a second form: a grid of one program per multiprocessor (4 on a CPU), each
loading both weights once and walking row blocks. Each of its configs is run
here (under the interpreter without a GPU) - with several row blocks per
program and a last, partial block - and checked against eager on awkward
shapes; and the form is offered exactly where it fits.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.launch import FusedKernel, cast_inputs
from autofuser_core.planner import plan_fusion_groups
from autofuser_plugins.matmul.mlp import mlp_layout
from autofuser_plugins.matmul.mlp import strategy as mlp

TOLERANCES = {torch.float16: dict(atol=2e-3, rtol=1e-2), torch.bfloat16: dict(atol=2e-2, rtol=4e-2)}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture(autouse=True)
def _small_shapes(monkeypatch):
    """The form is offered from 67584 rows; the interpreter runs it on a few hundred. With
    4 programs (not one per multiprocessor, on a GPU too) every program walks several row
    blocks of these few hundred rows."""
    monkeypatch.setattr(mlp_layout, "PERSISTENT_MIN_ROWS", 1)
    monkeypatch.setattr(mlp, "multiprocessors", lambda without_gpu: 4)


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int, norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def mlp_kernel(fused) -> FusedKernel:
    (kernel,) = [k for k in fused.kernels() if k.source.layout == "mlp"]
    return kernel


def run_config(kernel: FusedKernel, program, x: torch.Tensor, config: dict) -> torch.Tensor:
    """The kernel launched with ``config``, its inputs converted as that config's launcher converts them."""
    inputs = cast_inputs(kernel.with_live_attrs([x]), kernel.source.casts(program, config))
    ((shape, stride, dtype),) = kernel.output_layout
    out = torch.empty_strided(shape, stride, dtype=dtype, device=x.device)
    kernel.kernel[kernel.source.grid(config)](*inputs, out, **kernel.source.launch_args(config))
    return out


def fused_mlp(model, x, autocast: bool):
    """The fused model's MLP kernel, the planned program behind it (whose layout the
    strategy's configs read), and eager's output."""
    with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        expected = model(x)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        fused(x)
        plan = plan_fusion_groups(autofuser.capture(model, x), autofuser.load_plugins().registry)
    (program,) = [c.program for c in plan.kept if c.strategy.name == "mlp"]
    return mlp_kernel(fused), program, expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "rows,width,hidden,norm", [(3 * 221, 96, 200, False), (37, 24, 40, True), (2 * 221, 128, 256, True)]
)
def test_every_persistent_config_matches_eager(dtype, rows, width, hidden, norm, device):
    model = Mlp(width, hidden, norm).to(device, dtype).eval()
    x = torch.randn(rows, width, dtype=dtype, device=device)
    kernel, program, expected = fused_mlp(model, x, autocast=False)
    program_configs = [c for c in mlp.configs(program) if c.get("PERSISTENT")]
    assert program_configs, "the weights fit: the persistent form must be offered"
    assert "if PERSISTENT:" in kernel.source.source
    ran = split_ran = 0
    for config in program_configs:
        if mlp.is_valid(program, config) is not None:
            continue
        blocks = -(-rows // config["BLOCK_M"])
        split_fits = mlp.is_valid(program, {**config, "SPLIT_TAIL": 1}) is None
        assert config["SPLIT_TAIL"] == (mlp.split_tail(rows, config["BLOCK_M"], config["PROGRAMS"]) and split_fits)
        # Either way round where it fits, also where the strategy would not split (no whole
        # round, or half blocks for more than one round): the split is a matter of speed only.
        for split in (0, 1) if split_fits else (0,):
            config = {**config, "SPLIT_TAIL": split}
            programs = config["PROGRAMS"] if split else min(blocks, config["PROGRAMS"])
            assert kernel.source.grid(config) == (programs,)
            got = run_config(kernel, program, x, config)
            torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
            split_ran += split
        ran += 1
    assert ran >= 2
    assert split_ran or rows < 4 * 128, "the split tail must run where there are whole rounds"
    # The other form, from the same source, still agrees.
    regular = [c for c in mlp.configs(program) if not c.get("PERSISTENT")][0]
    torch.testing.assert_close(run_config(kernel, program, x, regular).float(), expected.float(), **TOLERANCES[dtype])


def test_persistent_form_with_64_bit_offsets(monkeypatch, device):
    """Past 2^31 elements the row offsets are 64-bit: the persistent form's row blocks
    (split or not) cast their index as the streamed form casts its program id."""
    from autofuser_plugins.matmul.mlp import mlp_kernel as kernel_module

    monkeypatch.setattr(kernel_module, "needs_int64", lambda program: True)
    # fp16: the offsets' width does not depend on the dtype, and the interpreter runs fp16
    # products in half bf16's time (bf16's own persistent runs are checked above).
    model = Mlp(96, 200, norm=False).to(device, torch.float16).eval()
    x = torch.randn(3 * 221, 96, dtype=torch.float16, device=device)
    kernel, program, expected = fused_mlp(model, x, autocast=False)
    assert "pid_m = tl.cast((2 * whole + tile), tl.int64)" in kernel.source.source
    configs = [c for c in mlp.configs(program) if c.get("PERSISTENT") and mlp.is_valid(program, c) is None]
    assert any(c["SPLIT_TAIL"] for c in configs)
    for config in configs:
        for split in (0, 1) if mlp.is_valid(program, {**config, "SPLIT_TAIL": 1}) is None else (0,):
            got = run_config(kernel, program, x, {**config, "SPLIT_TAIL": split})
            torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[torch.float16])


def test_split_tail_where_the_last_round_is_shorter_as_half_blocks():
    # 705 blocks of 128 rows on 132 programs: 5 whole rounds, then 89 half blocks (one round).
    assert mlp.split_tail(90168, 128, 132)
    # 738 blocks of 128: 5 whole rounds, then 157 half blocks - two rounds, no shorter.
    assert not mlp.split_tail(94480, 128, 132)
    assert not mlp.split_tail(132 * 128 * 5, 128, 132)  # no last round to shorten
    assert not mlp.split_tail(100 * 128, 128, 132)  # no whole round: one block per program already
    # Half blocks of 32 rows (one round of 2 here) run their products in another form: not split.
    assert not mlp.split_tail(8 * 64 + 60, 64, 4)
    assert mlp.split_tail(8 * 128 + 60, 128, 4)


def test_persistent_form_under_autocast_converts_its_weights_itself(device):
    """Autocast over fp32 weights: the streamed form reads them converted once by the
    launcher; the persistent form reads them as they are and converts them in its prologue."""
    model = Mlp(64, 160, norm=False).to(device).eval()
    x = torch.randn(300, 64, device=device)
    kernel, program, expected = fused_mlp(model, x, autocast=True)
    streamed = next(c for c in mlp.configs(program) if not c.get("PERSISTENT"))
    persistent = next(c for c in mlp.configs(program) if c.get("PERSISTENT"))
    weights = {"fc1.weight", "fc2.weight"}
    assert {kernel.attr_inputs[slot] for slot, _ in kernel.source.casts(program, streamed)} == weights
    assert kernel.source.casts(program, persistent) == []
    for config in (streamed, persistent):
        got = run_config(kernel, program, x, config)
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[torch.bfloat16])
    # The same rounding either way (to nearest even): the two forms agree to the bit
    # wherever their products agree, so the persistent form launched on weights the
    # launcher converted gives what it gives on the fp32 ones.
    converted = cast_inputs(kernel.with_live_attrs([x]), kernel.source.casts(program, streamed))
    ((shape, stride, dtype),) = kernel.output_layout
    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    kernel.kernel[kernel.source.grid(persistent)](*converted, out, **kernel.source.launch_args(persistent))
    assert torch.equal(out, run_config(kernel, program, x, persistent))
    # A kernel made for the persistent config converts nothing at launch, and runs right.
    fused = FusedKernel(kernel.kernel, kernel.source, persistent, program, kernel.eager, model)
    assert fused.casts == [] and fused.kernel_dtypes[1] == torch.float32
    torch.testing.assert_close(fused(x).float(), expected.float(), **TOLERANCES[torch.bfloat16])


def test_tuning_times_each_config_with_the_conversions_its_forward_makes(monkeypatch, use_timer, tmp_path, device):
    """A streamed config is timed with the launcher's two weight conversions, as the forward
    runs it; a persistent one without them (its prologue converts): the two compete fairly."""
    import autofuser_core.tuning as tuning_module
    from autofuser_core.fuse import FuseOptions

    from _helpers import StandInTimer

    model = Mlp(64, 160, norm=False).to(device).eval()
    x = torch.randn(300, 64, device=device)
    kernel, _, _ = fused_mlp(model, x, autocast=True)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        plan = plan_fusion_groups(autofuser.capture(model, x), autofuser.load_plugins().registry)
    (candidate,) = [c for c in plan.kept if c.strategy.name == "mlp"]
    program = candidate.program
    streamed = next(c for c in mlp.configs(program) if not c.get("PERSISTENT"))
    persistent = next(c for c in mlp.configs(program) if c.get("PERSISTENT"))
    converted, made = [], []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if self.dtype == torch.float32 and out.dtype == torch.bfloat16:
            converted.append(tuple(self.shape))
        return out

    def bench(fn, *args):
        before = len(converted)
        fn()
        made.append(sorted(converted[before:]))
        return float(len(made))

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    use_timer(StandInTimer(bench))
    inputs = kernel.with_live_attrs([x])
    tuning_module._tune(
        candidate,
        kernel.source,
        kernel.kernel,
        inputs,
        x.device,
        FuseOptions(),
        lambda m: None,
        tmp_path,
        {"kernel": "test"},
        configs=([streamed, persistent], None),
    )
    assert made == [[(64, 160), (160, 64)], []]


def test_configs_are_compiled_ahead_for_the_dtypes_they_take(monkeypatch, use_timer, tmp_path, device):
    """Compiling ahead: the persistent configs for the fp32 weights they take, the streamed
    ones for the bf16 weights the launcher converts (one job per set of argument dtypes)."""
    import autofuser_core.tuning as tuning_module
    from autofuser_core.precompile import Compiling

    from _helpers import StandInTimer

    started = []

    def start(jobs, progress, target=None):
        started.extend(jobs)
        return Compiling([], progress)  # nothing compiled: tuning compiles as it launches

    monkeypatch.setattr(tuning_module, "start_compiling", start)
    use_timer(StandInTimer(lambda fn, *args: 1.0))
    model = Mlp(64, 160, norm=False).to(device).eval()
    x = torch.randn(300, 64, device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        fused = autofuser.fuse(model, progress=False, verify_speed=False, cache_dir=str(tmp_path))
        fused(x)
    kernel = mlp_kernel(fused)
    jobs = [j for j in started if j.name == kernel.source.name]
    weights = [slot for slot in kernel.attr_inputs if kernel.attr_inputs[slot].endswith("weight")]
    by_weight_dtype = {tuple(j.dtypes[slot] for slot in weights): j for j in jobs}
    assert set(by_weight_dtype) == {("float32", "float32"), ("bfloat16", "bfloat16")}, jobs
    persistent = [dict(launch) for launch in by_weight_dtype[("float32", "float32")].launches]
    streamed = [dict(launch) for launch in by_weight_dtype[("bfloat16", "bfloat16")].launches]
    assert persistent and all(launch["PERSISTENT"] for launch in persistent)
    assert streamed and not any(launch["PERSISTENT"] for launch in streamed)


@pytest.mark.parametrize("case", ["fp32", "tf32", "too_wide"])
def test_persistent_form_only_where_both_weights_fit(case):
    """fp32 operands (strict or TF32) and weights over the shared-memory budget (width 256:
    2 x 256 x 512 bf16 values, 512 KiB) keep the one form."""
    width, dtype = (256, torch.bfloat16) if case == "too_wide" else (96, torch.float32)
    model = Mlp(width, 2 * width, norm=False).to(dtype).eval()
    x = torch.randn(300, width, dtype=dtype)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if case == "tf32" else "highest")
    try:
        with torch.no_grad():
            plan = plan_fusion_groups(autofuser.capture(model, x), autofuser.load_plugins().registry)
    finally:
        torch.set_float32_matmul_precision(old)
    (program,) = [c.program for c in plan.kept if c.strategy.name == "mlp"]
    assert not program.product_layout.persistent
    assert not any(c.get("PERSISTENT") for c in mlp.configs(program))


def test_persistent_threshold_follows_the_devices_multiprocessors(monkeypatch):
    """Unset, the row threshold is PERSISTENT_MIN_ROWS_PER_SM row blocks' rows per
    multiprocessor of the current device (132 assumed without a GPU): a chip of 78
    multiprocessors offers the form from fewer rows than an H200."""
    monkeypatch.setattr(mlp_layout, "PERSISTENT_MIN_ROWS", None)  # this file's fixture sets 1
    assert mlp_layout.persistent_min_rows() == mlp_layout.PERSISTENT_MIN_ROWS_PER_SM * 132 == 67584
    monkeypatch.setattr(mlp_layout, "multiprocessors", lambda without_gpu=132: 78)
    assert mlp_layout.persistent_min_rows() == 512 * 78
    monkeypatch.setattr(mlp_layout, "PERSISTENT_MIN_ROWS", 300)
    assert mlp_layout.persistent_min_rows() == 300


def test_persistent_form_only_from_many_rows(monkeypatch):
    """Below ``PERSISTENT_MIN_ROWS`` the weights are loaded by few enough programs that the
    streamed form is as good (the zoo's MLPs), so the form and its compiles are left out."""
    model = Mlp(64, 160, norm=False).to(torch.bfloat16).eval()
    x = torch.randn(300, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(mlp_layout, "PERSISTENT_MIN_ROWS", 301)
    plan = plan_fusion_groups(autofuser.capture(model, x), autofuser.load_plugins().registry)
    (program,) = [c.program for c in plan.kept if c.strategy.name == "mlp"]
    assert not program.product_layout.persistent and not any(c.get("PERSISTENT") for c in mlp.configs(program))
    monkeypatch.setattr(mlp_layout, "PERSISTENT_MIN_ROWS", 300)
    assert program.product_layout.persistent
