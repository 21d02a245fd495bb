"""torch.compile's modes in the kernel benchmarks (bandwidth, matmul, attention, conv,
mxint8, fft_plugin), as ``autofuser bench`` measures them: a ``--compile-modes`` option
(default: the default mode and ``reduce-overhead``), each mode its own column.

``reduce-overhead`` is Inductor's kernels replayed as CUDA graphs, the like-for-like
competitor of AutoFuser's own CUDA-graph replay. Its compiled callable here marks a new
step before each call (``torch.compiler.cudagraph_mark_step_begin``), so every timed call
is a replay of the recorded graph, never a refusal to replay because an earlier call's
outputs might still be read. On a CPU Inductor records no CUDA graph, and the mode runs
the default mode's kernels.

Each mode's cells are keyed as its column is titled, as in ``autofuser bench``:
``torch.compile`` for the default mode, ``torch.compile <mode>`` for another. A suite's
table shows the modes its rows have, so results written before a mode was measured, or
under the keys the suites used before (``compile``, ``compile-max``), still read.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Iterable

import torch

from autofuser.cli import COMPILE_MODES, DEFAULT_COMPILE_MODES, compile_modes

#: Modes whose compiled callable replays CUDA graphs (on CUDA).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
#: Keys of cells written before ``--compile-modes``, and their mode.
LEGACY_KEYS = {"compile": "default", "compile-max": "max-autotune-no-cudagraphs"}


def parse_compile_modes(text: str) -> tuple[str, ...]:
    """``--compile-modes``: comma-separated torch.compile modes, each named once (the
    bench's own parser: one rule for both)."""
    return compile_modes(text, hint="")


def add_compile_modes_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-modes",
        default=DEFAULT_COMPILE_MODES,
        type=parse_compile_modes,
        metavar="MODES",
        help=f"torch.compile modes, comma-separated, each its own column: {', '.join(COMPILE_MODES)} "
        f"(default: {','.join(DEFAULT_COMPILE_MODES)}; reduce-overhead is timed as its CUDA-graph replays; "
        "a mode that fails is an error cell)",
    )


def compile_key(mode: str) -> str:
    """The cell key, and column title, of torch.compile in ``mode``."""
    return "torch.compile" if mode == "default" else f"torch.compile {mode}"


def mode_of(key: str) -> str:
    """The torch.compile mode of cell key ``key`` (``compile_key``'s inverse; old keys too)."""
    if key in LEGACY_KEYS:
        return LEGACY_KEYS[key]
    if key == "torch.compile":
        return "default"
    mode = key.removeprefix("torch.compile ")
    if mode == key or mode not in COMPILE_MODES:
        raise KeyError(f"{key!r} names no torch.compile mode")
    return mode


def compile_keys_in(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The torch.compile cell keys the rows have, one per mode, in ``COMPILE_MODES`` order:
    the columns of a table of rows written with any set of modes (a summary from before a
    mode was measured has none of its cells, and no column for it)."""
    present = {key for row in rows for key in row}
    found = []
    for mode in COMPILE_MODES:
        keys = [compile_key(mode)] + [old for old, its_mode in LEGACY_KEYS.items() if its_mode == mode]
        found += [key for key in keys if key in present][:1]
    return found


def compiled(model: Callable, mode: str) -> Callable:
    """``torch.compile(model)`` in ``mode``; in a CUDA-graph mode, each call first marks a new
    step, so that the call replays the recorded graph (and overwrites the previous call's
    outputs: read an output before the next call)."""
    fn = torch.compile(model, mode=None if mode == "default" else mode)
    if mode not in CUDA_GRAPH_MODES:
        return fn

    def replay(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(*args, **kwargs)

    return replay
