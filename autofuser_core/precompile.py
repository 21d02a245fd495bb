"""Compiling tuning candidates in parallel, before they are timed.

Tuning times every valid config of every new kernel, and on a GPU most of a
cold compile is Triton compiling those configs one after another. Compiling
is independent of timing: child processes compile every (kernel, config) pair
up front through Triton's own ``warmup`` entry point, which stores the
binaries in Triton's on-disk cache under the key a real launch computes; the
timing loop then finds each binary there instead of compiling it.

The children are forks of this process, made when a planning round has
configs to compile and gone when it has compiled them. A fork starts in
milliseconds with torch, Triton and the kernels' imports already done (fresh
interpreters spent 4-5 s importing torch alone on the GPU machines we measured,
and 1.5 s more making the GPU current when 16 started at once). A fork of a
process that uses CUDA must not use CUDA itself, and these don't: compiling
needs only the GPU's target (architecture and warp size), which this process
reads before forking and hands to Triton in each child through a driver that
answers with it and never calls into CUDA. Forks also never run the user's
script again, which ``multiprocessing``'s spawned children would. The children
take configs from one shared queue, the slowest-to-compile kinds first, so no
child is left with a long tail while others idle.

Only tensors of the kernel's dtypes are described to the compiler (generated
kernels take tensors and compile-time constants only), as 16-byte-aligned
pointers, which is what freshly allocated tensors are. A launch whose tensor
is not so aligned just compiles its own variant, as it would have anyway.

A child that fails or hangs costs speed, never correctness: a config it did
not compile is compiled when it is timed. Where ``os.fork`` does not exist, or
the target can't be read, nothing is compiled ahead.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import struct
import time
import warnings
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("autofuser")

#: Seconds a compile waits for its children before giving up on them.
WAIT_S = 900

#: Tasks the children of the last ``precompile`` call answered for (compiled or refused).
last_answered = 0
#: Where the slowest child of the last ``precompile`` call spent its time, in seconds:
#: ``setup`` (from its fork to its first task) and ``compile`` (the configs it took).
last_slowest: dict[str, float] = {}

#: Queue records: unsigned 32-bit task indices. Pipe writes this small are atomic, so
#: children reading one record at a time each get whole, distinct indices.
_RECORD = struct.Struct("=I")
#: Tasks at most per precompile call: the whole queue must fit in a pipe's buffer
#: (16 KiB at least) before the children start. Larger rounds compile the rest when timed.
MAX_TASKS = 4096


@dataclass(frozen=True)
class CompileJob:
    """One kernel file and the launches to compile it for."""

    path: str  # the kernel's source file (Triton reads the source from it)
    name: str  # the @triton.jit function (or chain launcher) in it
    dtypes: tuple[str, ...]  # one per tensor argument, in call order ("float32", ...)
    launches: tuple[tuple[tuple[str, Any], ...], ...]  # constexprs, num_warps, num_stages per config


def workers() -> int:
    """Child processes: ``AUTOFUSER_COMPILE_WORKERS``, else the cores this process may
    use, shared among the ranks on this machine (``LOCAL_WORLD_SIZE``), at most 16;
    0 turns parallel compilation off."""
    configured = os.environ.get("AUTOFUSER_COMPILE_WORKERS")
    if configured is not None:
        try:
            return max(0, int(configured))
        except ValueError:
            logger.warning("AUTOFUSER_COMPILE_WORKERS=%r is not an integer; using the default", configured)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(16, cores // ranks))


def _enabled() -> bool:
    return workers() > 0 and hasattr(os, "fork") and os.environ.get("TRITON_INTERPRET") != "1"


def current_target():
    """The GPU target Triton compiles for in this process (its current device), or
    ``None`` where there is none to read."""
    try:
        from triton.runtime import driver

        return driver.active.get_current_target()
    except Exception:
        return None


def launch_items(launch_args: dict) -> tuple[tuple[str, Any], ...]:
    """A launch's keyword arguments (``KernelSource.launch_args``), hashable."""
    return tuple(sorted(launch_args.items()))


def _cost(task: dict) -> float:
    """A rough compile-time rank: longer kernels and larger tiles take longer."""
    size = os.path.getsize(task["path"]) if os.path.exists(task["path"]) else 0
    tile = 1
    for key, value in task["launch"].items():
        if key.startswith("BLOCK") and isinstance(value, int):
            tile *= max(1, value)
    return size * (1 + 0.1 * task["launch"].get("num_stages", 1)) + tile ** 0.5


