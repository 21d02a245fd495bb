"""Function-level opaque leaves: a helper function that can't be traced (a branch on
tensor values) becomes one opaque call, and the module calling it is still inlined."""

import copy
import os
import statistics
import threading
import types

import _solver_helpers
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _solver_helpers import centred_keys, stable_cholesky

import autofuser
from autofuser_core.capture import OPAQUE_FUNCTION_KEY, _is_user_frame, capture
from autofuser_core.errors import CaptureError

CHOLESKY = "_solver_helpers:stable_cholesky"
TOLERANCES = {torch.float32: dict(rtol=2e-4, atol=2e-5)}  # fused kernels vs eager; float32 only (Cholesky)


def jittered_inverse_sqrt(d: torch.Tensor) -> torch.Tensor:
    """A helper in the test's own module: a data-dependent loop."""
    d = d.clamp_min(0)
    while (d < 1e-3).any():
        d = d + 1e-3
    return d.rsqrt()


_BY_NAME = {"factor": stable_cholesky}  # reached through a dict: no name a patch can reach


class OrthoAttentionBlock(nn.Module):
    """Orthogonal (Cholesky-whitened) linear attention and a GELU MLP, pre-norm;
    ``helper`` says how the value-dependent factorisation is reached."""

    def __init__(self, c: int, helper: str):
        super().__init__()
        self.helper = helper
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def _factor(self, gram: torch.Tensor) -> torch.Tensor:
        factor = torch.linalg.cholesky(gram)
        if torch.isnan(factor).any():
            factor = torch.linalg.cholesky(gram + 1e-4 * torch.eye(gram.shape[-1]))
        return factor

    def factor(self, gram: torch.Tensor) -> torch.Tensor:
        if self.helper in ("imported", "twice"):
            return stable_cholesky(gram)
        if self.helper == "module_attribute":
            return _solver_helpers.stable_cholesky(gram)
        if self.helper == "method":
            return self._factor(gram)
        if self.helper == "method_via_dict":
            return _BY_NAME["factor"](gram)
        raise AssertionError(self.helper)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        if self.helper == "nested":
            k = centred_keys(k)
        gram = k.transpose(-2, -1) @ k / n + torch.eye(k.shape[-1], dtype=x.dtype)
        if self.helper == "dict":
            factor = _BY_NAME["factor"](gram)
        elif self.helper == "closure":

            def factor_here(a):  # made anew on every call: there is no name to patch
                return stable_cholesky(a) if torch.isfinite(a).all() else a

            factor = factor_here(gram)
        else:
            factor = self.factor(gram) if self.helper != "nested" else stable_cholesky(gram)
        kv = torch.cholesky_solve(k.transpose(-2, -1) @ v / n, factor)
        if self.helper == "twice":  # the queries whitened by the same helper
            q = q @ torch.cholesky_inverse(stable_cholesky(q.transpose(-2, -1) @ q / n + torch.eye(q.shape[-1])))
        x = x + self.proj(q @ kv)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Solver(nn.Module):
    def __init__(self, helper: str, c: int = 12):
        super().__init__()
        self.lift = nn.Linear(5, c)
        self.block = OrthoAttentionBlock(c, helper)
        self.head = nn.Linear(c, 3)

    def forward(self, x):
        return self.head(self.block(self.lift(x)))


def leaf_targets(gm):
    return [n.meta[OPAQUE_FUNCTION_KEY] for n in gm.graph.nodes if OPAQUE_FUNCTION_KEY in n.meta]


def test_helper_leaves_the_block_inlined():
    torch.manual_seed(0)
    model = Solver("imported").eval()
    gm = capture(model, torch.randn(2, 37, 5))
    assert list(gm.meta["autofuser_opaque"]) == [CHOLESKY]
    assert "value-dependent control flow at _solver_helpers.py:" in gm.meta["autofuser_opaque"][CHOLESKY]
    assert leaf_targets(gm) == [CHOLESKY]
    modules = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert {"block.norm1", "block.qkv", "block.proj", "block.norm2", "block.fc1", "block.fc2"} <= modules
    (node,) = [n for n in gm.graph.nodes if OPAQUE_FUNCTION_KEY in n.meta]
    assert node.target.function is stable_cholesky and CHOLESKY in node.meta["autofuser_opaque_reason"]
    for _ in range(2):  # fresh inputs, not the capture's
        x = torch.randn(2, 37, 5)
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


