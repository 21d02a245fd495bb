"""``autofuser bench`` on the CPU: the tiny configuration of one transformer
(Galerkin) and one neural operator (FNO), without torch.compile.

Checks that every column reaches bench.json and bench.md, that AutoFuser's
output matches eager, and that a system that raises becomes an error row
instead of stopping the run; the same of ``--train`` (a training step), whose
gradients must match eager's too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from typing import Optional

import pytest
import torch

# Imported now, under the variable conftest.py set: a test that changes TRITON_INTERPRET must
# not be the first to import Triton, whose library would then be decorated for the GPU.
import triton  # noqa: F401, I001

import autofuser
from autofuser.cli import build_parser, main
from autofuser.zoo import harness, train_bench

from _helpers import BENCHMARKS, benchmark_scripts

MODELS = ["galerkin", "fno"]
# F-FNO's weight-normed layers: every system trains a deep copy of the model. Not Galerkin:
# the --train path is the same for every model, and a Galerkin step compiles its 45 kernels
# twice under the interpreter (cold and warm), most of this fixture's cost;
# tests/core/test_training.py trains the fused Galerkin against eager.
TRAIN_MODELS = ["fno", "ffno"]
SMOKE = ["--device", "cpu", "--config", "tiny", "--iters", "2", "--warmup", "1", "--no-compile"]
CELL_KEYS = {"status", "error", "ms", "speedup", "first_call_s", "rel_err_vs_eager", "test_loss"}
AUTOFUSER_KEYS = {
    "first_call_cold_s",
    "first_call_warm_s",
    "fused_groups",
    "skipped_groups",
    "warm_cache_hits",
    "report",
    "opaque",
}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--models", ",".join(MODELS), *SMOKE, "--out", str(out)])
    return code, out, printed.getvalue()


def test_bench_writes_every_output(smoke_run):
    code, out, printed = smoke_run
    assert code == 0
    markdown = (out / "bench.md").read_text()
    assert printed.strip().endswith(markdown.strip().splitlines()[-1])  # the table is printed last
    assert (out / "bench.png").exists() or "matplotlib is not installed" in markdown
    data = json.loads((out / "bench.json").read_text())
    for key in ("date", "device", "gpu", "torch", "triton", "autofuser", "settings", "rows", "geomean_speedup"):
        assert key in data
    assert data["device"] == "cpu" and data["settings"]["no_compile"] is True
    assert [row["model"] for row in data["rows"]] == MODELS


def test_bench_json_has_every_column_and_small_errors(smoke_run):
    _, out, _ = smoke_run
    data = json.loads((out / "bench.json").read_text())
    for row in data["rows"]:
        assert row["params"] > 0 and row["batch"] == 2 and row["mesh"] == [17, 9]
        systems = row["systems"]
        assert list(systems) == ["eager", "torch.compile", "torch.compile reduce-overhead", "autofuser"]
        for cell in systems.values():
            assert CELL_KEYS <= set(cell)
        eager, fused = systems["eager"], systems["autofuser"]
        assert AUTOFUSER_KEYS <= set(fused)
        assert eager["status"] == "ok" and eager["ms"] > 0 and eager["test_loss"] > 0
        for compiled in (systems["torch.compile"], systems["torch.compile reduce-overhead"]):
            assert compiled["status"] == "skipped" and compiled["error"] == "skipped: --no-compile"
        assert fused["status"] == "ok", fused["error"]
        assert fused["ms"] > 0 and fused["speedup"] > 0
        assert fused["first_call_cold_s"] > 0 and fused["first_call_warm_s"] > 0
        assert fused["rel_err_vs_eager"] < 1e-4
        assert abs(fused["test_loss"] - eager["test_loss"]) < 1e-4
        assert fused["fused_groups"] >= 1 and fused["skipped_groups"] >= 0
        assert fused["opaque"] == {}
        assert len(fused["report"]["groups"]) == fused["fused_groups"] + fused["skipped_groups"]
    assert data["geomean_speedup"]["autofuser"] > 0
    assert data["geomean_speedup"]["torch.compile"] is None
    assert data["geomean_speedup"]["torch.compile reduce-overhead"] is None


def test_bench_markdown_has_every_column(smoke_run):
    _, out, _ = smoke_run
    markdown = (out / "bench.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| model"))
    assert [c.strip() for c in header.strip("|").split("|")] == harness.COLUMNS
    rows = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    for name in MODELS:
        cells = [c.strip() for c in rows[name].strip().strip("|").split("|")]
        assert len(cells) == len(harness.COLUMNS)
        assert all(cells), rows[name]
        assert cells[harness.COLUMNS.index("torch.compile ms")] == "skipped: --no-compile"
        assert cells[harness.COLUMNS.index("torch.compile reduce-overhead ms")] == "skipped: --no-compile"
        assert not any(c.startswith("error") for c in cells)
    assert "geometric mean" in rows


def test_a_failing_system_is_an_error_row(tmp_path, monkeypatch, capsys):
    def broken_fuse(model, *args, **kwargs):
        raise RuntimeError("deliberately broken fuse")

    monkeypatch.setattr(autofuser, "fuse", broken_fuse)
    assert main(["bench", "--models", "fno", *SMOKE, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    (row,) = data["rows"]
    eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
    assert eager["status"] == "ok" and eager["ms"] > 0
    assert fused["status"] == "error"
    assert fused["error"] == "RuntimeError: deliberately broken fuse"
    assert "broken_fuse" in fused["traceback"]
    assert fused["ms"] is None and fused["speedup"] is None and fused["rel_err_vs_eager"] is None
    markdown = (tmp_path / "bench.md").read_text()
    assert "error: RuntimeError" in markdown
    assert "fno / autofuser: RuntimeError: deliberately broken fuse" in markdown
    assert data["geomean_speedup"]["autofuser"] is None
    assert markdown.strip() in capsys.readouterr().out


def test_a_model_that_cannot_be_built_is_a_row_of_errors(tmp_path, monkeypatch):
    entry = harness.MODELS["fno"]

    def no_model(config="airfoil"):
        raise ValueError("no such weights")

    monkeypatch.setattr(type(entry), "make", lambda self, config="airfoil": no_model(config))
    result = harness.run_bench(
        ["fno"], device=harness.torch.device("cpu"), config="tiny", iters=1, warmup=0, out=tmp_path, no_compile=True
    )
    (row,) = result["rows"]
    assert {cell["status"] for cell in row["systems"].values()} == {"error"}
    assert row["systems"]["eager"]["error"] == "ValueError: no such weights"
    assert (tmp_path / "bench.md").exists()


def test_unknown_model_is_refused(tmp_path, capsys):
    assert main(["bench", "--models", "fno,nonesuch", *SMOKE, "--out", str(tmp_path)]) == 2
    assert "nonesuch" in capsys.readouterr().err


def test_train_steps_train_first_and_a_failed_training_still_measures(tmp_path, monkeypatch):
    cpu = harness.torch.device("cpu")
    monkeypatch.setattr(autofuser, "fuse", lambda model, **kwargs: model)  # only eager matters here
    result = harness.run_bench(
        ["fno"], device=cpu, config="tiny", iters=1, warmup=0, out=tmp_path / "a", no_compile=True, train_steps=3
    )
    (row,) = result["rows"]
    assert len(row["train_losses"]) == 3 and row["train_error"] is None
    assert row["systems"]["eager"]["status"] == "ok"

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (pretend)")

    monkeypatch.setattr(harness, "train", out_of_memory)
    result = harness.run_bench(
        ["fno"], device=cpu, config="tiny", iters=1, warmup=0, out=tmp_path / "b", no_compile=True, train_steps=3
    )
    (row,) = result["rows"]
    assert row["train_error"] == "RuntimeError: CUDA out of memory (pretend)"
    assert row["systems"]["eager"]["status"] == "ok" and row["systems"]["eager"]["test_loss"] > 0
    assert "training (measured untrained): RuntimeError" in result["markdown"]


def test_fresh_first_calls_run_in_their_own_processes_and_errors_are_cells(tmp_path):
    """``--fresh-first-calls``: AutoFuser's cold first call is timed again in a new process
    (its own empty caches; the harness's own cache folder stays untouched), and a fresh
    process that fails becomes an error in the table, not a crash."""
    from autofuser.zoo import first_call

    cpu = harness.torch.device("cpu")
    result = harness.run_bench(
        ["fno"],
        device=cpu,
        config="tiny",
        iters=1,
        warmup=0,
        out=tmp_path / "a",
        no_compile=True,
        fresh_first_calls=True,
    )
    (row,) = result["rows"]
    fused = row["systems"]["autofuser"]
    assert fused["first_call_fresh_s"] > 0 and fused["first_call_fresh_error"] is None
    assert "first_call_fresh_s" not in row["systems"]["torch.compile"]  # --no-compile: not run
    skipped = harness.NO_COMPILE
    assert f"| fno | {skipped} | {skipped} | {fused['first_call_fresh_s']:.2f} |" in result["markdown"]

    answer = first_call.measure_in_fresh_process(
        "fno", "autofuser", device="cpu", dtype="fp32", config="tiny", batch=0
    )  # a batch of 0 fails in the model
    assert set(answer) == {"error"} and answer["error"], answer
    fused.update(first_call_fresh_s=None, first_call_fresh_error=answer["error"])  # as bench_model records it
    assert "fno / autofuser (fresh process): " + answer["error"] in harness.render_markdown(result)


# ---------------------------------------------------------------------------
# --train: a training step instead of the forward
# ---------------------------------------------------------------------------

TRAIN_CELL_KEYS = {
    "status",
    "error",
    "step_ms",
    "speedup",
    "first_step_s",
    "peak_mem_mb",
    "loss",
    "rel_err_vs_eager",
    "grad_rel_err_vs_eager",
}
FP32_GRADIENT_TOLERANCE = 1e-4  # relative, all parameters' gradients as one vector


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-train")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--train", "--models", ",".join(TRAIN_MODELS), *SMOKE, "--out", str(out)])
    return code, out, printed.getvalue()


def test_train_bench_json_has_training_cells_and_small_errors(train_run):
    code, out, _ = train_run
    assert code == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["mode"] == "train" and data["settings"]["lr"] == harness.TRAIN_LR
    assert [row["model"] for row in data["rows"]] == TRAIN_MODELS
    for row in data["rows"]:
        systems = row["systems"]
        for cell in systems.values():
            assert TRAIN_CELL_KEYS <= set(cell)
        eager, compiled, fused = systems["eager"], systems["torch.compile"], systems["autofuser"]
        assert eager["status"] == "ok", eager["error"]
        assert math.isfinite(eager["step_ms"]) and eager["step_ms"] > 0 and eager["first_step_s"] > 0
        assert eager["grad_rel_err_vs_eager"] == 0.0 and eager["speedup"] == 1.0
        assert eager["peak_mem_mb"] is None  # measured on CUDA only
        assert compiled["status"] == "skipped" and compiled["error"] == harness.NO_COMPILE
        assert fused["status"] == "ok", fused["error"]
        assert math.isfinite(fused["step_ms"]) and fused["step_ms"] > 0 and fused["speedup"] > 0
        assert fused["first_step_s"] > 0 and fused["first_step_warm_s"] > 0
        assert isinstance(fused["warm_notes"], list)
        assert fused["changed_while_timed"] is None  # its timed steps ran what it settled on
        assert fused["rel_err_vs_eager"] < 1e-4, row["model"]
        assert fused["grad_rel_err_vs_eager"] < FP32_GRADIENT_TOLERANCE, row["model"]
        assert abs(fused["loss"] - eager["loss"]) < 1e-4 * eager["loss"]
        assert fused["fused_groups"] >= 1 and fused["opaque"] == {}
    assert data["geomean_speedup"]["autofuser"] > 0 and data["geomean_speedup"]["torch.compile"] is None


def test_train_bench_markdown_has_the_training_table(train_run):
    _, out, printed = train_run
    markdown = (out / "bench.md").read_text()
    assert markdown.startswith("# autofuser bench --train")
    assert printed.strip().endswith(markdown.strip().splitlines()[-1])
    header = next(line for line in markdown.splitlines() if line.startswith("| model"))
    assert [c.strip() for c in header.strip("|").split("|")] == train_bench.TRAIN_COLUMNS
    rows = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    for name in TRAIN_MODELS:
        cells = [c.strip() for c in rows[name].strip().strip("|").split("|")]
        assert len(cells) == len(train_bench.TRAIN_COLUMNS) and all(cells), rows[name]
        assert cells[train_bench.TRAIN_COLUMNS.index("torch.compile step ms")] == harness.NO_COMPILE
        assert cells[train_bench.TRAIN_COLUMNS.index("AutoFuser peak MB")] == "-"  # CPU
        assert cells[train_bench.TRAIN_COLUMNS.index("AutoFuser held MB")] == "-"
        assert not any(c.startswith("error") for c in cells)
    geomean = [c.strip() for c in rows["geometric mean"].strip().strip("|").split("|")]
    # Under the interpreter the speedup can round to 0.00: compare with bench.json, not with 0.
    expected = json.loads((out / "bench.json").read_text())["geomean_speedup"]["autofuser"]
    assert geomean[train_bench.TRAIN_COLUMNS.index("AutoFuser speedup")] == f"{expected:.2f}"


class _CountedStep:
    """A stand-in training step that logs each call, and raises from its ``fail_at``-th on."""

    def __init__(self, name: str, log: list[str], fail_at: Optional[int] = None):
        self.name, self.log, self.fail_at, self.calls = name, log, fail_at, 0

    def step(self) -> None:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError(f"{self.name} out of memory (pretend)")
        self.log.append(self.name)


def test_train_bench_times_the_systems_in_turns_and_keeps_the_others_when_one_fails():
    log: list[str] = []
    steps = {name: _CountedStep(name, log, fail_at=9 if name == "c" else None) for name in "abc"}
    cpu = harness.torch.device("cpu")
    results = train_bench.interleaved_steps(steps, iters=12, warmup=1, device=cpu)  # type: ignore[arg-type]
    rounds = train_bench.ROUND_STEPS
    assert log[:3] == ["a", "b", "c"]  # the warm-up steps, one each
    timed = log[3:]
    # Turns of ROUND_STEPS, the order rotating: a b c, then b c a (c fails in its second turn), ...
    assert timed[:rounds] == ["a"] * rounds and timed[rounds : 2 * rounds] == ["b"] * rounds
    assert timed[2 * rounds : 3 * rounds] == ["c"] * rounds
    assert timed[3 * rounds : 4 * rounds] == ["b"] * rounds
    assert timed[4 * rounds : 4 * rounds + 2] == ["c", "c"]  # its 8th call passes, the 9th raises
    assert timed[4 * rounds + 2 : 5 * rounds + 2] == ["a"] * rounds
    assert steps["a"].calls == steps["b"].calls == 1 + 12
    assert isinstance(results["c"], RuntimeError) and "pretend" in str(results["c"])
    for name in "ab":
        measured, peak = results[name]  # type: ignore[misc]
        assert measured["ms"] > 0 and measured["repeats"] == 12 and measured["iqr_ms"] >= 0
        assert peak is None  # peak memory is measured on CUDA only


def _tiny_fno_bench(out, train: bool, **options) -> dict:
    """The tiny FNO through the bench on the CPU (without torch.compile unless
    ``compile_modes`` names some), one timed call or step unless ``iters`` says otherwise."""
    cpu = harness.torch.device("cpu")
    settings = {"iters": 1, "no_compile": "compile_modes" not in options, **options}
    return harness.run_bench(["fno"], device=cpu, config="tiny", warmup=0, out=out, train=train, **settings)


def test_train_bench_a_failing_system_is_an_error_cell(tmp_path, monkeypatch):
    def broken_fuse(model, *args, **kwargs):
        raise RuntimeError("deliberately broken fuse")

    monkeypatch.setattr(autofuser, "fuse", broken_fuse)
    result = _tiny_fno_bench(tmp_path, train=True)
    (row,) = result["rows"]
    eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
    assert eager["status"] == "ok" and eager["step_ms"] > 0
    assert fused["status"] == "error" and fused["error"] == "RuntimeError: deliberately broken fuse"
    assert fused["step_ms"] is None and fused["grad_rel_err_vs_eager"] is None
    assert "fno / autofuser: RuntimeError: deliberately broken fuse" in result["markdown"]
    assert result["geomean_speedup"]["autofuser"] is None


def _fuse_with_forward(monkeypatch, around) -> None:
    """``autofuser.fuse`` with no plugins (nothing fused: fast), each call of a fused model's
    forward made by ``around(forward, call, fused, inputs, named)``: ``call`` counts from 1."""
    real_fuse = autofuser.fuse

    def fuse(model, *args, **kwargs):
        fused = real_fuse(model, *args, **{"plugins": [], **kwargs})
        forward, calls = fused.forward, []

        def patched(*inputs, **named):
            calls.append(1)
            return around(forward, len(calls), fused, inputs, named)

        fused.forward = patched
        return fused

    monkeypatch.setattr(autofuser, "fuse", fuse)


@pytest.mark.parametrize("drift", [1.01, math.nan], ids=["off by 1%", "NaN"])
@pytest.mark.parametrize("train", [False, True], ids=["forward", "training step"])
def test_autofuser_errors_count_what_the_timed_calls_run_not_only_the_first(tmp_path, monkeypatch, train, drift):
    """The first call may run the original while the check in use is under way; a module
    whose later calls drift from eager must show that drift in its error cells (NaN as NaN,
    not hidden behind the first call's finite error)."""

    def drifting(forward, call, fused, inputs, named):
        out = forward(*inputs, **named)
        return out if call == 1 else out * drift

    _fuse_with_forward(monkeypatch, drifting)
    result = _tiny_fno_bench(tmp_path, train=train)
    (row,) = result["rows"]
    cell = row["systems"]["autofuser"]
    assert cell["status"] == "ok", cell.get("error")
    errors = [cell["rel_err_vs_eager"]] + ([cell["grad_rel_err_vs_eager"]] if train else [])
    for error in errors:
        assert math.isnan(error) if math.isnan(drift) else 5e-3 < error < 2e-2


def test_train_bench_says_when_autofuser_changed_while_its_steps_were_timed(tmp_path, monkeypatch):
    """A recompile between the timed steps (a signature the first steps never saw) makes
    them a mix of runners: the cell and the table say so."""

    def changing(forward, call, fused, inputs, named):
        if call == 3:  # the first step, its rerun, then the first timed step
            next(fused.model.children()).eval()  # a new signature: the modules' modes differ
        return forward(*inputs, **named)

    _fuse_with_forward(monkeypatch, changing)
    result = _tiny_fno_bench(tmp_path, train=True, iters=2)
    (row,) = result["rows"]
    cell = row["systems"]["autofuser"]
    assert cell["status"] == "ok", cell.get("error")
    assert cell["changed_while_timed"].startswith("1 more signature(s) compiled")
    assert f"- fno: {cell['changed_while_timed']}" in result["markdown"]


def test_runner_state_names_each_change():
    class Report:
        def __init__(self, runs_original, notes):
            self.runs_original, self.notes = runs_original, notes

    class Fused:
        def __init__(self, reports, checking=False):
            self._reports, self.checking_in_use = reports, checking

        def report(self):
            return self._reports[-1]

        def reports(self):
            return self._reports

    before = train_bench.RunnerState.of(Fused([Report(False, ["compiled"])]))
    assert before.changes(Fused([Report(False, ["compiled"])])) is None
    settled_later = Fused([Report(True, ["compiled", "training step in use: the original runs"])])
    assert before.changes(settled_later) == "it now runs the original model; training step in use: the original runs"
    again = Fused([Report(False, ["compiled"]), Report(False, ["new"])], checking=True)
    assert before.changes(again) == "1 more signature(s) compiled; a check in use was under way; new"


def test_train_and_train_steps_are_told_apart(tmp_path, capsys):
    parser = harness.argparse.ArgumentParser()
    harness.add_arguments(parser)
    helps = {action.dest: action.help for action in parser._actions}
    assert "--train-steps" in helps["train"] and "--train" in helps["train_steps"]
    assert main(["bench", "--train", "--fresh-first-calls", "--models", "fno", *SMOKE, "--out", str(tmp_path)]) == 2
    assert "--fresh-first-calls" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Triton's interpreter, the user's own model, spread, the command's small things
# ---------------------------------------------------------------------------


def _clean_env(tmp_path) -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET (as a user's shell has it),
    the cache in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["AUTOFUSER_CACHE_DIR"] = str(tmp_path / "cache")
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's first run, without a GPU")
def test_cpu_bench_from_a_clean_environment_fuses(tmp_path):
    """No TRITON_INTERPRET: the command turns the interpreter on before Triton is imported,
    so AutoFuser's kernels run (the issue: every kernel failed, 0 groups fused, a speedup printed)."""
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "autofuser.cli", "bench", "--models", "fno", *SMOKE, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=_clean_env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads((out / "bench.json").read_text())
    assert data["triton_interpret"] is True
    fused = data["rows"][0]["systems"]["autofuser"]
    assert fused["status"] == "ok", fused["error"]
    assert fused["fused_groups"] >= 1 and fused["speedup"] > 0
    assert all(g["reason_code"] not in ("no_device", "interpreter_mismatch") for g in fused["report"]["groups"])


def test_cpu_bench_refuses_once_kernels_were_built_for_the_gpu(monkeypatch, capsys, tmp_path):
    """Too late to turn the interpreter on (kernels already decorated): the bench refuses
    with the fix instead of printing a table of eager against eager."""
    (tmp_path / "decorated_kernel.py").write_text("import triton\n\n\n@triton.jit\ndef copy(x):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import decorated_kernel  # noqa: F401 - a library's kernel, decorated when imported

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(harness.BenchError, match="TRITON_INTERPRET=1 before Triton is imported"):
        harness.use_interpreter_on_cpu(torch.device("cpu"))
    assert "TRITON_INTERPRET" not in os.environ
    code = harness.run_from_args(
        build_parser().parse_args(["bench", "--models", "fno", *SMOKE, "--out", str(tmp_path)])
    )
    assert code == 2 and "TRITON_INTERPRET=1 before Triton is imported" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


MODEL_FILE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x, scale=1.0):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x))) * scale


