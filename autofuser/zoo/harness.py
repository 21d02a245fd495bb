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
4. torch.compile, once per mode of ``--compile-modes`` (default: ``default``
   and ``reduce-overhead``, whose CUDA graphs replay Inductor's kernels as
   AutoFuser replays its own): after ``torch._dynamo.reset()``,
   ``torch.compile(model, mode=mode)``; its first call, then the median time,
   then one more call checked (in reduce-overhead, a replay of the recorded
   graph rather than the first call's warm-up run); skipped with
   ``--no-compile``. Each mode is a system of its own (``compile_system``):
   its own cells, columns and geometric mean, and a failure in one mode is
   that cell's error. On a CPU, reduce-overhead records no CUDA graph (Inductor
   skips them off CUDA) and runs the default mode's kernels; its cell says so.

Every system's output is compared with eager (``||out - eager|| / ||eager||``)
and with the airfoil target (the relative L2 test loss). Where some system's
error against eager is past ``MAX_REL_ERROR``, the model runs once more in
float64 (``judge_by_float64``) and every system's error against that is
recorded: ``wrong_results`` fails an AutoFuser result only if it is far from
float64 too, where eager is not. ``--dtype bf16`` runs
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
import copy
import datetime
import gc
import itertools
import json
import math
import os
import platform
import re
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
from autofuser_core.interpreter import FIX, kernels_decorated
from autofuser_core.tf32 import strict_fp32  # fp32 without TF32 (the float64 reference's stand-in)
from autofuser_core.verify import FLOAT64_FACTOR as VERIFY_FLOAT64_FACTOR
from autofuser_core.verify import no_autocast

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
NO_COMPILE = "skipped: --no-compile"
#: torch.compile's modes measured unless ``--compile-modes`` says otherwise.
DEFAULT_COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead")
#: Modes whose compiled forward replays CUDA graphs (on CUDA).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
#: A CUDA-graph mode's note on a CPU, where Inductor records no graph.
NO_CUDA_GRAPHS_ON_CPU = (
    "no CUDA graphs on a CPU: Inductor skips them off CUDA, so this mode runs the default mode's kernels"
)


def compile_system(mode: str) -> str:
    """The system (cell, column and geometric-mean key) of torch.compile in ``mode``:
    ``torch.compile`` for the default mode, ``torch.compile MODE`` for another."""
    return "torch.compile" if mode == "default" else f"torch.compile {mode}"


def systems_of(compile_modes: tuple[str, ...]) -> tuple[str, ...]:
    """Every system of a run, in table order: eager, torch.compile in each mode, AutoFuser."""
    return ("eager", *(compile_system(mode) for mode in compile_modes), "autofuser")


#: The systems of a run in the default modes.
SYSTEMS = systems_of(DEFAULT_COMPILE_MODES)
TRAIN_LR = 1e-3


def progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autofuser bench`` (declared in ``autofuser.cli``, which --help reads
    without importing the zoo)."""
    from autofuser.cli import add_bench_arguments

    add_bench_arguments(parser)


def run_from_args(args: argparse.Namespace) -> int:
    if args.iters < 1 or args.warmup < 0 or args.train_steps < 0:
        progress("--iters must be >= 1, --warmup and --train-steps >= 0")
        return 2
    if args.train and args.fresh_first_calls:
        progress("--fresh-first-calls times forward first calls; it does not combine with --train")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        progress("--device cuda but no CUDA device is available; use --device cpu")
        return 2
    custom: dict[str, tuple] = {}
    try:
        use_interpreter_on_cpu(device)  # before the factory runs: it may import a plugin's kernels
    except BenchError as err:
        progress(str(err))
        return 2
    if args.factory is not None:
        zoo_only = [flag for flag, used in ZOO_ONLY_OPTIONS.items() if used(args)]
        if zoo_only:
            progress(
                f"{', '.join(zoo_only)} apply to zoo models only; drop them to bench {args.factory}, "
                "or drop MODULE:FACTORY to bench the zoo"
            )
            return 2
        from autofuser.cli import call_factory

        names = [args.factory]
        custom[args.factory] = call_factory(args.factory, "bench")
    else:
        names = list(MODELS) if args.models.strip() == "all" else [m.strip() for m in args.models.split(",")]
        names = [m for m in names if m]
        unknown = [m for m in names if m not in MODELS]
        if unknown:
            progress(
                f"unknown model(s) {', '.join(unknown)}; the zoo has {', '.join(MODELS)} "
                "(or bench your own: autofuser bench path/to/file.py:make_model)"
            )
            return 2
    try:
        result = run_bench(
            names,
            device=device,
            dtype=args.dtype,
            iters=args.iters,
            warmup=args.warmup,
            out=Path(args.out),
            config=args.config,
            compile_modes=tuple(args.compile_modes),
            no_compile=args.no_compile,
            train_steps=args.train_steps,
            batch_size=args.batch_size,
            cache_root=Path(args.cache_dir) if args.cache_dir else None,
            fuse_options={
                **({} if args.tune_budget is None else {"tune_budget_s": args.tune_budget}),
                **({"tune_all_configs": True} if args.tune_all_configs else {}),
                **dict(getattr(args, "fuse_option", None) or ()),
            },
            fresh_first_calls=args.fresh_first_calls,
            train=args.train,
            custom_models=custom,
            keep_cache=args.keep_cache,
        )
    except BenchError as err:
        progress(str(err))
        return 2
    print(result["markdown"])
    wrong = wrong_results(result.get("rows", []), args.dtype)
    for line in wrong:
        progress(line)
    return 1 if wrong else 0


#: The largest relative L2 error against eager an AutoFuser output (and, training, its
#: gradients) may have in a bench, per ``--dtype``: an fp32 run differs from eager by
#: the order of its sums (about 1e-5 on the zoo); a bf16 run by bf16 roundings taken at
#: other points (a few 1e-3). Past it, the float64 reference judges (``wrong_results``).
MAX_REL_ERROR = {"fp32": 1e-4, "bf16": 4e-2}

#: The float64 reference's rule: a result past ``MAX_REL_ERROR`` against eager is a
#: rounding difference, not a wrong result, while its error against the float64 result is
#: at most this many times eager's own error against float64, plus the limit. Where a
#: model's sums are ill-conditioned (long fp32 sums whose terms cancel), eager itself
#: misses the exact value by more than the limit and any other order of the same sums
#: misses eager by about as much; a wrong kernel misses the exact value by the size of
#: its mistake, whatever eager's error. The factor is the fusion check's float64 judge's
#: (``autofuser_core.verify.FLOAT64_FACTOR``), here over the whole result.
FLOAT64_FACTOR = VERIFY_FLOAT64_FACTOR

#: Each error against eager a cell records, with the key of its error against the float64
#: reference and what the gate's message calls that result.
FLOAT64_KEYS = {
    "rel_err_vs_eager": ("rel_err_vs_float64", "output differs"),
    "grad_rel_err_vs_eager": ("grad_rel_err_vs_float64", "gradients differ"),
}


def past_limit(error: Optional[float], dtype: str) -> bool:
    """Whether a recorded error against eager is past ``MAX_REL_ERROR[dtype]`` (NaN is)."""
    return error is not None and not error <= MAX_REL_ERROR[dtype]


def wrong_results(rows: list[dict[str, Any]], dtype: str) -> list[str]:
    """One line per AutoFuser result of ``rows`` (outputs, and gradients where a training
    step was timed) that is wrong: farther from eager's than ``MAX_REL_ERROR[dtype]``, and
    either no float64 reference ran for its row or it is farther from the float64 result
    than ``FLOAT64_FACTOR`` times eager's own error against it, plus the limit. NaN is
    wrong. A bench that measured a wrong model must not pass as a speedup."""
    limit = MAX_REL_ERROR[dtype]
    lines = []
    for row in rows:
        cell = row["systems"].get("autofuser") or {}
        eager = row["systems"].get("eager") or {}
        for key, (exact_key, what) in FLOAT64_KEYS.items():
            error = cell.get(key)
            if not past_limit(error, dtype):
                continue
            head = (
                f"WRONG RESULT: {row['model']} ({dtype}): AutoFuser's {what} from eager's "
                f"by a relative error of {error:.3g}, above the {limit:g} allowed for {dtype}"
            )
            mine, eagers = cell.get(exact_key), eager.get(exact_key)
            if mine is None or eagers is None:
                why = row.get("float64_reference") or "not run"
                judged = f", and there is no float64 reference to judge it by ({why})"
            else:
                bound = FLOAT64_FACTOR * eagers + limit
                if mine <= bound:
                    continue  # as close to the exact result as eager's rounding allows
                judged = (
                    f"; against the float64 result its error is {mine:.3g}, eager's {eagers:.3g}, "
                    f"past the {FLOAT64_FACTOR:g} x {eagers:.3g} + {limit:g} = {bound:.3g} allowed"
                )
            lines.append(f"{head}{judged}; its speedup does not count. Please report it with bench.json.")
    return lines


#: Options that only mean something for zoo models (each with how to tell it was given).
ZOO_ONLY_OPTIONS: dict[str, Callable[[argparse.Namespace], bool]] = {
    "--models": lambda a: a.models.strip() != "all",
    "--train": lambda a: a.train,
    "--train-steps": lambda a: a.train_steps != 0,
    "--batch-size": lambda a: a.batch_size is not None,
    "--fresh-first-calls": lambda a: a.fresh_first_calls,
}


def main(argv: Optional[list[str]] = None) -> int:
    from autofuser.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


class BenchError(Exception):
    """``autofuser bench`` can't measure what it was asked to; the message says why and the fix."""


