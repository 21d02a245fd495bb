"""The on-disk cache (``autofuser_core.cache``): tuning entries, kernel
sources, the folder itself, and tuning results reused across processes."""

from __future__ import annotations

import errno
import importlib.util
import itertools
import json
import marshal
import os
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import autofuser
from autofuser_core import cache
from autofuser_core.cache import cache_dir, key_digest, load_kernel_module, read_tuning, write_tuning

from _helpers import NormGelu, StandInTimer, lock_is_free

KEY = {
    "kernel": "af_flat_mul_add_0123456789",
    "source_sha256": "ab" * 32,
    "torch": "2.13.0",
    "triton": "3.9.0",
    "gpu": "NVIDIA H200",
    "capability": "9.0",
}
CONFIG = {"BLOCK": 1024, "num_warps": 4}
TIMINGS = [{"config": {"BLOCK": 512, "num_warps": 4}, "ms": 0.0123}, {"config": CONFIG, "ms": 0.0101}]


def entry_path(root: Path, key: dict) -> Path:
    return root / "tuning" / f"{key_digest(key)}.json"


def leftovers(folder: Path) -> list[str]:
    """Temporary files an interrupted write would leave."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# ---------------------------------------------------------------------------
# Tuning entries
# ---------------------------------------------------------------------------


def test_tuning_entry_round_trips(tmp_path, recwarn):
    assert read_tuning(tmp_path, KEY) is None  # missing: no warning, just a miss
    write_tuning(tmp_path, KEY, CONFIG, TIMINGS)
    entry = read_tuning(tmp_path, KEY)
    assert entry["config"] == CONFIG
    assert entry["timings"] == TIMINGS
    assert entry["key"] == KEY
    assert len(recwarn) == 0
    # One file per key; another key is another file.
    other = {**KEY, "gpu": "NVIDIA A100", "capability": "8.0"}
    write_tuning(tmp_path, other, {"BLOCK": 256, "num_warps": 2}, [])
    assert read_tuning(tmp_path, other)["config"] == {"BLOCK": 256, "num_warps": 2}
    assert read_tuning(tmp_path, KEY)["config"] == CONFIG
    assert sorted(p.name for p in (tmp_path / "tuning").iterdir()) == sorted(
        [f"{key_digest(KEY)}.json", f"{key_digest(other)}.json"]
    )


def _valid_entry(**changes) -> str:
    entry = {"version": cache.ENTRY_VERSION, "key": KEY, "config": CONFIG, "timings": []}
    entry.update(changes)
    return json.dumps(entry)


@pytest.mark.parametrize(
    "text, why",
    [
        pytest.param('{"version": 1, "key": {"kernel": ', "Expecting", id="truncated-json"),
        pytest.param("\x00\x01 not json at all", "Expecting value", id="garbage"),
        pytest.param(
            _valid_entry(key={**KEY, "gpu": "another GPU"}), "another kernel, GPU or software", id="other-key"
        ),
        pytest.param(_valid_entry(version=cache.ENTRY_VERSION + 1), "unknown format version", id="newer-version"),
        pytest.param(_valid_entry(version=None), "unknown format version", id="no-version"),
        pytest.param("[1, 2, 3]", "unknown format version", id="not-an-object"),
        pytest.param(_valid_entry(config={"BLOCK": "1024"}), "not a mapping of integers", id="config-strings"),
        pytest.param(_valid_entry(config=[1024, 4]), "not a mapping of integers", id="config-list"),
    ],
)
def test_unusable_tuning_entry_is_warned_about_and_replaced(tmp_path, text, why):
    path = entry_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.warns(UserWarning, match="ignoring corrupt or foreign cache entry") as record:
        assert read_tuning(tmp_path, KEY) is None
    assert why in str(record[0].message) and str(path) in str(record[0].message)

    write_tuning(tmp_path, KEY, CONFIG, TIMINGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_tuning(tmp_path, KEY)["config"] == CONFIG
    assert json.loads(path.read_text())["key"] == KEY
    assert leftovers(path.parent) == []


def test_writes_leave_no_temporary_files(tmp_path):
    for block in (256, 512, 1024, 2048):
        write_tuning(tmp_path, KEY, {"BLOCK": block, "num_warps": 4}, TIMINGS)
    assert read_tuning(tmp_path, KEY)["config"]["BLOCK"] == 2048
    assert [p.name for p in (tmp_path / "tuning").iterdir()] == [f"{key_digest(KEY)}.json"]


def test_failed_write_keeps_the_old_entry_and_no_temporary_file(tmp_path, monkeypatch):
    write_tuning(tmp_path, KEY, CONFIG, TIMINGS)

    def replace_fails(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "replace", replace_fails)
    with pytest.warns(UserWarning, match="cannot write cache entry"):
        write_tuning(tmp_path, KEY, {"BLOCK": 256, "num_warps": 2}, [])
    monkeypatch.undo()
    assert read_tuning(tmp_path, KEY)["config"] == CONFIG  # never half written
    assert leftovers(tmp_path / "tuning") == []


# ---------------------------------------------------------------------------
# The folder
# ---------------------------------------------------------------------------


def test_cache_dir_is_created_private(tmp_path):
    root = cache_dir(str(tmp_path / "nested" / "autofuser"))
    assert root == tmp_path / "nested" / "autofuser"
    assert root.is_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFUSER_CACHE_DIR", str(tmp_path / "from_env"))
    assert cache_dir() == tmp_path / "from_env"
    assert cache_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"  # an option wins

    monkeypatch.delenv("AUTOFUSER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = cache_dir()
    assert root == tmp_path / "xdg" / "autofuser"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux default; other systems: docs/cache.md")
def test_cache_dir_default_is_the_users_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOFUSER_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = cache_dir()
    assert root == tmp_path / "home" / ".cache" / "autofuser"
    assert root.is_dir() and stat.S_IMODE(root.stat().st_mode) == 0o700


def test_kernel_and_tuning_subfolders_are_private(tmp_path):
    root = cache_dir(str(tmp_path / "c"))
    write_tuning(root, KEY, CONFIG, [])
    load_kernel_module(f"af_private_{uuid.uuid4().hex}", "VALUE = 1\n", root)
    for sub in ("tuning", "kernels"):
        assert stat.S_IMODE((root / sub).stat().st_mode) == 0o700


# ---------------------------------------------------------------------------
# Kernel sources: only the text just generated is ever run
# ---------------------------------------------------------------------------


@pytest.fixture
def kernel_name():
    """A fresh module name; the imported module is dropped afterwards."""
    name = f"af_test_kernel_{uuid.uuid4().hex}"
    yield name
    sys.modules.pop(f"autofuser_kernels.{name}", None)


GENERATED = "VALUE = 42\n\ndef kernel():\n    return VALUE\n"


def tampered_source(marker: Path) -> str:
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nVALUE = 666\n"


def test_tampered_kernel_file_is_rewritten_before_import(tmp_path, kernel_name):
    marker = tmp_path / "tampered_code_ran"
    path = tmp_path / "kernels" / f"{kernel_name}.py"
    path.parent.mkdir(parents=True)
    path.write_text(tampered_source(marker))

    module = load_kernel_module(kernel_name, GENERATED, tmp_path)
    assert not marker.exists()
    assert module.VALUE == 42 and module.kernel() == 42
    assert path.read_text() == GENERATED
    # The module is filed under this process's private copy, never the cache folder's file.
    assert Path(module.__file__).parent == cache.private_kernel_dir()
    assert Path(module.__file__).read_text() == GENERATED
    assert leftovers(path.parent) == []


def test_planted_bytecode_next_to_a_valid_kernel_file_never_runs(tmp_path, kernel_name):
    """The file's bytes match, but Python's loader would prefer a matching
    ``__pycache__`` entry: the checked text must be what runs."""
    marker = tmp_path / "planted_bytecode_ran"
    path = tmp_path / "kernels" / f"{kernel_name}.py"
    path.parent.mkdir(parents=True)
    path.write_text(GENERATED)
    pyc = Path(importlib.util.cache_from_source(str(path)))
    pyc.parent.mkdir()
    st = path.stat()
    header = importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size)
    pyc.write_bytes(header + marshal.dumps(compile(tampered_source(marker), str(path), "exec")))

    module = load_kernel_module(kernel_name, GENERATED, tmp_path)
    assert not marker.exists()
    assert module.VALUE == 42


def test_identical_kernel_file_is_reused(tmp_path, kernel_name):
    first = load_kernel_module(kernel_name, GENERATED, tmp_path)
    path = tmp_path / "kernels" / f"{kernel_name}.py"
    inode = path.stat().st_ino
    sys.modules.pop(f"autofuser_kernels.{kernel_name}")
    second = load_kernel_module(kernel_name, GENERATED, tmp_path)
    assert path.stat().st_ino == inode  # not rewritten (a rewrite renames a new file over it)
    assert second is not first and second.VALUE == 42


def test_a_loaded_kernel_is_not_written_again_for_each_copy_of_a_layer(tmp_path, kernel_name):
    """Repeated layers generate one kernel whose header names each copy's nodes: the
    module loaded for the first copy serves the others, its file written once."""
    first = load_kernel_module(kernel_name, "# nodes: fc1, gelu\n" + GENERATED, tmp_path)
    path = tmp_path / "kernels" / f"{kernel_name}.py"
    inode = path.stat().st_ino
    second = load_kernel_module(kernel_name, "# nodes: fc1_1, gelu_1\n" + GENERATED, tmp_path)
    assert second is first and path.stat().st_ino == inode
    assert path.read_text().startswith("# nodes: fc1, gelu\n")

    # Another cache folder gets its own file; a file removed meanwhile is written again.
    other = load_kernel_module(kernel_name, GENERATED, tmp_path / "other")
    assert (tmp_path / "other" / "kernels" / f"{kernel_name}.py").read_text() == GENERATED
    assert other is first  # the module itself is the one this process imported
    path.unlink()
    load_kernel_module(kernel_name, GENERATED, tmp_path)
    assert path.read_text() == GENERATED


# ---------------------------------------------------------------------------
# Tuning across processes
# ---------------------------------------------------------------------------

# Tuning needs a GPU; here it runs on the interpreter with a CPU timer, which is
# all the cache logic needs (what was tuned, what was stored, what was reused).
TUNING_SCRIPT = textwrap.dedent("""
    import json, time
    import torch
    import torch.nn.functional as F
    import autofuser
    from autofuser_core import timing

    class CpuTimer(timing.Timer):
        def bench(self, fn, *args, rep_ms=20):
            start = time.perf_counter()
            for _ in range(2):
                fn(*args)
            return (time.perf_counter() - start) / 2 * 1e3

        def can_tune(self, device, options):
            return options.tune

    timer = CpuTimer()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(37)

        def forward(self, x, y):
            h = torch.sigmoid(x * 2 + y).transpose(1, 2)  # the transpose splits two groups
            return self.ln(F.gelu(h) + 1)

    torch.manual_seed(0)
    model = Model().eval()  # an inference forward, which may replay as a CUDA graph
    x, y = torch.randn(3, 37, 5), torch.randn(37, 5)
    with torch.no_grad(), timing.using(timer):
        fused = autofuser.fuse(model, progress=False, tune_budget_s=1.0)
        got, expected = fused(x, y), model(x, y)
    report = fused.report()
    print(json.dumps({"close": torch.allclose(got, expected, atol=1e-5, rtol=1e-4),
                      "groups": [g.model_dump() for g in report.groups]}))
