"""The ``autofuser`` command.

    autofuser bench --models fno,transolver --device cuda --dtype bf16 --out bench-results/
    autofuser bench path/to/my_model.py:make_example --device cuda
    autofuser models [--config tiny]
    autofuser report mypackage.models:make_example --out report.html

``bench`` runs zoo models, or the user's own, under eager PyTorch, torch.compile
and AutoFuser (``autofuser.zoo.harness``); ``models`` lists the zoo; ``report``
fuses one model on example inputs and writes its report as one HTML page.

This module imports only the standard library at the top (``import autofuser``
imports nothing more until a public name is used): ``main`` decides on Triton's
interpreter before anything imports Triton, and ``--help`` is answered without
importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional, Sequence


def _list_models(args: argparse.Namespace) -> int:
    from autofuser.zoo.models import MESHES, MODELS, parameter_count

    mesh = MESHES[args.config]
    print(
        f"{'name':<12}{'model':<34}{'family':<17}{'layout':<8}{'batch':>6}{'params':>12}  config ({args.config}, "
        f"mesh {mesh[0]} x {mesh[1]})"
    )
    for name, entry in MODELS.items():
        params = parameter_count(entry.make(args.config))
        settings = ", ".join(f"{k}={v}" for k, v in entry.configs[args.config].items())
        print(
            f"{name:<12}{entry.title:<34}{entry.family:<17}{entry.layout:<8}{entry.batch(args.config):>6}"
            f"{params:>12,}  {settings}"
        )
    return 0


REPORT_HELP = """Fuse a model on example inputs and write its report as one self-contained HTML page.

MODULE:FACTORY names a function (MODULE an importable module or a .py file)
that takes no arguments and returns (model, inputs): inputs a tensor or a
tuple of positional arguments, or (model, args, kwargs). The model runs once
under torch.no_grad(), in the train/eval mode the factory left it in."""


def load_factory(spec: str, command: str = "report"):
    """The function ``spec`` (MODULE:FACTORY) names; a clear ``SystemExit`` where there is none."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise SystemExit(
            f"autofuser {command}: {spec!r} is not MODULE:FACTORY (e.g. mypackage.models:make_example "
            "or path/to/file.py:make_example)"
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise SystemExit(f"autofuser {command}: no file {module_name}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None:
            raise SystemExit(f"autofuser {command}: {module_name} can't be loaded as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[path.stem] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise SystemExit(
                f"autofuser {command}: can't import {module_name!r} ({err}); check the name, or pass a .py file"
            ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise SystemExit(f"autofuser {command}: {module_name} has no function {attribute!r}")
    return factory


def call_factory(spec: str, command: str = "report"):
    """``(model, args, kwargs)`` from the factory ``spec`` names, its answer checked."""
    import torch

    made = load_factory(spec, command)()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], torch.nn.Module):
        raise SystemExit(
            f"autofuser {command}: {spec} must return (model, inputs) or (model, args, kwargs), "
            f"got {type(made).__name__}"
        )
    model, inputs, kwargs = made[0], made[1], made[2] if len(made) == 3 else {}
    return model, inputs if isinstance(inputs, tuple) else (inputs,), kwargs