def use_interpreter_on_cpu(device: torch.device) -> None:
    """On a CPU, AutoFuser's kernels run under Triton's interpreter: turn it on, or refuse
    to run where that is too late (a kernel was already decorated for the GPU backend, so
    every group would fail and the table would compare eager with eager)."""
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if kernels_decorated():
        raise BenchError(
            "a CPU bench needs Triton's interpreter, and Triton kernels were already built for the GPU "
            f"in this process, so AutoFuser could fuse nothing. Run it as the `autofuser bench` command, or {FIX}"
        )
    # Triton picks the interpreter when a kernel is decorated: set before AutoFuser builds any.
    os.environ["TRITON_INTERPRET"] = "1"
    progress("CPU run: TRITON_INTERPRET=1 (AutoFuser kernels run under Triton's interpreter)")


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_for(device: torch.device, dtype: str):
    """The autocast context of ``--dtype``: none for fp32, bfloat16 autocast on ``device`` for bf16."""
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


#: How ``timed`` measures, as bench.md says it.
TIMING = "torch.utils.benchmark.Timer; median and IQR over blocks of calls"
#: At most this many timed blocks per system; ``--iters`` calls are split among them.
REPEATS = 10
#: A spread (IQR over the blocks) above this share of the median marks the time noisy:
#: torch.utils.benchmark's own threshold for warning about a measurement.
NOISY_IQR = 0.1


#: Calls (or training steps) at most before AutoFuser's timed ones, for its check in use to settle.
SETTLE_CALLS = 64


def settle(fused: Any, step: Callable[[], Any]) -> int:
    """Run ``step`` until ``fused``'s check in use has settled which runner it keeps (a
    benchmark times what the user's later calls run, not the check's mix of both); returns
    how many steps that took. Raises when it has not settled within ``SETTLE_CALLS``: its
    spans would take in the other systems' calls."""
    count = 0
    while fused.checking_in_use and count < SETTLE_CALLS:
        step()
        count += 1
    if fused.checking_in_use:
        raise RuntimeError(f"AutoFuser's check in use did not settle within {SETTLE_CALLS} calls")
    return count


