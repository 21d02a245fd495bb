"""The on-disk cache: generated kernel sources and tuning results.

Layout under ``cache_dir()`` (``$AUTOFUSER_CACHE_DIR``, else the system's user
cache folder for ``autofuser`` as ``platformdirs`` names it: ``$XDG_CACHE_HOME/autofuser``
or ``~/.cache/autofuser`` on Linux, ``~/Library/Caches/autofuser`` on macOS,
``%LOCALAPPDATA%\\autofuser\\Cache`` on Windows; created private to the user, mode 0700):

- ``kernels/<name>.py`` - generated Triton source, kept for people to read.
  Nothing is ever imported from it: the source is always regenerated from the
  graph, written to a private folder of the process (``private_kernel_dir()``)
  and run from the text in memory, which is also what Triton reads back as the
  kernel's source (``module_from_source``). A process that rewrites a file here,
  at any time, changes nothing that runs.
- ``tuning/<key-hash>.json`` - one tuning result: the full key (kernel
  source hash, GPU name and capability, torch and Triton versions), the
  winning config and its timings, and the group's fused-vs-eager times, so a
  warm cache neither tunes nor times again. A file that doesn't parse, or whose key
  doesn't match the one asked for, is reported and re-tuned, never trusted.
- ``verdicts/<key-hash>.json`` - whole-forward timings of one compiled signature
  (fused with and without a CUDA graph, and the original model), keyed by the
  rewritten graph's code, its kernels and configs, the input signature and the
  GPU and versions, so a warm cache skips the whole-forward measurement too.
  Each decision taken from those times carries a record of how it was measured
  (``records``: method, spread, rounds, provisional, confirmed in use); a
  decision with no record (an older entry) or a provisional one is measured again.

Every write goes to a temporary file in the same folder (created anew, never
through a link) and is renamed over the target (atomic on POSIX), so
concurrent processes never read half a file. Entries are read without
following a symbolic link and without blocking on a FIFO; anything but a
regular file of at most ``MAX_ENTRY_BYTES`` is ignored with a warning.

Only folders no other user can write are used (POSIX). The cache folder and
its subfolders must be real folders (a subfolder that is a symbolic link is
refused) owned by this user (or by root) and not writable by group or others:
one of this user's that others may write is made private (mode 0700, said
once); one that belongs to another user, or can't be made private, is not used
at all - one warning, and the process runs as with an unwritable folder. See
``docs/cache.md`` for the threat model.

Several processes (the ranks of a distributed job, say) sharing one folder
tune each kernel once: a process that misses an entry takes the entry's lock
(``tuning/<key-hash>.lock``, an advisory ``flock`` taken through ``filelock``), reads again, and tunes
only if the entry is still missing; the others wait for the lock and then read
its result. The operating system drops the lock of a process that dies, and
an entry appears only by the final rename, so a process killed while tuning
leaves nothing a later run trusts (only a stray ``*.tmp``, removed later).

A folder that can't be written (read-only, full disk) is not an error: one
warning, and tuning results are kept in memory for the process.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import importlib.util
import json
import linecache
import logging
import math
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import filelock
import platformdirs

try:
    import fcntl
except ImportError:  # not POSIX: private folders are removed only by the exit hook
    fcntl = None  # type: ignore[assignment]

from .errors import CacheError
from .interpreter import KERNEL_PACKAGE

logger = logging.getLogger("autofuser.cache")

ENTRY_VERSION = 1

#: How long a process waits for another one tuning the same kernel before it
#: gives up waiting and tunes itself (a tuner that hangs must not hang the job).
LOCK_TIMEOUT_S = 600.0
#: A temporary file this old is left over from a process that died while writing.
STALE_TMP_S = 60.0
#: The largest entry file read: a tuning entry with every config's timing is a few KiB.
MAX_ENTRY_BYTES = 4 << 20

# Tuning results this process could not write, by (folder, key hash): reused by
# later compilations in the same process.
_unwritten: dict[tuple[str, str], dict[str, Any]] = {}
_warned_unwritable: set[str] = set()
_warned_folders: set[str] = set()  # folders refused or made private: said once each
# This process's private kernel folder, with the pid that made it (a fork makes its own).
_private_kernel_dir: Optional[tuple[int, Path]] = None
_private_files: dict[str, str] = {}  # file name in that folder -> sha256 of the text written there
# (cache folder, kernel name) whose readable copy this process wrote or found identical.
_readable_copies: set[tuple[str, str]] = set()


def cache_dir(override: Optional[str] = None) -> Path:
    """The cache folder, created (mode 0700) if missing. A folder that can't be
    created is returned all the same: reads miss and writes fall back to memory."""
    root = override or os.environ.get("AUTOFUSER_CACHE_DIR")
    if not root:
        root = platformdirs.user_cache_dir("autofuser", appauthor=False)
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as err:
        _warn_unwritable(path, err)
    return path


def _warn_unwritable(root: Path, err: OSError) -> None:
    """One warning per folder and process: what failed and what happens instead."""
    if str(root) in _warned_unwritable:
        logger.debug("cache folder %s: %s", root, err)
        return
    _warned_unwritable.add(str(root))
    warnings.warn(
        f"AutoFuser: cannot write to the cache folder {root} ({err}); tuning results are kept in "
        "memory for this process only. Point AUTOFUSER_CACHE_DIR (or fuse(cache_dir=...)) at a "
        "writable folder to keep them.",
        stacklevel=3,
    )


# ---------------------------------------------------------------------------
# Whose folder it is
# ---------------------------------------------------------------------------


def _usable(root: Path, sub: str) -> bool:
    """Whether ``root/sub`` may be read and written: each of the two, where it exists, is
    a folder (``root`` may be reached through a symbolic link, ``sub`` may not) that
    belongs to this user or to root and that no other user can write. A folder of this
    user's that group or others may write is made private first (mode 0700). Refusals
    warn once per folder. A missing folder is usable: it is created private when written."""
    if os.name != "posix":
        return True  # no owners and modes to check (docs/cache.md: what is not protected)
    return _folder_ok(root, link_allowed=True, instead=_INSTEAD[""]) and _folder_ok(
        root / sub, link_allowed=False, instead=_INSTEAD[sub]
    )


#: What happens instead when a folder is not used.
_INSTEAD = {
    "": "nothing is read from it or written to it; tuning results are kept in memory for this process only",
    "tuning": "tuning results are kept in memory for this process only",
    "verdicts": "whole-forward timings are kept in memory for this process only",
    "kernels": "generated kernel sources are not copied there (they run from a private folder either way)",
}


def _folder_ok(path: Path, link_allowed: bool, instead: str) -> bool:
    try:
        st = os.stat(path) if link_allowed else os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:  # unreachable (a parent without search permission): reads and writes fail as usual
        return True
    if stat.S_ISLNK(st.st_mode):
        return _refuse(path, "is a symbolic link", instead, "replace the link by a folder of your own")
    if not stat.S_ISDIR(st.st_mode):
        return _refuse(path, "is not a folder", instead, "remove it")
    if st.st_uid not in _trusted_owners():
        return _refuse(path, f"belongs to another user (uid {st.st_uid})", instead, "use a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        if st.st_uid != os.getuid():
            return _refuse(path, "can be written by other users", instead, "use a folder of your own")
        try:
            os.chmod(path, 0o700)
        except OSError as err:
            return _refuse(
                path, f"can be written by other users and can't be made private ({err})", instead, "make it mode 0700"
            )
        if str(path) not in _warned_folders:
            _warned_folders.add(str(path))
            logger.warning(
                "made the cache folder %s private (mode %o -> 700): other users could write to it, "
                "and so choose which configs tuning keeps",
                path,
                stat.S_IMODE(st.st_mode),
            )
    return True


def _trusted_owners() -> set[int]:
    """Who may own the cache's folders: this user, and root (who can change any file
    anyway; a read-only cache that root installed is used as it is)."""
    return {os.getuid(), 0}


def _refuse(path: Path, why: str, instead: str, fix: str) -> bool:
    if str(path) not in _warned_folders:
        _warned_folders.add(str(path))
        warnings.warn(
            f"AutoFuser: not using the cache folder {path}: it {why}; {instead}. To keep them, {fix}, "
            "or point AUTOFUSER_CACHE_DIR (or fuse(cache_dir=...)) at one.",
            stacklevel=5,
        )
    return False


# ---------------------------------------------------------------------------
# Reading and writing files
# ---------------------------------------------------------------------------


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` where it is a regular file of at most ``limit`` bytes.

    Opened without following a symbolic link and without blocking (a FIFO would
    block an ordinary ``open`` until someone writes to it), then checked on the open
    descriptor. Raises ``FileNotFoundError`` where it is missing, ``CacheError``
    (saying what it is) where it is a link, not a regular file or too large, and
    ``OSError`` where it can't be read."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    if not nofollow and os.path.islink(path):
        raise CacheError("it is a symbolic link")
    flags = (
        os.O_RDONLY | nofollow | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    )
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if nofollow and err.errno in (errno.ELOOP, errno.EMLINK):  # EMLINK: the BSDs' answer
            raise CacheError("it is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CacheError("it is not a regular file")
        if st.st_size > limit:
            raise CacheError(f"it is larger than {limit} bytes")
        data = handle.read(limit + 1)
    if len(data) > limit:  # it grew while read
        raise CacheError(f"it is larger than {limit} bytes")
    return data


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a new temporary file (``mkstemp``: created
    exclusively, mode 0600, never through a planted link) renamed over it; a link or
    anything else at ``path`` is replaced, not written through."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---------------------------------------------------------------------------
# Kernel sources: only the text just generated is ever run
# ---------------------------------------------------------------------------


def load_kernel_module(name: str, source: str, root: Path):
    """Import the generated ``source`` as module ``autofuser_kernels.<name>``, and keep
    a copy in ``kernels/<name>.py`` of the cache folder for people to read; returns the
    module.

    What runs, and what Triton reads back as the kernel's source (the JIT when it
    decorates, the interpreter at the first launch), is ``source`` itself: the module
    is compiled from the text in memory, filed under a file this process writes in its
    private folder (``private_kernel_dir()``), and that text is registered in
    ``linecache`` under the file's name (``module_from_source``). The copy in the cache
    folder is never read back to run, so rewriting it, before or after this call, changes
    nothing that runs.

    A module this process already imported under ``name`` is returned as it is:
    the name hashes the code, so it differs from ``source`` at most in the
    header comment naming the fx nodes (another copy of a repeated layer), and
    its copy in this folder, still in place, is left alone rather than written
    again for every copy."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    _write_readable_copy(root, name, source, digest)
    module_name = f"{KERNEL_PACKAGE}.{name}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    module = module_from_source(module_name, source, _private_kernel_file(name, source, digest))
    sys.modules[module_name] = module
    return module


