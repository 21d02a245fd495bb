"""The third-party FFT plugin (examples/autofuser-plugin-fft), as a user gets it:
installed with pip, found through its entry point, chosen by name.

The README's test command installs it; so does CI.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import autofuser
from autofuser_core.plugins import installed_entry_points
from autofuser_core.report_html import coverage

try:
    import autofuser_plugin_fft
    from autofuser_plugin_fft import spectral_mix
except ImportError:  # pragma: no cover - a set-up error, reported as a failure
    pytest.fail(
        "autofuser-plugin-fft is not installed: run `pip install ./examples/autofuser-plugin-fft` "
        "(the README's test command does)",
        pytrace=False,
    )

from autofuser.zoo.models import MESHES, MODELS, TINY_BATCH

BUNDLED = ["elementwise", "reduction", "matmul", "attention"]
WITH_FFT = BUNDLED + ["fft"]


def _spectral_groups(report):
    return [g for g in report.groups if g.strategy == "fft.spectral_mix"]


def _check_close(fused, eager, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(fused, eager, atol=atol, rtol=rtol)


class SpectralConv2d(torch.nn.Module):
    """An FNO layer's spectral convolution, written as FNO writes it."""

    def __init__(self, in_channels, out_channels, modes):
        super().__init__()
        self.out_channels, self.modes = out_channels, modes
        shape = (in_channels, out_channels, *modes)
        self.w1 = torch.nn.Parameter(torch.randn(shape, dtype=torch.cfloat) / (in_channels * out_channels))
        self.w2 = torch.nn.Parameter(torch.randn(shape, dtype=torch.cfloat) / (in_channels * out_channels))

    def forward(self, x):
        batch, _, height, width = x.shape
        m1, m2 = self.modes
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(batch, self.out_channels, height, width // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], self.w1)
        out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], self.w2)
        return torch.fft.irfft2(out_ft, s=(height, width))


