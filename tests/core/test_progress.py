"""Tests of autofuser_core.progress: one line that a terminal sees rewritten in place
(model, step, bar, count), and that a log sees once per step."""

from __future__ import annotations

import io

from autofuser_core import progress as progress_module
from autofuser_core.progress import Progress, short_inputs, step


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_is_rewritten_with_a_bar(monkeypatch):
    monkeypatch.setattr(progress_module, "REDRAW_S", 0.0)
    out = Terminal()
    bar = Progress("Solver", True, out)
    bar.step("capture")
    for done in range(4):
        step(bar, "verify", done, 7, f"af_kernel_{done}")
    bar("tuning af_kernel_3: 5 configs")
    bar.finish("compiled in 1.0 s: 3 fused kernel(s)")
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, kept at the end
    frames = text.split("\r")[1:]
    assert frames[0].startswith("autofuser: Solver: capture 0 s")
    assert frames[4].startswith("autofuser: Solver: verify [####......] 3/7 0 s af_kernel_3")
    assert "tuning af_kernel_3: 5 configs" in frames[5]
    assert frames[-1] == "autofuser: Solver: compiled in 1.0 s: 3 fused kernel(s)\x1b[K\n"


def test_in_a_log_a_line_per_step_and_a_heartbeat(monkeypatch):
    out = io.StringIO()
    log = Progress("Solver", True, out)
    log.step("plan")
    for done in range(50):
        log.step("verify", done, 50, "af_x")  # within the heartbeat: only the step's first line
    log.finish("compiled")
    lines = out.getvalue().splitlines()
    assert lines == [
        "autofuser: Solver: plan 0 s",
        "autofuser: Solver: verify [..........] 0/50 0 s af_x",
        "autofuser: Solver: compiled",
    ]
    monkeypatch.setattr(progress_module, "HEARTBEAT_S", 0.0)
    log.step("verify", 10, 50)
    assert out.getvalue().splitlines()[-1].startswith("autofuser: Solver: verify [##........] 10/50")


def test_off_prints_nothing_and_long_lines_are_cut():
    out = Terminal()
    quiet = Progress("Solver", False, out)
    quiet.step("verify", 1, 2)
    quiet.finish("done")
    assert out.getvalue() == ""
    log = io.StringIO()
    Progress("M" * 300, True, log).step("capture")
    assert len(log.getvalue().rstrip("\n")) == progress_module.LOG_WIDTH
    assert short_inputs([f"float32[{n}]" for n in range(40)]) == "(float32[0], float32[1], float32[2], +37 more)"
