"""The flash-attention kernels' tilings (``plugins/attention/flash.py``), timed on a GPU.

``flash.BLOCKS_16BIT`` and ``flash.BLOCKS_FP32`` give each head width (padded to a
power of two) one forward and one backward tiling. This script times candidate
tilings for the widths and dtypes asked for, forward and backward separately, at an
attention of ``--points`` queries and keys (the softmax Transformer zoo model's
mesh by default), and keeps for each the fastest whose kernels compile within
``SHARED_LIMIT`` bytes of shared memory (the table's rule) and whose result matches
the current tiling's. Prints a table and the table entries it found; writes them as
JSON with ``--out``; ``--apply FILE`` writes such a JSON's entries into flash.py.

    python benchmarks/flash_blocks.py [--widths 16,64] [--dtypes fp32,bf16] [--points 11271] [--heads 8]
        [--budget-s 240] [--out blocks.json]
    python benchmarks/flash_blocks.py --apply blocks.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from sdpa_grad_probe import _milliseconds  # the same median of timed calls

from autofuser_plugins.attention import flash
from autofuser_plugins.attention.flash import Blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The most shared memory a tiling may take (the table's rule; flash.py's comment).
SHARED_LIMIT = 96 * 1024
FORWARD = [Blocks(h, s, w, n) for (h, s), w, n in itertools.product(
    [(64, 32), (64, 64), (128, 32), (128, 64), (64, 128), (128, 128)], [4, 8], [2, 3]
)]  # fmt: skip
BACKWARD = [Blocks(h, s, w, n) for (h, s), w, n in itertools.product(
    [(32, 32), (64, 32), (64, 64), (128, 32), (128, 64), (32, 64)], [4, 8], [1, 2]
)]  # fmt: skip
KERNELS = ("_forward_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel")
FLASH_PY = Path(flash.__file__)


class _Recorded:
    """A kernel whose launches note the compiled kernel's shared memory (bytes)."""

    def __init__(self, kernel: Any, shared: list):
        self.kernel, self.shared = kernel, shared

    def __getitem__(self, grid: Any) -> Callable:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            compiled = launch(*args, **kwargs)
            self.shared.append(getattr(getattr(compiled, "metadata", None), "shared", 0) or 0)
            return compiled

        return run


