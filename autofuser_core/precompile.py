"""Compiling tuning candidates in parallel, before they are timed.

Tuning times every valid config of every new kernel, and on a GPU most of a
cold compile is Triton compiling those configs one after another. Compiling
is independent of timing: worker processes compile every (kernel, config)
pair up front through Triton's own ``warmup`` entry point, which stores the
binaries in Triton's on-disk cache under the key a real launch computes; the
timing loop then finds each binary there instead of compiling it.

Only tensors of the kernel's dtypes are described to the workers (generated
kernels take tensors and compile-time constants only), as 16-byte-aligned
pointers, which is what freshly allocated tensors are. A launch whose tensor
is not so aligned just compiles its own variant, as it would have anyway.

The workers are plain subprocesses running this module (``python -m
autofuser_core.precompile``), never ``multiprocessing`` children: those
re-import the user's main script, which without an ``if __name__ ==
"__main__":`` guard would run the user's whole program again in every worker.
On a cache with no tuning result yet, where every kernel will compile, the
workers start when a compile begins (they import torch and Triton while the
graph is planned, without touching the GPU); otherwise only once some kernel
is found untuned, no more of them than there are configs to compile, so a
warm cache starts none. They serve every planning round of that compile: each
reads one line of tasks per round on stdin and answers with how many
compiled, so a later round pays neither the imports nor Triton's
first-compile set-up again (a round with more configs than workers starts
more, up to the limit). The compile stops its workers when it ends
(``shutdown``); a worker left without work never touches the GPU. A worker
that fails or hangs costs speed, never correctness: a config it did not
compile is compiled when it is timed, and the worker is dropped from the
pool.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger("autofuser")

#: Seconds a compile waits for its workers before giving up on them.
WAIT_S = 900

_workers: list[subprocess.Popen] = []
#: Tasks the workers of the last ``precompile`` call answered for (compiled or refused).
last_answered = 0


@dataclass(frozen=True)
class CompileJob:
    """One kernel file and the launches to compile it for."""

    path: str  # the kernel's source file (Triton reads the source from it)
    name: str  # the @triton.jit function (or chain launcher) in it
    dtypes: tuple[str, ...]  # one per tensor argument, in call order ("float32", ...)
    launches: tuple[tuple[tuple[str, Any], ...], ...]  # constexprs, num_warps, num_stages per config


def workers() -> int:
    """Worker processes: ``AUTOFUSER_COMPILE_WORKERS``, else the cores this process may
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
    return workers() > 0 and os.environ.get("TRITON_INTERPRET") != "1"