def make():
    torch.manual_seed(0)
    return Block(24), (torch.randn(1, 37, 24),), {"scale": 0.5}


def make_unfusable():
    return nn.Flatten(), torch.randn(3, 5, 7)


# Reads a float32 tensor that is neither parameter nor buffer: it can't run in float64.
class Float32Only(Block):
    def __init__(self, width):
        super().__init__(width)
        self.mix = torch.randn(width, width)

    def forward(self, x, scale=1.0):
        return super().forward(x, scale) @ self.mix


def make_float32_only():
    torch.manual_seed(0)
    return Float32Only(24), (torch.randn(1, 37, 24),), {"scale": 0.5}


def not_a_pair():
    return 3
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def test_bench_of_a_module_factory_model(model_file, tmp_path, capsys):
    spec = f"{model_file}:make"
    out = tmp_path / "bench"
    assert (
        main(["bench", spec, "--device", "cpu", "--iters", "3", "--warmup", "1", "--no-compile", "--out", str(out)])
        == 0
    )
    data = json.loads((out / "bench.json").read_text())
    assert data["settings"]["factory"] == spec
    (row,) = data["rows"]
    assert row["model"] == spec and row["title"] == "Block" and row["params"] == 2 * 24 + 24 * 24 + 24
    eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
    assert eager["status"] == "ok" and eager["ms"] > 0 and eager["test_loss"] is None
    assert fused["status"] == "ok", fused["error"]
    assert fused["fused_groups"] >= 1 and 0 <= fused["rel_err_vs_eager"] < 1e-5
    assert fused["speedup"] == pytest.approx(eager["ms"] / fused["ms"])
    markdown = (out / "bench.md").read_text()
    assert f"# autofuser bench - {spec}" in markdown and "fusion report of" in markdown
    assert markdown.strip().splitlines()[-1] in capsys.readouterr().out


