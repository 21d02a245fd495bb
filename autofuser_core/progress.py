"""The compile's progress: one short line on stderr naming the model and the step.

On a terminal the line is rewritten in place (``\\r``) as the compile moves on, with a
bar where the step has a count (``verify [####......] 3/7 af_mm_...``), cut to the
terminal's width; elsewhere (a log file, CI) a line is printed when the step changes
and, within a long step, at most every ``HEARTBEAT_S``, so a long compile is never
silent and a log never fills with redraws. Every message also goes to the
``autofuser.compile`` logger at INFO (``AUTOFUSER_LOG=compile``).

``Progress`` is the ``progress`` callable the compile passes down: ``progress(message)``
for a message from inside a step (tuning, re-planning), ``step(progress, ...)`` for a
step and its count, a no-op where ``progress`` is a plain function.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import Any, Callable, Optional, TextIO

logger = logging.getLogger("autofuser.compile")

HEARTBEAT_S = 5.0  # without a terminal: the longest silence within one step
REDRAW_S = 0.1  # on a terminal: the shortest time between two redraws
BAR = 10  # characters of the bar
LOG_WIDTH = 119  # without a terminal: the longest line


class Progress:
    """The progress line of one compile of ``model`` (its display name)."""

    def __init__(self, model: str, enabled: bool, stream: Optional[TextIO] = None):
        self.model = model
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        isatty = getattr(self.stream, "isatty", None)
        self.live = enabled and callable(isatty) and bool(isatty())
        self.started = time.perf_counter()
        self.phase, self.done, self.total, self.detail = "", 0, 0, ""
        self._drawn_at = 0.0
        self._printed_at = 0.0

    def __call__(self, message: str) -> None:
        """A message from inside the current step."""
        logger.info("%s: %s", self.model, message)
        self.detail = message
        self._show(force=False)

    def step(self, phase: str, done: int = 0, total: int = 0, detail: str = "") -> None:
        """The compile is at ``phase``, ``done`` of ``total`` items (0: no count)."""
        changed = phase != self.phase
        if changed:
            logger.info("%s: %s", self.model, phase)
        self.phase, self.done, self.total, self.detail = phase, done, total, detail
        self._show(force=changed)

    def finish(self, message: str) -> None:
        """The compile's last line, kept on screen."""
        logger.info("%s: %s", self.model, message)
        if not self.enabled:
            return
        line = f"autofuser: {self.model}: {message}"
        if self.live:
            self.stream.write("\r" + self._fit(line) + "\x1b[K\n")
        else:
            self.stream.write(self._fit(line) + "\n")
        self.stream.flush()

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.started
        count = ""
        if self.total:
            filled = BAR * min(self.done, self.total) // self.total
            count = f" [{'#' * filled}{'.' * (BAR - filled)}] {self.done}/{self.total}"
        detail = f" {self.detail}" if self.detail else ""
        return f"autofuser: {self.model}: {self.phase or 'compiling'}{count} {elapsed:.0f} s{detail}"

    def _fit(self, line: str) -> str:
        width = shutil.get_terminal_size((100, 20)).columns - 1 if self.live else LOG_WIDTH
        return line if len(line) <= width else line[: max(width - 3, 10)] + "..."

    def _show(self, force: bool) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.live:
            if force or now - self._drawn_at >= REDRAW_S:
                self.stream.write("\r" + self._fit(self._line()) + "\x1b[K")
                self.stream.flush()
                self._drawn_at = now
        elif force or now - self._printed_at >= HEARTBEAT_S:
            self.stream.write(self._fit(self._line()) + "\n")
            self.stream.flush()
            self._printed_at = now


def step(progress: Callable[[str], Any], phase: str, done: int = 0, total: int = 0, detail: str = "") -> None:
    """Tell ``progress`` the compile's step, where it is a ``Progress`` (a plain callable,
    as tests and a group's backward compile pass, has no steps)."""
    if isinstance(progress, Progress):
        progress.step(phase, done, total, detail)


def short_inputs(parts: list[str], keep: int = 3) -> str:
    """A call's inputs for the progress line: the first few, then how many more (a
    torch.compile graph takes every parameter as an input: hundreds)."""
    shown = ", ".join(parts[:keep])
    more = f", +{len(parts) - keep} more" if len(parts) > keep else ""
    return f"({shown}{more})"
