"""Data-parallel training of zoo models: ``DistributedDataParallel`` over AutoFuser, eager
PyTorch and ``torch.compile``, each against the same training in one process.

    # the one-process baseline: one process stands in for 2 ranks (--accumulate 2)
    torchrun --standalone --nproc-per-node 1 benchmarks/ddp_train.py --models galerkin,fno \\
        --dtype bf16 --accumulate 2 --out bench-results/ddp-1
    # 2 ranks, compared with it; rank 1 starts its first forward 5 s late
    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_train.py --models galerkin,fno \\
        --dtype bf16 --baseline bench-results/ddp-1 --delay-rank1-s 5 --out bench-results/ddp-2

(``bash benchmarks/gpu_run.sh ddp:DTYPE:MODEL,MODEL`` runs both.) Without torchrun the
script runs as one process, as under ``--nproc-per-node 1``.

For each model (its ``--config``, built with seed 0) and each system of ``--systems``:

- eager: ``DistributedDataParallel(model)``;
- autofuser: ``DistributedDataParallel(autofuser.fuse(model, cache_dir=C))``, ``C`` one
  folder the ranks share, emptied first (``--cache-dir``/MODEL-DTYPE);
- compile: ``DistributedDataParallel(torch.compile(model))``.

Every system trains its own copy of the same initial model with AdamW(lr=``--lr``). One
step is zero_grad, then for each of ``--accumulate`` micro-batches: forward in train
mode (under bf16 autocast with ``--dtype bf16``), ``mse_loss(as_grid(out), target) /
accumulate``, backward (DDP all-reduces on the last one only: ``no_sync``); then the
optimiser step. With one process (``WORLD_SIZE`` 1) the model is not wrapped in DDP: that
is the training on one GPU that the scaling is against.

**Data.** The synthetic airfoil task (``autofuser.zoo.airfoil``, training seed). Each step
uses ``R = world size x accumulate`` per-rank batches of ``--batch-size`` samples; global
step ``s``'s batch number ``s * R + rank * accumulate + micro`` goes to that rank's
micro-batch, so a run of 2 ranks and a run of 1 process with ``--accumulate 2`` train on
the same samples in the same steps.

**Why accumulation, not the global batch, is the comparison.** DDP averages the ranks'
gradients: ``(1/R) sum_r grad L_r``. One process accumulating the R per-rank batches,
each loss divided by R, computes the same sum with the same kernels on the same shapes
(one compiled signature, the same fusion decisions); for R a power of two the scaling
by 1/R is exact in floating point, so the two runs' gradients differ only in the order
the R terms are added. One process on the whole global batch would run other shapes
(other kernels, other reductions over the batch) and would differ by more than that.

**What is measured** (``--steps`` check steps, then ``--warmup`` and ``--iters`` timed):

- the first step's time (compiling included) and each rank's losses;
- after ``--steps`` steps: every parameter and the last step's gradients, saved to
  ``params/MODEL-SYSTEM.pt``; with ``--baseline DIR`` (a one-process run's ``--out``, the
  same R, model, dtype, batch, steps and lr) the relative error of the parameters' change
  ``||d - d_1|| / ||d_1||`` (``d`` = parameters after minus before) and of the gradients
  against that run's same system, within ``TOLERANCE[dtype]``, and against its eager;
- AutoFuser only: after the check steps, the steps until every rank's check in use has
  settled (run by all ranks alike, so none waits for a step the others never take);
- step time: each rank's time per step (CUDA events on a GPU), median, interquartile
  range, fastest and slowest, and every rank's median; samples/s =
  ``R x batch / median``; with ``--baseline``, scaling = samples/s over the baseline's;
- tuning: the entries under the shared cache's ``tuning/`` folder, each rank's tuned
  kernels (its report's groups that tuned and did not read the cache), and the kernels
  more than one rank tuned (should be none: ranks take a lock per kernel, docs/training.md).

**Hangs.** ``--delay-rank1-s S`` makes rank 1 start each system's first forward S seconds
after the others (a slower compile); the other ranks then wait for it in the first
all-reduce. Every phase runs under a watchdog: one that does not finish within
``--timeout-s`` prints the rank, model, system and phase and every thread's stack, and
ends the process with exit code 124 (torchrun then stops the other ranks). The process
group's own timeout is ``--timeout-s`` + 60 s, so the watchdog speaks first.

Backend: NCCL on CUDA (``NCCL_NVLS_ENABLE=0`` unless set: no NVLink multicast), gloo on the
CPU, where AutoFuser's kernels run under Triton's interpreter (tiny config only).

Rank 0 writes ``ddp_train.json`` and ``ddp_train.md`` to ``--out``. ``--table-only`` with
``--baseline`` rewrites them from an earlier run's files. Exit code 0, 1 where a system's
parameters or gradients differ from the baseline's beyond the tolerance, 2 on bad
arguments, 124 on a timeout. A system that fails on every rank alike (say, a compile
error) is an error cell, and the others run on; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import faulthandler
import json
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

# Before torch.distributed reads it: NVLink multicast (NVLS) stays off, as on the machines
# this runs on (docs/training.md).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import autofuser  # noqa: E402
from autofuser.zoo.airfoil import TRAIN_SEED, make_dataset  # noqa: E402
from autofuser.zoo.harness import (  # noqa: E402
    SETTLE_CALLS,
    BenchError,
    autocast_for,
    describe_error,
    release_memory,
    spread,
    synchronize,
    use_interpreter_on_cpu,
)
from autofuser.zoo.models import MESHES, MODELS, parameter_count  # noqa: E402
from autofuser.zoo.train_bench import flat_gradients  # noqa: E402
from autofuser_core import cache  # noqa: E402

SYSTEMS = ("eager", "autofuser", "compile")
#: Largest relative error of the parameters' change and of the gradients against the
#: one-process run. The kernels and shapes are the same; what differs is the order the
#: ranks' gradients are added and, on a GPU, tuning (two runs may pick other configs).
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}
TIMEOUT_EXIT = 124
RESULT_JSON, RESULT_MD = "ddp_train.json", "ddp_train.md"


def say(rank: int, message: str) -> None:
    print(f"ddp_train[rank {rank}]: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------


class Ranks:
    """This process's place among the ranks, and the few collectives the script needs
    (all no-ops with one process)."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.grouped = "RANK" in os.environ  # launched by torchrun (or another launcher)
        if self.grouped:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s + 60))

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order."""
        if not self.grouped:
            return [value]
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.grouped:
            dist.barrier()

    def close(self) -> None:
        if self.grouped:
            dist.destroy_process_group()


class Watchdog:
    """Turns a hang into an error: a phase still running after ``timeout_s`` calls
    ``on_timeout(message)`` - by default: print the message and every thread's stack,
    and end the process with ``TIMEOUT_EXIT``."""

    def __init__(self, rank: int, timeout_s: float, on_timeout: Optional[Callable[[str], None]] = None):
        self.rank, self.timeout_s = rank, timeout_s
        self.on_timeout = on_timeout or self._exit

    @contextlib.contextmanager
    def phase(self, what: str):
        message = (
            f"rank {self.rank}: {what} did not finish within {self.timeout_s:g} s (--timeout-s). A rank waits "
            "in a collective for another that failed (see its output above) or is still compiling (raise "
            "--timeout-s); every thread's stack follows."
        )
        timer = threading.Timer(self.timeout_s, self.on_timeout, args=(message,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    @staticmethod
    def _exit(message: str) -> None:
        print(f"ddp_train: {message}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        cache.remove_private_kernel_dir()  # os._exit skips the exit hook that removes it
        os._exit(TIMEOUT_EXIT)


# ---------------------------------------------------------------------------
# One system's training
# ---------------------------------------------------------------------------


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter as one fp32 CPU vector (a complex one as its real and imaginary parts)."""
    pieces = [(torch.view_as_real(p) if p.is_complex() else p).detach().float().flatten() for p in model.parameters()]
    return torch.cat(pieces).cpu()


