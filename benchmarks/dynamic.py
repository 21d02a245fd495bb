"""Variable point counts: one zoo model called on many distinct point counts.

The measurement of the issue "Variable point counts without a compile per shape":
a zoo model (default ``galerkin``, batch 4, inference under ``torch.no_grad()``)
called on ``--counts`` distinct point counts, drawn with a fixed seed uniformly
from ``--min-points`` to ``--max-points`` (inclusive), in a random order, with
fresh random coordinates on every call. Systems:

- eager PyTorch;
- AutoFuser, ``autofuser.fuse(model)`` (``dynamic=None``, the default: the first
  count compiles specialised, the second makes the point dim dynamic);
- torch.compile in each mode of ``--compile-modes`` (default: the default mode),
  with ``dynamic`` left at torch's default;
- the reference, AutoFuser ``dynamic=False``: its first call on the sequence's
  first count is *one cold compile*, and, compiled cold on each steady count in
  a fresh module and cache, its steady time is the *fully specialised* time.

Each system runs in a process of its own (this script again, as a worker), with
empty AutoFuser, Triton and Inductor caches: a kernel module or a Triton binary
loaded by one system in a process would be found loaded by the next, which would
then not compile cold. Each worker runs eager once first, at half the smallest
count (CUDA context, cuBLAS), and builds the same model (seed 0) and the same
inputs (seeded per call).

Per system: the wall time of the first call on each count (synchronised), and
their total; for AutoFuser, whether the call compiled, its compile time split
into the report's phases (capture, plan, generate, verify, tune, ...), the
dynamic dims of its shape class, and its groups' run-time sizes, size buckets
and the groups specialised per shape; for torch.compile, whether Dynamo
compiled a graph. Then the steady time per call at ``--steady-counts`` counts
(the smallest, middle ones and the largest of the sequence): the median of
``--iters`` calls after ``--warmup`` (``autofuser.zoo.harness.timed``), after
AutoFuser's check in use has settled. The targets of the issue: AutoFuser's
first calls together at most two cold compiles, and its steady time within 10%
of the specialised one, at every steady count.

Every output (first calls and one steady call per count) is compared with eager
on the same inputs, as ``autofuser bench`` does (``relative_error``: the relative
L2 error), and must be within ``MAX_REL_ERROR`` of the dtype; a mismatch, or a
system that fails, is printed loudly and makes the exit code 1.

    python benchmarks/dynamic.py --out bench-results/dynamic-fp32
    python benchmarks/dynamic.py --out /tmp/dyn --device cpu --config tiny --counts 3 \\
        --min-points 40 --max-points 90 --iters 2

On a CPU the kernels run under Triton's interpreter (a smoke check: its times say
nothing about a GPU), and torch.compile is skipped unless ``--compile-on-cpu``
(Inductor builds C++ for each graph: minutes on a small shared CPU).

Writes ``dynamic.json`` (every call, with date, device and versions) and
``dynamic.md`` (the summary, the targets, each AutoFuser first call) to ``--out``
and prints the summary last; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compile_modes import compile_key, compiled, parse_compile_modes  # noqa: E402

#: Relative L2 error against eager allowed per dtype: the limits ``benchmarks/attention.py``
#: and ``benchmarks/fft_plugin.py`` check model outputs with (bf16 is autocast, products in bf16).
MAX_REL_ERROR = {"fp32": 1e-4, "bf16": 4e-2}
#: The issue's targets: first calls together against one cold compile, steady against specialised.
FIRST_CALLS_TARGET = 2.0
STEADY_TARGET = 1.10
#: AutoFuser's systems: the one measured, and the fully specialised reference.
DYNAMIC, SPECIALISED = "autofuser", "autofuser dynamic=False"
#: At most this many steady calls wait for AutoFuser's checks in use to settle. A check of a
#: signature never called again stays pending, and another waits up to ``STALE_CALLS`` (64)
#: calls before it takes over (autofuser_core/in_use.py): a settle that counted on every
#: check ending would never end.
SETTLE_LIMIT = 128


def progress(message: str) -> None:
    print(f"dynamic: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The sequence
# ---------------------------------------------------------------------------


def draw_counts(n: int, low: int, high: int, seed: int) -> list[int]:
    """``n`` distinct point counts, uniformly from ``low`` to ``high`` inclusive, in a random
    order, the same for the same seed."""
    return random.Random(seed).sample(range(low, high + 1), n)


def steady_counts_of(counts: list[int], k: int) -> list[int]:
    """``k`` counts of the sequence, spread over its sorted range: the smallest, middle
    ones and the largest (one: the middle one)."""
    ordered = sorted(counts)
    if k == 1:
        return [ordered[len(ordered) // 2]]
    picked = [ordered[round(j * (len(ordered) - 1) / (k - 1))] for j in range(k)]
    return sorted(set(picked))


def inputs_for(entry: Any, batch: int, points: int, index: int, seed: int, device: torch.device) -> torch.Tensor:
    """The model's input for call ``index`` of the sequence: fresh random coordinates in
    [0, 1)^2, seeded per call, so that every worker process builds the same ones."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    coords = torch.rand(batch, points, 1, 2, generator=generator)  # a mesh of points x 1
    return entry.inputs(coords).to(device)


