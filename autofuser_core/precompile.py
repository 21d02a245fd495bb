"""Compiling tuning candidates in parallel, before they are timed.

Tuning times every valid config of every new kernel, and on a GPU most of a
cold compile is Triton compiling those configs one after another. Compiling
is independent of timing: child processes compile every (kernel, config) pair
up front through Triton's own ``warmup`` entry point, which stores the
binaries in Triton's on-disk cache under the key a real launch computes; the
timing loop then finds each binary there instead of compiling it.

The children are forks of this process, made when a planning round has
configs to compile and gone when it has compiled them. A fork starts in
milliseconds with torch, Triton and the kernels' imports already done, where a
fresh interpreter spends seconds importing torch and making the GPU current
(BENCHMARKS.md, "Measurements behind rules in the code"). A fork of a
process that uses CUDA must not use CUDA itself, and these don't: compiling
needs only the GPU's target (architecture and warp size), which this process
reads before forking and hands to Triton in each child through a driver that
answers with it and never calls into CUDA. Forks also never run the user's
script again, which ``multiprocessing``'s spawned children would. The children
take configs from one shared queue in the order they will be timed, and
report each config as it is done: this process times each config as soon as it
is compiled (``Compiling.wait_for``) while the children go on with the rest, so
tuning overlaps compiling instead of following it.

Only tensors of the kernel's dtypes are described to the compiler (generated
kernels take tensors and compile-time constants only), as 16-byte-aligned
pointers, which is what freshly allocated tensors are. A launch whose tensor
is not so aligned just compiles its own variant, as it would have anyway.

A child that fails or hangs costs speed, never correctness: a config it did
not compile is compiled when it is timed, and children silent for ``STALL_S``
seconds are stopped. Where ``os.fork`` does not exist, or
the target can't be read, nothing is compiled ahead.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .errors import AutoFuserError

logger = logging.getLogger("autofuser.tune")

#: Seconds without any answer from the children, while waiting for them, after which
#: they are given up on (killed; their configs compile when timed). One config takes
#: seconds at most to compile; a child silent this long is stuck.
STALL_S = 120

#: Tasks the children of the last ``precompile`` call answered for (compiled or refused).
last_answered = 0
#: Where the slowest child of the last ``precompile`` call spent its time, in seconds:
#: ``setup`` (from its fork to its first task) and ``compile`` (the configs it took).
last_slowest: dict[str, float] = {}

#: Queue records: unsigned 32-bit task indices. Pipe writes this small are atomic, so
#: children reading one record at a time each get whole, distinct indices.
_RECORD = struct.Struct("=I")
#: Tasks at most per precompile call; the whole queue is written into a pipe before the
#: children start, so fewer where the pipe holds less (``start``). The rest compile when timed.
MAX_TASKS = 4096
#: Signals whose handlers a child resets to the default (it inherits the parent's Python handlers).
_CHILD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


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
    if configured is not None and configured.strip():
        try:
            count = int(configured)
        except ValueError:
            count = -1
        if count < 0:
            raise AutoFuserError(
                f"AUTOFUSER_COMPILE_WORKERS={configured!r} is not a whole number of processes: set it to 0 "
                "(compile in this process), a count such as 4, or unset it for the default (the usable cores)"
            )
        return count
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


def precompile(jobs: list[CompileJob], progress, target=None) -> int:
    """Compile every job's launches in forked children and wait for them; returns the
    number compiled (``start`` then ``Compiling.finish``)."""
    return start(jobs, progress, target).finish()


def start(jobs: list[CompileJob], progress, target=None) -> "Compiling":
    """Start compiling every job's launches, in job order, in forked children.

    ``target`` is the Triton ``GPUTarget`` to compile for (default: this process's
    current device). Returns at once; ``wait_for(name)`` blocks until one kernel's
    configs are done, ``finish()`` until all are. Nothing is compiled ahead where
    parallel compilation is off (``AUTOFUSER_COMPILE_WORKERS=0``), under Triton's
    interpreter, or without a target.
    """
    global last_answered, last_slowest
    last_answered, last_slowest = 0, {}
    tasks = [
        {"path": j.path, "name": j.name, "dtypes": list(j.dtypes), "launch": dict(launch)}
        for j in jobs
        for launch in j.launches
    ][:MAX_TASKS]
    if not _enabled() or not tasks:
        return Compiling([], progress)
    target = target if target is not None else current_target()
    if target is None:
        return Compiling([], progress)
    _warm_compiler()  # once here instead of once in every child
    queue_read, queue_write = os.pipe()
    answer_read, answer_write = os.pipe()
    children: list[int] = []
    try:
        # The whole queue is written before any child reads it, so it must fit the pipe's
        # buffer: a pipe can hold as little as 4-8 KiB (past the user's pipe-user-pages-soft).
        # A write that does not fit would block this process forever; what doesn't fit
        # compiles when timed.
        os.set_blocking(queue_write, False)
        records = b"".join(_RECORD.pack(i) for i in range(len(tasks)))
        try:
            written = os.write(queue_write, records)
        except BlockingIOError:
            written = 0
        tasks = tasks[: written // _RECORD.size]
        count = min(workers(), len(tasks))
        if tasks:
            progress(
                f"compiling {len(tasks)} config(s) of {len({t['name'] for t in tasks})} kernel(s) "
                f"in {count} child process(es)"
            )
        # The children must not collect this process's garbage: a finaliser there (a CUDA
        # tensor's, a loaded kernel's) would call CUDA in a fork. Frozen objects are not collected.
        gc.freeze()
        # Signals arriving between the fork and the child's own handlers must not run the
        # parent's handlers (the user's SIGTERM checkpoint, KeyboardInterrupt) in a child.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_SIGNALS)
        try:
            for _ in range(count):
                with warnings.catch_warnings():  # "fork() may deadlock in a multi-threaded process": the
                    warnings.simplefilter("ignore", DeprecationWarning)  # children use no lock another thread holds
                    pid = os.fork()
                    if pid == 0:  # the child: compile from the queue, answer, and leave without cleaning up
                        status = 1
                        try:
                            os.setpgid(0, 0)  # its own group, so that stopping it also stops its ptxas
                            for number in _CHILD_SIGNALS:
                                signal.signal(number, signal.SIG_DFL)
                            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                            os.close(queue_write)
                            os.close(answer_read)
                            _child(tasks, target, queue_read, answer_write)
                            status = 0
                        finally:
                            os._exit(status)
                    try:
                        os.setpgid(pid, pid)  # (both sides set it: whichever runs first)
                    except OSError:
                        pass
                children.append(pid)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            gc.unfreeze()
    except OSError as err:
        logger.warning("could not fork compile processes (%s); %d started", err, len(children))
    except BaseException:
        for pid in children:  # interrupted while forking: no one would ever wait for these
            _kill(pid)
            _reap(pid)
        os.close(answer_read)
        raise
    finally:
        os.close(queue_write)
        os.close(queue_read)
        os.close(answer_write)
    return Compiling(tasks, progress, children, answer_read)


class Compiling:
    """Configs being compiled by forked children: wait for one kernel's, or for all."""

    def __init__(self, tasks: list[dict], progress, children: Sequence[int] = (), answers: Optional[int] = None):
        self.progress = progress
        self.children = list(children)
        self.left: dict[str, int] = {}  # configs per kernel not answered yet
        self.left_launch: dict[tuple, int] = {}  # the same per (kernel, launch_items of a config)
        self.launches = [(t["name"], launch_items(t["launch"])) for t in tasks]  # (kernel, launch) per task
        for name, launch in self.launches:
            self.left[name] = self.left.get(name, 0) + 1
            self.left_launch[(name, launch)] = self.left_launch.get((name, launch), 0) + 1
        self.summaries: list[dict] = []
        self.waited_s = 0.0  # spent blocked in wait_for and finish
        self._fd = answers if self.children else None
        if answers is not None and not self.children:
            os.close(answers)
        self._buffer = b""
        self._finished = False

    def wait_for(self, name: str, launch: Optional[tuple] = None) -> None:
        """Block until every config of kernel ``name`` is answered (compiled or refused),
        or only the one launched with ``launch`` (``launch_items``), or the children are
        gone or silent for ``STALL_S`` seconds."""
        begin = time.monotonic()
        if launch is None:
            while self.left.get(name, 0) > 0 and self._read():
                pass
        else:
            while self.left_launch.get((name, launch), 0) > 0 and self._read():
                pass
        self.waited_s += time.monotonic() - begin

    def finish(self) -> int:
        """Wait for every child's summary, reap them; returns the number of configs compiled."""
        global last_answered, last_slowest
        if self._finished:
            return sum(a.get("compiled", 0) for a in self.summaries)
        self._finished = True
        begin = time.monotonic()
        try:
            while len(self.summaries) < len(self.children) and self._read():
                pass
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            for pid in self.children:
                _reap(pid)
        self.waited_s += time.monotonic() - begin
        last_answered = sum(a.get("tried", 0) for a in self.summaries)
        last_slowest = max(
            ({k: float(a.get(f"{k}_s", 0.0)) for k in ("setup", "compile")} for a in self.summaries),
            key=lambda t: t["setup"] + t["compile"],
            default={},
        )
        if last_slowest:
            self.progress(
                f"compile processes done; the slowest spent {last_slowest['setup']:.1f} s starting "
                f"and {last_slowest['compile']:.1f} s compiling"
            )
        return sum(a.get("compiled", 0) for a in self.summaries)

    def _read(self) -> bool:
        """Take in the answers available (waiting for some); False once there is nothing
        more to wait for: every child's end of the pipe is closed, or none answered for
        ``STALL_S`` seconds (then they are stopped)."""
        if self._fd is None:
            return False
        poller = select.poll()  # not select(): it refuses descriptors past 1023
        poller.register(self._fd, select.POLLIN)
        if not poller.poll(STALL_S * 1000):
            logger.warning(
                "compile processes answered nothing for %d s; stopping them (their configs compile when timed)", STALL_S
            )
            self.abort()
            return False
        chunk = os.read(self._fd, 65536)
        if not chunk:  # every child exited (some maybe without a summary)
            self._close()
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if isinstance(answer, dict) and isinstance(answer.get("task"), int) and answer["task"] < len(self.launches):
                name, launch = self.launches[answer["task"]]
                self.left[name] -= 1
                self.left_launch[(name, launch)] -= 1
            elif isinstance(answer, dict) and "compiled" in answer:
                self.summaries.append(answer)
        return True

    def abort(self) -> None:
        """Stop the children now (the compile failed, or they are stuck)."""
        for pid in self.children:
            _kill(pid)
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.left, self.left_launch = {}, {}


