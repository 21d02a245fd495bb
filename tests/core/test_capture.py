"""Tests of autofuser_core.capture: one concrete-shape fx graph per model, bit-exact."""

import logging
import math
import operator
import os
import subprocess
import sys

import einops
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops.layers.torch import Rearrange, Reduce

import autofuser
from autofuser_core.capture import capture
from autofuser_core.errors import CaptureError, OpaquePartError


def call_modules(gm):
    return {n.target: n for n in gm.graph.nodes if n.op == "call_module"}


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert torch.equal(a, b)


# ----------------------------------------------------------------- nested modules


class Norm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.LayerNorm(c)

    def forward(self, x):
        return self.norm(x)


class Proj(nn.Module):
    def __init__(self, c, d):
        super().__init__()
        self.fc = nn.Linear(c, d)

    def forward(self, x):
        return F.gelu(self.fc(x))


class Block(nn.Module):
    def __init__(self, c, d):
        super().__init__()
        self.pre = Norm(c)
        self.mlp = Proj(c, d)

    def forward(self, x):
        return self.mlp(self.pre(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage = nn.Sequential(Block(7, 11))
        self.head = nn.Linear(11, 3)

    def forward(self, x):
        return self.head(self.stage(x)) * 0.5


def test_nested_modules_are_inlined_and_adjacent():
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 5, 7)
    gm = capture(model, x)
    mods = call_modules(gm)
    norm, fc = mods["stage.0.pre.norm"], mods["stage.0.mlp.fc"]
    assert fc.args[0] is norm  # LayerNorm feeds the Linear directly
    assert norm.next is fc
    assert gm.meta["autofuser_opaque"] == {}
    assert gm.meta["autofuser_input_names"] == ["x"]
    x2 = torch.randn(3, 5, 7)
    assert torch.equal(gm(x2), model(x2))


# ----------------------------------------------------------------- FNO spectral layer


class SpectralConv2d(nn.Module):
    def __init__(self, cin, cout, m1, m2):
        super().__init__()
        self.cout, self.m1, self.m2 = cout, m1, m2
        scale = 1 / (cin * cout)
        self.w1 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))
        self.w2 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))

    @staticmethod
    def mul(a, w):
        return torch.einsum("bixy,ioxy->boxy", a, w)

    def forward(self, x):
        b = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, self.cout, x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, : self.m1, : self.m2] = self.mul(x_ft[:, :, : self.m1, : self.m2], self.w1)
        out_ft[:, :, -self.m1 :, : self.m2] = self.mul(x_ft[:, :, -self.m1 :, : self.m2], self.w2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNOLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.spec = SpectralConv2d(3, 3, 2, 3)
        self.w = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return F.gelu(self.spec(x) + self.w(x))


def test_fno_spectral_layer():
    torch.manual_seed(1)
    model = FNOLayer().eval()
    gm = capture(model, torch.randn(2, 3, 9, 7))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.fft.rfft2 in targets and torch.fft.irfft2 in targets
    assert targets.count(operator.setitem) == 2
    assert torch.zeros in targets
    assert gm.meta["autofuser_opaque"] == {}
    x = torch.randn(2, 3, 9, 7)
    assert torch.equal(gm(x), model(x))


# ----------------------------------------------------------------- opaque submodule


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x) - 1


class Sibling(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x).relu()


class WithBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = Sibling()
        self.branch = Branchy()
        self.right = Sibling()
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.right(self.branch(self.left(x))))


def test_value_dependent_submodule_becomes_opaque(caplog):
    torch.manual_seed(2)
    model = WithBranch().eval()
    with caplog.at_level(logging.INFO, logger="autofuser"):
        gm = capture(model, torch.randn(4, 6))
    opaque = gm.meta["autofuser_opaque"]
    assert list(opaque) == ["branch"] and "TraceError" in opaque["branch"]
    mods = call_modules(gm)
    assert {"left.fc", "right.fc", "out", "branch"} <= set(mods)
    assert "branch.a" not in mods
    assert mods["branch"].meta["autofuser_opaque_reason"] == opaque["branch"]
    assert "branch" in caplog.text
    pos, neg = torch.randn(4, 6).abs() + 5, -torch.randn(4, 6).abs() - 5
    with torch.no_grad():  # make the left output follow the input's sign
        model.left.fc.weight.copy_(torch.eye(6))
        model.left.fc.bias.zero_()
    for x in (pos, neg):
        assert torch.equal(gm(x), model(x))
    assert not torch.equal(model.branch(model.left(pos)), model.branch.b(model.left(pos)) - 1)


# ----------------------------------------------------------------- einops


class EinopsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_tokens = Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=2, p2=3)
        self.pool = Reduce("b n d -> b d", "mean")
        self.fc = nn.Linear(18, 5)

    def forward(self, x):
        t = self.fc(self.to_tokens(x))
        y = einops.rearrange(t, "b (h w) d -> b d h w", h=2)
        y = einops.reduce(y, "b d h w -> b d h", "max")
        y = einops.repeat(y, "b d h -> b d h r", r=3)
        return y.sum(-1) + self.pool(t).unsqueeze(-1)


def test_einops_lowers_to_plain_ops():
    torch.manual_seed(3)
    model = EinopsNet().eval()
    gm = capture(model, torch.randn(2, 3, 4, 9))
    assert gm.meta["autofuser_opaque"] == {}
    for node in gm.graph.nodes:
        assert not str(getattr(node.target, "__module__", "") or "").startswith("einops")
        if node.op == "call_module":
            assert not type(gm.get_submodule(node.target)).__module__.startswith("einops")
    ops = {n.target for n in gm.graph.nodes if n.op in ("call_method", "call_function")}
    assert {"reshape", "permute", "mean", "amax", "expand"} <= ops
    x = torch.randn(2, 3, 4, 9)
    assert torch.equal(gm(x), model(x))


# ----------------------------------------------------------------- shape patterns


class ShapePatterns(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x, H: int = 3, W: int = 2):
        B, N, C = x.shape
        assert N == H * W
        assert len(x.shape) == 3
        if x.dim() == 3:
            x = self.fc(x)
        levels = int(np.log2(N)) + int(math.sqrt(C))
        img = x.transpose(1, 2).reshape(B, C, H, W)
        z = torch.zeros(B, C, *img.shape[2:], device=x.device, dtype=x.dtype)
        z[..., :1] = img[..., :1] * levels
        noise = torch.randn(B, 1, H, W)
        out = z + img.view(B, -1, H, W) + 0 * noise
        return out.flatten(2).transpose(1, 2) * x.size(-1), noise


def test_shape_patterns_trace_without_opaque_parts():
    torch.manual_seed(4)
    model = ShapePatterns().eval()
    gm = capture(model, torch.randn(2, 6, 5))
    assert gm.meta["autofuser_opaque"] == {}
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.randn in targets and operator.setitem in targets
    x = torch.randn(2, 6, 5)
    torch.manual_seed(7)
    got = gm(x)
    torch.manual_seed(7)
    assert_same(got, model(x))
    assert not torch.equal(gm(x)[1], gm(x)[1])  # randn draws fresh numbers per call


# ----------------------------------------------------------------- train mode, state


class TrainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(9, 9)
        self.bn = nn.BatchNorm1d(9)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x))).tanh()


def test_train_mode_keeps_buffers_rng_and_inputs():
    torch.manual_seed(5)
    model = TrainNet().train()
    x = torch.randn(6, 9)
    x_before = x.clone()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    gm = capture(model, x)
    assert torch.equal(x, x_before)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    torch.manual_seed(11)
    got = gm(x)
    torch.manual_seed(11)
    assert torch.equal(got, model(x))


def test_every_tensor_node_has_tensor_meta():
    torch.manual_seed(6)
    for model, x in (
        (Net(), torch.randn(2, 3, 7)),
        (FNOLayer(), torch.randn(1, 3, 8, 6)),
        (WithBranch(), torch.randn(3, 6)),
    ):
        gm = capture(model.eval(), x)
        for node in gm.graph.nodes:
            if node.op in ("output",) or node.target is operator.setitem:
                continue
            assert "tensor_meta" in node.meta, node.format_node()


# ----------------------------------------------------------------- bad input, root fallback


class RootBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.mean() > 0:
            return self.fc(x)
        return -x


def test_not_a_module_raises():
    with pytest.raises(CaptureError, match="instantiate"):
        capture(Net, torch.randn(2, 7))
    with pytest.raises(CaptureError, match="nn.Module instance"):
        capture(42, torch.randn(2, 7))


def test_wrong_argument_count_raises():
    with pytest.raises(CaptureError, match="takes 1 input"):
        capture(Net(), torch.randn(2, 7), torch.randn(2, 7))


def test_keyword_inputs_are_bound():
    torch.manual_seed(8)
    model = ShapePatterns().eval()
    gm = capture(model, x=torch.randn(1, 8, 5), W=4, H=2)
    assert gm.meta["autofuser_input_names"] == ["x", "H", "W"]
    x = torch.randn(1, 8, 5)
    torch.manual_seed(3)
    got = gm(x, 2, 4)
    torch.manual_seed(3)
    assert_same(got, model(x, 2, 4))


def test_untraceable_root_runs_unchanged_with_warning():
    torch.manual_seed(9)
    model = RootBranch().eval()
    with pytest.warns(UserWarning, match="could not trace RootBranch.*unchanged"):
        gm = capture(model, torch.randn(3, 4))
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "output"]
    assert list(gm.meta["autofuser_opaque"]) == [""]
    for x in (torch.randn(3, 4).abs() + 1, -torch.randn(3, 4).abs() - 1):
        assert torch.equal(gm(x), model(x))


# ----------------------------------------------------------------- data-dependent, in-place, misc


class DataDependentShape(nn.Module):
    def forward(self, x):
        idx = (x > 0).nonzero()
        return x * idx.shape[0]


class IterMasked(nn.Module):
    def forward(self, x):
        return sum(row for row in x[x > 0])


class ItemScale(nn.Module):
    def forward(self, x):
        return x * x.abs().max().item() + x.shape[-1]  # scalar from data, shape static


@pytest.mark.parametrize("cls", [DataDependentShape, IterMasked])
def test_data_dependent_shapes_are_not_specialised(cls):
    torch.manual_seed(10)
    model = cls()
    with pytest.warns(UserWarning, match="depends on tensor data"):
        gm = capture(model, torch.randn(5, 3))
    for x in (torch.randn(5, 3), torch.randn(5, 3)):
        assert torch.equal(gm(x), model(x))


def test_item_scalar_is_recorded():
    torch.manual_seed(12)
    model = ItemScale()
    gm = capture(model, torch.randn(4, 5))
    assert gm.meta["autofuser_opaque"] == {}
    assert "item" in {n.target for n in gm.graph.nodes}
    x = torch.randn(4, 5)
    assert torch.equal(gm(x), model(x))


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls.add_(1)
        h = x * 2
        y = h
        y += 1  # aliases h, as in eager mode
        out = torch.empty(x.shape[0], 2 * x.shape[1])
        out[:, ::2] = h
        out[:, 1::2] = y + self.calls
        return out


def test_inplace_ops_and_buffer_updates_are_recorded():
    torch.manual_seed(13)
    model = InPlace()
    gm = capture(model, torch.randn(3, 5))
    assert torch.equal(model.calls, torch.zeros(1))
    targets = [n.target for n in gm.graph.nodes]
    assert operator.iadd in targets and "add_" in targets
    x = torch.randn(3, 5)
    got = gm(x)
    assert torch.equal(model.calls, torch.ones(1))  # the graph updated the shared buffer
    with torch.no_grad():
        model.calls.zero_()
    assert torch.equal(got, model(x))


class VarInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *extra, scale=None, mask=None):
        y = self.fc(x)
        for e in extra:
            y = y + e
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y * scale


def test_varargs_and_keyword_only_inputs():
    torch.manual_seed(14)
    model = VarInputs()
    x, e, s = torch.randn(2, 4), torch.randn(4), torch.randn(1)
    gm = capture(model, x, e, scale=s)
    assert gm.meta["autofuser_input_names"] == ["x", "scale", "mask", "*extra"]
    assert torch.equal(gm(x, s, None, e), model(x, e, scale=s))


def test_root_with_forward_hook_stays_whole():
    torch.manual_seed(15)
    model = Net().eval()
    model.register_forward_hook(lambda mod, args, out: out + 1)
    with pytest.warns(UserWarning, match="hooks"):
        gm = capture(model, torch.randn(2, 7))
    x = torch.randn(2, 7)
    assert torch.equal(gm(x), model(x))


def test_model_failing_eagerly_raises_its_own_error():
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        capture(nn.Sequential(nn.Linear(3, 4)), torch.randn(2, 5))


def test_tracing_frees_values_the_model_no_longer_holds():
    """Tracing needs about the memory of one eager run: a dead intermediate is freed at once."""
    import gc

    shape = (7, 13, 11)
    live_counts = []

    def count_live() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == shape)

    class Deep(nn.Module):
        def forward(self, x):
            for _ in range(30):
                x = torch.sin(x) * 1.5 + 0.25
            live_counts.append(count_live())
            return x

    gm = capture(Deep(), torch.randn(*shape))
    # The input, its clone, the current value and a temporary at most; 90 values were computed.
    assert live_counts and live_counts[0] <= 6, live_counts
    x = torch.randn(*shape)
    torch.testing.assert_close(gm(x), Deep()(x))


def test_broadcast_shapes_agrees_with_torch():
    """``autofuser.broadcast_shapes`` (used while lowering, instead of torch's, which imports
    sympy) gives torch's shape, or raises where torch raises."""
    import random

    from autofuser import broadcast_shapes

    rng = random.Random(0)
    for _ in range(2000):
        shapes = [tuple(rng.choice((1, 2, 3, 5)) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 3))]
        try:
            expected = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            with pytest.raises(RuntimeError, match="cannot be broadcast"):
                broadcast_shapes(*shapes)
        else:
            assert broadcast_shapes(*shapes) == expected, shapes


COLD_COMPILE_SCRIPT = r"""
import sys
import torch
import autofuser
from autofuser.zoo.models import MODELS

for name in ("fno", "lsm", "transolver"):
    entry = MODELS[name]
    model = entry.make("tiny").eval()
    x = entry.inputs(torch.randn(2, 17, 9, 2))
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        error = (fused(x) - model(x)).abs().max().item()  # (torch.testing imports sympy itself)
    assert error < 1e-4 and fused.report().fused, (name, error)
print("sympy imported:", "sympy" in sys.modules)
"""


def test_a_compile_leaves_sympy_unimported(tmp_path):
    """torch imports sympy (seconds, on a cold machine) for its symbolic shapes; capture,
    planning and compiling need none of it, so a first call does not pay for it."""
    env = dict(os.environ, AUTOFUSER_CACHE_DIR=str(tmp_path), TRITON_INTERPRET="1")  # CPU tensors, on a GPU machine too
    done = subprocess.run(
        [sys.executable, "-c", COLD_COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sympy imported: False" in done.stdout, done.stdout


def test_strict_capture_names_the_part_that_stays_opaque():
    torch.manual_seed(3)
    model = WithBranch().eval()
    x = torch.randn(5, 6)
    fused = autofuser.fuse(model, plugins=["elementwise", "matmul"], fullgraph=True, progress=False)
    with pytest.raises(OpaquePartError, match=r"fullgraph=True.*WithBranch\.branch: .*TraceError.*without fullgraph"):
        fused(x)
    # Without it the same model runs, that part unfused.
    lenient = autofuser.fuse(model, plugins=["elementwise", "matmul"], progress=False)
    with torch.no_grad():
        torch.testing.assert_close(lenient(x), model(x))
    assert list(lenient.report().opaque) == ["branch"]