""")


def run_tuning_process(script: Path, cache_root: Path) -> tuple[dict, str]:
    env = {
        **os.environ,
        "AUTOFUSER_CACHE_DIR": str(cache_root),
        "TRITON_INTERPRET": "1",
        "AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["close"]
    return result, done.stderr


def tuning_files(cache_root: Path) -> dict[str, Path]:
    """Kernel name -> its tuning file."""
    files = {}
    for path in (cache_root / "tuning").glob("*.json"):
        files[json.loads(path.read_text())["key"]["kernel"]] = path
    return files


def test_second_process_retunes_nothing_and_a_corrupt_entry_is_retuned(tmp_path):
    script = tmp_path / "tune_once.py"
    script.write_text(TUNING_SCRIPT)
    cache_root = tmp_path / "cache"

    first, _ = run_tuning_process(script, cache_root)
    groups = first["groups"]
    assert [(g["strategy"], g["fused"]) for g in groups] == [("elementwise", True), ("row_reduction", True)]
    assert all(not g["cache_hit"] and g["tuning_s"] > 0 for g in groups)
    files = tuning_files(cache_root)
    assert set(files) == {g["kernel"] for g in groups}
    for g in groups:
        stored = json.loads(files[g["kernel"]].read_text())
        assert stored["config"] == g["config"] and stored["timings"]
        assert stored["key"]["gpu"] == "interpreter"

    second, _ = run_tuning_process(script, cache_root)
    assert [g["kernel"] for g in second["groups"]] == [g["kernel"] for g in groups]
    assert all(g["cache_hit"] and g["tuning_s"] == 0 for g in second["groups"])
    assert [g["config"] for g in second["groups"]] == [g["config"] for g in groups]

    corrupted = files[groups[1]["kernel"]]
    corrupted.write_text(corrupted.read_text()[:40])
    third, stderr = run_tuning_process(script, cache_root)
    assert "ignoring corrupt or foreign cache entry" in stderr and corrupted.name in stderr
    assert [g["cache_hit"] for g in third["groups"]] == [True, False]
    assert third["groups"][1]["tuning_s"] > 0
    assert json.loads(corrupted.read_text())["config"] == third["groups"][1]["config"]
    assert leftovers(cache_root / "tuning") == []


def test_a_warm_cache_reuses_the_fused_vs_eager_verdict(tmp_path):
    """The speed check's timings are stored with the tuning result; a second
    process neither tunes nor times again, and reaches the same verdicts."""
    script = tmp_path / "time_once.py"
    script.write_text(
        TUNING_SCRIPT.replace(
            "timer = CpuTimer()", "timer = CpuTimer()\ntimer.can_time = lambda device, options: options.verify_speed"
        )
    )
    cache_root = tmp_path / "cache"
    first, _ = run_tuning_process(script, cache_root)
    timed = [g for g in first["groups"] if g["time_fused_ms"] is not None]
    assert timed and all(g["time_eager_ms"] > 0 for g in timed)
    stored = {k: json.loads(p.read_text()) for k, p in tuning_files(cache_root).items()}
    # Timed launched (a CPU tensor can't be captured as a CUDA graph), and said so.
    launched = [{"fused_ms": g["time_fused_ms"], "eager_ms": g["time_eager_ms"], "graph_refused": True} for g in timed]
    assert [stored[g["kernel"]]["speed"] for g in timed] == launched
    second, _ = run_tuning_process(script, cache_root)
    again = {g["kernel"]: g for g in second["groups"]}
    for g in timed:
        assert again[g["kernel"]]["cache_hit"]
        assert (again[g["kernel"]]["time_fused_ms"], again[g["kernel"]]["time_eager_ms"]) == (
            g["time_fused_ms"],
            g["time_eager_ms"],
        )
        assert (again[g["kernel"]]["fused"], again[g["kernel"]]["reason_code"]) == (g["fused"], g["reason_code"])


def _fake_forward_times(use_timer, fused_ms, eager_ms: float):
    """Whole-forward timing on any device, by a stand-in timer: the fused forward (a
    GraphModule) takes ``fused_ms()`` ms, the original ``eager_ms``. Returns the list
    of timed callables, a small model and an input."""
    timer = use_timer(
        StandInTimer(tune=False, forward=lambda fn: fused_ms() if isinstance(fn, torch.fx.GraphModule) else eager_ms)
    )
    model = torch.nn.Sequential(torch.nn.LayerNorm(19), torch.nn.GELU()).eval()
    return timer.forwards, model, torch.randn(3, 7, 19)


def test_whole_forward_timings_are_cached_and_a_corrupt_entry_is_retimed(tmp_path, use_timer):
    """A warm cache decides fused-vs-original without timing the forward again."""
    from autofuser_core.fuse import FORWARD_ROUNDS

    calls, model, x = _fake_forward_times(use_timer, lambda: 1.0, 1.1)  # too close to stop after one round
    with torch.no_grad():
        first = autofuser.fuse(model, cache_dir=str(tmp_path), cuda_graphs=False, progress=False)
        torch.testing.assert_close(first(x), model(x))
        rounds = 2 * FORWARD_ROUNDS + 1  # eager and fused alternate, after one eager call
        assert len(calls) == rounds and "forward: 1.000 ms fused vs 1.100 ms eager" in first.report().notes
        second = autofuser.fuse(model, cache_dir=str(tmp_path), cuda_graphs=False, progress=False)
        torch.testing.assert_close(second(x), model(x))
        assert len(calls) == rounds, "a warm cache must not time the forward again"
        assert any("read from the cache" in n for n in second.report().notes)
        (entry,) = (tmp_path / "verdicts").glob("*.json")
        entry.write_text('{"version": 1, "key": {}, "times": {"eager_ms": -1}}')
        third = autofuser.fuse(model, cache_dir=str(tmp_path), cuda_graphs=False, progress=False)
        with pytest.warns(UserWarning, match="corrupt or foreign cache entry"):
            torch.testing.assert_close(third(x), model(x))
        assert len(calls) == 2 * rounds


def test_a_clear_win_is_decided_in_one_round(tmp_path, use_timer):
    """A fused forward more than ``CLEAR_GAP`` ahead after the first round is not timed again."""
    from autofuser_core.fuse import CLEAR_GAP

    calls, model, x = _fake_forward_times(use_timer, lambda: 1.0, 1.0 / (1.0 - CLEAR_GAP) + 0.01)
    with torch.no_grad():
        fused = autofuser.fuse(model, cache_dir=str(tmp_path), cuda_graphs=False, progress=False)
        torch.testing.assert_close(fused(x), model(x))
    assert len(calls) == 3 and any(n.startswith("forward: 1.000 ms fused") for n in fused.report().notes)


@pytest.mark.parametrize(
    "fused_ms, eager_ms, timed", [(30.0, 61.0, 2), (10.0, 61.0, 2), (30.0, 50.0, 3), (12.0, 24.9, 3)]
)
def test_a_long_eager_forward_far_behind_the_fused_one_is_called_once(tmp_path, use_timer, fused_ms, eager_ms, timed):
    """An eager call over FORWARD_BUDGET_MS that the fused forward beats by more than
    WIDE_GAP decides the check; closer, or shorter, the rounds run as for any forward."""
    from autofuser_core.fuse import FORWARD_BUDGET_MS, WIDE_GAP

    wide = eager_ms > FORWARD_BUDGET_MS and fused_ms < eager_ms * (1 - WIDE_GAP)
    assert wide == (timed == 2)
    calls, model, x = _fake_forward_times(use_timer, lambda: fused_ms, eager_ms)
    with torch.no_grad():
        fused = autofuser.fuse(model, cache_dir=str(tmp_path), cuda_graphs=False, progress=False)
        torch.testing.assert_close(fused(x), model(x))
    # The fused median and one eager call; then, not past the wide gap (all are past CLEAR_GAP),
    # the eager median.
    assert len(calls) == timed, calls
    assert f"forward: {fused_ms:.3f} ms fused vs {eager_ms:.3f} ms eager" in fused.report().notes


class _QueuedIn(StandInTimer):
    """One call of a forward that the host queues in ``queued_ms`` of its ``total_ms``."""

    def __init__(self, queued_ms: float, total_ms: float):
        super().__init__()
        self.queued_ms, self.total_ms = queued_ms, total_ms

    def forward_once_ms(self, fn, args) -> tuple[float, float]:
        return self.queued_ms, self.total_ms


def test_a_gpu_bound_forward_is_not_tried_as_a_cuda_graph():
    """A long forward that the host queues in a fraction of its time: its launches hide
    behind the GPU's work, so there is nothing for a graph replay to save. A launch-bound
    one (the host busy most of the time) and a short one are tried."""
    import autofuser_core.fuse as fuse_module

    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    x = torch.randn(2, 4)
    long_ms = fuse_module.FORWARD_BUDGET_MS + 5.0
    share = fuse_module.HOST_SHARE_GPU_BOUND
    cases = [
        ((0.1 * long_ms, long_ms), True),  # queued in a tenth of its time
        ((0.9 * long_ms, long_ms), False),  # the host launching all along
        ((0.1, fuse_module.FORWARD_BUDGET_MS - 1.0), False),
    ]  # short: a graph may pay
    for (queued, total), bound in cases:
        assert (queued < share * total and total > fuse_module.FORWARD_BUDGET_MS) == bound
        why = fuse_module._gpu_bound(_QueuedIn(queued, total), gm, (x,))
        assert (why is not None) == bound, why
        if bound:
            assert f"in {queued:.1f} of its {total:.1f} ms" in why


def test_a_fused_forward_within_the_margin_of_eager_leaves_the_original_running(tmp_path, use_timer):
    """Timing noise must not decide: a fused forward only 1% faster than eager is not kept,
    and the best of the alternating rounds counts, not the slower round (their spread, 0.5%,
    leaves the 1% lead clearly short of the 2% margin: no second measurement)."""
    fused_times = itertools.chain([0.995], itertools.repeat(0.99))  # a slower first round, then 1% ahead of eager
    _, model, x = _fake_forward_times(use_timer, lambda: next(fused_times), 1.0)
    with torch.no_grad():
        fused = autofuser.fuse(model, cache_dir=str(tmp_path), cuda_graphs=False, progress=False)
        torch.testing.assert_close(fused(x), model(x))
    notes = " ".join(fused.report().notes)
    assert "was not at least 2% faster than the original (1.000 ms)" in notes and "(0.990 ms)" in notes, notes
    assert fused._compiled[next(iter(fused._compiled))][0] is None  # the original model runs


# ---------------------------------------------------------------------------
# Faults: a process killed while tuning, a folder that can't be written
# ---------------------------------------------------------------------------

# The tuning script, stopped for good at one point while it tunes its first kernel:
# in the timer (holding the entry's lock), or inside the write (the entry's
# temporary file complete, the rename not yet done).
STOP_POINTS = {
    "while-tuning": ("timer.bench", "lambda fn, *args, **kwargs: stop()"),
    "while-writing": (
        "cache.os.replace",
        "lambda src, dst, replace=os.replace: stop() if str(dst).endswith('.json') else replace(src, dst)",
    ),
}


def stopping_script(where: str, marker: Path) -> str:
    target, replacement = STOP_POINTS[where]
    return TUNING_SCRIPT.replace(
        "from autofuser_core import timing",
        textwrap.dedent(f"""
        import os
        from autofuser_core import cache, timing

        def stop():
            open({str(marker)!r}, "w").close()
            time.sleep(600)
    """),
    ).replace("timer = CpuTimer()", f"timer = CpuTimer()\n{target} = {replacement}")


@pytest.mark.skipif(sys.platform == "win32", reason="entry locks use POSIX flock")
@pytest.mark.parametrize("where", list(STOP_POINTS))
def test_a_process_killed_while_tuning_leaves_nothing_a_later_run_trusts(tmp_path, where):
    marker, cache_root = tmp_path / "stopped", tmp_path / "cache"
    script = tmp_path / "stops.py"
    script.write_text(stopping_script(where, marker))
    env = {
        **os.environ,
        "AUTOFUSER_CACHE_DIR": str(cache_root),
        "TRITON_INTERPRET": "1",
        "AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    victim = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert victim.poll() is None, victim.communicate()[1].decode()
            assert time.monotonic() < deadline, "the tuning process never reached its stop point"
            time.sleep(0.05)
        (lock,) = (cache_root / "tuning").glob("*.lock")
        assert not lock_is_free(lock)  # it is tuning, and holds the entry's lock
    finally:
        victim.kill()
        victim.communicate()
    assert lock_is_free(lock)  # the system dropped the dead process's lock
    assert list((cache_root / "tuning").glob("*.json")) == []  # no entry, whole or half
    stray = leftovers(cache_root / "tuning")
    assert len(stray) == (1 if where == "while-writing" else 0)
    for name in stray:  # as if it died a while ago
        os.utime(cache_root / "tuning" / name, (time.time() - 3600, time.time() - 3600))

    script.write_text(TUNING_SCRIPT)
    later, _ = run_tuning_process(script, cache_root)
    assert all(not g["cache_hit"] and g["tuning_s"] > 0 for g in later["groups"])  # tuned again
    assert set(tuning_files(cache_root)) == {g["kernel"] for g in later["groups"]}
    assert leftovers(cache_root / "tuning") == []  # the dead writer's temporary file is cleaned up


@pytest.fixture
def gpu_tuning(stand_in_timer):
    """Tuning as on a GPU, with a stand-in timer; returns the list of timed launches."""
    return stand_in_timer.timed


def fuse_norm_gelu(root: Path, x: torch.Tensor):
    """Fuse and run ``NormGelu`` with cache folder ``root``: (report, output, eager output)."""
    torch.manual_seed(0)
    model = NormGelu()
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, cache_dir=str(root))
        got = fused(x)
        return fused.report(), got, model(x)


def test_a_kernels_tuning_configs_are_worked_out_once(tmp_path, gpu_tuning, monkeypatch):
    """Compiling ahead and tuning time the same list: it is built once per kernel, not twice."""
    import autofuser_core.tuning as tuning_module

    built = []
    real = tuning_module._tuning_configs

    def counting(candidate, every=False):
        built.append(candidate)
        return real(candidate, every)

    monkeypatch.setattr(tuning_module, "_tuning_configs", counting)
    report, got, expected = fuse_norm_gelu(tmp_path, torch.randn(3, 5, 37))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    tuned = [g for g in report.fused if not g.cache_hit]
    assert tuned and gpu_tuning, str(report)
    assert len(built) == len({g.kernel for g in tuned}), (len(built), [g.kernel for g in tuned])


def unwritable_folder(kind: str, root: Path, monkeypatch) -> None:
    """Make ``root`` refuse writes: for real (chmod), or a write that fails as a
    read-only file system or a full disk would."""
    root.mkdir(parents=True)
    if kind == "chmod":
        root.chmod(0o500)
        return
    code = errno.EROFS if kind == "read-only" else errno.ENOSPC
    write = cache.atomic_write

    def failing(path, text):
        if Path(path).is_relative_to(root):
            raise OSError(code, os.strerror(code), str(path))
        write(path, text)

    monkeypatch.setattr(cache, "atomic_write", failing)


@pytest.mark.parametrize(
    "kind",
    [
        "read-only",
        "full-disk",
        pytest.param(
            "chmod",
            marks=pytest.mark.skipif(
                not hasattr(os, "geteuid") or os.geteuid() == 0,
                reason="as root, chmod doesn't stop writes (simulated above)",
            ),
        ),
    ],
)
def test_an_unwritable_cache_folder_means_tuning_in_memory_with_one_warning(tmp_path, monkeypatch, gpu_tuning, kind):
    root = tmp_path / "cache"
    unwritable_folder(kind, root, monkeypatch)
    x = torch.randn(3, 5, 37)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report, got, expected = fuse_norm_gelu(root, x)
            messages = [str(w.message) for w in caught if "AutoFuser" in str(w.message)]
            assert len(messages) == 1 and "cannot write to the cache folder" in messages[0], messages
            assert str(root) in messages[0] and "in memory" in messages[0]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
            assert report.fused and all(not g.cache_hit and g.tuning_s > 0 for g in report.fused)
            timed_once = len(gpu_tuning)
            assert timed_once > 0

            # A second compilation in this process reuses what was tuned, without a new warning.
            again, got, expected = fuse_norm_gelu(root, x)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
            assert [g.config for g in again.fused] == [g.config for g in report.fused]
            assert all(g.cache_hit for g in again.fused) and len(gpu_tuning) == timed_once
            assert len([w for w in caught if "AutoFuser" in str(w.message)]) == 1
    finally:
        root.chmod(0o700)
    assert list(root.glob("tuning/*.json")) == [] and list(root.glob("kernels/*.py")) == []


# ---------------------------------------------------------------------------
# Shipping a cache to other machines
# ---------------------------------------------------------------------------


def test_a_shipped_cache_is_used_on_the_same_gpu_and_versions_and_ignored_elsewhere(tmp_path, monkeypatch, gpu_tuning):
    import autofuser_core.tuning as tuning_module

    machine = {"gpu": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0", "triton": "3.6.0"}
    monkeypatch.setattr(tuning_module, "device_key", lambda device: dict(machine))
    x = torch.randn(2, 5, 37)
    built = tmp_path / "built"
    tuned, _, _ = fuse_norm_gelu(built, x)
    assert tuned.fused and all(not g.cache_hit for g in tuned.fused)
    entries = {p.name: json.loads(p.read_text()) for p in (built / "tuning").glob("*.json")}
    assert len(entries) == len(tuned.fused)
    for entry in entries.values():
        assert {k: entry["key"][k] for k in machine} == machine

    shipped = tmp_path / "shipped"
    shutil.copytree(built, shipped)
    timed = len(gpu_tuning)
    with monkeypatch.context() as read_only, warnings.catch_warnings():
        # The same GPU and versions: every kernel is served without writing anything.
        def refuse(original):
            def call(path, *args, **kwargs):
                if Path(path).is_relative_to(shipped):
                    pytest.fail(f"wrote to {path}")
                return original(path, *args, **kwargs)

            return call

        def refuse_writes(original):
            def call(path, flags, *args, **kwargs):
                if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and Path(path).is_relative_to(shipped):
                    pytest.fail(f"opened {path} for writing")
                return original(path, flags, *args, **kwargs)

            return call

        read_only.setattr(cache, "atomic_write", refuse(cache.atomic_write))
        read_only.setattr(cache.os, "open", refuse_writes(os.open))  # the entry lock (entries are read)
        warnings.simplefilter("error")
        same, got, expected = fuse_norm_gelu(shipped, x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert all(g.cache_hit for g in same.fused) and len(gpu_tuning) == timed
    assert [g.config for g in same.fused] == [g.config for g in tuned.fused]

    for field, other in [
        ("gpu", "NVIDIA A100-SXM4-80GB"),
        ("capability", "8.0"),
        ("torch", "2.12.0"),
        ("triton", "3.7.0"),
    ]:
        monkeypatch.setattr(tuning_module, "device_key", lambda device: {**machine, field: other})
        elsewhere, got, expected = fuse_norm_gelu(shipped, x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        assert all(not g.cache_hit and g.tuning_s > 0 for g in elsewhere.fused), field
    for name, entry in entries.items():  # the shipped entries are left as they were
        assert json.loads((shipped / "tuning" / name).read_text()) == entry


def test_a_cached_config_the_strategy_now_refuses_is_tuned_again(tmp_path, gpu_tuning, caplog):
    """A validity rule added after an entry was written (a config found to fault on some GPU)
    applies to cached configs too: such an entry is a miss, tuned again and replaced."""
    x = torch.randn(2, 5, 37)
    first, _, _ = fuse_norm_gelu(tmp_path, x)
    rows = [p for p in (tmp_path / "tuning").glob("*.json") if "BLOCK_M" in json.loads(p.read_text())["config"]]
    assert len(rows) == 1 and len(first.fused) > 1
    entry = json.loads(rows[0].read_text())
    entry["config"] = {**entry["config"], "BLOCK_M": 1 << 20}  # a tile far past the strategy's limit
    rows[0].write_text(json.dumps(entry))
    with caplog.at_level("WARNING", logger="autofuser"):
        second, got, expected = fuse_norm_gelu(tmp_path, x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert "is no longer valid" in caplog.text and "exceeds" in caplog.text, caplog.text
    retuned = [g for g in second.fused if "BLOCK_M" in g.config]
    assert len(retuned) == 1 and not retuned[0].cache_hit and retuned[0].config["BLOCK_M"] < 1 << 20
    assert all(g.cache_hit for g in second.fused if "BLOCK_M" not in g.config)
    assert json.loads(rows[0].read_text())["config"]["BLOCK_M"] < 1 << 20  # the entry was replaced


#: A script without a ``__main__`` guard that writes two kernel files into argv[1] and
#: compiles their configs ahead for sm_90 (no GPU is needed to compile), then checks that
#: Triton's own launch path finds every one of them in its cache.
COMPILE_SCRIPT = r"""
import contextlib, io, os, sys, time
from pathlib import Path
print("top level ran", flush=True)  # as in many training scripts: no __main__ guard
os.environ.pop("TRITON_INTERPRET", None)
os.environ["AUTOFUSER_COMPILE_WORKERS"] = "3"
folder = Path(sys.argv[1])
os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
import torch
from triton.backends.compiler import GPUTarget
from autofuser_core import precompile
from autofuser_core.cache import module_from_source
precompile.STALL_S = int(os.environ.get("STALL_S", "20"))  # a stuck child is given up on sooner than in real use