def precompile(jobs: list[CompileJob], progress, target=None) -> int:
    """Compile every job's launches in forked children; returns the number compiled.

    ``target`` is the Triton ``GPUTarget`` to compile for (default: this process's
    current device). Blocks until the children answer (at most ``WAIT_S``). Returns 0
    without doing anything where parallel compilation is off
    (``AUTOFUSER_COMPILE_WORKERS=0``), under Triton's interpreter, or without a target.
    """
    global last_answered, last_slowest
    last_answered, last_slowest = 0, {}
    tasks = [{"path": j.path, "name": j.name, "dtypes": list(j.dtypes), "launch": dict(launch)}
             for j in jobs for launch in j.launches]
    if not _enabled() or not tasks:
        return 0
    target = target if target is not None else current_target()
    if target is None:
        return 0
    tasks.sort(key=_cost, reverse=True)
    tasks = tasks[:MAX_TASKS]
    count = min(workers(), len(tasks))
    progress(f"compiling {len(tasks)} config(s) of {len(jobs)} kernel(s) in {count} child process(es)")
    _warm_compiler()  # once here instead of once in every child
    queue_read, queue_write = os.pipe()
    answer_read, answer_write = os.pipe()
    os.write(queue_write, b"".join(_RECORD.pack(i) for i in range(len(tasks))))
    children: list[int] = []
    try:
        for _ in range(count):
            with warnings.catch_warnings():  # "fork() may deadlock in a multi-threaded process": the
                warnings.simplefilter("ignore", DeprecationWarning)  # children use no lock another thread holds
                pid = os.fork()
            if pid == 0:  # the child: compile from the queue, answer, and leave without cleaning up
                status = 1
                try:
                    os.close(queue_write)
                    os.close(answer_read)
                    _child(tasks, target, queue_read, answer_write)
                    status = 0
                finally:
                    os._exit(status)
            children.append(pid)
    except OSError as err:
        logger.warning("could not fork compile processes (%s); configs compile one by one when timed", err)
    finally:
        os.close(queue_write)
        os.close(queue_read)
        os.close(answer_write)
    try:
        answers = _collect(answer_read, len(children))
    finally:
        os.close(answer_read)
        for pid in children:
            _reap(pid)
    last_answered = sum(a.get("tried", 0) for a in answers)
    last_slowest = max(({k: float(a.get(f"{k}_s", 0.0)) for k in ("setup", "compile")} for a in answers),
                       key=lambda t: t["setup"] + t["compile"], default={})
    if last_slowest:
        progress(f"compile processes done; the slowest spent {last_slowest['setup']:.1f} s starting "
                 f"and {last_slowest['compile']:.1f} s compiling")
    return sum(a.get("compiled", 0) for a in answers)


def _collect(fd: int, expected: int) -> list[dict]:
    """Read one answer line per child until each answered, every child's end of the pipe
    is closed, or ``WAIT_S`` passes."""
    answers: list[dict] = []
    buffer = b""
    deadline = time.monotonic() + WAIT_S
    while len(answers) < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            logger.warning("compile processes did not answer within %d s; their configs compile when timed",
                           WAIT_S)
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # every child exited (some without an answer)
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if isinstance(answer, dict) and "compiled" in answer:
                answers.append(answer)
    return answers


def _reap(pid: int) -> None:
    """Wait for a child briefly, then kill it: a child that did not answer is not waited for."""
    for _ in range(50):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.01)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _warm_compiler() -> None:
    """Compute Triton's own cache-key digest (a hash over its sources and library, cached
    per process) before forking, so that the children inherit it."""
    for module, name in (("triton.runtime.cache", "triton_key"), ("triton.compiler.compiler", "triton_key")):
        try:
            getattr(__import__(module, fromlist=[name]), name)()
            return
        except Exception:
            continue


class _TargetDriver:
    """Triton's active driver, except that it names a fixed GPU target and never asks CUDA
    which device or stream is current: compiling for a target needs no GPU."""

    def __init__(self, real, target):
        self._real, self._target = real, target

    def __getattr__(self, name):
        if self._real is None:
            raise AttributeError(name)
        return getattr(self._real, name)

    def get_current_target(self):
        return self._target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def use_target(target) -> None:
    """Make Triton compile for ``target`` in this process without touching a GPU."""
    from triton.runtime import driver

    try:
        real = driver.active
    except Exception:  # no GPU driver here (a CPU-only machine): compiling needs none
        real = None
    driver.set_active(_TargetDriver(real, target))


def _child(tasks: list[dict], target, queue: int, answers: int) -> None:
    """In a child: compile queued tasks until the queue is empty, then write one answer line."""
    start = time.perf_counter()
    compiled = tried = 0
    setup_s = 0.0
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the compiler's chatter is not the user's output
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        import torch

        from .cache import module_from_source

        use_target(target)
        setup_s = time.perf_counter() - start
        modules: dict[str, Any] = {}
        while True:
            record = os.read(queue, _RECORD.size)
            if len(record) < _RECORD.size:
                break
            task = tasks[_RECORD.unpack(record)[0]]
            tried += 1
            try:
                if task["path"] not in modules:
                    with open(task["path"]) as handle:
                        modules[task["path"]] = module_from_source(f"autofuser_kernels.{task['name']}",
                                                                   handle.read(), task["path"])
                kernel = getattr(modules[task["path"]], task["name"])
                kernel.warmup(*[getattr(torch, d) for d in task["dtypes"]], grid=(1,), **task["launch"])
                compiled += 1
            except Exception:  # refused configs are refused again, with the error, when timed
                pass
    finally:
        line = json.dumps({"compiled": compiled, "tried": tried, "setup_s": round(setup_s, 4),
                           "compile_s": round(time.perf_counter() - start - setup_s, 4)}) + "\n"
        os.write(answers, line.encode())
