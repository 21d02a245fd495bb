"""CUDA takes at most 65535 programs on a launch grid's second and third axes
(``autofuser.kernel.MAX_GRID_YZ``). A batched product walks its batch on the second axis;
past the limit (an LSM's patches times heads) it folds the batch into the first. A kernel
whose grid is past the limits anyway is refused with a sentence naming it, and its group
stays eager, where the launch would fail with CUDA's bare "invalid argument".

The limit is lowered here so that a small batch crosses it in Triton's interpreter."""

import pytest
import torch

import autofuser
import autofuser_core.codegen as codegen
from autofuser import KernelSource
from autofuser.kernel import MAX_GRID_YZ, GridTooLarge
from autofuser_plugins.matmul import kernel as matmul_kernel

from _helpers import fuse_and_compare, one_group_with, trains_like_eager


class BatchedProductEpilogue(torch.nn.Module):
    """``relu(a @ b + bias)`` over batch dims broadcast from ``b``."""

    def __init__(self, n: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, a, b):
        return torch.relu(a @ b + self.bias)


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [((3, 4, 37, 19), (3, 4, 19, 23)), ((7, 1, 21, 9), (1, 6, 9, 17)), ((9, 5, 11), (9, 11, 13))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_batch_past_the_grid_limit_is_folded_into_axis_0_and_equals_eager(monkeypatch, a_shape, b_shape, dtype):
    monkeypatch.setattr(matmul_kernel, "MAX_GRID_YZ", 5)
    model = BatchedProductEpilogue(b_shape[-1]).to(dtype)
    a, b = torch.randn(a_shape, dtype=dtype), torch.randn(b_shape, dtype=dtype)
    group = one_group_with(fuse_and_compare(model, a, b))
    assert "pid_all = tl.program_id(0)" in group.kernel_source, group.kernel_source
    assert "tl.program_id(1)" not in group.kernel_source, group.kernel_source


def test_a_folded_batch_trains_like_eager(monkeypatch):
    monkeypatch.setattr(matmul_kernel, "MAX_GRID_YZ", 3)
    report = trains_like_eager(BatchedProductEpilogue(13), torch.randn(2, 3, 25, 7), torch.randn(2, 3, 7, 13))
    assert any("pid_all" in (group.kernel_source or "") for group in report.fused), str(report)


def test_a_batch_within_the_limit_keeps_its_own_axis():
    model = BatchedProductEpilogue(23)
    group = one_group_with(fuse_and_compare(model, torch.randn(3, 4, 37, 19), torch.randn(3, 4, 19, 23)))
    assert "tl.program_id(1)" in group.kernel_source and "pid_all" not in group.kernel_source


def _source(grid):
    return KernelSource(name="af_probe", source="", layout="flat", grid=lambda config: grid)


def test_launch_grid_names_the_kernel_and_the_axis_past_the_limit():
    assert _source((7, MAX_GRID_YZ, MAX_GRID_YZ)).launch_grid({}) == (7, MAX_GRID_YZ, MAX_GRID_YZ)
    with pytest.raises(GridTooLarge, match=r"af_probe.*axis 1.*65535.*fold"):
        _source((4, MAX_GRID_YZ + 1)).launch_grid({})
    with pytest.raises(GridTooLarge, match=r"axis 0"):
        _source((2**31,)).launch_grid({})
    with pytest.raises(GridTooLarge, match=r"axis 2"):
        _source((1, 1, 70000)).launch_grid({})
    with pytest.raises(GridTooLarge, match="4 axes"):
        _source((1, 1, 1, 1)).launch_grid({})


def test_a_kernel_past_the_grid_limit_leaves_its_group_eager_and_says_why(monkeypatch):
    """The plugin writes its usual grid (the batch on axis 1: 12 entries), the launch's limit
    is 5: the group is refused with the sentence, and the model stays right."""
    monkeypatch.setattr(codegen, "MAX_GRID_YZ", 5)
    model = BatchedProductEpilogue(23)
    a, b = torch.randn(3, 4, 37, 19), torch.randn(3, 4, 19, 23)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        torch.testing.assert_close(fused(a, b), model(a, b))
    refused = [g for g in fused.report().groups if not g.fused and "GridTooLarge" in (g.reason or "")]
    assert refused and "past CUDA's limit of 5" in refused[0].reason, str(fused.report())