def start_workers(at_most: Optional[int] = None) -> None:
    """Start workers in the background, so that their imports overlap what runs
    meanwhile: ``workers()`` of them, or ``at_most`` (one per task), counting those
    already running."""
    wanted = workers() if at_most is None else min(workers(), at_most)
    if not _enabled() or len(_workers) >= wanted:
        return
    import autofuser_core

    root = os.path.dirname(os.path.dirname(os.path.abspath(autofuser_core.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            env["AUTOFUSER_COMPILE_DEVICE"] = str(torch.cuda.current_device())  # this rank's GPU, not GPU 0
    except Exception:
        pass
    try:
        for _ in range(wanted - len(_workers)):
            _workers.append(subprocess.Popen(
                [sys.executable, "-m", "autofuser_core.precompile"], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    except OSError as err:
        logger.warning("could not start compile workers (%s); configs compile one by one when timed", err)
        shutdown()


def precompile(jobs: list[CompileJob], progress) -> int:
    """Compile every job's launches on the workers; returns the number compiled.

    Blocks until the workers answer (at most ``WAIT_S``). Returns 0 without doing
    anything where parallel compilation is off (``AUTOFUSER_COMPILE_WORKERS=0``) or
    under Triton's interpreter. The workers stay up for the next call, until ``shutdown``.
    """
    tasks = [{"path": j.path, "name": j.name, "dtypes": list(j.dtypes), "launch": dict(launch)}
             for j in jobs for launch in j.launches]
    global last_answered
    last_answered = 0
    if not _enabled() or not tasks:
        return 0
    start_workers(len(tasks))
    pool = list(_workers)
    if not pool:
        return 0
    progress(f"compiling {len(tasks)} config(s) of {len(jobs)} kernel(s) on {len(pool)} worker process(es)")
    shares = [tasks[k::len(pool)] for k in range(len(pool))]  # one config per task, spread round robin
    deadline = time.monotonic() + WAIT_S

    answers: list[tuple[int, int]] = []
    with ThreadPoolExecutor(max_workers=len(pool)) as talkers:  # each worker fed and read at once
        talks = [(proc, talkers.submit(_talk, proc, json.dumps(share) + "\n"))
                 for proc, share in zip(pool, shares) if share]
        for proc, talk in talks:
            try:
                answer = talk.result(timeout=max(1.0, deadline - time.monotonic()))
                answers.append((int(answer["compiled"]), int(answer["tried"])))
                continue
            except FutureTimeout:
                logger.warning("a compile worker did not answer within %d s; its configs compile when timed", WAIT_S)
            except (ValueError, KeyError, TypeError, OSError):
                logger.debug("a compile worker exited without an answer (code %s)", proc.poll())
            _stop(proc)  # also ends a write or read still blocked in its thread
            _workers.remove(proc)
    last_answered = sum(tried for _, tried in answers)
    return sum(done for done, _ in answers)


def _talk(proc: subprocess.Popen, tasks: str) -> dict:
    """Send a worker its line of tasks and return its answer (``OSError`` if it exited).
    Lines that are not an answer (something the compiler printed) are skipped."""
    proc.stdin.write(tasks)
    proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if not line:
            raise OSError("the worker exited")
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and "compiled" in answer:
            return answer


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.communicate(timeout=5)
    except Exception:
        pass


def shutdown() -> None:
    """Stop every worker: the compile that started them is over."""
    while _workers:
        _stop(_workers.pop())


atexit.register(shutdown)


def launch_items(launch_args: dict) -> tuple[tuple[str, Any], ...]:
    """A launch's keyword arguments (``KernelSource.launch_args``), hashable."""
    return tuple(sorted(launch_args.items()))


def _compile_tasks(tasks: list[dict]) -> int:
    """In a worker: import each kernel file and warm up its launches; returns how many compiled."""
    import torch

    from .cache import module_from_source

    modules: dict[str, Any] = {}
    done = 0
    for task in tasks:
        try:
            if task["path"] not in modules:
                with open(task["path"]) as handle:
                    modules[task["path"]] = module_from_source(f"autofuser_kernels.{task['name']}", handle.read(),
                                                               task["path"])
            kernel = getattr(modules[task["path"]], task["name"])
            kernel.warmup(*[getattr(torch, d) for d in task["dtypes"]], grid=(1,), **task["launch"])
            done += 1
        except Exception:  # refused configs are refused again, with the error, when timed
            pass
    return done


def _worker_main() -> None:
    try:
        import torch  # noqa: F401  (imports while waiting: the slow part of a worker's start)
        import triton  # noqa: F401
    except Exception:
        pass
    device_set = False
    for line in sys.stdin:  # one list of tasks per planning round, until the compile stops the worker
        compiled, tasks = 0, []
        try:
            tasks = json.loads(line) if line.strip() else []
            if tasks and not device_set:
                # Only now touch the GPU: a worker stopped unused never holds a CUDA context.
                device = os.environ.get("AUTOFUSER_COMPILE_DEVICE")
                if device is not None:
                    torch.cuda.set_device(int(device))
                device_set = True
            compiled = _compile_tasks(tasks)
        except Exception:
            pass
        finally:
            print(json.dumps({"compiled": compiled, "tried": len(tasks)}), flush=True)


if __name__ == "__main__":
    _worker_main()