def _write_readable_copy(root: Path, name: str, source: str, digest: str) -> None:
    """``kernels/<name>.py``, unless this process wrote it already or an identical file is there."""
    path = root / "kernels" / f"{name}.py"
    slot = (str(root), name)
    if slot in _readable_copies and os.path.lexists(path):
        return
    if not _usable(root, "kernels"):
        return
    try:
        identical = hashlib.sha256(read_regular_file(path, len(source.encode()))).hexdigest() == digest
    except (OSError, CacheError):
        identical = False
    if not identical:
        try:
            atomic_write(path, source)
        except OSError as err:
            _warn_unwritable(root, err)
            return
    _readable_copies.add(slot)


def module_from_source(module_name: str, source: str, path: Path):
    """A module made by running ``source``, filed as ``path``.

    The text itself runs, not the import system's pick (it would take a
    ``__pycache__/*.pyc`` planted next to the file over the file), and the same
    text is registered in ``linecache`` under ``path``: Triton gets a kernel's
    source through ``inspect``, which reads ``linecache`` first, so it compiles
    what ran here whatever the file holds by then. (An entry without a
    modification time is one ``linecache.checkcache`` keeps; if something clears
    the whole cache, ``inspect`` reads the file again.)"""
    filename = str(path)
    spec = importlib.util.spec_from_file_location(module_name, filename)
    assert spec is not None  # a path ending in .py always has one
    module = importlib.util.module_from_spec(spec)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def private_kernel_dir() -> Path:
    """This process's private folder for the kernel files it imports: made by
    ``tempfile.mkdtemp`` (a new name, mode 0700, ours) when the first kernel is loaded,
    and removed when the process exits. A forked child that loads kernels makes its own.

    A process that ends without running its exit hooks (killed by a signal, or leaving
    through ``os._exit``, as forked children and distributed ranks do) can't remove its
    folder, so every folder holds a lock file (``PRIVATE_LOCK``) that its process keeps
    locked (``flock``) for its whole life; the operating system drops the lock when the
    process dies, however it dies. Making a folder, a process first removes this user's
    folders whose lock is free (``_remove_dead_private_dirs``): what a dead process left
    lasts only until the next process loads a kernel."""
    global _private_kernel_dir
    pid = os.getpid()
    if _private_kernel_dir is None or _private_kernel_dir[0] != pid:
        _remove_dead_private_dirs(Path(tempfile.gettempdir()))
        folder = Path(tempfile.mkdtemp(prefix=_host_prefix()))
        # A fork inherits its parent's descriptor; the parent's lock stays the parent's
        # (and held while the child lives, which is right: the child reads its files).
        lock = _lock_private_dir(folder)
        if lock is not None:
            _private_locks[folder] = lock
        _private_kernel_dir = (pid, folder)
        _private_files.clear()
        atexit.register(_remove_private_dir, pid, folder)
    return _private_kernel_dir[1]