KERNEL = ("import triton\nimport triton.language as tl\n{extra}\n\n@triton.jit\n"
          "def {name}(x, y, BLOCK: tl.constexpr):\n    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
          "    tl.store(y + i, tl.exp(tl.load(x + i)) * {scale})\n")
# The print stands for compiler chatter, which must not reach the user's output.
good = folder / "good.py"
good.write_text(KERNEL.format(name="k", extra="print('chatter', flush=True)", scale=2))
bad = folder / "bad.py"
bad.write_text(KERNEL.format(name="b", extra=sys.argv[2], scale=3))

def job(path, name, blocks):
    return precompile.CompileJob(str(path), name, ("float32", "float32"), tuple(
        precompile.launch_items({"BLOCK": b, "num_warps": 4}) for b in blocks))

def entries():
    root = folder / "triton"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []

if os.environ.get("HOLD_FDS"):  # a process with many files open: the answer pipe's descriptor is past 1023
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
target = GPUTarget("cuda", 90, 32)
said = []
start = time.monotonic()
compiling = precompile.start([job(good, "k", (64, 128, 256, 512)), job(bad, "b", (64,))], said.append,
                             target=target)
compiling.wait_for("k", precompile.launch_items({"BLOCK": 64, "num_warps": 4}))  # one config
print("one config waited for", compiling.left_launch[("k", precompile.launch_items({"BLOCK": 64, "num_warps": 4}))],
      "left", flush=True)
