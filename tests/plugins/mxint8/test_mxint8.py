"""MXINT8: the format's reference encoder/decoder, the fused kernels that decode
it in registers (matmul, linear + epilogue, layer norm + linear, MLP), and
``fuse(model, quantize=...)`` end to end (selection, report, state_dict)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_plugins.mxint8 import MXInt8Linear, dequantize_mxint8, quantize_mxint8
from autofuser_plugins.mxint8 import layer as mxint8_layer

from _models import FeedForward

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=4e-2)}


def _fuse(model, **options):
    return autofuser.fuse(model, progress=False, tune=False, verify_speed=False, **options)


# -- the format ------------------------------------------------------------------


def test_encoding_rounds_half_to_even_and_saturates():
    # One block whose max is 1.0: shared exponent 0 (code 127), element step 2**-6.
    row = torch.zeros(1, 32)
    row[0, :6] = torch.tensor([1.0, 3 / 128, 5 / 128, -3 / 128, 0.5, -1.0])
    packed = quantize_mxint8(row)
    assert packed["scales"].tolist() == [[127]]
    assert packed["data"][0, :6].tolist() == [64, 2, 2, -2, 32, -64]  # 1.5 -> 2, 2.5 -> 2, -1.5 -> -2
    # max 1.999: exponent 0, 1.999 * 64 = 127.9 rounds to 128 and saturates to 127; the negation to -127.
    top = torch.tensor([[1.999, -1.999] + [0.0] * 30])
    packed = quantize_mxint8(top)
    assert packed["scales"].tolist() == [[127]] and packed["data"][0, :2].tolist() == [127, -127]


def test_decoding_follows_the_spec_fixed_point():
    data = torch.tensor([[-128, 127, 1] + [0] * 29], dtype=torch.int8)
    scales = torch.tensor([[130]], dtype=torch.uint8)  # 2**3
    weight = dequantize_mxint8(data, scales, 3)
    assert weight.tolist() == [[-2.0 * 8, 127 / 64 * 8, 1 / 64 * 8]]


@pytest.mark.parametrize("shape", [(37, 50), (1, 31), (5, 96)])
def test_quantisation_error_is_at_most_half_a_step_below_saturation(shape):
    torch.manual_seed(0)
    weight = torch.randn(*shape) * torch.logspace(-3, 3, shape[1])  # blocks of very different sizes
    packed = quantize_mxint8(weight)
    k_pad = -(-shape[1] // 32) * 32
    assert packed["data"].shape == (shape[0], k_pad) and packed["data"].dtype == torch.int8
    assert packed["scales"].shape == (shape[0], k_pad // 32) and packed["scales"].dtype == torch.uint8
    assert (packed["data"][:, shape[1] :] == 0).all()  # the padding of the last block
    restored = dequantize_mxint8(packed["data"], packed["scales"], shape[1]).double()
    step = torch.exp2(packed["scales"].double() - 133).repeat_interleave(32, -1)
    step = step[:, : shape[1]]
    err = (restored - weight.double()).abs()
    # Half a step, except where a value rounded up to 128 saturated to 127: under one step.
    saturated = packed["data"][:, : shape[1]].abs() == 127
    assert (err <= torch.where(saturated, step, step / 2)).all()
    assert (err[~saturated] <= step[~saturated] / 2).all() and (err[saturated] < step[saturated]).all()
    # the block max is in [1, 2) * 2**e: its element code is in [64, 127]
    amax_codes = packed["data"].abs().view(shape[0], -1, 32).amax(-1)
    assert ((amax_codes >= 64) & (amax_codes <= 127)).all()


def test_special_magnitudes():
    weight = torch.zeros(3, 64)
    torch.manual_seed(0)
    weight[1, :32] = (torch.rand(32) * 2 - 1) * 3.3e38  # near fp32 max
    weight[1, 0] = 3.3e38
    weight[1, 32:] = (torch.rand(32) * 2 - 1) * 1e-40  # subnormal
    weight[2] = torch.randn(64)
    packed = quantize_mxint8(weight)
    assert packed["scales"][0].tolist() == [0, 0] and (packed["data"][0] == 0).all()  # all-zero blocks
    assert packed["scales"][1].tolist() == [254, 0]  # 2**127; the smallest scale, 2**-127
    restored = dequantize_mxint8(packed["data"], packed["scales"], 64)
    assert torch.isfinite(restored).all() and (restored[0] == 0).all()
    big = weight[1, :32].double()
    assert ((restored[1, :32].double() - big).abs() <= 2.0 ** (127 - 7)).all()
    assert ((restored[1, 32:].double() - weight[1, 32:].double()).abs() <= 2.0 ** (-127 - 7)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_layer(bad):
    model = nn.Sequential(nn.Linear(8, 40), nn.ReLU(), nn.Linear(40, 8))
    with torch.no_grad():
        model[2].weight[3, 17] = bad
    with pytest.raises(autofuser.AutoFuserError, match=r"layer '2'.*NaN/infinite.*\[3, 17\].*exclude"):
        _fuse(model, quantize="mxint8")


# -- kernels against activation @ dequant(W) --------------------------------------


class Products(nn.Module):
    """One of each strategy's shapes of group: a product alone, with an epilogue,
    after a layer norm, and an MLP; K and N neither multiples of 32 nor powers of 2."""

    def __init__(self, width=50, hidden=72, wide=300):
        super().__init__()
        self.alone = nn.Linear(width, 37, bias=False)
        self.epilogue = nn.Linear(width, width)
        self.ln = nn.LayerNorm(wide)
        self.normed = nn.Linear(wide, 45)  # K = 300: statistics in passes over K
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x, y):
        a = self.alone(x)
        b = F.gelu(self.epilogue(x)) + x
        c = self.normed(self.ln(y))
        d = self.fc2(F.gelu(self.fc1(self.ln2(b)))) + b
        return a, c, d


def _reference(model, x, y):
    """The quantised model computed in float64 from ``dequant(W)``, rounded like eager where it is bf16."""
    double = Products()
    double.load_state_dict(
        {k: v for k, v in model.state_dict().items() if "weight_q" not in k and "scale" not in k}, strict=False
    )
    for name, layer in model.named_children():
        if isinstance(layer, MXInt8Linear):
            target = getattr(double, name)
            target.weight.data = layer.dequantized_weight(x.dtype).double()
    double = double.double()
    return [o.to(x.dtype) for o in double(x.double(), y.double())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_product_strategy_decodes_mxint8_weights(dtype):
    torch.manual_seed(0)
    model = Products().eval()
    with torch.no_grad():
        model.fc1.weight[5, :32] = 0  # an all-zero block
        model.fc1.weight[6, 32:] = 1e-39  # subnormal scale codes in the last (padded) block
        model.alone.weight[2] *= 1e30  # huge blocks
    model = model.to(dtype)
    x, y = torch.randn(1, 7, 50, dtype=dtype), torch.randn(1, 7, 300, dtype=dtype)
    fused = _fuse(model, quantize="mxint8")
    with torch.no_grad():
        outs = fused(x, y)
        refs = _reference(fused.model, x, y)
    report = fused.report()
    strategies = {g.strategy for g in report.fused if any(op == "mxint8.weight" for op in g.ops)}
    assert strategies == {"matmul", "linear_epilogue", "layernorm_linear", "mlp"}, str(report)
    assert len(report.quantized) == 5
    for out, ref in zip(outs, refs):
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref, **TOL[dtype])


def test_kernel_reads_the_packed_tensors_not_a_float_copy():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(45, 33), nn.GELU()).eval()
    x = torch.randn(3, 45)
    fused = _fuse(model, quantize="mxint8")
    with torch.no_grad():
        fused(x)
        # Changing the buffers in place (as load_state_dict does) changes the kernel's result.
        fused.model[0].weight_q.neg_()
        out = fused(x)
    ref = F.gelu(x.double() @ fused.model[0].dequantized_weight().double().T + fused.model[0].bias.double())
    torch.testing.assert_close(out, ref.float(), **TOL[torch.float32])
    group = next(g for g in fused.report().fused if "mxint8.weight" in g.ops)
    assert group.strategy == "linear_epilogue"


@pytest.mark.parametrize("k, n", [(20, 1), (33, 1), (7, 5)], ids=str)
def test_one_block_and_one_column(k, n):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(k, n), nn.Tanh()).eval()
    x = torch.randn(1, k)
    fused = _fuse(model, quantize="mxint8")
    with torch.no_grad():
        out = fused(x)
    layer = fused.model[0]
    ref = torch.tanh(x.double() @ layer.dequantized_weight().double().T + layer.bias.double())
    torch.testing.assert_close(out, ref.float(), **TOL[torch.float32])
    assert any("mxint8.weight" in g.ops for g in fused.report().fused), str(fused.report())


class OtherUse(nn.Module):
    """The dequantised weight read other than as a linear layer's weight."""

    FORMS = {
        "transposed_matmul": lambda x, w: x @ w.t(),
        "pointwise": lambda x, w: torch.relu(w) * 3,
        "bmm": lambda x, w: torch.bmm(x[None], w.t()[None]),
    }

    def __init__(self, form):
        super().__init__()
        self.layer = MXInt8Linear.from_linear(nn.Linear(40, 24))
        self.form = form

    def forward(self, x):
        weight = mxint8_layer.mxint8_weight(self.layer.weight_q, self.layer.weight_scale, 40, x.dtype)
        return self.FORMS[self.form](x, weight)


