"""``autofuser bench``: the model zoo under eager PyTorch, torch.compile and AutoFuser.

For each chosen model, on one device and one dtype:

1. build it (seed 0) and, with ``--train-steps N``, train it N Adam steps on
   generated airfoils so that its test loss means something;
2. eager: the reference output, and the median time of ``--iters`` calls after
   ``--warmup`` calls (CUDA events per call on a GPU, ``time.perf_counter`` on
   a CPU), in eval mode under ``torch.no_grad()``;
3. AutoFuser: ``autofuser.fuse(model, cache_dir=D)`` with ``D`` a fresh empty
   folder - its first call is the cold-cache compile time; then a second fresh
   ``FusedModule`` on the same folder - its first call is the warm-cache
   compile time - and the median time of that one;
4. torch.compile: after ``torch._dynamo.reset()``, ``torch.compile(model,
   mode=--compile-mode)``; its first call, then the median time (skipped with
   ``--no-compile``).

Every system's output is compared with eager (``||out - eager|| / ||eager||``)
and with the airfoil target (the relative L2 test loss). ``--dtype bf16`` runs
every forward of every system under ``torch.autocast(device, bfloat16)`` with
fp32 parameters. A system that fails on a model becomes that cell's error
(type and message), never a crash; every column is always produced.

``--train`` measures a training step of each model instead of its forward
(``autofuser.zoo.train_bench``); ``--train-steps`` is the pre-training of step 1,
for either.

Writes ``bench.json`` (everything, with date, device and versions),
``bench.md`` (the table, printed last) and ``bench.png`` (speedups over eager,
when matplotlib is installed) to ``--out``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import autofuser
from autofuser.zoo.airfoil import TRAIN_SEED, make_dataset, relative_l2, test_set
from autofuser.zoo.first_call import measure_in_fresh_process
from autofuser.zoo.models import MESHES, MODELS, ModelEntry, parameter_count
from autofuser_core.timing import median_call_ms

SYSTEMS = ("eager", "torch.compile", "autofuser")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
NO_COMPILE = "skipped: --no-compile"
TRAIN_LR = 1e-3


def progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autofuser bench``."""
    parser.add_argument(
        "--models", default="all", help=f"comma-separated model names, or 'all' (default): {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda when available)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="fp32, or bf16 = torch.autocast(bfloat16) around every forward (with --train: forward and loss); "
        "fp32 parameters",
    )
    parser.add_argument(
        "--iters", type=int, default=100, help="timed calls (with --train: training steps) per system (median reported)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls (with --train: steps) before timing")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md, bench.png")
    parser.add_argument(
        "--config",
        choices=sorted(MESHES),
        default="airfoil",
        help="model sizes: airfoil (paper configurations, 221 x 51 mesh) or tiny (CPU tests)",
    )
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default", help="torch.compile mode")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (it needs a C compiler on CPU)")
    parser.add_argument(
        "--train",
        action="store_true",
        help="measure a training step (zero_grad, forward in train mode, MSE loss, backward, AdamW step) "
        "instead of the eval-mode forward: step time, first step, peak memory, output and gradient errors. "
        "Not --train-steps, which pre-trains before anything is measured",
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="pre-training: Adam steps on generated airfoils before anything is measured, so the test loss "
        "means something (default 0: random weights); with or without --train, which measures training steps",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="override every model's batch size (default: the paper's, or 2 for --config tiny)",
    )
    parser.add_argument(
        "--tune-budget", type=float, default=None, help="AutoFuser tuning seconds per group (default: fuse()'s own)"
    )
    parser.add_argument(
        "--tune-all-configs",
        action="store_true",
        help="AutoFuser tunes every valid config, past the strategies' caps (fuse's "
        "tune_all_configs): for benchmarks/tuning_stats.py, not for timing first calls",
    )
    parser.add_argument(
        "--fresh-first-calls",
        action="store_true",
        help="also time AutoFuser's cold first call and torch.compile's first call each in a new "
        "process with empty caches (autofuser.zoo.first_call), as a user's first run of a "
        "script pays them",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="parent of the per-model AutoFuser cache folders (default: OUT/autofuser-cache); "
        "each model's folder is emptied first",
    )


