"""The last check of a speed decision, made where the model really runs: the first
calls after compiling.

The compile's whole-step and whole-forward checks time the fused model against the
original, back to back with nothing else in between. A user's loop holds more - the
loss, the optimiser, data loading, other work on the GPU, other processes on it - and
a fused model that won back to back can lose there (BENCHMARKS.md, "Training"), or the
compile's timings were themselves taken on a busy GPU. So a signature whose fused
training step, or fused inference forward, won at compile time (or whose forward's
verdict was provisional: inside the noise) starts on probation: after the compiling
call, its next ``len(PLAN)`` calls follow ``PLAN``, one call of the original to warm
it up, then blocks of ``BLOCK_CALLS`` calls of each runner in the order fused,
original, original, fused (drift over the calls reaches both alike). The timer marks
the start of every call in the device's stream order; the span from one call's start
to the next is that call's whole step, as the GPU ran it. Each runner's time is its
faster block's mean (a one-off stall - a checkpoint written, a collection - lands in
one block). On the call after the plan the check decides: the fused model stays only
if it was more than 2% faster (``FORWARD_MARGIN``) than the original and that lead is
clear of the spread of either side's blocks (slowest over fastest, the slowest of
three or more left out: ``timing.steady_spread``, ``timing.inside_spread``); a
verdict inside the spread is measured again by a second plan (``MAX_ROUNDS``), after
which the original runs unless it has come clear - by the lead, or by every one of
four fused blocks beating every one of the original's by the margin
(``SEPARATED_BLOCKS``: a noisy host spreads both sides' blocks wider than a real
lead) - and the verdict is provisional (``Settled.provisional``: not cached as final). Else the original runs for that
signature from then on. Both runners compute the same results within the verified
tolerance, so the calls of the plan are the user's calls as usual.

A call of other inputs between two calls of the plan breaks the spans: the plan starts
again, and after ``MAX_RESTARTS`` restarts it is given up (the compile's verdict
stands, and the report says so).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple, Optional

import torch

from .timing import Timer, inside_spread, steady_spread

BLOCK_CALLS = 4
PLAN = ("original",) + ("fused",) * BLOCK_CALLS + ("original",) * (2 * BLOCK_CALLS) + ("fused",) * BLOCK_CALLS
MAX_RESTARTS = 3
MAX_ROUNDS = 2  # plans at most: a second where the first's lead was inside the spread
#: Blocks on each side after which their order alone can settle a lead inside the spread:
#: every fused block faster than every block of the original by the margin. On a host
#: whose noise spreads each side's blocks wider than the lead, that still happens only
#: when the fused model is faster: were both alike, the chance that all four of one side
#: come before all four of the other is 1 in 70.
SEPARATED_BLOCKS = 4
STALE_CALLS = 64  # calls another check waits for one that makes no call of its plan, then takes over


class Settled(NamedTuple):
    """A check's outcome: which runs from then on, each side's ms per call, the spread."""

    runner: str  # "fused" or "original"
    fused_ms: float
    original_ms: float
    spread: float  # the largest (slowest - fastest) / fastest block of one side
    blocks: int  # blocks of each side measured
    provisional: bool  # the verdict was still inside the spread after MAX_ROUNDS plans


class InUseCheck:
    """One signature's probation; see the module doc. ``runner()`` before each call of
    it says which runs, ``"fused"`` or ``"original"``, or ``None`` once the plan is done
    and ``settle()`` decides."""

    def __init__(
        self,
        timer: Timer,
        device: torch.device,
        filing: Any = None,
        candidate: Any = None,
        compiled_ran: str = "fused",
    ):
        self.timer, self.device = timer, device
        self.filing = filing  # where and how the caller files the verdict
        self.candidate = candidate  # the caller's fused runner, where it is not what runs now
        self.calls = 0
        self.marks: list[Any] = []
        self.restarts = 0
        self.rounds = 1
        self.blocks: dict[str, list[float]] = {"fused": [], "original": []}  # ms per call, every plan's
        self.last = compiled_ran  # what the last call ran: the compiling call's runner
        self.turn_lost = False  # another check took the turn while this one's plan was under way

    def runner(self) -> Optional[str]:
        index = self.calls
        planned = PLAN[index] if index < len(PLAN) else None
        self.marks.append(self.timer.mark(self.device, planned == "fused"))
        if planned is not None:
            self.calls += 1
            self.last = planned
        return planned

    def interrupted(self) -> bool:
        """Calls of other inputs came between two of the plan: start it again. True when
        it has been started again too often and is given up."""
        self.calls, self.marks = 0, []
        self.restarts += 1
        return self.restarts > MAX_RESTARTS

    def separated(self, margin: float) -> bool:
        """Whether ``SEPARATED_BLOCKS`` or more blocks a side have every fused block more
        than ``margin`` faster than every block of the original."""
        fused, original = self.blocks["fused"], self.blocks["original"]
        if min(len(fused), len(original)) < SEPARATED_BLOCKS:
            return False
        return max(fused) < min(original) * (1.0 - margin)

    def settle(self, margin: float) -> Optional[Settled]:
        """The plan done: the fused model if it was more than ``margin`` faster and that
        lead is clear of the spread of either side's blocks; a verdict inside the spread
        is measured again with another plan (``None``: its calls follow), up to
        ``MAX_ROUNDS`` plans, and where it is still inside, the original runs (the safe
        side) and the verdict is provisional."""
        spans = [self.timer.between_ms(a, b) for a, b in zip(self.marks, self.marks[1:])]
        for start in range(1, len(PLAN), BLOCK_CALLS):
            self.blocks[PLAN[start]].append(sum(spans[start : start + BLOCK_CALLS]) / BLOCK_CALLS)
        fused, original = min(self.blocks["fused"]), min(self.blocks["original"])
        spread = max(steady_spread(times) for times in self.blocks.values())
        lead = (original - fused) / max(original, 1e-9)  # a clock that gave 0 ms
        unclear = inside_spread(lead, margin, spread) and not self.separated(margin)
        if unclear and self.rounds < MAX_ROUNDS:
            self.rounds += 1
            self.calls, self.marks = 0, []
            return None
        runner = "fused" if lead > margin and not unclear else "original"
        return Settled(runner, fused, original, spread, len(self.blocks["fused"]), unclear)


# One check's plan at a time, in the whole process: two fused modules in one loop (a
# generator and a critic) would otherwise run their plans in lock step, and each one's
# spans would take in the other's switch between fused and original.
_turn_lock = threading.Lock()
_holder: Optional["weakref.ref[InUseCheck]"] = None
_waited = 0


def take_turn(check: InUseCheck) -> bool:
    """Whether ``check`` may make a call of its plan now: no other check is under way, or
    the one that is made none of its calls while others waited ``STALE_CALLS`` calls (it
    then starts again when its turn comes back)."""
    global _holder, _waited
    with _turn_lock:
        holder = _holder() if _holder is not None else None
        if holder is None or holder is check:
            _holder, _waited = weakref.ref(check), 0
            return True
        _waited += 1
        if _waited <= STALE_CALLS:
            return False
        holder.turn_lost = True
        _holder, _waited = weakref.ref(check), 0
        return True


def end_turn(check: InUseCheck) -> None:
    """``check`` settled or was given up: the next check may go."""
    global _holder, _waited
    with _turn_lock:
        if _holder is not None and _holder() is check:
            _holder, _waited = None, 0
