"""Test settings: kernels run under Triton's interpreter when there is no GPU,
only the bundled plugins load, and the cache lives in a temporary folder; fixtures
that put a stand-in timer in place for a test."""

import atexit
import contextlib
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    # Must be set before any kernel is decorated: Triton picks the interpreter at @jit time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD", "1")
if "AUTOFUSER_CACHE_DIR" not in os.environ:
    # Made only when none is given (setdefault would make one every run all the same), and
    # removed when the session ends: each run used to leave one in $TMPDIR.
    os.environ["AUTOFUSER_CACHE_DIR"] = tempfile.mkdtemp(prefix="autofuser-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOFUSER_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_check_in_use_left_over():
    """Each test starts with no fused module's check in use under way: one a test left
    mid-plan would hold the turn (``autofuser_core.in_use.take_turn``) in the next."""
    from autofuser_core import in_use

    in_use._holder = None
    yield


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def use_timer():
    """``use_timer(timer)``: compiling measures with ``timer`` for the rest of the test
    (``autofuser_core.timing.using``); returns it. A later call takes over from an earlier."""
    from autofuser_core import timing

    with contextlib.ExitStack() as stack:
        yield lambda timer: stack.enter_context(timing.using(timer))


@pytest.fixture
def stand_in_timer(use_timer):
    """Tuning as on a GPU, with a stand-in clock (``_helpers.StandInTimer``); its
    ``timed`` lists the timed launches."""
    from _helpers import StandInTimer

    return use_timer(StandInTimer())


@pytest.fixture
def original_runs(monkeypatch):
    """Each call of a fused module that ran the original model appends to this list."""
    from autofuser_core.fuse import FusedModule

    runs: list = []
    run_original = FusedModule._run_original

    def counted(self, args, kwargs):
        runs.append(True)
        return run_original(self, args, kwargs)

    monkeypatch.setattr(FusedModule, "_run_original", counted)
    return runs