@pytest.mark.parametrize("form", list(OtherUse.FORMS))
def test_a_packed_weight_read_otherwise_is_dequantised_eagerly(form):
    torch.manual_seed(0)
    model = OtherUse(form).eval()
    x = torch.randn(5, 40)
    fused = _fuse(model)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), **TOL[torch.float32])
    groups = [g for g in fused.report().groups if "mxint8.weight" in g.ops]
    assert groups and not any(g.fused for g in groups), str(fused.report())
    assert {g.reason_code for g in groups} == {"packed_weight"}
    assert fused.report().fused  # the rest still fuses, reading the eagerly dequantised weight


# -- fuse(model, quantize=...) -------------------------------------------------------


class Block(FeedForward):
    """The shared feed-forward block with a linear head after it."""

    def __init__(self, width=40, hidden=96):
        super().__init__(width, hidden)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(super().forward(x))


def test_quantised_model_stays_within_the_documented_bound_of_fp32():
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 29, 40)
    fused = _fuse(model, quantize="mxint8")
    with torch.no_grad():
        exact, quantised = model(x), fused(x)
    # docs/mxint8.md: each weight moves by at most 1/127 of its block's max, so a layer's
    # output moves by at most sum_k |x_k| * blockmax / 127; through this block the error
    # stays below 1% of the output's RMS.
    rms = exact.pow(2).mean().sqrt()
    assert (quantised - exact).pow(2).mean().sqrt() <= 1e-2 * rms
    assert not torch.equal(quantised, exact)  # it did quantise


