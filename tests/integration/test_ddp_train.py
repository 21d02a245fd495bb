"""``benchmarks/ddp_train.py`` on the CPU (gloo, Triton's interpreter, the tiny FNO): two
ranks under torchrun train as one process accumulating the same two per-rank batches, and
the table is written; a rank whose first forward is late still finishes; a rank that never
comes is a clear error, not a hang; a baseline run with other settings is refused."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ddp_train.py"
TINY = ["--models", "fno", "--config", "tiny", "--batch-size", "1", "--steps", "2", "--warmup", "0", "--iters", "1"]


def load_script():
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the script module, one-process baseline folder, two-rank folder, the two-rank run)."""
    ddp_train = load_script()
    base, ranks = tmp_path_factory.mktemp("one-process"), tmp_path_factory.mktemp("two-ranks")
    # The baseline in this process: one process stands in for the two ranks.
    assert ddp_train.main([*TINY, "--systems", "eager,autofuser", "--accumulate", "2", "--out", str(base)]) == 0
    run = torchrun(
        *TINY,
        *("--systems", "eager,autofuser", "--baseline", str(base), "--out", str(ranks)),
        *("--delay-rank1-s", "2", "--timeout-s", "120"),
        timeout=240,
    )
    return ddp_train, base, ranks, run


def test_two_ranks_train_as_one_process_accumulating_their_batches(runs):
    ddp_train, base, ranks, run = runs
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((ranks / "ddp_train.json").read_text())
    assert result["settings"]["world"] == 2 and result["settings"]["backend"] == "gloo"
    assert result["settings"]["delay_rank1_s"] == 2
    (row,) = result["rows"]
    assert set(row["systems"]) == {"eager", "autofuser"}
    for system, cell in row["systems"].items():
        saved = torch.load(ranks / "params" / f"fno-{system}.pt")
        assert (saved["after"] - saved["before"]).abs().max() > 0, system  # the steps did train
        # The same kernels on the same shapes, two ranks' gradients halved and added: equal
        # to one process's up to summation order (this process runs more threads than the
        # ranks). Gradients are compared as such: AdamW's update hides a gradient's scale.
        assert cell["within_tolerance"], (system, cell)
        assert cell["update_rel_err"] <= 1e-5 and cell["grad_rel_err"] <= 1e-5, (system, cell)
        assert cell["loss_rel_err"] <= 1e-5, (system, cell)
        assert len(cell["rank_median_ms"]) == 2 and cell["step_ms"] > 0 and cell["scaling"] > 0
    fused = row["systems"]["autofuser"]
    assert fused["fused_groups"] > 0, fused["notes"]
    # Each tuning entry written by exactly one rank (none tune off a GPU).
    assert fused["tuned_twice"] == []
    assert sum(len(kernels) for kernels in fused["tuned_by_rank"]) == fused["tuning_entries"]
    # The fused model computed what eager did, to fp32 rounding.
    assert fused["update_rel_err_vs_eager"] < 1e-3
    markdown = (ranks / "ddp_train.md").read_text()
    for column in ddp_train.COLUMNS:
        assert column in markdown
    assert "| fno | eager | 2 | 1 |" in markdown and "| fno | autofuser | 2 | 1 |" in markdown


def test_the_table_is_rebuilt_from_saved_runs_and_a_mismatched_baseline_is_refused(runs, tmp_path):
    ddp_train, base, ranks, run = runs
    assert run.returncode == 0, run.stderr[-4000:]
    assert ddp_train.main(["--table-only", "--baseline", str(base), "--out", str(ranks)]) == 0
    other = tmp_path / "other"
    shutil.copytree(base, other)
    saved = json.loads((other / "ddp_train.json").read_text())
    saved["settings"]["steps"] = 3
    (other / "ddp_train.json").write_text(json.dumps(saved))
    with pytest.raises(ddp_train.BenchError, match="steps 2 here, 3 there"):
        ddp_train.main(["--table-only", "--baseline", str(other), "--out", str(ranks)])
    with pytest.raises(ddp_train.BenchError, match="run the one-process baseline first"):
        ddp_train.main(["--table-only", "--baseline", str(tmp_path / "missing"), "--out", str(ranks)])


def test_a_rank_that_never_comes_is_a_clear_error_not_a_hang(tmp_path):
    run = torchrun(
        *TINY,
        *("--systems", "eager", "--out", str(tmp_path)),
        *("--delay-rank1-s", "60", "--timeout-s", "4"),
        timeout=50,
    )
    assert run.returncode != 0
    assert "rank 0: fno/eager: first step (compiles) did not finish within 4 s (--timeout-s)" in run.stderr
    assert not (tmp_path / "ddp_train.json").exists()