class FNOBlock(torch.nn.Module):
    """``GELU(K v + W v)``: the spectral convolution next to a 1 x 1 linear map."""

    def __init__(self, channels, modes):
        super().__init__()
        self.spectral = SpectralConv2d(channels, channels, modes)
        self.pointwise = torch.nn.Linear(channels, channels)

    def forward(self, v):
        w = self.pointwise(v.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return torch.nn.functional.gelu(self.spectral(v) + w)


def test_installed_through_pip_and_found_by_entry_point():
    assert importlib.metadata.distribution("autofuser-plugin-fft").version == autofuser_plugin_fft.__version__
    entry = installed_entry_points()["fft"]
    assert entry.value == "autofuser_plugin_fft"
    assert entry.load() is autofuser_plugin_fft


def test_chosen_by_name_while_autoload_is_disabled(monkeypatch):
    monkeypatch.setenv("AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "fft" not in autofuser.load_plugins().names
    plugins = autofuser.load_plugins(WITH_FFT)
    assert plugins.names == WITH_FFT
    assert plugins.registry.lowerings["fft.spectral_mix"].plugin == "fft"
    assert plugins.registry.strategies["fft.spectral_mix"].plugin == "fft"


@pytest.mark.parametrize(
    "batch, channels, size, modes",
    [
        (3, (5, 7), (13, 10), (3, 4)),  # odd sizes, more output than input channels
        (1, (4, 4), (9, 16), (2, 5)),  # batch 1, an even width
        (2, (3, 2), (7, 6), (4, 3)),  # 2 * m1 > H: the two regions overlap, the second wins
    ],
)
def test_spectral_convolution_matches_eager_and_fuses(batch, channels, size, modes):
    torch.manual_seed(0)
    layer = SpectralConv2d(*channels, modes).eval()
    x = torch.randn(batch, channels[0], *size)
    fused = autofuser.fuse(layer, plugins=WITH_FFT, progress=False)
    with torch.no_grad():
        _check_close(fused(x), layer(x))
        x2 = torch.randn_like(x)
        _check_close(fused(x2), layer(x2))  # the compiled graph, on fresh inputs
    groups = _spectral_groups(fused.report())
    assert len(groups) == 1 and groups[0].fused, fused.report()
    assert "mode truncation" in groups[0].reason and groups[0].kernel.startswith("af_fft_spectral_mix_")
    assert groups[0].max_error is not None and groups[0].max_error < 1e-4


def test_fno_block_fuses_the_spectral_mix_and_the_pointwise_ops_around_the_ffts():
    torch.manual_seed(1)
    block = FNOBlock(6, (3, 3)).eval()
    x = torch.randn(2, 6, 11, 9)
    fused = autofuser.fuse(block, plugins=WITH_FFT, progress=False)
    with torch.no_grad():
        _check_close(fused(x), block(x))
    report = fused.report()
    assert [g.fused for g in _spectral_groups(report)] == [True]
    # The slice assignments are gone, so no mutation is left to stop the add + GELU from fusing.
    assert not any(n.reason_code == "mutation" for n in report.unfused_nodes)
    assert any(g.fused and "elementwise.gelu" in g.ops for g in report.groups)
    # The real and complex views the rewrite put around spectral_mix move no data (annotate_node),
    # and the FFTs are library calls on purpose: nothing else is left eager.
    views = [n for n in report.graph if "view_as" in n.target]
    assert len(views) == 4 and all(n.free for n in views), views  # two weights, the spectrum, the result
    counts = coverage(report)
    assert counts.library == 2 and counts.eager == 0, (counts, str(report))


def test_without_the_plugin_the_spectral_ops_stay_eager():
    layer = SpectralConv2d(3, 3, (2, 2)).eval()
    fused = autofuser.fuse(layer, plugins=BUNDLED, progress=False)
    with torch.no_grad():
        fused(torch.randn(2, 3, 8, 8))
    report = fused.report()
    assert not _spectral_groups(report)
    assert sum(n.reason_code == "mutation" for n in report.unfused_nodes) == 2


def test_gradients_match_eager():
    torch.manual_seed(2)
    layer = SpectralConv2d(4, 3, (2, 3))
    x = torch.randn(2, 4, 9, 7, requires_grad=True)
    fused = autofuser.fuse(layer, plugins=WITH_FFT, progress=False)
    out = fused(x)
    grads = torch.autograd.grad(out.square().sum(), [x, layer.w1, layer.w2])
    expected = torch.autograd.grad(layer(x).square().sum(), [x, layer.w1, layer.w2])
    assert [g.fused for g in _spectral_groups(fused.report())] == [True]
    for got, want in zip(grads, expected):
        _check_close(got, want, atol=1e-4, rtol=1e-3)


class _OneWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3, 2, 2, dtype=torch.cfloat))


class ReadsBufferEarly(_OneWeight):
    """The buffer is read between two assignments: not a pure spectral mix, left alone."""

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros_like(x_ft)
        out_ft[:, :, :2, :2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :2, :2], self.w)
        early = torch.fft.irfft2(out_ft, s=x.shape[-2:])
        out_ft[:, :, -2:, :2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -2:, :2], self.w)
        return early + torch.fft.irfft2(out_ft, s=x.shape[-2:])


class ShiftedModes(_OneWeight):
    """The einsum reads other modes than it writes: not this pattern, left alone."""

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros_like(x_ft)
        out_ft[:, :, :2, :2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, 1:3, :2], self.w)
        return torch.fft.irfft2(out_ft, s=x.shape[-2:])


class WritesSpectrumBetween(_OneWeight):
    """The spectrum changes between the two einsums: reading it once would be wrong, left alone."""

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros_like(x_ft)
        out_ft[:, :, :2, :2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :2, :2], self.w)
        x_ft.mul_(3.0)
        out_ft[:, :, -2:, :2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -2:, :2], self.w)
        return torch.fft.irfft2(out_ft, s=x.shape[-2:])


@pytest.mark.parametrize("model_class", [ReadsBufferEarly, ShiftedModes, WritesSpectrumBetween])
def test_other_patterns_are_left_alone_and_stay_right(model_class):
    model = model_class().eval()
    x = torch.randn(2, 3, 6, 5)
    fused = autofuser.fuse(model, plugins=WITH_FFT, progress=False)
    with torch.no_grad():
        _check_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    assert not _spectral_groups(fused.report())


