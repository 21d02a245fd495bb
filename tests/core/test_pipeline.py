"""The fusion pipeline end to end (``autofuser.fuse``): capture, planning,
code generation, verification, rewriting and the per-signature guard.

Every test compares the fused model with eager PyTorch on fresh random inputs
and checks what the report says was fused, skipped and left eager, and why.
"""

from __future__ import annotations

import json
import re
import types
import warnings
import zlib
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.report import FusionReport

from _helpers import stand_in_timer_by_kernel as _stand_in_timer
from _models import FeedForward

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=1e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-2, rtol=4e-2),
}
LINEAR = "torch.nn.modules.linear.Linear"
#: Without the matmul plugin, Linear and @ stay eager and everything around them fuses.
NO_MATMUL = ["elementwise", "reduction"]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def assert_matches_eager(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[expected.dtype])


def assert_fused(group, dtype: torch.dtype) -> None:
    """``group`` was fused (in every dtype: under the interpreter too, bf16 rounds
    to nearest even as on a GPU, see autofuser_core/rounding.py)."""
    assert group.fused and group.reason_code == "fused", (group, dtype)


def fuse_and_run(model: nn.Module, *inputs, **options):
    """(fused model, fused output, eager output) under ``torch.no_grad()``."""
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, **options)
        got = fused(*inputs)
        expected = model(*inputs)
    return fused, got, expected


def random_layer_norm(width: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(width)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width))
        norm.bias.copy_(torch.randn(width))
    return norm


def graph_order(model: nn.Module, *inputs) -> dict[str, int]:
    """Node name -> position in the captured graph (the names the report uses)."""
    gm = autofuser.capture(model, *inputs)
    return {node.name: i for i, node in enumerate(gm.graph.nodes)}


# ---------------------------------------------------------------------------
# Fusion shapes: pointwise chains, residual + norm, softmax
# ---------------------------------------------------------------------------


class PointwiseChain(nn.Module):
    """Seven pointwise ops; ``y`` broadcasts, ``x`` arrives transposed (strided)."""

    def forward(self, x, y):
        x = x.transpose(1, 2)
        a = x * 2 + y
        b = F.gelu(a)
        c = torch.sigmoid(b) * x
        d = c.clamp(-1.5, 1.5)
        return d - y


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pointwise_chain_is_one_elementwise_group(dtype, batch):
    x = torch.randn(batch, 37, 11, dtype=dtype)
    y = torch.randn(37, dtype=dtype)
    fused, got, expected = fuse_and_run(PointwiseChain(), x, y)
    assert_matches_eager(got, expected)

    report = fused.report()
    assert len(report.groups) == 1, str(report)
    group = report.groups[0]
    assert group.strategy == "elementwise"
    assert_fused(group, dtype)
    assert group.ops == [
        "elementwise.mul",
        "elementwise.add",
        "elementwise.gelu",
        "elementwise.sigmoid",
        "elementwise.mul",
        "elementwise.clamp",
        "elementwise.sub",
    ]
    assert group.nodes == ["mul", "add", "gelu", "sigmoid", "mul_1", "clamp", "sub"]
    # The transpose stays a view the kernel reads through strides.
    assert [(n.node, n.reason_code) for n in report.unfused_nodes] == [("transpose", "no_lowering")]
    assert group.kernel and group.max_error is not None  # it was generated, run and checked
    assert [k.__name__ for k in fused.kernels()] == [group.kernel]


class ChannelsLastAffine(nn.Module):
    """A channels-last tensor permuted to channels-first, scaled, shifted and activated."""

    def forward(self, x, scale, shift):
        return torch.relu(x.permute(0, 3, 1, 2) * scale + shift)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flat_kernel_walks_permuted_tensors_in_memory_order(dtype, batch):
    """The output keeps the input's channels-last layout, so consecutive elements in
    memory differ in the channel: the kernel's innermost coordinate must be the one
    with stride 1 in memory (coalesced accesses), not the logical last dim (W)."""
    channels, height, width = 13, 9, 17
    x = torch.randn(batch, height, width, channels, dtype=dtype)
    scale, shift = torch.randn(channels, 1, 1, dtype=dtype), torch.randn(channels, 1, 1, dtype=dtype)
    fused, got, expected = fuse_and_run(ChannelsLastAffine(), x, scale, shift)
    assert_matches_eager(got, expected)
    assert got.stride() == expected.stride()  # the layout eager gives, channels last

    (group,) = fused.report().groups
    assert_fused(group, dtype)
    store = next(line for line in group.kernel_source.splitlines() if "tl.store(out0" in line)
    offset = store.split("tl.store(out0 + ")[1].split(",")[0]
    coords = sorted({int(t) for t in re.findall(r"\bi(\d+)\b", group.kernel_source)})
    assert f"i{coords[-1]}" in [term.strip() for term in offset.split("+")], group.kernel_source


class ResidualNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = random_layer_norm(37)

    def forward(self, x, r):
        return self.ln(x + r)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_layer_norm_is_one_row_reduction_group(dtype, batch):
    model = ResidualNorm().to(dtype)
    x, r = torch.randn(batch, 7, 37, dtype=dtype), torch.randn(batch, 7, 37, dtype=dtype)
    fused, got, expected = fuse_and_run(model, x, r)
    assert_matches_eager(got, expected)

    report = fused.report()
    assert [(g.strategy, g.ops, g.nodes) for g in report.groups] == [
        ("row_reduction", ["elementwise.add", "reduction.layer_norm_module"], ["add", "ln"])
    ], str(report)
    assert_fused(report.groups[0], dtype)
    assert report.unfused_nodes == []