def free_count_models() -> list[str]:
    """The zoo models that take any point count: points layout, no structured mesh."""
    from autofuser.zoo.models import MODELS

    return [
        name
        for name, entry in MODELS.items()
        if entry.layout == "points" and all("mesh" not in config for config in entry.configs.values())
    ]


# ---------------------------------------------------------------------------
# A worker: one system in a process of its own
# ---------------------------------------------------------------------------


def run_worker(settings: dict[str, Any], system: str) -> dict[str, Any]:
    """Every call of ``system`` on the sequence, then its steady times; an exception is the
    result's ``error`` (with the calls measured before it)."""
    from autofuser.zoo.harness import autocast_for, describe_error, first_call_s, relative_error, synchronize
    from autofuser.zoo.models import MODELS

    device = torch.device(settings["device"])
    entry = MODELS[settings["model"]]
    torch.manual_seed(0)
    model = entry.make(settings["config"]).to(device).eval()
    batch, seed, dtype = settings["batch"], settings["seed"], settings["dtype"]
    limit = MAX_REL_ERROR[dtype]
    result: dict[str, Any] = {"system": system, "calls": [], "steady": {}, "mismatches": [], "error": None}

    def run(fn: Callable[..., Any], x: torch.Tensor) -> Callable[[], Any]:
        def call():
            with torch.no_grad(), autocast_for(device, dtype):
                return fn(x)

        return call

    def checked(out: Any, x: torch.Tensor, where: str) -> float:
        reference = run(model, x)()
        error = relative_error(out, reference)
        if not error <= limit:  # NaN too
            message = f"{system}: {where}: relative error {error:.3g} against eager > {limit:g}"
            result["mismatches"].append(message)
            progress(f"MISMATCH {message}")
        return error

    # Eager once, as every worker does before its system (CUDA context, cuBLAS handles).
    warm_points = max(2, settings["min_points"] // 2)
    first_call_s(run(model, inputs_for(entry, batch, warm_points, -1, seed, device)), device)
    scratch = Path(settings["scratch"])
    try:
        fn, reference_cold = system_for(system, model, settings, scratch, result)
        counts = settings["counts"]
        if system == SPECIALISED:
            counts = counts[:1]  # the one cold compile; its steady modules compile below
        for index, points in enumerate(counts):
            x = inputs_for(entry, batch, points, index, seed, device)
            before = compile_marker(system, fn)
            out, seconds = first_call_s(run(fn, x), device)
            call = {"index": index, "points": points, "first_call_s": seconds}
            call.update(compile_record(system, fn, before))
            call["rel_err"] = 0.0 if system == "eager" else checked(out, x, f"first call on {points} points")
            result["calls"].append(call)
            what = f", compiled in {call['compile_s']:.2f} s" if call.get("compile_s") is not None else ""
            progress(f"{system}: {index + 1}/{len(counts)}: {points} points, {seconds:.3f} s{what}")
            del out
        for points in settings["steady_counts"]:
            index = settings["counts"].index(points)
            x = inputs_for(entry, batch, points, index, seed, device)
            steady_fn = fn
            cell: dict[str, Any] = {}
            if system == SPECIALISED:
                steady_fn = reference_cold(points)
                out, seconds = first_call_s(run(steady_fn, x), device)
                cell["first_call_s"] = seconds  # cold cache, but a process that compiled before
                cell["rel_err_first"] = checked(out, x, f"first call on {points} points (steady module)")
            cell.update(steady(system, run(steady_fn, x), steady_fn, settings, device))
            synchronize(device)
            cell["rel_err"] = checked(run(steady_fn, x)(), x, f"a steady call on {points} points")
            result["steady"][str(points)] = cell
            progress(f"{system}: steady on {points} points: {cell['ms']:.3f} ms per call")
    except Exception as err:  # the parent reports it and fails the run
        result["error"] = describe_error(err)
        result["traceback"] = traceback.format_exc()
        progress(f"{system} failed: {result['error']}")
    return result


def system_for(
    system: str, model: torch.nn.Module, settings: dict[str, Any], scratch: Path, result: dict[str, Any]
) -> tuple[Callable[..., Any], Callable[[int], Any]]:
    """(the callable measured on the sequence, a maker of the specialised reference's fresh
    module per steady count: each in an empty cache folder of its own)."""
    import autofuser

    def fused(dynamic: Optional[bool], folder: str):
        (scratch / folder).mkdir(parents=True)
        return autofuser.fuse(model, cache_dir=str(scratch / folder), progress=False, dynamic=dynamic)

    def reference(points: int):
        return fused(False, f"autofuser-steady-{points}")

    if system == "eager":
        return model, reference
    if system == DYNAMIC:
        return fused(None, "autofuser"), reference
    if system == SPECIALISED:
        return fused(False, "autofuser-cold"), reference
    mode = system.removeprefix("torch.compile").strip() or "default"
    torch._dynamo.reset()
    result["mode"] = mode
    return compiled(model, mode), reference


def compile_marker(system: str, fn: Any) -> Any:
    """What tells, after a call, whether it compiled: AutoFuser's current reports, or
    Dynamo's count of graphs compiled."""
    if system in (DYNAMIC, SPECIALISED):
        return list(fn.reports())
    if system.startswith("torch.compile"):
        return dynamo_graphs()
    return None


def dynamo_graphs() -> Optional[int]:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # a torch without the counter: not recorded
        return None


def compile_record(system: str, fn: Any, before: Any) -> dict[str, Any]:
    """What a first call compiled: for AutoFuser, whether its report is new and that
    report's compile time, phases, shape class and groups; for torch.compile, the graphs
    Dynamo compiled during it."""
    if system.startswith("torch.compile"):
        after = dynamo_graphs()
        graphs = None if before is None or after is None else after - before
        return {"compiled": None if graphs is None else graphs > 0, "graphs_compiled": graphs}
    if system not in (DYNAMIC, SPECIALISED):
        return {}
    report = fn.report()
    if any(report is old for old in before):
        return {"compiled": False, "compile_s": None}
    fused = report.fused
    return {
        "compiled": True,
        "compile_s": report.compile_s,
        "phases": dict(report.phases),
        "dynamic_dims": list(report.dynamic_dims),
        "runs_original": report.runs_original,
        "fused_groups": len(fused),
        "kernels": sorted({g.kernel for g in fused if g.kernel}),
        "size_buckets": sorted({b for g in fused for b in g.size_buckets}),
        "groups_with_run_time_sizes": sum(bool(g.run_time_sizes) for g in fused),
        "groups_class_checked": sum(g.class_checked for g in fused),
        "specialised": sorted({f"{g.strategy}: {g.specialised}" for g in fused if g.specialised}),
        "groups": [
            {
                "strategy": g.strategy,
                "kernel": g.kernel,
                "run_time_sizes": dict(g.run_time_sizes),
                "size_buckets": list(g.size_buckets),
                "specialised": g.specialised,
                "class_checked": g.class_checked,
            }
            for g in fused
        ],
    }


def steady(system: str, call: Callable[[], Any], fn: Any, settings: dict[str, Any], device: torch.device) -> dict:
    """The steady time per call (``timed``: median over blocks of calls after the warm-up),
    AutoFuser's checks in use given up to ``SETTLE_LIMIT`` calls first."""
    from autofuser.zoo.harness import timed

    cell: dict[str, Any] = {}
    if system in (DYNAMIC, SPECIALISED):
        calls = 0
        while fn.checking_in_use and calls < SETTLE_LIMIT:
            call()
            calls += 1
        cell["settle_calls"] = calls
        cell["checking_in_use"] = fn.checking_in_use  # a check still pending (another shape's, or this)
        cell["runs_original"] = fn.report().runs_original
    cell.update(timed(call, settings["iters"], settings["warmup"], device))
    return cell


def worker_main(settings_path: str, system: str, out_path: str) -> int:
    settings = json.loads(Path(settings_path).read_text())
    result = run_worker(settings, system)
    Path(out_path).write_text(json.dumps(result, indent=1))
    return 0


# ---------------------------------------------------------------------------
# The parent: every system in turn, then the summary
# ---------------------------------------------------------------------------


def run_system(settings: dict[str, Any], system: str, scratch: Path) -> dict[str, Any]:
    """``system``'s worker in a new process with empty AutoFuser, Triton and Inductor caches."""
    folder = scratch / system.replace(" ", "-").replace("=", "-")
    folder.mkdir(parents=True)
    settings_path, out_path = folder / "settings.json", folder / "result.json"
    settings_path.write_text(json.dumps({**settings, "scratch": str(folder)}))
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=str(folder / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"),
        AUTOFUSER_CACHE_DIR=str(folder / "autofuser-default"),
        PYTHONUNBUFFERED="1",
    )
    if settings["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"  # before the worker imports Triton
    command = [sys.executable, __file__, "--worker", system, "--worker-settings", str(settings_path)]
    command += ["--worker-out", str(out_path)]
    progress(f"{system}: in a fresh process")
    started = time.perf_counter()
    done = subprocess.run(command, env=env)  # its progress goes to our stderr as it comes
    if not out_path.exists():
        return {
            "system": system,
            "calls": [],
            "steady": {},
            "mismatches": [],
            "error": f"worker exited {done.returncode}",
        }
    result = json.loads(out_path.read_text())
    result["process_s"] = time.perf_counter() - started
    return result


def summarize(settings: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Totals, the reference and the ratios against the issue's targets."""
    reference = results.get(SPECIALISED, {})
    cold = reference.get("calls", [{}])[0].get("first_call_s") if reference.get("calls") else None
    summary: dict[str, Any] = {"one_cold_compile_s": cold, "systems": {}}
    for system, result in results.items():
        calls = result.get("calls", [])
        complete = len(calls) == (1 if system == SPECIALISED else len(settings["counts"]))
        total = sum(c["first_call_s"] for c in calls) if complete else None
        compiles = [c for c in calls if c.get("compiled")]
        row = {
            "first_calls_total_s": total,
            "first_calls_vs_one_cold_compile": total / cold if total is not None and cold else None,
            "compiles": len(compiles) if system != "eager" else 0,
            "compile_s_total": sum(c.get("compile_s") or 0.0 for c in compiles) if compiles else None,
            "max_rel_err": max(
                [c.get("rel_err", 0.0) for c in calls]
                + [s.get(k, 0.0) for s in result.get("steady", {}).values() for k in ("rel_err", "rel_err_first")],
                default=None,
            ),
            "steady_ms": {p: s.get("ms") for p, s in result.get("steady", {}).items()},
        }
        summary["systems"][system] = row
    dynamic, specialised = summary["systems"].get(DYNAMIC, {}), summary["systems"].get(SPECIALISED, {})
    ratios = {}
    for points in map(str, settings["steady_counts"]):
        mine, theirs = dynamic.get("steady_ms", {}).get(points), specialised.get("steady_ms", {}).get(points)
        ratios[points] = mine / theirs if mine and theirs else None
    summary["steady_vs_specialised"] = ratios
    first = dynamic.get("first_calls_vs_one_cold_compile")
    summary["targets"] = {
        "first_calls": None if first is None else first <= FIRST_CALLS_TARGET,
        "steady": None if None in ratios.values() else all(r <= STEADY_TARGET for r in ratios.values()),
    }
    return summary


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The short table and the targets: what the run prints last."""
    s, summary = result["settings"], result["summary"]
    steady_counts = [str(p) for p in s["steady_counts"]]
    lines = [
        f"{s['model']} ({s['config']}), batch {s['batch']}, {s['dtype']}, {result['device']}: "
        f"{len(s['counts'])} point counts from {s['min_points']} to {s['max_points']} (seed {s['seed']}); "
        f"one cold compile (AutoFuser dynamic=False, first count {s['counts'][0]}): "
        f"{_num(summary['one_cold_compile_s'], '.2f')} s",
        "",
        "| system | first calls, total s | / one cold compile | compiles | "
        + " | ".join(f"steady ms at {p}" for p in steady_counts)
        + " | max rel err |",
        "|---|---|---|---|" + "---|" * len(steady_counts) + "---|",
    ]
    for system, row in summary["systems"].items():
        status = result["systems"][system]
        if status.get("skipped"):
            lines.append(f"| {system} | {status['skipped']} |")
            continue
        cells = [
            "(first count only)" if system == SPECIALISED else _num(row["first_calls_total_s"], ".2f"),
            "1 (the reference)" if system == SPECIALISED else _num(row["first_calls_vs_one_cold_compile"], ".2f"),
            str(row["compiles"]) if system != "eager" else "-",
            *[_num(row["steady_ms"].get(p), ".3f") for p in steady_counts],
            ("(the reference)" if system == "eager" else _num(row["max_rel_err"], ".1e"))
            + (" ERROR" if status.get("error") else ""),
        ]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    first = summary["systems"].get(DYNAMIC, {}).get("first_calls_vs_one_cold_compile")
    ratios = summary["steady_vs_specialised"]

    def verdict(met: Optional[bool]) -> str:
        return "not measured" if met is None else ("met" if met else "NOT met")

    lines += [
        "",
        f"- AutoFuser first calls / one cold compile: {_num(first, '.2f')} "
        f"(target <= {FIRST_CALLS_TARGET:g}): {verdict(summary['targets']['first_calls'])}",
        "- AutoFuser steady / specialised steady: "
        + ", ".join(f"{_num(r, '.3f')} at {p}" for p, r in ratios.items())
        + f" (target <= {STEADY_TARGET:.2f}): {verdict(summary['targets']['steady'])}",
    ]
    for note in result["notes"]:
        lines.append(f"- {note}")
    problems = result["mismatches"] + [
        f"{name}: {r['error']}" for name, r in result["systems"].items() if r.get("error")
    ]
    for problem in problems:
        lines.append(f"- **FAILED** {problem}")
    return lines


def detail_lines(result: dict[str, Any]) -> list[str]:
    """Each AutoFuser first call: what the new count cost, and where the time went."""
    calls = result["systems"].get(DYNAMIC, {}).get("calls", [])
    if not calls:
        return []
    phases: list[str] = []
    for call in calls:
        phases += [p for p in call.get("phases", {}) if p not in phases]
    lines = [
        "",
        "AutoFuser (dynamic=None), each first call in sequence order; phases in s (the report's compile-time "
        "breakdown); new kernels: sources no earlier call had",
        "",
        "| # | points | first call s | compiled | compile s | "
        + " | ".join(phases)
        + " | dynamic dims | buckets | new kernels | groups with run-time sizes | specialised groups |",
        "|---|---|---|---|---|" + "---|" * len(phases) + "---|---|---|---|---|",
    ]
    seen: set[str] = set()
    for call in calls:
        new = [k for k in call.get("kernels", []) if k not in seen]
        seen.update(call.get("kernels", []))
        compiled_now = call.get("compiled")
        cells = [
            str(call["index"] + 1),
            str(call["points"]),
            f"{call['first_call_s']:.3f}",
            "yes" if compiled_now else "no",
            _num(call.get("compile_s"), ".2f"),
            *[_num(call.get("phases", {}).get(p), ".2f") for p in phases],
            "; ".join(call.get("dynamic_dims", [])) or ("specialised" if compiled_now else "-"),
            ",".join(map(str, call.get("size_buckets", []))) or "-",
            str(len(new)) if compiled_now else "-",
            f"{call['groups_with_run_time_sizes']}/{call['fused_groups']}" if compiled_now else "-",
            "; ".join(call.get("specialised", [])) or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Distinct kernel sources over the sequence: {len(seen)}")
    steady = result["systems"].get(SPECIALISED, {}).get("steady", {})
    if steady:
        # Cold caches, but in a process that had compiled the first count: not the reference.
        colds = ", ".join(f"{_num(cell.get('first_call_s'), '.2f')} s at {p}" for p, cell in steady.items())
        lines.append(f"AutoFuser dynamic=False, first calls of its steady modules (each in an empty cache): {colds}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", help="folder for dynamic.json and dynamic.md (required)")
    parser.add_argument("--model", default="galerkin", help="a zoo model that takes any point count")
    parser.add_argument("--config", choices=("airfoil", "tiny"), default="airfoil", help="tiny: toy sizes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", choices=tuple(MAX_REL_ERROR), default="fp32", help="bf16: torch.autocast")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--counts", type=int, default=50, help="distinct point counts in the sequence")
    parser.add_argument("--min-points", type=int, default=4096)
    parser.add_argument("--max-points", type=int, default=16384, help="inclusive")
    parser.add_argument("--seed", type=int, default=0, help="of the counts, their order and the coordinates")
    parser.add_argument("--steady-counts", type=int, default=3, help="counts timed steady: smallest, middle, largest")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per steady count")
    parser.add_argument("--warmup", type=int, default=5, help="calls before the timed ones")
    parser.add_argument(
        "--compile-modes",
        default=("default",),
        type=parse_compile_modes,
        metavar="MODES",
        help="torch.compile modes, comma-separated, each a system of its own (dynamic left at torch's default)",
    )
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile systems")
    parser.add_argument(
        "--compile-on-cpu", action="store_true", help="run torch.compile on a CPU too (skipped there: slow)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-settings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return parser


def check_args(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the options, with the fix; None when nothing is."""
    from autofuser.zoo.models import MODELS

    free = free_count_models()
    if not args.out:
        return "--out FOLDER is required: where dynamic.json and dynamic.md go"
    if args.model not in MODELS:
        return f"--model {args.model!r} is no zoo model; give one of {', '.join(free)}"
    if args.model not in free:
        return (
            f"--model {args.model} needs a structured mesh (its point count is H x W of its configuration); "
            f"give one that takes any point count: {', '.join(free)}"
        )
    if args.dtype not in MODELS[args.model].dtypes:
        return f"{args.model} does not support --dtype {args.dtype}; it supports {', '.join(MODELS[args.model].dtypes)}"
    if not 2 <= args.min_points <= args.max_points:
        return "--min-points must be at least 2 (sizes 0 and 1 are never dynamic) and at most --max-points"
    if not 1 <= args.counts <= args.max_points - args.min_points + 1:
        return (
            f"--counts {args.counts}: give 1 to {args.max_points - args.min_points + 1}, the distinct counts "
            f"between --min-points and --max-points"
        )
    if not 1 <= args.steady_counts <= args.counts:
        return "--steady-counts must be between 1 and --counts"
    if args.iters < 1 or args.warmup < 0 or args.batch < 1:
        return "--iters and --batch must be >= 1, --warmup >= 0"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda but no CUDA device is available; use --device cpu"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker_settings, args.worker, args.worker_out)
    problem = check_args(args)
    if problem:
        progress(problem)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    notes = []
    counts = draw_counts(args.counts, args.min_points, args.max_points, args.seed)
    settings = {
        "model": args.model,
        "config": args.config,
        "batch": args.batch,
        "dtype": args.dtype,
        "device": str(device),
        "counts": counts,
        "min_points": args.min_points,
        "max_points": args.max_points,
        "seed": args.seed,
        "steady_counts": steady_counts_of(counts, args.steady_counts),
        "iters": args.iters,
        "warmup": args.warmup,
    }
    systems = ["eager", DYNAMIC]
    skipped: dict[str, str] = {}
    modes = () if args.no_compile else tuple(args.compile_modes)
    for mode in modes:
        if device.type == "cpu" and not args.compile_on_cpu:
            skipped[compile_key(mode)] = "skipped on a CPU (--compile-on-cpu runs it)"
        else:
            systems.append(compile_key(mode))
    if skipped:
        notes.append(
            "torch.compile skipped on a CPU: Inductor builds C++ for each graph, minutes on a small shared CPU "
            "(--compile-on-cpu runs it)"
        )
    if device.type == "cpu":
        notes.append("CPU run: AutoFuser's kernels run under Triton's interpreter; times say nothing about a GPU")
        progress("CPU run: TRITON_INTERPRET=1 in every worker (AutoFuser kernels under Triton's interpreter)")
    # The reference last: nothing of it is in the process of another system anyway (a worker each).
    systems.append(SPECIALISED)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="autofuser-dynamic-") as scratch:
        for system in systems:
            results[system] = run_system(settings, system, Path(scratch))
    mismatches = [m for r in results.values() for m in r.get("mismatches", [])]
    for system, reason in skipped.items():
        results[system] = {"system": system, "skipped": reason, "calls": [], "steady": {}, "mismatches": []}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "settings": settings,
        "systems": results,
        "mismatches": mismatches,
        "notes": notes,
    }
    result["summary"] = summarize(settings, {k: v for k, v in results.items() if not v.get("skipped")})
    for system in skipped:
        result["summary"]["systems"][system] = {"steady_ms": {}}
    summary = summary_lines(result)
    (out / "dynamic.json").write_text(json.dumps(result, indent=1))
    (out / "dynamic.md").write_text("\n".join(summary + detail_lines(result)) + "\n")
    failed = bool(mismatches) or any(r.get("error") for r in results.values())
    if failed:
        progress("FAILED: a system's output differed from eager's, or a system failed (see the table's last lines)")
    print("\n".join(summary))
    return 1 if failed else 0


def _triton_version() -> Optional[str]:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