class Trainer:
    """Trains ``module`` (a system wrapping ``model``) on this rank's batches."""

    def __init__(self, module, model, entry, data, batch: int, args, ranks: Ranks, device: torch.device):
        self.module, self.entry, self.args, self.ranks, self.device = module, entry, args, ranks, device
        self.coords, self.target = data
        self.batch_size = batch
        self.parameters = list(model.parameters())
        self.optimiser = torch.optim.AdamW(self.parameters, lr=args.lr)
        self.per_step = ranks.world * args.accumulate  # per-rank batches in a global step
        self.slots = self.coords.shape[0] // batch
        self.mesh = MESHES[args.config]

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = (step * self.per_step + self.ranks.rank * self.args.accumulate + micro) % self.slots
        rows = slice(slot * self.batch_size, (slot + 1) * self.batch_size)
        return self.entry.inputs(self.coords[rows]), self.target[rows]

    def step(self, step: int) -> torch.Tensor:
        """One optimiser step; this rank's loss (the mean over its micro-batches), on the
        device: reading it would wait for the GPU inside the timed steps."""
        self.optimiser.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for micro in range(self.args.accumulate):
            x, y = self.batch(step, micro)
            last = micro == self.args.accumulate - 1
            # DDP all-reduces in the backward of the last micro-batch only.
            sync = contextlib.nullcontext() if last or self.ranks.world == 1 else self.module.no_sync()
            with sync:
                with autocast_for(self.device, self.args.dtype):
                    out = self.module(x)
                    loss = F.mse_loss(self.entry.as_grid(out, self.mesh).float(), y) / self.args.accumulate
                loss.backward()
            total += loss.detach()
        self.optimiser.step()
        return total

    def timed_steps(self, first: int, count: int) -> list[float]:
        """ms of each of ``count`` steps (global steps ``first``...)."""
        if self.device.type != "cuda":
            times = []
            for k in range(count):
                begin = time.perf_counter()
                self.step(first + k)
                times.append((time.perf_counter() - begin) * 1e3)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
        synchronize(self.device)
        for k, (start, end) in enumerate(events):
            start.record()
            self.step(first + k)
            end.record()
        synchronize(self.device)
        return [start.elapsed_time(end) for start, end in events]


