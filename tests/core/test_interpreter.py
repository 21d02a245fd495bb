"""``autofuser_core.interpreter``: kernels that can't run are said once, loudly, with the
fix, and the model still computes eager's numbers; the interpreter is turned on by
itself only where no kernel was decorated yet."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Imported now, under the variable conftest.py set: a test that changes TRITON_INTERPRET must
# not be the first to import Triton, whose library would then be decorated for the GPU.
import triton  # noqa: F401, I001
from torch import nn

import autofuser
from autofuser_core import interpreter


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 40), nn.GELU()).eval()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU without the interpreter")
def test_cpu_without_the_interpreter_warns_once_with_the_fix_and_stays_eager(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(interpreter, "_warned", set())
    model, x = _block(), torch.randn(3, 7, 24)
    fused = autofuser.fuse(model)
    with pytest.warns(autofuser.NoKernelsWarning, match="set TRITON_INTERPRET=1 before Triton is imported"):
        with torch.no_grad():
            out = fused(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    report = fused.report()
    assert not report.fused and report.skipped
    assert {g.reason_code for g in report.skipped} == {"no_device"}
    assert any("TRITON_INTERPRET=1" in note for note in report.notes)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", autofuser.NoKernelsWarning)  # once: a second model says nothing
        with torch.no_grad():
            autofuser.fuse(_block())(torch.randn(2, 5, 24))


def test_kernels_decorated_for_the_other_backend_are_a_mismatch(tmp_path, monkeypatch):
    """A kernel decorated while TRITON_INTERPRET was 0, kernels now interpreted: the two
    can't call each other, so nothing is fused (and the reverse)."""
    (tmp_path / "gpu_kernels.py").write_text("import triton\n\n\n@triton.jit\ndef copy(x):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    import gpu_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = interpreter.kernels_cannot_run(torch.device("cpu"), [gpu_kernels])
    assert reason is not None and reason[0] == "interpreter_mismatch"
    assert "set after Triton was imported" in reason[1] and "TRITON_INTERPRET=1 before Triton" in reason[1]
    assert interpreter.kernels_cannot_run(torch.device("cpu"), [nn]) is None  # no kernel there
    monkeypatch.delitem(sys.modules, "gpu_kernels")


def test_fuse_turns_the_interpreter_on_where_no_kernel_was_decorated(tmp_path):
    """A user's script without TRITON_INTERPRET on a machine without a GPU: fuse() turns the
    interpreter on (no kernel exists yet) and the model is fused; where the user set the
    variable, even to 0, it is left alone."""
    script = (
        "import os, torch, autofuser\n"
        "model = torch.nn.Sequential(torch.nn.LayerNorm(24), torch.nn.GELU())\n"
        "fused = autofuser.fuse(model)\n"
        "with torch.no_grad():\n"
        "    x = torch.randn(3, 24)\n"
        "    assert torch.allclose(fused(x), model(x), rtol=1e-5, atol=1e-6)\n"
        "print(os.environ.get('TRITON_INTERPRET'), len(fused.report().fused))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["AUTOFUSER_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    interpret, fused_groups = done.stdout.split()
    if torch.cuda.is_available():
        assert interpret == "None"
    else:
        assert interpret == "1" and int(fused_groups) >= 1


@pytest.mark.parametrize("value", ["abc", "-2", "1.5"])
def test_a_malformed_compile_workers_count_is_an_error(monkeypatch, value):
    monkeypatch.setenv("AUTOFUSER_COMPILE_WORKERS", value)
    with pytest.raises(autofuser.AutoFuserError, match=f"AUTOFUSER_COMPILE_WORKERS='{value}' is not a whole number"):
        autofuser.fuse(_block())
    monkeypatch.setenv("AUTOFUSER_COMPILE_WORKERS", "0")
    autofuser.fuse(_block())
