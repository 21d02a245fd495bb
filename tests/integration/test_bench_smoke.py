"""``autofuser bench`` on the CPU: the tiny configuration of one transformer
(Galerkin) and one neural operator (FNO), without torch.compile.

Checks that every column reaches bench.json and bench.md, that AutoFuser's
output matches eager, and that a system that raises becomes an error row
instead of stopping the run; the same of ``--train`` (a training step), whose
gradients must match eager's too.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Optional

import pytest

import autofuser
from autofuser.cli import main
from autofuser.zoo import harness, train_bench

MODELS = ["galerkin", "fno"]
# F-FNO's weight-normed layers: every system trains a deep copy of the model.
TRAIN_MODELS = [*MODELS, "ffno"]
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
        assert set(systems) == {"eager", "torch.compile", "autofuser"}
        for cell in systems.values():
            assert CELL_KEYS <= set(cell)
        eager, compiled, fused = systems["eager"], systems["torch.compile"], systems["autofuser"]
        assert AUTOFUSER_KEYS <= set(fused)
        assert eager["status"] == "ok" and eager["ms"] > 0 and eager["test_loss"] > 0
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
    assert f"| fno | {harness.NO_COMPILE} | {fused['first_call_fresh_s']:.2f} |" in result["markdown"]

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
        milliseconds, peak = results[name]  # type: ignore[misc]
        assert milliseconds > 0 and peak is None  # peak memory is measured on CUDA only


def test_train_bench_a_failing_system_is_an_error_cell(tmp_path, monkeypatch):
    def broken_fuse(model, *args, **kwargs):
        raise RuntimeError("deliberately broken fuse")

    monkeypatch.setattr(autofuser, "fuse", broken_fuse)
    result = harness.run_bench(
        ["fno"],
        device=harness.torch.device("cpu"),
        config="tiny",
        iters=1,
        warmup=0,
        out=tmp_path,
        no_compile=True,
        train=True,
    )
    (row,) = result["rows"]
    eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
    assert eager["status"] == "ok" and eager["step_ms"] > 0
    assert fused["status"] == "error" and fused["error"] == "RuntimeError: deliberately broken fuse"
    assert fused["step_ms"] is None and fused["grad_rel_err_vs_eager"] is None
    assert "fno / autofuser: RuntimeError: deliberately broken fuse" in result["markdown"]
    assert result["geomean_speedup"]["autofuser"] is None


def test_train_and_train_steps_are_told_apart(tmp_path, capsys):
    parser = harness.argparse.ArgumentParser()
    harness.add_arguments(parser)
    helps = {action.dest: action.help for action in parser._actions}
    assert "--train-steps" in helps["train"] and "--train" in helps["train_steps"]
    assert main(["bench", "--train", "--fresh-first-calls", "--models", "fno", *SMOKE, "--out", str(tmp_path)]) == 2
    assert "--fresh-first-calls" in capsys.readouterr().err