def train_system(system: str, base: torch.nn.Module, entry, data, batch: int, args, ranks: Ranks, device, dog, out):
    """Train one system (a fresh copy of ``base``); its result cell (rank 0's, with every
    rank's numbers gathered). Saves its parameters to ``out/params`` on rank 0."""
    name = entry.name
    model = copy.deepcopy(base).train()
    cell: dict[str, Any] = {}
    fused = None
    if system == "autofuser":
        cache = Path(args.cache_dir or Path(args.out) / "autofuser-cache") / f"{name}-{args.dtype}"
        if ranks.rank == 0:
            shutil.rmtree(cache, ignore_errors=True)  # so its entries are this run's
            cache.mkdir(parents=True)
        ranks.barrier()
        fused = autofuser.fuse(model, cache_dir=str(cache), progress=False)
        inner: torch.nn.Module = fused
    elif system == "compile":
        torch._dynamo.reset()
        inner = torch.compile(model)
    else:
        inner = model
    if ranks.world > 1:
        module = DistributedDataParallel(inner, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        module = inner
    trainer = Trainer(module, model, entry, data, batch, args, ranks, device)
    before = flat_parameters(model)

    losses = []
    with dog.phase(f"{name}/{system}: first step (compiles)"):
        if ranks.rank == 1 and args.delay_rank1_s:
            say(ranks.rank, f"{name}/{system}: first forward {args.delay_rank1_s:g} s late (--delay-rank1-s)")
            time.sleep(args.delay_rank1_s)
        synchronize(device)
        begin = time.perf_counter()
        losses.append(trainer.step(0).item())
        synchronize(device)
        cell["first_step_s"] = time.perf_counter() - begin
    with dog.phase(f"{name}/{system}: check steps 2..{args.steps}"):
        for step in range(1, args.steps):
            losses.append(trainer.step(step).item())
    after, gradients = flat_parameters(model), flat_gradients(trainer.parameters).cpu()
    cell["losses"] = [sum(step_losses) / len(step_losses) for step_losses in zip(*ranks.gather(losses))]
    step = args.steps

    if fused is not None:
        with dog.phase(f"{name}/{system}: steps until every rank's check in use settled"):
            settle = 0
            # Every rank steps until all have settled: a rank that stopped early would leave
            # the others waiting in an all-reduce.
            while any(ranks.gather(fused.checking_in_use)) and settle < SETTLE_CALLS:
                trainer.step(step)
                step, settle = step + 1, settle + 1
        cell["settle_steps"] = settle
        report = fused.report()
        tuned_here = sorted({g.kernel for g in report.fused if g.kernel and not g.cache_hit and g.tuning_s > 0})
        tuned_by_rank = ranks.gather(tuned_here)
        counts: dict[str, int] = {}
        for kernels in tuned_by_rank:
            for kernel in kernels:
                counts[kernel] = counts.get(kernel, 0) + 1
        ranks.barrier()  # every rank's entries are written
        cell.update(
            fused_groups=len(report.fused),
            skipped_groups=len(report.skipped),
            notes=list(report.notes),
            tuning_entries=len(list((cache / "tuning").glob("*.json"))),
            tuned_by_rank=tuned_by_rank,
            tuned_twice=sorted(k for k, n in counts.items() if n > 1),
        )

    with dog.phase(f"{name}/{system}: {args.warmup} warm-up and {args.iters} timed steps"):
        for _ in range(args.warmup):
            trainer.step(step)
            step += 1
        times = trainer.timed_steps(step, args.iters)
    measured = spread(times)
    cell.update(
        step_ms=measured["ms"],
        iqr_ms=measured["iqr_ms"],
        min_ms=min(times),
        max_ms=max(times),
        rank_median_ms=[spread(t)["ms"] for t in ranks.gather(times)],
        samples_per_s=trainer.per_step * batch / (measured["ms"] / 1e3),
    )
    if ranks.rank == 0:
        (Path(args.out) / "params").mkdir(parents=True, exist_ok=True)
        torch.save({"before": before, "after": after, "gradients": gradients}, params_path(args.out, name, system))
    del trainer, module, inner, model, fused
    release_memory(device)
    return cell


def params_path(out: "str | Path", model: str, system: str) -> Path:
    return Path(out) / "params" / f"{model}-{system}.pt"


# ---------------------------------------------------------------------------
# Comparison with the one-process run, and the table
# ---------------------------------------------------------------------------

#: Settings two runs must share for their parameters to be compared.
SAME_SETTINGS = ("config", "dtype", "batch_size", "steps", "lr", "global_batches")


def check_baseline(settings: dict[str, Any], baseline_dir: Path) -> dict[str, Any]:
    """The one-process run in ``baseline_dir``, refused (``BenchError``, saying the fix) where
    it is missing, not one process, or ran other settings."""
    path = baseline_dir / RESULT_JSON
    if not path.is_file():
        raise BenchError(
            f"--baseline {baseline_dir} holds no {RESULT_JSON}: run the one-process baseline first, "
            f"with --accumulate {settings['global_batches']} --out {baseline_dir}"
        )
    baseline = json.loads(path.read_text())
    theirs = baseline["settings"]
    mismatched = [
        f"{key} {settings[key]} here, {theirs[key]} there" for key in SAME_SETTINGS if settings[key] != theirs[key]
    ]
    if theirs["world"] != 1:
        mismatched.append(f"it ran {theirs['world']} ranks, not one process")
    if mismatched:
        raise BenchError(
            f"--baseline {baseline_dir} does not match this run ({'; '.join(mismatched)}): run it as one process "
            "with the same --config, --dtype, --batch-size, --steps and --lr, and --accumulate set to this run's "
            "ranks x --accumulate"
        )
    return baseline


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.norm()
    return float((a - b).norm() / scale) if scale > 0 else float((a - b).norm())


def compare(result: dict[str, Any], out: Path, baseline_dir: Path) -> bool:
    """Fill every cell's comparison with the one-process run in ``baseline_dir``; True where
    all systems agree with it within the tolerance."""
    baseline = check_baseline(result["settings"], baseline_dir)
    tolerance = TOLERANCE[result["settings"]["dtype"]]
    agree = True
    for row in result["rows"]:
        base_row = next((r for r in baseline["rows"] if r["model"] == row["model"]), None)
        for system, cell in row["systems"].items():
            base_cell = None if base_row is None else base_row["systems"].get(system)
            if cell.get("error"):
                agree = False  # no result is not a result that agrees
                continue
            if base_cell is None or base_cell.get("error") or base_row["batch"] != row["batch"]:
                cell["compared"] = f"no result in --baseline {baseline_dir}"
                continue
            mine = torch.load(params_path(out, row["model"], system))
            theirs = torch.load(params_path(baseline_dir, row["model"], system))
            cell["update_rel_err"] = relative(mine["after"] - mine["before"], theirs["after"] - theirs["before"])
            cell["grad_rel_err"] = relative(mine["gradients"], theirs["gradients"])
            cell["loss_rel_err"] = relative(torch.tensor(cell["losses"]), torch.tensor(base_cell["losses"]))
            if "eager" in base_row["systems"]:
                eager = torch.load(params_path(baseline_dir, row["model"], "eager"))
                cell["update_rel_err_vs_eager"] = relative(
                    mine["after"] - mine["before"], eager["after"] - eager["before"]
                )
            cell["within_tolerance"] = max(cell["update_rel_err"], cell["grad_rel_err"]) <= tolerance
            cell["baseline_samples_per_s"] = base_cell["samples_per_s"]
            cell["scaling"] = cell["samples_per_s"] / base_cell["samples_per_s"]
            agree &= cell["within_tolerance"]
    result["baseline"] = str(baseline_dir)
    return agree


COLUMNS = [
    "model",
    "system",
    "ranks",
    "batch/rank",
    "step ms",
    "IQR ms",
    "min-max ms",
    "rank medians ms",
    "samples/s",
    "scaling vs 1 process",
    "first step s",
    "update rel err",
    "grad rel err",
    "update rel err vs 1-process eager",
    "tuning entries",
    "kernels tuned by 2+ ranks",
]


def render_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]

    def number(cell: dict, key: str, fmt: str) -> str:
        return "-" if cell.get(key) is None else format(cell[key], fmt)

    lines = [
        f"# DistributedDataParallel training - {s['config']} config, {s['dtype']}, {s['world']} rank(s) "
        f"({s['backend']}, {s['device']})",
        "",
        f"{result['date']}; torch {result['torch']}, Triton {result['triton']}. `benchmarks/ddp_train.py`: "
        f"{s['world']} rank(s) x {s['accumulate']} accumulated per-rank batch(es) (batch/rank samples each), AdamW(lr="
        f"{s['lr']:g}); step ms = rank 0's median over {s['iters']} steps after {s['steps']} check steps and "
        f"{s['warmup']} warm-up steps; scaling = samples/s over the one-process run's "
        f"({result.get('baseline') or 'no --baseline given'}); rel err = ||x - x_1|| / ||x_1|| of the parameters' "
        f"change over the {s['steps']} check steps (update) and of the last check step's gradients, against the "
        f"one-process run of the same system, tolerance {TOLERANCE[s['dtype']]:g}; rank 1's first forward "
        f"{s['delay_rank1_s']:g} s late.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in result["rows"]:
        for system, cell in row["systems"].items():
            if cell.get("error"):
                failed = [row["model"], system, str(s["world"]), str(row["batch"]), f"error: {cell['error']}"]
                lines.append("| " + " | ".join(failed + ["-"] * (len(COLUMNS) - len(failed))) + " |")
                continue
            flag = "" if cell.get("within_tolerance", True) else " (DIFFERS)"
            fused = system == "autofuser"
            lines.append(
                "| "
                + " | ".join(
                    [
                        row["model"],
                        system,
                        str(s["world"]),
                        str(row["batch"]),
                        number(cell, "step_ms", ".3f"),
                        number(cell, "iqr_ms", ".3f"),
                        f"{cell['min_ms']:.3f}-{cell['max_ms']:.3f}",
                        ", ".join(f"{ms:.3f}" for ms in cell["rank_median_ms"]),
                        number(cell, "samples_per_s", ".1f"),
                        number(cell, "scaling", ".2f") + ("x" if cell.get("scaling") else ""),
                        number(cell, "first_step_s", ".2f"),
                        number(cell, "update_rel_err", ".1e") + flag,
                        number(cell, "grad_rel_err", ".1e"),
                        number(cell, "update_rel_err_vs_eager", ".1e"),
                        str(cell["tuning_entries"]) if fused else "-",
                        (", ".join(cell["tuned_twice"]) or "none") if fused else "-",
                    ]
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def write_results(result: dict[str, Any], out: Path) -> None:
    (out / RESULT_JSON).write_text(json.dumps(result, indent=1))
    (out / RESULT_MD).write_text(render_markdown(result))


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--models", default="galerkin,fno", help="zoo models, comma-separated")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--config", choices=tuple(MESHES), default="airfoil")
    parser.add_argument("--batch-size", type=int, default=None, help="per rank (default: the model's training batch)")
    parser.add_argument("--accumulate", type=int, default=1, help="per-rank batches accumulated per step")
    parser.add_argument("--steps", type=int, default=5, help="steps before parameters are compared")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30, help="timed steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument("--out", default="bench-results/ddp")
    parser.add_argument("--cache-dir", default=None, help="AutoFuser's cache, shared by the ranks (default OUT/...)")
    parser.add_argument("--baseline", default=None, help="a one-process run's --out, to compare with")
    parser.add_argument("--table-only", action="store_true", help="with --baseline: compare --out's saved run")
    parser.add_argument("--delay-rank1-s", type=float, default=0.0, help="rank 1's first forwards this late")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="a phase running longer is a hang")
    args = parser.parse_args(argv)
    problems = []
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        problems.append(f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        problems.append(f"--models {args.models!r}: the zoo has {', '.join(MODELS)}")
    if args.accumulate < 1 or args.steps < 1 or args.iters < 1 or args.warmup < 0:
        problems.append("--accumulate, --steps and --iters must be >= 1, --warmup >= 0")
    if args.batch_size is not None and args.batch_size < 1:
        problems.append("--batch-size must be >= 1")
    if args.table_only and not args.baseline:
        problems.append("--table-only compares a saved run with --baseline DIR: give --baseline")
    if problems:
        parser.error("; ".join(problems))
    args.systems, args.models = systems, models
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        result = json.loads((out / RESULT_JSON).read_text())
        agree = compare(result, out, Path(args.baseline))
        write_results(result, out)
        print(render_markdown(result))
        return 0 if agree else 1
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BenchError("--device cuda but no CUDA device is available; use --device cpu")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    use_interpreter_on_cpu(device)
    ranks = Ranks(device, args.timeout_s)
    dog = Watchdog(ranks.rank, args.timeout_s)
    if ranks.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    import triton

    settings = {
        "models": args.models,
        "systems": args.systems,
        "config": args.config,
        "dtype": args.dtype,
        "world": ranks.world,
        "accumulate": args.accumulate,
        "global_batches": ranks.world * args.accumulate,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "iters": args.iters,
        "lr": args.lr,
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "backend": dist.get_backend() if ranks.grouped else "none",
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "delay_rank1_s": args.delay_rank1_s,
        "timeout_s": args.timeout_s,
    }
    if args.baseline:
        check_baseline(settings, Path(args.baseline))  # before training: a mismatch found at the end wastes the run
    rows = []
    for name in args.models:
        entry = MODELS[name]
        batch = args.batch_size or entry.batch(args.config, train=True)
        torch.manual_seed(0)
        base = entry.make(args.config).to(device)
        slots = ranks.world * args.accumulate * args.steps
        coords, target = make_dataset(slots * batch, TRAIN_SEED, MESHES[args.config])
        data = (coords.to(device), target.to(device))
        row: dict[str, Any] = {"model": name, "params": parameter_count(base), "batch": batch, "systems": {}}
        for system in args.systems:
            if ranks.rank == 0:
                say(0, f"{name}/{system}: training on {ranks.world} rank(s)")
            error = None
            try:
                cell = train_system(system, base, entry, data, batch, args, ranks, device, dog, out)
            except Exception as err:  # noqa: BLE001 - becomes the cell's error where every rank had one
                cell, error = {}, describe_error(err)
                say(ranks.rank, f"{name}/{system} failed:\n{traceback.format_exc()}")
                release_memory(device)
            # Every rank tells how the system went: one that failed on every rank alike (a
            # compile error) becomes an error cell and the run goes on. One that failed on some
            # ranks only leaves the others inside a collective, and the watchdog ends the run.
            with dog.phase(f"{name}/{system}: telling the ranks how it went"):
                errors = [e for e in ranks.gather(error) if e]
            row["systems"][system] = {"error": errors[0]} if errors else cell
        rows.append(row)
    agree = not any(cell.get("error") for row in rows for cell in row["systems"].values())
    if ranks.rank == 0:
        result = {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "autofuser": autofuser.__version__,
            "settings": settings,
            "rows": rows,
        }
        if args.baseline:
            agree = compare(result, out, Path(args.baseline)) and agree
        write_results(result, out)
        print(render_markdown(result))
    ranks.barrier()
    ranks.close()
    return 0 if agree else 1


if __name__ == "__main__":
    try:
        code = main()
    except BenchError as err:
        print(f"ddp_train: {err}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown: after the process group is destroyed it now
    # and then aborted a rank ("terminate called without an active exception", from C++;
    # tests/core/test_distributed.py saw the same). That teardown would also remove the
    # private kernel folder: removed here instead.
    cache.remove_private_kernel_dir()
    os._exit(code)