def test_bench_of_a_module_factory_refuses_zoo_options_and_bad_factories(model_file, tmp_path, capsys):
    common = ["--device", "cpu", "--out", str(tmp_path)]
    assert main(["bench", f"{model_file}:make", "--train", *common]) == 2
    assert "--train apply to zoo models only" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="must return \\(model, inputs\\)"):
        main(["bench", f"{model_file}:not_a_pair", *common])
    with pytest.raises(SystemExit, match="has no function 'nonesuch'"):
        main(["bench", f"{model_file}:nonesuch", *common])


def test_a_bench_that_fused_nothing_shows_no_speedup(model_file, tmp_path):
    from autofuser.cli import call_factory

    spec = f"{model_file}:make_unfusable"
    result = harness.run_bench(
        [spec],
        device=torch.device("cpu"),
        iters=2,
        warmup=0,
        out=tmp_path,
        no_compile=True,
        custom_models={spec: call_factory(spec, "bench")},
    )
    fused = result["rows"][0]["systems"]["autofuser"]
    assert fused["status"] == "ok" and fused["fused_groups"] == 0 and fused["ms"] > 0
    assert fused["speedup"] is None and fused["nothing_fused"] is True
    assert result["geomean_speedup"]["autofuser"] is None
    row = next(line for line in result["markdown"].splitlines() if line.startswith(f"| {spec}"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[harness.COLUMNS.index("AutoFuser speedup")] == harness.NOTHING_FUSED


def test_spread_is_the_interquartile_range_and_flags_a_large_one():
    steady = harness.spread([2.0, 2.0, 2.0, 2.02, 9.0])  # one outlier moves neither quartile much
    assert steady["ms"] == 2.0 and steady["iqr_ms"] == pytest.approx(0.02) and steady["noisy"] is False
    noisy = harness.spread([1.0, 2.0, 3.0, 4.0])  # quartiles 1.75 and 3.25
    assert noisy["ms"] == 2.5 and noisy["iqr_ms"] == pytest.approx(1.5) and noisy["noisy"] is True
    assert harness.spread([3.0]) == {"ms": 3.0, "iqr_ms": 0.0, "repeats": 1, "noisy": False}


def test_timed_reports_median_and_spread_over_blocks():
    calls = []
    measured = harness.timed(lambda: calls.append(1), iters=20, warmup=3, device=torch.device("cpu"))
    assert len(calls) >= 3 + 20  # ten blocks of two calls after the warm-up (and the Timer's own)
    assert measured["repeats"] == harness.REPEATS and measured["ms"] > 0 and measured["iqr_ms"] >= 0
    assert measured["noisy"] == (measured["iqr_ms"] > harness.NOISY_IQR * measured["ms"])


def test_noisy_times_are_flagged_in_the_table(smoke_run):
    _, out, _ = smoke_run
    data = json.loads((out / "bench.json").read_text())
    row = data["rows"][0]
    eager = row["systems"]["eager"]
    assert eager["iqr_ms"] >= 0 and isinstance(eager["noisy"], bool)
    eager["noisy"] = True  # as a busy machine makes it
    markdown = harness.render_markdown(data)
    cells = [
        c.strip()
        for c in next(li for li in markdown.splitlines() if li.startswith(f"| {row['model']} ")).strip("|").split("|")
    ]
    assert cells[harness.COLUMNS.index("eager IQR ms")].endswith("noisy)")
    assert cells[harness.COLUMNS.index("AutoFuser speedup")].endswith("(noisy)")
    assert "not reliable" in markdown


def test_models_into_a_closed_pipe_is_quiet(tmp_path):
    """``autofuser models | head -1``: the reader leaves early, no BrokenPipeError."""
    command = [sys.executable, "-m", "autofuser.cli", "models", "--config", "tiny"]
    shell = f"{' '.join(command)} | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("name") and len(done.stdout.splitlines()) == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 0


def test_help_shows_defaults_plain_text_and_imports_no_zoo_nor_torch(capsys):
    """``--help`` answers without importing torch (a second of the command's start otherwise)."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert "(default: 100)" in text and "(default: bench-results)" in text and "MODULE:FACTORY" in text
    assert "``" not in text
    probe = (
        "import sys\nfrom autofuser.cli import main\ntry:\n    main(['bench', '--help'])\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('autofuser.zoo.models', 'triton', 'einops', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


# ---------------------------------------------------------------------------
# torch.compile's modes: reduce-overhead beside the default, each its own columns
# ---------------------------------------------------------------------------

ALL_MODES = ["--compile-modes", "default,reduce-overhead,max-autotune"]
TINY = ["--device", "cpu", "--config", "tiny", "--iters", "2", "--warmup", "1"]


class _StandInCompile:
    """``torch.compile`` without Inductor (no C compiler, no minutes of compiling on the
    test machine): the model run as it is, a little off eager in reduce-overhead so that
    each mode's error is told apart, and max-autotune failing on its first call."""

    OFFSET = 1e-3

    def __init__(self):
        self.modes: list[str] = []

    def __call__(self, model, *, mode=None, **kwargs):
        self.modes.append(mode)

        def compiled(*args, **kw):
            if mode == "max-autotune":
                raise RuntimeError("autotuning found no config (pretend)")
            out = model(*args, **kw)
            return out * (1 + self.OFFSET) if mode == "reduce-overhead" else out

        return compiled


class _ReplayingStandIn(_StandInCompile):
    """The stand-in, whose reduce-overhead is eager's until its third call (a warm-up and a
    recording, then replays) and a little off from then on."""

    def __call__(self, model, *, mode=None, **kwargs):
        self.modes.append(mode)
        calls = []

        def compiled(*args, **kw):
            calls.append(1)
            out = model(*args, **kw)
            return out * (1 + self.OFFSET) if mode == "reduce-overhead" and len(calls) > 2 else out

        return compiled


def _table(markdown: str) -> tuple[list[str], dict[str, list[str]]]:
    """bench.md's header and its rows by their first cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    split = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    header = next(cells for cells in split if cells[0] == "model")
    return header, {cells[0]: cells for cells in split if cells[0] != "model"}


def test_train_bench_checks_a_graph_modes_replayed_steps_not_only_its_warm_up(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "compile", _ReplayingStandIn())
    result = _tiny_fno_bench(tmp_path, train=True, compile_modes=("default", "reduce-overhead"))
    (row,) = result["rows"]
    default, overhead = (row["systems"][harness.compile_system(m)] for m in ("default", "reduce-overhead"))
    assert default["rel_err_vs_eager"] == 0.0 and default["grad_rel_err_vs_eager"] == 0.0
    assert overhead["rel_err_vs_eager"] == pytest.approx(_StandInCompile.OFFSET, rel=1e-3)
    assert overhead["grad_rel_err_vs_eager"] > 0


def test_compile_modes_are_parsed_checked_and_the_old_flag_still_works(capsys):
    parser = build_parser()
    assert parser.parse_args(["bench"]).compile_modes == ("default", "reduce-overhead")
    assert parser.parse_args(["bench", "--compile-mode", "max-autotune"]).compile_modes == ("max-autotune",)
    assert parser.parse_args(["bench", *ALL_MODES]).compile_modes == ("default", "reduce-overhead", "max-autotune")
    for bad, says in (("default,fastest", "'fastest'"), ("default,default", "names a mode twice"), (",", "no mode")):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "--compile-modes", bad])
        assert says in capsys.readouterr().err


def test_bench_has_a_column_set_per_compile_mode_and_a_failing_mode_is_its_cell(tmp_path, monkeypatch):
    """A tiny zoo model with three torch.compile modes: each mode its own cells, columns and
    geometric mean; reduce-overhead says that a CPU records no CUDA graph; max-autotune's
    failure is that cell's error while the others are measured."""
    stand_in = _StandInCompile()
    monkeypatch.setattr(torch, "compile", stand_in)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["bench", "--models", "fno", *TINY, *ALL_MODES, "--out", str(tmp_path)]) == 0
    assert stand_in.modes == ["default", "reduce-overhead", "max-autotune"]
    data = json.loads((tmp_path / "bench.json").read_text())
    systems = ["eager", "torch.compile", "torch.compile reduce-overhead", "torch.compile max-autotune", "autofuser"]
    assert data["systems"] == systems and data["settings"]["compile_modes"] == ALL_MODES[1].split(",")
    (row,) = data["rows"]
    cells = row["systems"]
    assert list(cells) == systems
    default, overhead, autotune = (cells[s] for s in systems[1:4])
    assert [default["mode"], overhead["mode"], autotune["mode"]] == ["default", "reduce-overhead", "max-autotune"]
    for cell in (default, overhead):
        assert cell["status"] == "ok", cell["error"]
        assert cell["ms"] > 0 and cell["first_call_s"] > 0 and cell["iqr_ms"] >= 0
        assert cell["speedup"] == pytest.approx(cells["eager"]["ms"] / cell["ms"])
    assert default["rel_err_vs_eager"] == 0.0
    assert overhead["rel_err_vs_eager"] == pytest.approx(_StandInCompile.OFFSET, rel=1e-3)
    assert overhead["note"] == harness.NO_CUDA_GRAPHS_ON_CPU and "note" not in default
    assert autotune["status"] == "error" and "autotuning found no config" in autotune["error"]
    assert autotune["ms"] is None and autotune["speedup"] is None
    assert cells["autofuser"]["status"] == "ok" and cells["autofuser"]["fused_groups"] >= 1
    geomean = data["geomean_speedup"]
    assert set(geomean) == set(systems[1:])
    assert geomean["torch.compile"] == pytest.approx(default["speedup"])
    assert geomean["torch.compile reduce-overhead"] == pytest.approx(overhead["speedup"])
    assert geomean["torch.compile max-autotune"] is None

    markdown = (tmp_path / "bench.md").read_text()
    assert markdown.strip() in printed.getvalue()
    header, rows = _table(markdown)
    assert header == harness.forward_columns(systems[1:4])
    for system in systems[1:4]:
        for what in ("ms", "IQR ms", "speedup", "first call s", "rel err"):
            assert f"{system} {what}" in header
    fno, mean = rows["fno"], rows["geometric mean"]
    assert len(fno) == len(header) and all(fno)
    assert fno[header.index("torch.compile reduce-overhead rel err")] == f"{overhead['rel_err_vs_eager']:.1e}"
    assert fno[header.index("torch.compile max-autotune ms")] == "error: RuntimeError"
    assert mean[header.index("torch.compile speedup")] == f"{geomean['torch.compile']:.2f}"
    assert mean[header.index("torch.compile reduce-overhead speedup")] == f"{geomean[systems[2]]:.2f}"
    assert mean[header.index("torch.compile max-autotune speedup")] == "-"
    assert "fno / torch.compile max-autotune: RuntimeError: autotuning found no config" in markdown
    assert f"torch.compile reduce-overhead: {harness.NO_CUDA_GRAPHS_ON_CPU}." in markdown


def test_train_bench_has_a_column_set_per_compile_mode(tmp_path, monkeypatch):
    stand_in = _StandInCompile()
    monkeypatch.setattr(torch, "compile", stand_in)
    result = _tiny_fno_bench(
        tmp_path, train=True, iters=2, compile_modes=("default", "reduce-overhead", "max-autotune")
    )
    (row,) = result["rows"]
    default, overhead, autotune = (row["systems"][harness.compile_system(m)] for m in stand_in.modes)
    for cell in (default, overhead):
        assert cell["status"] == "ok", cell["error"]
        assert cell["step_ms"] > 0 and cell["first_step_s"] > 0 and cell["speedup"] > 0
    assert default["grad_rel_err_vs_eager"] == 0.0 and default["rel_err_vs_eager"] == 0.0
    assert overhead["rel_err_vs_eager"] == pytest.approx(_StandInCompile.OFFSET, rel=1e-3)
    assert overhead["grad_rel_err_vs_eager"] > 0  # its loss, and so its gradients, differ
    assert overhead["note"] == harness.NO_CUDA_GRAPHS_ON_CPU
    assert autotune["status"] == "error" and autotune["step_ms"] is None
    header, rows = _table(result["markdown"])
    assert header == train_bench.training_columns([harness.compile_system(m) for m in stand_in.modes])
    assert len(rows["fno"]) == len(header) and all(rows["fno"])
    assert rows["geometric mean"][header.index("torch.compile reduce-overhead speedup")] == (
        f"{result['geomean_speedup']['torch.compile reduce-overhead']:.2f}"
    )


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="Inductor needs a C compiler")
def test_bench_of_a_module_factory_model_under_reduce_overhead(model_file, tmp_path):
    """The real torch.compile in reduce-overhead mode on a CPU: it records no CUDA graph but
    runs, and its output (first call and a later one) is checked against eager's."""
    spec = f"{model_file}:make"
    out = tmp_path / "bench"
    command = ["bench", spec, "--device", "cpu", "--iters", "2", "--warmup", "1", "--out", str(out)]
    assert main([*command, "--compile-modes", "reduce-overhead"]) == 0
    data = json.loads((out / "bench.json").read_text())
    (row,) = data["rows"]
    assert list(row["systems"]) == ["eager", "torch.compile reduce-overhead", "autofuser"]
    cell = row["systems"]["torch.compile reduce-overhead"]
    assert cell["status"] == "ok", cell["error"]
    assert cell["mode"] == "reduce-overhead" and cell["note"] == harness.NO_CUDA_GRAPHS_ON_CPU
    assert 0 <= cell["rel_err_vs_eager"] < 1e-5 and cell["ms"] > 0 and cell["speedup"] > 0
    assert data["geomean_speedup"]["torch.compile reduce-overhead"] == pytest.approx(cell["speedup"])
    header, rows = _table((out / "bench.md").read_text())
    assert header == harness.forward_columns(["torch.compile reduce-overhead"])
    assert rows[spec][header.index("torch.compile reduce-overhead ms")] == f"{cell['ms']:.3f}"


