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
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

from .errors import CacheError

logger = logging.getLogger("autofuser")

ENTRY_VERSION = 1


def cache_dir(override: Optional[str] = None) -> Path:
    """The cache folder, created (mode 0700) if missing."""
    root = override or os.environ.get("AUTOFUSER_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "autofuser")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


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
    there) and import it; returns the module."""
    path = root / "kernels" / f"{name}.py"
    digest = hashlib.sha256(source.encode()).hexdigest()
    try:
        on_disk = path.read_bytes()
        trusted = hashlib.sha256(on_disk).hexdigest() == digest
    except OSError:
        trusted = False
    if not trusted:
        atomic_write(path, source)
    module_name = f"autofuser_kernels.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # Run the text just checked, not the loader's pick: it would take a
    # ``__pycache__/*.pyc`` planted next to the file over the file itself.
    exec(compile(source, str(path), "exec"), module.__dict__)
    sys.modules[module_name] = module
    return module


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def read_tuning(root: Path, key: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The stored result for ``key``, or ``None`` (missing, or unusable: warned)."""
    path = root / "tuning" / f"{key_digest(key)}.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"AutoFuser: cannot read cache entry {path}: {err}; re-tuning.")
        return None
    try:
        entry = json.loads(text)
        if not isinstance(entry, dict) or entry.get("version") != ENTRY_VERSION:
            raise CacheError("unknown format version")
        if entry.get("key") != key:
            raise CacheError("it was written for another kernel, GPU or software version")
        config = entry.get("config")
        if not isinstance(config, dict) or not all(isinstance(v, int) for v in config.values()):
            raise CacheError("its config is not a mapping of integers")
        speed = entry.get("speed")
        if speed is not None and not (isinstance(speed, dict) and set(speed) == {"fused_ms", "eager_ms"}
                                      and all(isinstance(v, (int, float)) and v > 0 for v in speed.values())):
            raise CacheError("its fused-vs-eager timing is malformed")
        return entry
    except (ValueError, CacheError) as err:
        warnings.warn(f"AutoFuser: ignoring corrupt or foreign cache entry {path} ({err}); re-tuning.")
        return None


def write_tuning(root: Path, key: dict[str, Any], config: dict[str, int], timings: list[dict[str, Any]],
                 speed: Optional[dict[str, float]] = None) -> None:
    """Store a tuning result; ``speed`` is the group's measured fused and eager times, so a
    warm cache skips re-timing them."""
    entry = {"version": ENTRY_VERSION, "key": key, "config": config, "timings": timings}
    if speed is not None:
        entry["speed"] = speed
    path = root / "tuning" / f"{key_digest(key)}.json"
    try:
        atomic_write(path, json.dumps(entry, indent=1, sort_keys=True))
    except OSError as err:
        warnings.warn(f"AutoFuser: cannot write cache entry {path} ({err}); keeping the result in memory only.")


def read_verdict(root: Path, key: dict[str, Any]) -> dict[str, float]:
    """Stored whole-forward timings for ``key`` (``{}`` when missing or unusable: warned).

    ``verdicts/<key-hash>.json`` holds the times a compiled forward was measured at
    (with and without a CUDA graph, and the original model's), so a warm cache
    decides without timing the forward again.
    """
    path = root / "verdicts" / f"{key_digest(key)}.json"
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        warnings.warn(f"AutoFuser: ignoring unreadable cache entry {path} ({err}); timing again.")
        return {}
    times = entry.get("times") if isinstance(entry, dict) else None
    if (not isinstance(entry, dict) or entry.get("version") != ENTRY_VERSION or entry.get("key") != key
            or not isinstance(times, dict)
            or not all(isinstance(v, (int, float)) and v > 0 for v in times.values())):
        warnings.warn(f"AutoFuser: ignoring corrupt or foreign cache entry {path}; timing again.")
        return {}
    return {str(k): float(v) for k, v in times.items()}


def write_verdict(root: Path, key: dict[str, Any], times: dict[str, float]) -> None:
    path = root / "verdicts" / f"{key_digest(key)}.json"
    try:
        atomic_write(path, json.dumps({"version": ENTRY_VERSION, "key": key, "times": times}, indent=1,
                                      sort_keys=True))
    except OSError as err:
        warnings.warn(f"AutoFuser: cannot write cache entry {path} ({err}); keeping the result in memory only.")
