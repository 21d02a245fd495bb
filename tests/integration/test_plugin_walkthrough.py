"""docs/writing-a-plugin.md runs: its code blocks, in order, in one namespace.

A block whose first line is ``# file: NAME`` is written to NAME in a fresh
folder (on ``sys.path``, and the working directory) instead of being run;
``bash`` blocks are shown to the reader only. So the walk-through can't rot:
if the API it uses changes, this test fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def _blocks():
    return [(language, body) for language, body in BLOCK.findall(DOC.read_text())]


def test_the_doc_has_the_steps_it_promises():
    blocks = _blocks()
    files = [body.splitlines()[0] for _, body in blocks if body.startswith("# file: ")]
    assert files == ["# file: softsign_plugin.py", "# file: pyproject.toml"]
    assert sum(language == "python" and not body.startswith("# file: ") for language, body in blocks) >= 4


def test_walkthrough_code_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {"__name__": "walkthrough"}
    ran = 0
    try:
        for k, (language, body) in enumerate(_blocks()):
            first = body.splitlines()[0]
            if first.startswith("# file: "):
                (tmp_path / first.removeprefix("# file: ").strip()).write_text(body)
            elif language == "python":
                exec(compile(body, f"{DOC.name} block {k}", "exec"), namespace)
                ran += 1
    finally:
        sys.modules.pop("softsign_plugin", None)
    assert ran >= 4