# ---------------------------------------------------------------------------
# The kernel suites (benchmarks/*.py) and the chart: a column per torch.compile mode
# ---------------------------------------------------------------------------

SUITES = ("bandwidth", "matmul", "attention", "conv", "mxint8", "fft_plugin")


@pytest.fixture(scope="module")
def suites():
    """The suites' modules, imported as their scripts import each other (from their folder)."""
    with benchmark_scripts(*SUITES, "chart", "_compile_modes") as modules:
        yield modules


@pytest.mark.parametrize("suite", SUITES)
def test_each_suite_takes_compile_modes_and_refuses_bad_ones(suites, suite, capsys, tmp_path):
    for bad, says in (("default,fastest", "'fastest'"), ("reduce-overhead,reduce-overhead", "names a mode twice")):
        with pytest.raises(SystemExit) as exited:
            suites[suite].main(["--out", str(tmp_path), "--compile-modes", bad])
        assert exited.value.code == 2 and says in capsys.readouterr().err
    modes = suites["_compile_modes"].parse_compile_modes
    assert modes("default, reduce-overhead,max-autotune") == ("default", "reduce-overhead", "max-autotune")
    assert suites["_compile_modes"].DEFAULT_COMPILE_MODES == ("default", "reduce-overhead")


def test_cuda_graph_modes_replay_a_new_step_on_every_call(suites, monkeypatch):
    """reduce-overhead (and max-autotune) mark a new CUDA-graph step before each call, so each
    timed call replays the graph; the default mode is torch.compile's callable as it is."""
    stand_in, marks = _StandInCompile(), []
    monkeypatch.setattr(torch, "compile", stand_in)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    compiled = suites["_compile_modes"].compiled
    x = torch.randn(3, 5)
    default = compiled(torch.nn.ReLU(), "default")
    torch.testing.assert_close(default(x), torch.relu(x))
    assert marks == [] and stand_in.modes == [None]
    overhead = compiled(torch.nn.ReLU(), "reduce-overhead")
    for _ in range(3):
        torch.testing.assert_close(overhead(x), torch.relu(x) * (1 + _StandInCompile.OFFSET))
    assert marks == [0, 1, 2] and stand_in.modes == [None, "reduce-overhead"]