def _output_path(option: str, value: str) -> Path:
    """``value`` as a file ``report`` can write, checked before anything is compiled (a
    compile can take minutes): missing parent folders are made now; a folder, or a
    parent that can't be made or written to, fails at once."""
    path = Path(value)
    if path.is_dir():
        raise SystemExit(
            f"autofuser report: {option} {value} is a folder; give a file name, such as "
            f"{path / ('report.json' if option == '--json' else 'report.html')}"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SystemExit(
            f"autofuser report: can't make the folder {path.parent} for {option} "
            f"({err.strerror or err}); choose another path"
        ) from None
    if not os.access(path.parent, os.W_OK):
        raise SystemExit(
            f"autofuser report: the folder {path.parent} for {option} is not writable; choose another path"
        )
    return path


def _report(args: argparse.Namespace) -> int:
    _output_path("--out", args.out)
    if args.json:
        _output_path("--json", args.json)

    import torch

    import autofuser

    model, inputs, kwargs = call_factory(args.factory)
    plugins = None if args.plugins is None else [p for p in args.plugins.split(",") if p]
    fused = autofuser.fuse(model, plugins=plugins)
    with torch.no_grad():
        fused(*inputs, **kwargs)
    report = fused.report()
    report.to_html(args.out, title=f"AutoFuser report: {type(model).__name__} ({args.factory})")
    if args.json:
        Path(args.json).write_text(report.to_json())
    print(f"{len(report.fused)} fused group(s), {len(report.skipped)} skipped; wrote {args.out}")
    return 0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written (paragraphs); every option's default shown, unless its
    help says it already or there is none to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            text += " (default: %(default)s)"
        return text


BENCH_HELP = """Benchmark models under eager PyTorch, torch.compile and AutoFuser.

Without MODULE:FACTORY, the zoo models --models names (see `autofuser models`);
with it, your own model: a function (MODULE an importable module or a .py
file) that takes no arguments and returns (model, inputs) or (model, args,
kwargs), moved to --device and run in eval mode under torch.no_grad().

torch.compile runs once per --compile-modes mode (default: the default mode and
reduce-overhead, Inductor's kernels replayed as CUDA graphs), each with its own
columns and geometric mean; a mode that fails is that cell's error.

Each system's output is compared with eager's; times are the median of
--iters calls with their spread (IQR); AutoFuser's fused and skipped groups
are counted, and a run that fused nothing shows no speedup. Writes bench.json,
bench.md and bench.png (with matplotlib) to --out; the table is printed last.
An AutoFuser output (or, with --train, gradients) farther from eager's than
1e-4 (fp32) or 4e-2 (bf16) in relative L2 error is judged against the same
model run once more in float64: it is named on stderr, and the command exits
with status 1, where it is also farther from the float64 result than 4 times
eager's own error plus that limit (where the model can't run in float64, its
run in strict fp32, without TF32, stands in; where neither runs, the limit
alone judges).
On a CPU, AutoFuser's kernels run under Triton's interpreter, which this
command turns on by itself."""

ZOO_CONFIGS = ("airfoil", "tiny")  # autofuser.zoo.models.MESHES, named here so that --help imports no model
BENCH_DTYPES = ("bf16", "fp32")  # autofuser.zoo.harness.DTYPES
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: torch.compile's modes ``bench`` measures unless told otherwise: the default, and reduce-overhead
#: (Inductor's kernels replayed as CUDA graphs), the like-for-like competitor of AutoFuser's own
#: CUDA-graph replay.
DEFAULT_COMPILE_MODES = ("default", "reduce-overhead")


def comma_separated(text: str, allowed: Sequence[str], what: str, hint: str = "") -> tuple[str, ...]:
    """An option's comma-separated names, each one of ``allowed`` (at least one);
    ``what`` names one in the error, ``hint`` ends the error's advice."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, unknown)) or f'no {what}'}: give one or more of {', '.join(allowed)}, "
            f"comma-separated{hint}"
        )
    return names


def compile_modes(text: str, hint: str = " (or --no-compile for no torch.compile column)") -> tuple[str, ...]:
    """``--compile-modes``: comma-separated torch.compile modes, each named once; ``hint``
    ends the error's advice."""
    modes = comma_separated(text, COMPILE_MODES, "mode", hint)
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"{text!r} names a mode twice; name each once")
    return modes