def test_one_layer_error_bound():
    torch.manual_seed(2)
    layer = nn.Linear(70, 23)
    x = torch.randn(11, 70)
    fused = _fuse(layer, quantize="mxint8")
    with torch.no_grad():
        out = fused(x)
    blockmax = F.pad(layer.weight.detach().abs(), (0, 26)).view(23, 3, 32).amax(-1).repeat_interleave(32, -1)[:, :70]
    # docs/mxint8.md: |w - dequant(w)| <= blockmax / 127 for every weight.
    bound = (x.abs() @ blockmax.T) / 127 + 1e-4
    assert ((out - layer(x).detach()).abs() <= bound).all()
    assert [q.name for q in fused.report().quantized] == ["<model>"]


def test_layer_selection_and_report():
    model = Block()
    options = {"format": "mxint8", "include": ["fc*", "head"], "exclude": ["fc2"], "min_numel": 200}
    fused = _fuse(model.eval(), quantize=options)
    x = torch.randn(1, 5, 40)
    with torch.no_grad():
        fused(x)
    report = fused.report()
    assert [q.name for q in report.quantized] == ["fc1"]  # fc2 excluded, head's 3 x 40 weight too small
    entry = report.quantized[0]
    assert entry.bytes_before == 96 * 40 * 4 and entry.bytes_after == 96 * 64 + 96 * 2
    text = str(report)
    assert "Quantised weights: 1 layer(s)" in text and "fc1 [96, 40]: mxint8" in text
    # The caller's model keeps its float layers.
    assert type(model.fc1) is nn.Linear and type(fused.model.fc1) is MXInt8Linear
    assert type(fused.model.fc2) is nn.Linear and torch.equal(fused.model.fc2.weight, model.fc2.weight)
    assert fused.model.fc2.weight is not model.fc2.weight  # a copy: moving one doesn't move the other


