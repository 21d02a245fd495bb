"""Timing kernels and eager code on the GPU, and the one place compiling asks how to time.

Three measurements live here: ``median_call_ms`` (calls back to back between CUDA events,
as a loop of forwards runs them), ``bench`` (L2 flushed before each call, a capped
number of calls: what tuning and each group's fused-vs-eager check use) and
``forward_ms`` (a whole forward called back to back, no flush: what the whole-forward
check and the CUDA graph's check use), with ``forward_once_ms`` (one call, wall clock:
how long the host took to queue it, and the GPU to finish it).

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
(``current()``), whether to tune, whether to time fused against eager (each group, and
the whole forward), and for each measurement. ``using(timer)`` puts another one in place
for a stretch of code (a test timing on the interpreter with a stand-in clock, a tool
recording every measurement)::

    with autofuser_core.timing.using(MyTimer()):
        fused = autofuser.fuse(model)
        fused(x)   # compiles here: tuning and the speed check ask MyTimer
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

#: Most timed calls per measurement. A typical fused kernel runs for less time on the GPU than
#: the host takes to launch it and its two events, so the number of calls, not ``rep_ms``,
#: sets how long tuning takes (BENCHMARKS.md, "Measurements behind rules in the code"). 30
#: calls give a stable median.
BENCH_MAX_CALLS = 30
#: About how long ``forward_ms`` spends calling a forward; one longer than this on its own is
#: called 3 times after 1 warm-up.
FORWARD_BUDGET_MS = 25.0


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


@contextlib.contextmanager
def uncached_casts() -> Iterator[None]:
    """Autocast's cache of cast parameters off inside, as it was on leaving. Every CUDA graph
    is warmed up and captured inside it: a cast cached while warming up would be read by the
    graph from memory that autocast frees when its region ends (a replay then reads whatever
    took that memory), and one cached while capturing would hold values never computed."""
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cache)


def graph_ms(fn, *args, rep_ms: float = 20) -> Optional[float]:
    """Milliseconds of one replay of ``fn(*args)`` captured as one CUDA graph (``bench`` of
    the replay: the GPU's time, no launch on the host), or ``None`` where it can't be
    captured (an argument not on a GPU, a host sync, an op a graph can't hold). Two calls
    on a side stream warm it up first (lazy initialisations must not be captured); the
    graph and its memory go when it is timed. Captured on that stream with
    ``capture_begin``/``capture_end``, not ``torch.cuda.graph``, whose entry waits for the
    device and empties the allocator's cache: a compile times two captures per group."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(not t.is_cuda for t in tensors):
        return None
    graph = torch.cuda.CUDAGraph()
    try:
        with _on_device(args), uncached_casts():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn(*args)
                # Only this thread's calls may break the capture (another thread's, on its
                # own stream, neither breaks it nor is captured).
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    fn(*args)
                finally:
                    graph.capture_end()  # raises where the capture was broken
            torch.cuda.current_stream().wait_stream(stream)
    except Exception:  # noqa: BLE001 - not capturable: the caller times it launched
        torch.cuda.synchronize()
        del graph
        return None
    try:
        return bench(graph.replay, rep_ms=rep_ms)
    finally:
        del graph


def _on_device(args: Sequence[Any]):
    """A context making the device of the first CUDA tensor in ``args`` current (none: the
    current device stays)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def forward_once_ms(fn, args: Sequence[Any]) -> tuple[float, float]:
    """One call of ``fn(*args)`` on the device of ``args``: (ms until the host returned from
    it, ms until the GPU finished it), wall clock from a synchronised start."""
    with _on_device(args):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        fn(*args)
        queued = time.perf_counter()
        torch.cuda.synchronize()
        return (queued - begin) * 1e3, (time.perf_counter() - begin) * 1e3


def forward_ms(fn, args: Sequence[Any], once_ms: Optional[float] = None) -> float:
    """Median ms per call of ``fn(*args)`` called back to back, as a loop of forwards runs:
    each call between two CUDA events, no cache flush between calls (a flush would also
    give the host a head start, hiding launch overhead), about ``FORWARD_BUDGET_MS`` of calls
    after two warm-up calls. On the device of the first tensor argument (``args`` or, for
    a closure over the call's arguments, the current device). ``once_ms``: one call's time,
    where the caller has just measured it (else the first call measures it)."""
    with _on_device(args):
        if once_ms is None:
            _, once_ms = forward_once_ms(fn, args)
        # A forward longer than the budget on its own: 3 calls after 1 warm-up (5 calls and 2
        # warm-ups of the zoo's eager Transformer would cost seconds: BENCHMARKS.md, Model zoo).
        slow = once_ms > FORWARD_BUDGET_MS
        calls = 3 if slow else max(5, min(100, int(FORWARD_BUDGET_MS / max(once_ms, 1e-3))))
        return median_call_ms(lambda: fn(*args), calls, warmup=1 if slow else 2)


class Timer:
    """How compiling measures, and whether it does: the GPU's timer.

    Subclass it to measure another way (or to stand in for a GPU under the interpreter)
    and put it in place with ``using``. ``bench``, ``can_tune`` and ``can_time`` are asked
    for each kernel or group; ``forward_ms``, ``forward_once_ms`` and ``can_time_forward``
    for each compiled signature of a model (the whole-forward check, and whether a CUDA
    graph pays); ``can_time_in_use``, ``mark`` and ``between_ms`` for the first calls of
    a fused training step as the user makes them (``in_use``)."""

    def bench(self, fn, *args, rep_ms: float = 20) -> float:
        """Milliseconds one call of ``fn(*args)`` takes (``bench``); ``rep_ms``: about how
        long to spend measuring a short call."""
        return bench(fn, *args, rep_ms=rep_ms)

    def graph_ms(self, fn, *args, rep_ms: float = 20) -> Optional[float]:
        """Milliseconds of one replay of ``fn(*args)`` captured as one CUDA graph, or ``None``
        where it can't be captured (``graph_ms``): a training step's groups, when the step
        will replay as CUDA graphs, where launching costs the host nothing."""
        return graph_ms(fn, *args, rep_ms=rep_ms)

    def can_tune(self, device: torch.device, options) -> bool:
        """Whether to tune a kernel's configs: only on a GPU (the interpreter's timings
        mean nothing), and only when the user asked for it (``options.tune``)."""
        return device.type == "cuda" and options.tune

    def can_time(self, device: torch.device, options) -> bool:
        """Whether to time each verified group, fused against eager, and keep the faster:
        like tuning, only on a GPU, and when asked for (``options.verify_speed``)."""
        return device.type == "cuda" and options.verify_speed

    def forward_ms(self, fn, args: Sequence[Any], once_ms: Optional[float] = None) -> float:
        """Milliseconds one call of a whole forward ``fn(*args)`` takes, called back to back
        without flushing L2 (``forward_ms``); ``once_ms``: one call's time, where the caller
        has just measured it with ``forward_once_ms`` (else one more call measures it)."""
        return forward_ms(fn, args, once_ms)

    def forward_once_ms(self, fn, args: Sequence[Any]) -> tuple[float, float]:
        """One call of ``fn(*args)``: (ms until the host returned from it, ms until the GPU
        finished it) (``forward_once_ms``)."""
        return forward_once_ms(fn, args)

    def can_time_forward(self, device: torch.device) -> bool:
        """Whether to time whole forwards on ``device`` (fused against eager, a CUDA graph
        against launching): only on a GPU, where the timings mean something. The caller
        checks ``options.verify_speed`` and that the forward is for inference."""
        return device.type == "cuda"

    def can_time_in_use(self, device: torch.device) -> bool:
        """Whether to time the first calls of a fused training step as the user makes them
        (``in_use``): only on a GPU. The caller checks ``options.verify_speed``."""
        return device.type == "cuda"

    def mark(self, device: torch.device, fused: bool) -> Any:
        """A mark of now in ``device``'s stream order (a CUDA event on its current stream),
        made as a call of the ``fused`` runner (or the original) starts."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def between_ms(self, start: Any, end: Any) -> float:
        """Milliseconds from mark ``start`` to mark ``end`` (waits for ``end``)."""
        end.synchronize()
        return float(start.elapsed_time(end))


def spread_of(times: Sequence[float]) -> float:
    """How far apart repeated measurements of one thing are: (slowest - fastest) /
    fastest; 0 for one measurement."""
    fastest = min(times)
    return (max(times) - fastest) / max(fastest, 1e-9)  # a clock that gave 0 ms


def steady_spread(times: Sequence[float]) -> float:
    """``spread_of`` the measurements less their slowest, where there are three or more:
    a one-off stall (a collection, a checkpoint written, another process's burst) lands
    in one block or round, which the estimate (the fastest) already ignores, and it must
    not alone make a verdict unclear; noise shows in two slow ones. With fewer
    measurements there is nothing to leave out."""
    kept = sorted(times)[:-1] if len(times) >= 3 else list(times)
    return spread_of(kept)


def inside_spread(lead: float, margin: float, spread: float) -> bool:
    """Whether a speed decision is unclear: a candidate's ``lead`` over the baseline (a
    share of the baseline's time, negative where it is slower) is within ``spread`` (the
    measurements' own scatter, ``spread_of``) of the ``margin`` it must beat. Noise of
    that size could put the lead on either side of the margin."""
    return spread > 0 and abs(lead - margin) <= spread


class Rounds:
    """Two candidates timed in alternating rounds: each round's ms of each side. The best
    round of each side counts (a slow moment lands in one round); the spread of either
    side's rounds says how far to trust the difference."""

    def __init__(self) -> None:
        self.candidate: list[float] = []
        self.baseline: list[float] = []

    @property
    def candidate_ms(self) -> float:
        return min(self.candidate)

    @property
    def baseline_ms(self) -> float:
        return min(self.baseline)

    @property
    def rounds(self) -> int:
        return min(len(self.candidate), len(self.baseline))

    @property
    def spread(self) -> float:
        """The larger side's ``steady_spread``."""
        return max(steady_spread(self.candidate), steady_spread(self.baseline))

    @property
    def lead(self) -> float:
        """The candidate's lead over the baseline, a share of the baseline's time."""
        return (self.baseline_ms - self.candidate_ms) / max(self.baseline_ms, 1e-9)

    def verdict(self, margin: float) -> Optional[bool]:
        """Whether the candidate beats the baseline by more than ``margin``: ``True`` or
        ``False`` where the lead is clear of the spread, ``None`` where it is inside."""
        if inside_spread(self.lead, margin, self.spread):
            return None
        return self.lead > margin


class TrainingStep:
    """``forward`` and its backward as one callable of ``forward``'s inputs: what a
    training step costs, for the checks that time fused against eager with gradients on
    (each group, and the whole step). Each call runs ``forward`` with gradients on and
    ``torch.autograd.grad`` of its floating-point outputs that need gradients (each
    weighted by ones) with respect to ``params`` and the inputs that need gradients, so
    no ``.grad`` is written. ``fused`` says which side it is (a stand-in timer reads it)."""

    def __init__(self, forward: Callable[..., Any], params: Sequence[torch.Tensor] = (), fused: bool = False):
        self.forward, self.params, self.fused = forward, list(params), fused

    def __call__(self, *inputs: Any) -> None:
        self._step(inputs, None)

    def outputs_and_gradients(self, *inputs: Any, seed: int) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
        """One step's floating-point outputs that need gradients (detached), and its
        gradients (``params``, then the inputs that need them; ``None`` where one gets
        none), each output weighted by normal values drawn from ``seed`` (and its place),
        the same for every side whose outputs have the same shapes (ones would give a
        centred output, a norm's, zero gradients)."""
        return self._step(inputs, seed)

    def _step(self, inputs: tuple, seed: Optional[int]) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
        with torch.enable_grad():
            leaves = self.params + [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
            found = self.forward(*inputs)
            outputs = [
                t
                for t in pytree.tree_leaves(found)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
            ]
            if not (outputs and leaves):
                return [t.detach() for t in outputs], [None] * len(leaves)
            if seed is None:
                weights = [torch.ones_like(t) for t in outputs]
            else:
                weights = [
                    torch.randn(
                        t.shape,
                        generator=torch.Generator(device=t.device).manual_seed(seed + k),
                        device=t.device,
                        dtype=torch.float32,
                    ).to(t.dtype)
                    for k, t in enumerate(outputs)
                ]
            grads: list[Optional[torch.Tensor]] = list(torch.autograd.grad(outputs, leaves, weights, allow_unused=True))
            return [t.detach() for t in outputs], grads


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