class ScaledSoftmax(nn.Module):
    def forward(self, x, bias):
        return torch.softmax(x * 0.125 + bias, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_of_scaled_biased_scores_is_one_row_reduction_group(dtype):
    x = torch.randn(3, 5, 51, dtype=dtype) * 4
    bias = torch.randn(51, dtype=dtype)  # broadcasts over batch and rows
    fused, got, expected = fuse_and_run(ScaledSoftmax(), x, bias)
    assert_matches_eager(got, expected)
    report = fused.report()
    assert [(g.strategy, g.ops) for g in report.groups] == [
        ("row_reduction", ["elementwise.mul", "elementwise.add", "reduction.softmax"])
    ], str(report)
    assert_fused(report.groups[0], dtype)


def test_report_round_trips_and_reads_well():
    fused, got, expected = fuse_and_run(ResidualNorm(), torch.randn(3, 7, 37), torch.randn(3, 7, 37))
    report = fused.report()
    again = FusionReport.model_validate_json(report.to_json())
    assert again == report
    assert json.loads(report.to_json())["groups"][0]["strategy"] == "row_reduction"
    text = str(report)
    assert "row_reduction" in text and "elementwise.add > reduction.layer_norm" in text
    assert report.signature == "(float32[3, 7, 37], float32[3, 7, 37])"
    assert report.device == "cpu"
    assert report.plugins == ["attention", "conv", "elementwise", "matmul", "mxint8", "reduction"]


# ---------------------------------------------------------------------------
# A transformer block without the matmul plugin: matmuls stay eager, the rest
# fuses around them
# ---------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    def __init__(self, width: int = 37, hidden: int = 45):
        super().__init__()
        self.ln1 = random_layer_norm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.ln2 = random_layer_norm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(0.1)
        self.scale = width**-0.5

    def forward(self, x, mask):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2)
        scores = torch.where(mask, float("-inf"), scores * self.scale)
        attention = self.drop(torch.softmax(scores, dim=-1))
        x = x + self.drop(attention @ v)
        h = self.fc2(self.drop(F.gelu(self.fc1(self.ln2(x)))))
        return x + self.drop(h)


@pytest.mark.parametrize("batch", [1, 3])
def test_transformer_block_fuses_around_eager_matmuls(batch):
    tokens = 13
    model = TransformerBlock().eval()
    x = torch.randn(batch, tokens, 37)
    mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), 1)  # causal: -inf above the diagonal
    fused, got, expected = fuse_and_run(model, x, mask, plugins=NO_MATMUL)
    assert_matches_eager(got, expected)

    report = fused.report()
    # An eval dropout whose result leaves its group is a no-op eager returns as its input: not fused.
    assert not [g for g in report.skipped if g.reason_code != "alias_output"], str(report)
    by_ops = {tuple(g.ops): g.strategy for g in report.fused}
    # The attention dropout and the MLP's hidden dropout feed eager matmuls: they stay
    # eager no-ops, the ops around them fuse.
    assert by_ops[("elementwise.mul", "elementwise.where", "reduction.softmax")] == "row_reduction"
    assert by_ops[("elementwise.dropout", "elementwise.add", "reduction.layer_norm_module")] == "row_reduction"
    assert by_ops[("elementwise.gelu",)] == "elementwise"
    assert by_ops[("elementwise.dropout", "elementwise.add")] == "elementwise"
    assert by_ops[("reduction.layer_norm_module",)] == "row_reduction"
    assert sorted(g.nodes[0] for g in report.skipped) == ["drop", "drop_2"]

    eager = {(n.node, n.target): n.reason_code for n in report.unfused_nodes}
    for linear in ("qkv", "fc1", "fc2"):
        assert eager[(linear, LINEAR)] == "no_lowering"
    assert eager[("matmul", "_operator.matmul")] == "no_lowering"
    assert eager[("matmul_1", "_operator.matmul")] == "no_lowering"
    fused_nodes = {name for g in report.fused for name in g.nodes}
    assert not fused_nodes & {n.node for n in report.unfused_nodes}


# ---------------------------------------------------------------------------
# Mutation and randomness are barriers
# ---------------------------------------------------------------------------


class MutatesAndDraws(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, y):
        a = x * 2 + 1
        a.add_(1)
        b = torch.sigmoid(a) * 3
        b = F.relu(b - 1.5, inplace=True)  # on a fresh value nothing else reads: a functional op
        t = b * y - 0.2
        c = self.relu(t)  # t is read again below, so the write into it is seen: a mutation
        out = c * 1.5 + 0.5 + t
        out[:, :3] = y[:, :3]
        d = self.drop(out) * 2
        return torch.tanh(d) + x


BARRIERS = {
    "add_": "mutation",  # Tensor.add_
    "relu_1": "mutation",  # nn.ReLU(inplace=True) on a value read again
    "setitem": "mutation",  # out[:, :3] = y
    "drop": "random",  # dropout in training
}


def test_mutation_and_randomness_stay_eager_and_split_groups():
    model = MutatesAndDraws().train()
    x, y = torch.randn(3, 37), torch.randn(3, 37)
    x_before, y_before = x.clone(), y.clone()
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        for _ in range(2):  # compiling call, then the compiled graph
            torch.manual_seed(7)
            got = fused(x, y)
            torch.manual_seed(7)
            expected = model(x, y)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(x, x_before) and torch.equal(y, y_before)
    assert len(fused.reports()) == 1

    report = fused.report()
    eager = {n.node: n.reason_code for n in report.unfused_nodes}
    for node, code in BARRIERS.items():
        assert eager[node] == code, str(report)
    # Every group between the barriers fuses: values written in place later
    # (a.add_, out[:, :3] = ...) must not fail verification.
    # An eval dropout whose result leaves its group is a no-op eager returns as its input: not fused.
    assert not [g for g in report.skipped if g.reason_code != "alias_output"], str(report)
    assert len(report.fused) == 4
    # The in-place relu on a value nothing else reads fused as the functional op.
    assert any("relu_functional" in g.nodes for g in report.fused), str(report)

    order = graph_order(model, x, y)
    barrier_positions = [order[name] for name in BARRIERS]
    for group in report.groups:
        positions = [order[name] for name in group.nodes if name in order]  # not those graph passes made
        assert not set(group.nodes) & set(BARRIERS)
        assert not any(min(positions) < p < max(positions) for p in barrier_positions), group.nodes


