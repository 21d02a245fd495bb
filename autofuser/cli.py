"""The ``autofuser`` command.

    autofuser bench --models fno,transolver --device cuda --dtype bf16 --out bench-results/
    autofuser models [--config tiny]
    autofuser report mypackage.models:make_example --out report.html

``bench`` runs the model zoo under eager PyTorch, torch.compile and AutoFuser
(``autofuser.zoo.harness``); ``models`` lists the zoo; ``report`` fuses one
model on example inputs and writes its report as one HTML page.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional


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


def _load_factory(spec: str):
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise SystemExit(
            f"autofuser report: {spec!r} is not MODULE:FACTORY (e.g. mypackage.models:make_example "
            "or path/to/file.py:make_example)"
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise SystemExit(f"autofuser report: no file {module_name}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None:
            raise SystemExit(f"autofuser report: {module_name} can't be loaded as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[path.stem] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise SystemExit(
                f"autofuser report: can't import {module_name!r} ({err}); check the name, or pass a .py file"
            ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise SystemExit(f"autofuser report: {module_name} has no function {attribute!r}")
    return factory


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

    made = _load_factory(args.factory)()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], torch.nn.Module):
        raise SystemExit(
            f"autofuser report: {args.factory} must return (model, inputs) or (model, args, kwargs), "
            f"got {type(made).__name__}"
        )
    model, inputs, kwargs = made[0], made[1], made[2] if len(made) == 3 else {}
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
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


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="autofuser", description="AutoFuser: fuse PyTorch models into Triton kernels."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmark the model zoo: eager vs torch.compile vs AutoFuser")
    # The zoo (its models, einops, the harness) is imported only when bench runs: the
    # harness declares bench's options, and no other command needs them.
    if argv[:1] == ["bench"]:
        from autofuser.zoo import harness

        bench.description = harness.__doc__.split("\n\n")[0]
        harness.add_arguments(bench)
        bench.set_defaults(run=harness.run_from_args)
    models = commands.add_parser("models", help="list the model zoo")
    models.add_argument("--config", choices=("airfoil", "tiny"), default="airfoil")
    models.set_defaults(run=_list_models)
    report = commands.add_parser(
        "report",
        help="fuse a model and write its report as an HTML page",
        description=REPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("factory", metavar="MODULE:FACTORY", help="function returning (model, inputs)")
    report.add_argument(
        "--out", default="autofuser-report.html", help="the HTML page to write (missing folders are made)"
    )
    report.add_argument("--json", help="also write the report as JSON here (missing folders are made)")
    report.add_argument("--plugins", help="comma-separated plugin names (default: every installed plugin)")
    report.set_defaults(run=_report)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
