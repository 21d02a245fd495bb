"""einsum equations beyond the matrix-product forms (``plugins/matmul/einsum_rewrite.py``):
several batch, row, column or contracted letters become views around one batched
product, which fuses; forms that are no product stay eager with their reason; complex
einsums stay the library's call."""

from __future__ import annotations

import pytest
import torch

import autofuser
from autofuser import PRODUCT_TOLERANCES


class Einsum(torch.nn.Module):
    def __init__(self, equation: str):
        super().__init__()
        self.equation = equation

    def forward(self, a, b):
        return torch.einsum(self.equation, a, b)


def _fused(model, *inputs):
    with torch.no_grad():
        expected = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
    return expected, got, fused.report()


FORMS = [
    # GNOT's normaliser: a matrix-vector product per head (no column letter)
    ("bhnd,bhd->bhn", (2, 3, 37, 5), (2, 3, 5)),
    # a batch letter in one operand only: b read as [b, 1, j, k]; batch 1
    ("bnij,bjk->bnik", (1, 3, 29, 13), (1, 13, 19)),
    # FNO's 2-D spectral weights on real tensors: two batch letters after the matrix's
    ("bixy,ioxy->boxy", (3, 5, 7, 6), (5, 11, 7, 6)),
    # F-FNO's 1-D weights: a batch letter the second operand lacks in the output's order
    ("bixy,iox->boxy", (2, 5, 7, 6), (5, 3, 7)),
    # FactFormer's axis kernels: two column letters merged (a view) ...
    ("bhij,bhjyd->bhiyd", (2, 2, 9, 17), (2, 2, 17, 5, 3)),
    # ... and merged with a copy, as einsum copies, so its result keeps einsum's strides
    ("bhkl,bhxld->bhxkd", (2, 2, 9, 7), (2, 2, 17, 7, 3)),
    # LSM's basis weights: a row letter split off as a broadcast batch dim
    ("phldk,hdk->phld", (5, 2, 3, 4, 6), (2, 4, 6)),
    # two contracted letters, and an implicit output
    ("abcd,cdbe->ae", (3, 5, 4, 7), (4, 7, 5, 9)),
    ("ij,jk", (13, 7), (7, 5)),
    # an outer product (nothing contracted)
    ("i,j->ij", (11,), (6,)),
]


COPIES = {"bhkl,bhxld->bhxkd", "abcd,cdbe->ae"}  # einsum copies an operand there too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("equation,shape_a,shape_b", FORMS, ids=[f[0] for f in FORMS])
def test_product_forms_fuse_and_match_eager(equation, shape_a, shape_b, dtype):
    a, b = torch.randn(*shape_a, dtype=dtype), torch.randn(*shape_b, dtype=dtype)
    expected, got, report = _fused(Einsum(equation), a, b)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert got.stride() == expected.stride()  # code after an einsum may .view() its result
    tol = PRODUCT_TOLERANCES[str(dtype).removeprefix("torch.")]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol.atol, rtol=tol.rtol)
    products = [g for g in report.fused if any("matmul" in op for op in g.ops)]
    assert len(products) == 1, str(report)
    eager = [n.target for n in report.unfused_nodes if not n.free]
    assert eager == [], str(report)  # only views around it
    # where einsum's own strides need the copy einsum makes, that copy is a kernel of its own
    copies = [g for g in report.fused if g.ops == ["elementwise.reshape"]]
    assert len(copies) == (1 if equation in COPIES else 0), str(report)


def test_product_form_fuses_with_a_transposed_input():
    # the operand's own strides decide whether rows merge as a view
    a = torch.randn(2, 13, 3, 5).transpose(1, 2)  # [b, n, i, j], i and n not mergeable
    b = torch.randn(2, 5, 9)
    expected, got, report = _fused(Einsum("bnij,bjk->bnik"), a, b)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert got.stride() == expected.stride()
    assert any("matmul" in op for g in report.fused for op in g.ops)


@pytest.mark.parametrize(
    "equation,shapes,reason",
    [
        ("bii,bij->bj", ((2, 5, 5), (2, 5, 7)), "diagonal"),
        ("ij,jk->k", ((4, 5), (5, 6)), "summed within one operand"),
        ("...ij,...jk->...ik", ((2, 4, 5), (2, 5, 6)), "ellipsis"),
    ],
)
def test_forms_that_are_no_product_stay_eager_with_the_reason(equation, shapes, reason):
    a, b = (torch.randn(*s) for s in shapes)
    expected, got, report = _fused(Einsum(equation), a, b)
    assert torch.equal(got, expected)
    (entry,) = [n for n in report.unfused_nodes if "einsum" in n.target]
    assert entry.reason_code == "unsupported_equation" and reason in entry.reason, entry.reason


class SpectralWeights(torch.nn.Module):
    """FNO's mixing of kept modes with complex weights stored as real ``[..., 2]``."""

    def __init__(self, channels: int, out_channels: int, modes: tuple[int, int]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(channels, out_channels, *modes, 2) / channels)
        self.modes = modes

    def forward(self, x):
        m1, m2 = self.modes
        x_ft = torch.fft.rfft2(x)[:, :, :m1, :m2]
        mixed = torch.einsum("bixy,ioxy->boxy", x_ft, torch.view_as_complex(self.weight))
        return torch.view_as_real(mixed) * 2.0


def test_complex_einsum_stays_the_library_product_and_is_reported_as_one():
    model = SpectralWeights(3, 5, (4, 3))
    x = torch.randn(1, 3, 11, 7)
    expected, got, report = _fused(model, x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    (entry,) = [n for n in report.unfused_nodes if "einsum" in n.target]
    assert entry.reason_code == "unsupported_dtype" and "complex64" in entry.reason
    # the real view of its result feeds the fused multiplication
    assert any("mul" in op for g in report.fused for op in g.ops)


def test_product_form_under_bf16_autocast_matches_eager():
    a, b = torch.randn(2, 5, 7, 6), torch.randn(5, 11, 7, 6)  # fp32 inputs, the product in bf16
    model = Einsum("bixy,ioxy->boxy")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got, report = _fused(model, a, b)
    assert got.dtype == expected.dtype == torch.bfloat16 and got.stride() == expected.stride()
    tol = PRODUCT_TOLERANCES["bfloat16"]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol.atol, rtol=tol.rtol)
    assert any("matmul" in op for g in report.fused for op in g.ops), str(report)