class MutatesItsInput(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return torch.sigmoid(x) * 3 - x


def test_model_writing_into_its_input_writes_once():
    """Compiling runs the graph once to verify kernels; that run must not also
    write into the caller's tensor."""
    model = MutatesItsInput()
    x = torch.randn(3, 37)
    x_fused, x_eager = x.clone(), x.clone()
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        got = fused(x_fused)
        expected = model(x_eager)
        torch.testing.assert_close(x_fused, x_eager)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fused(x_fused), model(x_eager), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x_fused, x * 4)
    report = fused.report()
    assert [n.reason_code for n in report.unfused_nodes] == ["mutation"]
    assert len(report.fused) == 1


# ---------------------------------------------------------------------------
# Autocast
# ---------------------------------------------------------------------------


class NormGeluSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = random_layer_norm(37)
        self.fc = nn.Linear(37, 29)

    def forward(self, x):
        return torch.softmax(self.fc(F.gelu(self.ln(x))), dim=-1)


def test_autocast_bfloat16_matches_eager_under_autocast():
    model = NormGeluSoftmax()
    x = torch.randn(3, 5, 37)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = autofuser.fuse(model, plugins=NO_MATMUL, progress=False)
        got = fused(x)
        expected = model(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[torch.bfloat16])
    report = fused.report()
    assert [g.ops for g in report.groups] == [
        ["reduction.layer_norm_module", "elementwise.gelu"],
        ["reduction.softmax"],
    ], str(report)
    for group in report.groups:
        assert_fused(group, torch.bfloat16)
    assert [(n.node, n.reason_code) for n in report.unfused_nodes] == [("fc", "no_lowering")]

    # The same model without autocast is another signature, compiled for fp32.
    with torch.no_grad():
        assert_matches_eager(fused(x), model(x))
    assert len(fused.reports()) == 2


# ---------------------------------------------------------------------------
# The guard: one compiled graph per input signature
# ---------------------------------------------------------------------------


class NormGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = random_layer_norm(37)

    def forward(self, x, r):
        return F.gelu(self.ln(x + r))


def inputs(batch: int, requires_grad: bool = False):
    x = torch.randn(batch, 4, 37, requires_grad=requires_grad)
    return x, torch.randn(batch, 4, 37)


def test_new_shape_compiles_again_and_old_one_is_reused():
    model = NormGelu()
    fused = autofuser.fuse(model, progress=False)
    with torch.no_grad():
        for batch, compiled in ((3, 1), (5, 2), (3, 2)):
            x, r = inputs(batch)
            assert_matches_eager(fused(x, r), model(x, r))
            assert len(fused.reports()) == compiled
            assert fused.report().signature == f"(float32[{batch}, 4, 37], float32[{batch}, 4, 37])"
    assert all(len(report.fused) == 1 for report in fused.reports())


def test_max_signatures_runs_new_signatures_eager_with_one_warning():
    model = NormGelu()
    fused = autofuser.fuse(model, progress=False, max_signatures=1)
    with torch.no_grad():
        x, r = inputs(3)
        assert_matches_eager(fused(x, r), model(x, r))
        with pytest.warns(UserWarning, match="max_signatures") as record:
            for batch in (5, 5, 7):
                x, r = inputs(batch)
                assert_matches_eager(fused(x, r), model(x, r))
        x, r = inputs(3)
        assert_matches_eager(fused(x, r), model(x, r))
    assert len([w for w in record if "max_signatures" in str(w.message)]) == 1
    assert len(fused.reports()) == 1


def test_train_eval_switch_compiles_per_mode():
    model = NormGelu()
    fused = autofuser.fuse(model, progress=False)
    x, r = inputs(3)
    with torch.no_grad():
        fused(x, r)
        model.eval()  # on the model itself
        assert_matches_eager(fused(x, r), model(x, r))
        assert len(fused.reports()) == 2
        fused.train()  # through the wrapper
        assert model.training and model.ln.training
        assert_matches_eager(fused(x, r), model(x, r))
        assert len(fused.reports()) == 2  # the first signature again
        fused.eval()
        assert not model.ln.training
        fused(x, r)
        assert len(fused.reports()) == 2


def test_gradients_through_a_fused_group_match_eager():
    model = NormGelu()
    fused = autofuser.fuse(model, progress=False)
    x, r = inputs(3, requires_grad=True)
    grad_out = torch.randn(3, 4, 37)

    got = fused(x, r)
    assert got.requires_grad
    report = fused.report()
    forward = [g.ops for g in report.fused if g.phase == "forward"]
    assert forward == [["elementwise.add", "reduction.layer_norm_module", "elementwise.gelu"]]
    assert any(g.phase == "backward" for g in report.fused)  # its backward graph fused too
    got.backward(grad_out)
    fused_grads = [t.grad.clone() for t in (x, model.ln.weight, model.ln.bias)]

    x.grad = None
    model.zero_grad(set_to_none=True)
    expected = model(x, r)
    expected.backward(grad_out)
    eager_grads = [x.grad, model.ln.weight.grad, model.ln.bias.grad]

    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    for fused_grad, eager_grad in zip(fused_grads, eager_grads):
        torch.testing.assert_close(fused_grad, eager_grad, atol=1e-5, rtol=1e-4)


def test_parameters_are_read_at_call_time():
    model = NormGelu()
    fused = autofuser.fuse(model, progress=False)
    x, r = inputs(3)
    with torch.no_grad():
        before = fused(x, r)
        model.ln.weight.mul_(2)
        model.ln.bias.add_(torch.randn(37))
        after = fused(x, r)
        assert_matches_eager(after, model(x, r))
        assert not torch.allclose(before, after)

        replacement = NormGelu()
        model.load_state_dict(replacement.state_dict())
        assert_matches_eager(fused(x, r), replacement(x, r))
    assert len(fused.reports()) == 1
    assert len(fused.report().fused) == 1


# ---------------------------------------------------------------------------
# Models that can't be traced, bad arguments
# ---------------------------------------------------------------------------


