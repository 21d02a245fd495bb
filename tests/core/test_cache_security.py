"""The cache as an attack surface (``autofuser_core.cache``, docs/cache.md): what runs
is only the text just generated, folders other users can write are not used, and
links, FIFOs and oversized files inside the cache are never followed or read."""

from __future__ import annotations

import contextvars
import errno
import inspect
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import autofuser
from autofuser_core import cache
from autofuser_core.cache import key_digest, load_kernel_module, read_tuning, read_verdict, tuning_lock, write_tuning

from _helpers import NormGelu, lock_is_free

posix_only = pytest.mark.skipif(os.name != "posix", reason="owners, modes, FIFOs and O_NOFOLLOW are POSIX")

KEY = {
    "kernel": "af_flat_mul_add_0123456789",
    "source_sha256": "cd" * 32,
    "torch": "2.13.0",
    "triton": "3.9.0",
    "gpu": "NVIDIA H200",
    "capability": "9.0",
}
CONFIG = {"BLOCK": 1024, "num_warps": 4}


def valid_entry(key=KEY, config=CONFIG) -> str:
    return json.dumps({"version": cache.ENTRY_VERSION, "key": key, "config": config, "timings": []})


@pytest.fixture
def kernel_name():
    """A fresh module name; the imported module is dropped afterwards."""
    name = f"af_secure_kernel_{uuid.uuid4().hex}"
    yield name
    sys.modules.pop(f"autofuser_kernels.{name}", None)


# ---------------------------------------------------------------------------
# Kernel sources: a file rewritten after it was checked changes nothing that runs
# ---------------------------------------------------------------------------

#: A generated kernel: y = 2x + 1.
KERNEL = """import triton
import triton.language as tl


@triton.jit
def {name}(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2.0 + 1.0, mask=i < n)
"""

#: The same kernel as someone else rewrote it: its module level and (under the
#: interpreter, which runs the kernel body as Python) its body leave a marker file,
#: and it computes something else. Lines are added, as an attack would.
TAMPERED = """import triton
import triton.language as tl
from pathlib import Path
Path({marker!r}).write_text("module level ran")


@triton.jit
def {name}(x, y, n, BLOCK: tl.constexpr):
    __import__("pathlib").Path({marker!r}).write_text("kernel body ran")
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 666.0, mask=i < n)
"""


def launch(module, name: str, device) -> None:
    """First launch of the kernel on 1000 fresh random values (not a power of two), checked."""
    torch.manual_seed(3)
    x = torch.randn(1000, device=device)
    y = torch.empty_like(x)
    getattr(module, name)[(triton_cdiv(1000, 256),)](x, y, 1000, BLOCK=256)
    torch.testing.assert_close(y, x * 2 + 1, atol=1e-6, rtol=1e-6)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("rewrite", ["cache-file", "cache-and-private-file"])
def test_a_kernel_file_rewritten_before_the_first_launch_changes_nothing_that_runs(
    tmp_path, kernel_name, device, rewrite
):
    """Triton reads a kernel's source back when it first runs it (the interpreter) or
    decorates it (the JIT): it must read the checked text, not what a file holds then."""
    marker = tmp_path / "tampered_code_ran"
    module = load_kernel_module(kernel_name, KERNEL.format(name=kernel_name), tmp_path)
    bad = TAMPERED.format(name=kernel_name, marker=str(marker))
    (tmp_path / "kernels" / f"{kernel_name}.py").write_text(bad)
    if rewrite == "cache-and-private-file":  # even our own private copy: the text in memory runs
        Path(module.__file__).write_text(bad)
    launch(module, kernel_name, device)
    assert not marker.exists(), marker.read_text()
    assert inspect.getsource(getattr(module, kernel_name).fn).startswith("@triton.jit\ndef ")
    assert "* 666.0" not in inspect.getsource(getattr(module, kernel_name).fn)  # tampered body (a name may hold 666)


def test_a_kernel_file_swapped_while_it_is_loaded_never_runs(tmp_path, kernel_name, device, monkeypatch):
    """The window inside ``load_kernel_module``: right after the cache's copy is written
    (checked), another process replaces it."""
    marker = tmp_path / "tampered_code_ran"
    write = cache.atomic_write

    def write_then_swap(path, text):
        write(path, text)
        if Path(path).name == f"{kernel_name}.py":
            Path(path).write_text(TAMPERED.format(name=kernel_name, marker=str(marker)))

    monkeypatch.setattr(cache, "atomic_write", write_then_swap)
    module = load_kernel_module(kernel_name, KERNEL.format(name=kernel_name), tmp_path)
    launch(module, kernel_name, device)
    assert not marker.exists(), marker.read_text()


def test_what_inspect_reads_back_is_the_text_that_ran(tmp_path, kernel_name):
    """The JIT takes a kernel's source through ``inspect.getsource`` when it decorates it."""
    source = "def kernel():\n    return 42\n"
    module = load_kernel_module(kernel_name, source, tmp_path)
    (tmp_path / "kernels" / f"{kernel_name}.py").write_text("def kernel():\n    return 666  # injected\n\n\n")
    Path(module.__file__).write_text("import os\n\ndef kernel():\n    return 666  # injected\n")
    assert inspect.getsource(module.kernel) == source
    assert module.kernel() == 42


@posix_only
def test_the_private_kernel_folder_is_ours_and_removed_at_exit(tmp_path):
    folder = cache.private_kernel_dir()
    st = folder.lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert cache.private_kernel_dir() == folder  # one per process
    script = (
        "from autofuser_core import cache\n"
        "print(cache.load_kernel_module('af_exit_check', 'VALUE = 1\\n', cache.Path(__import__('sys').argv[1]))"
        ".__file__)"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    private_file = Path(done.stdout.strip())
    assert private_file.name == "af_exit_check.py" and not private_file.parent.exists()


# Loads a kernel, says where its private file is, then leaves as argv[2] says.
LEAVING_SCRIPT = """
import os, signal, sys
from autofuser_core import cache
module = cache.load_kernel_module("af_leaving", "VALUE = 1\\n", cache.Path(sys.argv[1]))
print(module.__file__, flush=True)
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
elif sys.argv[2] == "os._exit":
    os._exit(0)
elif sys.argv[2] == "removes, then os._exit":
    cache.remove_private_kernel_dir()
    os._exit(0)
elif sys.argv[2] == "waits":
    sys.stdin.read()
"""


@posix_only
def test_private_folders_of_processes_that_died_without_exit_hooks_are_removed_by_the_next(tmp_path):
    """A process killed by a signal or leaving through ``os._exit`` can't remove its private
    folder (unless it calls ``remove_private_kernel_dir`` first); the next process to load a
    kernel does, and touches nothing else: not a live process's folder, not a folder without
    a lock file, not a link, not another host's folder."""
    temp = tmp_path / "tmp"
    temp.mkdir(mode=0o700)
    env = {**os.environ, "TMPDIR": str(temp)}
    here = cache._host_prefix()
    no_lock = temp / f"{here}nolock"
    no_lock.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / cache.PRIVATE_LOCK).touch()
    (temp / f"{here}link").symlink_to(elsewhere)
    # Another host's folder with a free lock: on a TMPDIR shared between hosts, its lock may
    # be that host's alone, so it may be alive there.
    other_host = temp / f"{cache.PRIVATE_PREFIX}another-host-abc123"
    other_host.mkdir()
    (other_host / cache.PRIVATE_LOCK).touch()

    def start(how: str) -> subprocess.Popen:
        command = [sys.executable, "-c", LEAVING_SCRIPT, str(tmp_path / "cache"), how]
        return subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def folder(process: subprocess.Popen) -> Path:
        return Path(process.stdout.readline().strip()).parent

    alive = start("waits")
    try:
        live_folder = folder(alive)
        tidy = start("removes, then os._exit")
        tidy_folder = folder(tidy)
        assert tidy.wait(timeout=60) == 0 and not tidy_folder.exists()
        left = None  # the folder the last process left behind
        for how, code in (("killed", -signal.SIGKILL), ("os._exit", 0)):
            process = start(how)
            mine = folder(process)
            assert process.wait(timeout=60) == code
            assert mine.is_dir() and mine.parent == temp, how  # its exit hook did not run
            assert left is None or not left.exists()  # the one before it was removed as this one started
            left = mine
        following = start("returns")
        assert folder(following).parent == temp and following.wait(timeout=60) == 0
        assert left is not None and not left.exists()
        assert live_folder.is_dir() and no_lock.is_dir() and (elsewhere / cache.PRIVATE_LOCK).exists()
    finally:
        alive.communicate("", timeout=60)
    assert alive.returncode == 0
    assert sorted(p.name for p in temp.iterdir()) == sorted([f"{here}link", f"{here}nolock", other_host.name])


def test_a_second_header_for_one_kernel_name_gets_its_own_private_file(tmp_path, kernel_name):
    """A private file never changes under a module filed as it (line numbers would shift)."""
    first = load_kernel_module(kernel_name, "# nodes: a\nVALUE = 1\n", tmp_path)
    sys.modules.pop(f"autofuser_kernels.{kernel_name}")
    second = load_kernel_module(kernel_name, "# nodes: b, c\n# more\nVALUE = 1\n", tmp_path)
    assert first.__file__ != second.__file__
    assert Path(first.__file__).read_text() == "# nodes: a\nVALUE = 1\n"


# ---------------------------------------------------------------------------
# Folders other users can write
# ---------------------------------------------------------------------------


def make_folder(root: Path, sub: str, mode: int) -> Path:
    folder = root / sub if sub else root
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, mode)
    return folder


@posix_only
@pytest.mark.parametrize("sub", ["", "kernels", "tuning", "verdicts"])
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_our_folder_that_others_can_write_is_made_private_and_said_once(tmp_path, caplog, kernel_name, sub, mode):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    folder = make_folder(root, sub, mode)
    with caplog.at_level(logging.WARNING, logger="autofuser"), warnings.catch_warnings():
        warnings.simplefilter("error")
        write_tuning(root, KEY, CONFIG, [])
        assert read_tuning(root, KEY)["config"] == CONFIG
        cache.write_verdict(root, KEY, {"fused_ms": 1.0})
        assert read_verdict(root, KEY).times == {"fused_ms": 1.0}
        load_kernel_module(kernel_name, "VALUE = 1\n", root)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    said = [r.getMessage() for r in caplog.records if "private" in r.getMessage()]
    assert len(said) == 1 and str(folder) in said[0] and f"{mode & 0o7777:o} -> 700" in said[0], said
    assert (root / "tuning" / f"{key_digest(KEY)}.json").is_file()  # used, once private


def owned_by_another_user(monkeypatch, folder: Path) -> None:
    """``folder`` (one we made) looks like another user's to the cache's owner check:
    its stat answers another uid (no root needed to test it)."""
    real_stat, real_lstat = os.stat, os.lstat

    def faking(real):
        def call(path, *args, **kwargs):
            st = real(path, *args, **kwargs)
            if str(path) == str(folder):
                fields = list(st[:10])
                fields[4] = os.getuid() + 4242  # st_uid
                return os.stat_result(fields)
            return st

        return call

    monkeypatch.setattr(cache.os, "stat", faking(real_stat))
    monkeypatch.setattr(cache.os, "lstat", faking(real_lstat))


