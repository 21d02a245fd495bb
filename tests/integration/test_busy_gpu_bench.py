"""benchmarks/busy_gpu.py's pieces on a CPU: its options, the matmul load started and
stopped in its own process, and the verdict and table of a row. The suite itself needs
a GPU (docs/zoo.md, "Busy GPU")."""

from __future__ import annotations

import threading
import time

import pytest

from _helpers import benchmark_scripts


@pytest.fixture(scope="module")
def busy_gpu():
    with benchmark_scripts("busy_gpu") as module:
        yield module


MODELS = ["fno", "unet", "transolver"]


def test_options_default_and_checked(busy_gpu, capsys):
    args = busy_gpu.parse_args([], known_models=MODELS)
    assert (args.models, args.dtypes, args.load) == (MODELS, ["fp32", "bf16"], ["matmul", "compile"])
    assert args.tolerance == pytest.approx(0.10)
    args = busy_gpu.parse_args(
        ["--models", "unet, fno", "--dtypes", "bf16", "--load", "matmul,matmul,fuse"], known_models=MODELS
    )
    assert (args.models, args.dtypes, args.load) == (["unet", "fno"], ["bf16"], ["matmul", "matmul", "fuse"])
    for argv, said in [
        (["--models", "unet,resnet"], "--models: 'resnet': give one or more of fno, unet, transolver"),
        (["--dtypes", "fp16"], "--dtypes: 'fp16': give one or more of fp32, bf16"),
        (["--load", "matmul,disk"], "--load: 'disk': give one or more of matmul, compile, fuse"),
        (["--load", ""], "--load: no value: give one or more of"),
        (["--iters", "0"], "--iters must be at least 1, got 0"),
        (["--busy-calls", "-1"], "--busy-calls must be at least 0, got -1"),
        (["--tolerance", "10"], "--tolerance is a share between 0 and 1"),
    ]:
        with pytest.raises(SystemExit) as stop:
            busy_gpu.parse_args(argv, known_models=MODELS)
        assert stop.value.code == 2 and said in capsys.readouterr().err, argv


def test_the_matmul_load_runs_until_stopped(busy_gpu):
    ready, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=busy_gpu.matmul_load, args=("cpu", 33, ready, stop))
    worker.start()
    assert ready.wait(30)
    stop.set()
    worker.join(30)
    assert not worker.is_alive()


def test_a_load_process_is_started_waited_for_and_stopped(busy_gpu):
    """``with Load(...)`` returns once its process's load runs, and leaves none running."""
    load = busy_gpu.Load(["matmul"], "cpu", 17, others=[], config="tiny", dtype="fp32")
    begin = time.monotonic()
    with load:
        ((process, ready),) = load.processes
        assert ready.is_set() and process.is_alive()
    assert not process.is_alive() and time.monotonic() - begin < busy_gpu.LOAD_START_S
    with pytest.raises(ValueError, match="needs another zoo model"):
        busy_gpu.Load(["compile"], "cpu", 17, others=[], config="tiny", dtype="fp32")


@pytest.mark.parametrize(
    "times, problem",
    [
        ({"eager_ms": 9.1, "quiet_ms": 4.46, "busy_ms": 4.6}, None),
        ({"eager_ms": 9.1, "quiet_ms": 4.46, "busy_ms": 12.9}, "slower than eager (12.900 vs 9.100 ms); 189% slower"),
        ({"eager_ms": 9.1, "quiet_ms": 4.46, "busy_ms": 5.0}, "12% slower than compiled on a quiet GPU (4.460 ms)"),
        ({"eager_ms": 9.1, "quiet_ms": 4.46}, "not measured: busy_ms"),
    ],
)
def test_a_row_holds_only_beside_eager_and_its_quiet_compile(busy_gpu, times, problem):
    row = {"model": "unet", "dtype": "fp32", **times}
    found = busy_gpu.verdict(row, 0.10)
    assert (found is None) if problem is None else (found is not None and found.startswith(problem)), found
    row["problem"] = found
    for kind in ("quiet", "busy"):
        if f"{kind}_ms" in row:
            row[f"{kind}_speedup"] = row["eager_ms"] / row[f"{kind}_ms"]
    table = busy_gpu.render_markdown([row], 0.10)
    assert f"| unet | fp32 | {times['eager_ms']:.3f} | - | 4.460 (2.04x) |" in table, table
    assert ("| yes |" in table) == (problem is None)
    assert f"{int(problem is None)} of 1 held" in table