class BranchesOnData(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return torch.sigmoid(x) * 2
        return x - 1


def test_untraceable_model_runs_unchanged_with_a_warning():
    model = BranchesOnData()
    fused = autofuser.fuse(model, progress=False)
    positive = torch.randn(3, 37).abs() + 0.1
    with pytest.warns(UserWarning, match="could not trace BranchesOnData"):
        assert_matches_eager(fused(positive), model(positive))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled once: no further warning
        assert_matches_eager(fused(-positive), model(-positive))  # the other branch, same signature
    report = fused.report()
    assert list(report.opaque) == [""]
    assert "control flow" in report.opaque[""]
    assert report.groups == [] and report.unfused_nodes == []
    assert "<whole model>" in str(report)


def test_unknown_option_names_it_and_lists_known_ones():
    with pytest.raises(autofuser.AutoFuserError) as caught:
        autofuser.fuse(NormGelu(), bogus=1)
    message = str(caught.value)
    assert "bogus" in message
    for option in ("cache_dir", "max_signatures", "tune", "tune_budget_s", "verify_speed", "progress"):
        assert option in message


def test_invalid_option_value_is_refused():
    with pytest.raises(autofuser.AutoFuserError, match="max_signatures"):
        autofuser.fuse(NormGelu(), max_signatures=0)


def test_fusing_a_class_is_a_capture_error():
    with pytest.raises(autofuser.CaptureError, match="instantiate"):
        autofuser.fuse(NormGelu)


def test_report_before_any_call_is_an_error():
    fused = autofuser.fuse(NormGelu(), progress=False)
    with pytest.raises(autofuser.AutoFuserError, match="nothing compiled yet"):
        fused.report()
    assert fused.reports() == []


# ---------------------------------------------------------------------------
# Verification: a wrong kernel never reaches the user
# ---------------------------------------------------------------------------


def _register_wrong_sigmoid(register):
    register(
        name="wrong.sigmoid",
        targets=(torch.sigmoid,),
        kind="pointwise",
        priority=10,  # beats elementwise.sigmoid
        lower=lambda ctx, x: ctx.pointwise("{0} * 0.5", x),  # not sigmoid at all
    )


WRONG_SIGMOID = types.ModuleType("wrong_sigmoid_plugin")
WRONG_SIGMOID.autofuser_register_lowerings = _register_wrong_sigmoid


class SigmoidChain(nn.Module):
    def forward(self, x, y):
        return torch.sigmoid(x * 2 + y) - y


def test_wrong_lowering_is_unfused_by_verification():
    x, y = torch.randn(3, 37), torch.randn(37)
    fused, got, expected = fuse_and_run(SigmoidChain(), x, y, plugins=None)
    assert fused.report().fused[0].ops[2] == "elementwise.sigmoid"  # control: right lowering fuses

    with torch.no_grad():
        fused = autofuser.fuse(SigmoidChain(), plugins=["elementwise", WRONG_SIGMOID], progress=False)
        assert_matches_eager(fused(x, y), expected)
        assert_matches_eager(fused(x, y), expected)  # and on the compiled path
    report = fused.report()
    assert report.fused == []
    [group] = report.skipped
    assert group.reason_code == "mismatch"
    assert "wrong.sigmoid" in group.ops
    assert "differs from eager" in group.reason and "sub" in group.reason
    assert "mismatch" in str(report)


# ---------------------------------------------------------------------------
# Generated source
# ---------------------------------------------------------------------------


def test_kernel_source_is_in_the_cache_and_names_the_nodes_it_replaces(tmp_path):
    x, y = torch.randn(3, 37, 11), torch.randn(37)
    fused, got, expected = fuse_and_run(PointwiseChain(), x, y, cache_dir=str(tmp_path))
    assert_matches_eager(got, expected)
    group = fused.report().fused[0]
    path = tmp_path / "kernels" / f"{group.kernel}.py"
    source = path.read_text()
    header = [line for line in source.splitlines() if line.startswith("#")]
    assert header[0].startswith("# Generated by AutoFuser (elementwise strategy")
    for node, op in zip(group.nodes, group.ops):
        assert any(line.split()[1:3] == [node, op] for line in header), (node, op, header)
    assert "in0=transpose[3, 11, 37]" in source and "in1=y[37]" in source
    assert f"def {group.kernel}(" in source
    assert group.kernel.startswith("af_flat_mul_add_gelu_sigmoid_clamp_sub")


def _fused_feedforward(seed: int):
    """Fuse and run ``FeedForward`` (checked against eager); its report and MLP groups."""
    torch.manual_seed(seed)
    model = FeedForward().eval()
    x = torch.randn(3, 19, 24)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
    report = fused.report()
    return report, [g for g in report.groups if g.strategy == "mlp"]


def test_an_mlp_that_fails_verification_is_replanned_one_product_per_group(monkeypatch):
    import autofuser_core.compile as compile_module
    import autofuser_core.tuning as tuning_module
    from autofuser_core.specs import Tolerance
    from autofuser_plugins.matmul.mlp.mlp_layout import MlpLayout

    real_tolerance = compile_module.tolerance

    def impossible_for_mlps(candidate, view):
        if isinstance(candidate.program.product_layout, MlpLayout):
            return Tolerance.model_construct(atol=-1.0, rtol=0.0)  # nothing passes
        return real_tolerance(candidate, view)

    monkeypatch.setattr(compile_module, "tolerance", impossible_for_mlps)
    limits = []  # the tuning-config limit each planning round ran under
    real_round = compile_module._verify_round

    def recording_round(*args, **kwargs):
        limits.append(tuning_module.CONFIG_LIMIT.get())
        return real_round(*args, **kwargs)

    monkeypatch.setattr(compile_module, "_verify_round", recording_round)
    report, mlp = _fused_feedforward(seed=7)
    assert mlp and not mlp[0].fused and mlp[0].reason_code == "mismatch"
    # Round 1 tunes every valid config; the re-planning round only the first few of each list.
    assert limits == [None, tuning_module.LATER_ROUND_CONFIGS], limits
    strategies = sorted(g.strategy for g in report.fused)
    assert strategies == ["layernorm_linear", "linear_epilogue"], str(report)
    covered = {n for g in report.fused for n in g.nodes}
    assert {"fc1", "fc2"} <= covered


def _timed_feedforward(
    use_timer,
    mlp_ms: float,
    part_ms: float,
    norm_ms: float = 0.3,
    bare_mlp_ms: Optional[float] = None,
    normed_part_ms: Optional[float] = None,
):
    """``_fused_feedforward`` under ``_stand_in_timer``: a kernel of two products takes
    ``mlp_ms`` (``bare_mlp_ms`` without the layer norm; the same by default), one of one
    product ``part_ms`` (``normed_part_ms`` with the layer norm; the same by default), the
    layer norm alone ``norm_ms``."""
    bare = mlp_ms if bare_mlp_ms is None else bare_mlp_ms
    normed_part = part_ms if normed_part_ms is None else normed_part_ms
    _stand_in_timer(
        use_timer,
        lambda layout, normed: (
            (mlp_ms if normed else bare)
            if layout == "mlp"
            else (normed_part if normed else part_ms)
            if layout == "matmul"
            else norm_ms
        ),
    )
    return _fused_feedforward(seed=7)


def test_a_kept_mlp_runs_as_its_split_when_the_split_is_faster(use_timer):
    """The MLP kernel beats eager (0.8 against 1 ms), but its two single-product groups
    together take 0.3 + 0.3 ms, and their ops' eager time (1 + 1 ms) covers the whole MLP's:
    the split runs, and the report says why the MLP group does not."""
    report, mlp = _timed_feedforward(use_timer, mlp_ms=0.8, part_ms=0.3)
    assert mlp and not mlp[0].fused and mlp[0].reason_code == "split_faster", str(report)
    assert "0.8000 ms vs 0.6000 ms as 2 shorter group(s)" in mlp[0].reason
    assert sorted(g.strategy for g in report.fused) == ["layernorm_linear", "linear_epilogue"], str(report)


def test_a_kept_mlp_faster_than_its_split_stays_one_kernel(use_timer):
    """Split by products (0.3 + 0.3 ms), then by products with the layer norm apart too
    (0.3 + 0.3 + 0.3), then with only the norm apart (0.3 + the MLP kernel's 0.5 ms
    without the norm): all slower than the kernel's 0.5 ms."""
    report, mlp = _timed_feedforward(use_timer, mlp_ms=0.5, part_ms=0.3)
    assert [g.strategy for g in report.fused] == ["mlp"], str(report)
    parts = [g for g in report.groups if g.reason_code == "larger_group_faster"]
    splits = {}
    for g in parts:
        splits.setdefault(g.reason.split("vs ")[-1], []).append(g.strategy)
    assert {k: sorted(v) for k, v in splits.items()} == {
        "0.6000 ms for the split)": ["layernorm_linear", "linear_epilogue"],
        "0.9000 ms for the split)": ["linear_epilogue", "linear_epilogue", "row_reduction"],
        "0.8000 ms for the split)": ["mlp", "row_reduction"],
    }, str(report)
    assert all("(0.5000 ms vs" in g.reason for g in parts)


def test_a_kept_mlp_runs_as_its_finest_split_when_that_is_faster(use_timer):
    """The MLP kernel with its layer norm (0.8 ms) beats its split by products with the
    norm in the first linear's kernel (0.6 + 0.3 ms: that kernel recomputes the norm), then
    loses to the norm's own kernel (0.1 ms) and the two linear kernels (0.3 + 0.3)."""
    report, mlp = _timed_feedforward(use_timer, mlp_ms=0.8, part_ms=0.3, norm_ms=0.1, normed_part_ms=0.6)
    assert sorted(g.strategy for g in report.fused) == ["linear_epilogue", "linear_epilogue", "row_reduction"], str(
        report
    )
    assert len(mlp) == 1 and mlp[0].reason_code == "split_faster", str(report)
    assert "0.8000 ms vs 0.7000 ms as 3 shorter group(s)" in mlp[0].reason
    by_products = [g for g in report.groups if g.reason_code == "larger_group_faster"]
    assert sorted(g.strategy for g in by_products) == ["layernorm_linear", "linear_epilogue"], str(report)


def test_a_kept_mlp_runs_apart_from_its_layer_norm_when_that_is_faster(use_timer):
    """The MLP kernel with its layer norm (0.8 ms) beats its split by products (0.5 + 0.5
    ms), and that split with the norm apart too (0.1 + 0.5 + 0.5), then loses to the
    norm's own kernel (0.1 ms) and the MLP kernel without it (0.3)."""
    report, mlp = _timed_feedforward(use_timer, mlp_ms=0.8, part_ms=0.5, norm_ms=0.1, bare_mlp_ms=0.3)
    assert sorted(g.strategy for g in report.fused) == ["mlp", "row_reduction"], str(report)
    whole = [g for g in mlp if "reduction.layer_norm_module" in g.ops]
    assert len(whole) == 1 and whole[0].reason_code == "split_faster", str(report)
    assert "0.8000 ms vs 0.4000 ms as 2 shorter group(s)" in whole[0].reason
    by_products = [g for g in report.groups if g.reason_code == "larger_group_faster"]
    assert sorted(g.strategy for g in by_products) == [
        "layernorm_linear",
        "linear_epilogue",
        "linear_epilogue",
        "linear_epilogue",
        "row_reduction",
    ], str(report)


def test_a_layer_norm_runs_as_its_own_kernel_when_that_is_faster_than_in_the_product(use_timer):
    """A layer norm + linear kernel that beats eager (0.6 against 1 ms) but loses to the
    norm's own kernel (0.1 ms) followed by the linear's (0.2 ms): the two run, and the
    report says why the larger group does not."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.LayerNorm(24), torch.nn.Linear(24, 40)).eval()
    x = torch.randn(3, 19, 24)

    def run(prologue_ms):
        _stand_in_timer(
            use_timer,
            lambda layout, normed: prologue_ms if layout == "matmul" and normed else 0.2 if layout == "matmul" else 0.1,
        )
        with torch.no_grad():
            fused = autofuser.fuse(model, progress=False)
            torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
        return fused.report()

    report = run(0.6)
    assert sorted(g.strategy for g in report.fused) == ["matmul", "row_reduction"], str(report)
    whole = [g for g in report.groups if g.strategy == "layernorm_linear"]
    assert len(whole) == 1 and whole[0].reason_code == "split_faster", str(report)
    assert "0.6000 ms vs 0.3000 ms as 2 shorter group(s)" in whole[0].reason

    report = run(0.25)
    assert [g.strategy for g in report.fused] == ["layernorm_linear"], str(report)
    parts = [g for g in report.groups if g.reason_code == "larger_group_faster"]
    assert sorted(g.strategy for g in parts) == ["matmul", "row_reduction"], str(report)


def test_tuning_configs_are_the_valid_ones_first_few_under_a_limit():
    import autofuser_core.tuning as tuning_module

    strategy = types.SimpleNamespace(
        configs=lambda program: [{"BLOCK": b} for b in (8, 16, 32, 64, 128, 256)],
        is_valid=lambda program, config: "too big" if config["BLOCK"] in (16, 128) else None,
        default_config=lambda program: {"BLOCK": 4},
        max_tuned_configs=None,
    )
    candidate = types.SimpleNamespace(strategy=strategy, program=None)

    def tuned():
        configs, cut = tuning_module._tuning_configs(candidate)
        return [c["BLOCK"] for c in configs], cut

    assert tuned() == ([8, 32, 64, 256], None)
    strategy.max_tuned_configs = 3  # the strategy's own cap counts valid configs only
    assert tuned() == ([8, 32, 64], None)
    token = tuning_module.CONFIG_LIMIT.set(2)  # a re-planning round's, when smaller: recorded as a cut
    try:
        assert tuned() == ([8, 32], 2)
        strategy.max_tuned_configs = 1  # the strategy's, when smaller: the round cut nothing
        assert tuned() == ([8], None)
        strategy.is_valid = lambda program, config: "none fits"
        assert tuned() == ([4], None)  # the default, as without a limit
    finally:
        tuning_module.CONFIG_LIMIT.reset(token)


def test_an_entry_tuned_over_a_few_configs_is_tuned_again_by_a_first_round():
    """A re-planning round tunes only a few configs and records that; a later first round
    (another compile meeting the same kernel) tunes it over every config instead of
    keeping the capped result for good."""
    import autofuser_core.tuning as tuning_module

    strategy = types.SimpleNamespace(
        configs=lambda program: [{"BLOCK": b} for b in (8, 16, 32, 64, 128)],
        is_valid=lambda program, config: None,
        default_config=lambda program: {"BLOCK": 4},
        max_tuned_configs=None,
    )
    candidate = types.SimpleNamespace(strategy=strategy, program=None)
    capped = {"config": {"BLOCK": 16}, "timings": [], "config_limit": tuning_module.LATER_ROUND_CONFIGS}
    full = {"config": {"BLOCK": 16}, "timings": []}
    assert tuning_module._valid_entry(candidate, capped) is None
    assert tuning_module._valid_entry(candidate, full) is full
    token = tuning_module.CONFIG_LIMIT.set(tuning_module.LATER_ROUND_CONFIGS)
    try:
        assert tuning_module._valid_entry(candidate, capped) is capped
    finally:
        tuning_module.CONFIG_LIMIT.reset(token)


def test_repeated_layers_share_one_kernel_and_one_tuning_key():
    """Layers that generate the same code tune once: the tuning key ignores the
    comment block naming each copy's fx nodes."""
    from autofuser_core.launch import FusedKernel

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(24)

        def forward(self, x):
            return torch.cumsum(F.gelu(self.norm(x)) + x, -1)  # cumsum: no lowering, ends the group

    model = nn.Sequential(Block(), Block(), Block())
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(2, 37, 24)
    expected = model(x)
    # Three cumsums grow the partial sums to thousands, and a small output is a
    # difference of large ones: its error is a few fp32 ulp of the largest magnitude
    # (8 ulp allowed), not 1e-5 absolute.
    torch.testing.assert_close(fused(x), expected, rtol=1e-4, atol=1e-6 * expected.abs().amax().item())
    ((gm, _),) = fused._compiled.values()
    kernels = [n.target for n in gm.graph.nodes if isinstance(n.target, FusedKernel)]
    assert len(kernels) == 3
    assert len({k.source.name for k in kernels}) == 1
    assert len({k.source.source for k in kernels}) == 3  # each names its own nodes...
    assert len({k.source.source_hash for k in kernels}) == 1  # ...and shares the tuning key


@pytest.mark.parametrize("out_features", [1, 5])
def test_a_product_with_one_row_fuses(out_features):
    """One row (batch 1, one point): the output tile still spans BLOCK_M rows of pointers."""
    model = nn.Sequential(nn.Linear(20, out_features), nn.Tanh()).eval()
    x = torch.randn(1, 20)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
    assert [g.strategy for g in fused.report().fused] == ["linear_epilogue"], str(fused.report())


def test_a_group_whose_code_cannot_be_generated_is_replanned(monkeypatch):
    """A failure to generate or load a kernel leaves that group eager and, like a failed
    check, sends its nodes to the next planning round, where smaller groups fuse."""
    import autofuser_core.compile as compile_module

    real_load = compile_module.load_kernel_module

    def no_mlp_kernels(name, source, root):
        if name.startswith("af_mlp"):
            raise RuntimeError("the compiler refused this kernel")
        return real_load(name, source, root)

    monkeypatch.setattr(compile_module, "load_kernel_module", no_mlp_kernels)
    report, mlp = _fused_feedforward(seed=8)
    assert mlp and not mlp[0].fused and mlp[0].reason_code == "codegen_failed"
    covered = {n for g in report.fused for n in g.nodes}
    assert {"fc1", "fc2"} <= covered, str(report)


# ---------------------------------------------------------------------------
# Which forwards may replay as a CUDA graph: those that never write into their inputs
# ---------------------------------------------------------------------------


class _SpectralLike(torch.nn.Module):
    """FNO's pattern: a buffer made in the forward, then written into by slice assignment."""

    def forward(self, x):
        out = torch.zeros(x.shape[0], 5, 7, dtype=x.dtype)
        out[:, :3, :4] = x[:, :3, :4] * 2
        return out + 1


class _WritesInput(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class _WritesInputThroughView(torch.nn.Module):
    def forward(self, x):
        x.reshape(-1)[:3] = 0.0
        return x.sum(dim=-1)


class _CountsCalls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x * self.calls


class _WritesInputOutsideTheTrace(torch.nn.Module):
    """The write sits in a part capture can't trace (value-dependent control flow)."""

    def forward(self, x):
        y = x * 3
        _scale_if_positive(x)
        return y


@torch.fx.wrap
def _scale_if_positive(x):
    if x.sum() > -1e9:
        x.mul_(2)
    return None


@pytest.mark.parametrize(
    "model,writes",
    [
        (_SpectralLike(), False),
        (_CountsCalls(), False),
        (_WritesInput(), True),
        (_WritesInputThroughView(), True),
        (_WritesInputOutsideTheTrace(), True),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, torch.nn.Module) else str(v),
)
def test_writes_into_inputs_tells_graph_safe_forwards_from_unsafe_ones(model, writes):
    from autofuser_core.fuse import writes_into_inputs

    x = torch.randn(2, 5, 7)
    before = x.clone()
    gm = autofuser.capture(model, x.clone())
    assert writes_into_inputs(gm, (x,)) is writes
    torch.testing.assert_close(x, before, atol=0, rtol=0)  # the check runs on copies


def test_baked_addresses_tell_in_place_updates_from_replaced_tensors_and_modules():
    """What a CUDA-graph replay checks on every call, without walking the module tree."""
    from autofuser_core.cudagraphs import BakedAddresses

    def model():
        return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3)).eval()

    m = model()
    baked = BakedAddresses(m)
    assert baked.unchanged()
    with torch.no_grad():
        m[0].weight.mul_(2)  # an optimiser's step: same memory
        m[1].running_mean.add_(torch.randn(7))
    assert baked.unchanged()
    for change in (
        lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.randn(7, 5))),
        lambda m: setattr(m[2].bias, "data", torch.randn(3)),
        lambda m: setattr(m[1], "running_var", torch.rand(7)),
        lambda m: m.__setitem__(2, torch.nn.Linear(7, 3)),
    ):
        m = model()
        baked = BakedAddresses(m)
        change(m)
        assert not baked.unchanged()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_checks_allow_roundings_of_the_tensor_scale_only(dtype):
    """A residual stream near 16 in bf16 that cancels to about 0.5 at one element: one
    rounding of the stream (16 * 2**-8 = 0.0625 in bf16) is not an error of the kernel;
    an error of the size of the values is. fp32 keeps the plain elementwise rule."""
    from autofuser_core.specs import DEFAULT_TOLERANCES, dtype_name
    from autofuser_core.verify import max_error

    tol = DEFAULT_TOLERANCES[dtype_name(dtype)]
    ulp = 16 * torch.finfo(dtype).eps  # the spacing at 16: two roundings of half a spacing
    scale = 16 + torch.rand(37) * 4
    eager = torch.cat([scale, torch.tensor([0.5])]).to(dtype)
    rounded_apart = eager.clone()
    rounded_apart[-1] += ulp  # the cancelled element off by two roundings of the stream
    ok, err = max_error(rounded_apart, eager, tol)
    assert ok and err > tol.atol + tol.rtol * 0.5, err  # the old, unscaled rule refused this
    wrong = eager.clone()
    wrong[-1] += 0.1 * float(eager.float().abs().max())  # 10% of the values' size: a wrong kernel
    assert not max_error(wrong, eager, tol)[0]
    with_inf = torch.cat([rounded_apart, torch.tensor([float("inf")], dtype=dtype)])
    assert max_error(with_inf, torch.cat([eager, torch.tensor([float("inf")], dtype=dtype)]), tol)[0]
    wrong_inf = torch.cat([wrong, torch.tensor([float("inf")], dtype=dtype)])  # inf does not widen the scale
    assert not max_error(wrong_inf, torch.cat([eager, torch.tensor([float("inf")], dtype=dtype)]), tol)[0]
    # One large value (or a masking sentinel) does not loosen the check for the rest.
    ones = torch.ones(1000, dtype=dtype)
    ones[0] = 1e4
    half_wrong = ones.clone()
    half_wrong[1::2] = 2.0  # every other element wrong by 1: the mean error gives it away
    assert not max_error(half_wrong, ones, tol)[0]
    scores = torch.randn(64, 64).to(dtype)
    scores[:, 5] = torch.finfo(dtype).min  # masked out
    garbage = scores.clone()
    garbage[:, 6:] = garbage[:, 6:] * 100
    assert not max_error(garbage, scores, tol)[0]
    assert max_error(scores.clone(), scores, tol)[0]
    # fp32 outputs: atol is absolute.
    fp32_tol = DEFAULT_TOLERANCES["float32"]
    eager32 = eager.float()
    off32 = eager32.clone()
    off32[-1] += 1e-3
    assert not max_error(off32, eager32, fp32_tol)[0]


