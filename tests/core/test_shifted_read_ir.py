"""Shifted and reshaped reads (``ctx.read_shifted``, ``ctx.read_reshaped``): the index
arithmetic of each mode against torch, the refusals where a read can't be honoured (a reduction below it, a matrix
product or a strategy's own layout in its group), and bad arguments named."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.group import GroupRefused
from autofuser_core.ir import LoweringContext, LoweringRefused
from autofuser_core.planner import PlanningView


def _view(model: nn.Module, *inputs: torch.Tensor) -> PlanningView:
    return PlanningView(autofuser.capture(model, *inputs), autofuser.load_plugins().registry)


def _nodes(view: PlanningView, *names: str) -> list[torch.fx.Node]:
    by_name = {n.name: n for n in view.nodes}
    return [by_name[name] for name in names]


class Shifted(nn.Module):
    """Reads ``x`` (computed: ``x * 2``) at shifted coordinates through one op per mode."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x * 2.0) + 1.0


@pytest.mark.parametrize(
    "op",
    [
        lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"),
        lambda x: F.pad(x, (2, 1, 3, 2), mode="replicate"),
        lambda x: F.pad(x, (4, 1, 6, 2), mode="circular"),
        lambda x: F.pad(x, (-2, 3, 1, -1), value=2.5),
        lambda x: torch.roll(x, (-13, 4), (-1, -2)),
        # nested reads: a pad of a roll of a pad
        lambda x: F.pad(torch.roll(F.pad(x, (1, 1)), 3, -1), (2, 0, 0, 1), mode="reflect"),
    ],
    ids=["reflect", "replicate", "circular", "fill-crop", "wrap", "nested"],
)
def test_each_mode_reads_where_torch_does(op):
    model = Shifted(op)
    x = torch.randn(2, 7, 5)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
    report = fused.report()
    assert len(report.fused) == 1 and len(report.fused[0].ops) >= 3, str(report)


def test_a_reduction_below_a_shifted_read_refuses_the_group():
    view = _view(Shifted(lambda x: torch.roll(torch.softmax(x, -1), 1, 1)), torch.randn(2, 7, 5))
    with pytest.raises(GroupRefused) as err:
        view.compose(_nodes(view, "mul", "softmax", "roll"))
    assert err.value.code == "shifted_reduction"


class ProductThenRoll(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return torch.roll(self.fc(x), 1, 1)


def test_a_product_and_a_shifted_read_refuse_the_group():
    view = _view(ProductThenRoll(), torch.randn(2, 7, 5))
    with pytest.raises(GroupRefused) as err:
        view.compose(_nodes(view, "fc", "roll"))
    assert err.value.code == "shifted_read"


def test_a_strategys_own_layout_never_sees_a_shifted_read():
    view = _view(Shifted(lambda x: torch.roll(x, 1, 1)), torch.randn(2, 7, 5))

    def lay_out(program, values):
        raise AssertionError("the layout was handed a shifted read")

    with pytest.raises(GroupRefused) as err:
        view.compose(_nodes(view, "mul", "roll"), lay_out=lay_out)
    assert err.value.code == "shifted_read"


def _context() -> tuple[LoweringContext, torch.fx.Node]:
    gm = autofuser.capture(Shifted(lambda x: x), torch.randn(3, 4))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    return LoweringContext(node, gm, {}), node


def test_bad_arguments_are_named():
    ctx, node = _context()
    with pytest.raises(ValueError, match="one entry per dim"):
        ctx.read_shifted(node, (3,), (0,))
    with pytest.raises(ValueError, match="mode 'mirror'"):
        ctx.read_shifted(node, (3, 4), (0, 0), mode="mirror")
    with pytest.raises(ValueError, match="must be positive"):
        ctx.read_shifted(node, (3, 4), (0, 0), scales=(1, 0))
    with pytest.raises(ValueError, match="index 4 of dim 1 is outside"):
        ctx.read_shifted(node, (3,), (0,), fixed_dims={1: 4})
    with pytest.raises(ValueError, match="one entry per dim"):
        ctx.read_shifted(node, (3, 4), (0, 0), new_dims=(0,))
    with pytest.raises(LoweringRefused, match="mirrors more than once"):
        ctx.read_shifted(node, (3, 12), (0, -4), mode="reflect")
    with pytest.raises(LoweringRefused, match="fill of shape"):
        ctx.read_shifted(node, (3, 4), (0, 1), fill=ctx.tensor(node).__class__("const", (5,), constant=0.0))


class EdgeColumns(nn.Module):
    """Width-1 pads broadcast over the row: one reads the fill only (past the edge), one
    reads the last column, mirrored back."""

    def forward(self, x):
        y = x * 2.0
        return x + F.pad(y, (-4, 1), value=3.0) - F.pad(y, (-3, 0), mode="constant") * F.pad(y, (0, -3))


def test_a_read_at_a_fixed_coordinate_is_resolved_when_written():
    x = torch.randn(3, 4)
    fused = autofuser.fuse(EdgeColumns(), progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), EdgeColumns()(x))
    report = fused.report()
    assert any(g.ops.count("elementwise.pad") == 3 for g in report.fused), str(report)


def test_a_reshaped_read_with_another_element_count_is_refused():
    ctx, node = _context()
    with pytest.raises(LoweringRefused, match=r"\[3, 4\] \(12 elements\) can't be read as \[5, 2\]"):
        ctx.read_reshaped(node, (5, 2))


@pytest.mark.parametrize(
    "shape, op",
    [
        ((2, 3, 5, 4), lambda x: x.permute(0, 2, 1, 3).reshape(2, 5, 12)),  # merge in the last run
        ((6, 5, 1), lambda x: x.transpose(0, 1).reshape(2, 15)),  # one run over every dim, a size-1 dim in it
        ((4, 6), lambda x: x.t().reshape(4, 3, 2)),  # split and merge in one run (6 x 4 -> 4 x 3 x 2)
        ((1, 7, 3), lambda x: x.transpose(1, 2).reshape(-1)),  # batch 1, everything merged
    ],
    ids=["merge-heads", "size-1", "regroup", "flatten"],
)
def test_reshaped_reads_take_torchs_row_major_order(shape, op):
    model = Shifted(lambda y: op(y).sigmoid())
    x = torch.randn(shape)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
    report = fused.report()
    assert any("elementwise.reshape" in g.ops and "elementwise.sigmoid" in g.ops for g in report.fused), str(report)


def test_a_reduction_below_a_reshaped_read_refuses_the_group():
    # x transposed: the products keep its strides, so the reshape copies
    x = torch.randn(2, 5, 7).transpose(1, 2)
    view = _view(Shifted(lambda y: (y.sum(1, keepdim=True) * y).reshape(2, -1)), x)
    with pytest.raises(GroupRefused) as err:
        view.compose(_nodes(view, "mul", "sum_1", "mul_1", "reshape"))
    assert err.value.code == "shifted_reduction"
