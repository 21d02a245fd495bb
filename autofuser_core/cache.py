"""The on-disk cache: generated kernel sources and tuning results.

Layout under ``cache_dir()`` (``$AUTOFUSER_CACHE_DIR``, else
``$XDG_CACHE_HOME/autofuser``, else ``~/.cache/autofuser``; created private to
the user, mode 0700):

- ``kernels/<name>.py`` - generated Triton source (Triton needs a real file).
  The source is always regenerated from the graph; a file on disk is imported
  only if its bytes hash to what was just generated, so a writable cache
  folder cannot inject code.
- ``tuning/<key-hash>.json`` - one tuning result: the full key (kernel
  source hash, GPU name and capability, torch and Triton versions), the
  winning config and its timings, and the group's fused-vs-eager times, so a
  warm cache neither tunes nor times again. A file that doesn't parse, or whose key
  doesn't match the one asked for, is reported and re-tuned, never trusted.
- ``verdicts/<key-hash>.json`` - whole-forward timings of one compiled signature
  (fused with and without a CUDA graph, and the original model), keyed by the
  rewritten graph's code, its kernels and configs, the input signature and the
  GPU and versions, so a warm cache skips the whole-forward measurement too.

Every write goes to a temporary file in the same folder and is renamed over
the target (atomic on POSIX), so concurrent processes never read half a file.

Several processes (the ranks of a distributed job, say) sharing one folder
tune each kernel once: a process that misses an entry takes the entry's lock
(``tuning/<key-hash>.lock``, an advisory ``flock``), reads again, and tunes
only if the entry is still missing; the others wait for the lock and then read
its result. The operating system drops the lock of a process that dies, and
an entry appears only by the final rename, so a process killed while tuning
leaves nothing a later run trusts (only a stray ``*.tmp``, removed later).

A folder that can't be written (read-only, full disk) is not an error: one
warning, tuning results are kept in memory for the process, and kernel sources
go to a private temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .errors import CacheError

logger = logging.getLogger("autofuser")

ENTRY_VERSION = 1

#: How long a process waits for another one tuning the same kernel before it
#: gives up waiting and tunes itself (a tuner that hangs must not hang the job).
LOCK_TIMEOUT_S = 600.0
#: A temporary file this old is left over from a process that died while writing.
STALE_TMP_S = 60.0

# Tuning results this process could not write, by (folder, key hash): reused by
# later compilations in the same process.
_unwritten: dict[tuple[str, str], dict[str, Any]] = {}
_warned_unwritable: set[str] = set()
_private_kernel_dir: Optional[Path] = None


def cache_dir(override: Optional[str] = None) -> Path:
    """The cache folder, created (mode 0700) if missing. A folder that can't be
    created is returned all the same: reads miss and writes fall back to memory."""
    root = override or os.environ.get("AUTOFUSER_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "autofuser")
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
    warnings.warn(f"AutoFuser: cannot write to the cache folder {root} ({err}); tuning results are kept in "
                  "memory for this process only, and kernel sources go to a private temporary folder. Point "
                  "AUTOFUSER_CACHE_DIR (or fuse(cache_dir=...)) at a writable folder to keep them.", stacklevel=3)


def atomic_write(path: Path, text: str) -> None:
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


def load_kernel_module(name: str, source: str, root: Path):
    """Write ``source`` to ``kernels/<name>.py`` (unless an identical file is
    there) and import it; returns the module.

    A module this process already imported under ``name`` is returned as it is:
    the name hashes the code, so it differs from ``source`` at most in the
    header comment naming the fx nodes (another copy of a repeated layer), and
    its file in this folder, still in place, is left alone rather than written
    again for every copy."""
    path = root / "kernels" / f"{name}.py"
    module = sys.modules.get(f"autofuser_kernels.{name}")
    if module is not None and module.__file__ == str(path) and path.is_file():
        return module
    digest = hashlib.sha256(source.encode()).hexdigest()
    try:
        on_disk = path.read_bytes()
        trusted = hashlib.sha256(on_disk).hexdigest() == digest
    except OSError:
        trusted = False
    if not trusted:
        try:
            atomic_write(path, source)
        except OSError as err:
            _warn_unwritable(root, err)
            path = _private_kernels() / f"{name}.py"
            atomic_write(path, source)
    module_name = f"autofuser_kernels.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module = module_from_source(module_name, source, path)
    sys.modules[module_name] = module
    return module


def module_from_source(module_name: str, source: str, path: Path):
    """A module made by running ``source``, filed as ``path`` (Triton reads a kernel's
    source back from its file). The text itself runs, not the import system's pick: it
    would take a ``__pycache__/*.pyc`` planted next to the file over the file."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def _private_kernels() -> Path:
    """A private temporary folder for kernel sources when the cache folder can't
    take them (Triton reads a kernel's source through its file)."""
    global _private_kernel_dir
    if _private_kernel_dir is None:
        _private_kernel_dir = Path(tempfile.mkdtemp(prefix="autofuser-kernels-"))
    return _private_kernel_dir


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def read_tuning(root: Path, key: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The stored result for ``key``, or ``None`` (missing, or unusable: warned).
    Where the file has none, a result this process tuned but could not write."""
    entry = _read_entry_file(root / "tuning" / f"{key_digest(key)}.json", key, _check_tuning, "re-tuning")
    if entry is None:
        entry = _unwritten.get((str(root), key_digest(key)))
    return entry


def _check_tuning(entry: dict[str, Any]) -> None:
    config = entry.get("config")
    if not isinstance(config, dict) or not all(isinstance(v, int) for v in config.values()):
        raise CacheError("its config is not a mapping of integers")
    speed = entry.get("speed")
    if speed is not None and not (isinstance(speed, dict) and set(speed) == {"fused_ms", "eager_ms"}
                                  and all(isinstance(v, (int, float)) and v > 0 for v in speed.values())):
        raise CacheError("its fused-vs-eager timing is malformed")


def _check_verdict(entry: dict[str, Any]) -> None:
    times = entry.get("times")
    if not isinstance(times, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in times.values()):
        raise CacheError("its timings are malformed")


def _read_entry_file(path: Path, key: dict[str, Any], check: Callable[[dict[str, Any]], None],
                     redo: str) -> Optional[dict[str, Any]]:
    """The entry in ``path`` if it is whole, of this version, for ``key`` and passes ``check``;
    else ``None`` (a missing file silently, anything else with a warning saying ``redo``)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"AutoFuser: cannot read cache entry {path}: {err}; {redo}.")
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


def write_tuning(root: Path, key: dict[str, Any], config: dict[str, int], timings: list[dict[str, Any]],
                 speed: Optional[dict[str, float]] = None, config_limit: Optional[int] = None) -> None:
    """Store a tuning result; ``speed`` is the group's measured fused and eager times, so a
    warm cache skips re-timing them; ``config_limit``: only that many configs were tried."""
    entry = {"version": ENTRY_VERSION, "key": key, "config": config, "timings": timings}
    if speed is not None:
        entry["speed"] = speed
    if config_limit is not None:
        entry["config_limit"] = config_limit
    path = root / "tuning" / f"{key_digest(key)}.json"
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


def read_verdict(root: Path, key: dict[str, Any]) -> dict[str, float]:
    """Stored whole-forward timings for ``key`` (``{}`` when missing or unusable: warned).

    ``verdicts/<key-hash>.json`` holds the times a compiled forward was measured at
    (with and without a CUDA graph, and the original model's), so a warm cache
    decides without timing the forward again. Where the file has none, timings this
    process measured but could not write.
    """
    entry = _read_entry_file(root / "verdicts" / f"{key_digest(key)}.json", key, _check_verdict, "timing again")
    if entry is None:
        entry = _unwritten.get((str(root), f"verdict-{key_digest(key)}"), {})
    return {str(k): float(v) for k, v in entry.get("times", {}).items()}


def write_verdict(root: Path, key: dict[str, Any], times: dict[str, float]) -> None:
    path = root / "verdicts" / f"{key_digest(key)}.json"
    try:
        atomic_write(path, json.dumps({"version": ENTRY_VERSION, "key": key, "times": times}, indent=1,
                                      sort_keys=True))
    except OSError as err:
        _keep_in_memory(root, f"verdict-{key_digest(key)}", {"times": times}, path, err)


@contextlib.contextmanager
def tuning_lock(root: Path, key: dict[str, Any], on_wait: Optional[Callable[[], None]] = None,
                timeout_s: Optional[float] = None) -> Iterator[bool]:
    """Hold ``key``'s entry lock, so that one process at a time tunes it.

    Yields ``True`` while the lock is held, ``False`` where there is no lock to
    take (no ``fcntl``, a folder that can't be written, a file system without
    locks, or ``timeout_s`` - default ``LOCK_TIMEOUT_S`` - spent waiting): the
    caller then tunes on its own, which is only slower. ``on_wait`` is called
    once if another process holds the lock.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: each process tunes; atomic writes still keep entries whole
        yield False
        return
    digest = key_digest(key)
    path = root / "tuning" / f"{digest}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        _warn_unwritable(root, err)
        yield False
        return
    try:
        held = _acquire(fcntl, fd, path, on_wait, LOCK_TIMEOUT_S if timeout_s is None else timeout_s)
        if held:
            _remove_stale_temporaries(path.parent, f".{digest}.json.")
        yield held
    finally:
        os.close(fd)  # closing drops the lock


def _acquire(fcntl, fd: int, path: Path, on_wait, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as err:  # a file system without locks (some network mounts)
            logger.debug("cannot lock %s: %s", path, err)
            return False
        if on_wait is not None:
            on_wait()
            on_wait = None
        if time.monotonic() >= deadline:
            warnings.warn(f"AutoFuser: waited {timeout_s:.0f} s for another process to finish tuning "
                          f"({path}); tuning here as well.")
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _remove_stale_temporaries(folder: Path, prefix: str) -> None:
    """Half-written files of processes that died while writing this entry."""
    now = time.time()
    for tmp in folder.glob(f"{prefix}*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass
