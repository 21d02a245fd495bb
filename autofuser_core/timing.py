"""Timing kernels and eager code on the GPU, and the one place compiling asks how to time.

Two measurements live here: ``median_call_ms`` (calls back to back between CUDA events,
as a loop of forwards runs them) and ``bench`` (L2 flushed before each call, a capped
number of calls: what tuning and the fused-vs-eager check use).

Why our own and not ``triton.testing.do_bench``: ``do_bench`` also flushes L2 before each
call and can return the median, but it times ``rep`` milliseconds of calls whatever their
number (a kernel of 10 us under its default of 100 ms is 10,000 calls, and each call
costs more host time than the kernel takes on the GPU, so tuning's time would be set by
the count), runs warm-up calls for ``warmup`` milliseconds, and estimates a call's time
from five calls timed together with their flushes. ``bench`` instead caps the calls at
``BENCH_MAX_CALLS`` (at least 5), measures a call that alone takes ``rep_ms`` or more by
three calls (an eager attention of 40 ms would otherwise cost many), and estimates from
three calls each timed on its own. And whole-forward timing must not flush at all (a
flush gives the host a head start and hides launch overhead), which ``do_bench`` always
does. tests/integration/test_cuda.py checks that ``bench`` measures what ``do_bench`` does.

Compiling never calls these functions directly: it asks the current ``Timer``
(``current()``), whether to tune, whether to time fused against eager, and for each
measurement. ``using(timer)`` puts another one in place for a stretch of code (a test
timing on the interpreter with a stand-in clock, a tool recording every measurement)::

    with autofuser_core.timing.using(MyTimer()):
        fused = autofuser.fuse(model)
        fused(x)   # compiles here: tuning and the speed check ask MyTimer
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
from typing import Callable, Iterator

import torch

#: Most timed calls per measurement. A typical fused kernel runs for less time on the GPU than
#: the host takes to launch it and its two events, so the number of calls, not ``rep_ms``,
#: sets how long tuning takes (BENCHMARKS.md, "Measurements behind rules in the code"). 30
#: calls give a stable median.
BENCH_MAX_CALLS = 30


def median_call_ms(fn: Callable[[], object], calls: int, warmup: int, before=None) -> float:
    """Median ms of one call of ``fn()`` on the current CUDA device: ``warmup`` untimed
    calls, then ``calls`` calls back to back, each between two CUDA events (and each
    after ``before()``, outside the events, where given)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(start.elapsed_time(end) for start, end in events))


def bench(fn, *args, rep_ms: float = 20) -> float:
    """Median ms of one call of ``fn(*args)`` on the current CUDA device, L2 flushed before
    each call (as Triton's ``do_bench``): after an untimed call (it loads the kernel), three
    timed calls; a call of ``rep_ms`` or more is measured by those three (an eager attention
    of 40 ms would otherwise cost nine calls), a shorter one by about ``rep_ms`` of further
    calls, at least 5 and at most ``BENCH_MAX_CALLS``."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    call = lambda: fn(*args)  # noqa: E731
    estimate_ms = median_call_ms(call, 3, warmup=1, before=flush.zero_)
    if estimate_ms >= rep_ms:
        return estimate_ms
    calls = max(5, min(BENCH_MAX_CALLS, int(rep_ms / max(estimate_ms, 1e-3))))
    return median_call_ms(call, calls, warmup=0, before=flush.zero_)


class Timer:
    """How compiling measures, and whether it does: the GPU's timer.

    Subclass it to measure another way (or to stand in for a GPU under the interpreter)
    and put it in place with ``using``. Each method is asked once per kernel or group."""

    def bench(self, fn, *args, rep_ms: float = 20) -> float:
        """Milliseconds one call of ``fn(*args)`` takes (``bench``); ``rep_ms``: about how
        long to spend measuring a short call."""
        return bench(fn, *args, rep_ms=rep_ms)

    def can_tune(self, device: torch.device, options) -> bool:
        """Whether to tune a kernel's configs: only on a GPU (the interpreter's timings
        mean nothing), and only when the user asked for it (``options.tune``)."""
        return device.type == "cuda" and options.tune

    def can_time(self, device: torch.device, options) -> bool:
        """Whether to time each verified group, fused against eager, and keep the faster:
        like tuning, only on a GPU, and when asked for (``options.verify_speed``)."""
        return device.type == "cuda" and options.verify_speed


_CURRENT: contextvars.ContextVar[Timer] = contextvars.ContextVar("autofuser_timer", default=Timer())


def current() -> Timer:
    """The timer compiling asks now: the innermost ``using``'s, else the GPU's ``Timer``."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(timer: Timer) -> Iterator[Timer]:
    """Compiling measures with ``timer`` inside the block: in this thread or task, and in
    those started from it in a copy of its context (``contextvars.copy_context().run``);
    a thread started plainly sees the GPU's ``Timer``."""
    token = _CURRENT.set(timer)
    try:
        yield timer
    finally:
        _CURRENT.reset(token)