@pytest.mark.parametrize("sample", range(3))
def test_spectral_mix_samples_fuse_and_match_their_reference(sample):
    spec = autofuser.load_plugins(["fft"]).registry.lowerings["fft.spectral_mix"]
    case = spec.samples(torch.float32)[sample]

    class Call(torch.nn.Module):
        def forward(self, *tensors):
            return spectral_mix(*tensors, **case.kwargs)

    fused = autofuser.fuse(Call(), plugins=["fft"], progress=False)
    with torch.no_grad():
        _check_close(fused(*case.args), spectral_mix(*case.args, **case.kwargs), atol=1e-5, rtol=1e-5)
    assert [g.fused for g in _spectral_groups(fused.report())] == [True], case.note


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name, layers_per_block", [("fno", 1), ("ffno", 2)])
def test_zoo_models_match_eager_with_spectral_groups_fused(name, layers_per_block, dtype):
    """fp32, and bf16 autocast (the FFTs and their spectral mix stay fp32, as the models ask)."""
    torch.manual_seed(3)
    entry = MODELS[name]
    model = entry.make("tiny").eval()
    x = entry.inputs(torch.rand(TINY_BATCH, *MESHES["tiny"], 2))
    fused = autofuser.fuse(model, plugins=WITH_FFT, progress=False)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with torch.no_grad(), autocast:
        got, want = fused(x), model(x)
    assert got.dtype == want.dtype
    tolerance = {"fp32": (1e-4, 1e-4), "bf16": (2e-2, 4e-2)}[dtype]
    _check_close(got.float(), want.float(), *tolerance)
    report = fused.report()
    groups = _spectral_groups(report)
    expected = layers_per_block * entry.configs["tiny"]["layers"]
    assert len(groups) == expected and all(g.fused for g in groups), report
    assert not any(g.reason_code == "mismatch" for g in report.groups), report


def test_spectral_kernels_compile_for_sm90(tmp_path):
    """The interpreter accepts programs the GPU compiler refuses: compile the
    plugin's kernels of the zoo's FNO and F-FNO ahead of time for sm_90."""
    from _sm90 import _compile_for_sm90, _job

    jobs = []
    for name in ("fno", "ffno"):
        entry = MODELS[name]
        fused = autofuser.fuse(
            entry.make("tiny").eval(), plugins=WITH_FFT, progress=False, tune=False, verify_speed=False
        )
        with torch.no_grad():
            fused(entry.inputs(torch.rand(1, *MESHES["tiny"], 2)))
        kernels = [k for k in fused.kernels() if k.source.name.startswith("af_fft_spectral_mix_")]
        assert kernels, fused.report()
        jobs += [
            _job(tmp_path, k.source, k.kernel_dtypes, [dtype for _, _, dtype in k.output_layout], k.launch_args)
            for k in kernels
        ]
    _compile_for_sm90(jobs, tmp_path)


@pytest.mark.parametrize("sample", range(3))
def test_an_infinite_mode_stays_infinite_as_in_eager(sample):
    """Each mode is multiplied by its own region's weight only: another region's (zero)
    weight times an infinite mode would make NaN where eager has an infinity."""
    spec = autofuser.load_plugins(["fft"]).registry.lowerings["fft.spectral_mix"]
    case = spec.samples(torch.float32)[sample]
    spectrum = case.args[0].clone()
    spectrum[(0,) * spectrum.dim()] = float("inf")  # the real part of mode (0, ...), in the first region
    args = (spectrum, *case.args[1:])

    class Call(torch.nn.Module):
        def forward(self, *tensors):
            return spectral_mix(*tensors, **case.kwargs)

    fused = autofuser.fuse(Call(), plugins=["fft"], progress=False)
    with torch.no_grad():
        expected = spectral_mix(*args, **case.kwargs)
        got = fused(*args)
    assert torch.isinf(expected).any(), case.note
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert [g.fused for g in _spectral_groups(fused.report())] == [True], (case.note, str(fused.report()))
