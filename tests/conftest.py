"""Test settings: kernels run under Triton's interpreter when there is no GPU,
only the bundled plugins load, and the cache lives in a temporary folder."""

import os
import tempfile

import torch

if not torch.cuda.is_available():
    # Must be set before any kernel is decorated: Triton picks the interpreter at @jit time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("AUTOFUSER_CACHE_DIR", tempfile.mkdtemp(prefix="autofuser-test-cache-"))

import pytest  # noqa: E402


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