def _with_blocks(blocks: Optional[Blocks], fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` with every kernel launched at ``blocks`` (the table's where None): its
    result and the most shared memory a kernel it launched took."""
    shared: list = []
    saved = {name: getattr(flash, name) for name in KERNELS}
    chooser = flash.choose_blocks
    try:
        for name in KERNELS:
            setattr(flash, name, _Recorded(saved[name], shared))
        if blocks is not None:
            flash.choose_blocks = lambda *args, **kwargs: blocks  # type: ignore[assignment]
        return fn(), max(shared, default=0)
    finally:
        for name in KERNELS:
            setattr(flash, name, saved[name])
        flash.choose_blocks = chooser


def _distance(got: Any, expected: Any) -> float:
    pairs = zip(got, expected) if isinstance(got, tuple) else [(got, expected)]
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)) for a, b in pairs)


def sweep(width: int, dtype: torch.dtype, points: int, heads: int, deadline: float) -> dict[str, Any]:
    """The fastest forward and backward tilings for one head width and dtype."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, points, heads, width, generator=gen, device="cuda").transpose(1, 2).to(dtype) for _ in range(4)
    )
    scale = width**-0.5
    out, lse = flash.flash_forward(q, k, v, scale, False)
    results: dict[str, Any] = {"width": width, "dtype": str(dtype).removeprefix("torch.")}
    head_block = flash._head_block(width)
    current = flash.choose_blocks(head_block, dtype, False), flash.choose_blocks(head_block, dtype, True)
    for phase, candidates, run in (
        ("forward", FORWARD, lambda: flash.flash_forward(q, k, v, scale, False)),
        ("backward", BACKWARD, lambda: flash.flash_backward(q, k, v, out, lse, dout, scale, False)),
    ):
        expected, _ = _with_blocks(None, run)
        rows = []
        for blocks in candidates:
            if time.monotonic() > deadline:
                break
            row: dict[str, Any] = {"blocks": list(blocks.__dict__.values())}
            try:
                got, shared = _with_blocks(blocks, run)
                row["shared"] = shared
                row["error"] = _distance(got, expected)
                if shared <= SHARED_LIMIT and row["error"] < 1e-2:
                    row["ms"] = _milliseconds(functools.partial(_with_blocks, blocks, run), repeats=7)
            except Exception as err:  # noqa: BLE001 - a tiling that does not compile is left out
                row["failed"] = str(err).splitlines()[0][:100] if str(err) else type(err).__name__
            rows.append(row)
            print(f"  {results['dtype']} D={width} {phase} {row}", flush=True)
        timed = [r for r in rows if "ms" in r]
        index = 1 if phase == "backward" else 0
        now = next((r for r in timed if r["blocks"] == list(current[index].__dict__.values())), None)
        results[phase] = {
            "best": min(timed, key=lambda r: r["ms"]) if timed else None,
            "current": now,
            "tried": len(rows),
        }
    return results


def apply(found: list[dict[str, Any]], path: Path = FLASH_PY) -> None:
    """Write each result's best tilings into flash.py's table for its dtype and width."""
    text = path.read_text()
    for result in found:
        table = "BLOCKS_FP32" if result["dtype"] == "float32" else "BLOCKS_16BIT"
        head_block = flash._head_block(result["width"])
        if head_block not in getattr(flash, table):
            raise SystemExit(f"no entry {head_block} in {table} of {path}")
        # A phase with no tiling timed keeps the table's.
        fwd, bwd = (
            result[phase]["best"] or {"blocks": list(getattr(flash, table)[head_block][index].__dict__.values())}
            for index, phase in enumerate(("forward", "backward"))
        )
        start = text.index(f"{table} = {{")
        end = text.index("}", start)
        tilings = ", ".join("Blocks(" + ", ".join(map(str, r["blocks"])) + ")" for r in (fwd, bwd))
        entry = f"    {head_block}: ({tilings}),"
        body, count = re.subn(rf"^    {head_block}: \(.*\),$", entry, text[start:end], flags=re.M)
        if count != 1:
            raise SystemExit(f"no entry {head_block} in {table} of {path}")
        text = text[:start] + body + text[end:]
    path.write_text(text)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="16,64")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--points", type=int, default=11271)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop trying tilings after this long")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--apply", type=Path, help="write the entries of this JSON (from --out) into flash.py")
    args = parser.parse_args(argv)
    if args.apply is not None:
        apply(json.loads(args.apply.read_text()))
        print(f"wrote {args.apply}'s tilings into {FLASH_PY}")
        return 0
    if not torch.cuda.is_available():
        print("flash_blocks.py times kernels on a CUDA GPU; none is here", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.budget_s
    found = []
    for dtype_name, width in itertools.product(args.dtypes.split(","), map(int, args.widths.split(","))):
        found.append(sweep(width, DTYPES[dtype_name], args.points, args.heads, deadline))
    print(f"\n{torch.cuda.get_device_name()}, {args.points} queries and keys, {args.heads} heads")
    print("| dtype | width | phase | table's tiling ms | best tiling | ms | tried |")
    print("|---|---|---|---|---|---|---|")
    for result in found:
        for phase in ("forward", "backward"):
            cell = result[phase]
            now, best = cell["current"], cell["best"]
            shown = f"{now['ms']:.3f}" if now else "n/a"
            tiling = "n/a" if best is None else "Blocks(" + ", ".join(map(str, best["blocks"])) + ")"
            ms = "n/a" if best is None else f"{best['ms']:.3f}"
            print(f"| {result['dtype']} | {result['width']} | {phase} | {shown} | {tiling} | {ms} | {cell['tried']} |")
    if args.out is not None:
        args.out.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