METHOD = "test_capture_functions:OrthoAttentionBlock._factor"
CLAMP = "_solver_helpers:clamp_rows"


@pytest.mark.parametrize(
    "helper, calls",
    [
        ("module_attribute", [CHOLESKY]),  # _solver_helpers.stable_cholesky(...)
        ("method", [METHOD]),  # self._factor(...), called from another method
        ("twice", [CHOLESKY, CHOLESKY]),
        ("nested", [CLAMP, CHOLESKY]),  # centred_keys traces; only clamp_rows, which it calls, branches
        # stable_cholesky is reached through a dict, where no patch reaches: the method calling it is the leaf
        ("method_via_dict", ["test_capture_functions:OrthoAttentionBlock.factor"]),
    ],
)
def test_helper_reached_every_way_is_a_named_leaf(helper, calls):
    torch.manual_seed(1)
    model = Solver(helper).eval()
    gm = capture(model, torch.randn(1, 29, 5))
    assert list(gm.meta["autofuser_opaque"]) == sorted(set(calls), key=calls.index)
    assert leaf_targets(gm) == calls
    if helper == "nested":
        assert "mean" in {n.target for n in gm.graph.nodes}  # centred_keys' own ops are in the graph
    x = torch.randn(1, 29, 5)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_fused_block_is_right_and_its_report_names_only_the_helper():
    torch.manual_seed(2)
    model = Solver("imported").eval()
    x = torch.randn(2, 37, 5)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        for inputs in (x, torch.randn(2, 37, 5)):  # the capture's inputs, then fresh ones
            torch.testing.assert_close(fused(inputs), model(inputs), **TOLERANCES[torch.float32])
    report = fused.report()
    assert list(report.opaque) == [CHOLESKY], str(report)
    fused_nodes = {name for group in report.fused for name in group.nodes}
    block = {"block_norm1", "block_qkv", "block_proj", "block_norm2", "block_fc1", "block_fc2", "gelu"}
    assert block <= fused_nodes, str(report)
    assert "stable_cholesky" not in fused_nodes
    (helper,) = [n for n in report.unfused_nodes if n.reason_code == "opaque"]
    assert helper.node == "stable_cholesky" and CHOLESKY in helper.reason
    assert f"{CHOLESKY}: function with value-dependent control flow at _solver_helpers.py:" in str(report)


@pytest.mark.parametrize("helper", ["imported", "method"])
def test_gradients_through_the_opaque_helper_match_eager(helper):
    torch.manual_seed(3)
    model = Solver(helper).train()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False)
    x = torch.randn(1, 23, 5)
    x_fused, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(1, 23, 3)
    (fused(x_fused) * weights).sum().backward()
    (reference(x_eager) * weights).sum().backward()
    tolerance = dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(x_fused.grad, x_eager.grad, **tolerance)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, **tolerance, msg=name)
    report = fused.report()
    assert report.fused and [n for n in report.unfused_nodes if n.reason_code == "opaque"], str(report)


@pytest.mark.parametrize("helper", ["dict", "closure"])
def test_a_helper_no_patch_reaches_leaves_its_module_opaque(helper):
    torch.manual_seed(4)
    model = Solver(helper).eval()
    gm = capture(model, torch.randn(2, 11, 5))
    opaque = gm.meta["autofuser_opaque"]
    assert list(opaque) == ["block"] and "TraceError" in opaque["block"]
    assert leaf_targets(gm) == []
    assert _solver_helpers.stable_cholesky is stable_cholesky and _BY_NAME["factor"] is stable_cholesky
    x = torch.randn(2, 11, 5)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