def _with_reduce_overhead(rows: list[dict], old_key: str) -> list[dict]:
    """``rows`` as a run with reduce-overhead would write them: its cell beside the default's."""
    new = []
    for row in rows:
        row = json.loads(json.dumps(row))
        if "ms" in row.get(old_key, {}):
            row["torch.compile reduce-overhead"] = {**row[old_key], "ms": row[old_key]["ms"] * 0.5}
        new.append(row)
    return new


def _header_and_rows(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    split = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("| ")]
    return split[0], [cells for cells in split[1:] if not set(cells[0]) <= {"-"}]


@pytest.mark.parametrize("suite", ["bandwidth", "matmul", "attention", "mxint8", "fft_plugin"])
def test_each_suites_table_reads_todays_results_and_shows_reduce_overhead_where_measured(suites, suite):
    """Today's benchmarks/results/<suite>.json (no reduce-overhead cells; some under the keys
    the suites wrote before) renders as it did; the same rows with reduce-overhead cells get
    its column, beside the default mode's, with each row's value in it."""
    module, summary = suites[suite], json.loads((BENCHMARKS / "results" / f"{suite}.json").read_text())
    if suite == "bandwidth":
        run, key, render = summary, "cases", lambda run: module.render(run).splitlines()
    elif suite == "fft_plugin":
        run, key, render = summary, "rows", lambda run: module.render(run).splitlines()
    elif suite == "matmul":
        run, key, render = summary["runs"][-1], "cases", lambda run: module.table(run).splitlines()
    else:
        run = summary if suite == "attention" else summary["runs"][-1]
        key, render = "cases", lambda run: module.rows_table(run["cases"])
    default_key = "compile" if suite == "mxint8" else "torch.compile"  # mxint8's summary: the old key
    header, rows = _header_and_rows(render(run))
    assert "torch.compile" in header and not any("reduce-overhead" in h for h in header)
    assert rows and all(len(cells) == len(header) for cells in rows)
    measured = {**run, key: _with_reduce_overhead(run[key], default_key)}
    header2, rows2 = _header_and_rows(render(measured))
    at = header2.index("torch.compile reduce-overhead")
    assert header2[at - 1] == "torch.compile" and header2[:at] + header2[at + 1 :] == header
    for cells, row in zip(rows2, measured[key]):
        assert len(cells) == len(header2)
        assert cells[at].startswith(f"{row['torch.compile reduce-overhead']['ms']:.3f}")


