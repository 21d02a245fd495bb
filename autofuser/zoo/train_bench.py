"""``autofuser bench --train``: a training step of each zoo model under eager PyTorch,
torch.compile and AutoFuser.

One training step of a system is

    optimiser.zero_grad(set_to_none=True)
    loss = mse_loss(as_grid(system(x)), target)   # train mode; with --dtype bf16 under autocast
    loss.backward()
    optimiser.step()                              # torch.optim.AdamW(params, lr=TRAIN_LR)

on one fixed batch (the airfoil test set's first ``batch`` samples, as the forward
bench feeds). For each chosen model:

1. build it once (seed 0) and, with ``--train-steps N``, pre-train it as the
   forward bench does (``harness.prepare_model``);
2. every system gets its own ``copy.deepcopy`` of that model, in train mode,
   and its own AdamW, so all of them start from the same weights;
3. eager: its first step is the reference - the output, the loss, and every
   parameter's gradient after the backward (before the optimiser step) as one
   vector;
4. AutoFuser: ``autofuser.fuse(copy, cache_dir=D)`` with ``D`` a fresh empty
   folder - its first step (which compiles) is ``first_step_s``, cold cache;
   then ``fuse`` of a second copy on the same folder - its first step is
   ``first_step_warm_s``, and it is the one checked and timed, after the untimed
   steps (``settle_steps``) in which its check in use decides whether the fused
   step or the original runs;
5. torch.compile, once per mode of ``--compile-modes`` (each its own system,
   as in the forward bench): after ``torch._dynamo.reset()``,
   ``torch.compile(copy, mode=mode)``; its first step (skipped with
   ``--no-compile``); in a CUDA-graph mode every step begins with
   ``torch.compiler.cudagraph_mark_step_begin()``, as its documentation asks
   of a training loop;
6. the step time of each: ``--warmup`` steps of every system, then ``--iters``
   steps of each in turns of ``ROUND_STEPS``, the order rotating every round
   (``interleaved_steps``); a system's median step.

Each system's first-step output and gradients are compared with eager's
(``||x - eager|| / ||eager||``), and for AutoFuser and torch.compile so is the same
step run again from the same weights by what their timed steps run
(``TrainingStep.rerun_from``); where one is past ``harness.MAX_REL_ERROR``
with the first step in float64 (``float64_first_step``); on CUDA the peak memory
the timed steps add is recorded. A system that fails becomes that cell's error, never a crash,
and every column is always produced; the cells, the table and the
geometric-mean row go through the same code as the forward bench's.
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

import autofuser
from autofuser.zoo.harness import (
    CUDA_GRAPH_MODES,
    DEFAULT_COMPILE_MODES,
    NO_CUDA_GRAPHS_ON_CPU,
    SYSTEMS,
    TRAIN_LR,
    autocast_for,
    compile_modes_of,
    compile_modes_text,
    compile_systems_of,
    describe_error,
    fill_speedups,
    first_call_s,
    footer_lines,
    format_cell,
    format_params,
    format_speedup,
    format_spread,
    fresh_cache,
    geomean_cells,
    judge_by_float64,
    no_autocast,
    prepare_model,
    progress,
    relative_error,
    release_memory,
    report_fields,
    row_errors,
    run_systems,
    settle,
    speedup_columns,
    spread,
    start_autofuser_cell,
    start_row,
    strict_fp32,
    synchronize,
    table_lines,
    what_ran_lines,
    where_run,
    widened,
    worst,
)
from autofuser.zoo.models import MESHES, MODELS, ModelEntry


def training_columns(compile_systems: "tuple[str, ...] | list[str]" = SYSTEMS[1:-1]) -> list[str]:
    """bench.md's columns of a ``--train`` run whose torch.compile systems (one per mode) are
    ``compile_systems``: each has the same columns as the others."""
    every = list(compile_systems)
    return [
        "model",
        "params",
        "batch",
        "eager step ms",
        "eager IQR ms",
        *[f"{system} {what}" for system in every for what in ("step ms", "IQR ms", "speedup")],
        "AutoFuser step ms",
        "AutoFuser IQR ms",
        "AutoFuser speedup",
        "eager first step s",
        *[f"{system} first step s" for system in every],
        "AutoFuser first step s (cold)",
        "AutoFuser first step s (warm)",
        "eager peak MB",
        *[f"{system} peak MB" for system in every],
        "AutoFuser peak MB",
        "eager held MB",
        *[f"{system} held MB" for system in every],
        "AutoFuser held MB",
        *[f"{system} {what}" for system in every for what in ("out rel err", "grad rel err")],
        "AutoFuser out rel err",
        "AutoFuser grad rel err",
        "fused groups",
        "skipped groups",
    ]


#: The columns of a run in the default modes.
TRAIN_COLUMNS = training_columns()


def _empty_training_cell(status: str = "not run", error: Optional[str] = None) -> dict[str, Any]:
    return {
        "status": status,
        "error": error,
        "step_ms": None,
        "iqr_ms": None,
        "noisy": None,
        "speedup": None,
        "first_step_s": None,
        "peak_mem_mb": None,
        "held_mb": None,
        "loss": None,
        "rel_err_vs_eager": None,
        "grad_rel_err_vs_eager": None,
        "step_times_ms": None,
    }


# ---------------------------------------------------------------------------
# One system's training step
# ---------------------------------------------------------------------------


def flat_gradients(parameters: list[torch.nn.Parameter], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every parameter's ``.grad`` as one vector of ``dtype``, in parameter order: a complex
    gradient as its real and imaginary parts, a parameter the loss did not reach
    (``.grad`` None) as zeros, so that vectors of two copies line up."""
    pieces = []
    for parameter in parameters:
        grad = parameter.grad
        if grad is None:
            numbers = parameter.numel() * (2 if parameter.is_complex() else 1)
            pieces.append(torch.zeros(numbers, device=parameter.device, dtype=dtype))
        else:
            pieces.append((torch.view_as_real(grad) if grad.is_complex() else grad).detach().to(dtype).flatten())
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)


