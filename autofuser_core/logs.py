"""``AUTOFUSER_LOG``: which parts of AutoFuser log, and how much, the way ``TORCH_LOGS`` does.

The value is a comma-separated list of components, each optionally prefixed:
``+`` logs it at DEBUG, no prefix at INFO, ``-`` only its errors::

    AUTOFUSER_LOG="+plan,tune"     # the planner's every decision, tuning's summary lines
    AUTOFUSER_LOG="all"            # every component at INFO
    AUTOFUSER_LOG="+all,-cache"    # everything at DEBUG but the cache

Each component is a child of the ``autofuser`` logger (``autofuser.plan``, ...), so
``logging.getLogger("autofuser")`` configured by hand keeps covering all of them.
``AUTOFUSER_DISABLE`` (read by ``fuse()``) is parsed here too, with the same care:
a value that is neither on nor off is an error rather than a guess.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from .errors import AutoFuserError

ROOT = "autofuser"

#: Component -> what it logs. Each is the logger ``autofuser.<component>``.
COMPONENTS = {
    "capture": "tracing the model: parts that stay opaque and why",
    "plan": "lowering and planning: every node left eager and every candidate refused",
    "tune": "config tuning and the compile workers",
    "verify": "fused-vs-eager checks and their mismatches",
    "cache": "the cache folder: entries read, written, refused",
    "compile": "the compile of a signature: its steps, fallbacks to the original model, backward groups",
}

_LEVELS = {"+": logging.DEBUG, "": logging.INFO, "-": logging.ERROR}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

#: The handler ``configure_from_env`` installed, and the value it was set from.
_installed: Optional[tuple[logging.Handler, str]] = None


def logger_of(component: str) -> logging.Logger:
    """The logger of one component (``autofuser.plan``)."""
    assert component in COMPONENTS, component
    return logging.getLogger(f"{ROOT}.{component}")


def parse_log_settings(text: str) -> dict[str, int]:
    """``AUTOFUSER_LOG``'s value -> ``{logger name: level}``, in the order given (a later
    entry overrides ``all`` for its component).

    :raises AutoFuserError: an unknown component or a malformed entry, naming it and
        listing the valid ones.
    """
    levels: dict[str, int] = {}
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        prefix, name = (entry[0], entry[1:]) if entry[0] in "+-" else ("", entry)
        if name == "all":
            levels = {f"{ROOT}.{c}": _LEVELS[prefix] for c in COMPONENTS}
        elif name in COMPONENTS:
            levels[f"{ROOT}.{name}"] = _LEVELS[prefix]
        else:
            known = ", ".join(["all", *COMPONENTS])
            raise AutoFuserError(
                f"AUTOFUSER_LOG={text!r}: {entry!r} is not a component. Give a comma-separated list of "
                f"{known}, each optionally prefixed with + (DEBUG) or - (errors only), "
                'e.g. AUTOFUSER_LOG="+plan,tune".'
            )
    return levels


def configure_from_env() -> None:
    """Apply ``AUTOFUSER_LOG`` (once per value): set each component's level and give the
    ``autofuser`` logger one handler on stderr. Unset or empty: leave logging alone.

    :raises AutoFuserError: the value is malformed (``parse_log_settings``).
    """
    global _installed
    text = os.environ.get("AUTOFUSER_LOG", "")
    if _installed is not None and _installed[1] == text:
        return
    levels = parse_log_settings(text)
    root = logging.getLogger(ROOT)
    if _installed is not None:
        root.removeHandler(_installed[0])
        root.propagate = True
        _installed = None
    for component in COMPONENTS:
        logging.getLogger(f"{ROOT}.{component}").setLevel(levels.get(f"{ROOT}.{component}", logging.NOTSET))
    if not levels:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
    root.addHandler(handler)
    # As TORCH_LOGS does: the records go to this handler alone, not a second time through
    # a handler the application put on the root logger.
    root.propagate = False
    _installed = (handler, text)


def disabled() -> bool:
    """Whether ``AUTOFUSER_DISABLE`` is on: ``fuse()`` then returns a module that runs
    the original model, compiling nothing.

    :raises AutoFuserError: a value that is neither on (1, true, yes, on) nor off
        (0, false, no, off, empty).
    """
    value = os.environ.get("AUTOFUSER_DISABLE", "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise AutoFuserError(
        f"AUTOFUSER_DISABLE={os.environ['AUTOFUSER_DISABLE']!r} is neither on nor off: set it to 1 to run "
        "every model unfused (fuse() compiles nothing), or 0 / unset it to fuse."
    )