def test_conv_and_matmul_tables_read_cells_under_the_old_keys(suites):
    """Rows written before --compile-modes (``compile``, matmul's ``compile-max``) still read,
    in the columns of their modes."""
    cell = {"ms": 2.0, "first_call_s": 1.0, "rel_err": 1e-6}
    row = {"case": "conv 3x3", "width": 32, "mode": "fp32", "floor_ms": 0.5, "eager": {"ms": 4.0}}
    old = {**row, "compile": cell, "compile-max": {**cell, "ms": 1.0}, "autofuser": {**cell, "ms": 0.8}}
    header, (cells,) = _header_and_rows(suites["conv"].rows_table([old]))
    assert header[4:8] == [
        "eager",
        "torch.compile",
        "torch.compile max-autotune-no-cudagraphs",
        "AutoFuser",
    ]
    assert cells[4:8] == ["4.000 (1.00x)", "2.000 (2.00x)", "1.000 (4.00x)", "0.800 (5.00x)"]
    new = {**row, "torch.compile": cell, "torch.compile reduce-overhead": {**cell, "ms": 1.6}, "autofuser": cell}
    header, (cells,) = _header_and_rows(suites["conv"].rows_table([new]))
    assert header[5:7] == ["torch.compile", "torch.compile reduce-overhead"] and cells[6] == "1.600 (2.50x)"


def test_the_chart_reads_todays_zoo_summary_and_draws_reduce_overhead_where_measured(suites):
    chart = suites["chart"]
    summary = json.loads((BENCHMARKS / "results" / "zoo.json").read_text())
    run = next(r for r in summary["runs"] if str(r["run"]) == "N")
    today = chart.render(run)
    assert today == (BENCHMARKS / "results" / "zoo.svg").read_text()  # the committed chart, unchanged
    assert "reduce-overhead" not in today and "#2ca02c" not in today
    measured = {**run, "rows": _with_reduce_overhead(run["rows"], "torch.compile")}
    for row in measured["rows"]:
        if "torch.compile reduce-overhead" in row:
            row["torch.compile reduce-overhead"]["speedup"] = 2 * row["torch.compile"]["speedup"]
    drawn = chart.render(measured)
    assert "torch.compile (reduce-overhead)" in drawn
    bars = sum(1 for r in measured["rows"] if r.get("torch.compile reduce-overhead", {}).get("speedup"))
    assert bars > 0 and drawn.count('fill="#2ca02c"/>') == bars + 1  # one per speedup, one in the legend
    assert drawn.count('fill="#1f77b4"/>') == today.count('fill="#1f77b4"/>')  # AutoFuser's bars as before


def test_fft_suite_runs_each_compile_mode_on_the_cpu(suites, monkeypatch, tmp_path):
    """A CPU smoke run of a suite's loop (fft_plugin, tiny FNO; torch.compile stood in for):
    each mode its own checked cell, reduce-overhead a new step per call, both in the table."""
    pytest.importorskip("autofuser_plugin_fft")
    stand_in, marks = _StandInCompile(), []
    stand_in.OFFSET = 0.0  # the suite fails a cell whose output is off eager
    monkeypatch.setattr(torch, "compile", stand_in)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    row = suites["fft_plugin"].bench_model("fno", torch.device("cpu"), 2, 1, str(tmp_path), "tiny")
    assert stand_in.modes == [None, "reduce-overhead"]
    for system in ("eager", "torch.compile", "torch.compile reduce-overhead", "autofuser (bundled)", "autofuser + fft"):
        assert "error" not in row[system], row[system]
        assert row[system]["ms"] > 0 and row[system]["rel_error"] <= 1e-4
    assert len(marks) >= 3  # the first call, warm-up and the timed calls: each a step
    result = {"device": "cpu", "date": "today", "config": "tiny", "rows": [row]}
    header, (cells,) = _header_and_rows(suites["fft_plugin"].render(result).splitlines())
    assert header[2:5] == ["eager", "torch.compile", "torch.compile reduce-overhead"] and len(cells) == len(header)