class LibraryBranch(nn.Module):
    """The branch is in the standard library (``statistics.median`` compares its
    values), not in user code: the library function is never made a leaf."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x) * statistics.median([x.mean(), x.std()])


class RootHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.pick = LibraryBranch()
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        h = self.norm(x)
        return self.pick(h * jittered_inverse_sqrt(h.var(dim=-1, keepdim=True)))


def test_root_helper_is_a_leaf_and_a_library_function_is_not():
    torch.manual_seed(5)
    model = RootHelper().eval()
    gm = capture(model, torch.randn(3, 7, 6))
    opaque = gm.meta["autofuser_opaque"]
    # jittered_inverse_sqrt (a data-dependent loop, called by the root) is the leaf, so
    # the root is not opaque; the branch inside statistics leaves its caller's module opaque.
    assert set(opaque) == {"pick", "test_capture_functions:jittered_inverse_sqrt"}, opaque
    assert (
        "value-dependent control flow at test_capture_functions.py:"
        in opaque["test_capture_functions:jittered_inverse_sqrt"]
    )
    assert leaf_targets(gm) == ["test_capture_functions:jittered_inverse_sqrt"]
    x = torch.randn(3, 7, 6)
    x[0, 0] = 3.0  # one row of equal values: its variance is 0, so the loop runs
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


SEEN_IN_OTHER_THREAD: list = []  # not on the module: capture restores a module's lists


class OtherThreadCalls(nn.Module):
    """Calls the helper from another thread on every forward, capture's retries
    included (while the helper is patched in this thread's trace)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        def elsewhere():  # its own tensors: the factories act for the capturing thread only
            a = torch.randn(3, 3)
            SEEN_IN_OTHER_THREAD.append(type(stable_cholesky(a @ a.T + torch.eye(3))))

        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        g = self.fc(x).transpose(-2, -1) @ self.fc(x)
        return stable_cholesky(g + torch.eye(4))


def test_capture_leaves_helpers_and_modules_as_they_were_and_other_threads_alone():
    torch.manual_seed(6)
    model = Solver("method").eval()
    before = dict(vars(model.block))
    gm = capture(model, torch.randn(2, 9, 5))
    assert list(gm.meta["autofuser_opaque"]) == [METHOD]
    assert vars(model.block) == before  # the method was patched on the instance for the trace only
    assert "_factor" not in vars(model.block)

    threaded = OtherThreadCalls()
    SEEN_IN_OTHER_THREAD.clear()
    gm = capture(threaded, torch.randn(6, 4))
    assert list(gm.meta["autofuser_opaque"]) == [CHOLESKY]
    assert stable_cholesky.__module__ == "_solver_helpers" and globals()["stable_cholesky"] is stable_cholesky
    assert _solver_helpers.stable_cholesky is stable_cholesky
    # one call per attempt (the second with the helper patched), never a proxy
    assert len(SEEN_IN_OTHER_THREAD) >= 2 and set(SEEN_IN_OTHER_THREAD) == {torch.Tensor}


def positive_rows(x: torch.Tensor) -> torch.Tensor:
    """Returns as many rows as are positive in sum: its output's shape depends on values."""
    keep = x.sum(dim=-1) > 0
    if keep.all():
        return x
    return x[keep]


class MeanOfPositiveRows(nn.Module):
    def forward(self, x):
        rows = positive_rows(x * 2)
        return rows.sum(dim=0) / rows.shape[0]  # the row count is specialised while tracing


def test_a_leaf_returning_another_shape_raises_instead_of_computing_on():
    torch.manual_seed(7)
    model = MeanOfPositiveRows()
    x = torch.rand(6, 5) + 0.1  # every row positive at capture
    gm = capture(model, x)
    assert list(gm.meta["autofuser_opaque"]) == ["test_capture_functions:positive_rows"]
    fresh = torch.rand(6, 5) + 0.1
    torch.testing.assert_close(gm(fresh), model(fresh), rtol=0, atol=0)
    fresh[2] -= 10  # one row negative: eager averages 5 rows, the graph would divide by 6
    with pytest.raises(CaptureError, match=r"positive_rows returned float32\[5, 5\] here but float32\[6, 5\]"):
        gm(fresh)


def _frame(module: str, path: str):
    return types.SimpleNamespace(f_globals={"__name__": module}, f_code=types.SimpleNamespace(co_filename=path))


def test_which_code_counts_as_the_users():
    site = os.path.join(os.sep, "env", "lib", "python3.11", "site-packages")
    solver_package = frozenset({"neuralop"})  # the model's modules are defined in it
    cases = [
        (_frame("mylab.linalg", os.path.join(os.sep, "home", "me", "mylab", "linalg.py")), True),
        (_frame("__main__", os.path.join(os.sep, "home", "me", "train.py")), True),
        (_frame("__main__", "<ipython-input-3>"), True),
        (_frame("neuralop.layers.spectral", os.path.join(site, "neuralop", "layers", "spectral.py")), True),
        (_frame("scipy.linalg", os.path.join(site, "scipy", "linalg.py")), False),
        (_frame("torch.functional", os.path.join(os.sep, "home", "me", "torch", "functional.py")), False),
        (_frame("autofuser_core.capture", os.path.join(os.sep, "src", "autofuser_core", "capture.py")), False),
        (_frame("statistics", statistics.__file__), False),
        (_frame("", "<eval_with_key>.3"), False),
    ]
    for frame, expected in cases:
        assert _is_user_frame(frame, solver_package) is expected, frame.f_globals


class CountsJitter(nn.Module):
    """A helper method that records on the module when it had to repair its input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 7)
        self.repaired = 0

    def _finite(self, x):
        if torch.isnan(x).any():
            self.repaired += 1
            x = torch.nan_to_num(x)
        return x

    def forward(self, x):
        return F.gelu(self._finite(self.fc(x)))


def test_a_method_leaf_changing_module_state_does_not_recompile():
    torch.manual_seed(8)
    model = CountsJitter()
    fused = autofuser.fuse(model, progress=False)
    with torch.no_grad():
        for call in range(3):
            x = torch.randn(5, 6)
            x[0, call] = float("nan")  # the helper repairs it, counting on the module
            expected = CountsJitter()
            expected.load_state_dict(model.state_dict())
            torch.testing.assert_close(fused(x), expected(x), equal_nan=True)
            assert model.repaired == call + 1
    assert len(fused.reports()) == 1  # the count the helper keeps is absorbed, not a new signature
    assert list(fused.report().opaque) == ["test_capture_functions:CountsJitter._finite"]


class PositiveRows(nn.Module):
    """An opaque module (its branch is in its own forward) whose output's row count
    depends on the values."""

    def forward(self, x):
        if bool((x < 0).any()):
            return x[(x > 0).all(dim=1)]
        return x


class MeanOfAModulesRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.rows = PositiveRows()

    def forward(self, x):
        rows = self.rows(torch.tanh(x) * 2)
        return rows.sum(dim=0) / rows.shape[0]  # the row count is specialised while tracing


def test_an_opaque_module_returning_another_shape_raises_instead_of_computing_on():
    """The same check for an opaque module's output: it keeps fusing around it, and a
    call where the module drops rows raises, naming it, where the graph would divide by
    the captured count."""
    model = MeanOfAModulesRows()
    x = torch.rand(6, 5) + 0.1
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False)
        torch.testing.assert_close(fused(x), model(x))
        report = fused.report()
        assert list(report.opaque) == ["rows"], str(report)
        assert report.fused, str(report)  # the tanh before it, the division after it
        fresh = torch.rand(6, 5) + 0.1
        torch.testing.assert_close(fused(fresh), model(fresh))
        fresh[2] -= 10  # one row negative: eager averages 5 rows, the graph would divide by 6
        with pytest.raises(CaptureError, match=r"module rows .* returned float32\[5, 5\] here but float32\[6, 5\]"):
            fused(fresh)