def remove_private_kernel_dir() -> None:
    """Remove this process's private kernel folder now, for a process about to leave
    through ``os._exit`` (which skips the exit hook that would). A kernel loaded after
    this makes a new folder."""
    global _private_kernel_dir
    if _private_kernel_dir is not None and _private_kernel_dir[0] == os.getpid():
        _remove_private_dir(*_private_kernel_dir)
        _private_kernel_dir = None


#: The private kernel folders' name prefix; the host's name follows it (``_host_prefix``),
#: then ``tempfile.mkdtemp``'s random letters.
PRIVATE_PREFIX = "autofuser-kernels-"


def _host_prefix() -> str:
    """``PRIVATE_PREFIX`` and this host's name: a process sweeps only its own host's folders.
    A TMPDIR shared between hosts may not share their locks (a network file system whose
    ``flock`` is local to each node), and another host's live folder would look dead."""
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname())[:40] or "host"
    return f"{PRIVATE_PREFIX}{host}-"


#: The lock file in each private folder, locked by its process for its whole life
#: (kernel files are ``<name>.py``, so no kernel is ever written over it).
PRIVATE_LOCK = ".alive.lock"
# Each private folder this process made -> its open, locked PRIVATE_LOCK (a fork inherits
# its parent's entries, which its exit hooks, checking the pid, leave alone).
_private_locks: dict[Path, int] = {}