def planted_fuse(monkeypatch, scale: float) -> None:
    """``autofuser.fuse`` whose modules return their output times ``scale``: a wrong result
    planted past verification, which keeps a wrong kernel from running at all."""
    real = autofuser.fuse

    def fuse(model, *args, **kwargs):
        fused = real(model, *args, **kwargs)
        forward = fused.forward
        fused.forward = lambda *a, **k: forward(*a, **k) * scale
        return fused

    monkeypatch.setattr(autofuser, "fuse", fuse)


def test_a_bench_whose_autofuser_results_differ_from_eager_fails_loudly(model_file, tmp_path, capsys, monkeypatch):
    """An AutoFuser output past the dtype's limit against eager, and as far from the
    float64 output, is named on stderr with both errors, and the command exits with status
    1: a wrong model must not pass as a speedup."""
    planted_fuse(monkeypatch, 1 + 3e-4)
    spec = f"{model_file}:make"
    argv = ["bench", spec, "--device", "cpu", "--iters", "2", "--warmup", "1", "--no-compile"]
    assert main([*argv, "--out", str(tmp_path / "bench")]) == 1
    err = capsys.readouterr().err
    assert f"WRONG RESULT: {spec} (fp32): AutoFuser's output differs from eager's" in err, err
    assert "above the 0.0001 allowed for fp32" in err, err
    (row,) = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]
    eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
    assert row["float64_reference"] == "ran"
    assert eager["rel_err_vs_float64"] < 1e-5 and fused["rel_err_vs_float64"] == pytest.approx(3e-4, rel=0.05)
    assert f"against the float64 result its error is {fused['rel_err_vs_float64']:.3g}" in err, err
    assert f"eager's {eager['rel_err_vs_float64']:.3g}" in err, err
    assert len(eager["block_ms"]) == eager["repeats"] and all(t > 0 for t in eager["block_ms"])


def test_where_float64_cannot_run_the_model_in_strict_fp32_judges(model_file, tmp_path, capsys, monkeypatch):
    """A model that can't run in float64 (the FNO's spectral layers cast to fp32): its
    output in fp32 with every product in full fp32 stands in for the exact one."""
    planted_fuse(monkeypatch, 1 + 3e-4)
    spec = f"{model_file}:make_float32_only"
    argv = ["bench", spec, "--device", "cpu", "--iters", "1", "--warmup", "0", "--no-compile"]
    assert main([*argv, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert row["float64_reference"].startswith("strict fp32 (float64 failed: RuntimeError"), row["float64_reference"]
    fused, eager = row["systems"]["autofuser"], row["systems"]["eager"]
    assert fused["rel_err_vs_float64"] == pytest.approx(3e-4, rel=0.05)
    assert eager["rel_err_vs_float64"] < 1e-6
    assert "against the float64 result its error is" in err, err
    assert f"- {spec} (against {row['float64_reference']}): " in (tmp_path / "bench.md").read_text()


def test_where_neither_reference_runs_the_plain_limit_judges():
    row = {"model": "m", "systems": {"eager": {"rel_err_vs_eager": 0.0}, "autofuser": {"rel_err_vs_eager": 3e-4}}}
    kept = {"autofuser": {"rel_err_vs_float64": [torch.ones(3)]}}

    def fails(what):
        def run():
            raise RuntimeError(f"{what} can't run")

        return run

    harness.judge_by_float64("m", row, "fp32", kept, fails("float64"), torch.device("cpu"), fallback=fails("fp32"))
    assert (
        row["float64_reference"]
        == "failed: RuntimeError: float64 can't run; strict fp32 too: RuntimeError: fp32 can't run"
    )
    (line,) = harness.wrong_results([row], "fp32")
    assert f"no float64 reference to judge it by ({row['float64_reference']})" in line


def test_the_training_bench_records_the_float64_reference_of_the_first_step(tmp_path, monkeypatch, capsys):
    planted_fuse(monkeypatch, 1 + 1e-3)
    code = main(["bench", "--train", "--models", "unet", *SMOKE, "--iters", "3", "--out", str(tmp_path)])
    assert code == 1
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
    assert row["float64_reference"] == "ran"
    # eager's own rounding: fp32's, far below the planted error
    assert 0 < eager["rel_err_vs_float64"] < 1e-5 and 0 < eager["grad_rel_err_vs_float64"] < 1e-5
    assert fused["rel_err_vs_float64"] == pytest.approx(1e-3, rel=0.05)
    assert fused["grad_rel_err_vs_float64"] > 1e-4
    assert "compile" not in " ".join(s for s, c in row["systems"].items() if "rel_err_vs_float64" in c)
    for cell in (eager, fused):
        assert len(cell["step_times_ms"]) == 3  # rounded to the microsecond, the median their middle one
        assert cell["step_ms"] == pytest.approx(sorted(cell["step_times_ms"])[1], abs=1e-3)
    err = capsys.readouterr().err
    assert "WRONG RESULT: unet (fp32): AutoFuser's output differs" in err, err
    assert "WRONG RESULT: unet (fp32): AutoFuser's gradients differ" in err, err
    markdown = (tmp_path / "bench.md").read_text()
    assert f"- unet: eager {eager['rel_err_vs_float64']:.1e} / {eager['grad_rel_err_vs_float64']:.1e}" in markdown


def test_the_float64_reference_runs_only_past_the_limit():
    calls = []
    row = {"systems": {"eager": {"rel_err_vs_eager": 0.0}, "autofuser": {"rel_err_vs_eager": 5e-5}}}
    kept = {"eager": {"rel_err_vs_float64": [torch.ones(3)]}}
    cpu = torch.device("cpu")

    def reference():
        calls.append(1)
        return {"rel_err_vs_float64": torch.ones(3, dtype=torch.float64) * (1 + 1e-6)}

    harness.judge_by_float64("m", row, "fp32", kept, reference, cpu)
    assert row["float64_reference"] == "not needed" and not calls
    row["systems"]["autofuser"]["rel_err_vs_eager"] = float("nan")
    harness.judge_by_float64("m", row, "fp32", kept, reference, cpu)
    assert row["float64_reference"] == "ran" and calls == [1]
    assert row["systems"]["eager"]["rel_err_vs_float64"] == pytest.approx(1e-6, rel=1e-3)


def gate_row(fused_vs_eager, fused_vs_float64, eager_vs_float64, reference="ran"):
    """A training row whose gradients' errors are these (None: not measured)."""
    eager = {"grad_rel_err_vs_eager": 0.0}
    fused = {"grad_rel_err_vs_eager": fused_vs_eager}
    if eager_vs_float64 is not None:
        eager["grad_rel_err_vs_float64"] = eager_vs_float64
    if fused_vs_float64 is not None:
        fused["grad_rel_err_vs_float64"] = fused_vs_float64
    return {"model": "unet", "float64_reference": reference, "systems": {"eager": eager, "autofuser": fused}}


def test_a_rounding_difference_as_large_as_eager_s_own_passes_the_gate():
    # The U-Net's fp32 step on a GPU: AutoFuser 1.2e-4 from eager, eager itself about as far from exact.
    assert harness.wrong_results([gate_row(1.2e-4, 1.5e-4, 1.3e-4)], "fp32") == []
    bound = harness.FLOAT64_FACTOR * 1.3e-4 + harness.MAX_REL_ERROR["fp32"]
    assert harness.wrong_results([gate_row(1.2e-4, 0.99 * bound, 1.3e-4)], "fp32") == []


@pytest.mark.parametrize(
    ("row", "says"),
    [
        # far from exact, where eager is not
        (gate_row(2e-3, 2e-3, 1e-6), ["relative error of 0.002,", "its error is 0.002, eager's 1e-06"]),
        # just past the bound
        (
            gate_row(1.2e-4, 1.01 * (4 * 1.3e-4 + 1e-4), 1.3e-4),
            ["its error is 0.000626, eager's 0.00013", "0.00062 allowed"],
        ),
        (gate_row(float("nan"), float("nan"), 1e-6), ["relative error of nan,"]),
        (gate_row(1.2e-4, 1e-6, float("nan")), ["eager's nan"]),  # eager's own error unknown
        (
            gate_row(2e-4, None, None, "failed: RuntimeError: no float64"),
            ["judge it by (failed: RuntimeError: no float64)"],
        ),
        (gate_row(2e-4, None, None, "not needed"), ["no float64 reference to judge it by (not needed)"]),
    ],
)
def test_the_gate_flags_a_result_far_from_float64_and_names_both_errors(row, says):
    (line,) = harness.wrong_results([row], "fp32")
    assert line.startswith("WRONG RESULT: unet (fp32): AutoFuser's gradients differ from eager's")
    for text in says:
        assert text in line, (text, line)


@pytest.mark.parametrize(
    ("cell", "dtype", "named"),
    [
        ({"rel_err_vs_eager": 2e-5}, "fp32", []),
        ({"rel_err_vs_eager": 2e-4}, "fp32", ["output"]),
        ({"rel_err_vs_eager": 2e-4, "grad_rel_err_vs_eager": float("nan")}, "bf16", ["gradients"]),
        ({"rel_err_vs_eager": None, "status": "error"}, "fp32", []),  # a failed cell is its own error
    ],
)
def test_wrong_results_names_each_result_past_the_dtype_s_limit(cell, dtype, named):
    lines = harness.wrong_results([{"model": "m", "systems": {"autofuser": cell}}], dtype)
    assert [line.split("AutoFuser's ")[1].split(" ")[0] for line in lines] == named


def test_batch_norm_train_bench_checks_every_result_against_eager():
    """``benchmarks/batch_norm_train.py``'s row on a tiny CPU case (untimed): the
    plugin's results (output, gradients, running statistics) within rounding of eager's,
    and a system that fails gives a cell with its error, not a crash."""
    with benchmark_scripts("batch_norm_train") as bench:
        for layout in ("channels_last", "contiguous"):
            row = bench.case(6, 9, 5, layout, torch.float32, "gelu", ["eager", "plugin", "nothing"], 1e12,
                             device="cpu", batch=3, timed=False)  # fmt: skip
            assert row["eager_err"] == 0 and 0 < row["plugin_err"] < 1e-5, row
            assert "nothing_error" in row and "plugin_ms" not in row, row


def test_batch_norm_train_bench_picks_cases_by_name():
    """``--layouts`` and ``--dtypes`` take comma-separated names; an unknown one is
    refused with the names it could have been."""
    with benchmark_scripts("batch_norm_train") as bench:
        assert bench._choices(bench.LAYOUTS, "layout")("channels_last") == ("channels_last",)
        assert bench._choices(tuple(bench.DTYPES), "dtype")(" bf16,fp32 ") == ("bf16", "fp32")
        for text in ("fp16", "", "fp32,half"):
            with pytest.raises(argparse.ArgumentTypeError, match="fp32, bf16"):
                bench._choices(tuple(bench.DTYPES), "dtype")(text)


def test_fuse_options_reach_fuse_from_the_command_line(monkeypatch):
    """``--fuse-option NAME=VALUE`` (repeatable, VALUE as JSON or else a string) goes to
    fuse() beside the tuning options; a malformed one is refused with the form to use."""
    seen = {}
    monkeypatch.setattr(harness, "run_bench", lambda names, **kwargs: seen.update(kwargs) or {"markdown": ""})
    parser = build_parser()
    argv = ["bench", "--models", "unet", "--device", "cpu", "--tune-budget", "2"]
    argv += ["--fuse-option", "batch_norm_kernels=false", "--fuse-option", "strict_fp32_products=ieee"]
    assert harness.run_from_args(parser.parse_args(argv)) == 0
    expected = {"tune_budget_s": 2.0, "batch_norm_kernels": False, "strict_fp32_products": "ieee"}
    assert seen["fuse_options"] == expected, seen
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--fuse-option", "batch_norm_kernels"])


def test_what_ran_reads_the_last_verdict_of_the_notes():
    from autofuser.zoo.harness import NOTE_CHARS, what_ran

    stands = (
        "the fused training step's gradients are off the original model's (0.27) but nearer ...: the fused step stands"
    )
    graphed = "training step, forward and backward: 4.2 ms fused (replayed as two CUDA graphs) vs 10.4 ms eager"
    in_use_fused = (
        "training step in use, 2 blocks of 4 calls on each side: 4.7 ms fused vs 10.2 ms: the fused model runs"
    )
    no_graph = "no CUDA graph for the training step (a replayed backward differs ...); kernels launch one by one"
    slower = "the fused training step, forward and backward (44 ms), was not at least 2% faster ...: the original runs"
    assert what_ran(None) is None and what_ran([]) is None
    assert what_ran([stands, graphed, in_use_fused]) == "the fused step, replayed as two CUDA graphs"
    assert what_ran([stands, no_graph, slower]) == f"the original: {slower}"
    assert what_ran([no_graph]) == f"the fused step, launched: {no_graph}"
    in_use_original = "training step in use, 4 blocks of 4 calls on each side: 9 ms fused vs 8 ms: the original runs"
    assert what_ran([graphed, in_use_original]).startswith("the original: training step in use")
    assert what_ran([slower + " (provisional)", in_use_fused]) == "the fused step, launched"
    assert len(what_ran(["x" * 500 + ": the original runs"])) == len("the original: ") + NOTE_CHARS
    forward = "the compiled forward replays as one CUDA graph (1.2 ms vs 2.0 ms launched op by op)"
    in_use = "forward in use, 4 blocks of 4 calls on each side: 1.3 ms fused vs 1.7 ms: the fused model runs"
    assert what_ran([forward, in_use], "forward") == "the fused forward, replayed as one CUDA graph"
    no_graph = "no CUDA graph: replaying it (2.1 ms) is not faster than launching (2.0 ms)"
    assert what_ran([no_graph], "forward") == f"the fused forward, launched: {no_graph}"
    # The report's own word, where the bench has it, decides over the notes' wording.
    untraced = "the model could not be traced at all; it runs unchanged"
    assert what_ran([untraced], "forward") == "the fused forward, launched"  # no wording it knows
    assert what_ran([untraced], "forward", runs_original=True) == f"the original: {untraced}"
    assert what_ran([graphed, in_use_original], runs_original=False) == "the fused step, replayed as two CUDA graphs"


def test_keep_cache_uses_the_cache_as_found_and_says_so(tmp_path):
    """``--keep-cache``: each model's AutoFuser cache folder is not emptied first (a run that
    filled it went before), and bench.md says the cold column is not cold; without it the
    folder starts empty."""
    first = _tiny_fno_bench(tmp_path, train=False)
    folder = tmp_path / "autofuser-cache" / "fno"
    kernels = sorted(folder.rglob("*.py"))
    assert kernels, "the first run filled the cache"
    (folder / "left-by-an-earlier-run").write_text("x")
    kept = _tiny_fno_bench(tmp_path, train=False, keep_cache=True)
    assert (folder / "left-by-an-earlier-run").exists() and sorted(folder.rglob("*.py")) == kernels
    assert kept["rows"][0]["systems"]["autofuser"]["status"] == "ok"
    assert kept["settings"]["keep_cache"] and "--keep-cache" in kept["markdown"]
    assert not first["settings"]["keep_cache"] and "--keep-cache" not in first["markdown"]
    _tiny_fno_bench(tmp_path, train=False)
    assert not (folder / "left-by-an-earlier-run").exists()
