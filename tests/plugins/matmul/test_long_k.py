"""Products over a long K in strict fp32: the kernel sums K in chunks, each chunk's sum
added to the accumulator by an ordinary fp32 addition (tensor cores do not round each
addition into an fp32 accumulator to nearest, so one accumulator over all of K drifts).
A weight gradient reduces over every row of the batch: K is the rows."""

import pytest
import torch

from autofuser_plugins.matmul.kernel import K_CHUNK

from _helpers import fuse_and_compare, one_group_with


class Gram(torch.nn.Module):
    """``a^T b`` over the points, as a weight gradient or a Galerkin projection is."""

    def forward(self, a, b):
        return torch.bmm(a.transpose(1, 2), b) * 0.5


@pytest.mark.parametrize(("batch", "points", "width"), [(1, 1100, 16), (3, 2 * K_CHUNK + 37, 12)])
def test_long_k_sums_in_chunks_and_equals_eager(batch, points, width):
    a, b = torch.randn(batch, points, width), torch.randn(batch, points, 20)
    group = one_group_with(fuse_and_compare(Gram(), a, b), "matmul.bmm")
    source = group.kernel_source
    assert f"for c0 in range(0, {points}, {K_CHUNK}):" in source and "acc += part" in source, source


def test_short_k_and_16_bit_products_keep_one_accumulator():
    a, b = torch.randn(2, 300, 8), torch.randn(2, 300, 8)
    source = one_group_with(fuse_and_compare(Gram(), a, b), "matmul.bmm").kernel_source
    assert "for k0 in range(0, 300, BLOCK_K):" in source and "part" not in source
    a16, b16 = torch.randn(2, 1100, 8, dtype=torch.bfloat16), torch.randn(2, 1100, 8, dtype=torch.bfloat16)
    source = one_group_with(fuse_and_compare(Gram(), a16, b16), "matmul.bmm").kernel_source
    assert "part" not in source