def _mlp_kernel(fused):
    """The FusedKernel of the fused model's one MLP group."""
    from autofuser_core.launch import FusedKernel

    (mlp,) = [g for g in fused.report().fused if g.strategy == "mlp"]
    ((gm, _),) = fused._compiled.values()
    (kernel,) = [
        n.target for n in gm.graph.nodes if isinstance(n.target, FusedKernel) and n.target.source.name == mlp.kernel
    ]
    return kernel


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_autocast_mlp_weights_are_converted_once_by_the_launcher(grad):
    """Under bf16 autocast an MLP's fp32 weights reach the kernel already in bf16 (one
    conversion per call, rounding as autocast's own), not converted by every program;
    the result matches eager, gradients included (they come from the eager recompute)."""
    torch.manual_seed(11)
    model = FeedForward(width=24, hidden=40)
    x = torch.randn(3, 19, 24, requires_grad=grad)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got, expected = fused(x), model(x)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=4e-2)
    kernel = _mlp_kernel(fused)
    weights = {"fc1.weight", "fc2.weight"}
    cast = {kernel.attr_inputs[slot] for slot, dtype in kernel.casts if dtype == torch.bfloat16}
    assert cast == weights, (cast, kernel.attr_inputs)
    kernel_inputs = kernel.with_live_attrs([x])
    assert all(kernel_inputs[slot].to(dtype).stride() == kernel.input_layout[slot][1] for slot, dtype in kernel.casts)
    assert model.fc1.weight.dtype == torch.float32  # the parameters themselves are untouched
    if grad:
        (got.float().square().sum()).backward()
        ref_x = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ref_x).float().square().sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("short", [0, 1], ids=["at_threshold", "one_read_short"])