compiling.wait_for("k")  # the first kernel's configs are done before the children finish
print("first kernel waited for", compiling.left["k"], "left", flush=True)
compiled = compiling.finish()
print("compiled", compiled, "answered", precompile.last_answered, "in", round(time.monotonic() - start), "s",
      flush=True)
print("said", said[0], flush=True)
print("slowest", sorted(precompile.last_slowest), flush=True)
before = entries()
precompile.use_target(target)
with contextlib.redirect_stdout(io.StringIO()):  # this process's own import prints the chatter
    module = module_from_source("autofuser_kernels.k", good.read_text(), good)
for block in (64, 128, 256, 512):
    module.k.warmup(torch.float32, torch.float32, grid=(1,), BLOCK=block, num_warps=4)
print("launch path compiled anew", len(set(entries()) - set(before)), flush=True)
module.k.warmup(torch.float32, torch.float32, grid=(1,), BLOCK=32, num_warps=4)
print("a new config compiled anew", len(set(entries()) - set(before)), flush=True)
"""


def _run_compile_script(tmp_path, bad_kernel_line: str, **extra_env: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(COMPILE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | extra_env
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), bad_kernel_line],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_configs_compiled_ahead_are_what_a_launch_finds(tmp_path):
    """Forked children compile every config for the given target into Triton's cache
    under the key Triton's own launch path computes: launching those configs compiles
    nothing more. A config a child can't compile is answered, not waited for; the user's
    script runs once, and what the compiler prints stays out of its output."""
    out = _run_compile_script(tmp_path, "raise ImportError('this kernel file is broken')")
    assert out.count("top level ran") == 1 and "chatter" not in out, out
    assert "compiled 4 answered 5" in out and "first kernel waited for 0 left" in out, out
    assert "one config waited for 0 left" in out, out
    assert "said compiling 5 config(s) of 2 kernel(s) in 3 child process(es)" in out, out
    assert "slowest ['compile', 'setup']" in out, out
    assert "launch path compiled anew 0" in out, out
    assert "a new config compiled anew 1" in out, out  # the check above can see a compile


def test_a_child_that_dies_is_not_waited_for(tmp_path):
    """A child killed while compiling (here: by the kernel file it imports) leaves its
    config uncompiled; the others finish, and the call returns."""
    out = _run_compile_script(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    counts = out.split("compiled ", 1)[1].split()
    answered, waited = int(counts[2]), int(counts[4])
    assert answered < 5, out  # the killed child never answered for its task
    assert waited < 20, out  # its death was noticed, not sat out until STALL_S


def test_compiling_ahead_works_with_more_than_1023_files_open(tmp_path):
    """``select`` refuses descriptors past 1023; a training process often holds that many."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] not in range(0, 2048):
        out = _run_compile_script(tmp_path, "raise ImportError('this kernel file is broken')", HOLD_FDS="1")
        assert "compiled 4 answered 5" in out and "launch path compiled anew 0" in out, out
    else:
        pytest.skip("this machine allows fewer than 2048 open files")


def test_a_stuck_child_is_stopped(tmp_path):
    """A child that stops answering (here: stuck importing its kernel file) is killed after
    ``STALL_S`` seconds without answers; the others' configs are compiled and found."""
    start = time.monotonic()
    # 10 s, not the others' 20: this test sits the whole stall out, and the good children's
    # answers come in a second or two each.
    out = _run_compile_script(tmp_path, "import time; time.sleep(600)", STALL_S="10")
    assert time.monotonic() - start < 200, out
    waited = int(out.split(" s\n", 1)[0].rsplit(" ", 1)[1])
    assert 10 <= waited < 100, out  # given up on after STALL_S, not after the sleep
    # The stuck child's summary never came (what it compiled first is not counted), but
    # every good config is in the cache all the same.
    assert "launch path compiled anew 0" in out, out


def test_compile_children_are_as_many_as_there_are_configs(monkeypatch):
    """No more children than configs, at most ``workers()``; none without a target or tasks."""
    from autofuser_core import precompile

    forked = []
    monkeypatch.setattr(precompile, "_enabled", lambda: True)
    monkeypatch.setenv("AUTOFUSER_COMPILE_WORKERS", "8")
    monkeypatch.setattr(precompile.Compiling, "finish", lambda self: self._close() or len(self.children))
    monkeypatch.setattr(precompile.os, "fork", lambda: forked.append(1) or 12345)

    def job(name: str, configs: int):
        return precompile.CompileJob(
            "k.py", name, ("float32",), tuple(precompile.launch_items({"BLOCK": 16 << b}) for b in range(configs))
        )

    assert precompile.precompile([], lambda m: None, target="sm90") == 0 and forked == []
    monkeypatch.setattr(precompile, "current_target", lambda: None)
    assert precompile.precompile([job("a", 3)], lambda m: None) == 0 and forked == []
    assert precompile.precompile([job("a", 3)], lambda m: None, target="sm90") == 3 and len(forked) == 3
    forked.clear()
    compiling = precompile.start([job(n, 5) for n in "abcd"], lambda m: None, target="sm90")
    assert len(forked) == 8 and compiling.left == {n: 5 for n in "abcd"}
    compiling._close()


# ---------------------------------------------------------------------------
# Configs compile ahead only where there is something to compile
# ---------------------------------------------------------------------------


def test_a_warm_cache_compiles_nothing_ahead(tmp_path, monkeypatch, gpu_tuning):
    """Every kernel of a cold cache is handed over to compile ahead; on a cache that holds
    every kernel this model needs, none; with new shapes, only the new kernels."""
    import autofuser_core.tuning as tuning_module

    asked = []
    monkeypatch.setattr(tuning_module, "start_compiling", lambda jobs, progress: asked.append(jobs) or None)

    cold, _, _ = fuse_norm_gelu(tmp_path, torch.randn(2, 5, 37))
    assert len(asked) == 1 and len(asked[0]) == len(cold.fused) > 1
    asked.clear()

    warm, got, expected = fuse_norm_gelu(tmp_path, torch.randn(2, 5, 37))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert all(g.cache_hit for g in warm.fused)
    assert asked == [[]]
    asked.clear()

    other, _, _ = fuse_norm_gelu(tmp_path, torch.randn(3, 7, 37))  # other shapes: other kernels
    assert len(asked) == 1 and len(asked[0]) == len(other.fused)


class RepeatedBlocks(torch.nn.Module):
    """Three copies of one pointwise block, kept apart by in-place ops: one kernel, three groups."""

    def forward(self, x):
        for _ in range(3):
            x = torch.nn.functional.gelu(x * 2 + 1)
            x.mul_(0.5)
        return x


def test_a_warm_compile_reads_each_tuning_entry_once_per_group(tmp_path, monkeypatch, gpu_tuning):
    """Repeated layers share one kernel and one entry: deciding what to compile reads it
    once, and each group reads it when it picks its config."""
    import autofuser_core.tuning as tuning_module

    x = torch.randn(4, 33)
    for _ in range(2):
        reads = []
        monkeypatch.setattr(
            tuning_module, "read_tuning", lambda root, key: reads.append(key["kernel"]) or cache.read_tuning(root, key)
        )
        with torch.no_grad():
            fused = autofuser.fuse(RepeatedBlocks(), progress=False, cache_dir=str(tmp_path))
            torch.testing.assert_close(fused(x.clone()), RepeatedBlocks()(x.clone()))
    groups = fused.report().fused
    assert len(groups) == 3 and len({g.kernel for g in groups}) == 1 and all(g.cache_hit for g in groups)
    assert reads == [groups[0].kernel] * 4


def test_a_failed_compile_stops_its_compile_children(tmp_path, monkeypatch, gpu_tuning):
    """An error (or Ctrl-C) while the kernels are checked stops the children at once
    instead of waiting for configs nobody will time."""
    import autofuser_core.tuning as tuning_module
    import autofuser_core.verify as verify_module

    calls = []

    class FakeCompiling:
        launches, waited_s = [], 0.0

        def wait_for(self, name, launch=None):
            calls.append("wait")

        def abort(self):
            calls.append("abort")

        def finish(self):
            calls.append("finish")
            return 0

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tuning_module, "start_compiling", lambda jobs, progress: FakeCompiling())
    monkeypatch.setattr(verify_module.Verifier, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fuse_norm_gelu(tmp_path, torch.randn(2, 5, 37))
    assert calls == ["abort", "finish"]


def test_each_config_is_timed_once_it_is_compiled_ahead(tmp_path, monkeypatch, gpu_tuning):
    """Tuning waits for each config it times, by its launch arguments, not for the whole
    kernel; the waits count as compiling, not as tuning."""
    import autofuser_core.tuning as tuning_module
    from autofuser_core import precompile

    waits = []

    class SlowCompiling(precompile.Compiling):
        def wait_for(self, name, launch=None):
            waits.append((name, launch))
            time.sleep(0.05)
            self.waited_s += 0.05

    monkeypatch.setattr(tuning_module, "start_compiling", lambda jobs, progress: SlowCompiling([], progress))
    report, got, expected = fuse_norm_gelu(tmp_path, torch.randn(2, 5, 37))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    kernels = {name for name, _ in waits}
    assert kernels >= {g.kernel for g in report.fused} and len(waits) > len(kernels)  # config by config
    assert all(launch is not None and dict(launch).get("num_warps") for _, launch in waits)
    assert len(set(waits)) == len(waits)  # each config waited for once
    assert report.phases["parallel_compile"] >= 0.05 * len(waits) - 1e-6
    assert all(g.tuning_s < 0.05 * len(waits) for g in report.fused)


@pytest.mark.parametrize(
    "speed, valid",
    [
        ({"fused_ms": 1.5, "eager_ms": 2.0}, True),
        ({"graph_fused_ms": 0.5, "graph_eager_ms": 2.0}, True),
        ({"fused_ms": 1.5, "eager_ms": 2.0, "graph_fused_ms": 0.5, "graph_eager_ms": 2.0}, True),
        ({"graph_fused_ms": 0.5}, False),  # half a pair
        ({"fused_ms": 1.5, "eager_ms": 2.0, "graph_fused_ms": 0.5}, False),
        ({"fused_ms": 1.5, "eager_ms": True}, False),
        ({"fused_ms": 1.5, "eager_ms": float("inf")}, False),
        ({"fused_ms": -1.0, "eager_ms": 2.0}, False),
        ({"fused_ms": 1.5, "eager_ms": 2.0, "other": 1.0}, False),
        ({"fused_ms": 1.5, "eager_ms": 2.0, "graph_refused": True}, True),
        ({"fused_ms": 1.5, "eager_ms": 2.0, "graph_refused": 1.0}, False),
        ({"fused_ms": 1.5, "eager_ms": 2.0, "graph_refused": False}, False),
        ({"graph_fused_ms": 0.5, "graph_eager_ms": 2.0, "graph_refused": True}, False),
        ([1.5, 2.0], False),
    ],
)
def test_a_tuning_entrys_fused_vs_eager_times_are_checked_before_use(speed, valid):
    """The cache folder is untrusted: a tuning entry's times are whole pairs of positive,
    finite milliseconds, launched, as CUDA graphs, or both; anything else is refused as
    corrupt (and timed again)."""
    from autofuser_core.cache import CacheError, _check_tuning

    entry = {"config": {"BLOCK": 64}, "timings": [], "speed": speed}
    if valid:
        _check_tuning(entry)
    else:
        with pytest.raises(CacheError, match="fused-vs-eager timing is malformed"):
            _check_tuning(entry)


def test_cached_group_times_are_used_as_the_compile_times_them():
    """Where a compile times groups as CUDA graphs, a cached pair timed as graphs is used,
    or the launched pair where capturing was tried and failed; a launched pair from a
    compile without graphs is timed again as graphs. Without graphs, only the launched
    pair. A new measurement adds its pair beside the other."""
    from autofuser_core.compile import cached_speed, speed_record

    launched = speed_record(None, (1.5, 2.0, False), graphs=False)
    assert launched == {"fused_ms": 1.5, "eager_ms": 2.0}
    assert cached_speed(launched, graphs=True) is None  # never tried as graphs: capture now
    assert cached_speed(launched, graphs=False) == (1.5, 2.0, False)
    refused = speed_record(None, (1.5, 2.0, False), graphs=True)
    assert refused == {"fused_ms": 1.5, "eager_ms": 2.0, "graph_refused": True}
    assert cached_speed(refused, graphs=True) == (1.5, 2.0, False)
    both = speed_record(launched, (0.5, 1.9, True), graphs=True)
    assert both == {"fused_ms": 1.5, "eager_ms": 2.0, "graph_fused_ms": 0.5, "graph_eager_ms": 1.9}
    assert cached_speed(both, graphs=True) == (0.5, 1.9, True)
    assert cached_speed(both, graphs=False) == (1.5, 2.0, False)
    graph_only = speed_record(None, (0.5, 1.9, True), graphs=True)
    assert cached_speed(graph_only, graphs=False) is None  # never timed launched: time it now
    assert cached_speed(None, graphs=True) is None