def test_quantize_option_errors():
    with pytest.raises(autofuser.AutoFuserError, match="no loaded plugin provides the weight format 'mxint4'"):
        _fuse(Block(), quantize="mxint4")
    with pytest.raises(autofuser.AutoFuserError, match="invalid quantize= setting.*layers"):
        _fuse(Block(), quantize={"format": "mxint8", "layers": ["fc1"]})


def test_state_dict_round_trips_into_a_fresh_fused_model():
    torch.manual_seed(0)
    fused = _fuse(Block().eval(), quantize="mxint8")
    x = torch.randn(3, 6, 40)
    with torch.no_grad():
        expected = fused(x)
    state = fused.state_dict()
    assert state["fc1.weight_q"].dtype == torch.int8 and state["fc1.weight_scale"].dtype == torch.uint8
    assert "fc1.weight" not in state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    torch.manual_seed(1)
    fresh = _fuse(Block().eval(), quantize="mxint8")  # other random weights, quantised
    fresh.load_state_dict(torch.load(buffer))
    with torch.no_grad():
        again = fresh(x)
    assert torch.equal(again, expected)
    assert any("mxint8.weight" in g.ops for g in fresh.report().fused)


def test_benchmark_script_smoke_run(tmp_path):
    """benchmarks/mxint8.py on the CPU: every system's cell, checked outputs, JSON and markdown."""
    import importlib.util
    import json
    import pathlib
    import sys

    bench = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("mxint8_bench", bench / "mxint8.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.main(["--device", "cpu", "--models", "", "--widths", "32", "--out", str(tmp_path)]) == 0
    finally:
        sys.path.remove(str(bench))
    data = json.loads((tmp_path / "mxint8.json").read_text())
    assert len(data["cases"]) == 4
    for row in data["cases"]:
        for system in ("eager", "autofuser", "eager-mxint8", "autofuser-mxint8"):
            assert "ms" in row[system], row[system]
        quantised = row["autofuser-mxint8"]
        assert quantised["quantised_layers"] >= 1 and quantised["fused_groups"] >= 1
        assert quantised["weight_bytes"] < row["eager"]["weight_bytes"]
        assert 0 < quantised["rel_err_vs_fp32"] < 2e-2
    assert (tmp_path / "mxint8.md").read_text().count("\n| ") == 5


def test_a_weight_tied_to_a_layer_left_in_float_is_copied_not_shared():
    """The quantised model shares no tensor with the caller's, tied weights included:
    a later change to the caller's weight must not reach half of the fused model."""
    from autofuser_core.quantize import QuantizeOptions, quantize_model

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(64, 40, bias=False)
            self.mirror = nn.Linear(64, 40, bias=False)
            self.mirror.weight = self.head.weight  # tied; only the head is selected

        def forward(self, x):
            return self.head(x) + self.mirror(x)

    model = Tied()
    registry = autofuser.load_plugins().registry
    copied, layers = quantize_model(model, QuantizeOptions(format="mxint8", include=["head"], min_numel=1), registry)
    assert [layer.name for layer in layers] == ["head"]
    assert copied.mirror.weight is not model.head.weight
    torch.testing.assert_close(copied.mirror.weight, model.head.weight)
    with torch.no_grad():
        model.head.weight.add_(1.0)
    assert not torch.equal(copied.mirror.weight, model.head.weight)