def test_autocast_linear_weight_is_converted_once_past_its_reads(monkeypatch, short):
    """A single product under bf16 autocast (linear + GELU) converts its fp32 weight once
    per call when its row tiles would read the weight often enough
    (``CONVERT_ONCE_MIN_READS``; lowered here so small shapes cross it), else each tile
    converts what it reads. Both match eager; only the first hands the kernel bf16."""
    from autofuser_core.launch import FusedKernel
    from autofuser_plugins.matmul import layout as matmul_layout

    reads = 36 * 20 * -(-(3 * 37) // matmul_layout.WEIGHT_READ_ROWS)  # weight elements x row tiles
    monkeypatch.setattr(matmul_layout, "CONVERT_ONCE_MIN_READS", reads + short)
    torch.manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(20, 36), torch.nn.GELU())
    x = torch.randn(3, 37, 20)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got, expected = fused(x), model(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    ((gm, _),) = fused._compiled.values()
    (kernel,) = [n.target for n in gm.graph.nodes if isinstance(n.target, FusedKernel)]
    assert kernel.source.layout == "matmul"
    cast = {kernel.attr_inputs[slot] for slot, dtype in kernel.casts if dtype == torch.bfloat16}
    assert cast == ({"0.weight"} if not short else set()), (cast, kernel.attr_inputs)
    # Converted on every call: an update of the parameter in place shows in the next forward.
    with torch.no_grad():
        model[0].weight.mul_(-0.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, expected = fused(x), model(x)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_a_strided_weight_is_read_as_it_is_under_autocast():
    """A weight that is a strided view (every other column of a larger matrix): a bf16
    copy would be contiguous, not what the kernel indexes, so it is not converted."""
    torch.manual_seed(5)
    model = FeedForward(width=24, hidden=40).eval()
    wide = torch.randn(40, 48) * 0.2
    model.fc1.weight = torch.nn.Parameter(wide[:, ::2])
    assert model.fc1.weight.stride() == (48, 2)
    x = torch.randn(2, 13, 24)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got, expected = fused(x), model(x)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=4e-2)
    kernel = _mlp_kernel(fused)
    assert {kernel.attr_inputs[slot] for slot, _ in kernel.casts} == {"fc2.weight"}


def test_one_element_host_tensors_move_to_the_kernels_device():
    """A forward's own constant (``x.masked_fill(m, torch.tensor(2.5))``) is a host tensor
    among device ones: eager takes it as a scalar, a kernel can't read host memory. (The
    meta device stands in for a GPU; tests/integration/test_conformance.py runs the real case there.)"""
    from types import SimpleNamespace

    from autofuser_core.launch import host_scalars, to_device

    program = SimpleNamespace(inputs=[SimpleNamespace(shape=s) for s in ((3, 37), (3, 37), (), (1,))])
    meta = torch.device("meta")
    inputs = [
        torch.empty(3, 37, device=meta),
        torch.empty(3, 37, dtype=torch.bool, device=meta),
        torch.tensor(2.5),
        torch.empty(1, device=meta),
    ]
    assert host_scalars(program, inputs, meta) == [2]  # one element on the device already: left alone
    moved = to_device(inputs, [2], meta)
    assert [t.device.type for t in moved] == ["meta"] * 4
    assert moved[0] is inputs[0] and moved[3] is inputs[3]
    host = [torch.randn(3, 37), torch.randn(3, 37) > 0, torch.tensor(2.5), torch.randn(1)]
    assert host_scalars(program, host, torch.device("cpu")) == []  # the interpreter's case
    assert to_device(host, [], meta) is host


def test_a_split_counts_the_measured_eager_time_of_a_part_that_stayed_eager(use_timer):
    """The norm's own kernel takes 0.1 ms, the linear's kernel 1.2 ms, slower than its eager
    1 ms, so the linear stays eager: the split costs 0.1 + 1 ms, more than the 0.6 ms of the
    norm + linear kernel, which runs. (Estimated as the larger group's eager time less the
    norm's, the linear would have cost nothing here, and the split would have run.)"""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.LayerNorm(24), torch.nn.Linear(24, 40)).eval()
    x = torch.randn(3, 19, 24)
    _stand_in_timer(use_timer, lambda layout, normed: (0.6 if normed else 1.2) if layout == "matmul" else 0.1)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
    report = fused.report()
    assert [g.strategy for g in report.fused] == ["layernorm_linear"], str(report)
    (linear,) = [g for g in report.groups if g.strategy == "matmul"]
    assert linear.reason_code == "slower", str(report)
    (norm,) = [g for g in report.groups if g.strategy == "row_reduction"]
    assert norm.reason_code == "larger_group_faster" and "0.6000 ms vs 1.1000 ms" in norm.reason, str(report)