def _fuse_option(text: str) -> tuple[str, object]:
    """``--fuse-option NAME=VALUE``: the name, and the value read as JSON (true, 3, "x",
    [1, 2]) or else as the string it is. fuse() checks the name and the value's type."""
    import json

    name, equals, value = text.partition("=")
    if not equals or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. batch_norm_kernels=false)")
    try:
        return name.strip(), json.loads(value)
    except ValueError:
        return name.strip(), value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autofuser bench`` (declared without importing torch or the zoo)."""
    parser.add_argument(
        "factory",
        nargs="?",
        metavar="MODULE:FACTORY",
        default=None,
        help="bench your own model: a function returning (model, inputs) or (model, args, kwargs), "
        "instead of zoo models",
    )
    parser.add_argument("--models", default="all", help="comma-separated zoo model names, or 'all'")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available, else cpu)")
    parser.add_argument(
        "--dtype",
        choices=BENCH_DTYPES,
        default="fp32",
        help="fp32, or bf16 = torch.autocast(bfloat16) around every forward (with --train: forward and loss); "
        "fp32 parameters",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=100,
        help="timed calls (with --train: training steps) per system; the median and the spread (IQR) are reported",
    )
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls (with --train: steps) before timing")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md, bench.png")
    parser.add_argument(
        "--config",
        choices=ZOO_CONFIGS,
        default="airfoil",
        help="zoo model sizes: airfoil (paper configurations, 221 x 51 mesh) or tiny (CPU tests)",
    )
    parser.add_argument(
        "--compile-modes",
        "--compile-mode",
        dest="compile_modes",
        type=compile_modes,
        default=DEFAULT_COMPILE_MODES,
        metavar="MODES",
        help="torch.compile modes, comma-separated, each its own set of columns: "
        f"{', '.join(COMPILE_MODES)} (default: {','.join(DEFAULT_COMPILE_MODES)}; reduce-overhead replays "
        "Inductor's kernels as CUDA graphs, as AutoFuser replays its own; on a CPU it records no graph)",
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="skip torch.compile, every mode (it needs a C compiler on CPU)"
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="zoo models: measure a training step (zero_grad, forward in train mode, MSE loss, backward, AdamW "
        "step) instead of the eval-mode forward: step time, first step, peak memory, output and gradient errors. "
        "Not --train-steps, which pre-trains before anything is measured",
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="zoo models: pre-training, Adam steps on generated airfoils before anything is measured, so the "
        "test loss means something (0: random weights); with or without --train, which measures training steps",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="zoo models: override every model's batch size (default: the paper's, or 2 for --config tiny)",
    )
    parser.add_argument(
        "--tune-budget",
        type=float,
        default=None,
        help="AutoFuser tuning seconds per group (default: fuse()'s own)",
    )
    parser.add_argument(
        "--tune-all-configs",
        action="store_true",
        help="AutoFuser tunes every valid config, past the strategies' caps (fuse's "
        "tune_all_configs): for benchmarks/tuning_stats.py, not for timing first calls",
    )
    parser.add_argument(
        "--fuse-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=_fuse_option,
        help="an option for AutoFuser's fuse(), core or a plugin's (repeatable; VALUE as JSON, else a string): "
        "e.g. --fuse-option batch_norm_kernels=false to measure without the conv plugin's batch norm kernels",
    )
    parser.add_argument(
        "--fresh-first-calls",
        action="store_true",
        help="zoo models: also time AutoFuser's cold first call and torch.compile's first call each in a new "
        "process with empty caches (autofuser.zoo.first_call), as a user's first run of a script pays them",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="parent of the per-model AutoFuser cache folders (default: OUT/autofuser-cache); "
        "each model's folder is emptied first, unless --keep-cache",
    )
    parser.add_argument(
        "--keep-cache",
        action="store_true",
        help="use each model's AutoFuser cache folder as an earlier run left it: its 'cold' first call or "
        "step then runs on that cache (bench.md says so); for timing runs after a run that filled the caches",
    )


def _bench(args: argparse.Namespace) -> int:
    from autofuser.zoo import harness

    return harness.run_from_args(args)


def _wants_cpu(argv: list[str]) -> bool:
    """Whether ``autofuser bench`` was asked for ``--device cpu``."""
    for index, word in enumerate(argv):
        if word == "--device" and argv[index + 1 : index + 2] == ["cpu"]:
            return True
        if word == "--device=cpu":
            return True
    return False


def use_interpreter_without_gpu(argv: list[str]) -> None:
    """Turn Triton's interpreter on for a command that runs kernels where they can only run
    under it: no CUDA device, or ``bench --device cpu``. Triton reads TRITON_INTERPRET when it
    decorates a kernel, so this runs before anything imports a plugin; a value the user set
    is left alone."""
    command = argv[:1]
    if "TRITON_INTERPRET" in os.environ or command not in (["bench"], ["report"]) or "-h" in argv or "--help" in argv:
        return
    if command == ["bench"] and _wants_cpu(argv):
        os.environ["TRITON_INTERPRET"] = "1"
        return
    import torch  # imports no Triton

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def build_parser() -> argparse.ArgumentParser:
    """The ``autofuser`` command's parser; imports nothing beyond the standard library."""
    parser = argparse.ArgumentParser(
        prog="autofuser",
        description="AutoFuser: fuse PyTorch models into Triton kernels.",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser(
        "bench",
        help="benchmark zoo models, or your own MODULE:FACTORY: eager vs torch.compile vs AutoFuser",
        description=BENCH_HELP,
        formatter_class=HelpFormatter,
    )
    add_bench_arguments(bench)
    bench.set_defaults(run=_bench)
    models = commands.add_parser(
        "models", help="list the model zoo", description="List the model zoo.", formatter_class=HelpFormatter
    )
    models.add_argument("--config", choices=ZOO_CONFIGS, default="airfoil", help="which configuration's sizes")
    models.set_defaults(run=_list_models)
    report = commands.add_parser(
        "report",
        help="fuse a model and write its report as an HTML page",
        description=REPORT_HELP,
        formatter_class=HelpFormatter,
    )
    report.add_argument("factory", metavar="MODULE:FACTORY", help="function returning (model, inputs)")
    report.add_argument(
        "--out", default="autofuser-report.html", help="the HTML page to write (missing folders are made)"
    )
    report.add_argument("--json", help="also write the report as JSON here (missing folders are made)")
    report.add_argument("--plugins", help="comma-separated plugin names (default: every installed plugin)")
    report.set_defaults(run=_report)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    use_interpreter_without_gpu(argv)
    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`autofuser models | head -3`): what it read was all it wanted.
        # Point stdout at nothing so that the interpreter's own flush at exit raises no more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
