"""Where a forward spends its time, kernel by kernel.

Side by side (``--zoo NAME`` or ``--factory MODULE:FACTORY``): AutoFuser's and
``torch.compile(mode="reduce-overhead")``'s replayed forwards (or any of eager,
autofuser and torch.compile's modes, ``--systems``) under ``torch.profiler``,
after each has compiled, settled and warmed up: every kernel's name, launches
per forward and device time per forward, the top ``--top`` of each system, and
a summary line per system. Writes the markdown to ``--out`` and prints it. On a
GPU the rows are the GPU kernels (their device time); on a CPU, where a
CUDA graph replays nothing, they are the CPU ops with their own (self) time, so
the tool and its tests run without a GPU.

    python benchmarks/profile_case.py --zoo unet --dtype bf16 --out profile-unet-bf16.md
    python benchmarks/profile_case.py --factory my_model.py:make --systems eager,autofuser,reduce-overhead

``--train`` profiles training steps instead (train mode; zero_grad, forward,
a mean-square loss over the outputs, backward; the optimiser, the same on every
side, left out): where a step's backward spends its time.

``--memory`` (CUDA) adds where each system's memory stays between calls: what
its calls keep allocated once they are done (its compiled buffers, CUDA graph
pools' live tensors, gradients) and the largest of those allocations grouped by
the line of Python that made them, from torch's allocator history:

    python benchmarks/profile_case.py --zoo transolver --train --systems eager,autofuser --memory

One case of ``benchmarks/attention.py`` (a form) or of ``benchmarks/matmul.py``
(a case whose name contains ``--form``), AutoFuser only, as before: the
report's notes (CUDA graph or not, whole-forward times), tuning timings and a
``torch.profiler`` table (GPU only):

    python benchmarks/profile_case.py --form galerkin --width 64 --mode bf16
    python benchmarks/profile_case.py --form w-2w-w --width 128 --mode tf32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

import autofuser

#: What ``--systems`` may name: eager, AutoFuser, or torch.compile in a mode.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: ``autofuser-fused``: the fused model whatever the speed checks decide (``verify_speed=False``):
#: where a check keeps the original, what the fused forward or step would spend, and on what.
SIDE_BY_SIDE_SYSTEMS = ("eager", "autofuser", "autofuser-fused", *COMPILE_MODES)
#: Allocations ``--memory`` keeps the stacks of (torch's allocator history, per system).
MEMORY_HISTORY = 200_000
#: Kernel names longer than this are cut in the table (Inductor's and cuDNN's run long).
NAME_WIDTH = 90


class MemorySite(NamedTuple):
    """Live memory made at one place: ``where`` (file:line in function, the innermost frame
    outside torch; ``[graph pool]`` where it lies in a CUDA graph's private pool)."""

    where: str
    mb: float
    blocks: int


#: Frames of these paths are torch's own: a site is named by the first frame outside them.
TORCH_FRAMES = ("/torch/", "/triton/", "<frozen ", "contextlib.py", "functools.py")
#: AutoFuser's own runtime: a site there (a fused kernel's outputs) also names its caller.
RUNTIME_FRAMES = ("/autofuser_core/",)


def _frame_text(frame: dict) -> str:
    return f"{Path(frame.get('filename', '?')).name}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def _site(frames: list, pooled: bool) -> str:
    """The allocation's place: the innermost frame not in ``TORCH_FRAMES`` (the innermost of
    all where every one is); where that is AutoFuser's runtime, with the first frame outside
    it too (what the kernel's caller was)."""
    outside = [f for f in frames if not any(p in f.get("filename", "") for p in TORCH_FRAMES)]
    chosen = outside[0] if outside else (frames[0] if frames else None)
    where = _frame_text(chosen) if chosen else "(no stack recorded)"
    if chosen is not None and any(p in chosen.get("filename", "") for p in RUNTIME_FRAMES):
        caller = next((f for f in outside if not any(p in f.get("filename", "") for p in RUNTIME_FRAMES)), None)
        if caller is not None:
            where += f" <- {_frame_text(caller)}"
    return where + (" [graph pool]" if pooled else "")


def active_blocks(snapshot: dict, device: Optional[int] = None) -> list[tuple[dict, dict]]:
    """(segment, block) of each allocated block of an allocator ``snapshot``
    (``torch.cuda.memory._snapshot()``, which covers every device), on ``device`` alone
    where one is given."""
    return [
        (segment, block)
        for segment in snapshot.get("segments", [])
        if device is None or segment.get("device") == device
        for block in segment.get("blocks", [])
        if block.get("state") == "active_allocated"
    ]


def live_sites(snapshot: dict, device: Optional[int] = None, before: frozenset = frozenset()) -> list[MemorySite]:
    """The allocated blocks of ``snapshot`` (on ``device``, and not among the addresses
    ``before``: those allocated before the system was made) grouped by ``_site``, largest
    first. A block in a segment of a private pool (a CUDA graph's: ``segment_pool_id``
    other than (0, 0)) is marked as such."""
    sizes: dict[str, list[int]] = defaultdict(list)
    for segment, block in active_blocks(snapshot, device):
        if block.get("address") in before:
            continue
        pooled = tuple(segment.get("segment_pool_id") or (0, 0)) != (0, 0)
        sizes[_site(block.get("frames") or [], pooled)].append(block["size"])
    sites = [MemorySite(where, sum(found) / 2**20, len(found)) for where, found in sizes.items()]
    return sorted(sites, key=lambda site: (-site.mb, site.where))


def render_memory(memory: dict[str, tuple[float, list[MemorySite]]], *, top: int) -> str:
    """The ``--memory`` section: per system what its calls keep allocated, then its ``top``
    allocation sites."""
    lines = ["", "## Memory kept between calls", "", "| system | MB kept |", "|---|---|"]
    for system, (kept, _) in memory.items():
        lines.append(f"| {system_label(system)} | {kept:.1f} |")
    for system, (_, sites) in memory.items():
        lines += ["", f"### {system_label(system)}: largest allocation sites", "", "| where | MB | blocks |"]
        lines.append("|---|---|---|")
        for site in sites[:top]:
            lines.append(f"| `{site.where.replace('|', '/')}` | {site.mb:.1f} | {site.blocks} |")
    return "\n".join(lines) + "\n"


class KernelRow(NamedTuple):
    """One kernel (on a CPU: one op) of a system's profiled forwards."""

    name: str
    launches: float  # per forward
    ms: float  # device time (on a CPU: self CPU time) per forward


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The options, checked: side by side needs exactly one of --zoo and --factory and
    systems from ``SIDE_BY_SIDE_SYSTEMS``, each named once."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--zoo", help="side by side: a zoo model (autofuser models lists them)")
    parser.add_argument(
        "--factory", metavar="MODULE:FACTORY", help="side by side: your model, as autofuser bench takes it"
    )
    parser.add_argument(
        "--systems",
        default="autofuser,reduce-overhead",
        help=f"side by side: comma-separated, from {', '.join(SIDE_BY_SIDE_SYSTEMS)} (a mode is torch.compile's)",
    )
    parser.add_argument("--config", default="airfoil", choices=("airfoil", "tiny"), help="--zoo: its sizes")
    parser.add_argument("--batch-size", type=int, default=None, help="--zoo: override its batch size")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="side by side: bf16 = autocast")
    parser.add_argument("--device", default=None, help="side by side: cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--train",
        action="store_true",
        help="side by side: profile training steps (zero_grad, forward, loss, backward; no optimiser) in train mode",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="side by side, CUDA: also where each system's memory stays between calls (allocation sites)",
    )
    parser.add_argument("--calls", type=int, default=20, help="side by side: forwards profiled per system")
    parser.add_argument("--warmup", type=int, default=10, help="side by side: forwards before profiling")
    parser.add_argument("--top", type=int, default=15, help="side by side: kernels listed per system")
    parser.add_argument("--out", default=None, help="side by side: write the markdown summary here too")
    parser.add_argument("--form", default="galerkin", help="one attention form or part of a matmul case name")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument(
        "--mode",
        default="bf16",
        choices=["fp32", "tf32", "bf16", "bf16-weights"],
        help="bf16: autocast over fp32 parameters; bf16-weights: parameters and inputs in bf16 "
        "(no autocast), to see what reading fp32 weights costs a fused kernel",
    )
    parser.add_argument("--tune-budget", type=float, default=2.0)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="side by side: AutoFuser's cache folder (default: a new empty one, so it compiles cold); "
        "pass a benchmark's to profile the kernels it tuned",
    )
    args = parser.parse_args(argv)
    args.side_by_side = args.zoo is not None or args.factory is not None
    if args.zoo is not None and args.factory is not None:
        parser.error("--zoo and --factory name the model two ways; give one")
    if args.zoo is not None:
        from autofuser.zoo.models import MODELS

        if args.zoo not in MODELS:
            parser.error(f"--zoo {args.zoo!r} is not a zoo model; choose one of {', '.join(MODELS)}")
    if args.factory is not None and ":" not in args.factory:
        parser.error(f"--factory {args.factory!r} is not MODULE:FACTORY (e.g. my_model.py:make)")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SIDE_BY_SIDE_SYSTEMS]
    if unknown or not systems or len(set(systems)) != len(systems):
        parser.error(
            f"--systems {args.systems!r}: name each of one or more of {', '.join(SIDE_BY_SIDE_SYSTEMS)} once"
            + (f" ({', '.join(unknown)} unknown)" if unknown else "")
        )
    args.systems = systems
    for option in ("calls", "top"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, got {getattr(args, option)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def system_label(system: str) -> str:
    """How the summary names a system."""
    return {"eager": "eager", "autofuser": "AutoFuser", "autofuser-fused": "AutoFuser, fused unchecked"}.get(
        system, f"torch.compile {system}"
    )


def kernel_rows(profile: Any, device_type: str, calls: int) -> list[KernelRow]:
    """Every kernel of ``profile`` (``calls`` forwards) with its launches and time per forward,
    the longest first. On CUDA, the events that ran on the GPU, each its own time; on a CPU,
    the ops, each with its self time (an op's children counted once, in themselves)."""
    launches: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for event in profile.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if device_type == "cuda" and on_device:
            micros[event.name] += event.time_range.elapsed_us()
        elif device_type != "cuda" and not on_device:
            micros[event.name] += event.self_cpu_time_total
        else:
            continue
        launches[event.name] += 1
    rows = [KernelRow(name, launches[name] / calls, micros[name] / 1e3 / calls) for name in launches]
    return sorted(rows, key=lambda row: (-row.ms, row.name))


def render_summary(
    profiles: dict[str, list[KernelRow]], *, top: int, title: str, where: str, calls: int, call: str = "forward"
) -> str:
    """The markdown summary: one line per system (launches, distinct kernels, kernel time per
    forward), then each system's ``top`` kernels with their share of its time."""
    unit = "GPU kernels" if where.startswith("cuda") else "CPU ops (self time; a CPU replays no CUDA graph)"
    lines = [
        f"# Kernels per {call}: {title}",
        "",
        f"{where}; {unit}; {calls} profiled {call}s per system, after warm-up; per {call}.",
        "",
        "| system | launches | distinct | time ms |",
        "|---|---|---|---|",
    ]
    for system, rows in profiles.items():
        total = sum(row.ms for row in rows)
        launches = sum(row.launches for row in rows)
        lines.append(f"| {system_label(system)} | {launches:g} | {len(rows)} | {total:.3f} |")
    for system, rows in profiles.items():
        total = sum(row.ms for row in rows) or 1.0
        shown = rows[:top]
        lines += [
            "",
            f"## {system_label(system)}: top {len(shown)} of {len(rows)}",
            "",
            "| kernel | launches | ms | share |",
            "|---|---|---|---|",
        ]
        for row in shown:
            name = row.name if len(row.name) <= NAME_WIDTH else row.name[: NAME_WIDTH - 3] + "..."
            name = name.replace("|", "\\|")
            lines.append(f"| `{name}` | {row.launches:g} | {row.ms:.3f} | {row.ms / total:.0%} |")
    return "\n".join(lines) + "\n"


def _model_and_call(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Callable, str]:
    """(model, call(fn) -> zero-argument forward of fn, title) of --zoo or --factory."""
    from autofuser.zoo.harness import autocast_for, build, to_device

    if args.zoo is not None:
        from autofuser.zoo.models import MODELS

        entry = MODELS[args.zoo]
        batch = args.batch_size or entry.batch(args.config)
        model, x, _ = build(entry, args.config, batch, device)
        inputs: tuple = (x,)
        kwargs: dict = {}
        title = f"{args.zoo} ({args.config}, batch {batch}, {args.dtype})"
    else:
        from autofuser.cli import call_factory

        model, inputs, kwargs = call_factory(args.factory, "profile_case")
        model = model.to(device)
        inputs, kwargs = to_device(inputs, device), to_device(kwargs, device)
        title = f"{args.factory} ({args.dtype})"

    def call(fn):
        def forward():
            with torch.no_grad(), autocast_for(device, args.dtype):
                return fn(*inputs, **kwargs)

        return forward

    def training_call(fn):
        # The loss reads every output; the optimiser is left out: it is the same code on every side.
        def step():
            # reduce-overhead's CUDA graphs: each step is a new iteration (a no-op elsewhere).
            torch.compiler.cudagraph_mark_step_begin()
            for parameter in model.parameters():
                parameter.grad = None
            with autocast_for(device, args.dtype):
                found = fn(*inputs, **kwargs)
                outputs = found if isinstance(found, (tuple, list)) else (found,)
                loss = sum(o.float().square().mean() for o in outputs if o.is_floating_point())
            loss.backward()

        return step

    if args.train:
        return model.train(), training_call, title + ", training steps"
    return model.eval(), call, title


def profile_systems(
    args: argparse.Namespace, memory: Optional[dict[str, tuple[float, list[MemorySite]]]] = None
) -> tuple[dict[str, list[KernelRow]], str, str]:
    """Each system of ``args.systems`` compiled, warmed up and profiled: ({system: rows}, title, where).
    With ``memory`` on CUDA, each system's (MB its calls keep allocated, ``live_sites``) goes in it."""
    from autofuser.zoo.harness import settle, use_interpreter_on_cpu

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    use_interpreter_on_cpu(device)
    model, call, title = _model_and_call(args, device)
    profiles: dict[str, list[KernelRow]] = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with contextlib.ExitStack() as scratch:
        for system in args.systems:
            print(f"profile_case: {system_label(system)}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            recording = memory is not None and device.type == "cuda"
            if recording:
                for parameter in model.parameters():  # the last system's gradients are not this one's
                    parameter.grad = None
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                index = torch.cuda.current_device() if device.index is None else device.index
                present = frozenset(b.get("address") for _, b in active_blocks(torch.cuda.memory._snapshot(), index))
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_HISTORY)
            if system == "eager":
                runner: Any = model
            elif system in ("autofuser", "autofuser-fused"):
                # Without --cache-dir, a new empty folder (a cold compile), removed when profiling ends.
                cache_dir = args.cache_dir or scratch.enter_context(
                    tempfile.TemporaryDirectory(prefix="autofuser-profile-")
                )
                checked = system == "autofuser"
                runner = autofuser.fuse(model, cache_dir=cache_dir, progress=False, verify_speed=checked)
            else:
                runner = torch.compile(model, mode=system)
            forward = call(runner)
            forward()  # compiles
            if system == "autofuser":
                settle(runner, forward)  # the runner its check in use keeps, as the bench times it
            if system in ("autofuser", "autofuser-fused"):
                for note in runner.report().notes:  # what it runs (graphed, fused or the original) and why
                    print(f"profile_case: AutoFuser: {note}", file=sys.stderr, flush=True)
            for _ in range(args.warmup):
                forward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            with torch.profiler.profile(activities=activities) as profile:
                for _ in range(args.calls):
                    forward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            profiles[system] = kernel_rows(profile, device.type, args.calls)
            if recording and memory is not None:
                kept = (torch.cuda.memory_allocated(device) - before) / 2**20
                memory[system] = (kept, live_sites(torch.cuda.memory._snapshot(), index, present))
                torch.cuda.memory._record_memory_history(enabled=None)
            del runner, forward
    torch._dynamo.reset()
    where = f"{device.type}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    return profiles, title, where


def side_by_side(args: argparse.Namespace) -> int:
    memory: Optional[dict[str, tuple[float, list[MemorySite]]]] = {} if args.memory else None
    profiles, title, where = profile_systems(args, memory)
    call = "training step" if args.train else "forward"
    summary = render_summary(profiles, top=args.top, title=title, where=where, calls=args.calls, call=call)
    if memory:
        summary += render_memory(memory, top=args.top)
    elif args.memory:
        summary += "\n--memory: no CUDA device, so no allocator history to read.\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(summary)
    print(summary)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side_by_side:
        return side_by_side(args)
    from autofuser_core.timing import forward_ms as forward_time

    from attention import FORMS, Softmax, _inputs
    from matmul import CASES, CHAIN_CASES, M, _ms, precision

    device = torch.device("cuda")
    torch.manual_seed(0)
    if args.form in FORMS:
        model = (Softmax() if args.form == "softmax" else FORMS[args.form](args.width)).to(device).eval()
        inputs = _inputs(args.form, args.width, device)
    else:
        factories = [f for name, (f, _, _) in {**CASES, **CHAIN_CASES}.items() if args.form in name]
        if not factories:
            raise SystemExit(
                f"--form {args.form!r} is neither an attention form ({', '.join(sorted(FORMS))}) nor part of "
                f"a matmul case name ({'; '.join({**CASES, **CHAIN_CASES})})"
            )
        factory = factories[0]
        model = factory(args.width).to(device).eval()
        inputs = [torch.randn(M, args.width, device=device) for _ in range(getattr(factory, "inputs", 1))]
    if args.mode == "bf16-weights":
        model = model.to(torch.bfloat16)
        inputs = [x.to(torch.bfloat16) for x in inputs]
    with (
        tempfile.TemporaryDirectory(prefix="autofuser-profile-") as cache,
        precision("fp32" if args.mode == "bf16-weights" else args.mode),
        torch.no_grad(),
    ):
        fused = autofuser.fuse(model, tune_budget_s=args.tune_budget, progress=False, cache_dir=cache)
        fused(*inputs)
        print(fused.report(), file=sys.stderr)
        for entry in sorted(Path(cache, "tuning").glob("*.json")):  # every config tuning timed, fastest first
            data = json.loads(entry.read_text())
            print(f"tuning {data['key']['kernel']}:")
            for timing in sorted(data.get("timings", []), key=lambda t: t["ms"])[:8]:
                print(f"  {timing['ms']:.4f} ms  {timing['config']}")
        for name, fn in (("eager", model), ("autofuser", fused)):
            print(f"{name}: {_ms(fn, *inputs):.4f} ms (do_bench: L2 flushed before each call)")
            print(
                f"{name}: {forward_time(fn, tuple(inputs)):.4f} ms (calls back to back, as the whole-forward check "
                "and the zoo harness time them)"
            )
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                fn(*inputs)
            host = (time.perf_counter() - start) / 50
            torch.cuda.synchronize()
            print(f"{name}: {1e3 * host:.4f} ms host time per call (launch only, unsynchronised)")
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(20):
                fused(*inputs)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
