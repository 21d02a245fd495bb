"""Torch's TF32 settings read and set through either of its APIs (``autofuser_core/tf32.py``).

From torch 2.9 each backend has an ``fp32_precision``; once a program sets the matmul
one to "tf32", torch refuses the legacy reads (``allow_tf32``,
``get_float32_matmul_precision``) with a RuntimeError, which every fused call used to
raise. Each test leaves torch's settings as it found them.
"""

from __future__ import annotations

import pytest
import torch

import autofuser
from autofuser_core.tf32 import fp32_settings, strict_fp32, tf32_allowed

NEWER = hasattr(torch.backends.cuda.matmul, "fp32_precision")


@pytest.fixture
def restored():
    """Torch's TF32 settings put back after the test, through the API each was set by."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    yield
    if NEWER:
        torch.backends.cuda.matmul.fp32_precision = "none"  # legacy reads answer again
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.set_float32_matmul_precision(precision)


def test_the_legacy_flags_are_read_and_strict_fp32_turns_them_off_for_a_while(restored):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    assert tf32_allowed("matmul") and tf32_allowed("conv")
    before = fp32_settings()
    with strict_fp32():
        assert not tf32_allowed("matmul") and not tf32_allowed("conv")
        assert torch.get_float32_matmul_precision() == "highest"
    assert fp32_settings() == before and tf32_allowed("matmul")


@pytest.mark.skipif(not NEWER, reason="torch before 2.9 has no per-backend fp32_precision")
def test_with_the_newer_api_set_to_tf32_a_fused_model_runs_and_strict_fp32_holds(restored):
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    with pytest.raises(RuntimeError):
        torch.get_float32_matmul_precision()  # what every fused call read before
    assert tf32_allowed("matmul") and fp32_settings()[:2] == (True, "tf32")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU())
    x = torch.randn(4, 8)
    fused = autofuser.fuse(model, progress=False, tune=False)
    torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
    with strict_fp32():
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert not tf32_allowed("matmul") and not tf32_allowed("conv")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" and tf32_allowed("matmul")