def _kill(pid: int) -> None:
    """Kill a child and whatever it started (its ``ptxas``): its process group."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


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
    _kill(pid)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
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


_kept_streams: list = []


def _child(tasks: list[dict], target, queue: int, answers: int) -> None:
    """In a child: compile queued tasks until the queue is empty, then write one answer line."""
    start = time.perf_counter()
    compiled = tried = 0
    setup_s = 0.0
    try:
        # The compiler's chatter is not the user's output. New stream objects as well: another
        # thread of the parent may have held the old ones' locks at the fork, forever here.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        # The old objects are kept: dropping the last reference to one (a user's
        # ``sys.stdout = open(...)``) would flush its buffer a second time, from here.
        _kept_streams.extend((sys.stdout, sys.stderr))
        sys.stdout = sys.stderr = open(devnull, "w", closefd=False)
        logging.disable(logging.CRITICAL)  # nothing from here reaches the user's log handlers
        try:
            os.nice(10)  # the parent times kernels meanwhile: its timing loop goes first
        except OSError:
            pass
        import torch

        from .cache import module_from_source

        use_target(target)
        setup_s = time.perf_counter() - start
        modules: dict[str, Any] = {}
        while True:
            record = os.read(queue, _RECORD.size)
            if len(record) < _RECORD.size:
                break
            index = _RECORD.unpack(record)[0]
            task = tasks[index]
            tried += 1
            try:
                if task["path"] not in modules:
                    with open(task["path"]) as handle:
                        modules[task["path"]] = module_from_source(
                            f"autofuser_kernels.{task['name']}", handle.read(), task["path"]
                        )
                kernel = getattr(modules[task["path"]], task["name"])
                kernel.warmup(*[getattr(torch, d) for d in task["dtypes"]], grid=(1,), **task["launch"])
                compiled += 1
            except Exception:  # refused configs are refused again, with the error, when timed
                pass
            os.write(answers, (json.dumps({"task": index}) + "\n").encode())
    finally:
        line = (
            json.dumps(
                {
                    "compiled": compiled,
                    "tried": tried,
                    "setup_s": round(setup_s, 4),
                    "compile_s": round(time.perf_counter() - start - setup_s, 4),
                }
            )
            + "\n"
        )
        os.write(answers, line.encode())
