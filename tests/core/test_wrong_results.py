"""Regressions: ways a fused model once computed something other than eager.

Each test builds the smallest model showing one of them and compares the fused
forward with eager on fresh random inputs (and, where the bug hid behind a
verification on special values, after those values change).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autofuser


def _fuse(model, *inputs):
    fused = autofuser.fuse(model, progress=False)
    with torch.no_grad():
        fused(*inputs)
    return fused


def test_max_and_min_reductions_keep_nan():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.amax(-1), x.amin(-1) * 2

    x = torch.randn(4, 9)
    x[1, 3] = float("nan")
    fused = _fuse(M(), x)
    with torch.no_grad():
        for got, expected in zip(fused(x), M()(x)):
            torch.testing.assert_close(got, expected, equal_nan=True)
    assert fused.report().fused


def test_reducing_a_value_of_size_one_along_the_row_is_the_identity():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.g = torch.nn.Parameter(torch.zeros(4, 1))  # zero-init gate: verification alone can't tell

        def forward(self, x):
            return torch.softmax(x, -1) * self.g.sum(-1, keepdim=True).exp()

    torch.manual_seed(0)
    model = Gate()
    fused = _fuse(model, torch.randn(4, 6))
    with torch.no_grad():
        model.g.add_(0.3)
        x = torch.randn(4, 6)
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)


def test_out_arguments_and_batch_norm_updates_keep_their_order():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(6)

        def forward(self, x, buf):
            a = x * 2
            torch.mul(a, 3, out=buf)  # needs a: if the rewrite moved it after a's group ...
            r = buf.sum(0)  # ... this reader, independent of the group, would see the old buf
            b = torch.relu(a + 1)
            return b, r, self.bn(x) - self.bn.running_mean

    torch.manual_seed(0)
    model = M().train()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6)
    with torch.no_grad():
        got = autofuser.fuse(model, progress=False)(x, torch.zeros(5, 6))
        expected = reference(x, torch.zeros(5, 6))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)


def test_gumbel_draws_are_not_reordered():
    class M(torch.nn.Module):
        def forward(self, x, y):
            a = x * 2
            d = F.gumbel_softmax(a, tau=0.5)  # uses the group's value: would move after the group ...
            r = F.gumbel_softmax(y, tau=0.5)  # ... while this independent draw stayed before it
            return a + 1, d, r

    x, y = torch.randn(5, 6), torch.randn(5, 6)
    model = M()
    fused = _fuse(model, x, y)
    torch.manual_seed(11)
    with torch.no_grad():
        got = fused(x, y)
    torch.manual_seed(11)
    with torch.no_grad():
        expected = model(x, y)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_hooks_on_modules_keep_running():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    seen = []
    model[1].register_forward_hook(lambda mod, inp, out: seen.append(1))
    scale = {"s": 1.0}
    model[2].register_forward_hook(lambda mod, inp, out: out * scale["s"])
    fused = _fuse(model, torch.randn(4, 16))
    seen.clear()
    scale["s"] = 3.0
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = fused(x)
        assert len(seen) == 1
        torch.testing.assert_close(got, model(x), atol=1e-4, rtol=1e-4)


def test_no_grad_and_autocast_inside_forward_are_honoured():
    class Distil(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.teacher, self.student = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                target = torch.relu(self.teacher(x))
            return (torch.sigmoid(self.student(x)) - target).pow(2).mean()

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.lin(x)
            return y * 2

    x = torch.randn(4, 8)
    model = Distil()
    fused = autofuser.fuse(model, progress=False)
    fused(x).backward()
    assert model.teacher.weight.grad is None and model.student.weight.grad is not None
    mixed = Mixed().eval()
    fused_mixed = autofuser.fuse(mixed, progress=False)
    with torch.no_grad():
        assert fused_mixed(x).dtype == mixed(x).dtype == torch.bfloat16


def test_a_no_op_is_not_turned_into_a_copy():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            skip = self.drop(h)  # eval: `skip` is `h` itself
            h += 1
            return skip * 2

    model = M().eval()
    x = torch.randn(3, 8)
    fused = _fuse(model, x)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
    assert any(g.reason_code == "alias_output" for g in fused.report().skipped)


def test_every_node_ends_in_some_group_when_groups_merge_out_of_order():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.lin = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

        def forward(self, x, y):
            m = x > 0
            h = torch.where(m, x * 2, y.exp())
            s = torch.softmax(self.lin(self.ln(h)), -1)
            return s, m, h.amax(-1), (h * s).sum(0)

    x, y = torch.randn(3, 8), torch.randn(3, 8)
    model = M().eval()
    fused = _fuse(model, x, y)
    with torch.no_grad():
        for got, expected in zip(fused(x, y), model(x, y)):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert len(fused.report().fused) >= 2


def test_a_keyword_after_a_skipped_optional_argument():
    class M(torch.nn.Module):
        def forward(self, x, bias=None, scale=None):
            y = x * 2
            if bias is not None:
                y = y + bias
            if scale is not None:
                y = y * scale
            return torch.relu(y)

    model = M()
    x, s = torch.randn(4, 8), torch.randn(8)
    fused = autofuser.fuse(model, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, scale=s), model(x, scale=s))
        torch.testing.assert_close(fused(x, None, s), model(x, None, s))


def test_a_fused_model_deep_copies_and_saves(tmp_path):
    import autofuser_plugins.elementwise as elementwise

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    fused = autofuser.fuse(model, plugins=[elementwise, "reduction"], progress=False)
    x = torch.randn(3, 8)
    with torch.no_grad():
        fused(x)
        twin = copy.deepcopy(fused)  # the EMA-teacher pattern
        with torch.no_grad():
            twin.model[0].weight.mul_(2)
        torch.testing.assert_close(twin(x), twin.model(x), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)  # the original is untouched
    plain = autofuser.fuse(model, progress=False)
    torch.save(plain, tmp_path / "fused.pt")
    loaded = torch.load(tmp_path / "fused.pt", weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), atol=1e-5, rtol=1e-4)


def test_a_forward_updating_frozen_state_updates_it_once_per_call():
    class Codebook(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.ema = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
            self.seen = torch.zeros(1)  # a plain tensor attribute

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            with torch.no_grad():
                self.ema.mul_(0.5).add_(h.mean(0), alpha=0.5)
                self.seen.add_(x.shape[0])
            return h * 2 + self.ema

    torch.manual_seed(0)
    eager, fused_model = Codebook(), Codebook()
    fused_model.load_state_dict(eager.state_dict())
    fused = autofuser.fuse(fused_model, progress=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), eager(x))
    torch.testing.assert_close(fused_model.ema, eager.ema)
    assert fused_model.seen.item() == eager.seen.item() == 4


def test_arguments_a_guard_cannot_compare_run_the_original():
    class M(torch.nn.Module):
        def forward(self, x, table, flag):
            scale = float(table[0])
            y = torch.sigmoid(x) * scale
            return y + 1 if flag is True else y - 1

    model = M()
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(3, 5)
    with torch.no_grad(), pytest.warns(UserWarning, match="can't be hashed"):
        for value in (2.0, 3.0):  # a fresh array each call: its id() may repeat, its value differs
            table = np.array([value])
            torch.testing.assert_close(fused(x, table, True), model(x, table, True))
    with torch.no_grad():
        table = (2.0,)
        torch.testing.assert_close(fused(x, table, True), model(x, table, True))
        torch.testing.assert_close(fused(x, table, 1), model(x, table, 1))  # 1 == True, but not `is True`


class _ScaledGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(37))

    def forward(self, x):
        return torch.nn.functional.gelu(x * self.scale + 1)


def test_a_parameter_converted_after_compiling_never_reaches_the_kernel():
    """``model.double()`` after the first call converts the parameter in place: the inputs
    are unchanged (no new compile), but the parameter's dtype is not what the kernel was
    made for. The group runs eager and gives eager's float64 result, not a float32 one."""
    torch.manual_seed(0)
    model = _ScaledGelu()
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(3, 37)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
        assert fused.report().fused
        model.double()
        got, expected = fused(x), model(x)
    assert expected.dtype == torch.float64
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)
