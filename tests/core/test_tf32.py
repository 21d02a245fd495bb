"""Torch's TF32 settings read and set through either of its APIs (``autofuser_core/tf32.py``).

From torch 2.9 each backend has an ``fp32_precision``; once a program sets the matmul
one to "tf32", torch refuses the legacy reads (``allow_tf32``,
``get_float32_matmul_precision``) with a RuntimeError, which every fused call used to
raise. Each test leaves torch's settings as it found them.
"""

from __future__ import annotations

import pytest
import torch

from autofuser_core.tf32 import fp32_settings, strict_fp32, tf32_allowed

NEWER = hasattr(torch.backends.cuda.matmul, "fp32_precision")


@pytest.fixture
def restored():
    """Torch's legacy TF32 flags put back after the test (the newer API is only written in
    a fresh interpreter: once written, torch refuses the legacy reads for good)."""
    legacy = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
    torch.set_float32_matmul_precision(precision)


def test_the_legacy_flags_are_read_and_strict_fp32_turns_them_off_for_a_while(restored):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    assert tf32_allowed("matmul") and tf32_allowed("conv")
    before = fp32_settings()
    legacy = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    with strict_fp32():
        assert not tf32_allowed("matmul") and not tf32_allowed("conv")
        assert fp32_settings() != before
    assert tf32_allowed("matmul") and tf32_allowed("conv")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == legacy


FRESH_PROCESS = """
import torch, autofuser
from autofuser_core.tf32 import fp32_settings, strict_fp32, tf32_allowed
torch.backends.cuda.matmul.fp32_precision = "tf32"
try:
    torch.get_float32_matmul_precision()
    refused = False
except RuntimeError:
    refused = True  # what every fused call read before
assert tf32_allowed("matmul") and "tf32" in fp32_settings()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU())
x = torch.randn(4, 8)
fused = autofuser.fuse(model, progress=False, tune=False)
torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
with strict_fp32():
    assert torch.backends.cuda.matmul.fp32_precision == "ieee" and not tf32_allowed("conv")
assert torch.backends.cuda.matmul.fp32_precision == "tf32" and tf32_allowed("matmul")
torch.backends.fp32_precision = "tf32"
torch.backends.cudnn.conv.fp32_precision = "ieee"
before = fp32_settings()
with strict_fp32():
    assert set(fp32_settings()) == {"ieee"}
assert fp32_settings() == before  # every backend reads as before
print("refused" if refused else "answered")
"""


@pytest.mark.skipif(not NEWER, reason="torch before 2.9 has no per-backend fp32_precision")
def test_with_the_newer_api_set_to_tf32_a_fused_model_runs_and_strict_fp32_holds():
    """In a fresh interpreter, where torch refuses the legacy reads once the newer API says "tf32"."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "refused"  # the state the fix is for