def timed(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """``fn``'s time per call after ``warmup`` calls, by ``torch.utils.benchmark.Timer``:
    ``iters`` calls in up to ``REPEATS`` blocks of calls back to back (the Timer waits for
    the GPU around each block, and warms each block up with a call or two of its own).
    ``ms`` is the median over the blocks of the time per call, ``iqr_ms`` their interquartile
    range, ``noisy`` whether that spread exceeds ``NOISY_IQR`` of the median (a speedup
    from such a time is not to be trusted), ``block_ms`` each block's time per call."""
    from torch.utils.benchmark import Timer
    from torch.utils.benchmark.utils.common import Measurement

    for _ in range(warmup):
        fn()
    repeats = min(iters, REPEATS)
    # Timer runs on one thread unless told otherwise: time as the model runs outside it.
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        blocks = [timer.timeit(max(1, iters // repeats)) for _ in range(repeats)]
    (measured,) = Measurement.merge(blocks)
    ms, iqr_ms = measured.median * 1e3, measured.iqr * 1e3
    return {
        "ms": ms,
        "iqr_ms": iqr_ms,
        "repeats": repeats,
        "noisy": iqr_ms > NOISY_IQR * ms,
        "block_ms": [round(t * 1e3, 3) for t in measured.times],
    }


def spread(times_ms: list[float]) -> dict[str, Any]:
    """``timed``'s fields from per-step times measured elsewhere (the training bench's turns)."""
    ordered = sorted(times_ms)
    median = float(statistics.median(ordered))
    if len(ordered) < 2:
        iqr = 0.0
    else:
        quartiles = statistics.quantiles(ordered, n=4, method="inclusive")
        iqr = quartiles[2] - quartiles[0]
    return {"ms": median, "iqr_ms": iqr, "repeats": len(ordered), "noisy": iqr > NOISY_IQR * median}


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


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, in order: the output itself, or those inside its
    tuples, lists and dict values."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for value in out.values() for t in output_tensors(value)]
    if isinstance(out, (tuple, list)):
        return [t for value in out for t in output_tensors(value)]
    return []


def relative_error(out: Any, reference: Any) -> float:
    """``||out - reference|| / ||reference||`` over every tensor of the two outputs together."""
    outs, references = output_tensors(out), output_tensors(reference)
    if len(outs) != len(references) or any(o.shape != r.shape for o, r in zip(outs, references)):
        raise ValueError(
            f"the output has {len(outs)} tensor(s) of shapes {[list(t.shape) for t in outs]}, eager's "
            f"{len(references)} of shapes {[list(t.shape) for t in references]}"
        )
    if not outs:
        return 0.0
    difference = torch.cat([(o.detach().double() - r.detach().double()).flatten() for o, r in zip(outs, references)])
    denominator = torch.cat([r.detach().double().flatten() for r in references]).norm()
    return float(difference.norm() / denominator) if denominator > 0 else float(difference.norm())


def to_float64(value: Any) -> Any:
    """``value`` with every floating tensor in it (nested in tuples, lists, dict values) in
    float64 and every complex one in complex128; anything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return value.to(torch.complex128)
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: to_float64(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_float64(v) for v in value)
    return value


def widened(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are ``to_float64``
    (``Module.double`` would leave complex ones, the FNO's spectral weights, as they are)."""
    wide = copy.deepcopy(model)
    for tensor in itertools.chain(wide.parameters(), wide.buffers()):
        tensor.data = to_float64(tensor.data)
    return wide


def float64_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The output of ``widened(model)`` on ``to_float64`` of the inputs, autocast off, no_grad."""
    wide = widened(model)
    with torch.no_grad(), no_autocast():
        return wide(*to_float64(args), **to_float64(kwargs))


def strict_fp32_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """``float64_forward``'s stand-in for a model that can't run in float64 (the FNO's
    spectral layers cast to fp32 on purpose): its output in fp32 with every product and
    convolution in full fp32 (``strict_fp32``), autocast off, no_grad. Far closer to the
    exact result than eager in TF32 or bf16, which is what the gate weighs."""
    with torch.no_grad(), no_autocast(), strict_fp32():
        return model(*args, **kwargs)


def judge_by_float64(
    name: str,
    row: dict[str, Any],
    dtype: str,
    kept: dict[str, dict[str, list[Any]]],
    reference: Callable[[], dict[str, Any]],
    device: torch.device,
    fallback: Optional[Callable[[], dict[str, Any]]] = None,
) -> None:
    """Where some cell of ``row`` is ``past_limit`` against eager, run ``reference()`` - the
    float64 results, ``{key: result}`` for each key of ``FLOAT64_KEYS``' values - and
    record in each system's cell, for each ``key: [its results]`` of ``kept[system]``, the
    largest relative error of those results against the float64 one. ``row["float64_reference"]``
    says whether it ran ("ran", "not needed", or "failed: " and why: an op without float64,
    no memory for it; ``wrong_results`` then falls back to the plain limit). Where it fails
    and ``fallback`` is given - the same results in strict fp32 (``strict_fp32_forward``) -
    that judges instead, and the row says "strict fp32" and why float64 failed."""
    # Only where needed: a float64 copy of the model and its run (for a training step, its
    # backward's saved activations too) cost twice eager's memory, which a model that fills
    # the GPU doesn't have, and on a CPU the time of one more step of every bench.
    past = [s for s, cell in row["systems"].items() if any(past_limit(cell.get(k), dtype) for k in FLOAT64_KEYS)]
    if not past:
        row["float64_reference"] = "not needed"
        return
    progress(f"{name}: {', '.join(past)} past the {MAX_REL_ERROR[dtype]:g} limit against eager: float64 reference")

    def measure(run: Callable[[], dict[str, Any]]) -> dict[str, dict[str, float]]:
        exact = run()  # freed on return, before release_memory empties the cache
        return {
            system: {key: worst([relative_error(r, exact[key]) for r in found]) for key, found in results.items()}
            for system, results in kept.items()
        }

    errors: dict[str, dict[str, float]] = {}
    failed = None
    try:
        errors = measure(reference)
        row["float64_reference"] = "ran"
    except Exception as err:  # noqa: BLE001 - recorded; the gate falls back to the plain limit
        failed = row["float64_reference"] = f"failed: {describe_error(err)}"
    if failed is not None:
        if fallback is not None:
            release_memory(device)
            try:
                errors = measure(fallback)
                row["float64_reference"] = f"strict fp32 (float64 {failed})"
            except Exception as again:  # noqa: BLE001 - as above
                row["float64_reference"] = f"{failed}; strict fp32 too: {describe_error(again)}"
        progress(f"{name}: the float64 reference {row['float64_reference']}")
    for system, recorded in errors.items():
        row["systems"][system].update(recorded)
    release_memory(device)


def worst(errors: list[float]) -> float:
    """The largest of ``errors``, NaN where any is NaN."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


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
        "iqr_ms": None,
        "noisy": None,
        "speedup": None,
        "first_call_s": None,
        "rel_err_vs_eager": None,
        "test_loss": None,
    }


def start_row(
    name: str,
    *,
    config: str,
    batch: int,
    train_steps: int,
    empty_cell: Callable[[], dict],
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES,
    no_compile: bool = False,
) -> dict:
    """A row of model ``name`` before anything is measured: every system's cell is ``empty_cell()``
    (torch.compile's, one per mode, with its ``mode``; skipped with ``no_compile``)."""
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
        "systems": system_cells(empty_cell, compile_modes, no_compile),
    }


def system_cells(
    empty_cell: Callable[[], dict], compile_modes: tuple[str, ...], no_compile: bool
) -> dict[str, dict[str, Any]]:
    """A row's cells, one per system of ``systems_of(compile_modes)``, before anything is
    measured; torch.compile's know their mode and are skipped with ``no_compile``."""
    cells = {system: empty_cell() for system in systems_of(compile_modes)}
    for mode in compile_modes:
        cells[compile_system(mode)]["mode"] = mode
        if no_compile:
            cells[compile_system(mode)].update(status="skipped", error=NO_COMPILE)
    return cells


def compile_modes_of(row: dict[str, Any]) -> dict[str, str]:
    """``{system: mode}`` of the torch.compile cells of ``row``, in table order."""
    return {system: cell["mode"] for system, cell in row["systems"].items() if cell.get("mode")}


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
    each torch.compile run (any mode) its caches are reset, unless ``reset_compile`` is
    false (its compiled module is still to be called)."""
    for system, run in runs:
        cell = row["systems"][system]
        try:
            run()
            cell["status"] = "ok"
        except Exception as err:
            # The helper's locals (a half-compiled module, its buffers) die with this block.
            cell.update(status="error", error=describe_error(err), traceback=traceback.format_exc())
            progress(f"{name}: {system} failed: {cell['error']}")
        if cell.get("mode") and reset_compile:
            torch._dynamo.reset()
        release_memory(device)


#: What the AutoFuser speedup cell says where no group was fused: the module ran eager's
#: ops, and its time against eager's is noise, not a speedup.
NOTHING_FUSED = "nothing fused"


def fill_speedups(row: dict[str, Any], time_key: str) -> None:
    """Every cell's ``speedup``: eager's ``time_key`` over the system's (1 for eager); none
    for an AutoFuser that fused no group (its ``nothing_fused`` is set instead)."""
    eager_cell = row["systems"]["eager"]
    for system, cell in row["systems"].items():
        if system == "eager":
            continue
        if system == "autofuser" and cell.get("fused_groups") == 0:
            cell["nothing_fused"] = True
            continue
        if cell[time_key] and eager_cell[time_key]:
            cell["speedup"] = eager_cell[time_key] / cell[time_key]
    eager_cell["speedup"] = 1.0 if eager_cell[time_key] else None


def fresh_cache(cache_dir: Path, keep: bool) -> str:
    """Make ``cache_dir`` ready for a system's first call: emptied (a cold cache), or with
    ``keep`` as a previous run left it (``--keep-cache``). Says which, for the progress line."""
    if not keep:
        shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return "cache as a previous run left it" if keep else "cold cache"


def forward_systems(
    name: str,
    row: dict[str, Any],
    model: torch.nn.Module,
    call: Callable[[Callable[..., Any]], Callable[[], Any]],
    finish: Callable[[dict[str, Any], Any], None],
    inputs: tuple[tuple, dict],
    *,
    device: torch.device,
    dtype: str,
    iters: int,
    warmup: int,
    no_compile: bool,
    cache_dir: Path,
    fuse_options: Optional[dict],
    keep_cache: bool = False,
) -> None:
    """Run and time every system's forward on ``model`` into ``row``: ``call(fn)`` is the
    zero-argument call of ``fn`` (the model, or a system wrapping it) on the row's inputs,
    ``finish(cell, output)`` records what is checked beyond the error against eager,
    ``inputs`` are the call's ``(args, kwargs)``, from which the model's output in float64
    (``float64_forward``), or where that fails in strict fp32 (``strict_fp32_forward``),
    is taken where an error against eager is past the limit (``judge_by_float64``).
    torch.compile runs in each mode of the row's cells (``system_cells``)."""
    autofuser_cell = start_autofuser_cell(row, first_call_cold_s=None, first_call_warm_s=None, warm_phases=None)
    eager_cell = row["systems"]["eager"]
    reference: Any = None
    # Each system's checked outputs, copied (a CUDA-graph replay overwrites its output
    # buffers), for the float64 reference: small beside the model.
    outputs: dict[str, list[list[torch.Tensor]]] = {}

    def check(system: str, out: Any) -> None:
        cell = row["systems"][system]
        finish(cell, out)
        cell["rel_err_vs_eager"] = relative_error(out, reference)
        outputs.setdefault(system, []).append([t.detach().clone() for t in output_tensors(out)])

    def check_again(system: str, out: Any) -> None:
        """``check`` of a later call: the error kept is the worse of the two (NaN if either is)."""
        first_error = row["systems"][system]["rel_err_vs_eager"]
        check(system, out)
        cell = row["systems"][system]
        cell["rel_err_vs_eager"] = worst([first_error, cell["rel_err_vs_eager"]])

    def run_eager() -> None:
        nonlocal reference
        progress(f"{name}: eager")
        reference, seconds = first_call_s(call(model), device)
        eager_cell["first_call_s"] = seconds
        check("eager", reference)
        eager_cell.update(timed(call(model), iters, warmup, device))

    def run_autofuser() -> None:
        progress(f"{name}: AutoFuser, {fresh_cache(cache_dir, keep_cache)} {cache_dir}")
        cold = autofuser.fuse(model, cache_dir=str(cache_dir), **(fuse_options or {}))
        _, seconds = first_call_s(call(cold), device)
        autofuser_cell["first_call_cold_s"] = autofuser_cell["first_call_s"] = seconds
        autofuser_cell.update(report_fields(cold.report()))
        del cold
        release_memory(device)  # the cold module's buffers and CUDA graph pool
        progress(f"{name}: AutoFuser, warm cache")
        warm = autofuser.fuse(model, cache_dir=str(cache_dir), **(fuse_options or {}))
        out, seconds = first_call_s(call(warm), device)
        autofuser_cell["first_call_warm_s"] = seconds
        autofuser_cell["warm_cache_hits"] = sum(g.cache_hit for g in warm.report().fused)
        autofuser_cell["warm_phases"] = dict(warm.report().phases)  # where the warm first call's time went
        check("autofuser", out)
        # Its first calls settle whether the fused forward or the original runs (the check in
        # use, docs/verification.md): they are not timed.
        autofuser_cell["settle_calls"] = settle(warm, call(warm))
        autofuser_cell["warm_notes"] = list(warm.report().notes)
        autofuser_cell["warm_runs_original"] = warm.report().runs_original
        autofuser_cell.update(timed(call(warm), iters, warmup, device))
        # The first call may have run the original while the check in use was under way:
        # check what the timed calls ran too.
        check_again("autofuser", call(warm)())

    def compile_run(system: str, mode: str) -> Callable[[], None]:
        cell = row["systems"][system]

        def run_compile() -> None:
            progress(f"{name}: torch.compile (mode {mode})")
            torch._dynamo.reset()
            if mode in CUDA_GRAPH_MODES and device.type != "cuda":
                cell["note"] = NO_CUDA_GRAPHS_ON_CPU
            compiled = torch.compile(model, mode=mode)
            out, seconds = first_call_s(call(compiled), device)
            cell["first_call_s"] = seconds
            check(system, out)
            cell.update(timed(call(compiled), iters, warmup, device))
            # The first call of a CUDA-graph mode runs its warm-up, not the graph the timed calls
            # replay: check a later call too.
            check_again(system, call(compiled)())

        return run_compile

    runs = [("eager", run_eager), ("autofuser", run_autofuser)]
    if not no_compile:
        runs += [(system, compile_run(system, mode)) for system, mode in compile_modes_of(row).items()]
    run_systems(name, row, runs, device)
    kept = {system: {"rel_err_vs_float64": found} for system, found in outputs.items()}
    outputs.clear()
    judge_by_float64(
        name,
        row,
        dtype,
        kept,
        lambda: {"rel_err_vs_float64": float64_forward(model, *inputs)},
        device,
        fallback=lambda: {"rel_err_vs_float64": strict_fp32_forward(model, *inputs)},
    )
    if row["systems"]["autofuser"]["status"] == "ok" and autofuser_cell["fused_groups"] == 0:
        progress(f"{name}: AutoFuser fused no group; its speedup is left out (see the report's reasons)")


def bench_model(
    name: str,
    *,
    device: torch.device,
    dtype: str,
    iters: int,
    warmup: int,
    config: str,
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES,
    no_compile: bool,
    train_steps: int,
    batch_size: Optional[int],
    cache_dir: Path,
    fuse_options: Optional[dict] = None,
    keep_cache: bool = False,
    fresh_first_calls: bool = False,
) -> dict[str, Any]:
    """One row: every system on zoo model ``name``; errors are recorded, not raised."""
    entry = MODELS[name]
    mesh = MESHES[config]
    batch = batch_size or entry.batch(config)
    row = start_row(
        name,
        config=config,
        batch=batch,
        train_steps=train_steps,
        empty_cell=_empty_cell,
        compile_modes=compile_modes,
        no_compile=no_compile,
    )
    start_autofuser_cell(row, first_call_cold_s=None, first_call_warm_s=None, warm_phases=None)
    prepared = prepare_model(row, dtype=dtype, device=device)
    if prepared is None:
        return row
    model, x, target = prepared

    def call(fn):
        return forward_call(fn, x, device, dtype)

    def finish(cell: dict[str, Any], out: torch.Tensor) -> None:
        cell["test_loss"] = float(relative_l2(entry.as_grid(out, mesh), target))

    forward_systems(
        name,
        row,
        model,
        call,
        finish,
        ((x,), {}),
        device=device,
        dtype=dtype,
        iters=iters,
        warmup=warmup,
        no_compile=no_compile,
        cache_dir=cache_dir,
        fuse_options=fuse_options,
        keep_cache=keep_cache,
    )
    if fresh_first_calls:
        fresh = {"autofuser": "default", **({} if no_compile else compile_modes_of(row))}
        for system, mode in fresh.items():
            progress(f"{name}: {system} first call in a fresh process")
            answer = measure_in_fresh_process(
                name,
                "autofuser" if system == "autofuser" else "torch.compile",
                device=str(device),
                dtype=dtype,
                config=config,
                batch=batch,
                compile_mode=mode,
                fuse_options=fuse_options,
            )
            row["systems"][system]["first_call_fresh_s"] = answer.get("first_call_s")
            row["systems"][system]["first_call_fresh_error"] = answer.get("error")
            if answer.get("error"):
                progress(f"{name}: {system} fresh-process first call failed: {answer['error']}")
    fill_speedups(row, "ms")
    model = x = target = None  # freed before release_memory empties the cache
    release_memory(device)
    return row


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (nested in tuples, lists, dict values) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def bench_custom_model(
    spec: str,
    made: tuple[torch.nn.Module, tuple, dict],
    *,
    device: torch.device,
    dtype: str,
    iters: int,
    warmup: int,
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES,
    no_compile: bool,
    cache_dir: Path,
    fuse_options: Optional[dict] = None,
    keep_cache: bool = False,
) -> dict[str, Any]:
    """One row: every system on the user's model, ``made`` = (model, args, kwargs) from the
    factory ``spec`` names; moved to ``device``, eval mode, no_grad. No target: no test loss."""
    model, args, kwargs = made
    row: dict[str, Any] = {
        "model": spec,
        "title": type(model).__name__,
        "paper": None,
        "family": None,
        "layout": None,
        "config": None,
        "mesh": None,
        "batch": None,
        "params": parameter_count(model),
        "train_steps": 0,
        "train_losses": [],
        "systems": system_cells(_empty_cell, compile_modes, no_compile),
    }
    try:
        model = model.to(device).eval()
        args, kwargs = to_device(args, device), to_device(kwargs, device)
    except Exception as err:
        message = describe_error(err)
        for cell in row["systems"].values():
            cell.update(status="error", error=message, traceback=traceback.format_exc())
        return row

    def call(fn):
        def run():
            with torch.no_grad(), autocast_for(device, dtype):
                return fn(*args, **kwargs)

        return run

    forward_systems(
        spec,
        row,
        model,
        call,
        lambda cell, out: None,
        (args, kwargs),
        device=device,
        dtype=dtype,
        iters=iters,
        warmup=warmup,
        no_compile=no_compile,
        cache_dir=cache_dir,
        fuse_options=fuse_options,
        keep_cache=keep_cache,
    )
    fill_speedups(row, "ms")
    del model  # freed before release_memory empties the cache (the inputs go with the closures)
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
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES,
    no_compile: bool = False,
    train_steps: int = 0,
    batch_size: Optional[int] = None,
    cache_root: Optional[Path] = None,
    fuse_options: Optional[dict] = None,
    fresh_first_calls: bool = False,
    train: bool = False,
    custom_models: Optional[dict[str, tuple]] = None,
    keep_cache: bool = False,
) -> dict[str, Any]:
    """Benchmark ``names`` (their forward, or with ``train`` a training step); write bench.json,
    bench.md, bench.png to ``out``; return the JSON data (plus the table under ``"markdown"``).
    A name in ``custom_models`` is the user's model, ``(model, args, kwargs)``, not a zoo one.
    ``keep_cache``: each model's AutoFuser cache is used as found, not emptied first, so its
    "cold" first call or step is one on that cache (a run that filled it went before).
    On a CPU, raises ``BenchError`` where Triton's interpreter can no longer be turned on."""
    custom_models = custom_models or {}
    compile_modes = tuple(compile_modes)
    if not compile_modes or len(set(compile_modes)) != len(compile_modes):
        raise BenchError(f"compile_modes {compile_modes!r}: name one or more torch.compile modes, each once")
    systems = systems_of(compile_modes)
    out.mkdir(parents=True, exist_ok=True)
    cache_root = cache_root or out / "autofuser-cache"
    use_interpreter_on_cpu(device)
    started = time.perf_counter()
    rows = []
    if train:
        from autofuser.zoo import train_bench  # it builds on this module: imported when used
    for index, name in enumerate(names, 1):
        what = "your model" if name in custom_models else f"{config}"
        progress(f"[{index}/{len(names)}] {name} ({what}, {dtype}, {device}{', training step' if train else ''})")
        options: dict[str, Any] = dict(
            device=device,
            dtype=dtype,
            iters=iters,
            warmup=warmup,
            config=config,
            compile_modes=compile_modes,
            no_compile=no_compile,
            train_steps=train_steps,
            batch_size=batch_size,
            cache_dir=cache_root / re.sub(r"[^\w.-]+", "_", name),
            fuse_options=fuse_options,
            keep_cache=keep_cache,
        )
        if name in custom_models:
            for zoo_only in ("config", "train_steps", "batch_size"):
                del options[zoo_only]
            rows.append(bench_custom_model(name, custom_models[name], **options))
        elif train:
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
            "compile_modes": list(compile_modes),
            "no_compile": no_compile,
            "train_steps": train_steps,
            "batch_size": batch_size,
            "fresh_first_calls": fresh_first_calls,
            "keep_cache": keep_cache,
            "fuse_options": dict(fuse_options or {}),
            "factory": next(iter(custom_models), None),
            "timing": (
                f"{'CUDA events' if device.type == 'cuda' else 'time.perf_counter'} per step; "
                "median and IQR over the steps"
                if train
                else TIMING
            ),
            **({"optimizer": "torch.optim.AdamW", "lr": TRAIN_LR, "loss": "mse_loss"} if train else {}),
        },
        "systems": list(systems),
        "rows": rows,
        "geomean_speedup": {
            s: geometric_mean([r["systems"][s]["speedup"] for r in rows if r["systems"][s]["status"] == "ok"])
            for s in systems[1:]
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


def forward_columns(compile_systems: "tuple[str, ...] | list[str]" = SYSTEMS[1:-1]) -> list[str]:
    """bench.md's columns of a forward run whose torch.compile systems are ``compile_systems``
    (``compile_system`` of each mode, in order): each has the same columns as the others."""
    every = list(compile_systems)
    return [
        "model",
        "params",
        "batch",
        "eager ms",
        "eager IQR ms",
        *[f"{system} {what}" for system in every for what in ("ms", "IQR ms", "speedup")],
        "AutoFuser ms",
        "AutoFuser IQR ms",
        "AutoFuser speedup",
        *[f"{system} first call s" for system in every],
        "AutoFuser first call s (cold)",
        "AutoFuser first call s (warm)",
        *[f"{system} rel err" for system in every],
        "AutoFuser rel err",
        "test loss eager",
        *[f"test loss {system}" for system in every],
        "test loss AutoFuser",
        "fused groups",
        "skipped groups",
    ]


#: The columns of a run in the default modes.
COLUMNS = forward_columns()


def compile_systems_of(result: dict[str, Any]) -> list[str]:
    """The torch.compile systems of a run (one per mode), in table order."""
    return [system for system in result["systems"] if system not in ("eager", "autofuser")]


def format_cell(cell: dict[str, Any], key: str, fmt: str) -> str:
    """A table cell: the value ``cell[key]`` in ``fmt``, or why the system has none."""
    if cell["status"] == "skipped":
        return cell["error"] or "skipped"
    if cell["status"] == "error":
        return f"error: {cell['error'].split(':')[0]}"
    value = cell.get(key)
    return "-" if value is None else format(value, fmt)


def format_spread(cell: dict[str, Any], key: str = "iqr_ms", time_key: str = "ms") -> str:
    """A spread cell: the IQR in ms and as a share of the median, ``noisy`` where that share
    is over ``NOISY_IQR``; or why the system has none."""
    text = format_cell(cell, key, ".3f")
    if cell["status"] != "ok" or cell.get(key) is None or not cell.get(time_key):
        return text
    return f"{text} ({100 * cell[key] / cell[time_key]:.0f}%{', noisy' if cell.get('noisy') else ''})"


def format_speedup(cell: dict[str, Any], eager: dict[str, Any]) -> str:
    """A speedup cell: ``nothing fused`` for an AutoFuser that fused no group, and marked
    ``noisy`` where its time or eager's has a large spread."""
    if cell["status"] == "ok" and cell.get("nothing_fused"):
        return NOTHING_FUSED
    text = format_cell(cell, "speedup", ".2f")
    if cell["status"] == "ok" and cell.get("speedup") is not None and (cell.get("noisy") or eager.get("noisy")):
        text += " (noisy)"
    return text


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


def speedup_columns(result: dict[str, Any]) -> dict[str, str]:
    """``{system: its speedup column}`` of every system but eager."""
    return {
        **{system: f"{system} speedup" for system in compile_systems_of(result)},
        "autofuser": "AutoFuser speedup",
    }


def geomean_cells(columns: list[str], result: dict[str, Any], speedup_columns: dict[str, str]) -> list[str]:
    """The geometric-mean row: each system's mean speedup in its column ``speedup_columns[system]``."""
    geomean, cells = result["geomean_speedup"], [""] * len(columns)
    cells[0] = "geometric mean"
    for system, column in speedup_columns.items():
        if geomean.get(system):
            text = f"{geomean[system]:.2f}"
        else:
            text = NO_COMPILE if result["settings"]["no_compile"] and system != "autofuser" else "-"
        cells[columns.index(column)] = text
    return cells


def row_errors(row: dict[str, Any]) -> list[str]:
    """One line per failed system of ``row``, and one for a failed pre-training."""
    errors = [
        f"- {row['model']} / {system}: {cell['error']}"
        for system, cell in row["systems"].items()
        if cell["status"] == "error"
    ]
    if row.get("train_error"):
        errors.append(f"- {row['model']} / training (measured untrained): {row['train_error']}")
    return errors


def footer_lines(result: dict[str, Any], errors: list[str]) -> list[str]:
    """What a noisy time and an unfused run mean (where there are any), the errors (where
    there are any) and what bench.png is."""
    cells = [(row, cell) for row in result["rows"] for cell in row["systems"].values()]
    lines = []
    notes = {
        (system, cell["note"])
        for row in result["rows"]
        for system, cell in row["systems"].items()
        if cell.get("note") and cell["status"] == "ok"
    }
    if notes:
        lines += ["", *[f"{system}: {note}." for system, note in sorted(notes)]]
    if any(cell.get("noisy") for _, cell in cells):
        lines += [
            "",
            f"noisy: the spread of the times (IQR) is over {NOISY_IQR:.0%} of their median, so a speedup "
            "built on them is not reliable; run again with more --iters, on an otherwise idle machine.",
        ]
    unfused = [row["model"] for row, cell in cells if cell.get("nothing_fused") and cell["status"] == "ok"]
    if unfused:
        lines += [
            "",
            f"{NOTHING_FUSED}: AutoFuser kept every group of {', '.join(unfused)} eager, so it has no speedup "
            "to show; the reasons are in bench.json (each row's autofuser report).",
        ]
        notes = {note for row, cell in cells if cell.get("nothing_fused") for note in cell["report"]["notes"]}
        lines += [f"- {note}" for note in sorted(notes)]
    lines += float64_lines(result)
    if result["settings"].get("keep_cache"):
        lines += [
            "",
            "--keep-cache: AutoFuser's first calls or steps marked cold ran on the caches an earlier run "
            "left, not on empty ones (under benchmarks/zoo_run.sh's ZOO_KEEP_CACHES, torch.compile's too).",
        ]
    if errors:
        lines += ["", "Errors (type: message; tracebacks in bench.json):", *errors]
    return lines + [
        "",
        "bench.png: speedups over eager." if result["plot"] == "bench.png" else f"bench.png: {result['plot']}",
    ]


def float64_lines(result: dict[str, Any]) -> list[str]:
    """Each system's errors against the float64 reference, for the rows where it ran (or why
    it failed): what ``wrong_results`` judged by."""
    dtype = result["settings"]["dtype"]
    train = result.get("mode") == "train"
    judged = [row for row in result["rows"] if row.get("float64_reference", "not needed") != "not needed"]
    if not judged:
        return []
    lines = [
        "",
        f"Float64 reference, run where a result missed eager's by more than {MAX_REL_ERROR[dtype]:g}: "
        f"||x - float64|| / ||float64|| of each system's {'output / gradients' if train else 'output'}. "
        f"AutoFuser's result is wrong only past {FLOAT64_FACTOR:g} x eager's error + {MAX_REL_ERROR[dtype]:g}.",
    ]
    keys = [exact_key for exact_key, _ in FLOAT64_KEYS.values()][: 2 if train else 1]
    for row in judged:
        if row["float64_reference"] != "ran" and not row["float64_reference"].startswith("strict fp32"):
            lines.append(f"- {row['model']}: {row['float64_reference']}")
            continue
        systems = [
            f"{'AutoFuser' if system == 'autofuser' else system} "
            + " / ".join("-" if cell.get(key) is None else f"{cell[key]:.1e}" for key in keys)
            for system, cell in row["systems"].items()
            if any(cell.get(key) is not None for key in keys)
        ]
        against = "" if row["float64_reference"] == "ran" else f" (against {row['float64_reference']})"
        lines.append(f"- {row['model']}{against}: {', '.join(systems)}")
    return lines


def compile_modes_text(result: dict[str, Any]) -> str:
    """What the header says of torch.compile's modes."""
    settings = result["settings"]
    if settings["no_compile"]:
        return "no torch.compile (--no-compile)"
    modes = settings["compile_modes"]
    return f"torch.compile mode{'s' if len(modes) > 1 else ''} {', '.join(modes)} (each its own columns)"


#: A note longer than this is cut where ``what_ran`` quotes it.
NOTE_CHARS = 240


def what_ran(notes: Optional[list[str]], what: str = "step", runs_original: Optional[bool] = None) -> Optional[str]:
    """In a few words, what a fused model's training step (``what`` "step") or forward
    ("forward") ran: the original (with the note that decided it), or the fused one
    replayed as CUDA graphs, or launched (with why no graph); ``None`` without notes.
    ``runs_original``: its report's own word on whether the original runs, where the
    caller has it; else read from the notes in their order (a later verdict, the check in
    use's, overrules an earlier one)."""
    if not notes:
        return None

    def quoted(note: str) -> str:
        return note if len(note) <= NOTE_CHARS else note[: NOTE_CHARS - 3] + "..."

    original, no_graph, graphs = None, None, False
    for note in notes:
        if "the original runs" in note or "the original model runs" in note:
            original = note
        elif "the fused model runs" in note or "the fused step stands" in note:
            original = None if "in use" in note else original
        if "replayed as two CUDA graphs" in note or "replays as one CUDA graph" in note:
            graphs = True
        if note.startswith("no CUDA graph"):
            no_graph = note
    if runs_original is not None:
        original = (original or notes[-1]) if runs_original else None
    if original is not None:
        return f"the original: {quoted(original)}"
    if graphs:
        return f"the fused {what}, replayed as {'two CUDA graphs' if what == 'step' else 'one CUDA graph'}"
    return f"the fused {what}, launched" + (f": {quoted(no_graph)}" if no_graph else "")


def what_ran_lines(result: dict[str, Any], what: str) -> list[str]:
    """bench.md's list under the table: ``what_ran`` of each row's AutoFuser cell."""
    cells = [(row["model"], row["systems"]["autofuser"]) for row in result["rows"]]
    ran = [(model, what_ran(cell.get("warm_notes"), what, cell.get("warm_runs_original"))) for model, cell in cells]
    if not any(text for _, text in ran):
        return []
    settled = "its first steps" if what == "step" else "its first calls"
    lines = ["", f"What AutoFuser ran once {settled} settled (its report's notes):"]
    return lines + [f"- {model}: {text}" for model, text in ran if text]


def render_markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    where = where_run(result)
    what = settings.get("factory") or f"{settings['config']} config"
    lines = [
        f"# autofuser bench - {what}, {settings['dtype']}, {where}",
        "",
        f"{result['date']}; torch {result['torch']}, Triton {result['triton']}, AutoFuser {result['autofuser']}; "
        f"median of {settings['iters']} calls after {settings['warmup']} warm-up calls ({settings['timing']}), "
        f"eval mode, no_grad{', bf16 autocast' if settings['dtype'] == 'bf16' else ''}; {compile_modes_text(result)}; "
        f"{settings['train_steps']} training steps. Speedup = eager ms / system ms; "
        "IQR = the interquartile range of the time per call over the timed blocks (share of the median); "
        "rel err = ||out - eager|| / ||eager||, for AutoFuser and torch.compile the larger of the first "
        "call's and a call's after timing; test loss = relative L2 vs the airfoil target (zoo models only).",
        "",
    ]
    errors, table = [], []
    compile_systems = compile_systems_of(result)
    columns = forward_columns(compile_systems)
    for row in result["rows"]:
        eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
        compiled = [row["systems"][system] for system in compile_systems]
        cells = [
            row["model"],
            format_params(row["params"]),
            "-" if row["batch"] is None else str(row["batch"]),
            format_cell(eager, "ms", ".3f"),
            format_spread(eager),
            *[
                text
                for cell in compiled
                for text in (format_cell(cell, "ms", ".3f"), format_spread(cell), format_speedup(cell, eager))
            ],
            format_cell(fused, "ms", ".3f"),
            format_spread(fused),
            format_speedup(fused, eager),
            *[format_cell(cell, "first_call_s", ".2f") for cell in compiled],
            format_cell(fused, "first_call_cold_s", ".2f"),
            format_cell(fused, "first_call_warm_s", ".2f"),
            *[format_cell(cell, "rel_err_vs_eager", ".1e") for cell in compiled],
            format_cell(fused, "rel_err_vs_eager", ".1e"),
            format_cell(eager, "test_loss", ".4f"),
            *[format_cell(cell, "test_loss", ".4f") for cell in compiled],
            format_cell(fused, "test_loss", ".4f"),
            "-" if fused["fused_groups"] is None else str(fused["fused_groups"]),
            "-" if fused["skipped_groups"] is None else str(fused["skipped_groups"]),
        ]
        table.append(cells)
        errors += row_errors(row)
    lines += table_lines(columns, table + [geomean_cells(columns, result, speedup_columns(result))])
    lines += what_ran_lines(result, "forward")
    if settings.get("fresh_first_calls"):
        lines += [
            "",
            "First calls in fresh processes, each with empty AutoFuser, Triton and Inductor caches "
            "(--fresh-first-calls), seconds:",
            "",
            "| model | "
            + " | ".join(f"{system} first call" for system in compile_systems)
            + " | AutoFuser first call (cold) |",
            "|---|" + "---|" * (len(compile_systems) + 1),
        ]
        for row in result["rows"]:
            fresh = []
            for system in (*compile_systems, "autofuser"):
                cell = row["systems"][system]
                if cell.get("first_call_fresh_s") is not None:
                    fresh.append(f"{cell['first_call_fresh_s']:.2f}")
                elif cell.get("first_call_fresh_error"):
                    fresh.append(f"error: {cell['first_call_fresh_error'].split(':')[0]}")
                    errors.append(f"- {row['model']} / {system} (fresh process): {cell['first_call_fresh_error']}")
                else:
                    fresh.append(cell["error"] if cell["status"] == "skipped" and cell["error"] else "-")
            lines.append(f"| {row['model']} | " + " | ".join(fresh) + " |")
    if settings.get("factory"):
        for row in result["rows"]:
            text = row["systems"]["autofuser"].get("report_text")
            if text:
                lines += ["", f"AutoFuser's fusion report of {row['model']} (cold compile):", "", "```", text, "```"]
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
    systems = [*compile_systems_of(result), "autofuser"]
    fig, ax = plt.subplots(figsize=(max(6.0, (0.4 + 0.35 * len(systems)) * len(names) + 2), 4))
    width = 0.8 / len(systems)
    # A log axis, bars drawn from eager's 1x: 0.5x and 2x are equally far from it, and a
    # 0.001x bar is as visible as a 1000x one.
    ax.set_yscale("log")
    for k, system in enumerate(systems):
        label = "AutoFuser" if system == "autofuser" else system
        values = [r["systems"][system]["speedup"] or 1.0 for r in rows]
        positions = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(rows))]
        bars = ax.bar(positions, [v - 1.0 for v in values], width, bottom=1.0, label=label)
        for bar, row in zip(bars, rows):
            cell = row["systems"][system]
            if cell["status"] != "ok" or cell.get("nothing_fused"):
                reason = NOTHING_FUSED if cell["status"] == "ok" else cell["status"]
                ax.annotate(reason, (bar.get_x() + width / 2, 1.0), ha="center", va="bottom", rotation=90, fontsize=7)
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
