"""Speed decisions taken on a busy GPU: each zoo model fused while other processes load
the GPU, then timed on a quiet GPU beside eager, torch.compile and the same model fused
on a quiet GPU (issue 28).

AutoFuser decides with timings taken while it compiles (keep or drop each group, CUDA
graph or not, fused forward or the original) and caches those verdicts. A GPU busy with
other work while they are taken gave wrong verdicts for good: a U-Net FNO fused while
other models compiled ran at 0.71x eager afterwards, 2.05x when fused alone. This
suite reproduces that. For each model and dtype:

1. eager and ``torch.compile`` (``--compile-mode``), timed on the quiet GPU;
2. quiet: ``autofuser.fuse`` with an empty cache, compiled alone, then timed;
3. busy: the load processes start (``--load``: ``matmul``, a loop of large products;
   ``compile``, ``torch.compile`` of the zoo's other models over and over, as a
   notebook or job beside it would; ``fuse``, the same with ``autofuser.fuse``), each
   signals once its load runs; ``autofuser.fuse`` with another empty cache compiles
   under that load (and makes ``--busy-calls`` further calls under it: the first calls
   after compiling, where the check in use times the fused forward against the
   original); the load stops; the busy-compiled module is then timed on the quiet GPU,
   once its check in use has settled (as the quiet one is).

Each row says whether the busy-compiled model holds: not slower than eager, and within
``--tolerance`` (10%) of the quiet-compiled one. Every timing is the median of
``--iters`` calls after ``--warmup`` calls (CUDA events, as ``autofuser bench``),
outside any load. The notes of both reports (which decisions were provisional, what the
check in use found) go into ``busy.json``; ``busy.md`` holds the table.

    python benchmarks/busy_gpu.py --models all --dtypes fp32,bf16 --out busy-results

Needs a CUDA GPU; each load process holds its own CUDA context (``--matmul-size``
sets how much memory the matmul loop takes: three n x n fp32 matrices).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from autofuser.cli import COMPILE_MODES, comma_separated

LOADS = ("matmul", "compile", "fuse")
DTYPES = ("fp32", "bf16")
#: Calls after compiling (and ``--busy-calls``) that the check in use may take to settle
#: before the fused model is timed: two plans of 17 calls and the settling call, with room.
SETTLE_CALLS = 64
#: Seconds a load process may take to start its load (import torch, make a CUDA context,
#: compile once) before the run gives up on it.
LOAD_START_S = 300.0


def progress(message: str) -> None:
    print(f"busy_gpu: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None, known_models: Optional[Sequence[str]] = None):
    """The options, checked: unknown models, dtypes or loads and counts out of range exit
    with status 2 and a message naming the value and what is allowed. ``known_models``:
    the zoo's model names (default: ``autofuser.zoo.models.MODELS``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="all", help="comma-separated zoo model names, or 'all' (default)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (default both)")
    parser.add_argument("--out", type=Path, default=Path("busy-results"), help="folder for busy.json and busy.md")
    parser.add_argument(
        "--load",
        default="matmul,compile",
        help=f"comma-separated load processes started while the model compiles: {', '.join(LOADS)} "
        "(default matmul,compile); a name twice starts two",
    )
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the matmul load's n x n products")
    parser.add_argument("--busy-calls", type=int, default=0, help="calls after compiling made while the load runs")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=25, help="calls before timing (they include the check in use)")
    parser.add_argument("--config", default="airfoil", choices=("airfoil", "tiny"), help="zoo configuration")
    parser.add_argument("--batch-size", type=int, default=None, help="override every model's batch size")
    parser.add_argument("--tune-budget", type=float, default=None, help="AutoFuser tuning seconds per group")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default", help="torch.compile's mode")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile column")
    parser.add_argument("--tolerance", type=float, default=0.10, help="busy within this share of quiet (0.10)")
    parser.add_argument("--device", default="cuda", help="a CUDA device (default cuda)")
    args = parser.parse_args(argv)
    if known_models is None:
        from autofuser.zoo.models import MODELS

        known_models = list(MODELS)
    args.models = _choices(parser, "--models", args.models, known_models, allow_all=True)
    args.dtypes = _choices(parser, "--dtypes", args.dtypes, DTYPES)
    args.load = _choices(parser, "--load", args.load, LOADS, unique=False)
    for name in ("iters", "matmul_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup", "busy_calls"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    if not 0 < args.tolerance < 1:
        parser.error(f"--tolerance is a share between 0 and 1 (0.10 for 10%), got {args.tolerance}")
    return args


def _choices(parser, option: str, text: str, allowed: Sequence[str], allow_all=False, unique=True) -> list[str]:
    """``option``'s comma-separated names through the CLI's parser; ``all`` (where
    ``allow_all``) for every name, repeats kept only where not ``unique``."""
    if allow_all and [name.strip() for name in text.split(",") if name.strip()] == ["all"]:
        return list(allowed)
    try:
        names = comma_separated(text, allowed, "value")
    except argparse.ArgumentTypeError as error:
        parser.error(f"{option}: {error}")
    return list(dict.fromkeys(names)) if unique else list(names)


# ---------------------------------------------------------------------------
# The load: other processes on the same GPU
# ---------------------------------------------------------------------------


def matmul_load(device: str, size: int, ready, stop) -> None:
    """Products of two ``size`` x ``size`` fp32 matrices back to back on ``device`` until
    ``stop`` is set; ``ready`` once the first is done. A few products are queued ahead,
    then the queue drains (the GPU stays busy, the host does not run far ahead)."""
    import torch

    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    out = torch.empty(size, size, device=device)
    torch.matmul(a, b, out=out)
    _synchronize(device)
    ready.set()
    while not stop.is_set():
        for _ in range(4):
            torch.matmul(a, b, out=out)
        _synchronize(device)


def compile_load(device: str, models: Sequence[str], config: str, dtype: str, ready, stop, system: str) -> None:
    """The zoo's ``models`` compiled one after another, over and over, until ``stop``:
    ``torch.compile`` (``system`` "compile", caches reset each time) or ``autofuser.fuse``
    (``system`` "fuse", an empty cache each time). ``ready`` once the first compile has
    started (set before it, as its own tuning and autotuning is the load)."""
    import tempfile

    import torch

    from autofuser.zoo.harness import build, forward_call
    from autofuser.zoo.models import MODELS

    dev = torch.device(device)
    ready.set()
    round_ = 0
    while not stop.is_set():
        name = models[round_ % len(models)]
        round_ += 1
        entry = MODELS[name]
        with contextlib.suppress(Exception):  # a model that fails to build or compile: the next one
            model, x, _ = build(entry, config, entry.batch(config), dev)
            model.eval()
            if system == "compile":
                torch._dynamo.reset()
                compiled = torch.compile(model)
                forward_call(compiled, x, dev, dtype)()
            else:
                import autofuser

                with tempfile.TemporaryDirectory() as folder:
                    forward_call(autofuser.fuse(model, cache_dir=folder, progress=False), x, dev, dtype)()
            _synchronize(device)
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def _synchronize(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Load:
    """The load processes of ``kinds`` (``LOADS``), started in ``spawn`` processes (a
    CUDA context can't be forked) by ``with Load(...)``; entering waits until each one's
    load runs, leaving stops and joins them. ``others``: the zoo models the compile
    loads compile (not the one measured)."""

    def __init__(self, kinds: Sequence[str], device: str, matmul_size: int, others: Sequence[str], config: str, dtype):
        self.context = multiprocessing.get_context("spawn")
        self.stop = self.context.Event()
        self.processes: list[tuple[Any, Any]] = []
        for kind in kinds:
            ready = self.context.Event()
            if kind == "matmul":
                target, fn_args = matmul_load, (device, matmul_size, ready, self.stop)
            else:
                if not others:
                    raise ValueError(f"the {kind!r} load needs another zoo model to compile; choose fewer loads")
                target, fn_args = compile_load, (device, list(others), config, dtype, ready, self.stop, kind)
            self.processes.append((self.context.Process(target=target, args=fn_args, daemon=True), ready))

    def __enter__(self) -> "Load":
        for process, _ in self.processes:
            process.start()
        deadline = time.monotonic() + LOAD_START_S
        for process, ready in self.processes:
            while not ready.wait(1.0):
                if not process.is_alive() or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"a load process ({process.name}) did not start its load")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for process, _ in self.processes:
            process.join(timeout=LOAD_START_S)
            if process.is_alive():
                process.terminate()  # a compile that does not return: its own process, ended by handle
                process.join()


# ---------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------


def verdict(row: dict[str, Any], tolerance: float) -> Optional[str]:
    """Why the busy-compiled model does not hold (slower than eager, or more than
    ``tolerance`` slower than the quiet-compiled one), or ``None`` where it holds; a row
    missing a time holds nothing, and says which."""
    busy, quiet, eager = row.get("busy_ms"), row.get("quiet_ms"), row.get("eager_ms")
    if busy is None or quiet is None or eager is None:
        missing = [k for k in ("eager_ms", "quiet_ms", "busy_ms") if row.get(k) is None]
        return f"not measured: {', '.join(missing)}"
    problems = []
    if busy > eager:
        problems.append(f"slower than eager ({busy:.3f} vs {eager:.3f} ms)")
    if busy > quiet * (1.0 + tolerance):
        problems.append(f"{100 * (busy / quiet - 1):.0f}% slower than compiled on a quiet GPU ({quiet:.3f} ms)")
    return "; ".join(problems) or None


def measure_model(name: str, dtype: str, args, cache_root: Path) -> dict[str, Any]:
    """One row: eager, torch.compile, AutoFuser compiled quiet and busy; errors recorded."""
    import torch

    import autofuser
    from autofuser.zoo.harness import build, describe_error, forward_call, release_memory
    from autofuser.zoo.harness import timed as timed_calls
    from autofuser.zoo.models import MODELS

    device = torch.device(args.device)
    entry = MODELS[name]
    row: dict[str, Any] = {"model": name, "dtype": dtype, "errors": {}}
    if dtype not in entry.dtypes:
        row["errors"]["model"] = f"skipped: {name} does not support {dtype}"
        return row
    model, x, _ = build(entry, args.config, args.batch_size or entry.batch(args.config), device)
    model.eval()
    options: dict[str, Any] = {"progress": False}
    if args.tune_budget is not None:
        options["tune_budget_s"] = args.tune_budget

    def timed(fn: Callable[[], Any]) -> float:
        return timed_calls(fn, args.iters, args.warmup, device)["ms"]

    def fused_on(folder: Path, load: Optional[Load]):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        fused = autofuser.fuse(model, cache_dir=str(folder), **options)
        call = forward_call(fused, x, device, dtype)
        with load if load is not None else contextlib.nullcontext():
            begin = time.perf_counter()
            call()  # compiles
            torch.cuda.synchronize(device)
            compile_s = time.perf_counter() - begin
            for _ in range(args.busy_calls):
                call()
            torch.cuda.synchronize(device)
        # The check in use (its plan runs the original for some calls) settles before timing.
        for _ in range(SETTLE_CALLS):
            if not fused.checking_in_use:
                break
            call()
        if fused.checking_in_use:
            raise RuntimeError(f"the check in use did not settle in {SETTLE_CALLS} calls")
        return fused, call, compile_s

    steps: list[tuple[str, Callable[[], None]]] = [
        ("eager", lambda: row.update(eager_ms=timed(forward_call(model, x, device, dtype))))
    ]
    if not args.no_compile:

        def run_compile() -> None:
            torch._dynamo.reset()
            row["compile_ms"] = timed(forward_call(torch.compile(model, mode=args.compile_mode), x, device, dtype))
            torch._dynamo.reset()

        steps.append(("torch.compile", run_compile))
    for kind in ("quiet", "busy"):

        def run_fused(kind: str = kind) -> None:
            others = [m for m in args.models if m != name] or [m for m in MODELS if m != name]
            load = (
                Load(args.load, args.device, args.matmul_size, others, args.config, dtype) if kind == "busy" else None
            )
            fused, call, row[f"{kind}_compile_s"] = fused_on(cache_root / f"{name}-{dtype}-{kind}", load)
            row[f"{kind}_ms"] = timed(call)
            row[f"{kind}_notes"] = [note for report in fused.reports() for note in report.notes]

        steps.append((kind, run_fused))
    for step, run in steps:
        progress(f"{name} {dtype}: {step}")
        try:
            run()
        except Exception as err:
            row["errors"][step] = describe_error(err)
            row.setdefault("tracebacks", {})[step] = traceback.format_exc()
            progress(f"{name} {dtype}: {step} failed: {row['errors'][step]}")
        release_memory(device)
    for kind in ("compile", "quiet", "busy"):
        if row.get(f"{kind}_ms") and row.get("eager_ms"):
            row[f"{kind}_speedup"] = row["eager_ms"] / row[f"{kind}_ms"]
    row["problem"] = verdict(row, args.tolerance)
    return row


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def render_markdown(rows: Sequence[dict[str, Any]], tolerance: float) -> str:
    """The table: per model and dtype, each system's ms and speedup over eager, the busy
    over quiet ratio, and whether the busy-compiled model holds."""

    def ms(row, key):
        value = row.get(f"{key}_ms")
        speedup = row.get(f"{key}_speedup")
        return "-" if value is None else f"{value:.3f}" + (f" ({speedup:.2f}x)" if speedup else "")

    lines = [
        "| model | dtype | eager ms | torch.compile ms | fused quiet ms | fused busy ms | busy / quiet | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row['busy_ms'] / row['quiet_ms']:.2f}" if row.get("busy_ms") and row.get("quiet_ms") else "-"
        holds = "yes" if row.get("problem") is None else f"no: {row['problem']}"
        cells = [ms(row, "eager"), ms(row, "compile"), ms(row, "quiet"), ms(row, "busy")]
        lines.append(f"| {row['model']} | {row['dtype']} | " + " | ".join(cells) + f" | {ratio} | {holds} |")
    held = sum(row.get("problem") is None for row in rows)
    lines.append("")
    lines.append(
        f"{held} of {len(rows)} held: not slower than eager, and within {100 * tolerance:.0f}% of the quiet compile."
    )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        progress("this suite needs a CUDA GPU (--device cuda); there is none here")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        for dtype in args.dtypes:
            rows.append(measure_model(name, dtype, args, args.out / "autofuser-cache"))
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(args.device),
        "torch": torch.__version__,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "rows": rows,
    }
    (args.out / "busy.json").write_text(json.dumps(result, indent=1, default=str))
    table = render_markdown(rows, args.tolerance)
    (args.out / "busy.md").write_text(table)
    print(table)
    return 0 if all(row.get("problem") is None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
