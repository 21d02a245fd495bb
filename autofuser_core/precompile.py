"""Compiling tuning candidates in parallel, before they are timed.

Tuning times every valid config of every new kernel, and on a GPU most of a
cold compile is Triton compiling those configs one after another. Compiling
is independent of timing: a pool of worker processes compiles every
(kernel, config) pair up front through Triton's own ``warmup`` entry point,
which stores the binaries in Triton's on-disk cache under the key a real
launch computes; the timing loop then finds each binary there instead of
compiling it.

Only tensors of the kernel's dtypes are described to the workers (generated
kernels take tensors and compile-time constants only), as 16-byte-aligned
pointers, which is what freshly allocated tensors are. A launch whose tensor
is not so aligned just compiles its own variant, as it would have anyway.

Worker processes are spawned (not forked: a forked child can't use CUDA),
started once and reused; a failure in a worker (a config the compiler
refuses) only means that config is compiled - and refused - at launch.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger("autofuser")

_POOL: Optional[cf.ProcessPoolExecutor] = None


@dataclass(frozen=True)
class CompileJob:
    """One kernel file and the launches to compile it for."""

    path: str  # the kernel's source file (Triton reads the source from it)
    name: str  # the @triton.jit function in it
    dtypes: tuple[str, ...]  # one per tensor argument, in call order ("float32", ...)
    launches: tuple[tuple[tuple[str, Any], ...], ...]  # constexprs, num_warps, num_stages per config


def workers() -> int:
    """Worker processes: ``AUTOFUSER_COMPILE_WORKERS``, else one per core up to 16; 0 turns it off."""
    configured = os.environ.get("AUTOFUSER_COMPILE_WORKERS")
    if configured is not None:
        try:
            return max(0, int(configured))
        except ValueError:
            logger.warning("AUTOFUSER_COMPILE_WORKERS=%r is not an integer; compiling in parallel with the default",
                           configured)
    return min(16, os.cpu_count() or 1)


def _pool(size: int) -> cf.ProcessPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = cf.ProcessPoolExecutor(max_workers=size, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_POOL.shutdown, wait=False, cancel_futures=True)
    return _POOL


def _ready() -> None:
    """Runs in a worker: pay the imports and the driver start-up before there is work."""
    import triton

    triton.runtime.driver.active.get_current_target()


def start_workers() -> None:
    """Start the pool in the background (its processes import torch and Triton for
    seconds), so it is ready by the time the first kernels are generated."""
    size = workers()
    if size == 0 or os.environ.get("TRITON_INTERPRET") == "1":
        return
    try:
        pool = _pool(size)
        for _ in range(size):
            pool.submit(_ready)
    except Exception as err:
        logger.warning("could not start compile workers (%s: %s)", type(err).__name__, err)
        shutdown()


def _compile_in_worker(job: CompileJob) -> int:
    """Runs in a worker: import the kernel file, warm up every launch; returns how many compiled."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"autofuser_kernels.{job.name}", job.path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = getattr(module, job.name)
    args = [getattr(torch, d) for d in job.dtypes]
    done = 0
    for launch in job.launches:
        try:
            kernel.warmup(*args, grid=(1,), **dict(launch))
            done += 1
        except Exception:  # refused configs are refused again, with the error, when launched
            pass
    return done


def precompile(jobs: list[CompileJob], progress) -> int:
    """Compile every job's launches on the worker pool; returns the number compiled.

    Blocks until all are done. Returns 0 without doing anything where parallel
    compilation is off (``AUTOFUSER_COMPILE_WORKERS=0``), under Triton's
    interpreter, or when the pool can't start.
    """
    size = workers()
    total = sum(len(j.launches) for j in jobs)
    if size == 0 or total == 0 or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    progress(f"compiling {total} config(s) of {len(jobs)} kernel(s) on {size} worker process(es)")
    # One task per config, not per kernel: a kernel with 20 configs would otherwise
    # keep one worker busy while the others wait.
    tasks = [CompileJob(j.path, j.name, j.dtypes, (launch,)) for j in jobs for launch in j.launches]
    try:
        futures = [_pool(size).submit(_compile_in_worker, task) for task in tasks]
        return sum(f.result() for f in cf.as_completed(futures))
    except Exception as err:  # a broken pool costs speed, never correctness
        logger.warning("parallel compilation failed (%s: %s); configs compile one by one when timed",
                       type(err).__name__, err)
        shutdown()
        return 0


def shutdown() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None


def launch_items(config: dict, constexprs: dict) -> tuple[tuple[str, Any], ...]:
    """A launch's keyword arguments as the tuning loop passes them, hashable."""
    return tuple(sorted({**config, **constexprs}.items()))