@posix_only
@pytest.mark.parametrize("sub", ["", "kernels", "tuning", "verdicts"])
def test_another_users_folder_is_not_used_and_warned_about_once(tmp_path, monkeypatch, kernel_name, sub):
    root = tmp_path / "cache"
    for folder in ("kernels", "tuning", "verdicts"):
        (root / folder).mkdir(parents=True, mode=0o700)
    planted = root / "tuning" / f"{key_digest(KEY)}.json"
    planted.write_text(valid_entry(config={"BLOCK": 64, "num_warps": 1}))
    (root / "verdicts" / f"{key_digest(KEY)}.json").write_text(
        json.dumps({"version": cache.ENTRY_VERSION, "key": KEY, "times": {"fused_ms": 0.001}})
    )
    owned_by_another_user(monkeypatch, root / sub if sub else root)
    before = {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.warns(UserWarning, match="belongs to another user") as record:
        tuning_read = read_tuning(root, KEY)
        verdict_read = read_verdict(root, KEY)
        write_tuning(root, KEY, CONFIG, [])
        cache.write_verdict(root, KEY, {"fused_ms": 1.0})
        module = load_kernel_module(kernel_name, "VALUE = 7\n", root)
        with tuning_lock(root, KEY) as held:
            locked = held
    messages = [str(w.message) for w in record if "AutoFuser" in str(w.message)]
    assert len(messages) == 1 and str(root / sub if sub else root) in messages[0], messages
    assert module.VALUE == 7
    files = {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    if sub in ("", "tuning"):
        assert "in memory" in messages[0]
        assert tuning_read is None and not locked  # the planted entry is not read, no lock taken there
        assert read_tuning(root, KEY)["config"] == CONFIG  # kept in memory for the process
        assert files[str(planted)] == before[str(planted)]
    if sub in ("", "verdicts"):
        assert "in memory" in messages[0]
        assert verdict_read.times == {} and read_verdict(root, KEY).times == {"fused_ms": 1.0}
    if sub in ("", "kernels"):
        assert not (root / "kernels" / f"{kernel_name}.py").exists()
    if sub == "":
        assert files == before  # nothing written anywhere in it
    else:  # the other subfolders are used as usual
        assert (tuning_read is None) == (sub == "tuning") and (verdict_read.times == {}) == (sub == "verdicts")


@posix_only
def test_a_root_owned_folder_that_others_cannot_write_is_used(tmp_path, monkeypatch):
    """Root can change any file anyway: a read-only cache that root installed is used."""
    root = tmp_path / "cache"
    write_tuning(root, KEY, CONFIG, [])
    monkeypatch.setattr(cache.os, "getuid", lambda: 4242)  # we are someone else; the files are root's or ours
    if os.stat(root).st_uid == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert read_tuning(root, KEY)["config"] == CONFIG
    else:
        with pytest.warns(UserWarning, match="belongs to another user"):
            assert read_tuning(root, KEY) is None


@posix_only
@pytest.mark.parametrize("sub", ["kernels", "tuning", "verdicts"])
def test_a_symlinked_subfolder_is_not_used(tmp_path, kernel_name, sub):
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    (elsewhere / f"{key_digest(KEY)}.json").write_text(valid_entry(config={"BLOCK": 64, "num_warps": 1}))
    (root / sub).symlink_to(elsewhere, target_is_directory=True)
    before = sorted(p.name for p in elsewhere.iterdir())
    with pytest.warns(UserWarning, match="symbolic link"):
        if sub == "tuning":
            assert read_tuning(root, KEY) is None
            write_tuning(root, KEY, CONFIG, [])
            with tuning_lock(root, KEY) as held:
                assert not held
        elif sub == "verdicts":
            assert read_verdict(root, KEY).times == {}
            cache.write_verdict(root, KEY, {"fused_ms": 1.0})
        else:
            load_kernel_module(kernel_name, "VALUE = 1\n", root)
    assert sorted(p.name for p in elsewhere.iterdir()) == before  # nothing written through the link
    assert (root / sub).is_symlink()


# ---------------------------------------------------------------------------
# Links, FIFOs and oversized files inside the cache
# ---------------------------------------------------------------------------


def entry_path(root: Path, folder: str = "tuning") -> Path:
    return root / folder / f"{key_digest(KEY)}.json"


def finishes(fn, timeout_s: float = 20.0, unblock: Path | None = None):
    """``fn()``'s result, or a failure if it is still running after ``timeout_s`` (blocked
    opening a FIFO: ``unblock`` is then opened for writing, which frees it). Run in a copy
    of the caller's context, so a timer put in place for the test (``timing.using``) holds."""
    result, error = [], []

    def run():
        try:
            result.append(fn())
        except BaseException as err:  # reported by the caller
            error.append(err)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        if unblock is not None:
            fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            thread.join(5)
        pytest.fail(f"still running after {timeout_s} s (blocked on a FIFO)")
    if error:
        raise error[0]
    return result[0]


@posix_only
@pytest.mark.parametrize("folder", ["tuning", "verdicts"])
def test_a_fifo_at_an_entry_path_is_not_read(tmp_path, folder):
    path = entry_path(tmp_path, folder)
    path.parent.mkdir(parents=True, mode=0o700)
    os.mkfifo(path)
    read = (lambda: read_tuning(tmp_path, KEY)) if folder == "tuning" else (lambda: read_verdict(tmp_path, KEY).times)
    with pytest.warns(UserWarning, match="not a regular file"):
        assert finishes(read, unblock=path) in (None, {})
    # A write replaces it with a regular file.
    if folder == "tuning":
        write_tuning(tmp_path, KEY, CONFIG, [])
        assert read_tuning(tmp_path, KEY)["config"] == CONFIG
    else:
        cache.write_verdict(tmp_path, KEY, {"fused_ms": 2.0})
        assert read_verdict(tmp_path, KEY).times == {"fused_ms": 2.0}
    assert stat.S_ISREG(path.lstat().st_mode)


@posix_only
def test_a_fifo_at_a_kernel_copy_is_replaced_not_read(tmp_path, kernel_name):
    path = tmp_path / "kernels" / f"{kernel_name}.py"
    path.parent.mkdir(parents=True, mode=0o700)
    os.mkfifo(path)
    module = finishes(lambda: load_kernel_module(kernel_name, "VALUE = 3\n", tmp_path), unblock=path)
    assert module.VALUE == 3 and path.read_text() == "VALUE = 3\n"


@posix_only
def test_a_symlinked_entry_is_not_followed_and_a_write_replaces_the_link(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text(valid_entry(config={"BLOCK": 64, "num_warps": 1}))  # a valid entry: following would use it
    path = entry_path(tmp_path / "cache")
    path.parent.mkdir(parents=True, mode=0o700)
    path.symlink_to(victim)
    with pytest.warns(UserWarning, match="symbolic link"):
        assert read_tuning(tmp_path / "cache", KEY) is None
    write_tuning(tmp_path / "cache", KEY, CONFIG, [])
    assert not path.is_symlink() and json.loads(path.read_text())["config"] == CONFIG
    assert json.loads(victim.read_text())["config"] == {"BLOCK": 64, "num_warps": 1}  # not written through


@posix_only
def test_a_symlinked_kernel_copy_is_replaced_not_written_through(tmp_path, kernel_name):
    victim = tmp_path / "victim.py"
    victim.write_text("VALUE = 1\n")  # identical text: following the link would leave it as it is
    path = tmp_path / "cache" / "kernels" / f"{kernel_name}.py"
    path.parent.mkdir(parents=True, mode=0o700)
    path.symlink_to(victim)
    load_kernel_module(kernel_name, "VALUE = 1\n", tmp_path / "cache")
    assert not path.is_symlink() and path.read_text() == "VALUE = 1\n"


def test_an_oversized_entry_is_not_read(tmp_path, monkeypatch):
    path = entry_path(tmp_path)
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text(valid_entry())
    monkeypatch.setattr(cache, "MAX_ENTRY_BYTES", len(path.read_bytes()) - 1)
    with pytest.warns(UserWarning, match="larger than"):
        assert read_tuning(tmp_path, KEY) is None
    monkeypatch.setattr(cache, "MAX_ENTRY_BYTES", len(path.read_bytes()))
    assert read_tuning(tmp_path, KEY)["config"] == CONFIG


@posix_only
@pytest.mark.skipif(sys.platform == "win32", reason="entry locks use POSIX flock")
@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "fifo", "folder"])
def test_a_lock_path_that_is_not_a_regular_file_is_not_used(tmp_path, kind):
    lock = tmp_path / "tuning" / f"{key_digest(KEY)}.lock"
    lock.parent.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    if kind == "symlink":
        victim.write_text("someone's file\n")
        lock.symlink_to(victim)
    elif kind == "dangling-symlink":
        lock.symlink_to(victim)  # following it would create the victim
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()

    def take():
        with tuning_lock(tmp_path, KEY, timeout_s=1) as held:
            return held

    with pytest.warns(UserWarning, match="not using the tuning lock"):
        assert finishes(take, unblock=lock) is False
    if kind == "symlink":
        assert victim.read_text() == "someone's file\n"
    else:
        assert not victim.exists()
    assert sorted(p.name for p in lock.parent.iterdir()) == [lock.name]  # no marker or other file left


def hold_lock_elsewhere(path: Path):
    """An open file holding ``flock`` on ``path``, as another process tuning would (a second
    open file description conflicts even within one process)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle = open(path, "a")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return handle


@pytest.mark.skipif(sys.platform == "win32", reason="entry locks use POSIX flock")
def test_a_held_lock_is_waited_for_said_once_and_given_up_after_the_timeout(tmp_path):
    lock = tmp_path / "tuning" / f"{key_digest(KEY)}.lock"
    other = hold_lock_elsewhere(lock)
    waits = []
    with pytest.warns(UserWarning, match="waited 0 s for another process"):
        with tuning_lock(tmp_path, KEY, on_wait=lambda: waits.append(1), timeout_s=0.3) as held:
            assert held is False
    assert waits == [1]
    other.close()  # the other process finished: the lock is free
    with tuning_lock(tmp_path, KEY, on_wait=lambda: waits.append(2)) as held:
        assert held is True and waits == [1]
        assert not lock_is_free(lock)
    assert lock_is_free(lock)  # released


@pytest.mark.skipif(sys.platform == "win32", reason="entry locks use POSIX flock")
def test_a_lock_file_is_made_private_and_left_in_place(tmp_path):
    lock = tmp_path / "tuning" / f"{key_digest(KEY)}.lock"
    old_mask = os.umask(0o022)
    try:
        with tuning_lock(tmp_path, KEY) as held:
            assert held is True and not lock_is_free(lock)
    finally:
        os.umask(old_mask)
    assert lock_is_free(lock) and stat.S_IMODE(lock.stat().st_mode) == 0o600  # waiters share its inode


@pytest.mark.skipif(sys.platform == "win32", reason="entry locks use POSIX flock")
def test_a_file_system_without_locks_tunes_without_one_and_writes_no_marker(tmp_path, monkeypatch, recwarn):
    """No ``flock`` (some network mounts): tuning goes on without the lock, silently, and no
    soft-lock marker (a pid, a host name) is written into the cache folder."""
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with tuning_lock(tmp_path, KEY, timeout_s=1) as held:
        assert held is False
    assert [str(w.message) for w in recwarn] == []
    assert [p.name for p in (tmp_path / "tuning").iterdir()] == [f"{key_digest(KEY)}.lock"]
    assert (tmp_path / "tuning" / f"{key_digest(KEY)}.lock").stat().st_size == 0


# ---------------------------------------------------------------------------
# A cached config only selects among the strategy's own configs
# ---------------------------------------------------------------------------


@pytest.fixture
def gpu_tuning(stand_in_timer):
    """Tuning as on a GPU, with a stand-in timer."""
    return stand_in_timer.timed


def fuse_and_run(root: Path, x: torch.Tensor):
    torch.manual_seed(0)
    model = NormGelu().to(x.device)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, cache_dir=str(root))
        got = fused(x)
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
    return fused.report()


def test_a_cached_config_the_strategy_does_not_list_is_tuned_again(tmp_path, gpu_tuning, caplog, device):
    """An entry that passes the strategy's validity rules but names a config the strategy
    never offers (written by hand, or by someone else) is a miss: tuned again, replaced."""
    torch.manual_seed(1)
    x = torch.randn(1, 5, 37, device=device)
    first = fuse_and_run(tmp_path, x)
    (path,) = [
        p
        for p in (tmp_path / "tuning").glob("*.json")
        if set(json.loads(p.read_text())["config"]) == {"BLOCK", "num_warps"}
    ]
    entry = json.loads(path.read_text())
    entry["config"] = {"BLOCK": 96, "num_warps": 1}  # 3 values per thread: valid, but not listed
    path.write_text(json.dumps(entry))
    elementwise = next(g for g in first.fused if g.strategy == "elementwise")
    assert elementwise.config != entry["config"]
    with caplog.at_level(logging.WARNING, logger="autofuser"):
        second = fuse_and_run(tmp_path, x)
    assert "is not one of the strategy's configs" in caplog.text, caplog.text
    again = next(g for g in second.fused if g.strategy == "elementwise")
    assert not again.cache_hit and again.config != {"BLOCK": 96, "num_warps": 1}
    assert json.loads(path.read_text())["config"] == again.config  # the entry was replaced


@posix_only
def test_fifos_at_every_tuning_entry_do_not_hang_fuse(tmp_path, gpu_tuning, device):
    """A FIFO where an entry should be used to block ``fuse`` forever in ``open``."""
    torch.manual_seed(2)
    x = torch.randn(3, 7, 37, device=device)
    fuse_and_run(tmp_path, x)
    entries = sorted((tmp_path / "tuning").glob("*.json"))
    assert entries
    for path in entries:
        path.unlink()
        os.mkfifo(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = finishes(lambda: fuse_and_run(tmp_path, x), timeout_s=120, unblock=entries[0])
    assert sum("not a regular file" in str(w.message) for w in caught) >= len(entries)
    assert report.fused and all(not g.cache_hit for g in report.fused)
    assert all(stat.S_ISREG(p.lstat().st_mode) for p in entries)  # tuned again and written over
