"""``unbind`` (through the graph pass that reads its parts as selects) and ``select``:
the components of a field read in place by the kernel that uses them."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
from test_roll_pad import DTYPES, fuse_and_compare, one_group_with, trains_like_eager

import autofuser


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class KineticEnergy(nn.Module):
    """A velocity field's components unbound along ``dim`` and combined pointwise.

    (The field is an input: a computed field read by several parts is still its own
    kernel, the planner growing groups one producer-consumer edge at a time.)"""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.density = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        u, v, w = x.unbind(self.dim)
        return 0.5 * self.density * (u * u + v * v) - torch.tanh(w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim, shape", [(-1, (1, 37, 3)), (1, (2, 3, 5, 7)), (0, (3, 11))])
def test_unbound_components_are_read_by_one_kernel(dtype, dim, shape):
    model = KineticEnergy(dim).to(dtype)
    report = fuse_and_compare(model, torch.randn(shape, dtype=dtype))
    group = one_group_with(report, "elementwise.select", "elementwise.tanh", "elementwise.mul")
    assert group.ops.count("elementwise.select") == 3


def test_unbind_trains_like_eager():
    trains_like_eager(KineticEnergy(-1), torch.randn(2, 9, 3))


class PartsLeave(nn.Module):
    def forward(self, x):
        u, v = x.unbind(1)
        return u, u * v


def test_a_part_read_outside_its_group_stays_a_view():
    x = torch.randn(4, 2, 5)
    fused = autofuser.fuse(PartsLeave(), progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        got = fused(x)
    expected = PartsLeave()(x)
    torch.testing.assert_close(got[1], expected[1])
    assert got[0]._base is x or got[0].data_ptr() == x.data_ptr(), "u must stay eager's view of x"


class WholeTuple(nn.Module):
    def forward(self, x):
        parts = x.unbind(0)
        return torch.stack(parts[1:], 0) * 2  # a slice of the tuple: the unbind stays


def test_an_unbind_read_as_a_tuple_is_left_alone():
    x = torch.randn(3, 4)
    fused = autofuser.fuse(WholeTuple(), progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), WholeTuple()(x))