#: Steps torch.compile's CUDA-graph modes take before they replay a graph (a warm-up, then a
#: recording): the bench checks a step after them as well as the first.
GRAPH_MODE_WARMUP_STEPS = 2


class FirstStep(NamedTuple):
    output: torch.Tensor  # the forward's output, detached and copied (a CUDA-graph replay overwrites it)
    loss: float
    gradients: torch.Tensor  # flat_gradients after the backward, before the optimiser step
    seconds: float  # the whole step, without taking the gradients


class TrainingStep:
    """``step()`` trains ``module`` (a system wrapping ``model``) one AdamW step on ``(x, target)``.

    The optimiser holds ``model``'s parameters: a ``FusedModule`` and torch.compile's
    wrapper share them with the model they wrap."""

    def __init__(
        self,
        module: Callable[[torch.Tensor], Any],
        model: torch.nn.Module,
        entry: ModelEntry,
        x: torch.Tensor,
        target: torch.Tensor,
        *,
        mesh: tuple[int, int],
        device: torch.device,
        dtype: str,
        mark_steps: bool = False,
    ):
        self.module, self.entry, self.x, self.target = module, entry, x, target
        self.mesh, self.device, self.dtype = mesh, device, dtype
        # torch.compile's CUDA graphs: tell it each step is a new iteration, so a replay may
        # overwrite the previous step's outputs.
        self.mark_steps = mark_steps
        self.parameters = list(model.parameters())
        self.optimiser = torch.optim.AdamW(self.parameters, lr=TRAIN_LR)

    def forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """zero_grad, forward and loss (under autocast for bf16; in the target's dtype), backward:
        (output, loss)."""
        if self.mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        self.optimiser.zero_grad(set_to_none=True)
        with autocast_for(self.device, self.dtype):
            output = self.module(self.x)
            loss = F.mse_loss(self.entry.as_grid(output, self.mesh).to(self.target.dtype), self.target)
        loss.backward()
        return output, loss

    def step(self) -> None:
        self.forward_backward()
        self.optimiser.step()

    def rerun_from(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> FirstStep:
        """The first step's forward and backward again, once ``model``'s parameters and
        buffers are ``state`` again (copied in place: a CUDA graph keeps reading them), without
        the optimiser's step: what a system runs once it settled, against eager's first step."""
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(state[name])
        output, loss = self.forward_backward()
        return FirstStep(output.detach().clone(), loss.detach().item(), flat_gradients(self.parameters), 0.0)

    def first(self) -> FirstStep:
        """The first step, timed (synchronised on both sides), keeping what the checks compare."""
        (output, loss), forward_backward_s = first_call_s(self.forward_backward, self.device)
        gradients = flat_gradients(self.parameters)
        _, optimiser_s = first_call_s(self.optimiser.step, self.device)
        return FirstStep(output.detach().clone(), loss.detach().item(), gradients, forward_backward_s + optimiser_s)


def float64_first_step(
    base: torch.nn.Module,
    entry: ModelEntry,
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    mesh: tuple[int, int],
    device: torch.device,
    wide: bool = True,
) -> dict[str, torch.Tensor]:
    """The float64 reference of every system's first step: ``base``'s weights (``widened``,
    train mode), input and target in float64, autocast off, the same loss; its output and
    all parameters' gradients after the backward (``flat_gradients`` in float64), under
    the keys the cells' errors against it take (``harness.judge_by_float64``). With
    ``wide=False``, its stand-in for a model that can't run in float64: the same step in
    fp32 with every product and convolution in full fp32 (``harness.strict_fp32``)."""
    if wide:
        model, x, target = widened(base).train(), x.double(), target.double()
    else:
        model = copy.deepcopy(base).train()
    step = TrainingStep(model, model, entry, x, target, mesh=mesh, device=device, dtype="fp32")
    with no_autocast(), strict_fp32() if not wide else contextlib.nullcontext():
        output, _ = step.forward_backward()
    return {
        "rel_err_vs_float64": output.detach(),
        "grad_rel_err_vs_float64": flat_gradients(step.parameters, torch.float64),
    }


def allocated_mb(device: torch.device) -> Optional[float]:
    """The CUDA memory allocated on ``device`` now, in MB, after its queued work is done;
    None on a CPU."""
    if device.type != "cuda":
        return None
    synchronize(device)
    return torch.cuda.memory_allocated(device) / 2**20


ROUND_STEPS = 5  # one system's timed steps in a row before the next system's


class RunnerState(NamedTuple):
    """What a fused module runs, as far as a benchmark can see from outside."""

    signatures: int  # compiled signatures
    checking: bool  # a check in use under way
    runs_original: bool  # the last call's signature runs the original model
    notes: int  # notes in that signature's report

    @classmethod
    def of(cls, fused: Any) -> "RunnerState":
        report = fused.report()
        return cls(len(fused.reports()), fused.checking_in_use, report.runs_original, len(report.notes))

    def changes(self, fused: Any) -> Optional[str]:
        """What ``fused`` does differently now than when this state was taken (a sentence,
        with the report's new notes), or ``None``."""
        now = RunnerState.of(fused)
        if now == self:
            return None
        said = []
        if now.signatures != self.signatures:
            said.append(f"{now.signatures - self.signatures} more signature(s) compiled")
        if now.checking:
            said.append("a check in use was under way")
        if now.runs_original != self.runs_original:
            said.append("it now runs the " + ("original model" if now.runs_original else "fused model"))
        notes = fused.report().notes[self.notes :] if now.signatures == self.signatures else fused.report().notes
        return "; ".join(said + list(notes)) or "its report changed"


def _timed_block(step: TrainingStep, steps: int, device: torch.device) -> tuple[list[float], Optional[float]]:
    """(ms of each of ``steps`` steps, MB of CUDA memory they add at their peak over what was
    allocated before them; None on a CPU)."""
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            step.step()
            times.append((time.perf_counter() - begin) * 1e3)
        return times, None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.cuda.device(device):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            step.step()
            end.record()
        torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return times, (torch.cuda.max_memory_allocated(device) - before) / 2**20


def interleaved_steps(
    steps: dict[str, TrainingStep], iters: int, warmup: int, device: torch.device
) -> dict[str, "tuple[dict[str, Any], Optional[float]] | BaseException"]:
    """Each system's (its step times' ``harness.spread`` - median ms, IQR, noisy - over ``iters``
    steps after ``warmup``, with ``step_times_ms``, each timed step's ms in the order run; peak
    MB its steps add), or the error its steps raised.

    The systems take turns, ``ROUND_STEPS`` steps each, the order rotating every round, so
    a drift of the GPU's clocks or of other load over the run reaches all of them alike
    instead of whichever was timed first."""
    results: dict[str, "tuple[dict[str, Any], Optional[float]] | BaseException"] = {}
    times: dict[str, list[float]] = {system: [] for system in steps}
    peaks: dict[str, Optional[float]] = {system: None for system in steps}
    order = list(steps)
    for system in order:
        try:
            for _ in range(warmup):
                steps[system].step()
        except Exception as err:  # noqa: BLE001 - becomes the cell's error
            results[system] = err
    done = 0
    while done < iters:
        block = min(ROUND_STEPS, iters - done)
        for system in order:
            if system in results:
                continue
            try:
                block_times, peak = _timed_block(steps[system], block, device)
            except Exception as err:  # noqa: BLE001 - becomes the cell's error
                results[system] = err
                continue
            times[system] += block_times
            if peak is not None:
                peaks[system] = max(peak, peaks[system] or 0.0)
        order = order[1:] + order[:1]
        done += block
    for system in steps:
        if system not in results:
            step_times_ms = [round(t, 3) for t in times[system]]
            results[system] = ({**spread(times[system]), "step_times_ms": step_times_ms}, peaks[system])
    return results


# ---------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------


def bench_training_model(
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
) -> dict[str, Any]:
    """One row: a training step of every system on model ``name``; errors are recorded, not raised."""
    entry = MODELS[name]
    mesh = MESHES[config]
    batch = batch_size or entry.batch(config, train=True)
    row = start_row(
        name,
        config=config,
        batch=batch,
        train_steps=train_steps,
        empty_cell=_empty_training_cell,
        compile_modes=compile_modes,
        no_compile=no_compile,
    )
    autofuser_cell = start_autofuser_cell(
        row,
        first_step_warm_s=None,
        settle_steps=None,
        warm_notes=None,
        warm_runs_original=None,
        changed_while_timed=None,
    )
    prepared = prepare_model(row, dtype=dtype, device=device)
    if prepared is None:
        return row
    base, x, target = prepared

    def fresh_copy() -> torch.nn.Module:
        return copy.deepcopy(base).train()

    def training_step(
        module: Callable[[torch.Tensor], Any], model: torch.nn.Module, mark_steps: bool = False
    ) -> TrainingStep:
        """``module`` (``model``, or a system wrapping it) trained with an optimiser of its own."""
        return TrainingStep(
            module, model, entry, x, target, mesh=mesh, device=device, dtype=dtype, mark_steps=mark_steps
        )

    reference: Optional[FirstStep] = None
    # AutoFuser's timed module and what it ran once settled, to see whether that held.
    settled: Optional[tuple[Any, RunnerState]] = None

    steps: dict[str, TrainingStep] = {}  # each system whose first step ran, timed together at the end
    # Each system's first step, and the same step run again by what its timed steps run, for
    # the float64 reference (outputs and gradient vectors: small beside the model).
    firsts: dict[str, list[FirstStep]] = {}
    # CUDA memory allocated as each system's copy of the model was made (None on a CPU).
    started: dict[str, Optional[float]] = {}

    def check(system: str, step: TrainingStep, first: FirstStep, again: Optional[FirstStep] = None) -> None:
        """``first``'s errors against eager's first step; with ``again`` (the same step run by
        what the timed steps run), the worse of the two (NaN if either is), and the float64
        reference judges both."""
        cell = row["systems"][system]
        cell["loss"] = first.loss
        now, then = allocated_mb(device), started.get(system)
        if now is not None and then is not None:
            # What the system keeps between steps, less the copies kept here for the checks.
            copies = [t for found in (first, again) if found is not None for t in (found.output, found.gradients)]
            kept = sum(t.numel() * t.element_size() for t in copies) / 2**20
            cell["held_mb"] = now - then - kept
        found = [first] if again is None else [first, again]
        if reference is not None:
            cell["rel_err_vs_eager"] = worst([relative_error(f.output, reference.output) for f in found])
            cell["grad_rel_err_vs_eager"] = worst([relative_error(f.gradients, reference.gradients) for f in found])
        steps[system] = step
        firsts[system] = found

    def run_eager() -> None:
        nonlocal reference
        progress(f"{name}: eager training step")
        started["eager"] = allocated_mb(device)
        model = fresh_copy()
        step = training_step(model, model)
        reference = step.first()
        row["systems"]["eager"].update(first_step_s=reference.seconds, rel_err_vs_eager=0.0, grad_rel_err_vs_eager=0.0)
        check("eager", step, reference)

    def run_autofuser() -> None:
        nonlocal settled
        progress(f"{name}: AutoFuser training step, {fresh_cache(cache_dir, keep_cache)} {cache_dir}")
        model = fresh_copy()
        cold = autofuser.fuse(model, cache_dir=str(cache_dir), **(fuse_options or {}))
        autofuser_cell["first_step_s"] = training_step(cold, model).first().seconds
        autofuser_cell.update(report_fields(cold.report()))
        del cold, model
        release_memory(device)  # the cold copy, its optimiser state and compiled buffers
        progress(f"{name}: AutoFuser training step, warm cache")
        started["autofuser"] = allocated_mb(device)
        model = fresh_copy()
        warm = autofuser.fuse(model, cache_dir=str(cache_dir), **(fuse_options or {}))
        step = training_step(warm, model)
        first = step.first()
        autofuser_cell["first_step_warm_s"] = first.seconds
        # Its first steps settle whether the fused step or the original runs: they are not timed.
        autofuser_cell["settle_steps"] = settle(warm, step.step)
        autofuser_cell["warm_cache_hits"] = sum(g.cache_hit for g in warm.report().fused)
        # Whether the checked and timed module runs its kernels or, not being faster, the original.
        autofuser_cell["warm_notes"] = list(warm.report().notes)
        autofuser_cell["warm_runs_original"] = warm.report().runs_original
        settled = warm, RunnerState.of(warm)
        # The first step may have run the original while the check in use was under way: the
        # settled runner, which the timed steps run, is checked on the first step's weights too.
        again = step.rerun_from(model, base.state_dict())
        check("autofuser", step, first, again)

    def compile_run(system: str, mode: str) -> Callable[[], None]:
        def run_compile() -> None:
            progress(f"{name}: torch.compile training step (mode {mode})")
            # Each mode's compiled copy is called again when the steps are timed: its caches stay.
            graphs = mode in CUDA_GRAPH_MODES
            if graphs and device.type != "cuda":
                row["systems"][system]["note"] = NO_CUDA_GRAPHS_ON_CPU
            started[system] = allocated_mb(device)
            model = fresh_copy()
            step = training_step(torch.compile(model, mode=mode), model, mark_steps=graphs)
            first = step.first()
            row["systems"][system]["first_step_s"] = first.seconds
            # A CUDA-graph mode's first steps warm up and record; the graphs replay from the third:
            # what the timed steps run is checked too, on the first step's weights.
            for _ in range(GRAPH_MODE_WARMUP_STEPS if graphs else 0):
                step.step()
            check(system, step, first, step.rerun_from(model, base.state_dict()))

        return run_compile

    runs = [("eager", run_eager), ("autofuser", run_autofuser)]
    if not no_compile:
        torch._dynamo.reset()
        runs += [(system, compile_run(system, mode)) for system, mode in compile_modes_of(row).items()]
    # torch.compile's caches stay until its steps are timed, with the others'.
    run_systems(name, row, runs, device, reset_compile=False)
    progress(f"{name}: timing {', '.join(steps)} in turns of {ROUND_STEPS} steps")
    for system, timed in interleaved_steps(steps, iters, warmup, device).items():
        cell = row["systems"][system]
        if isinstance(timed, BaseException):
            trace = "".join(traceback.format_exception(timed))
            cell.update(status="error", error=describe_error(timed), traceback=trace)
            progress(f"{name}: {system} failed: {cell['error']}")
        else:
            measured, cell["peak_mem_mb"] = timed
            cell.update(
                step_ms=measured["ms"],
                iqr_ms=measured["iqr_ms"],
                noisy=measured["noisy"],
                step_times_ms=measured["step_times_ms"],
            )
    if settled is not None:
        # The other systems' steps run between AutoFuser's timed ones: a recompile or a check
        # started again after it settled would make its timed steps a mix of runners.
        changed = settled[1].changes(settled[0])
        if changed is not None:
            autofuser_cell["changed_while_timed"] = changed
            progress(f"{name}: AutoFuser changed while its steps were timed: {changed}")
    fill_speedups(row, "step_ms")
    steps.clear()
    torch._dynamo.reset()
    release_memory(device)  # the systems' copies and optimisers, before the float64 copy is made
    kept = {
        system: {
            "rel_err_vs_float64": [f.output for f in found],
            "grad_rel_err_vs_float64": [f.gradients for f in found],
        }
        for system, found in firsts.items()
    }
    firsts.clear()

    def float64_step(wide: bool = True) -> dict[str, torch.Tensor]:
        return float64_first_step(base, entry, x, target, mesh=mesh, device=device, wide=wide)

    judge_by_float64(name, row, dtype, kept, float64_step, device, fallback=lambda: float64_step(wide=False))
    kept.clear()
    base = x = target = reference = None  # the closures hold them: freed before release_memory empties the cache
    release_memory(device)
    return row


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def render_training_markdown(result: dict[str, Any]) -> str:
    """bench.md of a ``--train`` run: one row per model, the geometric-mean row, the errors."""
    settings = result["settings"]
    bf16 = settings["dtype"] == "bf16"
    lines = [
        f"# autofuser bench --train - {settings['config']} config, {settings['dtype']}, {where_run(result)}",
        "",
        f"{result['date']}; torch {result['torch']}, Triton {result['triton']}, AutoFuser {result['autofuser']}. "
        "One training step = zero_grad(set_to_none=True), forward in train mode and MSE loss against the "
        f"airfoil target{' under bf16 autocast (fp32 parameters)' if bf16 else ''}, backward, "
        f"AdamW(lr={settings['lr']:g}) step, on one fixed batch; every system starts from the same weights "
        f"({settings['train_steps']} pre-training steps). Step ms = median of {settings['iters']} steps after "
        f"{settings['warmup']} warm-up steps, the systems taking turns of {ROUND_STEPS} steps "
        f"({settings['timing']}); speedup = eager step ms / system step ms; IQR = the interquartile range of "
        "the step times (share of the median); "
        "first step s includes compiling (AutoFuser: cold cache, then a fresh fuse on the warm cache); "
        "peak MB = the peak memory the timed steps add (CUDA only); held MB = what a system keeps "
        "between steps once its first step ran (its copy of the weights, gradients, optimiser state, "
        "compiled buffers, CUDA graph pools; CUDA only): a graph's pool is allocated when it is captured, "
        f"so it shows here, not in peak MB; {compile_modes_text(result)}; "
        "out / grad rel err = ||x - eager|| / ||eager|| of the first step's output and of all parameters' "
        "gradients after its backward; for AutoFuser and torch.compile the larger of that and the same for "
        "the first step run again, from the same weights, by what the timed steps run (AutoFuser's runner "
        "once its check in use settled; a CUDA-graph mode's replays).",
        "",
    ]
    errors, table = [], []
    compile_systems = compile_systems_of(result)
    columns = training_columns(compile_systems)
    for row in result["rows"]:
        eager, fused = row["systems"]["eager"], row["systems"]["autofuser"]
        compiled = [row["systems"][system] for system in compile_systems]
        table.append(
            [
                row["model"],
                format_params(row["params"]),
                str(row["batch"]),
                format_cell(eager, "step_ms", ".3f"),
                format_spread(eager, time_key="step_ms"),
                *[
                    text
                    for cell in compiled
                    for text in (
                        format_cell(cell, "step_ms", ".3f"),
                        format_spread(cell, time_key="step_ms"),
                        format_speedup(cell, eager),
                    )
                ],
                format_cell(fused, "step_ms", ".3f"),
                format_spread(fused, time_key="step_ms"),
                format_speedup(fused, eager),
                format_cell(eager, "first_step_s", ".2f"),
                *[format_cell(cell, "first_step_s", ".2f") for cell in compiled],
                format_cell(fused, "first_step_s", ".2f"),
                format_cell(fused, "first_step_warm_s", ".2f"),
                format_cell(eager, "peak_mem_mb", ".1f"),
                *[format_cell(cell, "peak_mem_mb", ".1f") for cell in compiled],
                format_cell(fused, "peak_mem_mb", ".1f"),
                format_cell(eager, "held_mb", ".1f"),
                *[format_cell(cell, "held_mb", ".1f") for cell in compiled],
                format_cell(fused, "held_mb", ".1f"),
                *[
                    format_cell(cell, key, ".1e")
                    for cell in compiled
                    for key in ("rel_err_vs_eager", "grad_rel_err_vs_eager")
                ],
                format_cell(fused, "rel_err_vs_eager", ".1e"),
                format_cell(fused, "grad_rel_err_vs_eager", ".1e"),
                "-" if fused.get("fused_groups") is None else str(fused["fused_groups"]),
                "-" if fused.get("skipped_groups") is None else str(fused["skipped_groups"]),
            ]
        )
        errors += row_errors(row)
    lines += table_lines(columns, table + [geomean_cells(columns, result, speedup_columns(result))])
    lines += what_ran_lines(result, "step")
    changed = [(row["model"], row["systems"]["autofuser"].get("changed_while_timed")) for row in result["rows"]]
    if any(text for _, text in changed):
        lines += ["", "AutoFuser changed after its first steps settled, before or while its steps were timed:"]
        lines += [f"- {model}: {text}" for model, text in changed if text]
    return "\n".join(lines + footer_lines(result, errors))