def run_from_args(args: argparse.Namespace) -> int:
    names = list(MODELS) if args.models.strip() == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        progress(f"unknown model(s) {', '.join(unknown)}; the zoo has {', '.join(MODELS)}")
        return 2
    if args.iters < 1 or args.warmup < 0 or args.train_steps < 0:
        progress("--iters must be >= 1, --warmup and --train-steps >= 0")
        return 2
    if args.train and args.fresh_first_calls:
        progress("--fresh-first-calls times forward first calls; it does not combine with --train")
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        progress("--device cuda but no CUDA device is available; use --device cpu")
        return 2
    result = run_bench(
        names,
        device=device,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        out=Path(args.out),
        config=args.config,
        compile_mode=args.compile_mode,
        no_compile=args.no_compile,
        train_steps=args.train_steps,
        batch_size=args.batch_size,
        cache_root=Path(args.cache_dir) if args.cache_dir else None,
        fuse_options={
            **({} if args.tune_budget is None else {"tune_budget_s": args.tune_budget}),
            **({"tune_all_configs": True} if args.tune_all_configs else {}),
        },
        fresh_first_calls=args.fresh_first_calls,
        train=args.train,
    )
    print(result["markdown"])
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="autofuser bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_for(device: torch.device, dtype: str):
    """The autocast context of ``--dtype``: none for fp32, bfloat16 autocast on ``device`` for bf16."""
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def median_ms(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> float:
    """Median wall time of one call of ``fn`` in ms, over ``iters`` calls after ``warmup`` calls:
    on a GPU timed as AutoFuser's whole-forward check times it (CUDA events, calls back to back)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return median_call_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return float(statistics.median(times))


def build(entry: ModelEntry, config: str, batch: int, device: torch.device):
    """(model, input, target) of one zoo model: seed 0, the test set's first ``batch`` airfoils."""
    torch.manual_seed(0)
    model = entry.make(config).to(device)
    coords, target = test_set(batch, MESHES[config])
    return model, entry.inputs(coords).to(device), target.to(device)


def forward_call(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, device: torch.device, dtype: str):
    """``fn(x)`` as every system is called: no_grad, and under bf16 autocast for ``--dtype bf16``."""

    def call():
        with torch.no_grad(), autocast_for(device, dtype):
            return fn(x)

    return call


def first_call_s(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(output, seconds) of one call, synchronised on both sides."""
    synchronize(device)
    begin = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - begin


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    out, reference = out.detach().double(), reference.detach().double()
    denominator = reference.norm()
    return float((out - reference).norm() / denominator) if denominator > 0 else float((out - reference).norm())


def describe_error(err: BaseException) -> str:
    """``Type: first line of the message``, and the same of its cause when it has one
    (fx's Interpreter re-raises a node's error as a bare RuntimeError)."""

    def one(e: BaseException) -> str:
        # KeyError's str() is the repr of its key: show the key itself.
        text = e.args[0] if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) else str(e)
        lines = text.strip().splitlines()
        return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__

    cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return one(err) + (f" (caused by {one(cause)})" if cause is not None else "")


def train(
    model: torch.nn.Module, entry: ModelEntry, mesh: tuple[int, int], batch: int, steps: int, device: torch.device
) -> list[float]:
    """``steps`` Adam steps (lr 1e-3, gradient norm clipped to 1) on the relative L2 loss, fp32."""
    pool = min(1000, max(batch, steps * batch))
    coords, target = make_dataset(pool, TRAIN_SEED, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=TRAIN_LR)
    model.train()
    losses = []
    for step in range(steps):
        index = torch.arange(step * batch, (step + 1) * batch) % pool
        x, y = entry.inputs(coords[index]).to(device), target[index].to(device)
        loss = relative_l2(entry.as_grid(model(x), mesh), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step == 0 or (step + 1) % max(1, steps // 10) == 0:
            progress(f"  train step {step + 1}/{steps}: loss {losses[-1]:.4f}")
    model.eval()
    return losses


# ---------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------


def _empty_cell(status: str = "not run", error: Optional[str] = None) -> dict[str, Any]:
    return {
        "status": status,
        "error": error,
        "ms": None,
        "speedup": None,
        "first_call_s": None,
        "rel_err_vs_eager": None,
        "test_loss": None,
    }


def start_row(name: str, *, config: str, batch: int, train_steps: int, empty_cell: Callable[[], dict]) -> dict:
    """A row of model ``name`` before anything is measured: every system's cell is ``empty_cell()``."""
    entry = MODELS[name]
    return {
        "model": name,
        "title": entry.title,
        "paper": entry.paper,
        "family": entry.family,
        "layout": entry.layout,
        "config": config,
        "mesh": list(MESHES[config]),
        "batch": batch,
        "params": None,
        "train_steps": train_steps,
        "train_losses": [],
        "systems": {s: empty_cell() for s in SYSTEMS},
    }


def prepare_model(row: dict[str, Any], *, dtype: str, device: torch.device) -> Optional[tuple]:
    """(model, input, target) of ``row``'s model, built and pre-trained (``row["train_steps"]``),
    in eval mode; None where there is nothing to measure: the model does not support ``dtype``
    (every cell skipped) or could not be built (every cell that error). A failed pre-training
    is recorded in the row and the model is measured as it is."""
    name, config, batch = row["model"], row["config"], row["batch"]
    entry, mesh = MODELS[name], MESHES[config]
    if dtype not in entry.dtypes:
        for cell in row["systems"].values():
            cell.update(status="skipped", error=f"skipped: {name} does not support {dtype}")
        return None
    try:
        model, x, target = build(entry, config, batch, device)
        row["params"] = parameter_count(model)
    except Exception as err:
        message = describe_error(err)
        progress(f"{name}: could not be built: {message}")
        for cell in row["systems"].values():
            cell.update(status="error", error=message, traceback=traceback.format_exc())
        return None
    row["train_error"] = None
    if row["train_steps"]:
        try:
            progress(f"{name}: training {row['train_steps']} steps")
            row["train_losses"] = train(model, entry, mesh, batch, row["train_steps"], device)
        except Exception as err:
            # Measure anyway (with the weights as they are): training needs far more memory than inference.
            row["train_error"] = describe_error(err)
            progress(f"{name}: training failed, measuring the untrained model: {row['train_error']}")
            release_memory(device)
    model.eval()
    return model, x, target


# What an AutoFuser cell keeps of its fusion report (``report_fields``) and of its warm
# cache, None until measured.
AUTOFUSER_REPORT_KEYS = ("fused_groups", "skipped_groups", "warm_cache_hits", "unfused_nodes", "opaque")


def start_autofuser_cell(row: dict[str, Any], **measured: None) -> dict[str, Any]:
    """``row``'s AutoFuser cell with the report's fields and ``measured`` set to None."""
    cell = row["systems"]["autofuser"]
    cell.update(dict.fromkeys(measured), **dict.fromkeys(AUTOFUSER_REPORT_KEYS), report=None, report_text=None)
    return cell


def report_fields(report) -> dict[str, Any]:
    """What an AutoFuser cell keeps of a cold compile's fusion report."""
    return {
        "fused_groups": len(report.fused),
        "skipped_groups": len(report.skipped),
        "unfused_nodes": len(report.unfused_nodes),
        "opaque": dict(report.opaque),
        "report": json.loads(report.to_json()),
        "report_text": str(report),
    }


def run_systems(
    name: str,
    row: dict[str, Any],
    runs: list[tuple[str, Callable[[], None]]],
    device: torch.device,
    *,
    reset_compile: bool = True,
) -> None:
    """Each ``(system, run)`` in turn: ``run()`` fills the system's cell; one that raises
    becomes the cell's error (type, message, traceback) and the next one runs. After
    torch.compile's run its caches are reset, unless ``reset_compile`` is false (its
    compiled module is still to be called)."""
    for system, run in runs:
        cell = row["systems"][system]
        try:
            run()
            cell["status"] = "ok"
        except Exception as err:
            # The helper's locals (a half-compiled module, its buffers) die with this block.
            cell.update(status="error", error=describe_error(err), traceback=traceback.format_exc())
            progress(f"{name}: {system} failed: {cell['error']}")
        if system == "torch.compile" and reset_compile:
            torch._dynamo.reset()
        release_memory(device)


def fill_speedups(row: dict[str, Any], time_key: str) -> None:
    """Every cell's ``speedup``: eager's ``time_key`` over the system's (1 for eager)."""
    eager_cell = row["systems"]["eager"]
    for system in ("torch.compile", "autofuser"):
        cell = row["systems"][system]
        if cell[time_key] and eager_cell[time_key]:
            cell["speedup"] = eager_cell[time_key] / cell[time_key]
    eager_cell["speedup"] = 1.0 if eager_cell[time_key] else None


def bench_model(
    name: str,
    *,
    device: torch.device,
    dtype: str,
    iters: int,
    warmup: int,
    config: str,
    compile_mode: str,
    no_compile: bool,
    train_steps: int,
    batch_size: Optional[int],
    cache_dir: Path,
    fuse_options: Optional[dict] = None,
    fresh_first_calls: bool = False,
) -> dict[str, Any]:
    """One row: every system on model ``name``; errors are recorded, not raised."""
    entry = MODELS[name]
    mesh = MESHES[config]
    batch = batch_size or entry.batch(config)
    row = start_row(name, config=config, batch=batch, train_steps=train_steps, empty_cell=_empty_cell)
    autofuser_cell = start_autofuser_cell(row, first_call_cold_s=None, first_call_warm_s=None, warm_phases=None)
    row["systems"]["torch.compile"]["mode"] = compile_mode
    prepared = prepare_model(row, dtype=dtype, device=device)
    if prepared is None:
        return row
    model, x, target = prepared

    def forward(fn):
        return forward_call(fn, x, device, dtype)

    def finish(cell: dict[str, Any], out: torch.Tensor, reference: Optional[torch.Tensor]) -> None:
        cell["test_loss"] = float(relative_l2(entry.as_grid(out, mesh), target))
        if reference is not None:
            cell["rel_err_vs_eager"] = relative_error(out, reference)

    eager_cell, compile_cell = row["systems"]["eager"], row["systems"]["torch.compile"]
    reference: Optional[torch.Tensor] = None

    def run_eager() -> None:
        nonlocal reference
        progress(f"{name}: eager")
        reference, seconds = first_call_s(forward(model), device)
        eager_cell["first_call_s"] = seconds
        finish(eager_cell, reference, None)
        eager_cell["rel_err_vs_eager"] = 0.0
        eager_cell["ms"] = median_ms(forward(model), iters, warmup, device)

    def run_autofuser() -> None:
        shutil.rmtree(cache_dir, ignore_errors=True)
        cache_dir.mkdir(parents=True)
        progress(f"{name}: AutoFuser, cold cache {cache_dir}")
        cold = autofuser.fuse(model, cache_dir=str(cache_dir), **(fuse_options or {}))
        _, seconds = first_call_s(forward(cold), device)
        autofuser_cell["first_call_cold_s"] = autofuser_cell["first_call_s"] = seconds
        autofuser_cell.update(report_fields(cold.report()))
        del cold
        release_memory(device)  # the cold module's buffers and CUDA graph pool
        progress(f"{name}: AutoFuser, warm cache")
        warm = autofuser.fuse(model, cache_dir=str(cache_dir), **(fuse_options or {}))
        out, seconds = first_call_s(forward(warm), device)
        autofuser_cell["first_call_warm_s"] = seconds
        autofuser_cell["warm_cache_hits"] = sum(g.cache_hit for g in warm.report().fused)
        autofuser_cell["warm_phases"] = dict(warm.report().phases)  # where the warm first call's time went
        finish(autofuser_cell, out, reference)
        autofuser_cell["ms"] = median_ms(forward(warm), iters, warmup, device)

    def run_compile() -> None:
        progress(f"{name}: torch.compile (mode {compile_mode})")
        torch._dynamo.reset()
        compiled = torch.compile(model, mode=compile_mode)
        out, seconds = first_call_s(forward(compiled), device)
        compile_cell["first_call_s"] = seconds
        finish(compile_cell, out, reference)
        compile_cell["ms"] = median_ms(forward(compiled), iters, warmup, device)

    if no_compile:
        compile_cell.update(status="skipped", error=NO_COMPILE)
    runs = [("eager", run_eager), ("autofuser", run_autofuser)]
    runs += [] if no_compile else [("torch.compile", run_compile)]
    run_systems(name, row, runs, device)

    if fresh_first_calls:
        for system in ("autofuser",) + (() if no_compile else ("torch.compile",)):
            progress(f"{name}: {system} first call in a fresh process")
            answer = measure_in_fresh_process(
                name,
                system,
                device=str(device),
                dtype=dtype,
                config=config,
                batch=batch,
                compile_mode=compile_mode,
                tune_budget=(fuse_options or {}).get("tune_budget_s"),
            )
            row["systems"][system]["first_call_fresh_s"] = answer.get("first_call_s")
            row["systems"][system]["first_call_fresh_error"] = answer.get("error")
            if answer.get("error"):
                progress(f"{name}: {system} fresh-process first call failed: {answer['error']}")
    fill_speedups(row, "ms")
    model = x = target = reference = None  # the closures hold them: freed before release_memory empties the cache
    release_memory(device)
    return row


def release_memory(device: torch.device) -> None:
    """Collect what nothing refers to any more and, on CUDA, return the cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# The whole run
# ---------------------------------------------------------------------------


def geometric_mean(values: list[float]) -> Optional[float]:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def run_bench(
    names: list[str],
    *,
    device: torch.device,
    dtype: str = "fp32",
    iters: int = 100,
    warmup: int = 10,
    out: Path = Path("bench-results"),
    config: str = "airfoil",
    compile_mode: str = "default",
    no_compile: bool = False,
    train_steps: int = 0,
    batch_size: Optional[int] = None,
    cache_root: Optional[Path] = None,
    fuse_options: Optional[dict] = None,
    fresh_first_calls: bool = False,
    train: bool = False,
) -> dict[str, Any]:
    """Benchmark ``names`` (their forward, or with ``train`` a training step); write bench.json,
    bench.md, bench.png to ``out``; return the JSON data (plus the table under ``"markdown"``)."""
    out.mkdir(parents=True, exist_ok=True)
    cache_root = cache_root or out / "autofuser-cache"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton picks the interpreter when a kernel is decorated: set it before AutoFuser builds any.
        os.environ["TRITON_INTERPRET"] = "1"
        progress("CPU run: TRITON_INTERPRET=1 (AutoFuser kernels run under Triton's interpreter)")
    started = time.perf_counter()
    rows = []
    if train:
        from autofuser.zoo import train_bench  # it builds on this module: imported when used
    for index, name in enumerate(names, 1):
        progress(f"[{index}/{len(names)}] {name} ({config}, {dtype}, {device}{', training step' if train else ''})")
        options: dict[str, Any] = dict(
            device=device,
            dtype=dtype,
            iters=iters,
            warmup=warmup,
            config=config,
            compile_mode=compile_mode,
            no_compile=no_compile,
            train_steps=train_steps,
            batch_size=batch_size,
            cache_dir=cache_root / name,
            fuse_options=fuse_options,
        )
        if train:
            rows.append(train_bench.bench_training_model(name, **options))
        else:
            rows.append(bench_model(name, **options, fresh_first_calls=fresh_first_calls))
    import triton

    result: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "mode": "train" if train else "forward",
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "autofuser": autofuser.__version__,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "settings": {
            "models": names,
            "dtype": dtype,
            "iters": iters,
            "warmup": warmup,
            "config": config,
            "compile_mode": compile_mode,
            "no_compile": no_compile,
            "train_steps": train_steps,
            "batch_size": batch_size,
            "fresh_first_calls": fresh_first_calls,
            "timing": "CUDA events, median" if device.type == "cuda" else "time.perf_counter, median",
            **({"optimizer": "torch.optim.AdamW", "lr": TRAIN_LR, "loss": "mse_loss"} if train else {}),
        },
        "rows": rows,
        "geomean_speedup": {
            s: geometric_mean([r["systems"][s]["speedup"] for r in rows if r["systems"][s]["status"] == "ok"])
            for s in SYSTEMS[1:]
        },
        "wall_s": time.perf_counter() - started,
    }
    result["plot"] = write_plot(result, out / "bench.png")
    markdown = train_bench.render_training_markdown(result) if train else render_markdown(result)
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "bench.md").write_text(markdown + "\n")
    plot = f", {out / 'bench.png'}" if result["plot"] == "bench.png" else ""
    progress(f"wrote {out / 'bench.json'}, {out / 'bench.md'}{plot}")
    return {**result, "markdown": markdown}


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------

COLUMNS = [
    "model",
    "params",
    "batch",
    "eager ms",
    "torch.compile ms",
    "torch.compile speedup",
    "AutoFuser ms",
    "AutoFuser speedup",
    "torch.compile first call s",
    "AutoFuser first call s (cold)",
    "AutoFuser first call s (warm)",
    "torch.compile rel err",
    "AutoFuser rel err",
    "test loss eager",
    "test loss torch.compile",
    "test loss AutoFuser",
    "fused groups",
    "skipped groups",
]


def format_cell(cell: dict[str, Any], key: str, fmt: str) -> str:
    """A table cell: the value ``cell[key]`` in ``fmt``, or why the system has none."""
    if cell["status"] == "skipped":
        return cell["error"] or "skipped"
    if cell["status"] == "error":
        return f"error: {cell['error'].split(':')[0]}"
    value = cell.get(key)
    return "-" if value is None else format(value, fmt)


def format_params(count: Optional[int]) -> str:
    """A parameter count as the table shows it (``1.11M``, ``5,025``)."""
    if count is None:
        return "-"
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count:,}"


def where_run(result: dict[str, Any]) -> str:
    """The GPU's name, or the CPU's (and whether Triton's interpreter ran the kernels)."""
    return result["gpu"] or f"CPU ({result['cpu']}{', Triton interpreter' if result['triton_interpret'] else ''})"


def table_lines(columns: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: the header, its rule, one line per row of cells."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def geomean_cells(columns: list[str], result: dict[str, Any], speedup_columns: dict[str, str]) -> list[str]:
    """The geometric-mean row: each system's mean speedup in its column ``speedup_columns[system]``."""
    geomean, cells = result["geomean_speedup"], [""] * len(columns)
    cells[0] = "geometric mean"
    cells[columns.index(speedup_columns["torch.compile"])] = (
        f"{geomean['torch.compile']:.2f}"
        if geomean["torch.compile"]
        else (NO_COMPILE if result["settings"]["no_compile"] else "-")
    )
    cells[columns.index(speedup_columns["autofuser"])] = f"{geomean['autofuser']:.2f}" if geomean["autofuser"] else "-"
    return cells


def row_errors(row: dict[str, Any]) -> list[str]:
    """One line per failed system of ``row``, and one for a failed pre-training."""
    errors = [
        f"- {row['model']} / {system}: {row['systems'][system]['error']}"
        for system in SYSTEMS
        if row["systems"][system]["status"] == "error"
    ]
    if row.get("train_error"):
        errors.append(f"- {row['model']} / training (measured untrained): {row['train_error']}")
    return errors


def footer_lines(result: dict[str, Any], errors: list[str]) -> list[str]:
    """The errors (where there are any) and what bench.png is."""
    lines = ["", "Errors (type: message; tracebacks in bench.json):", *errors] if errors else []
    return lines + [
        "",
        "bench.png: speedups over eager." if result["plot"] == "bench.png" else f"bench.png: {result['plot']}",
    ]


def render_markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    where = where_run(result)
    lines = [
        f"# autofuser bench - {settings['config']} config, {settings['dtype']}, {where}",
        "",
        f"{result['date']}; torch {result['torch']}, Triton {result['triton']}, AutoFuser {result['autofuser']}; "
        f"median of {settings['iters']} calls after {settings['warmup']} warm-up calls ({settings['timing']}), "
        f"eval mode, no_grad{', bf16 autocast' if settings['dtype'] == 'bf16' else ''}; torch.compile mode "
        f"{settings['compile_mode']}; {settings['train_steps']} training steps. Speedup = eager ms / system ms; "
        "rel err = ||out - eager|| / ||eager||; test loss = relative L2 vs the airfoil target.",
        "",
    ]
    errors, table = [], []
    for row in result["rows"]:
        eager, compiled, fused = (row["systems"][s] for s in SYSTEMS)
        cells = [
            row["model"],
            format_params(row["params"]),
            str(row["batch"]),
            format_cell(eager, "ms", ".3f"),
            format_cell(compiled, "ms", ".3f"),
            format_cell(compiled, "speedup", ".2f"),
            format_cell(fused, "ms", ".3f"),
            format_cell(fused, "speedup", ".2f"),
            format_cell(compiled, "first_call_s", ".2f"),
            format_cell(fused, "first_call_cold_s", ".2f"),
            format_cell(fused, "first_call_warm_s", ".2f"),
            format_cell(compiled, "rel_err_vs_eager", ".1e"),
            format_cell(fused, "rel_err_vs_eager", ".1e"),
            format_cell(eager, "test_loss", ".4f"),
            format_cell(compiled, "test_loss", ".4f"),
            format_cell(fused, "test_loss", ".4f"),
            "-" if fused["fused_groups"] is None else str(fused["fused_groups"]),
            "-" if fused["skipped_groups"] is None else str(fused["skipped_groups"]),
        ]
        table.append(cells)
        errors += row_errors(row)
    speedups = {"torch.compile": "torch.compile speedup", "autofuser": "AutoFuser speedup"}
    lines += table_lines(COLUMNS, table + [geomean_cells(COLUMNS, result, speedups)])
    if settings.get("fresh_first_calls"):
        lines += [
            "",
            "First calls in fresh processes, each with empty AutoFuser, Triton and Inductor caches "
            "(--fresh-first-calls), seconds:",
            "",
            "| model | torch.compile first call | AutoFuser first call (cold) |",
            "|---|---|---|",
        ]
        for row in result["rows"]:
            fresh = []
            for system in ("torch.compile", "autofuser"):
                cell = row["systems"][system]
                if cell.get("first_call_fresh_s") is not None:
                    fresh.append(f"{cell['first_call_fresh_s']:.2f}")
                elif cell.get("first_call_fresh_error"):
                    fresh.append(f"error: {cell['first_call_fresh_error'].split(':')[0]}")
                    errors.append(f"- {row['model']} / {system} (fresh process): {cell['first_call_fresh_error']}")
                else:
                    fresh.append(cell["error"] if cell["status"] == "skipped" and cell["error"] else "-")
            lines.append(f"| {row['model']} | {fresh[0]} | {fresh[1]} |")
    return "\n".join(lines + footer_lines(result, errors))


def write_plot(result: dict[str, Any], path: Path) -> str:
    """Grouped bars of the speedups over eager; returns "bench.png" or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not written: matplotlib is not installed (pip install 'autofuser[plot]')"
    rows = result["rows"]
    names = [r["model"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4))
    width = 0.38
    for k, (system, label) in enumerate((("torch.compile", "torch.compile"), ("autofuser", "AutoFuser"))):
        values = [r["systems"][system]["speedup"] or 0.0 for r in rows]
        positions = [i + (k - 0.5) * width for i in range(len(rows))]
        bars = ax.bar(positions, values, width, label=label)
        for bar, row in zip(bars, rows):
            cell = row["systems"][system]
            if cell["status"] != "ok":
                ax.annotate(
                    "skipped" if cell["status"] == "skipped" else "error",
                    (bar.get_x() + width / 2, 0.02),
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=7,
                )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=20)
    ax.set_ylabel("speedup over eager" + (" (training step)" if result.get("mode") == "train" else ""))
    where = result["gpu"] or "CPU"
    step = "training step, " if result.get("mode") == "train" else ""
    ax.set_title(f"{step}{result['settings']['config']} config, {result['settings']['dtype']}, {where}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "bench.png"


if __name__ == "__main__":
    raise SystemExit(main())