def _lock_private_dir(folder: Path) -> Optional[int]:
    """Create ``folder/PRIVATE_LOCK`` already locked; returns its descriptor, kept open.

    The file is created and locked under another name and then renamed into place, so
    that another process sweeping for dead folders never finds an unlocked lock file in
    a folder whose process is still setting it up. ``None`` without ``flock`` (the
    folder is then removed only by the exit hook)."""
    if fcntl is None:
        return None
    tmp = folder / f"{PRIVATE_LOCK}.new"
    fd = os.open(
        tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, folder / PRIVATE_LOCK)
    except OSError as err:  # a file system without locks: the exit hook still removes the folder
        logger.debug("cannot lock the private kernel folder %s: %s", folder, err)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return fd


def _remove_dead_private_dirs(parent: Path) -> None:
    """Remove the private kernel folders in ``parent`` that a dead process of this user left.

    Only folders of ours are touched: a name with this host's prefix (``_host_prefix``),
    a real folder (not a link) owned by this user, holding a regular ``PRIVATE_LOCK`` (opened without
    following a link) whose ``flock`` this process gets at once. A live process holds
    its lock, so its folder is left alone, whatever its pid or pid namespace; a folder
    without a lock file (one being set up, or left by an older AutoFuser) is left alone
    too. The lock is held while the folder is removed, so two processes sweeping at
    once don't both remove it. ``shutil.rmtree`` does not follow links inside it."""
    if fcntl is None:
        return
    prefix = _host_prefix()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(
                os.path.join(entry.path, PRIVATE_LOCK),
                os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
            )
        except OSError:  # gone, not ours to read, no lock file, or the lock file is a link
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its process is alive
                continue
            logger.debug("removing %s, left by a process that ended without removing it", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def _remove_private_dir(pid: int, folder: Path) -> None:
    if os.getpid() == pid:  # not from a forked child that inherited the exit hook
        shutil.rmtree(folder, ignore_errors=True)
        lock = _private_locks.pop(folder, None)  # popped: a second call never closes a reused number
        if lock is not None:
            with contextlib.suppress(OSError):
                os.close(lock)


def _private_kernel_file(name: str, source: str, digest: str) -> Path:
    """The private file holding ``source`` (written here, exclusively): ``<name>.py``, or
    where this process already wrote other text under that name (another header),
    ``<name>_<hash>.py``, so that a file never changes under a module filed as it."""
    folder = private_kernel_dir()
    file_name = f"{name}.py"
    if _private_files.get(file_name, digest) != digest:
        file_name = f"{name}_{digest[:16]}.py"
    path = folder / file_name
    if _private_files.get(file_name) != digest:
        fd = os.open(
            path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
            0o600,
        )
        with os.fdopen(fd, "w") as handle:
            handle.write(source)
        _private_files[file_name] = digest
    return path


# ---------------------------------------------------------------------------
# Tuning entries and whole-forward verdicts
# ---------------------------------------------------------------------------


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def read_tuning(root: Path, key: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The stored result for ``key``, or ``None`` (missing, or unusable: warned).
    Where the file has none (or the folder is not used: ``_usable``), a result this
    process tuned but could not write."""
    entry = None
    if _usable(root, "tuning"):
        entry = _read_entry_file(root / "tuning" / f"{key_digest(key)}.json", key, _check_tuning, "re-tuning")
    if entry is None:
        entry = _unwritten.get((str(root), key_digest(key)))
    return entry


def _check_tuning(entry: dict[str, Any]) -> None:
    config = entry.get("config")
    if not isinstance(config, dict) or not all(isinstance(v, int) for v in config.values()):
        raise CacheError("its config is not a mapping of integers")
    if not isinstance(entry.get("timings", []), list):
        raise CacheError("its timings are not a list")
    speed = entry.get("speed")
    if speed is not None and not (
        isinstance(speed, dict)
        and set(speed) in _SPEED_KEYS
        and all(_finite_ms(v) for k, v in speed.items() if k != "graph_refused")
        and speed.get("graph_refused", True) is True
    ):
        raise CacheError("its fused-vs-eager timing is malformed")


#: A tuning entry's fused-vs-eager times: launched (with ``graph_refused`` where capturing
#: them failed), as CUDA graphs, or both, each as a pair.
_SPEED_KEYS = (
    {"fused_ms", "eager_ms"},
    {"fused_ms", "eager_ms", "graph_refused"},
    {"graph_fused_ms", "graph_eager_ms"},
    {"fused_ms", "eager_ms", "graph_fused_ms", "graph_eager_ms"},
)


#: How one decision of a verdict entry was measured: every field, and its type.
_RECORD_FIELDS = {"method": str, "spread": float, "rounds": int, "provisional": bool, "in_use": bool}
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


def _finite_ms(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _check_record(name: Any, record: Any) -> None:
    """One decision's record, as ``make_record`` writes it; the folder is not trusted."""
    if not (isinstance(name, str) and 0 < len(name) <= 64 and set(name) <= _NAME_CHARS):
        raise CacheError("a decision's name is not a short identifier")
    if not isinstance(record, dict) or set(record) != set(_RECORD_FIELDS):
        raise CacheError(f"the record of decision {name!r} lacks or adds fields")
    for field, kind in _RECORD_FIELDS.items():
        value = record[field]
        ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf
        if not ok:
            raise CacheError(f"the record of decision {name!r} has a malformed {field!r}")
    if record["rounds"] < 1 or len(record["method"]) > 1000:
        raise CacheError(f"the record of decision {name!r} has a malformed 'rounds' or 'method'")


def _check_verdict(entry: dict[str, Any]) -> None:
    times = entry.get("times")
    if not isinstance(times, dict) or not all(_finite_ms(v) for v in times.values()):
        raise CacheError("its timings are malformed")
    records = entry.get("records", {})  # absent in entries written before records were kept
    if not isinstance(records, dict):
        raise CacheError("its decision records are malformed")
    for name, record in records.items():
        _check_record(name, record)


def make_record(method: str, spread: float, rounds: int, provisional: bool, in_use: bool = False) -> dict[str, Any]:
    """How one decision of a verdict entry was measured: ``method`` (a sentence),
    ``spread`` (the largest (slowest - fastest) / fastest of one side's rounds or blocks),
    ``rounds`` (rounds or blocks of each side), ``provisional`` (its lead was inside the
    spread: the safe side was taken, and a later compile measures it again) and
    ``in_use`` (measured in the first calls as the user makes them)."""
    return {
        "method": method,
        "spread": float(spread),
        "rounds": int(rounds),
        "provisional": bool(provisional),
        "in_use": bool(in_use),
    }


class Verdict(NamedTuple):
    """A verdict entry as read: times by name, and each decision's record by name."""

    times: dict[str, float]
    records: dict[str, dict[str, Any]]


def _read_entry_file(
    path: Path, key: dict[str, Any], check: Callable[[dict[str, Any]], None], redo: str
) -> Optional[dict[str, Any]]:
    """The entry in ``path`` if it is whole, of this version, for ``key`` and passes ``check``;
    else ``None`` (a missing file silently, anything else with a warning saying ``redo``).
    A link is not followed, and a FIFO or anything else that is not a regular file is
    not read (``read_regular_file``)."""
    try:
        text = read_regular_file(path, MAX_ENTRY_BYTES).decode()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"AutoFuser: cannot read cache entry {path}: {err}; {redo}.")
        return None
    except (CacheError, ValueError) as err:  # ValueError: not UTF-8
        warnings.warn(f"AutoFuser: ignoring corrupt or foreign cache entry {path} ({err}); {redo}.")
        return None
    try:
        entry = json.loads(text)
        if not isinstance(entry, dict) or entry.get("version") != ENTRY_VERSION:
            raise CacheError("unknown format version")
        if entry.get("key") != key:
            raise CacheError("it was written for another kernel, GPU or software version")
        check(entry)
        return entry
    except (ValueError, CacheError) as err:
        warnings.warn(f"AutoFuser: ignoring corrupt or foreign cache entry {path} ({err}); {redo}.")
        return None


def write_tuning(
    root: Path,
    key: dict[str, Any],
    config: dict[str, int],
    timings: list[dict[str, Any]],
    speed: Optional[dict[str, Any]] = None,
    config_limit: Optional[int] = None,
) -> None:
    """Store a tuning result; ``speed`` is the group's measured fused and eager times, so a
    warm cache skips re-timing them; ``config_limit``: only that many configs were tried."""
    entry = {"version": ENTRY_VERSION, "key": key, "config": config, "timings": timings}
    if speed is not None:
        entry["speed"] = speed
    if config_limit is not None:
        entry["config_limit"] = config_limit
    path = root / "tuning" / f"{key_digest(key)}.json"
    if not _usable(root, "tuning"):
        _unwritten[(str(root), key_digest(key))] = entry  # the refusal was warned about
        return
    try:
        atomic_write(path, json.dumps(entry, indent=1, sort_keys=True))
    except OSError as err:
        _keep_in_memory(root, key_digest(key), entry, path, err)
    else:
        _unwritten.pop((str(root), key_digest(key)), None)


def _keep_in_memory(root: Path, slot: str, value: dict[str, Any], path: Path, err: OSError) -> None:
    """A result the folder wouldn't take: kept for this process, and warned about once."""
    _unwritten[(str(root), slot)] = value
    _warn_unwritable(root, OSError(err.errno, f"cannot write cache entry {path}: {err.strerror or err}"))


def read_verdict(root: Path, key: dict[str, Any]) -> Verdict:
    """Stored whole-forward timings for ``key`` and their decisions' records (both empty
    when missing or unusable: warned).

    ``verdicts/<key-hash>.json`` holds the times a compiled forward was measured at
    (with and without a CUDA graph, and the original model's), so a warm cache
    decides without timing the forward again, and for each decision taken from them
    how it was measured (``make_record``). An entry of the older format has times but
    no records: the caller measures those decisions again rather than trust them.
    Where the file has none, timings this process measured but could not write.
    """
    entry = None
    if _usable(root, "verdicts"):
        entry = _read_entry_file(root / "verdicts" / f"{key_digest(key)}.json", key, _check_verdict, "timing again")
    if entry is None:
        entry = _unwritten.get((str(root), f"verdict-{key_digest(key)}"), {})
    times = {str(k): float(v) for k, v in entry.get("times", {}).items()}
    records = {str(k): dict(v) for k, v in entry.get("records", {}).items()}
    return Verdict(times, records)


def write_verdict(
    root: Path, key: dict[str, Any], times: dict[str, float], records: Optional[dict[str, dict[str, Any]]] = None
) -> None:
    """Store a verdict entry: ``times`` by name, and each decision's record (``make_record``)."""
    path = root / "verdicts" / f"{key_digest(key)}.json"
    value = {"times": times, "records": records or {}}
    if not _usable(root, "verdicts"):
        _unwritten[(str(root), f"verdict-{key_digest(key)}")] = value
        return
    try:
        atomic_write(path, json.dumps({"version": ENTRY_VERSION, "key": key, **value}, indent=1, sort_keys=True))
    except OSError as err:
        _keep_in_memory(root, f"verdict-{key_digest(key)}", value, path, err)


@contextlib.contextmanager
def tuning_lock(
    root: Path, key: dict[str, Any], on_wait: Optional[Callable[[], None]] = None, timeout_s: Optional[float] = None
) -> Iterator[bool]:
    """Hold ``key``'s entry lock, so that one process at a time tunes it.

    Yields ``True`` while the lock is held, ``False`` where there is no lock to
    take (no ``flock``, a folder that can't be written or is not used, a lock
    path that is a link or not a regular file, a file system without locks, or
    ``timeout_s`` - default ``LOCK_TIMEOUT_S`` - spent waiting): the caller then
    tunes on its own, which is only slower. ``on_wait`` is called once if another
    process holds the lock.

    The lock is ``filelock``'s ``flock`` lock, which opens the lock file with
    ``O_NOFOLLOW | O_NONBLOCK`` (a link is refused, a FIFO never waited on), creates
    it mode 0600, and leaves it in place on release. Two of its options keep the
    cache's rules (docs/cache.md): ``fallback_to_soft=False``, since its fallback on a
    file system without ``flock`` writes a marker file (a pid, a host name) into the
    folder, where tuning without the lock is only slower; and ``on_acquired``, which
    refuses a lock file that is not a regular file (a FIFO or a device opens, and
    ``flock`` takes it).
    """
    if not filelock.has_fcntl:  # not POSIX: each process tunes; atomic writes still keep entries whole
        yield False
        return
    if not _usable(root, "tuning"):
        yield False
        return
    digest = key_digest(key)
    path = root / "tuning" / f"{digest}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as err:
        _warn_unwritable(root, err)
        yield False
        return
    lock = filelock.UnixFileLock(
        path,
        mode=0o600,
        thread_local=False,
        fallback_to_soft=False,
        on_acquired=_refuse_irregular_lock_file,
    )
    if not _acquire(lock, root, path, on_wait, LOCK_TIMEOUT_S if timeout_s is None else timeout_s):
        yield False
        return
    try:
        _remove_stale_temporaries(path.parent, f".{digest}.json.")
        yield True
    finally:
        lock.release()


def _refuse_irregular_lock_file(fd: int) -> None:
    """``filelock``'s ``on_acquired``: raising makes it let go of the lock and close the file."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise CacheError("it is not a regular file")


def _acquire(lock, root: Path, path: Path, on_wait: Optional[Callable[[], None]], timeout_s: float) -> bool:
    """Take ``lock``; ``False`` (said why, where it matters) where it is not taken."""
    try:
        try:
            lock.acquire(blocking=False)
            return True
        except filelock.Timeout:  # another process holds it
            if on_wait is not None:
                on_wait()
        lock.acquire(timeout=timeout_s)
        return True
    except filelock.Timeout:
        warnings.warn(
            f"AutoFuser: waited {timeout_s:.0f} s for another process to finish tuning ({path}); tuning here as well."
        )
    except CacheError as err:
        _warn_no_lock(path, str(err))
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW's answer (EMLINK: the BSDs')
            _warn_no_lock(path, "it is a symbolic link")
        elif err.errno in (errno.EISDIR, errno.ENXIO):  # a folder; ENXIO: a socket
            _warn_no_lock(path, "it is not a regular file")
        elif err.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):  # no locks (some network mounts)
            logger.debug("cannot lock %s: %s", path, err)
        else:
            _warn_unwritable(root, err)
    return False


def _warn_no_lock(path: Path, why: str) -> None:
    if str(path) not in _warned_folders:
        _warned_folders.add(str(path))
        warnings.warn(
            f"AutoFuser: not using the tuning lock {path}: {why}; tuning without it (other processes "
            "sharing the cache may tune the same kernel too). Remove it to share tuning again.",
            stacklevel=5,
        )


def _remove_stale_temporaries(folder: Path, prefix: str) -> None:
    """Half-written files of processes that died while writing this entry."""
    now = time.time()
    for tmp in folder.glob(f"{prefix}*.tmp"):
        try:
            if now - tmp.lstat().st_mtime > STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass
